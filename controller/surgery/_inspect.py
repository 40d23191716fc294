"""Looking at checkpoints without loading them anywhere whole: per-leaf statistics and diffs,
computed by the hosts group by group (only a few numbers per leaf reach the controller)."""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np

from milepost import _progress
from milepost.surgery._lazy import LazyArray, apply, flat
from milepost.surgery._placement import Placement
from milepost.surgery._run import (
    DEFAULT_BUDGET,
    compute,
    counted,
    groups,
    placement_of,
    source_of,
    sources_of,
)
from milepost.workers import ShardingSpec


@dataclass(frozen=True)
class Table:
    """Rows of named columns; prints as text, shows as an HTML table in a notebook."""

    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[Any, ...], ...]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, name: str) -> dict[str, Any]:
        """The row of leaf ``name`` as a dict."""
        for row in self.rows:
            if row[0] == name:
                return dict(zip(self.columns, row, strict=True))
        raise KeyError(name)

    def as_dicts(self) -> list[dict[str, Any]]:
        return [dict(zip(self.columns, row, strict=True)) for row in self.rows]

    @staticmethod
    def _cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.6g}"
        return str(v)

    def __str__(self) -> str:
        cells = [self.columns, *[tuple(self._cell(v) for v in row) for row in self.rows]]
        widths = [max(len(r[i]) for r in cells) for i in range(len(self.columns))]
        lines = [self.title, "  ".join(c.ljust(w) for c, w in zip(cells[0], widths, strict=True))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells[1:]]
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.columns)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(self._cell(v))}</td>" for v in row) + "</tr>"
            for row in self.rows
        )
        return f"<p><b>{html.escape(self.title)}</b></p><table><tr>{head}</tr>{body}</table>"


def _replicated(placement: Placement) -> ShardingSpec:
    return ShardingSpec.named((len(placement.device_ids),), ("all",), placement.device_ids, ())


def _run_small(kind: str, outputs: dict[str, LazyArray], budget: int) -> dict[str, np.ndarray]:
    """Compute small (replicated) outputs group by group and bring them to the controller (one
    operation ``kind`` for the progress bar and the log)."""
    if not outputs:
        return {}
    placement = placement_of(list(outputs.values()))
    specs = {n: _replicated(placement) for n in outputs}
    out: dict[str, np.ndarray] = {}
    path = next(source_of(s).checkpoint.path for x in outputs.values() for s in sources_of(x))
    with (
        _progress.operation(kind, path, primary=placement.group.is_primary()),
        counted(outputs, written=False),
    ):
        for names in groups(outputs, specs, placement, budget):
            values = compute({n: outputs[n] for n in names}, placement, specs)
            fetched = placement.fetch([values[n] for n in names])
            out.update(zip(names, fetched, strict=True))
    return out


def _summary(x: Any) -> Any:
    v = x.astype(jnp.float32) if x.dtype != jnp.float32 else x
    finite = jnp.isfinite(v)
    n = jnp.maximum(finite.sum(), 1)
    mean = jnp.where(finite, v, 0).sum() / n
    var = jnp.where(finite, (v - mean) ** 2, 0).sum() / n
    big = jnp.finfo(jnp.float32).max
    return jnp.stack(
        [
            jnp.where(finite, v, big).min(),
            jnp.where(finite, v, -big).max(),
            mean,
            jnp.sqrt(var),
            jnp.isnan(v).sum().astype(jnp.float32),
            (~finite & ~jnp.isnan(v)).sum().astype(jnp.float32),
        ]
    )


def stats(tree: Any, *, where: str | None = None, memory_budget_bytes: int | None = None) -> Table:
    """Per array: min, max, mean and std of its finite values, NaN and inf counts, and where it
    lives; computed by the hosts, a group of leaves at a time.

    >>> ms.stats(ck.tree)
    """
    import re

    leaves = {
        n: v
        for n, v in flat(tree).items()
        if isinstance(v, LazyArray) and (where is None or re.search(where, n))
    }
    if where is not None and not leaves:
        raise ValueError(f"stats: {where!r} matches no array of the tree")
    computed = _run_small(
        "stats",
        {n: apply("stats", _summary, (x,), where=repr(n)) for n, x in leaves.items() if x.size},
        memory_budget_bytes or DEFAULT_BUDGET,
    )
    rows = []
    for name, x in leaves.items():
        s = computed.get(name)
        values: tuple[Any, ...] = (
            (*tuple(float(v) for v in s[:4]), int(s[4]), int(s[5]))
            if s is not None
            else (math.nan,) * 4 + (0, 0)
        )
        where_ = x.sharding.describe() if x.sharding is not None else "spread by milepost"
        rows.append((name, str(x.shape), str(x.dtype), *values, where_))
    return Table(
        "statistics",
        ("leaf", "shape", "dtype", "min", "max", "mean", "std", "nan", "inf", "sharding"),
        tuple(rows),
    )


@dataclass(frozen=True)
class Diff:
    """What :func:`diff` found: leaves only in either tree, and per common leaf whether it is
    equal and the largest absolute difference."""

    only_a: tuple[str, ...]
    only_b: tuple[str, ...]
    table: Table

    @property
    def equal(self) -> bool:
        return not self.only_a and not self.only_b and all(r[1] for r in self.table.rows)

    @property
    def different(self) -> tuple[str, ...]:
        return tuple(r[0] for r in self.table.rows if not r[1])

    def __str__(self) -> str:
        head = f"diff: {'equal' if self.equal else 'different'}"
        extra = [f"only in a: {list(self.only_a)}"] if self.only_a else []
        extra += [f"only in b: {list(self.only_b)}"] if self.only_b else []
        return "\n".join([head, *extra, str(self.table)])

    __repr__ = __str__

    def _repr_html_(self) -> str:
        extra = "".join(
            f"<p>only in {w}: <code>{html.escape(str(list(v)))}</code></p>"
            for w, v in (("a", self.only_a), ("b", self.only_b))
            if v
        )
        return (
            f"<p><b>{'equal' if self.equal else 'different'}</b></p>"
            f"{extra}{self.table._repr_html_()}"
        )


def _compare(a: Any, b: Any) -> Any:
    same = jnp.array_equal(a, b, equal_nan=bool(jnp.issubdtype(a.dtype, jnp.inexact)))
    if jnp.issubdtype(a.dtype, jnp.inexact) or jnp.issubdtype(a.dtype, jnp.integer):
        d = jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))
        worst = jnp.where(jnp.isnan(d), 0, d).max() if a.size else jnp.float32(0)
    else:
        worst = jnp.float32(0) if a.size == 0 else (a != b).any().astype(jnp.float32)
    return jnp.stack([same.astype(jnp.float32), worst.astype(jnp.float32)])


def diff(a: Any, b: Any, *, memory_budget_bytes: int | None = None) -> Diff:
    """Compare two trees leaf by leaf: which names only one has, and for the common ones whether
    shape, dtype and every value are equal (NaNs equal to NaNs) and the largest absolute
    difference; computed by the hosts.

    >>> ms.diff(ms.open(a).tree, ms.open(b).tree)
    """
    fa, fb = flat(a), flat(b)
    only_a = tuple(n for n in fa if n not in fb)
    only_b = tuple(n for n in fb if n not in fa)
    work: dict[str, LazyArray] = {}
    rows: dict[str, tuple[Any, ...]] = {}
    for name in (n for n in fa if n in fb):
        x, y = fa[name], fb[name]
        if isinstance(x, LazyArray) and isinstance(y, LazyArray):
            if x.expr is y.expr:  # the same stored leaf (or computation): nothing to read
                rows[name] = (name, True, 0.0, "same source")
            elif x.shape != y.shape or x.dtype != y.dtype:
                rows[name] = (name, False, math.nan, f"{x.shape} {x.dtype} vs {y.shape} {y.dtype}")
            elif x.size:
                work[name] = apply("diff", _compare, (x, y), where=repr(name))
            else:
                rows[name] = (name, True, 0.0, "empty")
        elif isinstance(x, LazyArray) or isinstance(y, LazyArray):
            rows[name] = (name, False, math.nan, "an array vs a value")
        else:
            rows[name] = (name, _same(x, y), math.nan, "" if _same(x, y) else f"{x!r} vs {y!r}")
    for name, r in _run_small("diff", work, memory_budget_bytes or DEFAULT_BUDGET).items():
        rows[name] = (name, bool(r[0]), float(r[1]), "")
    ordered = tuple(rows[n] for n in fa if n in rows)
    return Diff(only_a, only_b, Table("diff", ("leaf", "equal", "max_abs_diff", "note"), ordered))


def _same(x: Any, y: Any) -> bool:
    try:
        return bool(x == y) and type(x) is type(y)
    except (TypeError, ValueError):
        return False
