"""Save planning: which host writes which box of which array, and the on-disk chunking."""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from typing import Any

import numpy as np

from milepost import workers
from milepost.workers import Region, ShardingSpec

Box = tuple[tuple[int, int], ...]


def sharding_spec(sharding: Any) -> ShardingSpec | None:
    """A device-free description of ``sharding`` (None when it is neither named nor single)."""
    if isinstance(sharding, ShardingSpec):
        return sharding
    spec = getattr(sharding, "milepost_spec", None)
    if isinstance(spec, ShardingSpec):
        return spec
    try:
        return ShardingSpec.from_jax(sharding)
    except TypeError:
        return None


def device_boxes(sharding: Any, shape: tuple[int, ...]) -> dict[int, Box]:
    spec = sharding_spec(sharding)
    if spec is not None:
        return spec.device_indices(shape)
    out: dict[int, Box] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        out[device.id] = tuple(
            (s.start or 0, n if s.stop is None else s.stop)
            for s, n in zip(index, shape, strict=True)
        )
    return out


def write_regions(
    boxes: dict[int, Box],
    replica_parallel: bool,
    itemsize: int = 1,
    turn: int = 0,
    min_write_bytes: int = 0,
) -> tuple[tuple[int, ...], list[Region]]:
    """Choose who writes what: one replica per distinct box, or the box split among up to as
    many replicas as hold it, into parts of at least ``min_write_bytes``.

    A box written whole goes to one of its replicas in turn (``turn``: the array's number), so
    the small arrays of a tree spread over the hosts instead of all landing on the first.
    Returns the write shape (zarr chunk shape, identical for every region) and the regions.
    """
    replicas: dict[Box, list[int]] = defaultdict(list)
    for device_id, box in boxes.items():
        replicas[box].append(device_id)
    first = next(iter(replicas))
    shard_shape = tuple(b - a for a, b in first)
    count = min(len(d) for d in replicas.values())
    pieces, axis = 1, 0
    if replica_parallel and count > 1:
        nbytes = math.prod(shard_shape) * itemsize
        most = min(count, nbytes // min_write_bytes) if min_write_bytes else count
        for i, n in enumerate(shard_shape):  # the most pieces along one axis, outermost first
            fits = [d for d in _divisors(n) if d <= most and (min_write_bytes or d == count)]
            k = max(fits, default=1)
            if k > pieces:
                pieces, axis = k, i
    regions: list[Region] = []
    for j, (box, devices) in enumerate(replicas.items()):
        ordered = sorted(devices)
        shift = (turn + j) % len(ordered) if replica_parallel else 0
        ordered = ordered[shift:] + ordered[:shift]
        if pieces == 1:
            regions.append(Region(device_id=ordered[0], index=box))
            continue
        step = shard_shape[axis] // pieces
        for k, device_id in enumerate(ordered[:pieces]):
            start = box[axis][0] + k * step
            sub = (*box[:axis], (start, start + step), *box[axis + 1 :])
            regions.append(Region(device_id=device_id, index=sub))
    if pieces == 1:
        return tuple(max(1, n) for n in shard_shape), regions
    write_shape = (*shard_shape[:axis], shard_shape[axis] // pieces, *shard_shape[axis + 1 :])
    return tuple(max(1, n) for n in write_shape), regions


AUTO_BAND_BYTES = 1 << 20
"""The band size the default chunking (``SaveOptions.chunk_byte_size="auto"``) aims at."""


def inner_chunk_shape(
    write_shape: tuple[int, ...], itemsize: int, chunk_byte_size: int | str | None
) -> tuple[int, ...]:
    """Cut ``write_shape`` into inner chunks of at most ``chunk_byte_size`` bytes that divide it
    (``"auto"``: :func:`auto_chunk_shape`; None: one chunk, the write shape).

    The outermost dimension is divided first (by its smallest prime factor, again and again),
    then the next: chunks are bands of whole rows, each one contiguous in the written shard. A
    load onto more devices along the first axis (the paper's (2, 4) -> (8, 1)) then reads only
    the bands it keeps, and the chunks are written, checked and read without strided copies.
    """
    shape = list(write_shape)
    if chunk_byte_size is None:
        return tuple(shape)
    if chunk_byte_size == "auto":
        return auto_chunk_shape(tuple(write_shape), itemsize)
    assert isinstance(chunk_byte_size, int)
    while math.prod(shape) * itemsize > chunk_byte_size:
        i = next((i for i, n in enumerate(shape) if n > 1), None)
        if i is None:
            break
        shape[i] //= _smallest_factor(shape[i])
    return tuple(shape)


@functools.lru_cache(maxsize=4096)
def auto_chunk_shape(write_shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """The default chunking: a written shard of at least 2 MiB is cut into bands of whole rows
    of about 1 MiB (``AUTO_BAND_BYTES``); smaller shards stay one chunk.

    Dimensions are taken outermost first: one whose single index holds at least two bands is
    cut to 1, and the next one is cut into bands of ``b`` indices, ``b`` the divisor of its size
    that brings a band nearest 1 MiB (by ratio; at least 256 KiB). A band is then always one
    range of the shard (it is read and checked in place), and a size without a fitting divisor
    (a prime number of rows) makes fewer, larger bands rather than tiny ones.

    Why: with direct reads of banded shards, same-topology saves and loads cost what they cost
    unchunked, and a resharded load that keeps part of each saved shard reads only the bands it
    keeps instead of whole shards (docs/performance.md has the figures).
    """
    total = math.prod(write_shape) * itemsize
    if total < 2 * AUTO_BAND_BYTES:
        return write_shape
    shape = list(write_shape)
    for d, n in enumerate(write_shape):
        row = math.prod(write_shape[d + 1 :]) * itemsize  # bytes of one index of dimension d
        if row >= 2 * AUTO_BAND_BYTES:
            shape[d] = 1
            continue
        fits = [
            b for b in _divisors(n) if b * row >= AUTO_BAND_BYTES // 4
        ]  # (n itself always fits)
        shape[d] = min(fits, key=lambda b: (abs(math.log(b * row / AUTO_BAND_BYTES)), -b))
        break
    return tuple(shape)


def _divisors(n: int) -> list[int]:
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return sorted(set(small + [n // k for k in small]))


def _smallest_factor(n: int) -> int:
    for p in range(2, math.isqrt(n) + 1):
        if n % p == 0:
            return p
    return n


def host_array_spec(
    name: str, value: np.ndarray, compression: str | None, chunk_byte_size: int | str | None = None
) -> workers.ArraySpec:
    shape = tuple(value.shape)
    write_shape = tuple(max(1, n) for n in shape)
    return workers.ArraySpec(
        name=name,
        shape=shape,
        dtype=value.dtype.name,
        write_shape=write_shape,
        chunk_shape=inner_chunk_shape(write_shape, value.dtype.itemsize, chunk_byte_size),
        compression=compression,
    )
