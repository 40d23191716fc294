"""Reading a load's boxes within a memory budget, each checked against its chunks' checksums.

:class:`BudgetedReader` issues the reads of every box a host's devices need and completes the
oldest first while the bytes in flight would pass the budget. A box goes straight from its
file into the destination buffer where the layout allows (:mod:`._direct`), otherwise through
TensorStore; safetensors tensors are read by
:func:`~milepost.workers.format._safetensors.read_boxes`.
With recorded checksums every chunk a box touches is read whole and checked before its values
go anywhere.
"""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Iterable
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorstore as ts

from milepost.workers import _memory, _progress
from milepost.workers._boxes import box_to_slices
from milepost.workers._errors import CorruptCheckpointError
from milepost.workers._memory import parallel_copy
from milepost.workers.format import (
    ChunkTables,
    FileRange,
    chunk_checksums,
    from_tensorstore,
    safetensors_format,
    shard_key,
)
from milepost.workers.load import _direct, _locator
from milepost.workers.load._assemble import Assembler
from milepost.workers.load._pieces import BoxRead, ShardLayout, box_reads


@dataclass(frozen=True)
class Checked:
    """What a load checks an array's chunks against: the recorded checksum of each chunk."""

    name: str
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    expected: dict[tuple[int, ...], int]
    shard_shape: tuple[int, ...] = ()
    """The stored shards' shape (its chunk grid), which may hold several chunks."""
    tables: ChunkTables | None = None
    """With ``locator``: the checksums are in the chunks' writers' tables, not ``expected``."""
    locator: _locator.Locator | None = None

    def want(self, grid: tuple[int, ...], value: FileRange | None = None) -> int:
        """The checksum chunk ``grid`` must have: recorded by the commit (checkpoints before the
        tables; chunks stored inline in the B-tree), else its writer's table; -1 when neither
        has one (which fails the check: a chunk inline in the B-tree that the commit did not
        record was not written there by its writer). ``value``: where its shard value lies,
        if the caller located it already."""
        found = self.expected.get(grid)
        if found is not None or self.tables is None or self.locator is None:
            return -1 if found is None else found
        if value is None:
            value = self.locator.locate(self.key(grid))
        if value is None:
            return -1
        return self.tables.expected(self.name, grid, value)

    def wants(self, grids: list[tuple[int, ...]]) -> list[int]:
        """:meth:`want` of every chunk in ``grids``, their shard values located at once."""
        if self.tables is None or self.locator is None:
            return [self.want(grid) for grid in grids]
        values = self.locator.locate_many([self.key(grid) for grid in grids])
        return [self.want(grid, value) for grid, value in zip(grids, values, strict=True)]

    def prefetch(self, values: Iterable[FileRange | None]) -> None:
        """Start reading, all at once, the tables of the writers of these shard values (a
        box's), so that :meth:`want` waits for none of them one after another. Only those: at
        thousands of hosts every database holds a chunk of every array, and a host reads the
        tables of the few whose chunks it reads, not every writer's."""
        if self.tables is not None and self.locator is not None:
            self.tables.prefetch(value.path for value in values if value is not None)

    def box_values(self, box: tuple[tuple[int, int], ...]) -> list[FileRange | None]:
        """Where the shard values of the chunks ``box`` touches lie (located at once)."""
        if self.tables is None or self.locator is None:
            return []
        spans = (range(a // c, -(-b // c)) for (a, b), c in zip(box, self.chunk_shape, strict=True))
        keys = {self.key(grid) for grid in itertools.product(*spans) if grid not in self.expected}
        return self.locator.locate_many(sorted(keys))

    def key(self, grid: tuple[int, ...]) -> str:
        """The storage key of the shard holding chunk ``grid``."""
        return shard_key(self.name, grid, self.chunk_shape, self.shard_shape)


class _DirectRead:
    """The direct reads of one box in flight (each checks its chunk's checksum on its thread);
    if one of them turns out not to be directly readable (its chunk is missing), the whole box
    is read through TensorStore instead."""

    def __init__(
        self,
        handle: _direct.BoxHandle,
        store: Any,
        box: tuple[tuple[int, int], ...],
        out: np.ndarray,
        whole: tuple[tuple[int, int], ...],
    ) -> None:
        self.handle = handle
        self.store = store
        self.box = box
        self.out = out
        self.whole = whole
        self.staged: np.ndarray | None = None
        """After a fallback: the whole chunks the box touches, read to be checked (when more
        than the box)."""

    def result(self) -> bool:
        """Wait; True if the box was read through TensorStore after all (as ``whole``, the
        chunks a checked box touches, into ``staged`` when that is more than the box)."""
        if self.handle.result():
            if self.whole != self.box:
                self.staged = _memory.read_buffer(
                    tuple(b - a for a, b in self.whole), self.out.dtype
                )
                ts.array(self.staged).write(_box_view(self.store, self.whole)).result()
            else:
                ts.array(self.out).write(_box_view(self.store, self.box)).result()
            return True
        return False


def _ready(arrays: list[Any]) -> bool:
    """Whether every transfer to ``arrays`` is done (no wait)."""
    return all(a.is_ready() for a in arrays)


def _wait(arrays: list[Any]) -> None:
    """Wait until every transfer to ``arrays`` is done."""
    for a in arrays:
        a.block_until_ready()


def _box_view(store: Any, box: tuple[tuple[int, int], ...]) -> Any:
    """The TensorStore view of ``box`` (indexing a TensorStore costs tens of microseconds: done
    only for reads that go through it)."""
    return store[box_to_slices(box)] if box else store


class _TensorRead:
    """Every box one host needs of one safetensors tensor, read together (rows that several
    boxes share are read once)."""

    def __init__(self, tensor: safetensors_format.Tensor, asm: Assembler) -> None:
        dtype = np.dtype(safetensors_format.numpy_dtype(tensor.dtype))
        self.asm = asm
        self.targets = [
            (devices, box, _memory.read_buffer(tuple(b - a for a, b in box), dtype))
            for devices, box in asm.pieces
        ]
        self.nbytes = sum(out.nbytes for _, _, out in self.targets)
        self.futures = safetensors_format.read_boxes(
            tensor, [(box, out) for _, box, out in self.targets]
        )

    def finish(self) -> tuple[int, list[Any]]:
        """Wait; the bytes read, and the device arrays whose transfers started."""
        futures_wait(self.futures)
        got = sum(f.result() for f in self.futures)
        placed = [a for devices, _, out in self.targets for a in self.asm.take(devices, out)]
        self.targets = []
        return got, placed


@dataclass
class _Read:
    future: Any
    out: np.ndarray
    asm: Assembler
    devices: tuple[Any, ...]
    nbytes: int
    checked: Checked | None = None
    """Checked here once read (TensorStore reads); direct reads check on their own threads."""
    whole: tuple[tuple[int, int], ...] = ()
    """The chunk-aligned box read (when checked), into ``staged`` if it is larger than the box."""
    box: tuple[tuple[int, int], ...] = ()
    staged: np.ndarray | None = None
    scratch: int = 0
    """Bytes held while in flight beyond ``nbytes`` (direct pieces read beside the box first)."""


class BudgetedReader:
    """Issues reads, keeping at most ``budget`` bytes of read buffers in flight: reads not yet
    done, and (on accelerators) boxes read whose transfers to their devices are not yet done
    (a fast reader over a slow bus would otherwise hold ever more host memory).

    A box goes straight from its file into the destination buffer when the locator can find it
    (see :mod:`._direct`), otherwise through TensorStore. With recorded checksums every chunk a
    box touches is read whole and checked before its values go anywhere: a box that covers
    chunks only partly is read through TensorStore as the whole chunks, then cut out.
    """

    def __init__(
        self,
        budget: int | None,
        directory: str = "",
        locator: _locator.Locator | None = None,
        total_bytes: int = 0,
        boxes: int = 0,
        *,
        direct: bool = True,
    ) -> None:
        """``total_bytes`` in ``boxes`` boxes: about what the load will read."""
        self.budget = budget
        self.directory = directory
        self.locator = locator
        self.direct = (
            _direct.DirectReader(total_bytes, boxes) if locator is not None and direct else None
        )  # with the locator
        self.inflight: collections.deque[_Read | _TensorRead] = collections.deque()
        self.inflight_bytes = 0
        self.placing: collections.deque[tuple[list[Any], int]] = collections.deque()
        """Device arrays being placed from host buffers (asynchronously), and those bytes."""
        self.placing_bytes = 0
        self.peak_bytes = 0
        """The most bytes of reads and placements in flight at once."""
        self.bytes_read = 0
        self.progress = _progress.counter()

    def streams(self) -> int:
        """How many far-apart parts of the load's reads to read at once: for direct reads of
        large boxes one per read thread, as many as the memory budget holds batches of."""
        if self.direct is None:
            return 1
        lanes = self.direct.streams
        if self.budget is not None:
            lanes = min(lanes, self.budget // self.direct.batch_bytes)
        return max(1, lanes)

    def place(self, layout: ShardLayout | None, box: tuple[tuple[int, int], ...]) -> FileRange:
        """Where ``box``'s data starts: its first shard value (an empty range when it is not
        read directly)."""
        pieces = box_reads(layout, box) if layout is not None and self.locator else None
        value = self.locator.locate(pieces[0].key) if pieces and self.locator else None
        return value if value is not None else FileRange("", -1, 0)

    def order(self, sizes: list[int]) -> list[list[int]]:
        """The order to issue reads of ``sizes`` bytes (given in the order their data lies on
        disk) in: units of reads, after each of which :meth:`boundary` ends the batch, taken
        from :meth:`streams` far-apart parts in turn (:func:`._direct.spread`)."""
        unit = self.direct.batch_bytes if self.direct is not None else 0
        return _direct.spread(sizes, self.streams(), unit)

    def boundary(self) -> None:
        """The reads issued since the last boundary are one batch: hand them to a thread."""
        if self.direct is not None:
            self.direct.flush()

    def read(
        self,
        store: Any,
        layout: ShardLayout | None,
        box: tuple[tuple[int, int], ...],
        asm: Assembler,
        devices: tuple[Any, ...],
        checked: Checked | None = None,
    ) -> None:
        dtype = store.dtype.numpy_dtype
        nbytes = math.prod(b - a for a, b in box) * dtype.itemsize
        direct: tuple[list[BoxRead], list[FileRange]] | None = None
        scratch = 0
        if layout is not None and self.locator is not None and self.direct is not None:
            # (with checksums, every chunk the box touches is read whole, and the box's part placed)
            pieces = box_reads(layout, box, whole_chunks=checked is not None) or []
            if checked is not None and not all(p.whole for p in pieces):
                pieces = []  # a partial chunk cannot be checked: read it whole, below
            located = self.locator.locate_many([piece.key for piece in pieces])
            values = [v for v in located if v is not None]
            if pieces and len(values) == len(located):
                direct = pieces, values
                scratch = sum(p.scratch for p in pieces)  # read beside the box
        whole = box
        if checked is not None:
            whole = chunk_checksums.aligned_box(box, checked.chunk_shape, checked.shape)
            if whole != box and direct is None:
                nbytes += math.prod(b - a for a, b in whole) * dtype.itemsize
        self._make_room(nbytes + scratch)
        if checked is not None:
            checked.prefetch(direct[1] if direct is not None else checked.box_values(whole))
        out = _memory.read_buffer(tuple(b - a for a, b in box), dtype)
        read = _Read(None, out, asm, devices, nbytes, checked, whole, box, scratch=scratch)
        if direct is not None:
            pieces, values = direct
            expected: list[int | None] = [None] * len(pieces)
            if checked is not None:
                expected = [checked.want(p.grid, v) for p, v in zip(pieces, values, strict=True)]
            assert self.direct is not None  # made with the locator, which ``direct`` needs
            handle = self.direct.read_box(values, pieces, out, expected, asm.task.name)
            read.future = _DirectRead(
                handle, store, box, out, whole
            )  # checked again only after a fallback
        elif whole == box:
            read.future = ts.array(out).write(_box_view(store, box))
        else:
            read.staged = _memory.read_buffer(tuple(b - a for a, b in whole), dtype)
            read.future = ts.array(read.staged).write(_box_view(store, whole))
        self.inflight.append(read)
        self.inflight_bytes += nbytes + scratch
        self.peak_bytes = max(self.peak_bytes, self.inflight_bytes + self.placing_bytes)

    def read_tensor(self, tensor: safetensors_format.Tensor, asm: Assembler) -> None:
        """Read every box ``asm`` needs of a safetensors tensor."""
        if self.budget is not None:
            needed = (
                sum(math.prod(b - a for a, b in box) for _, box in asm.pieces)
                * tensor.nbytes
                // max(1, math.prod(tensor.shape))
            )
            self._make_room(needed)
        read = _TensorRead(tensor, asm)
        self.inflight.append(read)
        self.inflight_bytes += read.nbytes
        self.peak_bytes = max(self.peak_bytes, self.inflight_bytes + self.placing_bytes)

    def _make_room(self, nbytes: int) -> None:
        """Wait until ``nbytes`` more fit in the budget, or nothing else is in flight: first
        for placements (only their end frees memory: a read done becomes a placement), then
        for reads."""
        if self.budget is None:
            return
        while self.inflight_bytes + self.placing_bytes + nbytes > self.budget:
            if self.placing:
                self._placed_one(block=not _ready(self.placing[0][0]))
            elif self.inflight:
                self._complete_one()
            else:
                return

    def _placing(self, arrays: list[Any], nbytes: int) -> None:
        if arrays:
            self.placing.append((arrays, nbytes))
            self.placing_bytes += nbytes

    def _placed_one(self, block: bool) -> None:
        """Forget the oldest placement (waiting until its transfers are done if ``block``)."""
        arrays, nbytes = self.placing.popleft()
        if block:
            _wait(arrays)
        self.placing_bytes -= nbytes

    def _complete_one(self) -> None:
        read = self.inflight.popleft()
        if isinstance(read, _TensorRead):
            got, placed = read.finish()
            self.bytes_read += got
            self.inflight_bytes -= read.nbytes
            self._placing(placed, read.nbytes)
            if self.progress is not None:
                self.progress(read.nbytes)
            return
        asm = read.asm
        try:
            fell_back = read.future.result()
            if fell_back:
                read.staged = read.future.staged
            if read.checked is not None and (not isinstance(read.future, _DirectRead) or fell_back):
                self._check(read)
        except (
            Exception
        ) as e:  # TensorStore's ValueError("NOT_FOUND: ..."), a bad checksum, a short file...
            if isinstance(e, CorruptCheckpointError) and e.array == asm.task.name:
                raise  # already names the array and says what is wrong
            mapped = from_tensorstore(
                e, f"reading array {asm.task.name!r}", self.directory, reading=True
            )
            if (
                isinstance(mapped, OSError)
                and not isinstance(mapped, FileNotFoundError)
                and mapped is not e
            ):
                raise mapped from e
            raise CorruptCheckpointError(
                f"array {asm.task.name!r}: reading a {read.out.shape} box from "
                f"{self.directory} failed ({e}); the checkpoint's data files are "
                "missing or damaged. Load an earlier checkpoint.",
                array=asm.task.name,
                path=self.directory,
            ) from e
        placed = asm.take(read.devices, read.out)
        self.inflight_bytes -= read.nbytes + read.scratch
        self._placing(placed, read.out.nbytes)
        self.bytes_read += read.nbytes
        if self.progress is not None:
            self.progress(
                read.out.nbytes
            )  # the box delivered (a checked read may read whole chunks around it)

    def _check(self, read: _Read) -> None:
        """Check every chunk of a box read through TensorStore, then cut the box out."""
        checked = read.checked
        assert checked is not None
        buffer = read.staged if read.staged is not None else read.out
        crcs = list(chunk_checksums.region_crc32c(buffer, read.whole, checked.chunk_shape))
        wants = checked.wants([grid for grid, _ in crcs])
        for (grid, crc), want in zip(crcs, wants, strict=True):
            recorded = {grid: want} if want >= 0 else {}
            chunk_checksums.check(checked.name, grid, crc, recorded, self._where(checked, grid))
        if read.staged is not None:
            local = tuple(
                slice(a - w, b - w) for (a, b), (w, _) in zip(read.box, read.whole, strict=True)
            )
            parallel_copy([(read.out, read.staged[local])])
            read.staged = None

    def _where(self, checked: Checked, grid: tuple[int, ...]) -> str:
        key = checked.key(grid)
        value = self.locator.locate(key) if self.locator is not None else None
        return (
            f"{value.path} at byte {value.offset}, key {key!r}"
            if value is not None
            else f"{self.directory}, key {key!r}"
        )

    def drain(self) -> None:
        while self.inflight:
            self._complete_one()

    def complete(self, asm: Assembler) -> None:
        """Finish the reads in flight for ``asm`` (and the reads issued before them)."""
        while any(read.asm is asm for read in self.inflight):
            self._complete_one()

    def close(self) -> None:
        """Wait for direct reads still running (after a failure) and close their files."""
        if self.direct is not None:
            self.direct.close()
