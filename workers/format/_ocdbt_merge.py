"""The root OCDBT view of a save, written directly: every per-process database's B-tree read,
their entries sorted together, the root's B-tree nodes and manifest encoded with NumPy.

A save's hosts each write an OCDBT database (``ocdbt.process_<i>[.<k>]``); the commit makes
the checkpoint's root view, one B-tree whose entries point at the values in those databases'
data files (no value is copied). TensorStore can do it (a transaction copying every key), but
spends microseconds per key in it: at 4,096 hosts x 2,000 arrays (8 M keys) that was most of a
16-second commit. Here the work per key is a few NumPy operations on columns: the databases'
leaves decode as columns (:mod:`._ocdbt_format`), the keys sort as fixed-width rows, and the
root's leaves encode as columns again.

What this writer does not read (a numbered manifest, a key holding NUL, one key in two
databases, damaged bytes) raises :class:`~._ocdbt_format.FormatError` before anything is
written, and the caller merges with TensorStore instead, which says what is wrong if anything
is. The root view is written as one data file (``d/<random>``, every node) and then its
manifest; a failure between the two leaves an unreferenced data file in a folder that is not a
checkpoint until the commit.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorstore as ts
import zstandard

from milepost.workers._errors import CorruptCheckpointError
from milepost.workers._paths import context_for, kvstore
from milepost.workers._runtime import RUNTIME, Pool
from milepost.workers.format import _ocdbt_format as fmt
from milepost.workers.format._confirm import confirm_files
from milepost.workers.format._ocdbt_keys import (
    BLOCK,
    RankMajor,
    long_keys,
    padded,
    rebuild_keys,
    shared_prefixes,
)
from milepost.workers.format._ts_internals import leads_out, status_of

ZSTD = zstandard.ZstdCompressionParameters.from_level(
    19, strategy=zstandard.STRATEGY_BTOPT, chain_log=16, hash_log=16, search_log=1
)
"""How the root's nodes compress: zstd's optimal parser, whose matches may be 3 bytes long
(level 19's), with a short search. Most of a root is its leaves' value offsets, varints of 3
bytes that repeat from array to array; matches of 4 bytes or more (levels up to 15) miss them.
The leaves of 512 hosts x 2,000 arrays (14 MB decoded): 2.00 MB in 0.26 s, against 2.44 MB in
0.07 s at level 9 and 2.00 MB in 0.58 s at level 19 (docs/performance.md)."""

_ARITY = 4096  # children per interior node
_THREADS = max(1, min(4, os.cpu_count() or 1))  # rebuilding keys, sorting, encoding leaves
_RANK_SOURCES = 8
"""Databases from which on their keys are laid out by rank (``RankMajor``) if that sorts them:
the keys of fewer are a few runs, sorted as they are, and a save in one process has one or two
(whose keys, made rank by rank, would leave a thread idle)."""
_SORT_PIECE = 1 << 19  # rows of the second half placed per job when merging the sorted halves


@dataclass
class _Leaf:
    """A database's leaf, read but not decoded: its keys' prefix (from the interior nodes above
    it), where it lies and its bytes; its number of entries and decoded size."""

    prefix: bytes
    ref: fmt.Ref
    data: bytes
    entries: int
    size: int


@dataclass
class _Source:
    name: str  # the folder under the root ("" for none)
    leaves: list[_Leaf]  # in key order


def _read(kv: Any, key: str, ref: fmt.Ref | None = None) -> ts.Future[Any]:
    if ref is None:
        return kv.read(key)
    return kv.read(key, byte_range=slice(ref.offset, ref.offset + ref.length))


def _load_sources(kv: Any, names: list[str], directory: Any) -> list[_Source]:
    """Every database's leaves, read level by level (all databases' nodes of a level at once).
    A node whose file is missing or cut short is a :class:`LostWriteError` naming the file."""
    manifests = [_read(kv, f"{n}/manifest.ocdbt") for n in names]
    sources = [_Source(n, []) for n in names]
    # (source, key prefix, node ref, expected height), for the level being read
    level: list[tuple[int, bytes, fmt.Ref, int]] = []
    seen: set[tuple[object, str, int]] = set()
    for i, (name, future) in enumerate(zip(names, manifests, strict=True)):
        got = future.result()
        if got.state != "value":
            raise fmt.FormatError(f"{name}: no manifest.ocdbt")
        root = fmt.decode_manifest(bytes(got.value), name)
        if root.node is not None:
            level.append((i, b"", root.node, root.height))
    for i, _, ref, _ in level:
        fmt.check_unshared(seen, i, ref, names[i])
    while level:
        reads = [_read(kv, _under(names[i], ref.path), ref) for i, _, ref, _ in level]
        below: list[tuple[int, bytes, fmt.Ref, int]] = []
        for (i, prefix, ref, height), future in zip(level, reads, strict=True):
            try:
                got = future.result()
            except ValueError as e:  # (past the end of its file: cut short)
                if status_of(e) != "OUT_OF_RANGE":
                    raise
                got = None
            where = f"{names[i]}/{ref.path}@{ref.offset}"
            if got is None or got.state != "value" or len(got.value) != ref.length:
                # (the listing names the file and its size; presence only on object stores)
                confirm_files(directory, {_under(names[i], ref.path): ref.offset + ref.length})
                raise fmt.FormatError(f"{where}: the node is missing or cut short")
            data = bytes(got.value)
            found, entries, size = fmt.peek_node(data, ref, where)
            if found != height:
                raise fmt.FormatError(f"{where}: at height {found}, its parent says {height}")
            if height == 0:  # (decoded when merged, one at a time: see _merge)
                sources[i].leaves.append(_Leaf(prefix, ref, data, entries, size))
                continue
            node = fmt.decode_node(data, ref, where)
            assert isinstance(node, fmt.Children)
            for key, child, common in zip(node.keys, node.refs, node.common, strict=True):
                below.append((i, prefix + key[:common], child, height - 1))
        # (children are appended in key order, so each source's leaves stay in order)
        level = below
        for i, _, ref, _ in level:
            fmt.check_unshared(seen, i, ref, names[i])
    return sources


@dataclass
class _Merged:
    """Every database's entries, in no order; ``order`` sorts them by key."""

    keys: np.ndarray  # (n, width) uint8, NUL-padded
    key_lengths: np.ndarray
    lengths: np.ndarray  # uint32, or uint64 if a value is 4 GiB or more
    files: np.ndarray  # index into paths, -1: inline
    offsets: np.ndarray
    """Where each value starts: in its data file, or (inline) in ``inline``; uint32 or uint64,
    as ``lengths``."""
    inline: np.ndarray
    paths: list[str]  # sorted
    order: np.ndarray
    long: dict[int, bytes] = field(default_factory=dict)
    """The keys longer than the rows of ``keys`` (cut there), whole, by row."""
    sizes: dict[str, int] = field(default_factory=dict)
    """Each data file of ``paths``, with the bytes it must at least hold: the end of the last
    value in it (what the commit confirms before it calls the checkpoint committed)."""
    path_rows: tuple[np.ndarray, np.ndarray] = field(init=False)
    """``paths`` as :func:`padded` rows and lengths: each leaf's data file table is some of
    them (at 4,096 hosts, every leaf names about 4,096 files)."""

    def __post_init__(self) -> None:
        self.path_rows = padded([p.encode() for p in self.paths])


def _merge(sources: list[_Source], pool: Pool | None = None) -> _Merged:
    """Every database's leaves in one set of columns, and the order of their keys. Each leaf
    is decoded, copied in and dropped in turn: the memory is that of the columns, not of 4,096
    databases' decoded leaves besides them."""
    leaves = [(s.name, leaf) for s in sources for leaf in s.leaves]
    sizes = [sum(leaf.entries for leaf in s.leaves) for s in sources]
    layout = RankMajor(sizes) if len(sizes) >= _RANK_SOURCES else None
    sources.clear()
    if not leaves:
        raise fmt.FormatError("no keys to merge")
    key_prefix, key_suffix, raw, lengths, files, offsets, inline, paths = _columns(leaves)
    n = len(key_prefix)
    # (now, while each database's values lie in runs of rows: 13 ms at 8 M keys)
    ends = _ends(files, offsets, lengths, len(paths))
    file_ends = {path: int(ends[i]) for path, i in paths.items()}
    # Rows as wide as all keys but the longest few: at 4,096 hosts x 2,000 arrays the longest
    # are the hosts' tables' (43 bytes against 29), and every byte of width is 8 MB of rows.
    width = _width(key_prefix, key_suffix)
    # Hosts that hold alike keys (a chunk of every array each) are nearly sorted laid out rank
    # by rank: then so are the sort's passes and every gather after it (at 4,096 hosts x 2,000
    # arrays, write_root 5.5 -> 4.6 s; see RankMajor). Hosts of disjoint keys are not: their
    # keys are made again in source order, and sorted as they are; nor are a few databases'.
    if layout is not None:
        keys = layout.rebuild(key_prefix, key_suffix, raw, width, pool)
        if not layout.nearly_sorted(keys.view(f"S{width}").ravel()):
            del keys
            layout = None
    if layout is None:
        keys = rebuild_keys(key_prefix, key_suffix, raw, pool, width)
    long = long_keys(keys, key_prefix, key_suffix, raw, layout.places if layout else None)
    key_prefix += key_suffix  # (now each key's length)
    del key_suffix, raw
    # Sort the data file table once: each leaf's table is then a sorted subset (prefix-coded).
    ordered = sorted(paths)
    renumber = np.array([paths[p] for p in ordered], np.int64).argsort().astype(np.int32)
    renumber = np.append(renumber, np.int32(-1))  # (-1, inline, stays -1)
    for lo in range(0, n, BLOCK):
        files[lo : lo + BLOCK] = renumber[files[lo : lo + BLOCK]]
    if layout is not None:
        columns = [key_prefix, lengths, files, offsets]
        del key_prefix, lengths, files, offsets  # (lay_out drops each when laid)
        key_prefix, lengths, files, offsets = layout.lay_out(columns, pool)
        cut = np.fromiter(long, np.int64, len(long))
        long = dict(zip(layout.places(cut).tolist(), long.values(), strict=True))
    order = sort_rows(keys.view(f"S{keys.shape[1]}").ravel(), pool)
    if long:
        _sort_cut_keys(keys, long, order)
    return _Merged(
        keys=keys,
        key_lengths=key_prefix,
        lengths=lengths,
        files=files,
        offsets=offsets,
        inline=inline,
        paths=ordered,
        order=order,
        long=long,
        sizes=file_ends,
    )


def _columns(
    leaves: list[tuple[str, _Leaf]],
) -> tuple[
    np.ndarray,
    np.ndarray,
    np.ndarray,
    np.ndarray,
    np.ndarray,
    np.ndarray,
    np.ndarray,
    dict[str, int],
]:
    """Every leaf (``(database, leaf)``, consumed) decoded into one set of columns: the keys'
    prefix and suffix lengths and bytes, the values' lengths, files (ids into the data file
    table, returned; -1 inline) and offsets, and the inline values' bytes."""
    n = sum(leaf.entries for _, leaf in leaves)
    room = sum(leaf.size + len(leaf.prefix) for _, leaf in leaves)  # (key and inline bytes)
    key_prefix = np.empty(n, np.int32)
    key_suffix = np.empty(n, np.int32)
    raw = np.empty(room, np.uint8)  # (pages are touched only as far as they are filled)
    # (32-bit lengths and offsets until one needs more: at 8 M keys, 64 MB less fresh memory,
    # whose first touches cost the commit more than the work on it)
    lengths = np.empty(n, np.uint32)
    files = np.empty(n, np.int32)
    offsets = np.empty(n, np.uint32)
    inline = np.empty(room, np.uint8)
    paths: dict[str, int] = {}
    at = raw_at = blob_at = 0
    leaves.reverse()  # (popped from the end: each leaf dropped once copied in)
    while leaves:
        name, leaf = leaves.pop()
        where = f"{name}/{leaf.ref.path}@{leaf.ref.offset}"
        e = fmt.decode_node(leaf.data, leaf.ref, where)
        assert isinstance(e, fmt.Entries)
        prefix = leaf.prefix
        m, rows = len(e.lengths), slice(at, at + len(e.lengths))
        key_prefix[rows] = e.key_prefix
        key_suffix[rows] = e.key_suffix
        if prefix:  # (keys below an interior node's subtree prefix: put it back in front)
            key_prefix[at + 1 : at + m] += len(prefix)
            key_suffix[at] += len(prefix)
            raw[raw_at : raw_at + len(prefix)] = np.frombuffer(prefix, np.uint8)
            raw_at += len(prefix)
        raw[raw_at : raw_at + len(e.key_bytes)] = e.key_bytes
        raw_at += len(e.key_bytes)
        ids = [paths.setdefault(_under(name, q), len(paths)) for q in e.paths]
        files[rows] = np.array([*ids, -1], np.int32)[e.files]  # (-1 picks the -1 at the end)
        starts = np.where(
            e.files < 0, e.inline_at.astype(np.uint64) + np.uint64(blob_at), e.offsets
        )
        lengths = _fitting(lengths, e.lengths)
        offsets = _fitting(offsets, starts)
        lengths[rows] = e.lengths
        offsets[rows] = starts
        inline[blob_at : blob_at + len(e.inline)] = e.inline
        blob_at += len(e.inline)
        at += m
        del e, leaf
    if at != n:
        raise fmt.FormatError(f"the leaves held {at} entries where their headers said {n}")
    return key_prefix, key_suffix, raw, lengths, files, offsets, inline[:blob_at], paths


def _ends(files: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, count: int) -> np.ndarray:
    """Where the last value in each of ``count`` data files ends (by file id; inline values,
    id -1, left out), from columns in which a file's values lie in runs of rows (one maximum
    per run, then per file), a block at a time."""
    out = np.zeros(count + 1, np.uint64)  # (the last: id -1)
    for lo in range(0, len(files), BLOCK):
        block = files[lo : lo + BLOCK]
        ends = offsets[lo : lo + BLOCK].astype(np.uint64)
        ends += lengths[lo : lo + BLOCK]
        runs = np.flatnonzero(np.concatenate(([True], block[1:] != block[:-1])))
        np.maximum.at(out, block[runs], np.maximum.reduceat(ends, runs))
    return out[:count]


def _fitting(column: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``column`` (uint32 or uint64), widened to uint64 if one of ``values`` needs it."""
    if column.dtype == np.uint32 and len(values) and int(values.max()) >> 32:
        return column.astype(np.uint64)
    return column


_LONG_KEYS = 1 / 256
"""At most this share of the keys may be longer than the merge's rows (and are kept whole
apart)."""


def _width(prefix: np.ndarray, suffix: np.ndarray) -> int:
    """The merge's row width: every key's length (``prefix + suffix``) but those of the
    longest few. (A histogram of the lengths, in blocks: no column of them as long as the keys.)"""
    n = len(prefix)
    if not n:
        return 0
    counts = np.zeros(1 << 16, np.int64)  # (keys are shorter than 64 KiB)
    for lo in range(0, n, BLOCK):
        counts += np.bincount(prefix[lo : lo + BLOCK] + suffix[lo : lo + BLOCK], None, 1 << 16)
    cut = n - 1 - int(n * _LONG_KEYS)  # (the cut-th shortest key's length)
    return int(np.searchsorted(np.cumsum(counts), cut, side="right"))


def _sort_cut_keys(keys: np.ndarray, long: dict[int, bytes], order: np.ndarray) -> None:
    """Put the keys cut at the row width in their place in ``order`` (sorted by rows): each
    lies in the run of rows equal to its cut one, sorted again here by whole keys."""
    rows = keys.view(f"S{keys.shape[1]}").ravel()
    cut = np.zeros(len(order), bool)
    cut[np.fromiter(long, np.int64, len(long))] = True
    places = np.flatnonzero(cut[order])
    done = -1
    for place in places.tolist():
        if place <= done:
            continue
        row = rows[order[place]]
        lo, hi = place, place + 1
        while lo > 0 and rows[order[lo - 1]] == row:
            lo -= 1
        while hi < len(order) and rows[order[hi]] == row:
            hi += 1
        run = order[lo:hi].tolist()
        run.sort(key=lambda i: (long.get(i) or bytes(rows[i]), i))
        order[lo:hi] = run
        done = hi - 1


def sort_rows(rows: np.ndarray, pool: Pool | None = None) -> np.ndarray:
    """The stable sorting order of ``rows`` (fixed-width bytes). With a pool of two threads or
    more, the two halves are sorted side by side and merged (1.8 -> 1.4 s at 8 M keys): each of
    the second half's rows goes where bisection among the first half's puts it (after its
    equals), in pieces (their temporaries stay small), and the first half's rows fill the
    places left, in order."""
    n = len(rows)
    if pool is None or (pool.max_threads or 1) < 2 or n < 1 << 16:
        return np.argsort(rows, kind="stable")
    half = n // 2
    first, second = rows[:half], rows[half:]
    in_first, in_second = pool.map(lambda part: np.argsort(part, kind="stable"), [first, second])
    order = np.empty(n, np.int64)
    left = np.ones(n, bool)  # (the places the first half's rows fill)

    def place(lo: int) -> None:
        hi = min(lo + _SORT_PIECE, len(in_second))
        ahead = np.searchsorted(first, second[in_second[lo:hi]], side="right", sorter=in_first)
        ahead += np.arange(lo, hi)  # (the rows of the second half before it)
        order[ahead] = in_second[lo:hi] + half
        left[ahead] = False

    pool.map(place, range(0, len(in_second), _SORT_PIECE))
    order[left] = in_first
    return order


def _under(name: str, path: str) -> str:
    """A database's data file path, from the root's folder. One leading out of the database's
    folder (absolute, ``..``, NUL, backslash) is never opened nor referenced: the database
    was altered or damaged."""
    if leads_out(path):
        raise CorruptCheckpointError(
            f"{name}: its OCDBT B-tree names the file {path!r}, outside its folder; the "
            "database was altered or damaged, and nothing outside it is read. Save the step "
            "again, or load an earlier one.",
            path=name,
        )
    return f"{name}/{path}" if name else path


def _cuts(m: _Merged, node_bytes: int) -> list[int]:
    """Where the root's leaves start and end (in key order): about ``node_bytes`` of decoded
    entries each, its data file table besides."""
    node_bytes -= min(60 * len(m.paths), node_bytes // 4)  # (the table: ~50 bytes a path)
    per_leaf = max(1, node_bytes)
    n = len(m.order)
    found: list[tuple[int, int]] = []  # (bytes before a leaf's start, where it starts)
    total = 0
    for lo in range(0, n, BLOCK):
        take = m.order[lo : lo + BLOCK]
        # Each entry's columns, estimated: its key after the bytes it shares with the key
        # before (an eighth of it: sorted neighbours share most), its lengths' uleb128s, its
        # value kind, and its file id and offset, or its inline value. A leaf that turns out
        # larger than the limit is split (write_root).
        lengths = m.lengths[take]
        size = m.key_lengths[take] // 8 + 3 + fmt.varint_sizes(lengths)
        inline = m.files[take] < 0  # (inline values are small: at most 1 KiB by default)
        size += np.where(inline, lengths.astype(np.int64), fmt.varint_sizes(m.offsets[take]) + 2)
        ends = np.cumsum(size, dtype=np.int64)
        ends += total
        marks = np.arange(total // per_leaf + 1, int(ends[-1]) // per_leaf + 1) * per_leaf
        found += zip(marks.tolist(), (np.searchsorted(ends, marks) + lo).tolist(), strict=True)
        total = int(ends[-1])
    cuts = sorted({0, *(at for mark, at in found if mark < total), n})
    out = [cuts[0]]
    for c in cuts[1:]:  # (no leaf above the reader's limit of entries)
        while c - out[-1] > fmt.MAX_NODE_ENTRIES - 1:
            out.append(out[-1] + fmt.MAX_NODE_ENTRIES - 1)
        if c > out[-1]:
            out.append(c)
    return out


def _leaf(m: _Merged, lo: int, hi: int, level: fmt.Compression) -> tuple[bytes, bytes, int, int]:
    """The encoded leaf of the ``lo``-th to ``hi``-th keys in key order, its first key, its
    decoded size and the bytes of its values in data files (not inline).
    A key equal to the one before it (the last of the previous leaf, for the first) is in two
    databases: :class:`~._ocdbt_format.FormatError`."""
    take = m.order[max(lo - 1, 0) : hi]
    key_lengths = m.key_lengths[take]
    width = int(key_lengths.max())
    keys = m.keys[take, :width]
    if width > m.keys.shape[1]:  # (keys longer than the rows: whole from ``m.long``)
        keys = np.pad(keys, ((0, 0), (0, width - keys.shape[1])))
        for r in np.flatnonzero(key_lengths > m.keys.shape[1]).tolist():
            whole = m.long[int(take[r])]
            keys[r, : len(whole)] = np.frombuffer(whole, np.uint8)
    shared = shared_prefixes(keys, key_lengths)
    same = np.flatnonzero((shared == key_lengths[1:]) & (key_lengths[1:] == key_lengths[:-1]))
    if len(same):
        key = bytes(keys[same[0], : key_lengths[same[0]]])
        raise fmt.FormatError(f"the key {key!r} is in more than one database")
    if lo > 0:
        take, keys, key_lengths, shared = take[1:], keys[1:], key_lengths[1:], shared[1:]
    files = m.files[take]
    lengths = m.lengths[take]
    offsets = m.offsets[take]  # (an inline value's: its start in ``m.inline``)
    used = np.flatnonzero(np.bincount(files[files >= 0], minlength=len(m.paths)))
    local = np.full(len(m.paths) + 1, -1, np.int64)
    local[used] = np.arange(len(used))
    inline = b""
    direct = np.flatnonzero(files < 0)
    if len(direct):
        starts = offsets[direct].astype(np.int64)
        sizes = lengths[direct].astype(np.int64)
        at = np.repeat(starts - np.cumsum(sizes) + sizes, sizes) + np.arange(int(sizes.sum()))
        inline = m.inline[at].tobytes()
    node, decoded = fmt.encode_leaf(
        keys,
        key_lengths.astype(np.int64),
        lengths,
        local[files],
        offsets,
        inline,
        fmt.file_table(m.path_rows[0][used], m.path_rows[1][used]),
        level,
        shared,
    )
    indirect = int(lengths[files >= 0].sum())
    return node, bytes(keys[0, : key_lengths[0]]), decoded, indirect


def write_root(directory: Any, children: list[str], config: dict[str, Any]) -> dict[str, int]:
    """Write the root view in ``directory`` over the databases in its sub-folders
    ``children`` (names), with the root configuration ``config``. Raises
    :class:`~._ocdbt_format.FormatError` before writing anything if a database is not in a
    form this writer reads. Returns every data file the root view references (its own
    included, paths from ``directory``), each with the bytes it must at least hold."""
    kv = ts.KvStore.open(kvstore(directory), context=context_for(directory)).result()
    if kv.read("manifest.ocdbt").result().state == "value":
        raise fmt.FormatError("the folder already has a root view (merged with TensorStore)")
    # (milepost's runtime pool, not concurrent.futures: a save the interpreter's exit waits
    # for still commits, and concurrent.futures takes no work then)
    with RUNTIME.scoped("merge", _THREADS) as pool:
        merged = _merge(_load_sources(kv, children, directory), pool)
        data_file = f"d/{os.urandom(16).hex()}"
        leaf_bytes = _leaf_bytes(merged.paths, int(config["max_decoded_node_bytes"]))
        data, root, height, stats = _tree(merged, config, data_file, pool, leaf_bytes)
    kv.write(data_file, data).result()
    kv.write("manifest.ocdbt", _manifest(config, root, height, stats)).result()
    return {**merged.sizes, data_file: len(data)}


def write_database(
    directory: Any,
    files: Sequence[tuple[Sequence[str], Sequence[int], bytes]],
    config: dict[str, Any],
    token: str = "",
) -> None:
    """Write a new database in ``directory`` whose values lie in ``files``, each a data file
    (keys, lengths, bytes): its values one after another, the value of ``keys[i]`` the next
    ``lengths[i]`` bytes (keys distinct across all; no value inline, so each has a data file
    to find its writer by). Then the B-tree's nodes in one more data file, then the manifest.
    Before the manifest the folder is no database; a failure leaves files nothing references.

    The files are named ``d/<token>.<k>``: ``token`` is the save's (8 hex digits, drawn once
    per save and shared by its hosts), or "" to draw one here. A root view over these
    databases names, in each of its leaves, every data file the leaf's values are in (at 4,096
    hosts, every host's), so the names must be short and alike: at 4,096 hosts x 2,000 arrays
    the root was 1.63 MB with a token per database (70% of it the tokens, which zstd cannot
    shrink) and 0.53 MB with the save's. The names stay unique: a save writes each database
    folder once (one process per index, host calls never retried), and a later save of the
    same path draws a new token, so a late write from an earlier save overwrites none of its
    files. A folder that already holds a database is refused, before anything is written:
    :class:`FileExistsError`."""
    for keys, lengths, data in files:
        if not keys or sum(lengths) != len(data):
            raise ValueError(f"{len(keys)} values of {sum(lengths)} bytes, in {len(data)} bytes")
    if len(files) > 9999:
        raise ValueError(f"{len(files)} data files in one database; at most 9,999")
    kv = ts.KvStore.open(kvstore(directory), context=context_for(directory)).result()
    if kv.read("manifest.ocdbt").result().state == "value":
        raise FileExistsError(
            f"{directory} already holds an OCDBT database; a save writes each process's "
            "database once, so a second writer of it is refused before it writes anything. "
            "Check that no two processes of the job have the same process index, then save "
            "again (to a new path, or after removing this one's temporary folder)."
        )
    token = token or os.urandom(4).hex()
    names = [f"d/{token}.{k:04d}" for k in range(len(files))]  # (sorted: a leaf's table is)
    rows, key_lengths = padded([k.encode() for keys, _, _ in files for k in keys])
    sizes = [np.array(lengths, np.uint64) for _, lengths, _ in files]
    merged = _Merged(
        keys=rows,
        key_lengths=key_lengths.astype(np.int32),
        lengths=np.concatenate(sizes),
        files=np.repeat(np.arange(len(files), dtype=np.int32), [len(n) for n in sizes]),
        offsets=np.concatenate([np.cumsum(n) - n for n in sizes]),
        inline=np.zeros(0, np.uint8),
        paths=names,
        order=sort_rows(rows.view(f"S{rows.shape[1]}").ravel()),
    )
    nodes_file = f"d/{token}.n"
    # (as large leaves as the configuration allows: a host's database is read whole, by the
    # commit's merge, never key by key)
    nodes, root, height, stats = _tree(merged, config, nodes_file, None)
    written = [kv.write(n, data) for n, (_, _, data) in zip(names, files, strict=True)]
    written.append(kv.write(nodes_file, nodes))
    failed = []
    for future in written:  # (every write settled before one's failure is raised: none lands late)
        try:
            future.result()
        except Exception as e:
            failed.append(e)
    if failed:
        raise failed[0]
    kv.write("manifest.ocdbt", _manifest(config, root, height, stats)).result()


def _manifest(
    config: dict[str, Any], root: fmt.Ref, height: int, stats: tuple[int, int, int]
) -> bytes:
    """The manifest of a new database whose B-tree's root is ``root``."""
    return fmt.encode_manifest(
        uuid=os.urandom(16),
        config={
            "max_inline_value_bytes": int(config["max_inline_value_bytes"]),
            "max_decoded_node_bytes": int(config["max_decoded_node_bytes"]),
            "version_tree_arity_log2": int(config.get("version_tree_arity_log2", 4)),
        },
        generation=1,
        height=height,
        root=root,
        stats=stats,
        commit_ns=time.time_ns(),
        level=0,
    )


def _leaf_bytes(paths: list[str], limit: int) -> int:
    """How large (decoded) the leaves of a B-tree over values in ``paths`` are made: eight
    times the data file table a leaf may repeat, at least 1 MiB and at most 3/4 of ``limit``.
    A read through the tree (TensorStore's, Orbax's) decodes a whole leaf: at 4,096 hosts x
    2,000 arrays (packed), 2,000 header reads take 1.49 / 0.92 / 0.54 / 0.46 s with leaves of
    6 / 3 / 1.5 / 1 MiB; but each leaf names every data file its values are in, and smaller
    leaves repeat that table more often: the root 0.58 / 1.18 / 2.54 / 3.76 MB
    (docs/performance.md)."""
    table = sum(len(p) for p in paths)
    return min(limit * 3 // 4, max(1 << 20, 8 * table))


def _tree(
    merged: _Merged,
    config: dict[str, Any],
    data_file: str,
    pool: Pool | None,
    leaf_bytes: int = 0,
) -> tuple[bytes, fmt.Ref, int, tuple[int, int, int]]:
    """A B-tree of ``merged`` as one data file's bytes (leaves, then the interior nodes above
    them), its root node's place and height, and its statistics (``pool``: None, encoded on
    this thread; ``leaf_bytes``: the leaves' decoded size, 0: 3/4 of the configuration's
    limit)."""
    limit = int(config["max_decoded_node_bytes"])
    spans = list(itertools.pairwise(_cuts(merged, leaf_bytes or limit * 3 // 4)))

    def encode(span: tuple[int, int]) -> tuple[bytes, bytes, int, int]:
        return _leaf(merged, span[0], span[1], ZSTD)

    encoded = [encode(s) for s in spans] if pool is None else pool.map(encode, spans)
    out = bytearray()
    level: list[tuple[bytes, fmt.Ref, tuple[int, int, int]]] = []
    while spans:
        lo, hi = spans.pop(0)
        node, first, decoded, indirect = encoded.pop(0)
        if decoded > limit and hi - lo > 1:  # (the estimate fell short: split it)
            spans[:0] = [(lo, (lo + hi) // 2), ((lo + hi) // 2, hi)]
            encoded[:0] = [_leaf(merged, a, b, ZSTD) for a, b in spans[:2]]
            continue
        level.append(
            (first, fmt.Ref(data_file, len(out), len(node), ""), (hi - lo, len(node), indirect))
        )
        out += node
    height = 0
    while len(level) > 1:
        height += 1
        above = []
        for i in range(0, len(level), _ARITY):
            keys, refs, stats = zip(*level[i : i + _ARITY], strict=True)
            node = fmt.encode_interior(height, list(keys), list(refs), list(stats), ZSTD)
            total = (
                sum(s[0] for s in stats),
                sum(s[1] for s in stats) + len(node),
                sum(s[2] for s in stats),
            )
            above.append((keys[0], fmt.Ref(data_file, len(out), len(node), ""), total))
            out += node
        level = above
    _, root, stats = level[0]
    return bytes(out), root, height, stats
