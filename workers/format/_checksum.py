"""Chunk checksums: the CRC32C (Castagnoli) of each stored chunk's values, in C order.

The host that writes a chunk computes it from the values it writes; the commit records it by
array and chunk-grid index (in the checkpointable's ``_milepost.json``); every read checks the
values it got against it before they reach a device. Being a checksum of the values rather than
of the encoded bytes, it is the same for compressed and uncompressed chunks, and it ties the
values to their place: data read from the wrong file or the wrong chunk fails it too.

The ``crc32c`` package computes it in hardware (SSE4.2 / ARMv8 CRC instructions) and releases
the GIL, so host threads check while other threads read.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator

import crc32c as _crc32c
import numpy as np

from milepost.workers._errors import CorruptCheckpointError

Grid = tuple[int, ...]
"""A chunk's index in the array's chunk grid."""


def crc32c(data: np.ndarray | bytes | memoryview, value: int = 0) -> int:
    """CRC32C of a contiguous buffer, continuing from ``value``."""
    # (numpy's stubs give ndarray the buffer protocol only for Python >= 3.12)
    return int(_crc32c.crc32c(data, value))  # type: ignore[arg-type]


def crc32c_of(buffers: Iterable[np.ndarray | bytes | memoryview]) -> int:
    """CRC32C of ``buffers`` one after another (e.g. the rows of a chunk read into place)."""
    value = 0
    compute = _crc32c.crc32c
    for buffer in buffers:
        value = compute(buffer, value)  # type: ignore[arg-type]  # as in crc32c()
    return int(value)


def _contiguous_tail(array: np.ndarray) -> int:
    """How many trailing dimensions of ``array`` form one contiguous C-order block."""
    expected = array.itemsize
    k = 0
    for n, stride in zip(reversed(array.shape), reversed(array.strides), strict=True):
        if n != 1 and stride != expected:
            break
        expected *= n
        k += 1
    return k


_RUN_BYTES = 4 << 10
"""Contiguous runs at least this long are checksummed in place, a call per run; shorter ones
after one copy (a call per short run costs more than a copy). A copy needs fresh memory, whose
first touch is what costs on a VM that hands freed memory back (docs/performance.md#code-figures
has the figures)."""


def values_crc32c(array: np.ndarray) -> int:
    """CRC32C of ``array``'s values in C order, without copying when its runs are long."""
    if array.size == 0:
        return 0
    if array.flags.c_contiguous:
        return crc32c(array)
    tail = _contiguous_tail(array)
    if tail == 0 or math.prod(array.shape[array.ndim - tail :]) * array.itemsize < _RUN_BYTES:
        return crc32c(np.ascontiguousarray(array))
    value = 0
    for index in np.ndindex(*array.shape[: array.ndim - tail]):
        value = crc32c(array[index], value)
    return value


def grid_indices(counts: Iterable[int]) -> Iterator[Grid]:
    """Every index of a grid of ``counts`` per dimension, in C order, one at a time and in
    constant memory (``itertools.product`` first makes a tuple of each range: a crafted header's
    grid of 2**30 by 2**30 would be eight gigabytes before the first index)."""
    dims = tuple(counts)
    if any(n <= 0 for n in dims):
        return
    index = [0] * len(dims)
    while True:
        yield tuple(index)
        axis = len(dims) - 1
        while axis >= 0:
            index[axis] += 1
            if index[axis] < dims[axis]:
                break
            index[axis] = 0
            axis -= 1
        if axis < 0:
            return


def chunk_boxes(
    box: tuple[tuple[int, int], ...], chunk_shape: tuple[int, ...]
) -> Iterator[tuple[Grid, tuple[slice, ...]]]:
    """The chunks of a chunk-aligned ``box``: each one's grid index and its slices within the
    box."""
    ranges = [range(a // c, (b + c - 1) // c) for (a, b), c in zip(box, chunk_shape, strict=True)]
    for grid in itertools.product(*ranges):
        yield (
            grid,
            tuple(
                slice(g * c - a, min((g + 1) * c, b) - a)
                for g, c, (a, b) in zip(grid, chunk_shape, box, strict=True)
            ),
        )


def region_crc32c(
    data: np.ndarray, box: tuple[tuple[int, int], ...], chunk_shape: tuple[int, ...]
) -> list[tuple[Grid, int]]:
    """The checksum of every chunk of ``data``, which holds the chunk-aligned ``box``."""
    return [(grid, values_crc32c(data[local])) for grid, local in chunk_boxes(box, chunk_shape)]


def aligned_box(
    box: tuple[tuple[int, int], ...], chunk_shape: tuple[int, ...], shape: tuple[int, ...]
) -> tuple[tuple[int, int], ...]:
    """The smallest box of whole chunks (clipped to the array) containing ``box``."""
    return tuple(
        (a // c * c, min(math.ceil(b / c) * c, n))
        for (a, b), c, n in zip(box, chunk_shape, shape, strict=True)
    )


def grid_key(grid: Grid) -> str:
    """How a grid index is written in ``_milepost.json``: ``"1.0"`` (``""`` for 0-d arrays)."""
    return ".".join(map(str, grid))


def parse_grid_key(key: str) -> Grid:
    return tuple(int(part) for part in key.split(".")) if key else ()


def check(name: str, grid: Grid, got: int, expected: dict[Grid, int], where: str) -> None:
    """Raise a CorruptCheckpointError naming the array, the chunk and the file unless ``got``
    is the recorded checksum of chunk ``grid``."""
    want = expected.get(grid)
    if want is None:
        raise CorruptCheckpointError(
            f"array {name!r}: chunk {grid} ({where}) has no recorded checksum although the array's "
            "others do; the checkpoint's metadata is damaged. Load an earlier checkpoint.",
            array=name,
            chunk=grid,
            path=where,
        )
    if got != want:
        raise CorruptCheckpointError(
            f"array {name!r}: chunk {grid} read from {where} fails its checksum "
            f"(CRC32C {got:#010x}, recorded {want:#010x}): the data on disk is damaged "
            "or not this chunk's. Load an earlier checkpoint.",
            array=name,
            chunk=grid,
            path=where,
        )
