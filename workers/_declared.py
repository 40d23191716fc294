"""What a file declares, checked before anything is built from it: one set of rules for every
reader (safetensors headers, Flax msgpack structure, Orbax and milepost metadata, zarr headers).

A file is hostile until checked. Every number a reader takes from it is an ``int`` (``True`` is
not one; ``2.9`` is refused, never truncated) within the bounds below; its JSON has no duplicate
keys, no ``NaN``/``Infinity`` and no integers longer than Python writes; every name is bounded
in length and parts; every dtype is one milepost knows. A violation is a
:class:`~._errors.CorruptCheckpointError` naming the file (``path``) and the field (``field``),
raised before anything that size is allocated or walked. So a reader costs time and memory in
proportion to the file it reads, and whatever a file says, a reader's error is that one type.

The bounds, and why:

- ``MAX_RANK`` 64: NumPy's most dimensions (``NPY_MAXDIMS``); zarr headers ``MAX_ZARR_RANK``
  32, TensorStore's.
- ``MAX_BYTES`` 2**63: an array's bytes (its zero dimensions counted as 1, so no stride or
  offset overflows either) fit a signed 64-bit offset, what ``pread``, NumPy and TensorStore
  index with.
- ``MAX_NAME_BYTES`` 4,096 (``PATH_MAX``: a name is part of a path) and ``MAX_NAME_PARTS`` 256
  key parts per leaf name; a msgpack file's leaf names together at most 16 times the file, or
  64 MiB (:class:`NameBudget`): its names share their prefixes in the file, not in memory.
- ``MAX_DEPTH`` 256 levels of msgpack maps and lists; JSON nests no deeper than Python's
  parser recurses (its ``RecursionError`` is this error too).
- ``MAX_INT_DIGITS`` 4,300: Python's own limit, the longest integer ``json.dumps`` writes.
- ``MAX_DEVICES`` 2**20 device ids in one recorded mesh.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import numpy as np

from milepost.workers._errors import CorruptCheckpointError

MAX_RANK = 64
MAX_ZARR_RANK = 32
MAX_BYTES = 1 << 63
"""Exclusive: an array declares fewer bytes than this (its zero dimensions counted as 1)."""
MAX_NAME_BYTES = 4096
MAX_NAME_PARTS = 256
MAX_FOLDER_NAME_BYTES = 255
MAX_DEPTH = 256
MAX_INT_DIGITS = 4300
MAX_DEVICES = 1 << 20
NAME_BYTES_PER_FILE_BYTE = 16
NAME_BYTES_FLOOR = 64 << 20

ZARR3_DTYPES = frozenset(
    {
        "bool",
        "int2",
        "int4",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float4_e2m1fn",
        "float8_e3m4",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e4m3b11fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    }
)
"""NumPy dtype names that TensorStore's zarr3 driver can store: what a zarr3 header, and a
msgpack array, may declare."""


# ------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------


def shown(value: Any) -> str:
    """``value`` as an error message shows it: short, and never costly (a huge integer by its
    size, a container by its length)."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, int):
        return (
            str(value) if value.bit_length() <= 128 else f"an integer of {value.bit_length()} bits"
        )
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return repr(value if len(value) <= 60 else value[:57] + "...")
    if isinstance(value, list | tuple):
        simple = all(isinstance(v, bool | int | float | type(None)) for v in value)
        if len(value) <= 8 and simple:
            return "[" + ", ".join(shown(v) for v in value) + "]"
        return f"a list of {len(value)}"
    if isinstance(value, dict):
        return f"an object of {len(value)} keys"
    return type(value).__name__


def bad(path: str, field: str, why: str, *, array: str | None = None) -> CorruptCheckpointError:
    """The error for ``field`` of the file ``path`` (``why``: what is wrong with it)."""
    return CorruptCheckpointError(
        f"{path}: {field} {why}; the file is damaged or crafted, and nothing was read from it. "
        "Load an earlier checkpoint, or a file you trust.",
        array=array,
        path=path,
        field=field,
    )


# ------------------------------------------------------------------------------------------
# JSON
# ------------------------------------------------------------------------------------------


class _Duplicate(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _Duplicate(key)
            seen.add(key)
    return out


class _NotFinite(Exception):
    def __init__(self, text: str) -> None:
        self.text = text


def _no_constant(text: str) -> Any:
    raise _NotFinite(text)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotFinite(text)
    return value


def _bounded_int(text: str) -> int:
    if len(text) - text.startswith("-") > MAX_INT_DIGITS:
        raise ValueError("Exceeds the limit for integer string conversion")
    return int(text)


def loads(raw: bytes | str, path: str, what: str, *, user_data: bool = False) -> Any:
    """The JSON in ``raw`` (the file ``path``, described as ``what``): UTF-8, no key twice in an
    object, no ``NaN``, ``Infinity`` or number beyond a float's range, no integer over
    ``MAX_INT_DIGITS`` digits, nesting within what the parser recurses. ``user_data``: the
    file holds values a user gave (metrics, custom metadata), where Python's ``json`` writes
    ``NaN`` and ``Infinity``: those are kept."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes | bytearray) else raw
    except UnicodeDecodeError as e:
        raise bad(path, what, f"is not UTF-8 text (byte {e.start})") from None
    # (Python's own limit on integer digits raises ValueError; where it is lifted, ours holds)
    limited = 0 < sys.get_int_max_str_digits() <= MAX_INT_DIGITS
    try:
        return json.loads(
            text,
            object_pairs_hook=_unique,
            parse_constant=None if user_data else _no_constant,
            parse_float=None if user_data else _finite,
            parse_int=None if limited else _bounded_int,
        )
    except _Duplicate as e:
        raise bad(path, what, f"holds the key {shown(e.key)} twice in one object") from None
    except _NotFinite as e:
        raise bad(path, what, f"holds the number {shown(e.text)}, which is not finite") from None
    except json.JSONDecodeError as e:
        raise bad(path, what, f"is truncated or not JSON ({e.msg} at char {e.pos})") from None
    except RecursionError:
        raise bad(path, what, "nests deeper than JSON is read") from None
    except ValueError as e:  # (an integer of more digits than MAX_INT_DIGITS)
        raise bad(path, what, f"holds a number that cannot be read ({e})") from None


def mapping(value: Any, path: str, field: str) -> dict[str, Any]:
    """``value`` is a JSON object."""
    if not isinstance(value, dict):
        raise bad(path, field, f"is {shown(value)}, not an object")
    return value


def strings(value: Any, path: str, field: str) -> dict[str, str]:
    """``value`` is a JSON object of strings."""
    for key, item in mapping(value, path, field).items():
        if not isinstance(item, str):
            raise bad(path, f"{field}[{shown(key)}]", f"is {shown(item)}, not a string")
    return value


# ------------------------------------------------------------------------------------------
# Numbers and shapes
# ------------------------------------------------------------------------------------------


def integer(
    value: Any, path: str, field: str, *, minimum: int = 0, maximum: int = MAX_BYTES - 1
) -> int:
    """``value`` is an int (not a bool, not a float) from ``minimum`` to ``maximum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(path, field, f"is {shown(value)}, not an integer")
    if not minimum <= value <= maximum:
        raise bad(path, field, f"is {shown(value)}, not from {minimum} to {shown(maximum)}")
    return value


def shape(
    value: Any,
    path: str,
    field: str,
    *,
    rank: int = MAX_RANK,
    minimum: int = 0,
    array: str | None = None,
) -> tuple[int, ...]:
    """``value`` is a list of at most ``rank`` integers, each at least ``minimum`` (0 for an
    array's shape, 1 for a chunk's) and below ``MAX_BYTES``."""
    if not isinstance(value, list | tuple):
        raise bad(path, field, f"is {shown(value)}, not a list of integers", array=array)
    if len(value) > rank:
        raise bad(path, field, f"has {len(value)} dimensions, more than {rank}", array=array)
    for n in value:
        if isinstance(n, bool) or not isinstance(n, int) or not minimum <= n < MAX_BYTES:
            raise bad(
                path,
                field,
                f"is {shown(value)}: each dimension must be an integer from {minimum} "
                f"to 2**63 - 1, not {shown(n)}",
                array=array,
            )
    return tuple(value)


def nbytes(
    dims: tuple[int, ...], itemsize: int, path: str, field: str, *, array: str | None = None
) -> int:
    """The bytes of an array of shape ``dims`` and ``itemsize``, which must be fewer than
    ``MAX_BYTES`` with its zero dimensions counted as 1 (so no offset or stride within it
    overflows either)."""
    whole = itemsize
    for n in dims:
        whole *= max(n, 1)
        if whole >= MAX_BYTES:
            raise bad(
                path,
                field,
                f"{list(dims)} of {itemsize}-byte elements declares 2**63 bytes or more",
                array=array,
            )
    return math.prod(dims) * itemsize


def dtype(
    value: Any, known: Collection[str], path: str, field: str, *, array: str | None = None
) -> str:
    """``value`` is one of the ``known`` dtype names."""
    if not isinstance(value, str) or value not in known:
        raise bad(
            path,
            field,
            f"is {shown(value)}, which milepost does not read (it reads "
            f"{', '.join(sorted(known))})",
            array=array,
        )
    return value


# ------------------------------------------------------------------------------------------
# Names
# ------------------------------------------------------------------------------------------


def name_problem(name: str) -> str | None:
    """Why ``name`` (a leaf's key parts joined by '.') cannot be a leaf's name, the same rule
    for names saved and names read; None: it can. A '.' inside a key counts as a part too: a
    tree without an abstract tree is rebuilt by splitting the names at their '.'s."""
    if (
        len(name) > MAX_NAME_BYTES // 4
        and len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES
    ):
        return f"it is longer than {MAX_NAME_BYTES} bytes"
    if name.count(".") >= MAX_NAME_PARTS:
        return f"it has {name.count('.') + 1} parts, more than {MAX_NAME_PARTS}"
    return None


def name(value: Any, path: str, field: str) -> str:
    """``value`` is a string that may name a leaf (:func:`name_problem`)."""
    if not isinstance(value, str):
        raise bad(path, field, f"is {shown(value)}, not a string")
    why = name_problem(value)
    if why is not None:
        raise bad(path, field, f"is {shown(value)}: {why}")
    return value


def folder_name(value: str, path: str, field: str) -> str:
    """``value`` (a name) fits one folder name: at most ``MAX_FOLDER_NAME_BYTES``, what a file
    system holds in one path component (``NAME_MAX``); a layout of a folder per array (plain
    zarr) can hold no longer name."""
    if len(value.encode("utf-8", "surrogatepass")) > MAX_FOLDER_NAME_BYTES:
        raise bad(
            path,
            field,
            f"is {shown(value)}, longer than the {MAX_FOLDER_NAME_BYTES} bytes of a folder name",
        )
    return value


def conflict(names: Iterable[str]) -> tuple[str, str] | None:
    """Two of ``names`` such that the first is the start of the second up to a '.' (``a`` and
    ``a.b``: no tree holds both as leaves), or None; in time linear in the names' length."""
    return _conflict((n, n.split(".")) for n in names)


def conflict_of_paths(paths: Iterable[Sequence[str]]) -> tuple[str, str] | None:
    """:func:`conflict` of leaves given by their key paths (a key may hold a '.'), shown as
    ``repr`` of the paths."""
    found = _conflict((tuple(p), p) for p in paths)
    if found is None:
        return None
    texts = (str(found[0]), str(found[1]))
    return tuple(t if len(t) <= 80 else t[:77] + "..." for t in texts)  # type: ignore[return-value]


def _conflict(items: Iterable[tuple[Any, Sequence[str]]]) -> tuple[Any, Any] | None:
    trie: dict[Any, Any] = {}
    end = object()  # (the key of a node that ends a path: its label)
    for label, parts in items:
        node = trie
        for part in parts:
            if end in node:
                return node[end], label
            node = node.setdefault(part, {})
        if end in node:
            continue  # (the same path twice: the caller's own question)
        if node:  # (a longer path went through here)
            while end not in node:
                node = next(iter(node.values()))
            return label, node[end]
        node[end] = label
    return None


def grid_key(key: Any, path: str, field: str) -> tuple[int, ...]:
    """A chunk's grid index written as milepost writes it (``"0.3"``; ``""`` for a scalar).
    An index outside the array is no chunk's, and never looked up: it is read, not refused."""
    parts = key.split(".") if isinstance(key, str) and key else []
    if (
        not isinstance(key, str)
        or len(parts) > MAX_ZARR_RANK
        or not all(
            p.removeprefix("-").isascii() and p.removeprefix("-").isdigit() and len(p) <= 40
            for p in parts
        )
    ):
        raise bad(path, field, f"holds the chunk {shown(key)}, not a grid index such as '0.3'")
    return tuple(int(p) for p in parts)


class NameBudget:
    """The bytes of leaf names a file of ``file_bytes`` may make: ``NAME_BYTES_PER_FILE_BYTE``
    times its size, at least ``NAME_BYTES_FLOOR``. A nested format (msgpack) stores each key
    once and makes every leaf's whole name of it: a small file could make gigabytes."""

    def __init__(self, file_bytes: int, path: str) -> None:
        self.left = max(NAME_BYTES_FLOOR, NAME_BYTES_PER_FILE_BYTE * file_bytes)
        self.path = path

    def spend(self, name: str) -> None:
        self.left -= len(name)
        if self.left < 0:
            raise bad(
                self.path,
                "its leaves' names",
                f"come to more than {NAME_BYTES_PER_FILE_BYTE} times the file's size (or "
                f"{NAME_BYTES_FLOOR >> 20} MiB): its keys repeat in every leaf's name",
            )


# ------------------------------------------------------------------------------------------
# Meshes
# ------------------------------------------------------------------------------------------


def devices(dims: tuple[int, ...], path: str, field: str) -> int:
    """The devices of a mesh of shape ``dims`` (each at least 1), at most ``MAX_DEVICES``."""
    count = 1
    for n in dims:
        count *= n
        if count > MAX_DEVICES:
            raise bad(path, field, f"{list(dims)} has more than {MAX_DEVICES} devices")
    return count


# ------------------------------------------------------------------------------------------
# zarr headers
# ------------------------------------------------------------------------------------------


def zarr_header(header: Any, array: str, path: str) -> dict[str, Any]:
    """An array's ``zarr.json`` (zarr3) or ``.zarray`` (zarr2) as parsed from ``path``, checked:
    its shape, dtype, chunk shapes (the sharding codec's inner chunks too, each dividing the
    shard) and total size. Returns it unchanged."""
    header = mapping(header, path, f"the header of array {array!r}")
    zarr2 = header.get("zarr_format") == 2 or "chunks" in header
    dims = shape(header.get("shape"), path, "shape", rank=MAX_ZARR_RANK, array=array)
    if zarr2:
        name = header.get("dtype")
        itemsize = _zarr2_itemsize(name, path, array)
        chunks = shape(header.get("chunks"), path, "chunks", rank=len(dims), minimum=1, array=array)
        inner = chunks
    else:
        itemsize = _itemsize(
            dtype(header.get("data_type"), ZARR3_DTYPES, path, "data_type", array=array)
        )
        grid = header.get("chunk_grid")
        configuration = grid.get("configuration") if isinstance(grid, dict) else None
        if not isinstance(configuration, dict):
            raise bad(
                path, "chunk_grid", f"is {shown(grid)}, not a regular chunk grid", array=array
            )
        chunks = shape(
            configuration.get("chunk_shape"), path, "chunk_grid.chunk_shape", minimum=1, array=array
        )
        inner = chunks
        codecs = header.get("codecs")
        if not isinstance(codecs, list) or not codecs or not isinstance(codecs[0], dict):
            raise bad(path, "codecs", f"is {shown(codecs)}, not a list of codecs", array=array)
        if codecs[0].get("name") == "sharding_indexed":
            inner_raw = mapping(codecs[0].get("configuration"), path, "codecs[0].configuration")
            inner = shape(
                inner_raw.get("chunk_shape"),
                path,
                "the sharding codec's chunk_shape",
                minimum=1,
                array=array,
            )
            if len(inner) != len(chunks) or any(s % i for s, i in zip(chunks, inner, strict=True)):
                raise bad(
                    path,
                    "the sharding codec's chunk_shape",
                    f"{list(inner)} does not divide the shard shape {list(chunks)}",
                    array=array,
                )
    if len(chunks) != len(dims):
        raise bad(
            path,
            "the chunk shape",
            f"{list(chunks)} is not of the rank of the shape {list(dims)}",
            array=array,
        )
    nbytes(dims, itemsize, path, "shape", array=array)
    nbytes(chunks, itemsize, path, "the chunk shape", array=array)
    return header


def _itemsize(name: str) -> int:
    """Bytes per element of a dtype milepost knows, as NumPy holds it."""
    import ml_dtypes  # noqa: F401  (registers bfloat16, int4 and the small floats with NumPy)

    return int(np.dtype(name).itemsize)


def _zarr2_itemsize(value: Any, path: str, array: str) -> int:
    """The bytes per element of a zarr2 ``dtype`` (a NumPy type string such as ``<f4``, or a
    name such as ``bfloat16``): a number or bool of fixed size."""
    if isinstance(value, str) and value in ZARR3_DTYPES:
        return _itemsize(value)
    if (
        isinstance(value, str)
        and len(value) in (3, 4)
        and value[0] in "<>|="
        and value[1] in "biufc"
        and value[2:].isdigit()
        and int(value[2:]) in (1, 2, 4, 8, 16)
    ):
        return int(value[2:])
    raise bad(path, "dtype", f"is {shown(value)}, not a numeric dtype milepost reads", array=array)
