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

Nothing here trusts the folder: steps and owners are parsed from names this module writes, and
the manifest's CRC32C and every box's CRC32C are checked before a byte is used.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from milepost.workers._checksum import crc32c
from milepost.workers._errors import CorruptCheckpointError
from milepost.workers._messages import Index

FORMAT = 1
MANIFEST = "manifest.json"
DATA = "data"
_STEP = re.compile(r"step_(\d{1,19})")
_OWNER = re.compile(r"owner_(\d{1,9})")
_RUN = re.compile(r"[A-Za-z0-9_.-]{1,64}")


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
    """This node's folder for ``run``: ``folder`` with ``{node}`` replaced by the node's name
    (a simulated cluster's nodes share one machine), then ``run``."""
    for what, name in (("run", run), ("node", node)):
        if not _RUN.fullmatch(name) or name in (".", ".."):
            raise ValueError(
                f"peer tier {what} name {name!r}: use up to 64 letters, digits, '_', '.', '-' "
                "(it names a folder)"
            )
    return Path(folder.replace("{node}", node)) / run


def part_folder(root: Path, step: int, owner: int) -> Path:
    return root / f"step_{step}" / f"owner_{owner}"


def write(root: Path, part: Part, data: np.ndarray) -> None:
    """Write ``part`` (its manifest and ``data``, the boxes' bytes) complete, or not at all:
    into a temporary folder renamed into place. A part of the same step and owner already there
    (of an earlier save of that step) is replaced."""
    final = part_folder(root, part.step, part.owner)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp.owner_{part.owner}.{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        with open(tmp / DATA, "wb") as f:
            f.write(np.ascontiguousarray(data).data)
            f.flush()
            os.fsync(f.fileno())
        with open(tmp / MANIFEST, "wb") as f:
            f.write(part.encode())
            f.flush()
            os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def listing(root: Path) -> list[Held]:
    """The complete parts in this node's folder (a damaged manifest is left out)."""
    out: list[Held] = []
    if not root.is_dir():
        return out
    for step_dir in root.iterdir():
        m = _STEP.fullmatch(step_dir.name)
        if not m or not step_dir.is_dir() or step_dir.is_symlink():
            continue
        for owner_dir in step_dir.iterdir():
            o = _OWNER.fullmatch(owner_dir.name)
            if not o or owner_dir.is_symlink():
                continue
            try:
                part = read_manifest(root, int(m.group(1)), int(o.group(1)))
            except (OSError, CorruptCheckpointError):
                continue
            out.append(Held(step=part.step, owner=part.owner, token=part.token, nbytes=part.nbytes))
    return out


def read_manifest(root: Path, step: int, owner: int) -> Part:
    where = str(part_folder(root, step, owner))
    raw = (part_folder(root, step, owner) / MANIFEST).read_bytes()
    part = Part.decode(raw, where)
    if (part.step, part.owner) != (step, owner):
        raise CorruptCheckpointError(
            f"the peer tier's part {where} says it is step {part.step} of host {part.owner}; "
            "it is not used",
            path=where,
        )
    return part


def read(
    root: Path, step: int, owner: int, token: str, *, checked: bool = True
) -> tuple[Part, np.ndarray]:
    """A part's manifest and data, checked whole (the manifest, the size, each box; only the
    manifest when not ``checked``: for a copy sent to a host that checks it itself). The data
    is the file mapped read-only (a part is never changed in place: a new one replaces it by a
    rename, and a removed file stays readable while mapped)."""
    part = read_manifest(root, step, owner)
    where = str(part_folder(root, step, owner))
    if part.token != token:
        raise CorruptCheckpointError(
            f"the peer tier's part {where} is of another save of step {step} (token "
            f"{part.token[:8]}, wanted {token[:8]}); it is not used",
            path=where,
        )
    path = part_folder(root, step, owner) / DATA
    size = path.stat().st_size
    data = np.memmap(path, np.uint8, mode="r") if size else np.empty(0, np.uint8)
    if checked:
        check(part, data, where)
    elif data.size != part.nbytes:
        check(part, data, where)  # (raises: the size is wrong)
    return part, data


def check(part: Part, data: np.ndarray, where: str) -> None:
    """Every box of ``part`` is in ``data`` with its CRC32C (a copy from a peer is checked too)."""
    if data.size != part.nbytes:
        raise CorruptCheckpointError(
            f"the peer tier's part {where} holds {data.size} bytes, its manifest says "
            f"{part.nbytes}; it is not used",
            path=where,
        )
    for box in part.boxes:
        if crc32c(data[box.offset : box.offset + box.nbytes]) != box.crc32c:
            raise CorruptCheckpointError(
                f"the peer tier's part {where} is damaged: a box of array {box.array} "
                f"({box.index}) fails its CRC32C; it is not used",
                path=where,
            )


def prune(root: Path, keep: set[int]) -> None:
    """Remove every step but ``keep`` (and every temporary folder left by a killed write of a
    step not kept)."""
    if not root.is_dir():
        return
    for step_dir in root.iterdir():
        m = _STEP.fullmatch(step_dir.name)
        if m and int(m.group(1)) not in keep and not step_dir.is_symlink():
            shutil.rmtree(step_dir, ignore_errors=True)


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
