"""Lazy arrays: what a surgery is planned with. Nothing here reads or moves array bytes.

A :class:`LazyArray` is an expression: a leaf of a checkpoint (:class:`Source`) or an
operation (:class:`Op`: a jittable function of other lazy arrays). Its shape and dtype are
known as soon as it is made (``jax.eval_shape``), so a wrong surgery fails at once, naming the
leaf, before any byte moves. ``sharding`` is where the result would like to live (a
:class:`~milepost.ShardingSpec` over global device ids, or None: let the engine choose).

Trees are nested dicts (and lists) of lazy arrays and plain values (strings, scalars);
operations address leaves by their paths: the keys joined by '.', as the checkpoint stores them,
a '.' or '\\' inside a key written ``\\.`` or ``\\\\`` (``milepost._tree.path_of``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from milepost import workers
from milepost._tree import path_of, path_parts
from milepost.surgery._placement import fits
from milepost.workers import ShardingSpec
from milepost.workers import format as fmt

if TYPE_CHECKING:
    from milepost.surgery._checkpoint import Checkpoint


@dataclass(frozen=True, eq=False)
class Source:
    """Leaf ``name`` (its storage name) of the checkpoint ``checkpoint``, at ``path`` in its
    tree (``milepost._tree.path_of``: the same for keys without '.')."""

    checkpoint: Checkpoint
    name: str
    path: str


@dataclass(frozen=True, eq=False)
class Op:
    """``fn(*inputs)``, jittable; ``name`` is recorded in the output's provenance."""

    name: str
    fn: Callable[..., Any]
    inputs: tuple[LazyArray, ...]
    params: Any = None
    """What the operation was given (a getitem's index), for those that look at it."""


class LazyArray:
    """An array a surgery will compute; indexing, ``astype``, ``reshape`` and ``transpose``
    make new lazy arrays, ``np.asarray`` computes it (only the chunks a plain slice of a stored
    leaf needs are read)."""

    __slots__ = ("dtype", "expr", "history", "shape", "sharding")

    def __init__(
        self,
        expr: Source | Op,
        shape: tuple[int, ...],
        dtype: Any,
        sharding: ShardingSpec | None,
        history: tuple[str, ...] = (),
    ) -> None:
        self.expr = expr
        """How it is computed: a stored leaf, or an operation on other lazy arrays."""
        self.shape: tuple[int, ...] = tuple(int(d) for d in shape)
        """The global shape."""
        self.dtype: np.dtype = np.dtype(dtype)
        """The NumPy dtype."""
        self.sharding = sharding
        """The sharding it prefers (a stored leaf's saved one, kept by the operations that keep the
        layout); None: none, and ``write`` places it (its ``shardings``, else over every device)."""
        self.history = history
        """The operations that made it, in order (shown by ``describe``)."""

    # -- description ------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        """The number of dimensions."""
        return len(self.shape)

    @property
    def size(self) -> int:
        """The number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole array once computed."""
        return self.size * self.dtype.itemsize

    def sources(self) -> Iterator[Source]:
        """Every stored leaf this array is computed from (with repeats)."""
        if isinstance(self.expr, Source):
            yield self.expr
        else:
            for x in self.expr.inputs:
                yield from x.sources()

    def describe(self) -> str:
        """How it is computed, e.g. ``cast(stack(/ckpt/1:params.layer0.w, ...))``."""
        if isinstance(self.expr, Source):
            return f"{self.expr.checkpoint.path}:{self.expr.path}"
        inner = ", ".join(x.describe() for x in self.expr.inputs[:3]) + (
            ", ..." if len(self.expr.inputs) > 3 else ""
        )
        return f"{self.expr.name}({inner})"

    def __repr__(self) -> str:
        where = f", sharding={self.sharding.describe()}" if self.sharding is not None else ""
        return workers.printable(
            f"LazyArray(shape={self.shape}, dtype={self.dtype}{where}, from={self.describe()})"
        )

    def renamed(self, history: str) -> LazyArray:
        """The same array with ``history`` appended (renames and selections keep the expression)."""
        return LazyArray(self.expr, self.shape, self.dtype, self.sharding, (*self.history, history))

    # -- making new ones --------------------------------------------------------------------
    def __getitem__(self, index: Any) -> LazyArray:
        index = index if isinstance(index, tuple) else (index,)
        for part in index:
            if not (part is None or part is Ellipsis or isinstance(part, int | slice | np.integer)):
                raise TypeError(
                    "a LazyArray takes ints, slices, None and ... as "
                    f"indices (basic indexing), got {part!r}"
                )
        return apply("getitem", lambda x: x[index], (self,), params=index)

    def astype(self, dtype: Any) -> LazyArray:
        """The array cast to ``dtype``, as ``surgery.cast`` casts (a dtype the format cannot store,
        or complex to real, is refused)."""
        target = check_cast(self, dtype, "astype")
        return apply("cast", lambda x: x.astype(target), (self,), sharding=self.sharding)

    def reshape(self, *shape: Any) -> LazyArray:
        """The array reshaped (as ``numpy.reshape``); it prefers no sharding."""
        new = (
            tuple(shape[0])
            if len(shape) == 1 and isinstance(shape[0], tuple | list)
            else tuple(shape)
        )
        return apply("reshape", lambda x: x.reshape(new), (self,))

    def transpose(self, *axes: Any) -> LazyArray:
        """The array with its axes permuted (reversed when none are given)."""
        order = (
            tuple(axes[0])
            if len(axes) == 1 and isinstance(axes[0], tuple | list)
            else tuple(axes) or tuple(reversed(range(self.ndim)))
        )
        spec = _permuted(self.sharding, order, self.ndim)
        return apply("transpose", lambda x: x.transpose(order), (self,), sharding=spec)

    @property
    def T(self) -> LazyArray:
        """The array with its axes reversed."""
        return self.transpose()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if _reader is None:
            raise RuntimeError("import milepost.surgery to read the values of a LazyArray")
        out = _reader(self)
        return out.astype(dtype) if dtype is not None else out


_reader: Callable[[LazyArray], np.ndarray] | None = None
"""Reads a lazy array's values (``np.asarray(x)``): the engine (:mod:`._run`) sets it when it is
imported, so that this module, which the engine builds on, does not import it back."""


def set_reader(reader: Callable[[LazyArray], np.ndarray]) -> None:
    global _reader
    _reader = reader


def check_cast(x: LazyArray, dtype: Any, where: str) -> np.dtype:
    try:
        target = np.dtype(jnp.dtype(dtype))
    except TypeError:
        raise TypeError(f"cast of {where}: {dtype!r} is not a dtype") from None
    if target.name not in fmt.ZARR3_DTYPES:
        raise TypeError(
            f"cast of {where}: {target} cannot be stored (the format stores "
            f"{', '.join(sorted(fmt.ZARR3_DTYPES))})"
        )
    if x.dtype.kind == "c" and target.kind != "c":
        raise TypeError(
            f"cast of {where}: {x.dtype} to {target} would drop the "
            "imaginary part; take .real in ms.map first"
        )
    return target


def apply(
    name: str,
    fn: Callable[..., Any],
    inputs: tuple[LazyArray, ...],
    *,
    sharding: ShardingSpec | None = None,
    where: str = "",
    params: Any = None,
) -> LazyArray:
    """``fn(*inputs)`` as a lazy array; its shape and dtype from ``jax.eval_shape`` (an error
    names ``where`` and the inputs)."""
    try:
        out = jax.eval_shape(fn, *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in inputs))
    except Exception as e:
        shapes = ", ".join(f"{x.shape} {x.dtype}" for x in inputs)
        raise ValueError(
            f"{name}{f' of {where}' if where else ''} fails on inputs of shapes {shapes}: {e}"
        ) from None
    if not isinstance(out, jax.ShapeDtypeStruct):
        raise TypeError(
            f"{name}{f' of {where}' if where else ''} must "
            f"return one array, got {type(out).__name__}"
        )
    history = (*tuple(dict.fromkeys(h for x in inputs for h in x.history)), name)
    return LazyArray(
        Op(name, fn, inputs, params),
        out.shape,
        out.dtype,
        sharding if fits(sharding, out.shape) else None,
        history,
    )


def _permuted(spec: ShardingSpec | None, order: tuple[int, ...], ndim: int) -> ShardingSpec | None:
    if spec is None or spec.kind != "named":
        return spec
    entries = tuple(spec.spec) + (None,) * (ndim - len(spec.spec))
    return ShardingSpec.named(
        spec.mesh_shape, spec.axis_names, spec.device_ids, tuple(entries[i] for i in order)
    )


def with_entry(
    spec: ShardingSpec | None, axis: int, ndim: int, *, insert: bool
) -> ShardingSpec | None:
    """``spec`` with a replicated dimension inserted at ``axis`` (``insert``) or removed."""
    if spec is None or spec.kind != "named":
        return None
    entries = list(tuple(spec.spec) + (None,) * (ndim - len(spec.spec)))
    if insert:
        entries.insert(axis, None)
    else:
        if entries[axis] is not None:
            return None
        del entries[axis]
    return ShardingSpec.named(spec.mesh_shape, spec.axis_names, spec.device_ids, tuple(entries))


# ------------------------------------------------------------------------------------------
# Trees by leaf name
# ------------------------------------------------------------------------------------------


def flat(tree: Any) -> dict[str, Any]:
    r"""``{'a.b.0': leaf}``: every leaf of nested dicts/lists/tuples by its path (keys joined by
    '.', a '.' or '\' inside a key escaped: ``{"a.b": x}`` -> ``a\.b``); empty containers are
    leaves."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            items: Any = node.items()
        elif isinstance(node, list | tuple) and node and not hasattr(node, "_fields"):
            items = enumerate(node)
        else:
            if not prefix:
                raise TypeError(
                    "a surgery works on trees (dicts and lists "
                    f"of arrays), got {type(node).__name__}"
                )
            out[prefix] = node
            return
        for key, child in items:
            key = str(key)
            if not key:
                raise ValueError(
                    f"an empty key under {prefix or 'the root'!r}: an empty key cannot name a "
                    "stored leaf; rename it"
                )
            part = path_of((key,))
            walk(child, f"{prefix}.{part}" if prefix else part)

    walk(tree, "")
    return out


def nest(leaves: dict[str, Any]) -> dict[str, Any]:
    """The nested tree of ``{'a.b.0': leaf}`` (leaf paths, as :func:`flat` names them); a node
    whose keys are 0..n-1 becomes a list."""
    root: dict[str, Any] = {}
    for name, value in leaves.items():
        parts = path_parts(name)
        node = root
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"leaf {name!r} would be inside leaf {part!r}; rename one of them")
            node = child
        if parts[-1] in node:
            raise ValueError(f"two leaves would be named {name!r}")
        node[parts[-1]] = value
    return _listify(root)


def _listify(node: Any) -> Any:
    if not isinstance(node, dict) or not node:
        return node
    node = {k: _listify(v) for k, v in node.items()}
    if all(k.isdigit() for k in node) and sorted(int(k) for k in node) == list(range(len(node))):
        return [node[str(i)] for i in range(len(node))]
    return node


def arrays(tree: Any) -> dict[str, LazyArray]:
    return {k: v for k, v in flat(tree).items() if isinstance(v, LazyArray)}
