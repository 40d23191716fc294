"""A host's small shards, packed by milepost into one database of its own, in key order.

TensorStore lays a database's values out in the order its commits happen to take them, so the
same array's shard lies at a different offset in each host's data file. The root view of a
save over many hosts holds one offset per host per array, and those differing offsets were most
of its bytes (docs/performance.md#the-commit-at-many-hosts). Here a host's small shards
(uncompressed zarr3 shards, whole and inside the array, each at most :data:`PACK_LIMIT`
bytes) are encoded by milepost and written in key order into one data file of a database of
their own (``ocdbt.process_<i>[.<k>].p``): hosts writing the same arrays' shards lay them
out alike, and the root's offsets repeat from host to host.

Each value is the zarr3 ``sharding_indexed`` shard TensorStore would write: the inner chunks'
little-endian bytes in C order, then the index of (offset, length) pairs and its CRC32C. The
database is OCDBT (:func:`~milepost.workers.format._ocdbt_merge.write_database`); its chunk checksum
table (:mod:`~milepost.workers.format._chunk_tables`) lies in a data file of its own.

The order of a save with packed shards (:func:`~milepost.workers.save.start_save`):
:meth:`Packer.add` for each packable region, :meth:`Packer.copies` (the copies into one buffer,
run with the other staging copies), then :meth:`Packer.write` off the caller's thread.
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
from dataclasses import dataclass

import numpy as np

from milepost.workers._boxes import Box
from milepost.workers._messages import ArraySpec, StoreSpec
from milepost.workers._paths import as_path
from milepost.workers.format import Grid, chunk_checksums, chunk_tables, specs, write_database
from milepost.workers.save._device import DevicePart

PACK_LIMIT = 1 << 20
"""Shards of at most this many bytes are packed; larger ones are written by TensorStore (their
offsets are few for their bytes)."""

PACK_BUDGET = 256 << 20
"""At most this many bytes are packed per save on a host (in the plan's order, the same on
every host); the regions after them are written by TensorStore. The packed database is one
data file written in one request, after every packed shard was copied."""

_BIG_ENDIAN = sys.byteorder != "little"  # (zarr3's bytes are little-endian: not packed here)
_SUB_BYTE = ("int2", "uint2", "int4", "uint4", "float4_e2m1fn")  # stored packed by TensorStore


def packed_name(database: str) -> str:
    """The folder of the packed database beside a host's writer database ``database``."""
    return database + specs.PACKED_SUFFIX


@dataclass(frozen=True)
class _Shard:
    key: str
    name: str
    box: Box  # the shard's box in the array
    data: np.ndarray | DevicePart  # the region's host view holding it (the caller's memory
    # until copied), or the region on its way from device memory
    within: tuple[slice, ...]  # the shard's slices in ``data``


class Packer:
    """The packed shards of one save on one host: added while its regions are classified,
    copied with the staging copies, written by :meth:`write`."""

    def __init__(self, store: StoreSpec, database: str) -> None:
        self.store = store
        self.database = packed_name(database)
        self._shards: list[_Shard] = []
        self._specs: dict[str, ArraySpec] = {}
        self._buffer: np.ndarray | None = None
        self._at: list[int] = []  # where each shard (in key order) starts in the buffer
        self.nbytes = 0
        """The bytes of the shards taken (values, indexes and their CRC32Cs)."""
        self.data_bytes = 0
        """The bytes of their values."""

    def add(
        self, spec: ArraySpec, box: Box, data: np.ndarray | DevicePart, room: int | None = None
    ) -> int:
        """Take the region ``box`` of ``spec`` (its values ``data``) if every shard of it may be
        packed (whole shards inside the array, uncompressed, of at most :data:`PACK_LIMIT`
        bytes, of an element type stored as its bytes) and its stored bytes fit in ``room``
        (None: any) and :data:`PACK_BUDGET`: the bytes it takes in the buffer (0: not taken,
        TensorStore writes it)."""
        if not self._packable(spec, box, data):
            return 0
        count = math.prod((b - a) // w for (a, b), w in zip(box, spec.write_shape, strict=True))
        size = count * _shard_bytes(spec, data.dtype.itemsize)
        if self.nbytes + size > PACK_BUDGET or (room is not None and size > room):
            return 0
        self._specs[spec.name] = spec
        ranges = [range(a, b, w) for (a, b), w in zip(box, spec.write_shape, strict=True)]
        for start in itertools.product(*ranges):
            shard = tuple((s, s + w) for s, w in zip(start, spec.write_shape, strict=True))
            grid = tuple(s // w for s, w in zip(start, spec.write_shape, strict=True))
            within = tuple(slice(s - a, e - a) for (s, e), (a, _) in zip(shard, box, strict=True))
            key = chunk_tables.shard_key(spec.name, grid, spec.write_shape, spec.write_shape)
            self._shards.append(_Shard(key, spec.name, shard, data, within))
        self.nbytes += size
        self.data_bytes += data.nbytes
        return size

    def _packable(self, spec: ArraySpec, box: Box, data: np.ndarray | DevicePart) -> bool:
        if spec.compression is not None or data.size == 0 or spec.dtype in _SUB_BYTE:
            return False
        if data.dtype.kind not in "biufcV" or not data.dtype.isnative or _BIG_ENDIAN:
            return False
        shard_bytes = math.prod(spec.write_shape) * data.dtype.itemsize
        if shard_bytes > PACK_LIMIT:
            return False
        return all(
            a % w == 0 and (b - a) % w == 0 and b <= n and w % c == 0
            for (a, b), w, c, n in zip(
                box, spec.write_shape, spec.chunk_shape, spec.shape, strict=True
            )
        )

    def layout(self) -> int:
        """Lay the shards out in key order; the bytes of the buffer they need."""
        self._shards.sort(key=lambda s: s.key)
        sizes = (_shard_bytes(self._specs[s.name], s.data.dtype.itemsize) for s in self._shards)
        self._at = [0, *itertools.accumulate(sizes)]
        return self._at[-1]

    def copies(self, buffer: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """The (destination, source) copies that fill in every chunk's values in ``buffer``
        (uint8, of :meth:`layout`'s bytes, ours until :meth:`write` ends): the caller's memory
        is free once they ran."""
        self._buffer = buffer
        pairs = []
        for shard, at in zip(self._shards, self._at, strict=False):
            spec = self._specs[shard.name]
            values = shard.data[shard.within]
            inner, _, chunk_bytes = _layout(spec.write_shape, spec.chunk_shape, values.itemsize)
            for n, grid in enumerate(inner):
                chunk = zip(grid, spec.chunk_shape, strict=True)
                local = tuple(slice(g * c, (g + 1) * c) for g, c in chunk)
                start = at + n * chunk_bytes
                dst = buffer[start : start + chunk_bytes].view(values.dtype)
                pairs.append((dst.reshape(spec.chunk_shape), values[local]))
        return pairs

    def write(self) -> None:
        """Finish each shard (its index and the index's CRC32C), checksum every chunk, and
        write the database: the shards in key order in one data file, the table in another.
        After :meth:`copies`' copies ran."""
        assert self._buffer is not None, "Packer.copies first"
        buffer, self._buffer = self._buffer, None
        table: dict[str, list[tuple[Grid, int]]] = {}
        for shard, at, end in zip(self._shards, self._at, self._at[1:], strict=False):
            spec = self._specs[shard.name]
            itemsize = shard.data.dtype.itemsize
            inner, tail, chunk_bytes = _layout(spec.write_shape, spec.chunk_shape, itemsize)
            buffer[end - len(tail) : end] = tail
            origin = [a // c for (a, _), c in zip(shard.box, spec.chunk_shape, strict=True)]
            crcs = table.setdefault(shard.name, [])
            for n, grid in enumerate(inner):
                start = at + n * chunk_bytes
                crc = chunk_checksums.crc32c(buffer[start : start + chunk_bytes])
                crcs.append((tuple(o + g for o, g in zip(origin, grid, strict=True)), crc))
        shards = ([s.key for s in self._shards], [b - a for a, b in itertools.pairwise(self._at)])
        data = buffer.tobytes()
        del buffer  # (the staging pool takes it back once no one references it)
        self._shards = []
        encoded = chunk_tables.encode(self.database, table)
        # The table in a data file of its own: a damaged shards' file still names their array.
        write_database(
            as_path(self.store.directory) / self.database,
            [(*shards, data), ([chunk_tables.table_key(self.database)], [len(encoded)], encoded)],
            specs.OCDBT_CONFIG,
            self.store.file_token,
        )


@functools.lru_cache(maxsize=256)
def _layout(
    write_shape: tuple[int, ...], chunk_shape: tuple[int, ...], itemsize: int
) -> tuple[list[Grid], np.ndarray, int]:
    """What every shard of this shape shares: its inner chunks' grid indices within it (C
    order), its index and the index's CRC32C (the bytes after its values), and a chunk's
    bytes."""
    counts = [w // c for w, c in zip(write_shape, chunk_shape, strict=True)]
    inner = list(itertools.product(*(range(n) for n in counts)))
    chunk_bytes = math.prod(chunk_shape) * itemsize
    starts = np.arange(len(inner), dtype="<u8") * chunk_bytes
    # (offset, length) of each chunk, little-endian uint64s
    index = np.stack([starts, np.full(len(inner), chunk_bytes, "<u8")], axis=1).view(np.uint8)
    crc = chunk_checksums.crc32c(index).to_bytes(4, "little")
    tail = np.concatenate([index.ravel(), np.frombuffer(crc, np.uint8)])
    tail.flags.writeable = False  # (shared by every shard of this shape)
    return inner, tail, chunk_bytes


def _shard_bytes(spec: ArraySpec, itemsize: int) -> int:
    """The stored bytes of one shard of ``spec``: its values, its index and the index's CRC32C."""
    _, tail, _ = _layout(spec.write_shape, spec.chunk_shape, itemsize)
    return math.prod(spec.write_shape) * itemsize + len(tail)
