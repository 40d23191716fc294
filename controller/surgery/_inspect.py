"""Looking at checkpoints without loading them anywhere whole: per-leaf statistics and diffs,
computed by the hosts group by group (only a few numbers per leaf reach the controller)."""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np

from milepost import _progress, workers
from milepost._tree import storage_name_of
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
    """What the table shows (``statistics``, ``diff``)."""
    columns: tuple[str, ...]
    """The columns' names; the first is the leaf's."""
    rows: tuple[tuple[Any, ...], ...]
    """One tuple per leaf, in the columns' order."""

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, name: str) -> dict[str, Any]:
        """The row of leaf ``name`` as a dict."""
        for row in self.rows:
            if row[0] == name:
                return dict(zip(self.columns, row, strict=True))
        raise KeyError(name)

    def as_dicts(self) -> list[dict[str, Any]]:
        """Each row as a dict by column name (e.g. for ``pandas.DataFrame``)."""
        return [dict(zip(self.columns, row, strict=True)) for row in self.rows]

    @staticmethod
    def _cell(v: Any) -> str:
        """A cell as text: floats to 6 significant digits, names escaped (``workers.printable``)."""
        if isinstance(v, float):
            return f"{v:.6g}"
        return workers.printable(v)

    def __str__(self) -> str:
        cells = [self.columns, *[tuple(self._cell(v) for v in row) for row in self.rows]]
        widths = [max(len(r[i]) for r in cells) for i in range(len(self.columns))]
        lines = [self.title, "  ".join(c.ljust(w) for c, w in zip(cells[0], widths, strict=True))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells[1:]]
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{workers.html_text(c)}</th>" for c in self.columns)
        body = "".join(
            "<tr>" + "".join(f"<td>{workers.html_text(self._cell(v))}</td>" for v in row) + "</tr>"
            for row in self.rows
        )
        return f"<p><b>{workers.html_text(self.title)}</b></p><table><tr>{head}</tr>{body}</table>"


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


def chosen(
    names: Sequence[str],
    where: str | None,
    leaves: Sequence[str] | None,
    what: str,
    kind: str = "leaf",
) -> list[str]:
    r"""The names (leaf paths) ``where`` matches (``re.search``) or ``leaves`` names, in their
    order; all of them when both are None. Each of ``leaves`` is a leaf's path (as tables show
    it: ``params.a\.b`` for the key ``a.b``) or its storage name (the keys joined by '.',
    ``params.a.b``, which a checkpoint's leaves never share); one that names no leaf, or
    ``where`` matching none, is a ValueError."""
    if where is None and leaves is None:
        return list(names)
    hits: set[str] = set()
    if where is not None:
        try:
            rx = re.compile(where)
        except re.error as e:
            raise ValueError(f"{what}: {where!r} is not a regular expression ({e})") from None
        hits.update(n for n in names if rx.search(n))
        if not hits:
            raise ValueError(f"{what}: {where!r} matches no {kind} of the tree")
    if isinstance(leaves, str):
        raise TypeError(f"{what}: leaves is a list of leaf names, got the string {leaves!r}")
    known = set(names)
    plural = "leaves" if kind == "leaf" else f"{kind}s"
    by_storage: dict[str, list[str]] = {}
    for n in names:
        by_storage.setdefault(storage_name_of(n), []).append(n)
    for name in leaves or ():
        found = [name] if name in known else by_storage.get(name, [])
        if not found:
            shown = ", ".join(workers.printable(n) for n in names[:8])
            raise ValueError(
                f"{what}: no {kind} is named {name!r} (the {plural} are {shown}"
                f"{', ...' if len(names) > 8 else ''}); give a path as the tables show it, or "
                "a storage name"
            )
        if len(found) > 1:
            shown = ", ".join(workers.printable(n) for n in found)
            raise ValueError(f"{what}: {name!r} is the storage name of {shown}; give one's path")
        hits.add(found[0])
    return [n for n in names if n in hits]


def stats(
    tree: Any,
    *,
    where: str | None = None,
    leaves: Sequence[str] | None = None,
    memory_budget_bytes: int | None = None,
) -> Table:
    r"""Per array: min, max, mean and std of its finite values, NaN and inf counts, and where it
    lives; computed by the hosts, a group of leaves at a time. ``where`` (a regular expression
    on each leaf's path) and ``leaves`` (paths, or storage names) choose the arrays: those
    either picks; default all. A name in ``leaves`` that names no array is a ValueError.

    >>> ms.stats(ck.tree)
    >>> ms.stats(ck.tree, leaves=[r"params.a\.b"])   # the key "a.b" under params
    """
    arrays = {n: v for n, v in flat(tree).items() if isinstance(v, LazyArray)}
    picked = chosen(list(arrays), where, leaves, "stats", "array")
    leaves_ = {n: arrays[n] for n in picked}
    computed = _run_small(
        "stats",
        {n: apply("stats", _summary, (x,), where=repr(n)) for n, x in leaves_.items() if x.size},
        memory_budget_bytes or DEFAULT_BUDGET,
    )
    rows = []
    for name, x in leaves_.items():
        s = computed.get(name)
        values: tuple[Any, ...] = (
            (*tuple(float(v) for v in s[:4]), int(s[4]), int(s[5]))
            if s is not None
            else (math.nan,) * 4 + (0, 0)
        )
        where_ = workers.sharding_str(x.sharding)
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
    """Leaves only in the first tree."""
    only_b: tuple[str, ...]
    """Leaves only in the second tree."""
    table: Table
    """Per common leaf: whether it is equal, and the largest absolute difference."""

    @property
    def equal(self) -> bool:
        """True when the trees have the same leaves and every one is equal."""
        return not self.only_a and not self.only_b and all(r[1] for r in self.table.rows)

    @property
    def different(self) -> tuple[str, ...]:
        """The common leaves that are not equal."""
        return tuple(r[0] for r in self.table.rows if not r[1])

    def __str__(self) -> str:
        head = f"diff: {'equal' if self.equal else 'different'}"
        extra = [
            f"only in {w}: {', '.join(workers.printable(n) for n in names)}"
            for w, names in (("a", self.only_a), ("b", self.only_b))
            if names
        ]
        return "\n".join([head, *extra, str(self.table)])

    __repr__ = __str__

    def _repr_html_(self) -> str:
        extra = "".join(
            f"<p>only in {w}: <code>{workers.html_text(', '.join(v))}</code></p>"
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


def diff(
    a: Any,
    b: Any,
    *,
    where: str | None = None,
    leaves: Sequence[str] | None = None,
    memory_budget_bytes: int | None = None,
) -> Diff:
    """Compare two trees leaf by leaf: which names only one has, and for the common ones whether
    shape, dtype and every value are equal (NaNs equal to NaNs) and the largest absolute
    difference; computed by the hosts. ``where`` and ``leaves`` compare only the leaves they
    choose (as :func:`stats`'s, among the names of either tree).

    >>> ms.diff(ms.open(a).tree, ms.open(b).tree)
    """
    fa, fb = flat(a), flat(b)
    if where is not None or leaves is not None:
        keep = set(chosen(list({**fa, **fb}), where, leaves, "diff"))
        fa = {n: v for n, v in fa.items() if n in keep}
        fb = {n: v for n, v in fb.items() if n in keep}
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
            same = _same(x, y)
            rows[name] = (name, same, _value_gap(x, y, same), "" if same else f"{x!r} vs {y!r}")
    for name, r in _run_small("diff", work, memory_budget_bytes or DEFAULT_BUDGET).items():
        rows[name] = (name, bool(r[0]), float(r[1]), "")
    ordered = tuple(rows[n] for n in fa if n in rows)
    return Diff(only_a, only_b, Table("diff", ("leaf", "equal", "max_abs_diff", "note"), ordered))


def _value_gap(x: Any, y: Any, same: bool) -> float:
    """The max_abs_diff of two values that are not arrays: 0 when equal, ``|x - y|`` for two
    numbers, NaN (no such figure) otherwise."""
    if same:
        return 0.0
    numbers = (int, float, np.integer, np.floating)
    if all(isinstance(v, numbers) and not isinstance(v, bool | np.bool_) for v in (x, y)):
        with contextlib.suppress(OverflowError):
            return abs(float(x) - float(y))
    return math.nan


def _same(x: Any, y: Any) -> bool:
    try:
        return bool(x == y) and type(x) is type(y)
    except (TypeError, ValueError):
        return False
