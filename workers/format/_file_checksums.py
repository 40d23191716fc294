"""Checksums of every file that is not array data, and the checks of what a load opens.

At commit, ``_milepost_checksums.json`` records the size, CRC32C and CRC-32 of every file of the
checkpoint except array chunks (which carry checksums of their own, in ``_milepost.json``): the
checkpoint and tree metadata, the string leaves, the array metadata, the OCDBT manifests, a
custom handler's files. While a load or ``metadata`` of that checkpoint runs (inside
:func:`verifying`), every JSON file :func:`read_json` reads is checked against it first.
Before any of a checkpoint's files is opened, :func:`check_contained` refuses a checkpoint
holding a symlink out of it or anything but files and folders.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from milepost.workers import _declared as declared
from milepost.workers._errors import CheckpointNotFoundError, CorruptCheckpointError
from milepost.workers._paths import ObjectPath, StoragePath, in_object_store, relative_key
from milepost.workers._runtime import RUNTIME
from milepost.workers.format._checksum import crc32c
from milepost.workers.format._files import CHECKSUMS, OCDBT_MANIFEST, OWNER_FILE, write_file


def read_json(path: StoragePath, what: str, *, user_data: bool = False) -> Any:
    """The JSON in ``path``: a missing file is a :class:`CheckpointNotFoundError`, one that is
    not UTF-8 JSON by :func:`milepost.declared.loads`' rules (or fails its recorded
    checksum) a :class:`CorruptCheckpointError`, both naming the file. ``user_data``: a file of
    values a user gave (metrics, custom metadata, a JSON checkpointable), whose ``NaN`` and
    ``Infinity`` are kept."""
    raw = _read(path, what)
    value = parse_json(path, raw, what, user_data=user_data)
    checksums = _VERIFYING.get()
    if checksums is not None:  # well-formed, but is it what was committed?
        checksums.check(path, raw)
    return value


def read_checked(path: StoragePath, what: str) -> bytes:
    """The bytes of ``path``, checked against the recorded checksum (inside :func:`verifying`):
    a missing file is a :class:`CheckpointNotFoundError`, a changed one a
    :class:`CorruptCheckpointError`, both naming the file."""
    raw = _read(path, what)
    checksums = _VERIFYING.get()
    if checksums is not None:
        checksums.check(path, raw)
    return raw


def _read(path: StoragePath, what: str) -> bytes:
    checksums = _VERIFYING.get()
    try:
        return path.read_bytes()
    except FileNotFoundError as e:
        if checksums is not None and checksums.lists(path):
            raise CheckpointNotFoundError(
                f"{what} {path} was committed (it is listed in {CHECKSUMS}) but is missing now: "
                "the checkpoint is damaged. Load an earlier checkpoint."
            ) from e
        raise CheckpointNotFoundError(
            f"{what} {path} is missing: {path.parent} is not a complete checkpoint. "
            "Pass the path of a committed checkpoint (a directory with commit_success.txt)."
        ) from e


def parse_json(path: StoragePath, raw: bytes, what: str, *, user_data: bool = False) -> Any:
    """``raw`` (read from ``path``) as JSON (:func:`milepost.declared.loads`); a
    :class:`CorruptCheckpointError` naming the file if it is not."""
    return declared.loads(raw, str(path), what, user_data=user_data)


def present(path: StoragePath) -> bool:
    """Whether an optional file of the checkpoint being read is there to read: it exists, or the
    checkpoint's checksums say it was committed (then reading it reports it missing)."""
    checksums = _VERIFYING.get()
    return path.exists() or (checksums is not None and checksums.lists(path))


def verified() -> bool:
    """Whether the checkpoint being read has file checksums (it was written by this milepost)."""
    return _VERIFYING.get() is not None


def read_json_object(path: StoragePath, what: str, *, user_data: bool = False) -> dict[str, Any]:
    """Like :func:`read_json`, for files that must hold a JSON object."""
    value = read_json(path, what, user_data=user_data)
    if not isinstance(value, dict):
        raise CorruptCheckpointError(
            f"{what} {path} is not a JSON object (it holds a {type(value).__name__}); the "
            "checkpoint is damaged. Load an earlier checkpoint."
        )
    return value


def _is_array_data(name: str, siblings: set[str]) -> bool:
    """A folder ``name`` of array chunks, among ``siblings`` (the names in its parent): an
    OCDBT database's ``d/``, or a plain zarr3 array's ``c/``."""
    return (name == "d" and OCDBT_MANIFEST in siblings) or (name == "c" and "zarr.json" in siblings)


def _files_to_check(root: Path) -> list[str]:
    """Every file below ``root`` but array data, symlinks and the owner file, as paths relative
    to ``root``. (``os.scandir`` on strings: at 4,096 hosts a commit walks 4,100 folders, and
    ``os.walk`` with ``pathlib`` took 0.18-0.45 s of it.)"""
    out: list[str] = []
    folders = [""]
    while folders:
        rel = folders.pop()
        with os.scandir(os.path.join(root, rel) if rel else root) as listing:
            entries = list(listing)
        names = {e.name for e in entries}
        for entry in entries:
            key = f"{rel}/{entry.name}" if rel else entry.name
            if entry.is_symlink() or (not rel and entry.name == OWNER_FILE):
                continue
            if entry.is_dir(follow_symlinks=False):
                if not _is_array_data(entry.name, names):
                    folders.append(key)
            else:
                out.append(key)
    return sorted(out)


def _crc32(raw: bytes) -> int:
    return zlib.crc32(raw) & 0xFFFFFFFF


@dataclass(frozen=True)
class Checksums:
    """``_milepost_checksums.json``: (size, CRC32C) of each file by path relative to ``root``,
    and (``files_crc32``, since 2026-11) each file's CRC-32 (zlib's polynomial).

    The second digest is what tells OCDBT files apart: they end with their own CRC32C, so the
    CRC32C of a whole such file is the same constant for every file (the CRC residue), and a
    different manifest of the same size would pass. Older checkpoints have only ``files``; older
    milepost versions ignore the new key."""

    root: StoragePath
    files: dict[str, tuple[int, int]]
    crc32: dict[str, int] | None = None

    @staticmethod
    def compute(root: StoragePath) -> Checksums:
        if in_object_store(root):
            return Checksums._compute_objects(root)
        files: dict[str, tuple[int, int]] = {}
        crc32: dict[str, int] = {}
        for key in _files_to_check(root):
            with open(os.path.join(root, key), "rb") as f:
                raw = f.read()
            files[key] = (len(raw), crc32c(raw))
            crc32[key] = _crc32(raw)
        return Checksums(root, files, crc32)

    @staticmethod
    def _compute_objects(root: ObjectPath) -> Checksums:
        """The same over an object store's keys (one listing; array chunks told by their place:
        below an OCDBT database's ``d/`` or a zarr3 array's ``c/``)."""
        keys = root.keys()
        present = set(keys)
        wanted = []
        for key in keys:
            parts = key.split("/")
            chunk = any(
                (part == "d" and "/".join([*parts[:i], OCDBT_MANIFEST]) in present)
                or (part == "c" and "/".join([*parts[:i], "zarr.json"]) in present)
                for i, part in enumerate(parts[:-1])
            )
            if not chunk:
                wanted.append(key)

        def checksum(key: str) -> tuple[int, int, int]:
            raw = (root / key).read_bytes()
            return len(raw), crc32c(raw), _crc32(raw)

        # A few files per host (its databases' manifests, its array_metadatas file): read them
        # concurrently, or a thousand hosts cost thousands of round trips one after another.
        # (in this call's context: what it already read of the store is not asked again)
        context = contextvars.copy_context()
        with RUNTIME.scoped("checksums", min(32, max(1, len(wanted)))) as pool:
            sums = dict(
                zip(
                    wanted, pool.map(lambda k: context.copy().run(checksum, k), wanted), strict=True
                )
            )
        return Checksums(
            root,
            {k: (n, c) for k, (n, c, _) in sums.items()},
            {k: c for k, (_, _, c) in sums.items()},
        )

    def write(self) -> None:
        body: dict[str, Any] = {
            "format": 1,
            "algorithm": "crc32c",
            "files": {k: list(v) for k, v in sorted(self.files.items())},
        }
        if self.crc32 is not None:
            body["files_crc32"] = dict(sorted(self.crc32.items()))
        write_file(
            self.root / CHECKSUMS,
            _canonical({**body, "self_crc32c": crc32c(_canonical(body))}),
        )

    @staticmethod
    def read(root: StoragePath) -> Checksums | None:
        """The checksums of the checkpoint at ``root``; None for checkpoints written without
        them (by Orbax, or older milepost versions)."""
        path = root / CHECKSUMS
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        damaged = CorruptCheckpointError(
            f"{path} is damaged (it does not match its own checksum), so nothing in this "
            "checkpoint can be trusted. Load an earlier checkpoint."
        )
        try:
            data = declared.loads(raw, str(path), "the file checksums")
            if _canonical(data) != raw:  # written in canonical form: any other byte is damage
                raise damaged
            recorded = data.pop("self_crc32c")
            if crc32c(_canonical(data)) != recorded:
                raise damaged
            files = {str(k): (int(v[0]), int(v[1])) for k, v in data["files"].items()}
            crc32 = (
                {str(k): int(v) for k, v in data["files_crc32"].items()}
                if "files_crc32" in data
                else None
            )
        except (
            UnicodeDecodeError,
            ValueError,
            KeyError,
            TypeError,
            AttributeError,
            IndexError,
            OverflowError,
        ) as e:
            raise damaged from e
        return Checksums(root, files, crc32)

    def _key(self, path: StoragePath) -> str:
        """``path`` relative to ``root``, as files are recorded (ValueError if not inside)."""
        return relative_key(path, self.root)

    def lists(self, path: StoragePath) -> bool:
        try:
            return self._key(path) in self.files
        except ValueError:
            return False

    def check_folder(self, folder: StoragePath) -> None:
        """Check every committed file below ``folder`` (the files of a checkpointable whose
        handler reads them itself): each must be there, with its recorded size and CRC32C."""
        prefix = self._key(folder) + "/"
        for key in self.files:
            if key.startswith(prefix):
                path = self.root / key
                try:
                    raw = path.read_bytes()
                except FileNotFoundError as e:
                    raise CheckpointNotFoundError(
                        f"{path} was committed (it is listed in {CHECKSUMS}) but is missing now: "
                        "the checkpoint is damaged. Load an earlier checkpoint."
                    ) from e
                self.check(path, raw)

    def matches(self, key: str, raw: bytes) -> bool:
        """Whether ``raw`` is what was committed as ``key`` (True for files not listed)."""
        recorded = self.files.get(key)
        if recorded is None:
            return True
        size, crc = recorded
        if len(raw) != size or crc32c(raw) != crc:
            return False
        return self.crc32 is None or key not in self.crc32 or _crc32(raw) == self.crc32[key]

    def check(self, path: StoragePath, raw: bytes) -> None:
        """Raise CorruptCheckpointError unless ``raw``, read from ``path``, is what was
        committed."""
        try:
            key = self._key(path)
        except ValueError:
            return
        if not self.matches(key, raw):
            size = self.files[key][0]
            raise CorruptCheckpointError(
                f"{path} is not the file that was committed (size {len(raw)} vs {size}, or its "
                "checksums differ): it was damaged or changed. Load an earlier checkpoint."
            )


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


_VERIFYING: contextvars.ContextVar[Checksums | None] = contextvars.ContextVar(
    "milepost_verifying", default=None
)


@contextlib.contextmanager
def verifying(checksums: Checksums | None) -> Iterator[None]:
    """Check every JSON file :func:`read_json` reads against ``checksums`` inside the block."""
    token = _VERIFYING.set(checksums)
    try:
        yield
    finally:
        _VERIFYING.reset(token)


def check_contained(root: StoragePath) -> None:
    """Refuse a checkpoint with a symlink that leads out of it (reading through it would read
    files that are not the checkpoint's), or with an entry that is neither a file nor a folder
    (a FIFO would block a read forever). Symlinks that stay inside are fine (object stores have
    none)."""
    if in_object_store(root):
        return
    top = root.resolve()
    # Every load runs this over the whole checkpoint (each host's databases and data files):
    # the entries' types come from the directory listings, with no stat per entry.
    folders = [os.fspath(root)]
    while folders:
        try:
            listing = os.scandir(folders.pop())
        except OSError:  # gone or unreadable: the reads that need it report it
            continue
        with listing:
            for entry in listing:
                if entry.is_symlink():
                    target = Path(entry.path).resolve()
                    if target != top and top not in target.parents:
                        raise CorruptCheckpointError(
                            f"{entry.path} is a symlink to {target}, outside the checkpoint "
                            f"{root}; milepost does not read through it. Copy the files into the "
                            "checkpoint instead of linking them"
                        )
                elif entry.is_dir(follow_symlinks=False):
                    folders.append(entry.path)
                elif not entry.is_file(follow_symlinks=False):
                    raise CorruptCheckpointError(
                        f"{entry.path} is not a regular file or folder (a FIFO, socket or device "
                        "file); reading it could block forever. A checkpoint holds only files and "
                        "folders: remove it, or restore the checkpoint from a copy"
                    )
