"""Host job ``verify``: read chunks of a checkpoint and check each against its recorded
checksum; report what is damaged, missing or unreadable instead of raising."""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import tensorstore as ts

from milepost.workers import _checksum, _progress
from milepost.workers import _tensorstore as tsu
from milepost.workers._boxes import box_to_slices
from milepost.workers._errors import CorruptCheckpointError
from milepost.workers._messages import VerifyAck, VerifyPlan, VerifyTask
from milepost.workers.load import ArrayChecks


def verify(plan: VerifyPlan, process_index: int | str = 0) -> VerifyAck:
    """Read every chunk of the plan and check it against its recorded checksum; report what is
    damaged, missing or unreadable instead of raising."""
    verifier = _Verifier(plan)
    for task in plan.tasks:
        verifier.check_array(task)
    return VerifyAck(
        process_index=process_index,
        chunks_checked=verifier.checked,
        bytes_read=verifier.nbytes,
        problems=tuple(verifier.problems),
    )


class _Verifier:
    def __init__(self, plan: VerifyPlan) -> None:
        self.plan = plan
        self.context = tsu.new_context(plan.tasks[0].store.directory if plan.tasks else None)
        self.budget = plan.memory_budget_bytes or (256 << 20)
        self.problems: list[str] = []
        self.checked = self.nbytes = 0
        self.progress = _progress.counter()

    def check_array(self, task: VerifyTask) -> None:
        spec = tsu.open_spec(
            tsu.read_kvstore(task.store), task.name, task.fill_missing, task.store.zarr_format
        )
        try:
            store = ts.open(spec, open=True, read=True, context=self.context).result()
            chunk_shape = tsu.chunk_shapes(store)[0]
        except Exception as e:
            self.problems.append(f"array {task.name!r}: cannot be opened ({e})")
            return
        shape = tuple(store.shape)
        expected = dict(task.expected) if task.expected is not None else None
        if task.chunk_tables:
            try:
                inner, shard = tsu.chunk_shapes(store)
                tables = ArrayChecks(task.store, [task.name], self.context)
                expected = dict(expected or {})  # (the chunks inline in the B-tree, recorded)
                for grid in task.chunks:
                    if grid not in expected:
                        want = tables.expected(task.name, grid, inner, shard)
                        if want >= 0:  # (-1: reported as unrecorded below)
                            expected[grid] = want
            except Exception as e:
                self.problems.append(
                    f"array {task.name!r}: its chunks' checksum tables cannot be read ({e})"
                )
                return
        inflight: collections.deque[tuple[tuple[int, ...], Any, np.ndarray]] = collections.deque()
        held = 0
        for grid in task.chunks:
            box = tuple(
                (g * c, min((g + 1) * c, n))
                for g, c, n in zip(grid, chunk_shape, shape, strict=True)
            )
            out = np.empty(tuple(b - a for a, b in box), store.dtype.numpy_dtype)
            while inflight and held + out.nbytes > self.budget:
                held -= self._finish(task, expected, *inflight.popleft())
            inflight.append(
                (grid, ts.array(out).write(store[box_to_slices(box)] if box else store), out)
            )
            held += out.nbytes
        while inflight:
            self._finish(task, expected, *inflight.popleft())

    def _finish(
        self,
        task: VerifyTask,
        expected: dict[tuple[int, ...], int] | None,
        grid: tuple[int, ...],
        future: Any,
        out: np.ndarray,
    ) -> int:
        name = task.name
        try:
            future.result()
        except Exception as e:
            self.problems.append(f"array {name!r}: chunk {grid} is missing or unreadable ({e})")
            return out.nbytes
        self.checked += 1
        self.nbytes += out.nbytes
        if self.progress is not None:
            self.progress(out.nbytes)
        if expected is not None:
            try:
                _checksum.check(
                    name, grid, _checksum.values_crc32c(out), expected, task.store.directory
                )
            except CorruptCheckpointError as e:
                self.problems.append(str(e))
        return out.nbytes
