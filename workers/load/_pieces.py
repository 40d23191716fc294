"""Where a box's bytes are: the pieces of each stored chunk a box touches, and where each lands
in the box's buffer (the geometry of direct reads, :mod:`._direct`).

A piece is the range of its chunk the box needs when that is one range of the chunk, and
otherwise the whole chunk, of which the box keeps a part: placed straight into the box with an
iovec per run when the runs are long, else through a scratch buffer and a copy. Every chunk
whose checksum is to be checked is read whole.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from milepost.workers._boxes import Box

# Element types whose zarr3 "bytes" encoding is not simply the NumPy buffer.
_PACKED_DTYPES = frozenset({"int2", "int4", "uint2", "uint4", "float4_e2m1fn"})


@dataclass(frozen=True)
class ShardLayout:
    """What a direct read needs to know about one array (from its zarr.json)."""

    name: str
    shard_shape: tuple[int, ...]
    dtype: np.dtype
    separator: str
    chunk_shape: tuple[int, ...] = ()
    """The inner chunks' shape (a shard holds one or several; () : one, the shard itself)."""
    shape: tuple[int, ...] = ()
    """The array's shape (() : not known; then every chunk is taken to lie inside it)."""

    @property
    def chunk(self) -> tuple[int, ...]:
        return self.chunk_shape or self.shard_shape


def shard_layout(
    name: str, store: Any, metadata: dict[str, Any] | None = None
) -> ShardLayout | None:
    """The array's layout when its shards can be read directly, else None. ``metadata``: the
    array's zarr metadata, if the caller has it (else it is taken from ``store``'s spec)."""
    if sys.byteorder != "little":
        return None
    if metadata is None:
        metadata = store.spec().to_json().get("metadata", {})
    try:
        grid = metadata["chunk_grid"]
        if grid.get("name") != "regular":
            return None
        shard_shape = tuple(int(n) for n in grid["configuration"]["chunk_shape"])
        (codec,) = metadata["codecs"]
        config = codec.get("configuration", {})
        chunk_shape = tuple(int(n) for n in config.get("chunk_shape", ()))
        shape = tuple(int(n) for n in metadata.get("shape", store.shape))
        encoding = metadata.get("chunk_key_encoding", {"name": "default"})
    except (KeyError, TypeError, ValueError):
        return None
    dtype = store.dtype.numpy_dtype
    if (
        codec.get("name") != "sharding_indexed"
        # inner chunks that tile the shard (zarr3 requires it; checked, not assumed)
        or len(chunk_shape) != len(shard_shape)
        or len(shape) != len(shard_shape)
        or any(c <= 0 or s % c for c, s in zip(chunk_shape, shard_shape, strict=True))
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
    return ShardLayout(
        name=name,
        shard_shape=shard_shape,
        dtype=dtype,
        separator=separator,
        chunk_shape=chunk_shape if chunk_shape != shard_shape else (),
        shape=shape,
    )


def _is_plain_bytes(codecs: Any) -> bool:
    return (
        isinstance(codecs, list)
        and len(codecs) == 1
        and codecs[0].get("name") == "bytes"
        and codecs[0].get("configuration", {}).get("endian", "little") == "little"
    )


@dataclass(frozen=True)
class BoxRead:
    """One piece of a box: what one inner chunk holds of it, read from the chunk's stored bytes
    (a range of them, or the whole chunk) into the box buffer.

    Three kinds: a range of the chunk that is one range of the box's buffer (``scatter`` None);
    a piece that is not one range of the box's buffer, read straight into its place in the box
    with one iovec per run (``in_place``; the rest of the chunk into a scratch buffer, so that
    the whole chunk can be checked); or read into a scratch buffer of its own, checked, and
    copied into place (runs too short for an iovec each).
    """

    key: str
    """The storage key of the shard value holding the chunk."""
    offset_in_chunk: int
    """Where the bytes read start in the chunk."""
    chunk_nbytes: int
    offset_in_box: int = 0
    nbytes: int = -1
    """Bytes of the box the piece fills (-1: the whole destination)."""
    grid: tuple[int, ...] = ()
    """The chunk's index in the array's (inner) chunk grid: what its checksum is recorded under."""
    scatter: Box | None = None
    """Where the piece lands in the box, when that is not one range of the box's buffer."""
    chunk: int = 0
    """The chunk's place in its shard (C order of the shard's inner grid): its shard index entry."""
    chunks: int = 1
    """Inner chunks per shard (entries in the shard index)."""
    read_nbytes: int = -1
    """Bytes read from ``offset_in_chunk`` on (-1: ``nbytes``); the whole chunk when only part of
    it is kept, so that it can be checked."""
    read_shape: tuple[int, ...] = ()
    """With ``scatter``: the shape of what is read (the chunk's when it is read whole)."""
    within: Box | None = None
    """With ``scatter``: the part of what is read that lands there (None: all of it)."""
    in_place: bool = False
    """With ``scatter``: read straight into place, one iovec per run of the piece."""

    @property
    def length(self) -> int:
        """Bytes read from the chunk (-1: the whole destination)."""
        return self.nbytes if self.read_nbytes < 0 else self.read_nbytes

    @property
    def whole(self) -> bool:
        """The piece reads its whole chunk (so the chunk's checksum can be checked)."""
        return self.offset_in_chunk == 0 and self.length == self.chunk_nbytes

    @property
    def scratch(self) -> int:
        """Bytes read beside the box (a scratch buffer of their own) while the piece is in
        flight."""
        if self.scatter is None:
            return 0
        return self.length - self.nbytes if self.in_place else self.length


_IN_PLACE_RUN_BYTES = 4 << 10
"""A piece strided in the box whose runs are at least this long is read straight into place,
an iovec per run, and checksummed there (shorter runs: a buffer of its own and a copy, whose
fresh memory costs more to fault in; docs/performance.md#code-figures)."""

_MAX_PIECES = 1 << 16
"""Boxes touching more chunks are read through TensorStore (planning a piece costs microseconds:
65,536 of them are a fraction of a second against the 64 GiB they would be at 1 MiB each)."""


def box_reads(layout: ShardLayout, box: Box, whole_chunks: bool = False) -> list[BoxRead] | None:
    """The pieces of ``box``, one per inner chunk it touches; None when it cannot be read
    directly (more than ``_MAX_PIECES`` pieces, or a chunk to be read whole that reaches past
    the array's edge, whose stored padding no checksum covers).

    A piece is the range of its chunk the box needs when that is one range of the chunk, and
    ``whole_chunks`` is False (no checksums to check) or the piece is the whole chunk; otherwise
    the whole chunk is read and the box's part of it placed. That covers a box equal to a saved
    shard (its chunks, one after another), a run of whole rows of one, boxes spanning the
    shards replica-parallel saving cut along any axis, and resharded boxes that keep part of
    each chunk they touch.
    """
    if not box or any(b <= a for a, b in box):
        return None
    shape, chunk = layout.shard_shape, layout.chunk
    if all(a % s == 0 and b - a == s for (a, b), s in zip(box, shape, strict=True)) and (
        not layout.chunk_shape or _contiguous([(0, c) for c in chunk], shape)
    ):
        return _one_shard(layout, box)
    spans = [range(a // c, (b - 1) // c + 1) for (a, b), c in zip(box, chunk, strict=True)]
    if math.prod(len(r) for r in spans) > _MAX_PIECES:
        return None
    pieces = []
    for grid in itertools.product(*spans):
        piece = _piece(layout, box, grid, whole_chunks)
        if piece is None:
            return None
        pieces.append(piece)
    return pieces


def _one_shard(layout: ShardLayout, box: Box) -> list[BoxRead]:
    """Exactly one saved shard (the usual case) of one chunk, or of chunks that lie one after
    another in it (row bands): each whole chunk into its range of the box."""
    shape, chunk = layout.shard_shape, layout.chunk
    chunk_nbytes = math.prod(chunk) * layout.dtype.itemsize
    per_shard = tuple(s // c for s, c in zip(shape, chunk, strict=True))
    grid = tuple(a // s for (a, _), s in zip(box, shape, strict=True))
    key = layout.name + "/c" + "".join(layout.separator + str(g) for g in grid)
    if not layout.chunk_shape:
        return [
            BoxRead(
                key=key,
                offset_in_chunk=0,
                chunk_nbytes=chunk_nbytes,
                offset_in_box=0,
                nbytes=chunk_nbytes,
                grid=grid,
            )
        ]
    first = [g * k for g, k in zip(grid, per_shard, strict=True)]
    return [
        BoxRead(
            key=key,
            offset_in_chunk=0,
            chunk_nbytes=chunk_nbytes,
            offset_in_box=i * chunk_nbytes,
            nbytes=chunk_nbytes,
            grid=tuple(f + j for f, j in zip(first, inner, strict=True)),
            chunk=i,
            chunks=math.prod(per_shard),
        )
        for i, inner in enumerate(itertools.product(*(range(k) for k in per_shard)))
    ]


def _piece(
    layout: ShardLayout, box: Box, grid: tuple[int, ...], whole_chunks: bool
) -> BoxRead | None:
    """The read of the inner chunk at ``grid`` for ``box``: the range the box needs when that is
    one range of the chunk (and ``whole_chunks`` allows it), else the whole chunk with the box's
    part placed; None when the chunk must be read whole but reaches past the array's edge."""
    chunk, itemsize = layout.chunk, layout.dtype.itemsize
    if (
        whole_chunks
        and layout.shape
        and any((g + 1) * c > n for g, c, n in zip(grid, chunk, layout.shape, strict=True))
    ):
        return None
    chunk_nbytes = math.prod(chunk) * itemsize
    per_shard = tuple(s // c for s, c in zip(layout.shard_shape, chunk, strict=True))
    box_shape = tuple(b - a for a, b in box)
    # the piece: box ∩ chunk, in global coordinates
    piece = [
        (max(a, g * c), min(b, (g + 1) * c)) for (a, b), g, c in zip(box, grid, chunk, strict=True)
    ]
    in_chunk = tuple(
        (a - g * c, b - g * c) for (a, b), g, c in zip(piece, grid, chunk, strict=True)
    )
    in_box = tuple((a - ba, b - ba) for (a, b), (ba, _) in zip(piece, box, strict=True))
    shard_grid = [g // k for g, k in zip(grid, per_shard, strict=True)]
    position = _offset([(g % k, 0) for g, k in zip(grid, per_shard, strict=True)], per_shard)
    nbytes = math.prod(b - a for a, b in piece) * itemsize
    whole = all(r == (0, c) for r, c in zip(in_chunk, chunk, strict=True))
    key = layout.name + "/c" + "".join(layout.separator + str(g) for g in shard_grid)
    if _contiguous(in_chunk, chunk) and (whole or not whole_chunks):
        offset_in_chunk = _offset(in_chunk, chunk) * itemsize
        if _contiguous(in_box, box_shape):
            return BoxRead(
                key=key,
                offset_in_chunk=offset_in_chunk,
                chunk_nbytes=chunk_nbytes,
                offset_in_box=_offset(in_box, box_shape) * itemsize,
                nbytes=nbytes,
                grid=tuple(grid),
                chunk=position,
                chunks=math.prod(per_shard),
            )
        read_shape = tuple(b - a for a, b in in_chunk)
        within = None
    else:  # the whole chunk, of which the box keeps a part
        offset_in_chunk, read_shape, within = 0, chunk, in_chunk
    full = within or tuple((0, n) for n in read_shape)
    return BoxRead(
        key=key,
        offset_in_chunk=offset_in_chunk,
        chunk_nbytes=chunk_nbytes,
        nbytes=nbytes,
        grid=tuple(grid),
        scatter=in_box,
        chunk=position,
        chunks=math.prod(per_shard),
        read_nbytes=math.prod(read_shape) * itemsize,
        read_shape=read_shape,
        within=within,
        in_place=_run_bytes(full, read_shape, in_box, box_shape, itemsize) >= _IN_PLACE_RUN_BYTES,
    )


def _contiguous(sub: Sequence[tuple[int, int]], shape: tuple[int, ...]) -> bool:
    """Whether ``sub`` (a box inside an array of ``shape``) is one range of the C-order buffer:
    after the first dimension with more than one index, every dimension is taken whole."""
    dims = len(shape)
    first = next((d for d in range(dims) if sub[d][1] - sub[d][0] > 1), dims - 1)
    return all(sub[d] == (0, shape[d]) for d in range(first + 1, dims))


def _offset(sub: Sequence[tuple[int, int]], shape: tuple[int, ...]) -> int:
    """Elements before the first element of ``sub`` in the C-order buffer of ``shape``."""
    return sum(a * math.prod(shape[d + 1 :]) for d, (a, _) in enumerate(sub))


def _cut(within: Box, shape: tuple[int, ...], place: Box, box_shape: tuple[int, ...]) -> int:
    """The dimension the runs of a piece are cut at: after it, both the piece's source
    (``within`` an array of ``shape``) and its place in the box (``place`` in ``box_shape``)
    take every dimension whole."""
    j = len(shape) - 1
    while j > 0 and within[j] == (0, shape[j]) and place[j] == (0, box_shape[j]):
        j -= 1
    return j


def _run_bytes(
    within: Box, shape: tuple[int, ...], place: Box, box_shape: tuple[int, ...], itemsize: int
) -> int:
    """The length of the piece's runs: its stretches contiguous both where it is read from and
    where it lands."""
    j = _cut(within, shape, place, box_shape)
    return (within[j][1] - within[j][0]) * math.prod(shape[j + 1 :]) * itemsize


def runs(
    within: Box, shape: tuple[int, ...], place: Box, box_shape: tuple[int, ...], itemsize: int
) -> tuple[list[int], list[int], int]:
    """The piece's runs in the order they are read: their byte offsets in what is read and in
    the box buffer, and their length (offsets worked out by NumPy: a band has a run per row)."""
    j = _cut(within, shape, place, box_shape)
    length = (within[j][1] - within[j][0]) * math.prod(shape[j + 1 :]) * itemsize
    source = np.array(
        sum(w[0] * math.prod(shape[d + 1 :]) for d, w in enumerate(within)) * itemsize, np.int64
    )
    target = np.array(
        sum(p[0] * math.prod(box_shape[d + 1 :]) for d, p in enumerate(place)) * itemsize, np.int64
    )
    for d in range(j):
        steps = np.arange(within[d][1] - within[d][0], dtype=np.int64)
        source = source[..., None] + steps * (math.prod(shape[d + 1 :]) * itemsize)
        target = target[..., None] + steps * (math.prod(box_shape[d + 1 :]) * itemsize)
    return source.reshape(-1).tolist(), target.reshape(-1).tolist(), length
