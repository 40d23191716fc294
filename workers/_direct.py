"""Direct reads: a box's bytes go from the data file straight into the buffer the device adopts.

TensorStore reads a chunk into a buffer of its own and then copies it into ours: one more pass
over every byte, into freshly faulted memory. In the layout milepost writes by default (an
uncompressed zarr3 shard holding a single chunk, optionally inside OCDBT), the bytes of a box
that lies in one shard and is contiguous in C order are one range of one file. We find that
range from the OCDBT B-tree (or the plain zarr3 file), check the shard index and its CRC32C the
way TensorStore would, and ``preadv`` into the destination. Everything else — compressed or
subchunked arrays, boxes spanning shards, missing chunks, inline values — goes through
TensorStore.
"""

from __future__ import annotations

import itertools
import math
import os
import struct
import sys
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorstore as ts

from milepost.workers import _checksum
from milepost.workers import _tensorstore as tsu
from milepost.workers._errors import CorruptCheckpointError
from milepost.workers._iostats import count_read
from milepost.workers._messages import StoreSpec

_INDEX_ENTRY = struct.Struct("<QQ")
_MISSING = 2**64 - 1
# Element types whose zarr3 "bytes" encoding is not simply the NumPy buffer.
_PACKED_DTYPES = frozenset({"int2", "int4", "uint2", "uint4", "float4_e2m1fn"})
_READ_THREADS = 4


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC32C = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), as zarr3's ``crc32c`` codec appends it. Used on shard indexes only,
    which are a few bytes long."""
    c = 0xFFFFFFFF
    for byte in data:
        c = _CRC32C[(c ^ byte) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


class FallBack(Exception):
    """This box cannot be read directly after all (e.g. its chunk is missing): use TensorStore."""


@dataclass(frozen=True)
class ShardLayout:
    """What a direct read needs to know about one array (from its zarr.json)."""

    name: str
    shard_shape: tuple[int, ...]
    dtype: np.dtype
    separator: str


def shard_layout(name: str, store: Any) -> ShardLayout | None:
    """The array's layout when its shards can be read directly, else None."""
    if sys.byteorder != "little":
        return None
    metadata = store.spec().to_json().get("metadata", {})
    try:
        grid = metadata["chunk_grid"]
        if grid.get("name") != "regular":
            return None
        shard_shape = tuple(int(n) for n in grid["configuration"]["chunk_shape"])
        (codec,) = metadata["codecs"]
        config = codec.get("configuration", {})
        encoding = metadata.get("chunk_key_encoding", {"name": "default"})
    except (KeyError, TypeError, ValueError):
        return None
    dtype = store.dtype.numpy_dtype
    if (
        codec.get("name") != "sharding_indexed"
        or tuple(config.get("chunk_shape", ())) != shard_shape
        or config.get("index_location", "end") != "end"
        or not _is_plain_bytes(config.get("codecs"))
        or config.get("index_codecs") is None
        or len(config["index_codecs"]) != 2
        or not _is_plain_bytes(config["index_codecs"][:1])
        or config["index_codecs"][1].get("name") != "crc32c"
        or encoding.get("name") != "default"
        or dtype.name in _PACKED_DTYPES
        or metadata.get("data_type") in _PACKED_DTYPES
    ):
        return None
    separator = encoding.get("configuration", {}).get("separator", "/")
    return ShardLayout(name=name, shard_shape=shard_shape, dtype=dtype, separator=separator)


def _is_plain_bytes(codecs: Any) -> bool:
    return (
        isinstance(codecs, list)
        and len(codecs) == 1
        and codecs[0].get("name") == "bytes"
        and codecs[0].get("configuration", {}).get("endian", "little") == "little"
    )


@dataclass(frozen=True)
class BoxRead:
    """One contiguous piece of a box: a range of a chunk that lands on a range of the box buffer."""

    key: str
    offset_in_chunk: int
    chunk_nbytes: int
    offset_in_box: int = 0
    nbytes: int = -1
    """Bytes of the piece (-1: the whole destination)."""
    grid: tuple[int, ...] = ()
    """The chunk's index in the array's chunk grid."""

    @property
    def whole(self) -> bool:
        """The piece is its whole chunk (so the chunk's checksum can be checked)."""
        return self.offset_in_chunk == 0 and self.nbytes == self.chunk_nbytes

_MAX_PIECES = 4096


def box_reads(layout: ShardLayout, box: tuple[tuple[int, int], ...]) -> list[BoxRead] | None:
    """The pieces of ``box``, one per shard it touches, when each piece is one contiguous range
    both in its chunk and in the box's own C-order buffer; else None.

    That covers a box equal to a saved shard, a run of whole rows of one, and a box that spans
    the shards replica-parallel saving cut along its first axis.
    """
    if not box or any(b <= a for a, b in box):
        return None
    shape = layout.shard_shape
    box_shape = tuple(b - a for a, b in box)
    spans = [range(a // s, (b - 1) // s + 1) for (a, b), s in zip(box, shape, strict=True)]
    if math.prod(len(r) for r in spans) > _MAX_PIECES:
        return None
    itemsize = layout.dtype.itemsize
    chunk_nbytes = math.prod(shape) * itemsize
    pieces = []
    for grid in itertools.product(*spans):
        # the piece: box ∩ shard, in global coordinates
        piece = [
            (max(a, g * s), min(b, (g + 1) * s)) for (a, b), g, s in zip(box, grid, shape, strict=True)
        ]
        in_chunk = [(a - g * s, b - g * s) for (a, b), g, s in zip(piece, grid, shape, strict=True)]
        in_box = [(a - ba, b - ba) for (a, b), (ba, _) in zip(piece, box, strict=True)]
        if not (_contiguous(in_chunk, shape) and _contiguous(in_box, box_shape)):
            return None
        pieces.append(
            BoxRead(
                key=layout.name + "/c" + "".join(layout.separator + str(g) for g in grid),
                offset_in_chunk=_offset(in_chunk, shape) * itemsize,
                chunk_nbytes=chunk_nbytes,
                offset_in_box=_offset(in_box, box_shape) * itemsize,
                nbytes=math.prod(b - a for a, b in piece) * itemsize,
                grid=tuple(grid),
            )
        )
    return pieces


def _contiguous(sub: list[tuple[int, int]], shape: tuple[int, ...]) -> bool:
    """Whether ``sub`` (a box inside an array of ``shape``) is one range of the C-order buffer:
    after the first dimension with more than one index, every dimension is taken whole."""
    dims = len(shape)
    first = next((d for d in range(dims) if sub[d][1] - sub[d][0] > 1), dims - 1)
    return all(sub[d] == (0, shape[d]) for d in range(first + 1, dims))


def _offset(sub: list[tuple[int, int]], shape: tuple[int, ...]) -> int:
    """Elements before the first element of ``sub`` in the C-order buffer of ``shape``."""
    return sum(a * math.prod(shape[d + 1 :]) for d, (a, _) in enumerate(sub))


@dataclass(frozen=True)
class _Value:
    path: str
    offset: int
    length: int


class Locator:
    """Finds the file range that holds a key's value in a checkpoint's store."""

    def __init__(self, store: StoreSpec) -> None:
        self.directory = store.directory
        self.use_ocdbt = store.use_ocdbt
        self._values: dict[str, _Value] = {}
        self._indexed: set[str] = set()

    def index(self, names: Iterable[str]) -> None:
        """Learn the value locations of every chunk of these arrays (one B-tree walk)."""
        prefixes = sorted({n + "/" for n in names} - self._indexed)
        if not prefixes or not self.use_ocdbt:
            return
        base = ts.KvStore.open(tsu.file_kvstore(self.directory)).result()
        manifest = ts.ocdbt.dump(base).result()
        root = manifest["versions"][-1]["root"].get("location") if manifest.get("versions") else None
        if root is not None:
            wanted = [p.encode() for p in prefixes]
            self._walk(base, root, b"", wanted)
        self._indexed.update(prefixes)

    def _walk(self, base: Any, location: str, prefix: bytes, wanted: list[bytes]) -> None:
        node = ts.ocdbt.dump(base, location).result()
        entries = node["entries"]
        for i, entry in enumerate(entries):
            key = prefix + entry["key"]
            if "location" in entry:  # interior: the child holds keys in [key, next key)
                upper = prefix + entries[i + 1]["key"] if i + 1 < len(entries) else None
                if any(_overlaps(key, upper, w) for w in wanted):
                    self._walk(base, entry["location"], prefix + entry.get("subtree_common_prefix", b""), wanted)
            elif "indirect_value" in entry and any(key.startswith(w) for w in wanted):
                value = _parse_value(self.directory, entry["indirect_value"])
                if value is not None:
                    self._values[key.decode()] = value

    def locate(self, key: str) -> _Value | None:
        if self.use_ocdbt:
            return self._values.get(key)
        path = os.path.join(self.directory, key)
        try:
            return _Value(path=path, offset=0, length=os.path.getsize(path))
        except OSError:
            return None


def _overlaps(low: bytes, high: bytes | None, prefix: bytes) -> bool:
    """Whether some key in [low, high) starts with ``prefix``."""
    if low <= prefix:
        smallest = prefix
    elif low.startswith(prefix):
        smallest = low
    else:  # low sorts after every key that starts with prefix
        return False
    return high is None or smallest < high


def _parse_value(directory: str, reference: str) -> _Value | None:
    # "value:<base path>:<relative path>:<offset>:<length>"
    head, offset, length = reference.rsplit(":", 2)
    kind, base_path, relative = head.split(":", 2)
    if kind != "value":
        return None
    inside = base_path + relative
    parts = inside.split("/")
    if os.path.isabs(inside) or ".." in parts or "\\" in inside or "\x00" in inside:
        raise CorruptCheckpointError(
            f"the OCDBT database in {directory} points a value at {inside!r}, outside the checkpoint; the checkpoint is "
            "damaged or crafted, and that file was not opened"
        )
    return _Value(path=os.path.join(directory, inside), offset=int(offset), length=int(length))


class DirectReader:
    """Runs direct reads on a few threads (``preadv`` releases the GIL); one per load."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(_READ_THREADS, thread_name_prefix="milepost-read")
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def submit(self, value: _Value, read: BoxRead, out: np.ndarray, expected: int | None = None, name: str = "") -> Future[None]:
        """Read ``read`` into its range of ``out`` (the whole box's buffer); with ``expected``
        (-1: none recorded for this chunk) check the chunk's checksum before returning."""
        return self._pool.submit(self._read, value, read, out, expected, name)

    def _fd(self, path: str) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            return fd

    def _read(self, value: _Value, read: BoxRead, out: np.ndarray, expected: int | None = None, name: str = "") -> None:
        self._read_piece(value, read, out)
        if expected is not None:
            target = memoryview(out.reshape(-1).view(np.uint8))[read.offset_in_box : read.offset_in_box + read.nbytes]
            recorded = {read.grid: expected} if expected >= 0 else {}
            where = f"{value.path} at byte {value.offset}"
            _checksum.check(name, read.grid, _checksum.crc32c(target), recorded, where)

    def _read_piece(self, value: _Value, read: BoxRead, out: np.ndarray) -> None:
        fd = self._fd(value.path)
        target = memoryview(out.reshape(-1).view(np.uint8))
        if read.nbytes >= 0:
            target = target[read.offset_in_box : read.offset_in_box + read.nbytes]
        index_size = _INDEX_ENTRY.size + 4
        if value.length < index_size:
            raise CorruptCheckpointError(f"shard {read.key!r} is {value.length} bytes, too short to hold its index")
        whole = read.offset_in_chunk == 0 and len(target) == read.chunk_nbytes == value.length - index_size
        if whole:
            # TensorStore puts a shard's only chunk first, then the index: one sequential read
            # gets both; the index then confirms where the chunk was.
            index = bytearray(index_size)
            _pread_exactly(fd, [target, memoryview(index)], value.offset, read.key, value.path)
        else:
            index = bytearray(index_size)
            _pread_exactly(fd, [memoryview(index)], value.offset + value.length - index_size, read.key, value.path)
        (checksum,) = struct.unpack("<I", index[-4:])
        if crc32c(bytes(index[:-4])) != checksum:
            raise CorruptCheckpointError(f"shard {read.key!r} has a damaged index (CRC32C mismatch) in {value.path}")
        chunk_offset, chunk_nbytes = _INDEX_ENTRY.unpack(index[:-4])
        if chunk_offset == _MISSING and chunk_nbytes == _MISSING:
            raise FallBack
        if chunk_nbytes != read.chunk_nbytes or chunk_offset + chunk_nbytes > value.length - index_size:
            raise CorruptCheckpointError(
                f"shard {read.key!r} in {value.path} says its chunk is {chunk_nbytes} bytes at {chunk_offset}, "
                f"but an uncompressed chunk is {read.chunk_nbytes} bytes within a {value.length}-byte shard"
            )
        if not whole or chunk_offset != 0:
            _pread_exactly(fd, [target], value.offset + chunk_offset + read.offset_in_chunk, read.key, value.path)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def _pread_exactly(fd: int, buffers: list[memoryview], position: int, key: str, path: str) -> None:
    """Fill ``buffers`` from ``position`` on, however many short reads that takes."""
    total = sum(len(b) for b in buffers)
    done = 0
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
