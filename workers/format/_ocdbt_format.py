"""The OCDBT format, as far as the commit's merge reads and writes it.

The format is TensorStore's, specified in its ``kvstore/ocdbt/index.rst`` (the fields named
here are that document's): a manifest (``manifest.ocdbt``) holding the configuration and, for
the ``single`` manifest kind, the versions; B+tree nodes in data files. Every encoded piece is
framed the same way: magic (uint32 big-endian), total length (uint64 little-endian), format
version and compression (uleb128 each), the body (zstd-compressed, or not), CRC32C of all that
(uint32 little-endian). Node bodies are columns: all of one field for every entry, then the
next field, so a node decodes and encodes with a few NumPy operations whatever its size.

A leaf's entries are held as :class:`Entries`: keys as rows of a ``uint8`` matrix (NUL-padded:
OCDBT keys are bytes, but the keys milepost's databases hold never contain NUL, which
:func:`decode_node` checks), and each value either inline or as a file range.
"""

from __future__ import annotations

import logging
import posixpath
import re
import struct
import threading
from dataclasses import dataclass

import numpy as np
import zstandard

from milepost.workers.format._checksum import crc32c
from milepost.workers.format._ocdbt_keys import padded, rebuild_keys, shared_prefixes

MANIFEST_MAGIC = 0x0CDB3A2A
BTREE_MAGIC = 0x0CDB20DE
MAX_NODE_ENTRIES = 1 << 20  # the most entries a reader accepts in one node
MAX_NODE_BYTES = 1 << 28
"""The most bytes a manifest or node decodes to here (the databases milepost writes allow
100 MB nodes): crafted bytes that claim more are refused, not allocated."""
_HEAD = struct.Struct(">I")
_LENGTH = struct.Struct("<Q")
_CRC = struct.Struct("<I")


class FormatError(ValueError):
    """Bytes that are not what the OCDBT format says (damaged), or a form of it the merge does
    not write itself (then the caller merges with TensorStore instead)."""


_log = logging.getLogger("milepost")
_fell_back: set[tuple[str, str]] = set()
_fell_back_lock = threading.Lock()
_WHERE = re.compile(r"\S*/\S*|\d+")
"""What in a reason says where (paths, offsets, tokens), left out of its kind."""
_MAX_REASONS = 64


def note_fallback(fast: str, slow: str, reason: FormatError) -> bool:
    """Say, at WARNING, that milepost's own OCDBT code (``fast``, e.g. "B-tree walk") did not
    read a database, for ``reason``, and TensorStore's (``slow``) runs instead: correct, but
    2-3x slower at thousands of hosts. Once per process for each fallback and kind of reason
    (the reason without the paths and numbers that say where: one per database would be one per
    save), and at most ``_MAX_REASONS`` kinds; True if this call logged."""
    key = (fast, _WHERE.sub("_", str(reason)))
    with _fell_back_lock:
        if key in _fell_back or len(_fell_back) >= _MAX_REASONS:
            return False
        _fell_back.add(key)
    _log.warning(
        "OCDBT %s fell back to %s: %s. The result is the same but slower at many hosts; if "
        "this database was written by milepost, report it (logged once per process and reason)",
        fast,
        slow,
        reason,
    )
    return True


# ------------------------------------------------------------------------------------------
# uleb128, one at a time and in columns
# ------------------------------------------------------------------------------------------


class _Cursor:
    """Reads the small scalar parts (manifest, data file tables) of a decoded body."""

    def __init__(self, data: bytes, pos: int = 0) -> None:
        self.data = data
        self.pos = pos

    def varint(self) -> int:
        value = shift = 0
        while True:
            if self.pos >= len(self.data) or shift > 63:
                raise FormatError("a uleb128 number runs past the end")
            byte = self.data[self.pos]
            self.pos += 1
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value
            shift += 7

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise FormatError(f"{n} bytes wanted past the end")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out


def read_varints(buf: np.ndarray, pos: int, count: int) -> tuple[np.ndarray, int]:
    """``count`` uleb128 numbers starting at ``buf[pos]`` (uint8), as uint64, and the position
    after them. Each number's 7-bit groups are shifted into place and the groups of a number
    summed, all at once (no pass per byte of the longest number)."""
    if count == 0:
        return np.zeros(0, np.uint64), pos
    # (the columns of a node are mostly numbers of 1-3 bytes: their ends are found in a
    # window that long first, not in the 10 bytes a number may take)
    window = buf[pos : pos + 3 * count + 8]
    ends = np.flatnonzero(window < 0x80)
    if len(ends) < count:
        window = buf[pos : pos + 10 * count]
        ends = np.flatnonzero(window < 0x80)
        if len(ends) < count:
            raise FormatError("a column of uleb128 numbers runs past the end")
    ends = ends[:count]
    size = int(ends[-1]) + 1
    if size == count:  # (every number one byte)
        return window[:count].astype(np.uint64), pos + count
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    if lengths.max() > 10:
        raise FormatError("a uleb128 number longer than 10 bytes")
    shifts = np.arange(size, dtype=np.uint64)
    shifts -= np.repeat(starts, lengths).astype(np.uint64)  # (each byte's place in its number)
    shifts *= np.uint64(7)
    parts = (window[:size] & 0x7F).astype(np.uint64)
    parts <<= shifts
    return np.add.reduceat(parts, starts), pos + size


def varint_sizes(values: np.ndarray) -> np.ndarray:
    """How many bytes the uleb128 of each number in ``values`` takes."""
    values = np.asarray(values, dtype=np.uint64)
    sizes = np.ones(values.shape, np.int32)
    top = int(values.max()) if values.size else 0
    for k in range(1, 10):
        if top < 1 << (7 * k):  # (no pass for bytes no number has)
            break
        sizes += values >= np.uint64(1 << (7 * k))
    return sizes


def encode_varints(values: np.ndarray) -> np.ndarray:
    """The uleb128 bytes of every number in ``values``, one after another: a row of every
    number's k-th 7-bit group for each k, its high bit set where the number goes on, and
    the rows read number by number, each as far as its size."""
    values = np.asarray(values, dtype=np.uint64)
    if values.size == 0:
        return np.zeros(0, np.uint8)
    sizes = varint_sizes(values)
    width = int(sizes.max())
    if width == 1:
        return values.astype(np.uint8)
    groups = np.empty((width, len(values)), np.uint8)
    kept = np.empty((width, len(values)), bool)
    for k in range(width):
        np.bitwise_and(values >> np.uint64(7 * k), 0x7F, out=groups[k], casting="unsafe")
        np.greater(sizes, k, out=kept[k])
    groups[:-1] |= kept[1:].view(np.uint8) << 7
    return groups.T[kept.T]


def varint(value: int) -> bytes:
    """The uleb128 bytes of one number."""
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# ------------------------------------------------------------------------------------------
# Framing
# ------------------------------------------------------------------------------------------


def unframe(data: bytes, magic: int, what: str) -> bytes:
    """The decoded body of an encoded manifest or node (``what`` names it in errors)."""
    if len(data) < 16:
        raise FormatError(f"{what}: {len(data)} bytes, shorter than any encoded OCDBT piece")
    (found,) = _HEAD.unpack_from(data, 0)
    if found != magic:
        raise FormatError(f"{what}: magic {found:#010x}, not {magic:#010x}")
    (length,) = _LENGTH.unpack_from(data, 4)
    if length != len(data):
        raise FormatError(f"{what}: its header says {length} bytes, but it has {len(data)}")
    (crc,) = _CRC.unpack_from(data, len(data) - 4)
    if crc32c(memoryview(data)[:-4]) != crc:
        raise FormatError(f"{what}: CRC32C mismatch (the bytes are damaged)")
    cursor = _Cursor(data[:-4], 12)
    if cursor.varint() != 0:
        raise FormatError(f"{what}: an OCDBT format version other than 0")
    compression = cursor.varint()
    body = data[cursor.pos : -4]
    if compression == 0:
        return body
    if compression == 1:
        return _unzstd(body, what)
    raise FormatError(f"{what}: compression format {compression} is unknown")


_LOCAL = threading.local()


def _decompressor() -> zstandard.ZstdDecompressor:
    """This thread's zstd decompressor (one is not shared by threads). Making one costs 18 us,
    as much as decoding a manifest: a commit at 4,096 hosts decodes 12,000 pieces."""
    found: zstandard.ZstdDecompressor | None = getattr(_LOCAL, "zstd", None)
    if found is None:
        found = _LOCAL.zstd = zstandard.ZstdDecompressor()
    return found


def _unzstd(body: bytes, what: str) -> bytes:
    """A zstd frame decoded, never past :data:`MAX_NODE_BYTES` (whatever its header says)."""
    try:
        size = zstandard.frame_content_size(body)
        if size > MAX_NODE_BYTES:
            raise FormatError(f"{what}: more than {MAX_NODE_BYTES} bytes decoded")
        if size >= 0:  # (known: decoded into a buffer of that size, checked against it)
            return _decompressor().decompress(body)
        out = bytearray()
        reader = _decompressor().stream_reader(body)
        while part := reader.read(1 << 20):
            out += part
            if len(out) > MAX_NODE_BYTES:
                raise FormatError(f"{what}: more than {MAX_NODE_BYTES} bytes decoded")
        return bytes(out)
    except zstandard.ZstdError as e:
        raise FormatError(f"{what}: zstd: {e}") from e


Compression = int | zstandard.ZstdCompressionParameters | None
"""How a node is compressed: not at all (None), with zstd at a level, or with zstd parameters."""


def frame(body: bytes, magic: int, level: Compression) -> bytes:
    """``body`` encoded as a manifest or node: zstd at ``level`` (a level or parameters; None:
    uncompressed)."""
    if level is None:
        tail = varint(0) + varint(0) + body
    else:
        zstd = (
            zstandard.ZstdCompressor(level=level)
            if isinstance(level, int)
            else zstandard.ZstdCompressor(compression_params=level)
        )
        tail = varint(0) + varint(1) + zstd.compress(body)
    head = _HEAD.pack(magic) + _LENGTH.pack(12 + len(tail) + 4)
    crc = crc32c(tail, crc32c(head))
    return head + tail + _CRC.pack(crc)


# ------------------------------------------------------------------------------------------
# Data file tables
# ------------------------------------------------------------------------------------------


def read_file_table(cursor: _Cursor, transitive: str) -> tuple[list[str], list[str]]:
    """A data file table: each file's full path (from the database's folder) and the
    transitive path nodes reached through it carry (``transitive`` + its base path)."""
    n = cursor.varint()
    prefix = [0] + [cursor.varint() for _ in range(n - 1)]
    suffix = [cursor.varint() for _ in range(n)]
    base = [cursor.varint() for _ in range(n)]
    paths: list[str] = []
    bases: list[str] = []
    previous = b""
    for i in range(n):
        if prefix[i] > len(previous):
            raise FormatError("a data file table's path prefix is longer than the path before")
        path = previous[: prefix[i]] + cursor.take(suffix[i])
        if base[i] > len(path):
            raise FormatError("a data file table's base path is longer than its path")
        paths.append(transitive + path.decode())
        bases.append(transitive + path[: base[i]].decode())
        previous = path
    return paths, bases


def write_file_table(paths: list[str]) -> bytes:
    """The encoding of a data file table of ``paths``, each with an empty base path (the
    nodes milepost writes reach their files from the database's folder)."""
    return file_table(*padded([p.encode() for p in paths]))


def file_table(rows: np.ndarray, lengths: np.ndarray) -> bytes:
    """:func:`write_file_table` of paths given as the sorted NUL-padded rows of
    :func:`~._ocdbt_keys.padded` (a merge's leaves each take their table's rows from one such
    matrix of every path: no Python work per path and leaf)."""
    if not len(rows):
        return varint(0)
    width = int(lengths.max())
    rows = rows[:, :width]
    prefix = shared_prefixes(rows, lengths)
    starts = np.concatenate([[0], prefix]).astype(np.int64)
    col = np.arange(width)
    mine = (col[None, :] >= starts[:, None]) & (col[None, :] < lengths[:, None])
    columns = [prefix, lengths - starts, np.zeros(len(rows), np.int64)]
    head = varint(len(rows)) + encode_varints(np.concatenate(columns)).tobytes()
    return head + rows[mine].tobytes()


# ------------------------------------------------------------------------------------------
# Manifest
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ref:
    """Where an encoded node lies: ``length`` bytes at ``offset`` in ``path`` (from the
    database's folder); ``transitive``: the path its children's tables start from."""

    path: str
    offset: int
    length: int
    transitive: str


@dataclass(frozen=True)
class Root:
    """The newest version of a database: its generation and B+tree root (None: empty)."""

    generation: int
    height: int
    node: Ref | None


_MISSING = 2**64 - 1


def decode_manifest(data: bytes, where: str) -> Root:
    """The newest version a ``single``-kind manifest names."""
    cursor = _Cursor(unframe(data, MANIFEST_MAGIC, f"{where} (manifest)"))
    cursor.take(16)  # uuid
    if cursor.varint() != 0:
        raise FormatError(f"{where}: a numbered manifest (the merge reads single ones)")
    cursor.varint()  # max_inline_value_bytes
    cursor.varint()  # max_decoded_node_bytes
    cursor.take(1)  # version_tree_arity_log2
    if cursor.varint() == 1:
        cursor.take(4)  # zstd level
    paths, bases = read_file_table(cursor, "")
    n = cursor.varint()
    if n == 0:
        return Root(generation=0, height=0, node=None)
    gens = [cursor.varint() for _ in range(n)]
    heights = list(cursor.take(n))
    files = [cursor.varint() for _ in range(n)]
    offsets = [cursor.varint() for _ in range(n)]
    lengths = [cursor.varint() for _ in range(n)]
    # (a version with no root, the database empty: length 0, or TensorStore's "missing",
    # offset and length 2^64 - 1, left by a delete of every key)
    if lengths[-1] == 0 or lengths[-1] == offsets[-1] == _MISSING:
        return Root(generation=gens[-1], height=0, node=None)
    if files[-1] >= len(paths):
        raise FormatError(f"{where}: a version names data file {files[-1]} of {len(paths)}")
    ref = Ref(paths[files[-1]], offsets[-1], lengths[-1], bases[files[-1]])
    return Root(generation=gens[-1], height=heights[-1], node=ref)


def encode_manifest(
    *,
    uuid: bytes,
    config: dict[str, int],
    generation: int,
    height: int,
    root: Ref,
    stats: tuple[int, int, int],
    commit_ns: int,
    level: int | None,
) -> bytes:
    """A ``single``-kind manifest with one version: the B+tree root at ``root``."""
    parts = [uuid, varint(0), varint(config["max_inline_value_bytes"])]
    parts += [varint(config["max_decoded_node_bytes"]), bytes([config["version_tree_arity_log2"]])]
    parts += [varint(0)] if level is None else [varint(1), struct.pack("<i", level)]
    parts += [write_file_table([root.path]), varint(1), varint(generation), bytes([height])]
    parts += [varint(0), varint(root.offset), varint(root.length)]
    parts += [varint(s) for s in stats]
    parts += [struct.pack("<Q", commit_ns), varint(0)]
    return frame(b"".join(parts), MANIFEST_MAGIC, level)


# ------------------------------------------------------------------------------------------
# B+tree nodes
# ------------------------------------------------------------------------------------------


@dataclass
class Entries:
    """A leaf's entries, as its columns: each key as the bytes it shares with the key before
    (``key_prefix``, 0 for the first) and its own bytes after them (``key_suffix`` of them, in
    ``key_bytes``, one key's after another: ``_ocdbt_keys.rebuild_keys`` makes the keys); the
    value's ``lengths``; ``files`` (index into ``paths``, -1: inline) and ``offsets`` of values
    in data files; ``inline`` (the inline values, one after another) and ``inline_at`` (each
    inline value's start in it)."""

    key_prefix: np.ndarray
    key_suffix: np.ndarray
    key_bytes: np.ndarray
    lengths: np.ndarray
    files: np.ndarray
    offsets: np.ndarray
    inline: np.ndarray
    inline_at: np.ndarray
    paths: list[str]


@dataclass(frozen=True)
class Children:
    """An interior node's children: their first keys (after ``prefix``), where they lie, and
    each one's subtree common prefix length."""

    keys: list[bytes]
    refs: list[Ref]
    common: list[int]


def _keys(
    buf: np.ndarray, pos: int, n: int, interior: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """A node's key columns: shared prefix and suffix lengths (int32), the suffix bytes, and
    (interior nodes) each child's subtree common prefix length."""
    prefix_in, pos = read_varints(buf, pos, n - 1)
    prefix = np.zeros(n, np.int32)
    prefix[1:] = prefix_in
    suffix_in, pos = read_varints(buf, pos, n)
    suffix = suffix_in.astype(np.int32)
    common = np.zeros(n, np.int64)
    if interior:
        common_in, pos = read_varints(buf, pos, n)
        common = common_in.astype(np.int64)
    lengths = prefix + suffix
    if np.any(prefix[1:] > lengths[:-1]) or np.any(lengths > 65535):
        raise FormatError("a key's prefix length exceeds the previous key's length")
    total = int(suffix.sum())
    if pos + total > len(buf):
        raise FormatError("key bytes run past the end")
    raw = buf[pos : pos + total].copy()  # (not a view keeping the whole node)
    if np.any(raw == 0):
        raise FormatError("a key holds a NUL byte")
    return prefix, suffix, raw, common, pos + total


def peek_node(data: bytes, ref: Ref, where: str) -> tuple[int, int, int]:
    """A B+tree node's height, number of entries and decoded size, without its entries."""
    body = unframe(data, BTREE_MAGIC, f"{where} (B-tree node)")
    cursor = _Cursor(body)
    height = cursor.take(1)[0]
    read_file_table(cursor, ref.transitive)
    entries = cursor.varint()
    if not 0 < entries <= MAX_NODE_ENTRIES:
        raise FormatError(f"{where}: a B-tree node of {entries} entries")
    return height, entries, len(body)


def check_unshared(seen: set[tuple[object, str, int]], owner: object, ref: Ref, where: str) -> None:
    """Note that a walk of ``owner``'s B-tree reaches the node at ``ref``. A version's B-tree
    never reaches one node twice: a crafted one that does (a cycle, or a million children
    naming one node) is a :class:`FormatError`, not read again and again."""
    at = (owner, posixpath.normpath(ref.path), ref.offset)  # (one file however it is spelt)
    if at in seen:
        raise FormatError(f"{where}: the B-tree reaches the node at {ref.path}@{ref.offset} twice")
    seen.add(at)


def decode_node(data: bytes, ref: Ref, where: str) -> Entries | Children:
    """A B+tree node: a leaf's :class:`Entries` (keys after the node's path prefix) or an
    interior node's :class:`Children`."""
    body = unframe(data, BTREE_MAGIC, f"{where} (B-tree node)")
    cursor = _Cursor(body)
    height = cursor.take(1)[0]
    paths, bases = read_file_table(cursor, ref.transitive)
    n = cursor.varint()
    if n == 0:
        raise FormatError(f"{where}: an empty B-tree node")
    buf = np.frombuffer(body, np.uint8)
    prefix, suffix, raw, common, pos = _keys(buf, cursor.pos, n, interior=height > 0)
    if height > 0:
        files, pos = read_varints(buf, pos, n)
        offsets, pos = read_varints(buf, pos, n)
        lengths, pos = read_varints(buf, pos, n)
        if np.any(files >= len(paths)):
            raise FormatError(f"{where}: a child names a data file not in its table")
        refs = [
            Ref(paths[f], int(o), int(ln), bases[f])
            for f, o, ln in zip(files.tolist(), offsets.tolist(), lengths.tolist(), strict=True)
        ]
        keys = rebuild_keys(prefix, suffix, raw)
        as_bytes = [bytes(keys[i, : prefix[i] + suffix[i]]) for i in range(n)]
        return Children(keys=as_bytes, refs=refs, common=common.tolist())
    lengths, pos = read_varints(buf, pos, n)
    kinds = buf[pos : pos + n]
    pos += n
    if len(kinds) < n or np.any(kinds > 1):
        raise FormatError(f"{where}: a value kind other than inline (0) or in a file (1)")
    indirect = kinds == 1
    m = int(indirect.sum())
    file_ids, pos = read_varints(buf, pos, m)
    offsets_in, pos = read_varints(buf, pos, m)
    if np.any(file_ids >= len(paths)):
        raise FormatError(f"{where}: a value names a data file not in its table")
    files = np.full(n, -1, np.int32)
    files[indirect] = file_ids.astype(np.int32)
    offsets = np.zeros(n, np.uint64)
    offsets[indirect] = offsets_in
    inline_lengths = np.where(indirect, 0, lengths).astype(np.int64)
    inline_at = np.cumsum(inline_lengths) - inline_lengths
    total = int(inline_lengths.sum())
    if pos + total != len(buf):
        raise FormatError(f"{where}: the node's length does not match its entries")
    return Entries(
        key_prefix=prefix,
        key_suffix=suffix,
        key_bytes=raw,
        lengths=lengths,
        files=files,
        offsets=offsets,
        inline=buf[pos : pos + total].copy(),  # (not a view keeping the whole node)
        inline_at=inline_at,
        paths=paths,
    )


def encode_leaf(
    keys: np.ndarray,
    key_lengths: np.ndarray,
    lengths: np.ndarray,
    files: np.ndarray,
    offsets: np.ndarray,
    inline: bytes,
    table: bytes,
    level: Compression,
    prefix: np.ndarray | None = None,
) -> tuple[bytes, int]:
    """A leaf node of sorted, distinct ``keys`` (NUL-padded rows, C order): ``files`` index
    the node's data file table (``table``: :func:`write_file_table`'s), -1 for the inline
    values, which ``inline`` holds in order; and its decoded size. ``prefix``: how many bytes
    each key shares with the next, if the caller has it
    (:func:`~._ocdbt_keys.shared_prefixes`)."""
    n, width = keys.shape
    if prefix is None:
        prefix = shared_prefixes(keys, key_lengths)
    starts = np.zeros(n, np.int64)
    starts[1:] = prefix
    suffix = key_lengths - starts
    # each key's own bytes (after what it shares), as places in the rows, one after another
    first = np.arange(0, n * width, width, dtype=np.int64) + starts
    own = np.repeat(first - (np.cumsum(suffix) - suffix), suffix)
    own += np.arange(len(own))
    indirect = files >= 0
    body = [
        bytes([0]),
        table,
        varint(n),
        encode_varints(prefix).tobytes(),
        encode_varints(suffix).tobytes(),
        np.ascontiguousarray(keys).reshape(-1)[own].tobytes(),
        encode_varints(lengths).tobytes(),
        indirect.astype(np.uint8).tobytes(),
        encode_varints(files[indirect]).tobytes(),
        encode_varints(offsets[indirect]).tobytes(),
        inline,
    ]
    decoded = b"".join(body)
    return frame(decoded, BTREE_MAGIC, level), len(decoded)


def encode_interior(
    height: int,
    keys: list[bytes],
    refs: list[Ref],
    stats: list[tuple[int, int, int]],
    level: Compression,
) -> bytes:
    """An interior node at ``height`` over children whose first keys are ``keys`` (sorted),
    each at its ``refs``, with its (keys, tree bytes, indirect value bytes)."""
    paths = sorted({r.path for r in refs})
    index = {p: i for i, p in enumerate(paths)}
    rows, key_lengths = padded(keys)
    prefix = shared_prefixes(rows, key_lengths).tolist()
    starts = [0, *prefix]
    cols = [
        [varint(p) for p in prefix],
        [varint(len(k) - s) for k, s in zip(keys, starts, strict=True)],
        [varint(0) for _ in keys],  # subtree common prefix: none
        [k[s:] for k, s in zip(keys, starts, strict=True)],
        [varint(index[r.path]) for r in refs],
        [varint(r.offset) for r in refs],
        [varint(r.length) for r in refs],
        [varint(s[0]) for s in stats],
        [varint(s[1]) for s in stats],
        [varint(s[2]) for s in stats],
    ]
    head = bytes([height]) + write_file_table(paths) + varint(len(keys))
    return frame(head + b"".join(b"".join(c) for c in cols), BTREE_MAGIC, level)
