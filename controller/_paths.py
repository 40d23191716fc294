"""One path type for every storage: ``pathlib.Path`` for local folders, :class:`ObjectPath` for
object stores (``gs://``, ``s3://``) and ``memory://``.

``ObjectPath`` has the part of ``pathlib.Path``'s interface milepost uses on checkpoints
(``/``, ``name``, ``parent``, ``exists``, ``is_dir``, ``read_bytes``, ``write_bytes``,
``iterdir``, ``unlink``...), over the same TensorStore kvstore client the array data uses, so
small files and arrays reach a bucket the same way and nothing needs fsspec. Object stores have
no folders (a "folder" exists while a key is below it) and no rename; the commit protocol there
is different (see ``_commit_protocols``).
"""

from __future__ import annotations

import errno
import fnmatch
import functools
import os
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import tensorstore as ts

from milepost.workers import Location

NO_VALUE = b"\x02"
"""TensorStore's generation condition 'the key must not exist'."""


def as_path(path: Any) -> Path | ObjectPath:
    """The path ``path`` names: an absolute ``Path`` for local folders, else an ObjectPath.
    An unknown scheme is an UnknownStorageError (a ValueError) before anything is written."""
    if isinstance(path, ObjectPath):
        return path
    location = Location.of(path)
    return Path(location.key) if location.is_local else ObjectPath(location)


def is_local(path: Any) -> bool:
    return isinstance(path, Path)


@functools.cache
def _bucket(scheme: str, bucket: str) -> Any:
    location = Location(scheme, bucket, "")
    from milepost.workers import _storage

    return ts.KvStore.open(location.kvstore(), context=_storage.context_for(location)).result()


def _successor(prefix: bytes) -> bytes:
    """The smallest key greater than every key that starts with ``prefix``."""
    trimmed = prefix.rstrip(b"\xff")
    return trimmed[:-1] + bytes([trimmed[-1] + 1]) if trimmed else b""


class ObjectPath:
    """A key (or key prefix) in an object store, with a pathlib-like interface."""

    def __init__(self, location: Location) -> None:
        self.location = location

    # -- naming ---------------------------------------------------------------------------
    def __truediv__(self, name: str | os.PathLike[str]) -> ObjectPath:
        return ObjectPath(self.location / os.fspath(name))

    def __str__(self) -> str:
        return str(self.location)

    def __repr__(self) -> str:
        return f"ObjectPath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectPath) and other.location == self.location

    def __hash__(self) -> int:
        return hash(self.location)

    def __lt__(self, other: ObjectPath) -> bool:
        return self.location < other.location

    @property
    def name(self) -> str:
        return self.location.name

    @property
    def parent(self) -> ObjectPath:
        return ObjectPath(self.location.parent)

    def with_name(self, name: str) -> ObjectPath:
        return ObjectPath(self.location.with_name(name))

    def relative_to(self, other: ObjectPath) -> PurePosixPath:
        return PurePosixPath(self.location.relative_to(other.location))

    def as_posix(self) -> str:
        return str(self)

    def absolute(self) -> ObjectPath:
        return self

    def resolve(self) -> ObjectPath:
        return self

    # -- the store ------------------------------------------------------------------------
    @property
    def _kv(self) -> Any:
        return _bucket(self.location.scheme, self.location.bucket)

    @property
    def _key(self) -> str:
        return self.location.key

    def keys(self) -> list[str]:
        """Every key below this folder, relative to it, sorted (one listing)."""
        prefix = (self._key + "/").lstrip("/").encode()
        keys = self._kv.list(
            ts.KvStore.KeyRange(prefix, _successor(prefix)) if prefix else ts.KvStore.KeyRange()
        ).result()
        return sorted(k[len(prefix) :].decode() for k in keys)

    def read_bytes(self) -> bytes:
        result = self._kv.read(self._key).result()
        if result.state != "value":
            raise FileNotFoundError(errno.ENOENT, "no such object", str(self))
        return bytes(result.value)

    def generation(self) -> bytes | None:
        """The object's generation (changes on every write); None when it does not exist."""
        result = self._kv.read(self._key, byte_range=slice(0, 0)).result()
        return bytes(result.stamp.generation) if result.state == "value" else None

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def write_bytes(self, data: bytes, *, if_generation: bytes | None = None) -> bytes:
        """Write the object (durable when this returns); with ``if_generation`` only if its
        generation is that (``NO_VALUE``: only if it does not exist). Returns the new generation,
        ``b''`` when the condition failed."""
        if if_generation is None:
            return bytes(self._kv.write(self._key, data).result().generation)
        return bytes(self._kv.write(self._key, data, if_equal=if_generation).result().generation)

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode())

    def is_file(self) -> bool:
        return self.generation() is not None

    def is_dir(self) -> bool:
        return bool(self.keys())

    def exists(self) -> bool:
        return self.is_file() or self.is_dir()

    def is_symlink(self) -> bool:
        return False

    def iterdir(self) -> Iterator[ObjectPath]:
        children = sorted({key.split("/", 1)[0] for key in self.keys()})
        return iter([self / child for child in children])

    def glob(self, pattern: str) -> Iterator[ObjectPath]:
        return iter([p for p in self.iterdir() if fnmatch.fnmatchcase(p.name, pattern)])

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Nothing to do: a folder exists while a key is below it."""

    def unlink(self, missing_ok: bool = False, *, if_generation: bytes | None = None) -> bool:
        """Delete the object; with ``if_generation`` only if its generation is that."""
        if not missing_ok and not self.is_file():
            raise FileNotFoundError(errno.ENOENT, "no such object", str(self))
        if if_generation is None:
            self._kv.write(self._key, None).result()
            return True
        return (
            bytes(self._kv.write(self._key, None, if_equal=if_generation).result().generation)
            != b""
        )

    def delete_tree(self) -> Any:
        """Start deleting every key below this folder; returns the future."""
        prefix = (self._key + "/").encode()
        return self._kv.delete_range(ts.KvStore.KeyRange(prefix, _successor(prefix)))
