"""safetensors files: the format, reading boxes of their tensors, and writing them.

A file is an 8-byte little-endian header length N, N bytes of JSON (``{"name": {"dtype":
"F32", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {str: str}}``, padded
with spaces), then the tensors' bytes, C order, little-endian, offsets relative to ``8 + N``.
Sharded models add ``model.safetensors.index.json`` (``{"metadata": {"total_size": ...},
"weight_map": {tensor: file}}``).

A host reads only the byte ranges its devices need: a box that is one contiguous range goes
straight into the buffer its device adopts; otherwise the rows it spans are read in slabs (each
slab once, whatever boxes share it) and the boxes cut out of them.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from milepost.workers import _declared as declared
from milepost.workers._errors import CorruptCheckpointError
from milepost.workers._iostats import count_read, count_write
from milepost.workers._runtime import RUNTIME, Pool

DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "F16": "float16",
    "BF16": "bfloat16",
    "U32": "uint32",
    "I32": "int32",
    "F32": "float32",
    "U64": "uint64",
    "I64": "int64",
    "F64": "float64",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
}
"""safetensors dtype codes and the NumPy (ml_dtypes) dtype names they are."""
CODES = {name: code for code, name in DTYPES.items()}
MAX_HEADER = 100_000_000
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class Tensor:
    """Where one tensor's bytes are: ``offset`` is absolute in ``path``."""

    path: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(numpy_dtype(self.dtype)).itemsize


def numpy_dtype(name: str) -> Any:
    import ml_dtypes  # noqa: F401  (registers bfloat16 and the float8 types with NumPy)

    return np.dtype(name)


def read_header(path: str) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors of one file and its ``__metadata__``. The header must be what the reference
    implementation reads (at most ``MAX_HEADER`` bytes of UTF-8 JSON, a string map as
    ``__metadata__``, each tensor a known dtype, a shape of non-negative integers and
    ``data_offsets`` that hold exactly its bytes, the tensors back to back from the start of
    the data to the end of the file) and what :mod:`._declared` allows (no key twice, names
    within bounds); anything else is a CorruptCheckpointError naming the file and the field."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise declared.bad(path, "its header length", "is cut short (under 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            raise declared.bad(
                path,
                "its header length",
                f"is {n} bytes (at most {MAX_HEADER}; the file has {size})",
            )
        raw = f.read(n)
    header = declared.mapping(declared.loads(raw, path, "its header"), path, "its header")
    metadata = header.pop("__metadata__", None)
    metadata = {} if metadata is None else declared.strings(metadata, path, "__metadata__")
    base = 8 + n
    tensors: dict[str, Tensor] = {}
    spans: list[tuple[int, int, str]] = []
    for name, info in header.items():
        tensor, begin, end = _tensor(path, name, info, base)
        tensors[name] = tensor
        spans.append((begin, end, name))
    covered = 0
    for begin, end, name in sorted(spans):
        if begin != covered:
            raise declared.bad(
                path,
                f"the data_offsets of tensor {name!r}",
                f"begin at {begin}, where the tensors before end at {covered}: the tensors must "
                "lie back to back, without gaps or overlaps",
                array=name,
            )
        covered = end
    if base + covered != size:
        raise declared.bad(
            path,
            "its tensors' data_offsets",
            f"end {size - base - covered} bytes before the end of the file: the reference "
            "safetensors refuses bytes after the last tensor",
        )
    return tensors, metadata


def _tensor(path: str, name: str, info: Any, base: int) -> tuple[Tensor, int, int]:
    """One entry of a header: the tensor, and its data_offsets (checked against its shape)."""
    declared.name(name, path, "a tensor's name")
    info = declared.mapping(info, path, f"tensor {name!r}")
    code = declared.dtype(info.get("dtype"), DTYPES, path, f"the dtype of {name!r}", array=name)
    shape = declared.shape(info.get("shape"), path, f"the shape of {name!r}", array=name)
    nbytes = declared.nbytes(
        shape, numpy_dtype(DTYPES[code]).itemsize, path, f"the shape of {name!r}", array=name
    )
    offsets = info.get("data_offsets")
    field = f"the data_offsets of {name!r}"
    if not isinstance(offsets, list) or len(offsets) != 2:
        raise declared.bad(path, field, f"are {declared.shown(offsets)}, not [begin, end]")
    begin = declared.integer(offsets[0], path, field)
    end = declared.integer(offsets[1], path, field)
    if end - begin != nbytes:
        raise declared.bad(
            path,
            field,
            f"{[begin, end]} do not hold a {code} tensor of shape {list(shape)} ({nbytes} bytes)",
            array=name,
        )
    tensor = Tensor(path=path, name=name, dtype=DTYPES[code], shape=shape, offset=base + begin)
    return tensor, begin, end


def header_bytes(
    tensors: Sequence[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str] | None
) -> bytes:
    """The header of a file holding ``(name, numpy dtype name, shape, nbytes)`` tensors in this
    order, padded with spaces to a multiple of 8 bytes (length prefix included)."""
    body: dict[str, Any] = {}
    if metadata:
        body["__metadata__"] = dict(metadata)
    offset = 0
    for name, dtype, shape, nbytes in tensors:
        body[name] = {
            "dtype": CODES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(body, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


# ------------------------------------------------------------------------------------------
# Reading boxes
# ------------------------------------------------------------------------------------------

_SLAB_BYTES = 32 << 20
_THREADS = 4


def _contiguous(box: tuple[tuple[int, int], ...], shape: tuple[int, ...]) -> bool:
    first = next((d for d in range(len(shape)) if box[d][1] - box[d][0] > 1), len(shape) - 1)
    return all(box[d] == (0, shape[d]) for d in range(first + 1, len(shape)))


def _offset(box: tuple[tuple[int, int], ...], shape: tuple[int, ...]) -> int:
    return sum(a * math.prod(shape[d + 1 :]) for d, (a, _) in enumerate(box))


def _pread_into(fd: int, view: memoryview, position: int, where: str) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], position + done)
        count_read(max(got, 0))
        if got <= 0:
            raise CorruptCheckpointError(f"{where} is cut short at byte {position + done}")
        done += got


def _pool() -> Pool:
    return RUNTIME.pool("safetensors", _THREADS)


def read_boxes(
    tensor: Tensor, boxes: Iterable[tuple[tuple[tuple[int, int], ...], np.ndarray]]
) -> list[Future[int]]:
    """Start filling each ``out`` with its ``box`` of ``tensor`` on a few threads; the futures
    give the bytes each read took from the file.

    Contiguous boxes are read straight into ``out``; the others are cut out of slabs of whole
    rows (dimension 0), each slab read once for every box it serves (so a few threads hold a
    slab of at most 32 MiB each, and nothing else).
    """
    dtype = numpy_dtype(tensor.dtype)
    itemsize = dtype.itemsize
    shape = tensor.shape
    direct: list[tuple[tuple[tuple[int, int], ...], np.ndarray]] = []
    sliced: list[tuple[tuple[tuple[int, int], ...], np.ndarray]] = []
    for box, out in boxes:
        if math.prod(b - a for a, b in box) == 0:
            continue
        (direct if not shape or _contiguous(box, shape) else sliced).append((box, out))
    row_bytes = math.prod(shape[1:]) * itemsize if shape else itemsize
    slabs: list[tuple[int, int]] = []  # row ranges of the slabs, each at most _SLAB_BYTES
    for start, stop in _merge([box[0] for box, _ in sliced]):
        step = max(1, _SLAB_BYTES // max(row_bytes, 1))
        slabs.extend((r, min(r + step, stop)) for r in range(start, stop, step))
    where = f"tensor {tensor.name!r} in {tensor.path}"

    def read_direct(box: tuple[tuple[int, int], ...], out: np.ndarray) -> int:
        view = out.reshape(-1).view(np.uint8).data
        with _open(tensor.path) as fd:
            _pread_into(fd, view, tensor.offset + _offset(box, shape) * itemsize, where)
        return len(view)

    def read_slab(rows: tuple[int, int]) -> int:
        slab = np.empty((rows[1] - rows[0], *shape[1:]), dtype)
        with _open(tensor.path) as fd:
            _pread_into(
                fd,
                slab.reshape(-1).view(np.uint8).data,
                tensor.offset + rows[0] * row_bytes,
                where,
            )
        for box, out in sliced:  # the boxes' rows within the slab: disjoint across slabs
            lo, hi = max(box[0][0], rows[0]), min(box[0][1], rows[1])
            if lo < hi:
                src = slab[(slice(lo - rows[0], hi - rows[0]), *(slice(a, b) for a, b in box[1:]))]
                np.copyto(out[lo - box[0][0] : hi - box[0][0]], src)
        return slab.nbytes

    pool = _pool()
    return [pool.submit(read_direct, box, out) for box, out in direct] + [
        pool.submit(read_slab, rows) for rows in slabs
    ]


@contextlib.contextmanager
def _open(path: str) -> Iterator[int]:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        yield fd
    finally:
        os.close(fd)


def _merge(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


# ------------------------------------------------------------------------------------------
# Writing
# ------------------------------------------------------------------------------------------


def write_file(path: str, header: bytes, arrays: Iterable[np.ndarray]) -> int:
    """Write a file: ``header``, then each array's bytes in order (the header's order); fsync.
    Returns the bytes written."""
    with open(path, "wb") as f:
        f.write(header)
        written, requests = len(header), 1
        for array in arrays:
            data = np.ascontiguousarray(array)
            f.write(data.reshape(-1).view(np.uint8).data)
            written += data.nbytes
            requests += 1
        f.flush()
        os.fsync(f.fileno())
    count_write(written, requests)
    return written
