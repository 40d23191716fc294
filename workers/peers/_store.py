"""A node's folder of the peer tier: each host's shards of a step, kept in node-local memory.

Layout, under the tier's folder on a node (a RAM disk such as ``/dev/shm``; not shared between
nodes)::

    <folder>/<run>/step_<s>/owner_<o>/manifest.json   what the part holds, and its CRC32C
                                     /data            the boxes' bytes, one after another

``owner_<o>`` is the part of step ``s`` that host (process) ``o`` held on its devices: each
distinct box of each array once. The same part is written by its owner on its own node and by
the peers that keep a copy of it on theirs; every copy is the same bytes, so it does not matter
on which node it is found. A part is written under a temporary name and renamed into place
whole, so a part that exists is complete: a host killed mid-write leaves only a temporary
folder, which is never read and is removed by the next prune. Its manifest names the save that
wrote it (``token``): recovery combines the parts of one save only, never a step written twice.

Nothing here trusts the folder. It is opened by the rules of ``_folder`` (this user's own, not
writable by others, never through a link: every folder and file below the tier folder is opened
relative to its parent's descriptor with ``O_NOFOLLOW``; folders are made 0700, files 0600).
Steps and owners are parsed from names this module writes; a manifest's boxes must tile its data
(inside it, no two overlapping, each as long as its shape and dtype make, of dtypes milepost
writes), and the manifest's CRC32C and every box's CRC32C are checked before a byte is used.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import math
import mmap
import os
import re
import struct
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from milepost.workers._errors import CorruptCheckpointError
from milepost.workers._messages import Index
from milepost.workers.format import crc32c
from milepost.workers.peers import _folder
from milepost.workers.peers._folder import NAME, UnsafeFolderError

log = logging.getLogger("milepost.peers")

FORMAT = 1
MANIFEST = "manifest.json"
DATA = "data"
_STEP = re.compile(r"step_(\d{1,19})")
_OWNER = re.compile(r"owner_(\d{1,9})")
_KEY = re.compile(r"key<[A-Za-z0-9_]{1,64}>")


@dataclass(frozen=True, kw_only=True)
class Box:
    """One distinct box of one array in a part: where its bytes lie in ``data``."""

    array: int
    index: Index
    offset: int
    nbytes: int
    crc32c: int


@dataclass(frozen=True, kw_only=True)
class Part:
    """What one part holds (its manifest)."""

    step: int
    owner: int
    token: str
    hosts: int
    dtypes: tuple[str, ...]
    """Each array's dtype, by the array's place in the saved tree's arrays."""
    boxes: tuple[Box, ...]
    leaves: tuple[tuple[int, Any], ...] = ()
    """The saved tree's leaves that are not arrays (JSON values), by leaf index: a
    multi-controller job's processes keep them in their parts (a slice's controller keeps them
    itself)."""

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.boxes)

    def encode(self) -> bytes:
        body = json.dumps(
            {
                "format": FORMAT,
                "step": self.step,
                "owner": self.owner,
                "token": self.token,
                "hosts": self.hosts,
                "dtypes": list(self.dtypes),
                "boxes": [
                    [b.array, [list(r) for r in b.index], b.offset, b.nbytes, b.crc32c]
                    for b in self.boxes
                ],
                "leaves": [[k, v] for k, v in self.leaves],
            },
            separators=(",", ":"),
        ).encode()
        return body + struct.pack("<I", crc32c(body))

    @staticmethod
    def decode(raw: bytes, where: str) -> Part:
        def bad(why: str) -> CorruptCheckpointError:
            return CorruptCheckpointError(
                f"the peer tier's part {where} is damaged ({why}); it is not used: recovery "
                "takes another copy, or the durable checkpoint",
                path=where,
            )

        if len(raw) < 4 or struct.unpack("<I", raw[-4:])[0] != crc32c(raw[:-4]):
            raise bad("its manifest fails its CRC32C")
        try:
            doc = json.loads(raw[:-4])
            if doc["format"] != FORMAT:
                raise bad(f"manifest format {doc['format']!r}, this milepost reads {FORMAT}")
            boxes = tuple(
                Box(
                    array=int(a),
                    index=tuple((int(lo), int(hi)) for lo, hi in index),
                    offset=int(offset),
                    nbytes=int(n),
                    crc32c=int(c),
                )
                for a, index, offset, n, c in doc["boxes"]
            )
            return Part(
                step=int(doc["step"]),
                owner=int(doc["owner"]),
                token=str(doc["token"]),
                hosts=int(doc["hosts"]),
                dtypes=tuple(str(d) for d in doc["dtypes"]),
                boxes=boxes,
                leaves=tuple((int(k), v) for k, v in doc.get("leaves", [])),
            )
        except CorruptCheckpointError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise bad(f"its manifest does not parse: {type(e).__name__}: {e}") from None


@dataclass(frozen=True, kw_only=True)
class Held:
    """A complete part found in a node's folder (a listing's entry)."""

    step: int
    owner: int
    token: str
    nbytes: int


def run_folder(folder: str, run: str, node: str) -> Path:
    """This node's folder for ``run``: ``folder`` with ``{user}`` replaced by this process's user
    name (its uid where it has none) and ``{node}`` by the node's name (a simulated cluster's
    nodes share one machine), then ``run``. Nothing is created or checked here: every use
    checks the folder (the rules: ``milepost.workers.peers._folder``)."""
    for what, name in (("run", run), ("node", node)):
        if not NAME.fullmatch(name) or name in (".", ".."):
            raise ValueError(
                f"peer tier {what} name {name!r}: use up to 64 letters, digits, '_', '.', '-' "
                "(it names a folder)"
            )
    return Path(_folder.expand(folder, node)) / run


def part_folder(root: Path, step: int, owner: int) -> Path:
    return root / f"step_{step}" / f"owner_{owner}"


def make_run_folder(root: Path) -> None:
    """Create the run folder ``root`` (0700, and the folders missing above it), or check the
    one there; this process holds it from then on (``write`` and ``listing`` do the same)."""
    with _folder.run_dir(root, create=True, hold=True):
        pass


def write(root: Path, part: Part, data: np.ndarray) -> None:
    """Write ``part`` (its manifest and ``data``, the boxes' bytes) complete, or not at all:
    into a temporary folder renamed into place. A part of the same step and owner already there
    (of an earlier save of that step) is replaced. The run folder is created as
    :func:`make_run_folder` does (this process holds it)."""
    with _folder.run_dir(root, create=True, hold=True) as opened:
        assert opened is not None and opened.run is not None
        name = f"step_{part.step}"
        step = _folder.open_dir(opened.run, name, root / name, create=True)
        assert step is not None
        try:
            _write_part(step, root / name, part, data)
        finally:
            os.close(step)


def _write_part(step: int, where: Path, part: Part, data: np.ndarray) -> None:
    final = f"owner_{part.owner}"
    tmp = f".tmp.{final}.{uuid.uuid4().hex}"
    old: str | None = None
    try:
        fd = _folder.open_dir(step, tmp, where / tmp, create=True)
        assert fd is not None
        try:
            _folder.create_file(fd, DATA, np.ascontiguousarray(data).data)
            _folder.create_file(fd, MANIFEST, part.encode())
        finally:
            os.close(fd)
        aside = f".old.{final}.{uuid.uuid4().hex}"
        try:  # an earlier part set aside (a rename: a link there is moved, never followed)
            os.rename(final, aside, src_dir_fd=step, dst_dir_fd=step)
            old = aside
        except FileNotFoundError:
            pass
        os.rename(tmp, final, src_dir_fd=step, dst_dir_fd=step)
    except BaseException:
        with contextlib.suppress(OSError):
            _folder.remove(step, tmp, where / tmp)
        if old is not None:  # (the earlier part back in its place)
            with contextlib.suppress(OSError):
                os.rename(old, final, src_dir_fd=step, dst_dir_fd=step)
        raise
    if old is not None:
        _folder.remove(step, old, where / old)


def listing(root: Path) -> list[Held]:
    """The complete parts in this node's folder. A part whose manifest is damaged or whose boxes
    do not tile its data, a link, or a folder that is not this user's is left out (with a log
    line). This process holds the run folder from then on (a recovery uses it)."""
    out: list[Held] = []
    with _folder.run_dir(root, create=False, hold=True) as opened:
        if opened is None or opened.run is None:
            return out
        for entry in _folder.entries(opened.run):
            m = _STEP.fullmatch(entry.name)
            if m:
                out += _listed(opened.run, root / entry.name, entry, int(m.group(1)))
    return out


def _listed(run: int, where: Path, entry: os.DirEntry[str], step: int) -> list[Held]:
    """The complete parts of one step's folder (``entry`` of the run folder ``run``)."""
    if entry.is_symlink():
        log.warning("peer tier: passed over %s: a symbolic link (never followed)", where)
        return []
    try:
        fd = _folder.open_dir(run, entry.name, where, create=False)
    except (UnsafeFolderError, NotADirectoryError) as e:
        log.warning("peer tier: passed over %s: %s", where, e)
        return []
    if fd is None:
        return []
    found: list[Held] = []
    try:
        for inner in _folder.entries(fd):
            o = _OWNER.fullmatch(inner.name)
            if not o:
                continue
            try:
                part = _listed_part(fd, where / inner.name, step, int(o.group(1)))
            except FileNotFoundError:  # (pruned meanwhile)
                continue
            except (OSError, CorruptCheckpointError) as e:
                log.warning("peer tier: passed over a part: %s", e)
                continue
            found.append(
                Held(step=part.step, owner=part.owner, token=part.token, nbytes=part.nbytes)
            )
    finally:
        os.close(fd)
    return found


def _listed_part(step_fd: int, where: Path, step: int, owner: int) -> Part:
    """The manifest of a part (``where``, in the step folder ``step_fd``), its boxes checked."""
    fd = _folder.open_dir(step_fd, where.name, where, create=False)
    if fd is None:
        raise FileNotFoundError(errno.ENOENT, "no such part", str(where))
    try:
        part = _manifest_in(fd, step, owner, str(where))
    finally:
        os.close(fd)
    validate(part, str(where))
    return part


@contextlib.contextmanager
def _open_part(root: Path, step: int, owner: int) -> Iterator[int]:
    """A part's folder, opened (a FileNotFoundError when there is none)."""
    where = part_folder(root, step, owner)
    with _folder.run_dir(root, create=False) as opened:
        if opened is None or opened.run is None:
            raise FileNotFoundError(errno.ENOENT, "no run folder here", str(root))
        name = f"step_{step}"
        fd = _folder.open_dir(opened.run, name, root / name, create=False)
        if fd is None:
            raise FileNotFoundError(errno.ENOENT, f"no step {step} here", str(root / name))
        try:
            part = _folder.open_dir(fd, where.name, where, create=False)
        finally:
            os.close(fd)
        if part is None:
            raise FileNotFoundError(errno.ENOENT, f"no part of host {owner} here", str(where))
        try:
            yield part
        finally:
            os.close(part)


def _manifest_in(fd: int, step: int, owner: int, where: str) -> Part:
    """The manifest in the part folder ``fd``, of step ``step`` and host ``owner``."""
    with os.fdopen(_folder.open_file(fd, MANIFEST, f"{where}/{MANIFEST}"), "rb") as f:
        raw = f.read()
    part = Part.decode(raw, where)
    if (part.step, part.owner) != (step, owner):
        raise CorruptCheckpointError(
            f"the peer tier's part {where} says it is step {part.step} of host {part.owner}; "
            "it is not used",
            path=where,
        )
    return part


def read_manifest(root: Path, step: int, owner: int) -> Part:
    with _open_part(root, step, owner) as fd:
        return _manifest_in(fd, step, owner, str(part_folder(root, step, owner)))


def read(
    root: Path, step: int, owner: int, token: str, *, checked: bool = True
) -> tuple[Part, np.ndarray]:
    """A part's manifest and data, checked whole (the manifest, the size, the boxes' layout,
    each box's CRC32C; all but the CRC32Cs when not ``checked``: for a copy sent to a host that
    checks it itself). The data is the file mapped read-only (a part is never changed in place:
    a new one replaces it by a rename, and a removed file stays readable while mapped); its
    manifest and data are read from one folder, opened once."""
    where = str(part_folder(root, step, owner))
    with _open_part(root, step, owner) as fd:
        part = _manifest_in(fd, step, owner, where)
        if part.token != token:
            raise CorruptCheckpointError(
                f"the peer tier's part {where} is of another save of step {step} (token "
                f"{part.token[:8]}, wanted {token[:8]}); it is not used",
                path=where,
            )
        data = _mapped(fd, f"{where}/{DATA}")
    if checked:
        check(part, data, where)
    else:
        _sized(part, data, where)
        validate(part, where)
    return part, data


def _mapped(fd: int, where: str) -> np.ndarray:
    """The data file in the part folder ``fd``, mapped read-only."""
    data = _folder.open_file(fd, DATA, where)
    try:
        size = os.fstat(data).st_size
        if not size:
            return np.empty(0, np.uint8)
        return np.frombuffer(mmap.mmap(data, size, prot=mmap.PROT_READ), np.uint8)
    finally:
        os.close(data)


def check(part: Part, data: np.ndarray, where: str) -> None:
    """Every box of ``part`` is in ``data`` with its CRC32C (a copy from a peer is checked too),
    and the boxes tile the data (:func:`validate`)."""
    _sized(part, data, where)
    validate(part, where)
    for box in part.boxes:
        if crc32c(data[box.offset : box.offset + box.nbytes]) != box.crc32c:
            raise CorruptCheckpointError(
                f"the peer tier's part {where} is damaged: a box of array {box.array} "
                f"({box.index}) fails its CRC32C; it is not used",
                path=where,
            )


def _sized(part: Part, data: np.ndarray, where: str) -> None:
    if data.size != part.nbytes:
        raise CorruptCheckpointError(
            f"the peer tier's part {where} holds {data.size} bytes, its manifest says "
            f"{part.nbytes}; it is not used",
            path=where,
        )


@functools.lru_cache(maxsize=256)
def _itemsize(dtype: str) -> int | None:
    """Bytes per element of a dtype a part names (``key<impl>``: its ``uint32`` words), or None
    for one milepost does not write (not a number: objects, strings, records)."""
    if _KEY.fullmatch(dtype):
        return 4
    import ml_dtypes  # noqa: F401  (registers bfloat16, float8_*, int4... with NumPy by name)

    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError, SyntaxError):
        return None
    known = dt.kind in "biufc" or dt.type.__module__ == "ml_dtypes"
    return dt.itemsize if known and dt.name == dtype and dt.itemsize > 0 else None


def validate(part: Part, where: str) -> None:
    """The manifest's boxes tile its data (``part.nbytes`` bytes): each of an array the part
    holds, of a dtype milepost writes, its bytes as many as its shape and dtype make, inside the
    data, no two overlapping and none repeated; the owner is one of its hosts. A
    CorruptCheckpointError names the first box that lies."""

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"the peer tier's part {where} is damaged: {why}; it is not used", path=where
        )

    if not 0 <= part.owner < part.hosts:
        raise bad(f"its owner {part.owner} is not one of its {part.hosts} hosts")
    sizes = []
    for k, dtype in enumerate(part.dtypes):
        size = _itemsize(dtype)
        if size is None:
            raise bad(f"array {k}'s dtype {dtype!r} is not one milepost writes")
        sizes.append(size)
    total, seen, ndim = part.nbytes, set(), dict[int, int]()
    for k, box in enumerate(part.boxes):
        name = f"its box {k} (array {box.array}, {box.index})"
        if not 0 <= box.array < len(sizes):
            raise bad(f"{name} is of an array it does not hold (it holds {len(sizes)})")
        if any(not 0 <= lo <= hi for lo, hi in box.index):
            raise bad(f"{name} has a negative or reversed extent")
        if ndim.setdefault(box.array, len(box.index)) != len(box.index):
            raise bad(
                f"{name} has {len(box.index)} dimensions, another box of the array has "
                f"{ndim[box.array]}"
            )
        n = math.prod(hi - lo for lo, hi in box.index) * sizes[box.array]
        if box.nbytes != n:
            raise bad(
                f"{name} says {box.nbytes} bytes; its shape and dtype "
                f"({part.dtypes[box.array]}) make {n}"
            )
        if box.offset < 0 or box.offset + box.nbytes > total:
            raise bad(
                f"{name} lies outside the data (bytes {box.offset} to "
                f"{box.offset + box.nbytes} of {total})"
            )
        if (box.array, box.index) in seen:
            raise bad(f"{name} repeats another box")
        seen.add((box.array, box.index))
    end, last = 0, -1
    for k, box in sorted(enumerate(part.boxes), key=lambda kb: kb[1].offset):
        if box.nbytes and box.offset < end:
            raise bad(f"its box {k} (array {box.array}, {box.index}) overlaps its box {last}")
        if box.nbytes:
            end, last = box.offset + box.nbytes, k


def prune(root: Path, keep: set[int]) -> None:
    """Remove every step but ``keep`` (and every temporary folder left by a killed write of a
    step not kept); a link in the run folder is passed over (with a log line), never
    followed."""
    with _folder.run_dir(root, create=False) as opened:
        if opened is None or opened.run is None:
            return
        for entry in _folder.entries(opened.run):
            m = _STEP.fullmatch(entry.name)
            if not m or int(m.group(1)) in keep:
                continue
            if entry.is_symlink():
                log.warning(
                    "peer tier: passed over %s: a symbolic link (never followed)", root / entry.name
                )
                continue
            try:
                _folder.remove(opened.run, entry.name, root / entry.name)
            except OSError as e:
                log.warning("peer tier: could not remove %s: %s", root / entry.name, e)


def box_view(data: np.ndarray, box: Box, dtype: Any) -> np.ndarray:
    """A box's values as an array of its shape (a view of ``data``)."""
    shape = tuple(hi - lo for lo, hi in box.index)
    dt = np.dtype(dtype)
    if math.prod(shape) * dt.itemsize != box.nbytes:
        raise CorruptCheckpointError(
            f"a box of array {box.array} ({box.index}) holds {box.nbytes} bytes, not "
            f"{math.prod(shape)} x {dt.itemsize}; the part is not used"
        )
    return data[box.offset : box.offset + box.nbytes].view(dt).reshape(shape)
