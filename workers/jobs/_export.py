"""Host job: write safetensors files from a checkpoint, each host the files assigned to it.

The controller computed every file's header (names, dtypes, shapes, offsets) from metadata
alone; a host reads each tensor from the checkpoint into its memory (checked like any load),
one tensor ahead of the one it writes, and writes it at its place. Bytes never reach the
controller.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from milepost.workers._messages import LoadPlan, LoadTask, StoreSpec
from milepost.workers._runtime import RUNTIME, Pool
from milepost.workers.format import safetensors_format
from milepost.workers.load import load


@dataclass(frozen=True, kw_only=True)
class ExportFile:
    path: str
    header: bytes
    tensors: tuple[LoadTask, ...]
    """In the header's order; each read whole into host memory (no sharding)."""


@dataclass(frozen=True, kw_only=True)
class ExportPlan:
    store: StoreSpec
    files: tuple[ExportFile, ...]
    fill_missing: bool = False
    memory_budget_bytes: int | None = None


@dataclass(frozen=True, kw_only=True)
class ExportAck:
    process_index: int | str
    files: tuple[str, ...]
    bytes_written: int


def export_safetensors(plan: ExportPlan, process_index: int | str = 0) -> ExportAck:
    written = 0

    def read(task: LoadTask) -> np.ndarray:
        one = LoadPlan(
            store=plan.store,
            tasks=(task,),
            memory_budget_bytes=plan.memory_budget_bytes,
            fill_missing=plan.fill_missing,
        )
        (array,), _ = load(one, process_index)
        return np.asarray(array)

    with RUNTIME.scoped("export", 1) as reader:
        for file in plan.files:
            arrays = _prefetched(reader, read, file.tensors)
            written += safetensors_format.write_file(file.path, file.header, arrays)
    return ExportAck(
        process_index=process_index, files=tuple(f.path for f in plan.files), bytes_written=written
    )


def _prefetched(pool: Pool, read: Any, tasks: tuple[LoadTask, ...]) -> Any:
    """Each task's array, the next one read while the caller writes this one."""
    pending: Future[np.ndarray] | None = pool.submit(read, tasks[0]) if tasks else None
    for k in range(len(tasks)):
        assert pending is not None
        array = pending.result()
        pending = pool.submit(read, tasks[k + 1]) if k + 1 < len(tasks) else None
        yield array
