"""How values show themselves in text and HTML: names, bytes, shapes, shardings, tables. Small
and free of dependencies; the slice handles (``milepost.colocated``), the controller's views
(tables of checkpoints, steps and reports), the command, reprs and milepost's log lines share
them.

Names, metric keys and values, paths and messages come from files and peers that may be
hostile: each is shown through :func:`printable`, which writes every character a terminal or a
renderer could act on, or that hides or reorders text, as a visible escape (``\\x1b``,
``\\u202e``). milepost's loggers escape their records the same way (:class:`PrintableLogs`).
"""

from __future__ import annotations

import html
import logging
import numbers
import re
from collections.abc import Mapping, Sequence
from typing import Any

MAX_HTML_ROWS = 500

# ------------------------------------------------------------------------------------------
# Names as they may be shown
# ------------------------------------------------------------------------------------------


_SHORT = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}
"""The escapes ``repr`` writes for these; any other character is ``\\x``, ``\\u`` or ``\\U``."""


def _escape(char: str) -> str:
    code = ord(char)
    if char in _SHORT:
        return _SHORT[char]
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(text: Any, *, newlines: bool = False) -> str:
    r"""``text`` (or ``str(text)``) safe to show on a terminal, in a notebook or a log line: each
    character Python's ``repr`` escapes is written as that escape (``\x1b``, ``\u202e``,
    ``\U000e0041``); everything else, accents and CJK included, is kept. ``newlines``: keep
    ``\n`` (text of several lines, each escaped).

    The characters escaped are those ``str.isprintable`` refuses: controls (C0 including tab and
    newline, DEL, C1: what a terminal acts on), format characters (bidirectional embeddings,
    overrides and isolates, LRM/RLM/ALM, zero-width spaces and joiners, soft hyphen, BOM, tag
    characters: what reorders or hides text), lone surrogates (undecodable file names, which
    cannot even be written as UTF-8), private-use and unassigned code points (their glyphs are
    up to the font, or not known yet), line and paragraph separators, and every space but
    U+0020 (a name that seems to hold a space holds one). A backslash is kept as it is: a
    leaf's path already writes its own as ``\\`` (``milepost._tree.path_of``).

    >>> printable("\x1b[2Jok\u202e")
    '\\x1b[2Jok\\u202e'
    """
    text = text if isinstance(text, str) else str(text)
    if text.isprintable():
        return text
    if newlines:
        return "\n".join(printable(line) for line in text.split("\n"))
    return "".join(c if c.isprintable() else _escape(c) for c in text)


_ESCAPES = re.compile(r"\\(\\|[ntr]|x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8})")
_UNSHORT = {"n": "\n", "t": "\t", "r": "\r"}


def from_printable(text: str) -> str:
    r"""What :func:`printable` showed, back: ``\n``, ``\t``, ``\r``, ``\xNN``, ``\uNNNN`` and
    ``\UNNNNNNNN`` become their characters; ``\\`` (a path's escaped backslash) and anything
    else stay as they are. The command reads names given as it printed them (``--leaf``,
    ``--item``) through this."""

    def one(m: re.Match[str]) -> str:
        code = m.group(1)
        if code in _UNSHORT:
            return _UNSHORT[code]
        value = -1 if code == "\\" else int(code[1:], 16)
        return chr(value) if 0 <= value <= 0x10FFFF else m.group(0)

    return _ESCAPES.sub(one, text)


class _Shown:
    """A log argument shown through :func:`printable` (``%s``, ``%r`` and format specs)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __str__(self) -> str:
        return printable(str(self.value))

    def __repr__(self) -> str:
        return printable(repr(self.value))

    def __format__(self, spec: str) -> str:
        return printable(format(self.value, spec))


def _shown(arg: Any) -> Any:
    return arg if arg is None or isinstance(arg, numbers.Number | _Shown) else _Shown(arg)


class PrintableLogs(logging.Filter):
    """Escapes a log record's message and arguments through :func:`printable` (numbers are left
    as they are, for ``%d``); the template and the arguments stay apart (handlers that group
    records by template still can), and a traceback attached to the record is escaped line by
    line. On each of milepost's loggers (:data:`LOGGERS`), so names read from files reach no
    handler raw."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = printable(record.msg) if isinstance(record.msg, str) else _Shown(record.msg)
        if isinstance(record.args, Mapping):
            record.args = {k: _shown(v) for k, v in record.args.items()}
        elif record.args:
            record.args = tuple(_shown(a) for a in record.args)
        if record.exc_info and not record.exc_text:
            text = logging.Formatter().formatException(record.exc_info)
            record.exc_text = printable(text, newlines=True)
        return True


LOGGERS = (
    "milepost",
    "milepost.training",
    "milepost.surgery",
    "milepost.peers",
    "milepost.slice",
    "milepost._storage._workspace",
)
"""Every logger milepost logs on (tests/test_hostile_names.py checks that none is missing)."""

_FILTER = PrintableLogs()
for _name in LOGGERS:
    logging.getLogger(_name).addFilter(_FILTER)

# ------------------------------------------------------------------------------------------
# Sizes, shapes, shardings, tables
# ------------------------------------------------------------------------------------------


def human_bytes(n: float | None) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    if n is None:
        return ""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def shape_str(shape: Sequence[int] | None) -> str:
    return (
        ""
        if shape is None
        else "(" + ", ".join(str(int(n)) for n in shape) + ("," if len(shape) == 1 else "") + ")"
    )


def sharding_str(spec: Any) -> str:
    """A ShardingSpec as ``P('data', 'model') on {data: 2, model: 4}`` (or ``device 3``): its
    ``describe()``, escaped (``printable``)."""
    return "" if spec is None else printable(spec.describe())


def html_text(value: Any) -> str:
    """``value`` as HTML text: :func:`printable`, then ``html.escape`` (quotes too)."""
    return html.escape(printable(value))


def html_table(
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    title: str | None = None,
    max_rows: int = MAX_HTML_ROWS,
) -> str:
    head = "".join(f"<th style='text-align:left'>{html_text(c)}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td style='text-align:left'>{html_text(v)}</td>" for v in row) + "</tr>"
        for row in rows[:max_rows]
    )
    more = f"<p>... and {len(rows) - max_rows} more rows</p>" if len(rows) > max_rows else ""
    caption = f"<b>{html_text(title)}</b>" if title else ""
    return (
        f"<div>{caption}<table><thead><tr>{head}</tr></thead>"
        f"<tbody>{body}</tbody></table>{more}</div>"
    )


def html_fields(title: str, fields: Mapping[str, Any]) -> str:
    """A two-column table of named facts."""
    rows = "".join(
        f"<tr><th style='text-align:left'>{html_text(k)}</th>"
        f"<td style='text-align:left'>{html_text(v)}</td></tr>"
        for k, v in fields.items()
    )
    return f"<div><b>{html_text(title)}</b><table>{rows}</table></div>"
