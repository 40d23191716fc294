"""Surgery operations: each takes trees (nested dicts of lazy arrays) and returns a new tree,
planned only; a mistake (a pattern that matches nothing, two leaves with one name, shapes that
do not fit, a dtype that cannot be cast) is a ValueError or TypeError naming the leaves, before
anything is read or written."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from milepost import workers
from milepost.surgery._lazy import LazyArray, apply, check_cast, flat, nest, with_entry


def _compile(pattern: str, what: str) -> re.Pattern[str]:
    if not isinstance(pattern, str):
        raise TypeError(f"{what}: a pattern is a regular expression string, got {pattern!r}")
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"{what}: {pattern!r} is not a regular expression ({e})") from None


def _nothing_matched(what: str, pattern: str, names: Sequence[str]) -> ValueError:
    shown = ", ".join(workers.printable(n) for n in list(names)[:8]) + (
        ", ..." if len(names) > 8 else ""
    )
    return ValueError(
        f"{what}: {pattern!r} matches no leaf (the leaves are {shown}); fix the pattern"
    )


def _matching(
    leaves: Mapping[str, Any], where: str | None, what: str, *, arrays_only: bool = True
) -> list[str]:
    names = [n for n, v in leaves.items() if isinstance(v, LazyArray) or not arrays_only]
    if where is None:
        return names
    rx = _compile(where, what)
    hits = [n for n in names if rx.search(n)]
    if not hits:
        raise _nothing_matched(what, where, names)
    return hits


def _rebuild(leaves: dict[str, Any], what: str) -> Any:
    try:
        return nest(leaves)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None


# ------------------------------------------------------------------------------------------
# Names
# ------------------------------------------------------------------------------------------


def rename(tree: Any, mapping: Mapping[str, str | None]) -> Any:
    """Rename leaves by regular expression: each leaf takes the first pattern that matches its
    name (``re.search``) and is renamed with ``re.sub`` (``\\1``... refer to groups); None drops
    it. Leaves no pattern matches keep their names.

    >>> t = rename(ck.tree, {r"^params\\.(.*)": r"model.\\1", r"^opt_state\\..*": None})
    """
    leaves = flat(tree)
    rules = [(_compile(p, "rename"), p, r) for p, r in mapping.items()]
    used = {p: 0 for _, p, _ in rules}
    out: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for name, value in leaves.items():
        for rx, pattern, repl in rules:
            if rx.search(name):
                used[pattern] += 1
                if repl is None:
                    break
                new = rx.sub(repl, name, count=1)
                if new in out:
                    raise ValueError(
                        f"rename: {origin[new]!r} and {name!r} would both be "
                        f"named {new!r}; make the names distinct"
                    )
                out[new], origin[new] = (
                    (value.renamed("rename") if isinstance(value, LazyArray) else value),
                    name,
                )
                break
        else:
            if name in out:
                raise ValueError(
                    f"rename: {origin[name]!r} would be renamed to {name!r}, which "
                    "another leaf keeps; make the names distinct"
                )
            out[name], origin[name] = value, name
    for pattern, count in used.items():
        if not count:
            raise _nothing_matched("rename", pattern, list(leaves))
    return _rebuild(out, "rename")


def drop(tree: Any, *patterns: str) -> Any:
    r"""The tree without the leaves any pattern matches (``re.search`` on the dotted path); a
    pattern that matches nothing is an error.

    >>> t = ms.drop(ck.tree, r"^opt_state\.", r"\.ema$")
    """
    leaves = flat(tree)
    doomed: set[str] = set()
    for p in patterns:
        doomed.update(_matching(leaves, p, "drop", arrays_only=False))
    return _rebuild({n: v for n, v in leaves.items() if n not in doomed}, "drop")


def select(tree: Any, *patterns: str) -> Any:
    r"""Only the leaves some pattern matches (``re.search`` on the dotted path); a pattern that
    matches nothing is an error.

    >>> params = ms.select(ck.tree, r"^params\.")
    """
    leaves = flat(tree)
    kept: set[str] = set()
    for p in patterns:
        kept.update(_matching(leaves, p, "select", arrays_only=False))
    return _rebuild(
        {
            n: (v.renamed("select") if isinstance(v, LazyArray) else v)
            for n, v in leaves.items()
            if n in kept
        },
        "select",
    )


# ------------------------------------------------------------------------------------------
# Values
# ------------------------------------------------------------------------------------------


def cast(tree: Any, dtype: Any, where: str | None = None) -> Any:
    """Every array (or those ``where`` matches) cast to ``dtype``.

    >>> t = cast(t, jnp.bfloat16, where=r"kernel$")
    """
    leaves = flat(tree)
    for name in _matching(leaves, where, "cast"):
        x = leaves[name]
        target = check_cast(x, dtype, repr(name))
        if x.dtype != target:
            leaves[name] = apply(
                "cast", lambda a, t=target: a.astype(t), (x,), sharding=x.sharding, where=repr(name)
            )
    return nest(leaves)


def map(
    fn: Callable[..., Any], *trees: Any, where: str | None = None, name: str | None = None
) -> Any:
    """``fn(a, b, ...)`` (jittable) for every array of the first tree (or those ``where``
    matches) whose name every other tree has too; the first tree's other leaves pass through.
    Shapes are checked now (``jax.eval_shape``), with the leaf named.

    >>> merged = map(lambda w, a, b: w + 0.5 * (a @ b), t, lora_a, lora_b, where=r"attn")
    """
    if not trees:
        raise TypeError("map needs at least one tree")
    leaves = flat(trees[0])
    others = [flat(t) for t in trees[1:]]
    fn_name: str = getattr(fn, "__name__", "map")
    label = name or fn_name
    label = "map" if label == "<lambda>" else label
    done = 0
    for leaf in _matching(leaves, where, "map"):
        inputs = [leaves[leaf], *(o.get(leaf) for o in others)]
        if any(not isinstance(x, LazyArray) for x in inputs):
            continue
        leaves[leaf] = apply(
            label, fn, tuple(inputs), sharding=inputs[0].sharding, where=repr(leaf)
        )
        done += 1
    if not done:
        raise ValueError(
            f"map: no array of the first tree{f' matching {where!r}' if where else ''} is in all "
            f"{len(trees)} trees; rename the other trees' leaves to the first one's names"
        )
    return nest(leaves)


def average(*trees: Any, weights: Sequence[float] | None = None, where: str | None = None) -> Any:
    """The (weighted) mean of several trees leaf by leaf, in float32, cast back to each leaf's
    dtype: a model soup, or an average of the last steps.

    >>> soup = average(ms.open(a).tree, ms.open(b).tree, ms.open(c).tree)
    """
    if len(trees) < 2:
        raise ValueError("average needs at least two trees")
    w = [1.0 / len(trees)] * len(trees) if weights is None else [float(x) for x in weights]
    if len(w) != len(trees):
        raise ValueError(f"average: {len(w)} weights for {len(trees)} trees")
    missing = [
        n
        for n in flat(trees[0])
        if isinstance(flat(trees[0])[n], LazyArray) and any(n not in flat(t) for t in trees[1:])
    ]
    if missing:
        raise ValueError(
            f"average: {missing[:5]} are not in every tree; select the common leaves first"
        )

    def mean(*xs: Any) -> Any:
        total = sum(wi * x.astype(jnp.float32) for wi, x in zip(w, xs, strict=True))
        return total.astype(xs[0].dtype)

    return map(mean, *trees, where=where, name="average")


# ------------------------------------------------------------------------------------------
# Shapes
# ------------------------------------------------------------------------------------------


def stack(tree: Any, pattern: str, out: str, axis: int = 0) -> Any:
    """Stack the leaves ``pattern`` matches into new leaves along a new ``axis``. The pattern's
    first group is the index (an integer, giving the order); the new name is ``re.sub(pattern,
    out, name)``, so ``out`` refers to the other groups.

    >>> t = stack(t, r"^model\\.layer(\\d+)\\.(.*)$", r"model.layers.\\2")
    """
    leaves = flat(tree)
    rx = _compile(pattern, "stack")
    if rx.groups < 1:
        raise ValueError(
            f"stack: {pattern!r} needs a group for the index, e.g. r'layer(\\d+)\\.(.*)'"
        )
    groups: dict[str, list[tuple[int, str]]] = {}
    for name in _matching(leaves, pattern, "stack"):
        m = rx.search(name)
        assert m is not None
        try:
            index = int(m.group(1))
        except (TypeError, ValueError):
            raise ValueError(
                f"stack: the first group of {pattern!r} must be an "
                f"integer index, got {m.group(1)!r} in {name!r}"
            ) from None
        groups.setdefault(rx.sub(out, name, count=1), []).append((index, name))
    for new, members in groups.items():
        members.sort()
        indices = [i for i, _ in members]
        if len(set(indices)) != len(indices):
            raise ValueError(f"stack into {new!r}: index repeated among {[n for _, n in members]}")
        xs = [leaves.pop(n) for _, n in members]
        kinds = {(x.shape, x.dtype) for x in xs}
        if len(kinds) > 1:
            raise ValueError(
                f"stack into {new!r}: the leaves differ in shape or dtype: "
                f"{[(n, x.shape, str(x.dtype)) for (_, n), x in zip(members, xs, strict=True)]}"
            )
        if new in leaves:
            raise ValueError(f"stack: {new!r} is already a leaf; choose another output name")
        ax = axis if axis >= 0 else axis + xs[0].ndim + 1
        leaves[new] = apply(
            "stack",
            lambda *a, ax=ax: jnp.stack(a, axis=ax),
            tuple(xs),
            sharding=with_entry(xs[0].sharding, ax, xs[0].ndim, insert=True),
            where=repr(new),
        )
    return _rebuild(leaves, "stack")


def unstack(tree: Any, pattern: str, out: str, axis: int = 0) -> Any:
    """Split each leaf ``pattern`` matches along ``axis`` into one leaf per index, named
    ``re.sub(pattern, out, name)`` with ``{i}`` replaced by the index.

    >>> t = unstack(t, r"^model\\.layers\\.(.*)$", r"model.layer{i}.\\1")
    """
    leaves = flat(tree)
    rx = _compile(pattern, "unstack")
    if "{i}" not in out:
        raise ValueError(f"unstack: the output name {out!r} needs '{{i}}' where the index goes")
    for name in _matching(leaves, pattern, "unstack"):
        x = leaves.pop(name)
        ax = axis if axis >= 0 else axis + x.ndim
        if not 0 <= ax < x.ndim:
            raise ValueError(
                f"unstack of {name!r}: axis {axis} is out of range for shape {x.shape}"
            )
        spec = with_entry(x.sharding, ax, x.ndim, insert=False)
        for i in range(x.shape[ax]):
            new = rx.sub(out, name, count=1).replace("{i}", str(i))
            if new in leaves:
                raise ValueError(
                    f"unstack of {name!r}: {new!r} is already a leaf; choose another output name"
                )
            leaves[new] = apply(
                "unstack",
                lambda a, i=i, ax=ax: jnp.take(a, i, axis=ax),
                (x,),
                sharding=spec,
                where=repr(name),
            )
    return _rebuild(leaves, "unstack")


def concat(tree: Any, names: Sequence[str], out: str, axis: int = 0) -> Any:
    """Concatenate the named leaves along ``axis`` into leaf ``out`` (fusing q, k, v).

    >>> t = concat(t, ["attn.q", "attn.k", "attn.v"], "attn.qkv", axis=1)
    """
    leaves = flat(tree)
    missing = [n for n in names if not isinstance(leaves.get(n), LazyArray)]
    if missing:
        raise ValueError(f"concat: {missing} are not arrays of the tree")
    xs = [leaves.pop(n) for n in names]
    if out in leaves:
        raise ValueError(f"concat: {out!r} is already a leaf; choose another output name")
    ax = axis if axis >= 0 else axis + xs[0].ndim
    spec = (
        xs[0].sharding
        if xs[0].sharding is not None
        and ax < len(xs[0].sharding.spec)
        and xs[0].sharding.spec[ax] is None
        else None
    )
    if spec is None and xs[0].sharding is not None and ax >= len(xs[0].sharding.spec):
        spec = xs[0].sharding
    leaves[out] = apply(
        "concat", lambda *a: jnp.concatenate(a, axis=ax), tuple(xs), sharding=spec, where=repr(out)
    )
    return _rebuild(leaves, "concat")


def split(tree: Any, name: str, parts: Mapping[str, int], axis: int = 0) -> Any:
    """Split leaf ``name`` along ``axis`` into ``{new name: size}`` parts, in order.

    >>> t = split(t, "attn.qkv", {"attn.q": 64, "attn.k": 64, "attn.v": 64}, axis=1)
    """
    leaves = flat(tree)
    x = leaves.pop(name, None)
    if not isinstance(x, LazyArray):
        raise ValueError(f"split: {name!r} is not an array of the tree")
    ax = axis if axis >= 0 else axis + x.ndim
    if sum(parts.values()) != x.shape[ax]:
        raise ValueError(
            f"split of {name!r}: the sizes {dict(parts)} add up to "
            f"{sum(parts.values())}, but axis {ax} has {x.shape[ax]}"
        )
    start = 0
    spec = (
        x.sharding
        if x.sharding is not None and (ax >= len(x.sharding.spec) or x.sharding.spec[ax] is None)
        else None
    )
    for new, size in parts.items():
        if new in leaves:
            raise ValueError(
                f"split of {name!r}: {new!r} is already a leaf; choose another output name"
            )
        leaves[new] = apply(
            "split",
            lambda a, s=start, n=size: jax.lax.slice_in_dim(a, s, s + n, axis=ax),
            (x,),
            sharding=spec,
            where=repr(name),
        )
        start += size
    return _rebuild(leaves, "split")
