"""How values show themselves in text and HTML: bytes, shapes, shardings, tables. Small and
free of dependencies; the slice handles (``milepost.colocated``) and the controller's views
(tables of checkpoints, steps and reports) share them."""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

MAX_HTML_ROWS = 500


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
    """A ShardingSpec as ``P('data', 'model') on {data: 2, model: 4}`` (or ``device 3``)."""
    if spec is None:
        return ""
    memory = f" [{spec.memory_kind}]" if getattr(spec, "memory_kind", None) else ""
    if spec.kind == "single":
        return f"device {spec.device_ids[0]}{memory}"
    entries = ", ".join(
        "None"
        if e is None
        else repr(e)
        if isinstance(e, str)
        else "(" + ", ".join(map(repr, e)) + ")"
        for e in spec.spec
    )
    mesh = ", ".join(f"{a}: {n}" for a, n in zip(spec.axis_names, spec.mesh_shape, strict=True))
    return f"P({entries}) on {{{mesh}}}{memory}"


def html_table(
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    title: str | None = None,
    max_rows: int = MAX_HTML_ROWS,
) -> str:
    head = "".join(f"<th style='text-align:left'>{html.escape(c)}</th>" for c in columns)
    body = "".join(
        "<tr>"
        + "".join(f"<td style='text-align:left'>{html.escape(str(v))}</td>" for v in row)
        + "</tr>"
        for row in rows[:max_rows]
    )
    more = f"<p>... and {len(rows) - max_rows} more rows</p>" if len(rows) > max_rows else ""
    caption = f"<b>{html.escape(title)}</b>" if title else ""
    return (
        f"<div>{caption}<table><thead><tr>{head}</tr></thead>"
        f"<tbody>{body}</tbody></table>{more}</div>"
    )


def html_fields(title: str, fields: Mapping[str, Any]) -> str:
    """A two-column table of named facts."""
    rows = "".join(
        f"<tr><th style='text-align:left'>{html.escape(k)}</th>"
        f"<td style='text-align:left'>{html.escape(str(v))}</td></tr>"
        for k, v in fields.items()
    )
    return f"<div><b>{html.escape(title)}</b><table>{rows}</table></div>"
