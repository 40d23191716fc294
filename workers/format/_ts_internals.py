"""What milepost relies on of TensorStore beyond its documented API, in one place.

- **The OCDBT dump.** ``ts.ocdbt.dump`` of a manifest gives its versions, each with the
  location of its B-tree root; of a node, its entries: a key (after the node's common prefix),
  and either a child's location (interior nodes) or an indirect value's reference, the text
  ``value:<base>:<relative>:<offset>:<length>`` with every path byte outside
  ``[A-Za-z0-9-_./]`` percent-encoded. Direct reads find each chunk's file range this way.
- **A zarr3 shard as TensorStore writes it** (``sharding_indexed`` codec, index at the end):
  the chunks, then the index, ``(offset, nbytes)`` as little-endian uint64 per inner chunk in
  C order (``2**64 - 1`` twice for a missing chunk), then the index's CRC32C; a shard written
  whole holds its chunks one after another in C order from offset 0.
- **The words of its errors.** TensorStore raises ``ValueError`` for everything: the absl
  status code starts the message (``NOT_FOUND: ...``), a full disk says "No space left on
  device", a full quota "Disk quota exceeded", and some decoding failures carry no status but
  these words: "Error decoding", "Error reading", "ZSTD_", "Invalid key". A read of a value's
  data file that is gone or cut short says ``Error reading Byte range [a, b) of "<key>"``
  (S3), ``of gs://<bucket>/<key>`` (GCS) or ``of local file "<path>"`` (a disk); cut short,
  ``... is not valid for value of size n``.

:func:`check` verifies the first two against the TensorStore installed (and the status prefix of
the third): a release that changes any of them fails a test that names what changed, instead of
direct reads turning slow (they fall back) or loads failing. ``pyproject.toml`` states the range
of TensorStore versions that is tested.
"""

from __future__ import annotations

import os
import re
import struct
import tempfile
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import crc32c
import numpy as np
import tensorstore as ts

# ------------------------------------------------------------------------------------------
# The OCDBT dump
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FileRange:
    """Where a value's bytes are: ``length`` bytes at ``offset`` in the file ``path``."""

    path: str
    offset: int
    length: int


class KeyFilter(Protocol):
    def match(self, key: bytes) -> bool:
        """Whether the value of ``key`` is wanted."""
        ...

    def overlaps(self, low: bytes, high: bytes | None) -> bool:
        """Whether some key in ``[low, high)`` may be wanted (``high`` None: no bound)."""
        ...


class OutsideError(ValueError):
    """A value reference names a file outside the database's folder."""

    def __init__(self, inside: str) -> None:
        super().__init__(inside)
        self.inside = inside


def ocdbt_values(
    directory: str, wanted: KeyFilter, base: Any = None
) -> Iterator[tuple[bytes, FileRange]]:
    """Every wanted key of the newest version of the OCDBT database in ``directory`` (a local
    folder, or ``base``: an opened kvstore of the folder, e.g. in an object store) whose value
    lies in a data file, with that file range (paths under ``directory``); keys whose values
    are inline in the B-tree are skipped. One walk, visiting only the nodes that may hold
    wanted keys. A reference to a file outside ``directory`` is an :class:`OutsideError`."""
    if base is None:
        base = ts.KvStore.open({"driver": "file", "path": directory.rstrip("/") + "/"}).result()
    manifest = ts.ocdbt.dump(base).result()
    versions = manifest.get("versions") or []
    root = versions[-1]["root"].get("location") if versions else None
    if root is not None:
        yield from _walk(directory, base, root, b"", wanted)


def _walk(
    directory: str, base: Any, location: str, prefix: bytes, wanted: KeyFilter
) -> Iterator[tuple[bytes, FileRange]]:
    entries = ts.ocdbt.dump(base, location).result()["entries"]
    for i, entry in enumerate(entries):
        key = prefix + entry["key"]
        if "location" in entry:  # interior: the child holds keys in [key, next key)
            upper = prefix + entries[i + 1]["key"] if i + 1 < len(entries) else None
            if wanted.overlaps(key, upper):
                below = prefix + entry.get("subtree_common_prefix", b"")
                yield from _walk(directory, base, entry["location"], below, wanted)
        elif "indirect_value" in entry and wanted.match(key):
            found = value_range(directory, entry["indirect_value"])
            if found is not None:
                yield key, found


def leads_out(path: str) -> bool:
    """Whether a data file path an OCDBT B-tree names (from its database's folder) leads out
    of it: absolute, ``..``, a backslash or NUL (or empty)."""
    return (
        not path or os.path.isabs(path) or ".." in path.split("/") or "\\" in path or "\x00" in path
    )


def value_range(directory: str, reference: str) -> FileRange | None:
    """The file range an indirect value's reference names (None: not a value in a file).
    The path is percent-decoded, as TensorStore itself reads it; one leading out of
    ``directory`` is an :class:`OutsideError`."""
    head, offset, length = reference.rsplit(":", 2)
    kind, base_path, relative = head.split(":", 2)
    if kind != "value":
        return None
    inside = urllib.parse.unquote(base_path) + urllib.parse.unquote(relative)
    if leads_out(inside):
        raise OutsideError(inside)
    return FileRange(path=os.path.join(directory, inside), offset=int(offset), length=int(length))


# ------------------------------------------------------------------------------------------
# A zarr3 shard's index
# ------------------------------------------------------------------------------------------

INDEX_ENTRY = struct.Struct("<QQ")
MISSING = 2**64 - 1


def index_size(chunks: int) -> int:
    """Bytes of a shard index of ``chunks`` entries with its CRC32C."""
    return chunks * INDEX_ENTRY.size + 4


def index_entries(index: bytes | bytearray | memoryview) -> list[tuple[int, int] | None] | None:
    """The ``(offset, nbytes)`` of each inner chunk a shard's index (its last bytes) records
    (None: the chunk is missing); None for the whole when the index fails its CRC32C."""
    (recorded,) = struct.unpack("<I", bytes(index[-4:]))
    if crc32c.crc32c(bytes(index[:-4])) != recorded:
        return None
    return [
        None if (offset, nbytes) == (MISSING, MISSING) else (int(offset), int(nbytes))
        for offset, nbytes in INDEX_ENTRY.iter_unpack(bytes(index[:-4]))
    ]


# ------------------------------------------------------------------------------------------
# Error messages
# ------------------------------------------------------------------------------------------

_STATUS = re.compile(r"^\s*([A-Z_]+):\s")
_DAMAGE = re.compile(r"Error decoding|Error reading|ZSTD_|Invalid key")


def status_of(error: BaseException) -> str | None:
    """The absl status code TensorStore put at the start of its error message, if any."""
    match = _STATUS.match(str(error))
    return match.group(1) if match else None


def says_no_space(error: BaseException) -> bool:
    return "No space left on device" in str(error)


def says_over_quota(error: BaseException) -> bool:
    return "Disk quota exceeded" in str(error)


def says_damaged(error: BaseException) -> bool:
    """A decoding failure without a status code (a damaged manifest or B-tree node)."""
    return _DAMAGE.search(str(error)) is not None


_UNREAD = re.compile(
    r"Error reading Byte range \[\d+, (\d+)\) of (?:local file )?"
    r"(?:\"([^\"]+)\"|([a-z][a-z0-9+.-]*://\S+?)(?=:\s|\s|$))"
)
_SIZE = re.compile(r"is not valid for value of size (\d+)")


def unread_file(error: BaseException) -> tuple[str, int, int | None] | None:
    """For the error of a read of a value's data file that is missing (``NOT_FOUND``) or cut
    short (``OUT_OF_RANGE``): the file (its key in its bucket, a URL, or a local path), the
    bytes the read needed, and the bytes it holds (None: missing or unknown); else None."""
    status = status_of(error)
    found = _UNREAD.findall(str(error))
    if status not in ("NOT_FOUND", "OUT_OF_RANGE") or not found:
        return None
    end, quoted, url = found[-1]  # (the innermost read)
    name = quoted or url
    size = _SIZE.search(str(error)) if status == "OUT_OF_RANGE" else None
    return name, int(end), int(size.group(1)) if size else None


# ------------------------------------------------------------------------------------------
# The check
# ------------------------------------------------------------------------------------------


def check() -> list[str]:
    """What of the above the installed TensorStore no longer does, one line each (empty: all of
    it holds). Writes a small sharded zarr3 array into an OCDBT database in a temporary folder,
    finds its shard through the dump and reads it back from the file by hand."""
    with tempfile.TemporaryDirectory(prefix="milepost-ts-check-") as folder:
        values = np.arange(4 * 6, dtype=np.float32).reshape(4, 6)
        spec = _probe_spec(folder)
        ts.open(spec, create=True).result().write(values).result()
        where = _locate_shard(folder)
        if isinstance(where, str):
            return [where]
        problems = _check_shard(where, values)
        problems += _check_missing_fails(spec)
        problems += _check_unread(spec, where.path)
    return problems


_PROBE_SHARD = b"a b/c/0/0"
"""The key of the probe array's one shard (its path has a space: keys are not URL-quoted)."""


def _probe_spec(folder: str) -> dict[str, Any]:
    """The probe: a 4x6 float32 zarr3 array in an OCDBT database in ``folder``, one shard of two
    2x6 chunks, raw, with a CRC32C'd index (values over 16 bytes go to data files)."""
    return {
        "driver": "zarr3",
        "kvstore": {
            "driver": "ocdbt",
            "base": {"driver": "file", "path": folder + "/"},
            "config": {"max_inline_value_bytes": 16},
            "path": "a b/",
        },
        "metadata": {
            "shape": [4, 6],
            "data_type": "float32",
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [4, 6]}},
            "codecs": [
                {
                    "name": "sharding_indexed",
                    "configuration": {
                        "chunk_shape": [2, 6],
                        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
                        "index_codecs": [
                            {"name": "bytes", "configuration": {"endian": "little"}},
                            {"name": "crc32c"},
                        ],
                    },
                }
            ],
        },
    }


class _ProbeShard:
    """The key filter that wants only the probe's shard."""

    def match(self, key: bytes) -> bool:
        return key == _PROBE_SHARD

    def overlaps(self, low: bytes, high: bytes | None) -> bool:
        return low <= _PROBE_SHARD and (high is None or _PROBE_SHARD < high)


def _locate_shard(folder: str) -> FileRange | str:
    """Where the probe's shard lies, found by walking the dump; or, if the walk no longer works,
    the one problem that says why (the checks after it need the shard's bytes)."""
    try:
        found = dict(ocdbt_values(folder, _ProbeShard()))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        return f"ts.ocdbt.dump no longer has the structure milepost walks ({type(e).__name__}: {e})"
    where = found.get(_PROBE_SHARD)
    if where is None:
        return "walking ts.ocdbt.dump did not find the shard's value reference (its form changed)"
    if not os.path.isfile(where.path):
        return f"a value reference no longer names a file of the database: {where}"
    return where


def _check_shard(where: FileRange, values: np.ndarray) -> list[str]:
    """Read the shard from its file by hand: two raw chunks in C order, then an index of their
    (offset, length) ending with its CRC32C."""
    with open(where.path, "rb") as f:
        f.seek(where.offset)
        shard = f.read(where.length)
    chunk = values[:2].nbytes
    size = index_size(2)
    if len(shard) != 2 * chunk + size:
        return [f"a full shard of 2 chunks is {len(shard)} bytes, not {2 * chunk + size}"]
    entries = index_entries(shard[-size:])
    if entries is None:
        return ["a shard's index no longer ends with the CRC32C of its entries"]
    if entries != [(0, chunk), (chunk, chunk)]:
        return [f"a full shard's index says {entries}, not the chunks in C order"]
    if shard[: 2 * chunk] != values.tobytes():
        return ["a full shard no longer holds its chunks one after another, raw"]
    return []


def _check_missing_fails(spec: dict[str, Any]) -> list[str]:
    """Opening an array that is not there fails with a ValueError whose message starts with a
    status code (what :func:`status_of` reads)."""
    try:
        ts.open({**spec, "path": "missing/"}, open=True).result()
        return ["opening a missing array no longer fails"]
    except ValueError as e:
        if status_of(e) is None:
            return [f"TensorStore's errors no longer start with a status code: {e}"]
    return []


def _check_unread(spec: dict[str, Any], data_file: str) -> list[str]:
    """That reading a shard whose data file is cut short, then gone, names that file."""
    fresh = {**spec, "recheck_cached_data": False}
    for cut in (True, False):
        if cut:
            os.truncate(data_file, 8)
        else:
            os.unlink(data_file)
        try:
            ts.open(fresh, open=True).result().read().result()
        except ValueError as e:
            found = unread_file(e)
            if found is None or os.path.realpath(found[0]) != os.path.realpath(data_file):
                return [
                    f"a read of a data file {'cut short' if cut else 'gone'} no longer "
                    f"names it as milepost finds it: {str(e)[:300]}"
                ]
            if cut and found[2] != 8:
                return [f"a read of a data file cut short no longer says its size: {e}"[:300]]
        else:
            return [f"a read of a data file {'cut short' if cut else 'gone'} no longer fails"]
    return []
