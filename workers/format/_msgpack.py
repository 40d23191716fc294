"""Msgpack checkpoints: Flax's ``flax.serialization`` files (``flax_model.msgpack`` on model hubs,
``flax.training.checkpoints``' ``checkpoint_<step>``) and the aggregate ``checkpoint`` file of
Orbax's PyTree handler.

The format: msgpack maps of string keys (lists were saved as maps with keys ``"0"``,
``"1"``...), whose leaves are msgpack scalars and strings, or extension objects: code 1 an
array, code 3 a NumPy scalar, each holding the msgpack triple ``(shape, dtype name, C-order
bytes)``, and code 2 a complex number ``(real, imag)``. Arrays over 1 GiB were split into flat
chunks (``{"__msgpack_chunked_array__": true, "shape": ..., "chunks": {...}}``).

:func:`read_tree` walks the structure and records where each array's bytes lie (a
:class:`Tensor`, as for safetensors), so the hosts read only the ranges their devices need and
the bulk never passes through the reader. Nothing in the file is executed: no pickle, no types
named by the file, only the dtypes below.
"""

from __future__ import annotations

import os
import struct
from typing import Any

import numpy as np

from milepost.workers import _declared as declared
from milepost.workers._declared import ZARR3_DTYPES
from milepost.workers._errors import CorruptCheckpointError
from milepost.workers._iostats import count_read
from milepost.workers.format._safetensors import Tensor, numpy_dtype

DTYPES = ZARR3_DTYPES
"""The dtypes an array of a msgpack checkpoint may have: those milepost stores (Flax refuses
object and structured dtypes when it writes; milepost refuses every other name when it reads)."""
CHUNKED = "__msgpack_chunked_array__"
MAX_DEPTH = declared.MAX_DEPTH
_ARRAY, _COMPLEX, _SCALAR = 1, 2, 3


def is_msgpack_tree(path: str) -> bool:
    """The file starts as a msgpack map does (every Flax and Orbax msgpack checkpoint is one)."""
    try:
        with open(path, "rb") as f:
            first = f.read(1)
    except OSError:
        return False
    return len(first) == 1 and (0x80 <= first[0] <= 0x8F or first[0] in (0xDE, 0xDF))


def read_tree(path: str) -> Any:
    """The tree of the msgpack file ``path``: nested dicts whose leaves are :class:`Tensor`
    (arrays, not read), NumPy scalars, Python scalars, strings, bytes and None. A file that is
    not well-formed (or that shrinks while it is read) is a CorruptCheckpointError naming it and
    the offset."""
    with open(path, "rb") as f:
        source = _FileWindow(f.fileno(), os.fstat(f.fileno()).st_size)
        if len(source) == 0:
            raise CorruptCheckpointError(f"{path} is empty; it is not a msgpack checkpoint")
        walker = _Walker(path, source)
        tree = walker.value(0)
        if walker.pos != len(source):
            raise walker.bad(f"{len(source) - walker.pos} bytes follow the tree")
        count_read(walker.read)
        return tree


class _FileWindow:
    """The bytes of a file, read on demand through a window of ``WINDOW`` bytes (``pread``: a
    file cut short while it is read gives short reads, an error, never a fault as a mapping
    would). Skipped ranges (the arrays' bytes) are never read."""

    WINDOW = 1 << 16

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size
        self.start, self.data = 0, b""

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, span: slice) -> bytes:
        lo, hi = span.start, span.stop
        if not (self.start <= lo and hi <= self.start + len(self.data)):
            want = max(hi - lo, self.WINDOW)
            self.start, self.data = lo, os.pread(self.fd, min(want, self.size - lo), lo)
            if len(self.data) < hi - lo:
                raise OSError(f"the file ended at byte {lo + len(self.data)} while being read")
        return self.data[lo - self.start : hi - self.start]


def read_tree_bytes(data: bytes, where: str) -> Any:
    """The tree of a msgpack file already in memory (``where`` names it in errors), its arrays
    as NumPy arrays: for the small aggregate file of an Orbax tree."""
    walker = _Walker(where, data, arrays_in_memory=True)
    if not data:
        raise walker.bad("the file is empty")
    tree = walker.value(0)
    if walker.pos != len(data):
        raise walker.bad(f"{len(data) - walker.pos} bytes follow the tree")
    return tree


def read_leaves(path: str) -> dict[str, Any]:
    """:func:`flat_leaves` of :func:`read_tree`: the leaves of the msgpack file ``path``."""
    return flat_leaves(read_tree(path), path, os.path.getsize(path))


def flat_leaves(tree: Any, where: str, file_bytes: int = 0) -> dict[str, Any]:
    """The leaves of a msgpack tree by name: key paths joined by '.' (list items by their
    index); an empty map or list is a leaf (but for the root: an empty tree has no leaves). Two
    key paths that join to one name (``{"a.b": x}`` beside ``{"a": {"b": y}}``), or a leaf's
    name that another's starts with (``{"a": x}`` beside ``{"a.b": y}``), are a
    CorruptCheckpointError: the leaves could not be told apart, or the tree rebuilt. So is a
    name beyond :mod:`._declared`'s bounds, or names that together come to more than its
    :class:`~._declared.NameBudget` for a file of ``file_bytes``. Each name is made once from
    its parent's, and checked once: time and memory in proportion to the names made."""
    out: dict[str, Any] = {}
    budget = declared.NameBudget(file_bytes, where)
    stack: list[tuple[str | None, Any]] = [(None, tree)]
    while stack:  # (depth first, children in order: the leaves come in the file's order)
        prefix, node = stack.pop()
        if isinstance(node, dict | list) and node:
            items = node.items() if isinstance(node, dict) else enumerate(node)
            children = []
            for key, child in items:
                name = str(key) if prefix is None else f"{prefix}.{key}"
                budget.spend(name)  # (before the next is made: never past the budget)
                children.append((declared.name(name, where, "a leaf's name"), child))
            stack.extend(reversed(children))
            continue
        if prefix is None and isinstance(node, dict | list):  # (an empty tree: no leaves)
            break
        name = "_root" if prefix is None else prefix
        if name in out:
            raise CorruptCheckpointError(
                f"{where}: two key paths both name the leaf {name!r} (milepost joins key parts "
                "with '.'), so neither can be loaded by name; rename one in the file's tree",
                path=where,
            )
        out[name] = node
    clash = declared.conflict(out)
    if clash is not None:  # {"a": {}} or {"a.b": x} beside {"a": {"b": {"c": y}}}
        raise CorruptCheckpointError(
            f"{where}: the leaf {clash[0]!r} is also the start of the leaf {clash[1]!r} "
            "(milepost joins key parts with '.'), so the tree cannot be rebuilt; "
            "rename one in the file's tree",
            path=where,
        )
    return out


class _Walker:
    def __init__(
        self, path: str, view: _FileWindow | bytes, *, arrays_in_memory: bool = False
    ) -> None:
        self.path, self.view, self.pos, self.read = path, view, 0, 0
        self.arrays_in_memory = arrays_in_memory

    def bad(self, why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self.path} is not a valid msgpack checkpoint: {why} (at byte {self.pos}); the "
            "file is damaged or not a Flax/Orbax msgpack file"
        )

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.view):
            raise self.bad(f"{n} bytes are needed but the file ends")
        try:
            out = self.view[self.pos : self.pos + n]
        except OSError as e:
            raise self.bad(str(e)) from None
        self.pos += n
        self.read += n
        return out

    def skip(self, n: int) -> int:
        """Pass over ``n`` bytes without reading them; their offset."""
        if n < 0 or self.pos + n > len(self.view):
            raise self.bad(f"{n} bytes are needed but the file ends")
        start, self.pos = self.pos, self.pos + n
        return start

    def number(self, fmt: str) -> Any:
        raw = self.take(struct.calcsize(fmt))
        return struct.unpack(">" + fmt, raw)[0]

    def count(self, n: int) -> int:
        if n > len(self.view) - self.pos:  # every entry takes a byte at least
            raise self.bad(f"a count of {n} entries is larger than the rest of the file")
        return n

    def value(self, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise self.bad(f"it nests deeper than {MAX_DEPTH} levels")
        b = self.take(1)[0]
        if b <= 0x7F:
            return b
        if b >= 0xE0:
            return b - 0x100
        if 0x80 <= b <= 0x8F:
            return self.mapping(b & 0x0F, depth)
        if 0x90 <= b <= 0x9F:
            return [self.value(depth + 1) for _ in range(self.count(b & 0x0F))]
        if 0xA0 <= b <= 0xBF:
            return self.text(b & 0x1F)
        simple: dict[int, Any] = {0xC0: None, 0xC2: False, 0xC3: True}
        if b in simple:
            return simple[b]
        numbers = {0xCA: "f", 0xCB: "d", 0xCC: "B", 0xCD: "H", 0xCE: "I", 0xCF: "Q"}
        numbers.update({0xD0: "b", 0xD1: "h", 0xD2: "i", 0xD3: "q"})
        if b in numbers:
            return self.number(numbers[b])
        lengths = {0xC4: "B", 0xC5: "H", 0xC6: "I", 0xD9: "B", 0xDA: "H", 0xDB: "I"}
        if b in (0xC4, 0xC5, 0xC6):
            return bytes(self.take(self.number(lengths[b])))
        if b in (0xD9, 0xDA, 0xDB):
            return self.text(self.number(lengths[b]))
        if b in (0xDC, 0xDD):
            n = self.count(self.number("H" if b == 0xDC else "I"))
            return [self.value(depth + 1) for _ in range(n)]
        if b in (0xDE, 0xDF):
            return self.mapping(self.number("H" if b == 0xDE else "I"), depth)
        if 0xD4 <= b <= 0xD8:
            return self.extension(1 << (b - 0xD4))
        if b in (0xC7, 0xC8, 0xC9):
            return self.extension(self.number({0xC7: "B", 0xC8: "H", 0xC9: "I"}[b]))
        raise self.bad(f"byte 0x{b:02x} starts no msgpack value")

    def text(self, n: int) -> str:
        try:
            return self.take(n).decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.bad(f"a string is not UTF-8 ({e})") from None

    def mapping(self, n: int, depth: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for _ in range(self.count(n)):
            key = self.value(depth + 1)
            if isinstance(key, int) and not isinstance(key, bool):
                key = str(key)
            if not isinstance(key, str):
                raise self.bad(f"a map key is a {type(key).__name__}, not a string")
            if key in out:
                raise self.bad(f"the key {key!r} appears twice in one map")
            out[key] = self.value(depth + 1)
        if out.get(CHUNKED) is True:
            # Its pieces are flat and not contiguous, so it cannot be read by ranges.
            raise self.bad(
                "it holds an array over 1 GiB that Flax split into chunks, which milepost does "
                "not read; restore the file with flax.serialization.msgpack_restore and save "
                "the tree with milepost"
            )
        return out

    def extension(self, n: int) -> Any:
        code = struct.unpack(">b", self.take(1))[0]
        end = self.pos + n
        if code == _COMPLEX:
            pair = self.value(MAX_DEPTH - 2)
            if not (
                isinstance(pair, list)
                and len(pair) == 2
                and all(isinstance(x, int | float) and not isinstance(x, bool) for x in pair)
            ):
                raise self.bad(f"a complex number is {pair!r}")
            value: Any = complex(pair[0], pair[1])
        elif code in (_ARRAY, _SCALAR):
            value = self.array(code == _SCALAR)
        else:
            raise self.bad(f"extension type {code} is not one Flax or Orbax writes")
        if self.pos != end:
            raise self.bad(f"an extension of {n} bytes holds {self.pos - end + n}")
        return value

    def array(self, scalar: bool) -> Any:
        b = self.take(1)[0]
        if b != 0x93:
            raise self.bad("an array is not the triple (shape, dtype, bytes)")
        at = self.pos
        shape = self.value(MAX_DEPTH - 2)
        if scalar and shape != []:
            raise self.bad(f"an array scalar's shape is {declared.shown(shape)}, not []")
        field = f"the shape of the array at byte {at}"
        shape = declared.shape(shape, self.path, field)
        name = self.value(MAX_DEPTH)
        name = name.decode("ascii", "replace") if isinstance(name, bytes) else name
        declared.dtype(name, DTYPES, self.path, f"the dtype of the array at byte {at}")
        kind = self.take(1)[0]
        if kind not in (0xC4, 0xC5, 0xC6):
            raise self.bad("an array's data is not a byte string")
        n = self.number({0xC4: "B", 0xC5: "H", 0xC6: "I"}[kind])
        dtype = numpy_dtype(name)
        expected = declared.nbytes(shape, dtype.itemsize, self.path, field)
        if n != expected:
            raise self.bad(f"an array of shape {tuple(shape)} {name} has {n} bytes, not {expected}")
        if scalar:
            return np.frombuffer(self.take(n), dtype=dtype).reshape(shape)[()]
        if self.arrays_in_memory:
            return np.frombuffer(self.take(n), dtype=dtype).reshape(shape).copy()
        offset = self.skip(n)
        return Tensor(path=self.path, name="", dtype=name, shape=tuple(shape), offset=offset)
