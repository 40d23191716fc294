"""Shared helpers for the embedded-mode tests: exact tree equality, sharded puts, listings."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def _is_leaf(x: Any) -> bool:
    return x is None or x is ... or (isinstance(x, dict | list | tuple) and len(x) == 0)


def same_bits(a: Any, b: Any) -> bool:
    """Exact equality of two arrays: same dtype, same shape, same bytes (NaN == NaN, -0 != +0)."""
    x, y = np.asarray(a), np.asarray(b)
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    if x.dtype.itemsize == 0 or x.size == 0:
        return True
    width = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}.get(x.dtype.itemsize)
    if width is None or x.dtype.kind == "c":
        return x.tobytes() == y.tobytes()
    return bool(
        np.array_equal(np.ascontiguousarray(x).view(width), np.ascontiguousarray(y).view(width))
    )


def assert_tree_equal(got: Any, want: Any, *, check_sharding: bool = True) -> None:
    """Same structure, same leaf types, bit-identical values, equivalent shardings."""
    lg, tg = jax.tree_util.tree_flatten_with_path(got, is_leaf=_is_leaf)
    lw, tw = jax.tree_util.tree_flatten_with_path(want, is_leaf=_is_leaf)
    assert tg == tw, f"structures differ:\n got  {tg}\n want {tw}"
    for (path, g), (_, w) in zip(lg, lw, strict=True):
        where = jax.tree_util.keystr(path)
        if isinstance(w, jax.Array):
            assert isinstance(g, jax.Array), f"{where}: got {type(g).__name__}, want jax.Array"
            assert same_bits(g, w), f"{where}: values differ\n got  {g}\n want {w}"
            if check_sharding:
                assert g.sharding.is_equivalent_to(w.sharding, w.ndim), (
                    f"{where}: {g.sharding} vs {w.sharding}"
                )
        elif isinstance(w, np.ndarray | np.generic):
            assert type(g) is type(w), f"{where}: got {type(g).__name__}, want {type(w).__name__}"
            assert same_bits(g, w), f"{where}: values differ: {g!r} vs {w!r}"
        else:
            assert type(g) is type(w), (
                f"{where}: got {type(g).__name__} {g!r}, want {type(w).__name__} {w!r}"
            )
            assert g == w or (g is w), f"{where}: {g!r} != {w!r}"


def put(x: Any, mesh: jax.sharding.Mesh, spec: P) -> jax.Array:
    return jax.device_put(np.asarray(x), NamedSharding(mesh, spec))


def abstract_of(tree: Any) -> Any:
    """The abstract tree of ``tree``: ShapeDtypeStructs (with sharding) for jax.Arrays, the
    leaves themselves otherwise."""
    return jax.tree_util.tree_map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            if isinstance(x, jax.Array)
            else x
        ),
        tree,
    )


def listing(root: Path) -> list[str]:
    """Every path below ``root`` (relative), sorted: to show that nothing was written."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def reseal(ckpt: Path) -> None:
    """Recompute a checkpoint's file checksums after a test edited its metadata on purpose: what
    an attacker who crafts a checkpoint can do, so the checks behind the checksums get tested."""
    from milepost.workers import format as _format

    (ckpt / _format.CHECKSUMS).unlink()
    _format.Checksums.compute(ckpt).write()


def without_compact_shardings(ckpt: Path) -> Path:
    """Leave out milepost's compact shardings (``"shardings"`` in each tree's
    ``_milepost.json``) and reseal: the checkpoint's shardings are then read from ``_sharding``,
    as for one written by Orbax or an older milepost."""
    import json

    for info in ckpt.glob("*/_milepost.json"):
        data = json.loads(info.read_text())
        data.pop("shardings", None)
        info.write_text(json.dumps(data))
    reseal(ckpt)
    return ckpt


class MergeGate:
    """Holds saves at their background part (the OCDBT merge): ``entered`` is set when a save
    reaches it, and the saves go on once ``set()`` is called."""

    def __init__(self) -> None:
        import threading

        self.entered = threading.Event()
        self.opened = threading.Event()

    def set(self) -> None:
        self.opened.set()


def gate_merge(monkeypatch: Any) -> MergeGate:
    """Hold every save's background part (the OCDBT merge) until the returned gate is set."""
    import milepost as mp

    gate = MergeGate()
    real = mp.workers.format.merge_ocdbt

    def merge(directory: Any) -> None:
        gate.entered.set()
        assert gate.opened.wait(60), "test gate never opened"
        real(directory)

    monkeypatch.setattr(mp.workers.format, "merge_ocdbt", merge)
    return gate


@contextmanager
def tensorstore_writes_only() -> Iterator[None]:
    """Saves in this process write every shard with TensorStore, none packed by milepost
    (``workers.save._packed``): for tests of the databases TensorStore writes (writers, their
    tables, shards inline in the B-tree), which large shards still take."""
    import pytest

    from milepost.workers.save import _packed

    with pytest.MonkeyPatch.context() as m:
        m.setattr(_packed, "PACK_LIMIT", 0)
        yield


@contextmanager
def warnings_logged(logger: str = "milepost") -> Iterator[list[str]]:
    """The messages logged at WARNING or above to ``logger`` while the block runs (a handler of
    its own: Ray changes caplog's formatting in this suite)."""
    import logging

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Keep(logging.WARNING)
    target = logging.getLogger(logger)
    target.addHandler(handler)
    try:
        yield lines
    finally:
        target.removeHandler(handler)
