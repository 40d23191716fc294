"""Host job ``verify``: read chunks of a checkpoint and check each against its recorded
checksum; report what is damaged, missing or unreadable instead of raising.

The chunks walked are those of the shards storage holds (one listing of the array's keys),
one at a time: never a list of the chunk grid its header declares, which a crafted header can
make as large as it likes. The declared shards that storage lacks are counted."""

from __future__ import annotations

import collections
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorstore as ts

from milepost.workers import _progress
from milepost.workers._boxes import box_to_slices
from milepost.workers._errors import CorruptCheckpointError
from milepost.workers._messages import VerifyAck, VerifyPlan, VerifyTask
from milepost.workers.format import chunk_checksums, specs
from milepost.workers.load import ArrayChecks

MAX_PROBLEMS = 20
"""Problems reported per array; past them its other chunks are not read."""

Grid = tuple[int, ...]


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
        self.context = specs.new_context(plan.tasks[0].store.directory if plan.tasks else None)
        self.budget = plan.memory_budget_bytes or (256 << 20)
        self.problems: list[str] = []
        self.checked = self.nbytes = 0
        self.progress = _progress.counter()

    def check_array(self, task: VerifyTask) -> None:
        spec = specs.open_spec(
            specs.read_kvstore(task.store), task.name, task.fill_missing, task.store.zarr_format
        )
        try:
            store = ts.open(spec, open=True, read=True, context=self.context).result()
            metadata = specs.zarr_metadata(store)
            inner, shard = specs.chunk_shapes(store, metadata)
            stored = self._stored(task, metadata, len(inner))
        except Exception as e:
            self.problems.append(f"array {task.name!r}: cannot be opened ({e})")
            return
        shape = tuple(store.shape)
        shards = tuple(-(-n // s) for n, s in zip(shape, shard, strict=True))
        present = sorted(g for g in stored if all(i < n for i, n in zip(g, shards, strict=True)))
        k, n = task.share
        if k == 0 and not task.fill_missing and 0 not in shape:
            self._missing(task.name, shards, present)
        elif k == 0 and task.expected is not None:  # (a chunk with a checksum was written)
            self._lost(task.name, task.expected, present, inner, shard, shape)
        expected = dict(task.expected) if task.expected is not None else None
        tables = None
        if task.chunk_tables:
            expected = expected or {}  # (the chunks inline in the B-tree, recorded; the others:)
            try:
                tables = ArrayChecks(task.store, [task.name], self.context)
            except Exception as e:
                self.problems.append(
                    f"array {task.name!r}: its chunks' checksum tables cannot be read ({e})"
                )
                return
        chunks = _chunks(present[k::n], inner, shard, shape)
        self._read(task, store, chunks, inner, shard, shape, expected, tables)

    def _stored(self, task: VerifyTask, metadata: dict[str, Any], rank: int) -> set[Grid]:
        """The shard-grid indices of the array's chunks (shards) storage holds: one listing of
        its keys (keys of another form are not chunks of it, and are passed over)."""
        kv = ts.KvStore.open(specs.read_kvstore(task.store), context=self.context).result()
        prefix = f"{task.name}/".encode()
        keys = kv.list(ts.KvStore.KeyRange(prefix, prefix[:-1] + b"0")).result()
        encoding = metadata.get("chunk_key_encoding") or {"name": "default"}
        v2 = task.store.zarr_format == 2 or encoding.get("name") == "v2"
        configuration = encoding.get("configuration") or {}
        separator = (
            metadata.get("dimension_separator", ".")
            if task.store.zarr_format == 2
            else configuration.get("separator", "." if v2 else "/")
        )
        out: set[Grid] = set()
        for key in keys:
            text = key[len(prefix) :].decode("utf-8", "replace")
            if not v2:
                if text != "c" and not text.startswith("c" + separator):
                    continue
                text = text[2:]
            parts = text.split(separator) if text else []
            if rank == 0 and not v2:
                parts = [] if text == "" else ["x"]
            elif rank == 0:
                parts = [] if text == "0" else ["x"]
            if len(parts) == rank and all(p.isascii() and p.isdigit() for p in parts):
                out.add(tuple(int(p) for p in parts))
        return out

    def _lost(
        self,
        name: str,
        recorded: tuple[tuple[Grid, int], ...],
        present: list[Grid],
        inner: Grid,
        shard: Grid,
        shape: Grid,
    ) -> None:
        """Report the chunks whose checksums were recorded (so they were written) and whose
        shards storage lacks, whatever the metadata says of missing chunks."""
        per = tuple(s // c for s, c in zip(shard, inner, strict=True))
        grid = tuple(-(-n // c) for n, c in zip(shape, inner, strict=True))
        held = set(present)
        lost = sorted(
            g
            for g, _ in recorded
            if len(g) == len(grid)
            and all(0 <= i < n for i, n in zip(g, grid, strict=True))  # (a chunk of the array)
            and tuple(i // p for i, p in zip(g, per, strict=True)) not in held
        )
        self.problems.extend(
            f"array {name!r}: chunk {g} is missing (its checksum was recorded)"
            for g in lost[:MAX_PROBLEMS]
        )

    def _missing(self, name: str, shards: Grid, present: list[Grid]) -> None:
        """Report the shards the header declares and storage lacks: counted, and the first
        found by walking the grid no further than the shards there are."""
        declared = math.prod(shards)
        if len(present) >= declared:
            return
        held = set(present)
        first = next(g for g in chunk_checksums.grid_indices(shards) if g not in held)
        self.problems.append(
            f"array {name!r}: {declared - len(present)} of its {declared} stored chunks "
            f"(shards) are missing (first: {first})"
        )

    def _read(
        self,
        task: VerifyTask,
        store: Any,
        chunks: Iterator[Grid],
        inner: Grid,
        shard: Grid,
        shape: Grid,
        expected: dict[Grid, int] | None,
        tables: ArrayChecks | None,
    ) -> None:
        """Read ``chunks`` (an iterator) within the memory budget, each checked as it comes."""
        inflight: collections.deque[tuple[Grid, Any, np.ndarray]] = collections.deque()
        held = 0
        before = len(self.problems)
        for grid in chunks:
            if len(self.problems) - before >= MAX_PROBLEMS:
                self.problems.append(
                    f"array {task.name!r}: {MAX_PROBLEMS} problems; its other chunks were not read"
                )
                break
            if tables is not None and (expected is None or grid not in expected):
                try:
                    want = tables.expected(task.name, grid, inner, shard)
                except Exception as e:
                    self.problems.append(
                        f"array {task.name!r}: its chunks' checksum tables cannot be read ({e})"
                    )
                    break
                if want >= 0 and expected is not None:  # (-1: reported as unrecorded)
                    expected[grid] = want
            box = tuple(
                (g * c, min((g + 1) * c, n)) for g, c, n in zip(grid, inner, shape, strict=True)
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
        expected: dict[Grid, int] | None,
        grid: Grid,
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
                chunk_checksums.check(
                    name, grid, chunk_checksums.values_crc32c(out), expected, task.store.directory
                )
            except CorruptCheckpointError as e:
                self.problems.append(str(e))
        return out.nbytes


def _chunks(shards: list[Grid], inner: Grid, shard: Grid, shape: Grid) -> Iterator[Grid]:
    """The chunk-grid indices of the stored chunks inside ``shards`` (and inside the array),
    one at a time."""
    per = tuple(s // c for s, c in zip(shard, inner, strict=True))
    grid = tuple(-(-n // c) for n, c in zip(shape, inner, strict=True))
    for at in shards:
        for offset in chunk_checksums.grid_indices(per):
            chunk = tuple(a * k + o for a, k, o in zip(at, per, offset, strict=True))
            if all(c < g for c, g in zip(chunk, grid, strict=True)):
                yield chunk
