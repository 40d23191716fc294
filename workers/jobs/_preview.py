"""Host job: read one box of one array (a look at a few values of a checkpoint, e.g.
``np.asarray(ck.tree["w"][:4, :8])`` in a notebook). The whole chunks the box touches are read
and checked against their recorded checksums, then the box is cut out: only those chunks are
read, and nothing unchecked is returned.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tensorstore as ts

from milepost.workers._boxes import box_to_slices
from milepost.workers._errors import CorruptCheckpointError
from milepost.workers._messages import Index, StoreSpec
from milepost.workers.format import chunk_checksums, from_tensorstore, specs
from milepost.workers.load import ArrayChecks


@dataclass(frozen=True, kw_only=True)
class BoxPlan:
    store: StoreSpec
    name: str
    box: Index
    checksums: tuple[tuple[tuple[int, ...], int], ...] | None = None
    """Recorded (chunk grid index, CRC32C) of the array's chunks; None: not recorded."""
    chunk_tables: bool = False
    """The checksums are in the chunks' writers' tables (read here)."""


def read_box(plan: BoxPlan, process_index: int | str = 0) -> np.ndarray:
    context = specs.new_context(plan.store.directory)
    spec = specs.open_spec(specs.read_kvstore(plan.store), plan.name, False, plan.store.zarr_format)
    try:
        store = ts.open(spec, open=True, read=True, context=context).result()
        if plan.checksums is None and not plan.chunk_tables:
            return np.asarray(store[box_to_slices(plan.box)].read().result())
        inner, shard = specs.header_chunks(store.spec().to_json().get("metadata", {}))
        whole = chunk_checksums.aligned_box(plan.box, inner, tuple(store.shape))
        data = np.asarray(store[box_to_slices(whole)].read().result())
    except Exception as e:
        mapped = from_tensorstore(
            e, f"reading array {plan.name!r}", plan.store.directory, reading=True
        )
        if mapped is not e:
            raise mapped from e
        raise CorruptCheckpointError(
            f"array {plan.name!r} could not be read from {plan.store.directory}: {e}",
            array=plan.name,
            path=plan.store.directory,
        ) from e
    where = f"{plan.store.directory}, array {plan.name!r}"
    recorded = dict(plan.checksums or ())  # (with tables: the chunks inline in the B-tree)
    tables = ArrayChecks(plan.store, [plan.name], context) if plan.chunk_tables else None
    for grid, crc in chunk_checksums.region_crc32c(data, whole, inner):
        want = recorded.get(grid)
        if want is None and tables is not None:
            want = tables.expected(plan.name, grid, inner, shard)
        chunk_checksums.check(
            plan.name, grid, crc, {grid: want} if want is not None and want >= 0 else {}, where
        )
    local = tuple(slice(a - w, b - w) for (a, b), (w, _) in zip(plan.box, whole, strict=True))
    return np.ascontiguousarray(data[local])
