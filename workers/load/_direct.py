"""Direct reads: a box's bytes go from the data file straight into the buffer the device adopts.

TensorStore reads a chunk into a buffer of its own and then copies it into ours: one more pass
over every byte, into freshly faulted memory. In the layouts milepost writes (an uncompressed
zarr3 shard holding one chunk, or several inner chunks with ``chunk_byte_size``, optionally
inside OCDBT) every chunk is one range of one file. We find the shard value from the OCDBT
B-tree (or the plain zarr3 file), check its index and the index's CRC32C the way TensorStore
would, and ``preadv`` each chunk the box touches into its place: a chunk that is one range of
the box buffer in one iovec, one whose rows are strided in the box one iovec per row, and only
chunks with short runs through a scratch buffer and a copy. Every chunk read is read whole when
its checksum is to be checked (a box keeping part of it still reads all of it).

TensorStore writes a full shard as its inner chunks one after another in the C order of the
shard's chunk grid, then the index (``(offset, nbytes)`` per chunk, little-endian uint64, in the
same order) and its CRC32C. When a box's part of a shard is all of its chunks, one after another
in the box buffer (a box that is the shard, with one chunk or with row bands), the shard value is
read in one go, chunks then index, and the index only confirms where each chunk was (a chunk
stored elsewhere is read again from there). Otherwise the index is read first.

Everything else -- compressed arrays, inner chunks that do not tile the shard, missing chunks
(which fall back), inline values -- goes through TensorStore.
"""

from __future__ import annotations

import itertools
import os
import stat
import threading
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from milepost.workers._errors import CorruptCheckpointError
from milepost.workers._iostats import count_read
from milepost.workers._runtime import RUNTIME
from milepost.workers.format import FileRange, chunk_checksums, index_entries, index_size
from milepost.workers.load._pieces import BoxRead, runs

_READ_THREADS = max(1, min(4, os.cpu_count() or 1))
"""Read threads for loads of small boxes: more than cores only fight over the GIL between their
reads (the figures: docs/performance.md#code-figures)."""
_LARGE_BOX_BYTES = 1 << 20
"""Loads whose boxes average this much or more are I/O-bound: they get one more read thread
than cores, so a read is in flight while every core checks what was read, and larger batches.
Loads of small boxes are CPU-bound (placing thousands of arrays): small batches hand the placing
thread results early. (The figures: docs/performance.md#code-figures.)"""
_BATCH_BYTES = (4 << 20, 32 << 20)
"""Boxes are handed to the read threads in batches of about this many bytes, the least and the
most: a small box's read costs less than its hand-over to a thread, and shard values lying back
to back in a batch are read with one ``preadv``, which the disk serves faster the larger it is
(docs/performance.md#code-figures)."""


def sizing(total: int, boxes: int) -> tuple[int, int]:
    """(read threads, batch bytes) for a load of ``boxes`` boxes, ``total`` bytes in all: for
    large boxes one more thread than cores, and about two batches per thread (so every thread
    has work until the end) within :data:`_BATCH_BYTES`; for small ones as many threads as
    cores, and the least batch."""
    least, most = _BATCH_BYTES
    if not boxes or total // boxes < _LARGE_BOX_BYTES:
        return _READ_THREADS, least
    threads = min(4, _READ_THREADS + 1)
    return threads, max(least, min(most, total // (2 * threads)))


def spread(sizes: list[int], lanes: int, unit: int) -> list[list[int]]:
    """The reads of a load (``sizes[i]`` bytes each, given in the order their data lies on
    disk) regrouped so that the ``lanes`` batches read at once lie far apart: the reads are cut
    into ``lanes`` parts of about equal bytes, each part into units of about ``unit`` bytes
    (a batch), and the units are taken from the parts in turn (part 0's first unit, part 1's
    first, ..., then part 0's second...). Each read thread then reads one part front to back
    instead of every thread reading the next neighbouring batch of one file: measured on this
    machine's disk, the same ``preadv`` calls took 0.34-0.38 s that way against 0.45-0.49 s in
    disk order (docs/performance.md#read-buffers). Returns the units, each a list of indices."""
    total = sum(sizes)
    if lanes <= 1 or total <= lanes * unit:
        return [list(range(len(sizes)))]
    parts: list[list[list[int]]] = [[] for _ in range(lanes)]
    start = filled = 0
    for i, size in enumerate(sizes):
        part = parts[min(lanes - 1, start * lanes // total)]
        if not part or filled >= unit:
            part.append([])
            filled = 0
        part[-1].append(i)
        filled += size
        start += size
    return [u for units in itertools.zip_longest(*parts) for u in units if u is not None]


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), as zarr3's ``crc32c`` codec appends it (checked on shard indexes)."""
    return chunk_checksums.crc32c(data)


class FallBack(Exception):
    """This box cannot be read directly after all (e.g. its chunk is missing): use TensorStore."""


_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024)


class BoxHandle:
    """The direct reads of one box: ``result()`` waits for its batch and returns True if the
    box must be read through TensorStore after all (a chunk is missing), or raises what its
    own reads raised (another box's failure in the same batch is not its own)."""

    def __init__(self, reader: DirectReader, batch: _Batch, slot: int) -> None:
        self._reader = reader
        self._batch = batch
        self._slot = slot

    def result(self) -> bool:
        if self._batch.future is None:
            self._reader.flush()
        assert self._batch.future is not None
        outcome = self._batch.future.result()[self._slot]
        if outcome is None:
            return False
        if isinstance(outcome, FallBack):
            return True
        raise outcome


_BoxWork = tuple[list[FileRange], list[BoxRead], np.ndarray, list[int | None], str]


@dataclass
class _Batch:
    boxes: list[_BoxWork]
    nbytes: int = 0
    partial: bool = False
    """Some box reads parts of shard values (see :meth:`DirectReader.read_box`)."""
    future: Future[list[BaseException | None]] | None = None


@dataclass
class _Piece:
    """A piece being read: where its bytes go, in the order they are stored."""

    read: BoxRead
    buffers: list[memoryview]
    expected: int | None
    scratch: np.ndarray | None = None
    """The buffer the whole piece was read into, to be copied into place once checked."""
    entry: int = 0
    """Where its chunk starts in the shard value (from the shard index)."""


@dataclass
class _Group:
    """The pieces of one box that lie in one shard value, and that shard's index."""

    value: FileRange
    pieces: list[_Piece]
    slot: int
    index: bytearray
    whole: memoryview | None = None
    """The shard's chunks one after another in the box buffer: the value is read in one go."""


class DirectReader:
    """Runs direct reads on a few threads (``preadv`` releases the GIL); one per load.

    Boxes (:meth:`read_box`) are gathered into batches (:func:`sizing`); a read
    thread takes a whole batch. A shard whose chunks land one after another in a box (a box
    that is the shard, or whole shards stacked along the first axis) is read whole, its chunks
    and then its index, and shards lying back to back in one file with one ``preadv``: thousands
    of small arrays cost a few hundred system calls and hand-overs, not one each. The index
    then confirms where each chunk was (a chunk stored elsewhere is read again from there).
    Other shards have their index read first, then the chunks the box touches (neighbours in
    one ``preadv``).
    """

    def __init__(self, total_bytes: int = 0, boxes: int = 0) -> None:
        """``total_bytes`` in ``boxes`` boxes: about what the load will read (they set the
        number of threads and the batch size)."""
        self.threads, self.batch_bytes = sizing(total_bytes, boxes)
        self.streams = self.threads if self.batch_bytes > _BATCH_BYTES[0] else 1
        """Far-apart parts of the load worth reading at once (:func:`spread`): one per thread
        when the boxes are large (I/O-bound); small ones are read in disk order (CPU-bound)."""
        self._pool = RUNTIME.call_pool("read", self.threads)
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._batch = _Batch([])
        self._indexes: dict[tuple[str, int], list[int | None]] = {}
        """The checked index of each shard value read index first (by file and offset)."""

    def read_box(
        self,
        values: list[FileRange],
        reads: list[BoxRead],
        out: np.ndarray,
        expected: list[int | None],
        name: str = "",
    ) -> BoxHandle:
        """Read every piece of one box (``reads[i]`` from ``values[i]``) into ``out``, checking
        each whole chunk against ``expected[i]`` (its recorded CRC32C; -1: none was recorded for
        it, which fails; None: not checked). Queued into the current batch,
        which is handed to a thread once it is large enough (or :meth:`flush`, or a wait)."""
        whole = self._prefetch(values, reads)
        batch = self._batch
        batch.boxes.append((values, reads, out, expected, name))
        batch.nbytes += out.nbytes
        batch.partial = batch.partial or not whole
        handle = BoxHandle(self, batch, len(batch.boxes) - 1)
        # Large batches serve boxes of whole shard values (neighbours coalesce into one large
        # read); boxes that read parts of shards read them on their own, several threads at once
        # (large batches made a resharded load much slower: docs/performance.md#code-figures).
        if batch.nbytes >= (_BATCH_BYTES[0] if batch.partial else self.batch_bytes):
            self.flush()
        return handle

    def _prefetch(self, values: list[FileRange], reads: list[BoxRead]) -> bool:
        """Ask the kernel to start reading what the box needs of each shard it reads only part
        of (the chunks it touches, where the shard's C order puts them, and the index), so that
        those reads are in flight together instead of one after another on the read thread.
        A box that reads whole shard values needs no hint: each is one large read. Returns
        whether the box is (most likely) such a box. (What the hint saves, resharded and not:
        docs/performance.md#code-figures.)"""
        chunks = reads[0].chunks if reads else 1
        if len(reads) % chunks == 0 and all(r.scatter is None and r.whole for r in reads):
            return True  # (most likely whole shard values, each one large read)
        spans: dict[
            tuple[str, int], tuple[FileRange, int, int, int]
        ] = {}  # (first byte, end, pieces read whole into place)
        for value, read in zip(values, reads, strict=True):
            start = value.offset + read.chunk * read.chunk_nbytes + read.offset_in_chunk
            end = start + (read.length if read.length >= 0 else read.chunk_nbytes)
            direct = int(read.scatter is None and read.whole)
            known = spans.get((value.path, value.offset))
            if known is not None:
                start, end, direct = min(known[1], start), max(known[2], end), known[3] + direct
            spans[value.path, value.offset] = (value, start, end, direct)
        for value, start, end, direct in spans.values():
            if direct == chunks:  # every chunk into its range of the box: one large read
                continue
            index = index_size(chunks)
            try:
                fd = self._fd(value.path)
                os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)
                os.posix_fadvise(
                    fd, value.offset + value.length - index, index, os.POSIX_FADV_WILLNEED
                )
            except (
                OSError,
                AttributeError,
            ):  # (no posix_fadvise here; a missing file fails the read itself)
                break
        return False

    def flush(self) -> None:
        """Hand the current batch to a read thread."""
        batch = self._batch
        if batch.boxes:
            self._batch = _Batch([])
            batch.future = self._pool.submit(self._read_batch, batch.boxes)

    def _fd(self, path: str) -> int:
        with self._lock:
            fd = self._fds.get(path)
        if fd is not None:
            return fd
        # Opened outside the lock, without blocking (a FIFO put where a data file was would
        # block the open, and every read behind the lock, forever), and only if it is a file.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise CorruptCheckpointError(
                    f"{path} is not a regular file (a FIFO, socket or device); a checkpoint's data "
                    "files are files, so the checkpoint is damaged or crafted, and it was not read"
                )
        except BaseException:
            os.close(fd)
            raise
        with self._lock:
            known = self._fds.setdefault(path, fd)
        if known != fd:  # another thread opened it first
            os.close(fd)
        return known

    def _read_batch(self, boxes: list[_BoxWork]) -> list[BaseException | None]:
        """Read a batch; per box, None or the exception its reads raised (FallBack included)."""
        outcomes: list[BaseException | None] = [None] * len(boxes)
        groups: list[_Group] = []
        for slot, (values, reads, out, expected, _) in enumerate(boxes):
            try:
                groups += _groups(slot, values, reads, out, expected)
            except Exception as e:
                outcomes[slot] = e
        # Whole shard values, in runs lying back to back in one file: one preadv per run.
        runs: dict[str, list[tuple[_Group, memoryview]]] = {}
        for group in groups:
            if group.whole is not None:
                runs.setdefault(group.value.path, []).append((group, group.whole))
        for path, members in runs.items():
            members.sort(key=lambda m: m[0].value.offset)
            start = 0
            while start < len(members):
                end = start + 1
                while (
                    end < len(members)
                    and end - start < _IOV_MAX // 2
                    and members[end][0].value.offset
                    == members[end - 1][0].value.offset + members[end - 1][0].value.length
                ):
                    end += 1
                run = members[start:end]
                buffers = [b for g, whole in run for b in (whole, memoryview(g.index))]
                first = run[0][0]
                try:
                    _pread_exactly(
                        self._fd(path), buffers, first.value.offset, first.pieces[0].read.key, path
                    )
                except Exception:
                    # Each value again on its own, so each box gets its own error (a file cut
                    # short fails only the values past its end).
                    for g, whole in run:
                        try:
                            _pread_exactly(
                                self._fd(path),
                                [whole, memoryview(g.index)],
                                g.value.offset,
                                g.pieces[0].read.key,
                                path,
                            )
                        except Exception as e:
                            outcomes[g.slot] = outcomes[g.slot] or e
                start = end
        for group in groups:
            if outcomes[group.slot] is not None:
                continue
            try:
                if group.whole is not None:
                    self._confirm(group)
                else:
                    self._read_group(group)
            except Exception as e:
                outcomes[group.slot] = e
        for group in groups:
            if outcomes[group.slot] is not None:
                continue
            out, name = boxes[group.slot][2], boxes[group.slot][4]
            try:
                for piece in group.pieces:
                    _finish(piece, group.value, out, name)
            except Exception as e:
                outcomes[group.slot] = e
        return outcomes

    def _confirm(self, group: _Group) -> None:
        """After a shard value was read whole: check its index, and read again from where the
        index says any chunk that was not where the shard's C order put it."""
        value = group.value
        entries = _checked_index(value, group.pieces[0].read, group.index)
        for piece in group.pieces:
            entry = entries[piece.read.chunk]
            if entry is None:
                raise FallBack
            piece.entry = entry
            if entry != piece.read.chunk * piece.read.chunk_nbytes:
                _pread_all(
                    self._fd(value.path),
                    piece.buffers,
                    value.offset + entry,
                    piece.read.key,
                    value.path,
                )

    def _read_group(self, group: _Group) -> None:
        """Read the shard's index, then the pieces the box needs (neighbours in one preadv)."""
        value = group.value
        first = group.pieces[0].read
        fd = self._fd(value.path)
        size = index_size(first.chunks)
        if value.length < size:
            raise CorruptCheckpointError(
                f"shard {first.key!r} is {value.length} bytes, too short to hold its index"
            )
        with self._lock:
            entries = self._indexes.get((value.path, value.offset))
        if entries is None:  # (the other boxes that touch this shard use it too)
            _pread_exactly(
                fd,
                [memoryview(group.index)],
                value.offset + value.length - size,
                first.key,
                value.path,
            )
            entries = _checked_index(value, first, group.index)
            with self._lock:
                self._indexes[value.path, value.offset] = entries
        spans: list[tuple[int, int, list[memoryview]]] = []
        for piece in group.pieces:
            entry = entries[piece.read.chunk]
            if entry is None:
                raise FallBack
            piece.entry = entry
            start = value.offset + entry + piece.read.offset_in_chunk
            spans.append(
                (
                    start,
                    piece.read.length if piece.read.length >= 0 else len(piece.buffers[0]),
                    piece.buffers,
                )
            )
        spans.sort(key=lambda s: s[0])
        i = 0
        while i < len(spans):
            start, length, buffers = spans[i][0], spans[i][1], list(spans[i][2])
            i += 1
            while i < len(spans) and spans[i][0] == start + length:
                length += spans[i][1]
                buffers += spans[i][2]
                i += 1
            _pread_all(fd, buffers, start, first.key, value.path)

    def close(self) -> None:
        self._pool.stop()
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def _groups(
    slot: int,
    values: list[FileRange],
    reads: list[BoxRead],
    out: np.ndarray,
    expected: list[int | None],
) -> list[_Group]:
    """A box's pieces grouped by the shard value they lie in, each with its buffers."""
    flat = out.reshape(-1).view(np.uint8).data
    groups: dict[tuple[str, int], _Group] = {}
    for value, read, crc in zip(values, reads, expected, strict=True):
        group = groups.get((value.path, value.offset))
        if group is None:
            group = groups[value.path, value.offset] = _Group(
                value, [], slot, bytearray(index_size(read.chunks))
            )
        group.pieces.append(_piece(read, out, flat, crc))
    for group in groups.values():
        group.whole = _whole_value(group, flat)
    return list(groups.values())


def _piece(read: BoxRead, out: np.ndarray, flat: memoryview, expected: int | None) -> _Piece:
    """Where a piece's bytes are read to, in the order they are stored."""
    if read.scatter is None:
        target = (
            flat[read.offset_in_box : read.offset_in_box + read.nbytes]
            if read.nbytes >= 0
            else flat
        )
        return _Piece(read, [target], expected)
    if not read.in_place:
        scratch = np.empty(read.length, np.uint8)
        return _Piece(read, [scratch.data], expected, scratch)
    within = read.within or tuple((0, n) for n in read.read_shape)
    sources, targets, length = runs(within, read.read_shape, read.scatter, out.shape, out.itemsize)
    if read.length == read.nbytes:  # all of it kept: runs back to back
        return _Piece(read, [flat[to : to + length] for to in targets], expected)
    spare = np.empty(read.length - read.nbytes, np.uint8).data  # what the box does not keep
    buffers: list[memoryview] = []
    done = used = 0
    for at, to in zip(sources, targets, strict=True):
        if at > done:
            buffers.append(spare[used : used + at - done])
            used += at - done
        buffers.append(flat[to : to + length])
        done = at + length
    if done < read.length:
        buffers.append(spare[used:])
    return _Piece(read, buffers, expected)


def _whole_value(group: _Group, flat: memoryview) -> memoryview | None:
    """The range of the box buffer that takes the whole shard value's chunks when they land
    there one after another, in the order the shard's C order stores them (else None)."""
    pieces = group.pieces
    first = pieces[0].read
    if (
        len(pieces) != first.chunks
        or group.value.length != first.chunks * first.chunk_nbytes + index_size(first.chunks)
        or any(
            p.read.scatter is not None
            or not p.read.whole
            or p.read.chunk != k
            or p.read.offset_in_box != first.offset_in_box + k * first.chunk_nbytes
            for k, p in enumerate(pieces)
        )
    ):
        return None
    start = first.offset_in_box if first.nbytes >= 0 else 0
    return flat[start : start + first.chunks * first.chunk_nbytes]


def _finish(piece: _Piece, value: FileRange, out: np.ndarray, name: str) -> None:
    """Check a piece's chunk against its recorded checksum, and copy it into place if it was
    read beside the box."""
    read = piece.read
    if piece.expected is not None:
        crc = chunk_checksums.crc32c_of(piece.buffers)
        recorded = {read.grid: piece.expected} if piece.expected >= 0 else {}
        where = f"{value.path} at byte {value.offset + piece.entry}, key {read.key!r}"
        chunk_checksums.check(name, read.grid, crc, recorded, where)
    if piece.scratch is not None and read.scatter is not None:
        source = piece.scratch.view(out.dtype).reshape(read.read_shape)
        if read.within is not None:
            source = source[tuple(slice(a, b) for a, b in read.within)]
        np.copyto(out[tuple(slice(a, b) for a, b in read.scatter)], source)


def _checked_index(value: FileRange, read: BoxRead, index: bytearray) -> list[int | None]:
    """Where the shard's index (its last bytes, ``index``) says each chunk starts (None: the
    chunk is missing); raises if the index is damaged or disagrees with uncompressed chunks."""
    if value.length < len(index):
        raise CorruptCheckpointError(
            f"shard {read.key!r} is {value.length} bytes, too short to hold its index"
        )
    entries = index_entries(index)
    if entries is None:
        raise CorruptCheckpointError(
            f"shard {read.key!r} has a damaged index (CRC32C mismatch) in {value.path}"
        )
    room = value.length - len(index)
    starts: list[int | None] = []
    for k, entry in enumerate(entries):
        if entry is None:
            starts.append(None)
            continue
        chunk_offset, chunk_nbytes = entry
        if chunk_nbytes != read.chunk_nbytes or chunk_offset + chunk_nbytes > room:
            raise CorruptCheckpointError(
                f"shard {read.key!r} in {value.path} says its chunk {k} is {chunk_nbytes} bytes "
                f"at {chunk_offset}, but an uncompressed chunk is {read.chunk_nbytes} bytes "
                f"within a {value.length}-byte shard"
            )
        starts.append(chunk_offset)
    return starts


def _pread_all(fd: int, buffers: list[memoryview], position: int, key: str, path: str) -> None:
    """Fill ``buffers`` from ``position`` on, at most ``_IOV_MAX`` buffers per call."""
    for start in range(0, len(buffers), _IOV_MAX):
        part = buffers[start : start + _IOV_MAX]
        position += _pread_exactly(fd, part, position, key, path)


def _pread_exactly(fd: int, buffers: list[memoryview], position: int, key: str, path: str) -> int:
    """Fill ``buffers`` from ``position`` on, however many short reads that takes; their size."""
    total = sum(map(len, buffers))
    if total == 0:
        return 0
    done = os.preadv(fd, buffers, position)  # (almost always all of it)
    count_read(max(done, 0))
    if done <= 0:
        raise CorruptCheckpointError(f"shard {key!r} is cut short in {path}")
    while done < total:
        pending, skip = [], done
        for b in buffers:
            if skip >= len(b):
                skip -= len(b)
                continue
            pending.append(b[skip:])
            skip = 0
        got = os.preadv(fd, pending, position + done)
        count_read(max(got, 0))
        if got <= 0:
            raise CorruptCheckpointError(f"shard {key!r} is cut short in {path}")
        done += got
    return total
