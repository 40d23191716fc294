"""How milepost's objects show themselves: text tables for ``repr`` and the terminal, HTML
tables for notebooks, plain records for ``--json``. One place, so that ``repr(meta)``,
``meta._repr_html_()`` and ``milepost inspect`` agree.

Every cell, column and title goes through ``workers.printable`` (control and bidirectional
characters as visible escapes) and reaches ``rich`` as a ``Text``, never as markup; leaves are
named by their path (``_tree.path_of``: ``params.a\\.b`` for the key ``a.b``), the name
``milepost stats --leaf`` and surgery take.
"""

from __future__ import annotations

import datetime
import io
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from milepost._tree import path_of
from milepost.workers import (
    MAX_HTML_ROWS,
    html_fields,
    html_table,
    human_bytes,
    printable,
    shape_str,
    sharding_str,
)

__all__ = [
    "MAX_HTML_ROWS",
    "html_fields",
    "html_table",
    "human_bytes",
    "printable",
    "shape_str",
    "sharding_str",
]

MAX_ROWS = 40
"""Rows a ``repr`` shows before it says how many more there are."""


def timestamp_str(nsecs: int | None) -> str:
    if not isinstance(nsecs, int) or nsecs <= 0:
        return ""
    when = datetime.datetime.fromtimestamp(nsecs / 1e9, datetime.UTC).astimezone()
    return when.isoformat(sep=" ", timespec="seconds")


def metric_cell(value: Any) -> str:
    """A step's metric as a table cell: blank if absent, floats to 6 significant digits."""
    if value is None:
        return ""
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def short_json(value: Any, limit: int = 120) -> str:
    text = json.dumps(value, default=str, sort_keys=True)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ------------------------------------------------------------------------------------------
# Leaves of a checkpoint's tree
# ------------------------------------------------------------------------------------------

LEAF_COLUMNS = ("path", "type", "shape", "dtype", "sharding", "write shape", "chunk shape", "bytes")


def flat_leaves(tree: Any) -> list[Any]:
    """The LeafMetadata of a metadata tree, in tree order (empty containers are left out)."""
    return [leaf for _, leaf in leaf_paths(tree)]


def leaf_paths(tree: Any) -> list[tuple[str, Any]]:
    """(path, LeafMetadata) of every leaf of a metadata tree, in tree order: the path is the
    leaf's keys as ``_tree.path_of`` joins them (its storage name, unless a key holds '.')."""
    out: list[tuple[str, Any]] = []

    def walk(node: Any, keys: tuple[str, ...]) -> None:
        if isinstance(node, Mapping):
            for k, v in node.items():
                walk(v, (*keys, str(k)))
        elif isinstance(node, list | tuple):
            for i, v in enumerate(node):
                walk(v, (*keys, str(i)))
        elif hasattr(node, "value_type") and hasattr(node, "name"):
            # (a tree whose keys are not the stored name's parts keeps the stored name)
            out.append((path_of(keys) if ".".join(keys) == node.name else node.name, node))

    walk(tree, ())
    return out


def leaf_record(leaf: Any, path: str | None = None) -> dict[str, Any]:
    """One leaf as plain JSON values (``path``: as :func:`leaf_paths` names it; default its
    name)."""
    return {
        "path": leaf.name if path is None else path,
        "type": str(leaf.value_type),
        "shape": list(leaf.shape) if leaf.shape is not None else None,
        "dtype": str(leaf.dtype) if leaf.dtype is not None else None,
        "sharding": sharding_str(leaf.sharding) or None,
        "write_shape": list(leaf.write_shape) if leaf.write_shape is not None else None,
        "chunk_shape": list(leaf.chunk_shape) if leaf.chunk_shape is not None else None,
        "bytes": leaf.nbytes,
    }


def leaf_row(leaf: Any, path: str | None = None) -> tuple[str, ...]:
    """One leaf as table cells (``path``: as :func:`leaf_paths` names it; default its name)."""
    return (
        leaf.name if path is None else path,
        str(leaf.value_type),
        shape_str(leaf.shape),
        str(leaf.dtype) if leaf.dtype is not None else "",
        sharding_str(leaf.sharding),
        shape_str(leaf.write_shape),
        shape_str(leaf.chunk_shape),
        human_bytes(leaf.nbytes),
    )


def totals(leaves: Sequence[Any]) -> tuple[int, int, int]:
    """(leaves, arrays, bytes of the arrays)."""
    arrays = [leaf for leaf in leaves if leaf.nbytes is not None]
    return len(leaves), len(arrays), sum(leaf.nbytes for leaf in arrays)


# ------------------------------------------------------------------------------------------
# Tables
# ------------------------------------------------------------------------------------------


def rich_table(
    columns: Sequence[str],
    rows: Iterable[Sequence[Any]],
    *,
    title: str | None = None,
    right: Sequence[str] = ("bytes",),
) -> Any:
    """A ``rich`` Table (for the terminal): every cell, column and the title escaped
    (``printable``) and given as ``Text``, so nothing in them is read as markup or emoji."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(
        title=None if title is None else Text(printable(title)),
        box=box.SIMPLE_HEAD,
        show_edge=False,
        title_justify="left",
        pad_edge=False,
    )
    for c in columns:
        table.add_column(
            Text(printable(c)), justify="right" if c in right else "left", overflow="fold"
        )
    for row in rows:
        table.add_row(*(Text(printable(v)) for v in row))
    return table


def render_text(*renderables: Any, width: int = 160) -> str:
    """Render ``rich`` renderables (or strings: escaped, no markup) as plain text, no colours."""
    from rich.console import Console

    out = io.StringIO()
    console = Console(
        file=out,
        width=width,
        color_system=None,
        force_terminal=False,
        force_jupyter=False,
        soft_wrap=False,
        emoji=False,
    )
    for r in renderables:
        if isinstance(r, str):
            console.print(printable(r, newlines=True), highlight=False, markup=False)
        else:
            console.print(r)
    return "\n".join(line.rstrip() for line in out.getvalue().rstrip().splitlines())


def text_table(
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    title: str | None = None,
    max_rows: int = MAX_ROWS,
) -> str:
    shown = list(rows[:max_rows])
    text = render_text(rich_table(columns, shown, title=title))
    if len(rows) > max_rows:
        text += f"\n... and {len(rows) - max_rows} more rows"
    return text
