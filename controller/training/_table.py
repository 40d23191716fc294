"""A Checkpointer's steps as a table: its ``repr`` (text) and its notebook view (HTML)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from milepost import _views

if TYPE_CHECKING:
    from milepost.training._checkpointer import Checkpointer

Table = tuple[str, tuple[str, ...], list[tuple[Any, ...]]]
"""A title, the columns' names and the rows."""


def table(ckpt: Checkpointer, rows: list[dict[str, Any]], closed: bool) -> Table:
    """``rows`` (``StepState.rows``) with a column per metric, under a title saying how
    ``ckpt`` was opened and where it stands."""
    names = sorted({k for r in rows for k in r["metrics"]})
    columns = ("step", "tier", "state", *names)
    cells = [
        (
            r["step"],
            r["tier"],
            r["state"],
            *(_views.metric_cell(r["metrics"].get(k)) for k in names),
        )
        for r in rows
    ]
    where = repr(str(ckpt.root)) + (
        f", local={str(ckpt.local)!r}" if ckpt.local is not None else ""
    )
    mode = ", read_only=True" if ckpt.read_only else ""
    title = (
        f"Checkpointer({where}{mode}): {len(rows)} step{'' if len(rows) == 1 else 's'}, "
        f"latest {ckpt.latest}; save_policy={ckpt.save_policy!r}, keep={ckpt.keep!r}"
        + (f", local_keep={ckpt.local_keep!r}" if ckpt.local is not None else "")
        + (", preempted" if ckpt.preempted else "")
        + (", closed" if closed else "")
    )
    return title, columns, cells


def text(title: str, columns: tuple[str, ...], rows: list[tuple[Any, ...]]) -> str:
    """The table as text: the title, then the last ``_views.MAX_ROWS`` rows."""
    if not rows:
        return f"{title}"
    shown = rows[-_views.MAX_ROWS :]
    out = title + ("" if len(shown) == len(rows) else f" (the last {len(shown)} shown)")
    return out + "\n" + _views.text_table(columns, shown)
