"""Where the values of some arrays lie in an OCDBT database, found with NumPy.

A load's hosts each ask the checkpoint's root view where their arrays' chunks are. At 4,096
hosts x 2,000 arrays the view holds 8 M keys in leaves of ~440,000 entries, and every leaf
holds chunks of every host: TensorStore's ``ocdbt.dump`` turns each entry into a Python dict,
50 s and GBs per host to index a whole model. Here each node decodes as columns
(:mod:`._ocdbt_format`), the wanted keys are picked out with NumPy, and what is kept is a
sorted key column with each value's file, offset and length, looked up by bisection.

What :mod:`._ocdbt_format` does not read (a numbered manifest, a key holding NUL, damaged
bytes) is a :class:`~._ocdbt_format.FormatError`: :func:`find_values` then walks with
TensorStore instead (said once, :func:`~._ocdbt_format.note_fallback`), which says what is wrong
if anything is. A value naming a file outside the database's folder is a
``CorruptCheckpointError``; that file is never opened.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorstore as ts

from milepost.workers._errors import CorruptCheckpointError
from milepost.workers._paths import context_for, kvstore
from milepost.workers._runtime import RUNTIME
from milepost.workers.format import _ocdbt_format as fmt
from milepost.workers.format._ocdbt_keys import rebuild_keys
from milepost.workers.format._ts_internals import (
    FileRange,
    OutsideError,
    leads_out,
    ocdbt_values,
    value_range,
)

_THREADS = max(1, min(4, os.cpu_count() or 1))  # nodes decoded side by side


@dataclass
class _Part:
    """One leaf's wanted keys (fixed-width bytes, sorted), and per key the wanted prefix it
    starts with, its value's data file (index into the :class:`Values`' paths; into ``paths``
    until then), offset and length."""

    keys: np.ndarray
    groups: np.ndarray
    files: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    paths: list[str]


@dataclass(frozen=True)
class Values:
    """The wanted keys whose values lie in data files, leaf by leaf in key order; ``paths``
    (each from the database's folder) are what the parts' ``files`` index."""

    parts: list[_Part]
    paths: list[str]

    def find(self, keys: Sequence[bytes]) -> list[tuple[str, int, int] | None]:
        """The data file, offset and length of each key's value (None: not a wanted key whose
        value lies in a data file), found by bisection for all keys at once: a box's chunks
        cost one NumPy call per leaf they lie in, not one each."""
        found: list[tuple[str, int, int] | None] = [None] * len(keys)
        if not self.parts or not keys:
            return found
        where: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            at = bisect.bisect_right(self._firsts, key) - 1
            if at >= 0 and b"\x00" not in key:
                where.setdefault(at, []).append(i)
        for at, asked in where.items():
            part = self.parts[at]
            wanted = np.array([keys[i] for i in asked], dtype="S")
            rows = np.minimum(np.searchsorted(part.keys, wanted), len(part.keys) - 1)
            hit = part.keys[rows] == wanted
            for i, row, ok in zip(asked, rows.tolist(), hit.tolist(), strict=True):
                if ok:
                    found[i] = (
                        self.paths[part.files[row]],
                        int(part.offsets[row]),
                        int(part.lengths[row]),
                    )
        return found

    def __len__(self) -> int:
        return sum(len(p.keys) for p in self.parts)

    def rows(self) -> Iterator[tuple[bytes, int, int, int]]:
        """Every key, with its value's data file (an index into ``paths``), offset and length."""
        for part in self.parts:
            yield from zip(
                part.keys.tolist(),
                part.files.tolist(),
                part.offsets.tolist(),
                part.lengths.tolist(),
                strict=True,
            )

    @functools.cached_property
    def _firsts(self) -> list[bytes]:
        return [bytes(p.keys[0]) for p in self.parts]

    def column(self, name: str) -> np.ndarray:
        """One column (``groups``, ``files``, ``offsets``, ``lengths``) of every part."""
        return np.concatenate([getattr(p, name) for p in self.parts] or [np.zeros(0, np.int64)])


class Prefixes:
    """A set of key prefixes, asked per B-tree entry in O(log n) rather than O(n).

    Prefixes that extend another one are dropped (the shorter one matches all their keys). In
    the sorted rest, the keys starting with each prefix form disjoint intervals in the same
    order, and a key's only candidate is the greatest prefix not after it: any prefix between
    a matching prefix and the key would extend the matching one.
    """

    def __init__(self, prefixes: Iterable[bytes]) -> None:
        kept: list[bytes] = []
        for p in sorted(set(prefixes)):
            if not (kept and p.startswith(kept[-1])):
                kept.append(p)
        self.sorted = kept

    def match(self, key: bytes) -> bool:
        """Whether ``key`` starts with one of the prefixes."""
        i = bisect.bisect_right(self.sorted, key) - 1
        return i >= 0 and key.startswith(self.sorted[i])

    def overlaps(self, low: bytes, high: bytes | None) -> bool:
        """Whether some key in [low, high) starts with one of the prefixes."""
        if self.match(low):
            return True
        # Otherwise the first prefix after ``low`` is the smallest matching key at or after it.
        i = bisect.bisect_right(self.sorted, low)
        return i < len(self.sorted) and (high is None or self.sorted[i] < high)


def indirect_values(kv: Any, prefixes: Iterable[bytes], where: str) -> Values:
    """The keys starting with one of ``prefixes`` in the newest
    version of the database ``kv`` (a kvstore of its folder), whose values lie in data files.
    Nodes are read level by level, all of a level at once, and only those whose key range
    may hold a wanted key."""
    wanted = Prefixes(prefixes)
    table = np.array(wanted.sorted, "S")
    after = np.array([_successor(p) for p in wanted.sorted], "S")
    got = kv.read("manifest.ocdbt").result()
    if got.state != "value":
        raise fmt.FormatError(f"{where}: no manifest.ocdbt")
    root = _decoded(lambda: fmt.decode_manifest(bytes(got.value), where))
    parts: list[_Part] = []
    paths: dict[str, int] = {}
    seen: set[tuple[object, str, int]] = set()
    # (key prefix, node, expected height, the key bound after the node's range or None)
    level = [(b"", root.node, root.height, None)] if root.node is not None else []
    for _, ref, _, _ in level:
        fmt.check_unshared(seen, None, ref, where)
    with RUNTIME.scoped("ocdbt-index", _THREADS) as pool:
        while level:
            reads = [_read(kv, ref) for _, ref, _, _ in level]

            def visit(i: int) -> list[Any]:
                prefix, ref, height, high = level[i]  # noqa: B023
                node_at = f"{where}/{ref.path}@{ref.offset}"
                got = reads[i].result()  # noqa: B023
                if got.state != "value" or len(got.value) != ref.length:
                    raise fmt.FormatError(f"{node_at}: the node is missing or cut short")
                node = _decoded(lambda: fmt.decode_node(bytes(got.value), ref, node_at))
                if isinstance(node, fmt.Children) != (height > 0):  # (heights fall: no cycle)
                    raise fmt.FormatError(f"{node_at}: not the kind of node its height is")
                if isinstance(node, fmt.Entries):
                    return [_match(node, prefix, table, after)]
                bounds = [prefix + k for k in node.keys[1:]] + [high]
                return [
                    (prefix + key[:common], child, height - 1, upper)
                    for key, child, common, upper in zip(
                        node.keys, node.refs, node.common, bounds, strict=True
                    )
                    if wanted.overlaps(prefix + key, upper)
                ]

            found = [x for xs in pool.map(visit, range(len(level))) for x in xs]
            # (children in key order: the parts stay in key order)
            for part in (x for x in found if isinstance(x, _Part)):
                ids = [paths.setdefault(path, len(paths)) for path in part.paths]
                part.files = np.array(ids, np.int32)[part.files]
                part.paths = []
                parts.append(part)
            level = [x for x in found if isinstance(x, tuple)]
            for _, ref, _, _ in level:
                fmt.check_unshared(seen, None, ref, where)
    return Values(parts=parts, paths=list(paths))


def find_values(directory: str, wanted: Prefixes) -> Values | list[tuple[bytes, FileRange]]:
    """Where the values of the keys that start with one of ``wanted`` lie in the OCDBT
    database in ``directory`` (a local folder or an object store's): milepost's walk
    (:func:`indirect_values`), or TensorStore's (``ocdbt.dump``, keyed file ranges) where that
    decoder does not read the database. A value naming a file outside ``directory`` is a
    ``CorruptCheckpointError``."""
    kv = ts.KvStore.open(kvstore(directory), context=context_for(directory)).result()
    with _contained(directory):
        try:
            return indirect_values(kv, wanted.sorted, directory)
        except fmt.FormatError as e:  # (TensorStore reads it, or says what is wrong)
            fmt.note_fallback("B-tree walk", "TensorStore's ocdbt.dump", e)
            return list(ocdbt_values(directory, wanted, kv))


def parse_value(directory: str, reference: str) -> FileRange | None:
    """The file range an OCDBT value reference names (``_ts_internals.value_range``), checked
    to lie in ``directory``."""
    with _contained(directory):
        return value_range(directory, reference)


@contextlib.contextmanager
def _contained(directory: str) -> Iterator[None]:
    """A value reference out of ``directory`` is a CorruptCheckpointError; nothing is opened."""
    try:
        yield
    except OutsideError as e:
        raise CorruptCheckpointError(
            f"the OCDBT database in {directory} points a value at {e.inside!r}, outside the "
            "checkpoint; the checkpoint is damaged or crafted, and that file was not opened"
        ) from None


def _read(kv: Any, ref: fmt.Ref) -> Any:
    if leads_out(ref.path):
        raise OutsideError(ref.path)
    return kv.read(ref.path, byte_range=slice(ref.offset, ref.offset + ref.length))


def _decoded(decode: Any) -> Any:
    try:
        return decode()
    except UnicodeDecodeError as e:  # (a data file path that is not UTF-8)
        raise fmt.FormatError(str(e)) from e


def _narrow(values: np.ndarray) -> np.ndarray:
    """``values`` as int32 if they fit, else int64."""
    if not len(values) or int(values.max()) < 2**31:
        return values.astype(np.int32)
    return values.astype(np.int64)


def _successor(prefix: bytes) -> bytes:
    """The least key after every key starting with ``prefix`` (b"\\xff" for none)."""
    head = prefix.rstrip(b"\xff")
    return head[:-1] + bytes([head[-1] + 1]) if head else b"\xff" * (len(prefix) + 1)


def _match(
    entries: fmt.Entries,
    prefix: bytes,
    table: np.ndarray,
    after: np.ndarray,
) -> _Part | None:
    """A leaf's wanted keys whose values lie in data files (None: none)."""
    indirect = np.flatnonzero(entries.files >= 0)
    if not len(indirect):
        return None
    keys = rebuild_keys(entries.key_prefix, entries.key_suffix, entries.key_bytes)
    keys = keys[indirect]
    if prefix:
        head = np.broadcast_to(np.frombuffer(prefix, np.uint8), (len(keys), len(prefix)))
        keys = np.concatenate([head, keys], axis=1)
    rows = np.ascontiguousarray(keys).view(f"S{keys.shape[1]}").ravel()
    if np.any(rows[1:] <= rows[:-1]):
        raise fmt.FormatError("a leaf's keys are not in order")
    # The keys starting with a prefix are those from it up to its successor (prefixes never
    # extend one another, so the runs are disjoint and in the prefixes' order).
    starts = np.searchsorted(rows, table, side="left")
    counts = np.searchsorted(rows, after, side="left") - starts
    if not counts.any():
        return None
    hit = np.repeat(starts - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))
    group = np.repeat(np.arange(len(table)), counts)
    take = indirect[hit]
    for path in entries.paths:
        if leads_out(path):
            raise OutsideError(path)
    return _Part(
        keys=rows[hit],
        groups=group.astype(np.int32),  # (int32 columns where they fit: 8 M keys per host)
        files=entries.files[take],
        offsets=entries.offsets[take].astype(np.int64),
        lengths=_narrow(entries.lengths[take]),
        paths=entries.paths,
    )
