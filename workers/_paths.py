"""Where checkpoints live: one path type for every storage.

A path is parsed once from what the user passed (:func:`as_path`): a local folder (or
``file://``) is a ``pathlib.Path``; ``gs://``, ``s3://`` and ``memory://`` are an
:class:`ObjectPath`. Any other scheme is an :class:`UnknownStorageError` before anything is
written (a URL is never mistaken for a local path). :data:`StoragePath` names the two; where
they differ, code asks :func:`is_local` or :func:`in_object_store` (and :func:`kvstore`,
:func:`relative_key` do one job for both).

``ObjectPath`` has the part of ``pathlib.Path``'s interface milepost uses on checkpoints
(``/``, ``name``, ``parent``, ``exists``, ``is_dir``, ``read_bytes``, ``write_bytes``,
``iterdir``, ``unlink``...) over TensorStore's kvstores, the client array data goes through,
so small files and arrays reach a bucket the same way. It adds what object stores have and
folders lack: generations, and writes and deletions conditioned on them (leases use these).
Object stores have no folders (a "folder" exists while a key is below it) and no rename.

(``etils.epath`` was weighed and not used: its object-store backends, through ``gcsfs``/
``s3fs`` or TensorFlow, have no conditional writes or generations, and ``memory://`` must be
TensorStore's own memory store, shared with the arrays written there.)

How object stores are reached comes from the standard places, read when a path is opened:

- S3: credentials from ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``
  (or ``AWS_PROFILE`` and the shared files, or the instance's role); the endpoint from
  ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` (MinIO, a local server; TensorStore takes it
  only from the spec, so milepost puts it there) and the region from ``AWS_REGION`` or
  ``AWS_DEFAULT_REGION``.
- GCS: application-default credentials; an emulator from ``TENSORSTORE_GCS_HTTP_URL``. The
  conventional ``STORAGE_EMULATOR_HOST`` alone is refused with the fix (TensorStore does not
  read it, and milepost does not change the process's environment).
- ``memory://``: one store per process, shared by every open (handy in tests and notebooks).
- Retries and the silence limit of ``gs://`` and ``s3://`` requests: this process's
  :class:`~milepost.workers._requests.StorageOptions` (the one variable milepost sets itself is
  TensorStore's silence limit, before the first request, unless the environment has one).
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import fnmatch
import functools
import os
import re
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import tensorstore as ts

from milepost.workers import _requests

if TYPE_CHECKING:  # (typing.TypeIs from Python 3.13; for the type checker only)
    from typing_extensions import TypeIs

SCHEMES = ("file", "gs", "s3", "memory")
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(//?)(.*)$")

NO_VALUE = b"\x02"
"""TensorStore's generation condition 'the key must not exist'."""

STORAGE_ENV_VARS: tuple[str, ...] = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_EC2_METADATA_DISABLED",
    "TENSORSTORE_GCS_HTTP_URL",
    "STORAGE_EMULATOR_HOST",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "GOOGLE_AUTH_TOKEN_FOR_TESTING",
    _requests.ENV,
    _requests.SILENCE_ENV,
    "TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES",
)
"""The variables that decide how this module and TensorStore reach gs:// and s3:// (endpoints,
regions, credentials, emulators): a host process must see the controller's to open its paths."""


def storage_environment() -> dict[str, str]:
    """The :data:`STORAGE_ENV_VARS` set in this process, to give to host processes it starts."""
    return {name: value for name in STORAGE_ENV_VARS if (value := os.environ.get(name)) is not None}


class UnknownStorageError(ValueError):
    """A path names a storage milepost does not write to (or cannot reach)."""


def as_path(path: str | os.PathLike[str] | ObjectPath) -> StoragePath:
    """The path ``path`` names (a ``str``, ``os.PathLike`` or ``ObjectPath``): an absolute
    ``Path`` for local folders, else an :class:`ObjectPath`. An unknown scheme is an
    :class:`UnknownStorageError` (a ``ValueError``) before anything is written."""
    if isinstance(path, ObjectPath):
        return path
    if isinstance(path, Path):
        return Path(os.path.abspath(path))
    text = os.fspath(path) if isinstance(path, str | os.PathLike) else None
    if not isinstance(text, str):
        raise TypeError(
            f"a checkpoint path is a str or os.PathLike naming a folder or a URL, got "
            f"{type(path).__name__} {path!r}; pass e.g. '/ckpt/100' or 's3://bucket/run/100'. "
            "Nothing was written."
        )
    if not text.strip():
        raise ValueError(
            "the checkpoint path is empty; pass the folder to write or read, e.g. '/ckpt/100'. "
            "Nothing was written."
        )
    match = _URL.match(text)
    if match is None or (len(match.group(1)) == 1 and os.name == "nt"):  # no scheme, or a drive
        return Path(os.path.abspath(text))
    scheme, _, rest = match.groups()
    scheme = scheme.lower()
    if scheme == "file":
        return Path(os.path.abspath("/" + rest.lstrip("/")))
    if scheme not in SCHEMES:
        raise UnknownStorageError(
            f"milepost does not know the storage {scheme}:// of {text!r}; it reads and writes "
            "local paths (or file://), gs://, s3:// and memory://. Nothing was written."
        )
    if scheme == "memory":
        return ObjectPath("memory", "", rest.strip("/"))
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise UnknownStorageError(f"{text!r} names no bucket; write {scheme}://<bucket>/<path>")
    return ObjectPath(scheme, bucket, key.strip("/"))


def is_local(path: StoragePath) -> TypeIs[Path]:
    """Whether ``path`` is a local folder (else :func:`in_object_store`). A ``str`` or
    ``os.PathLike`` is read as :func:`as_path` reads it. Code asks this, not ``isinstance``:
    the question is where the checkpoint lives."""
    return isinstance(path, Path) or isinstance(as_path(path), Path)


def in_object_store(path: StoragePath) -> TypeIs[ObjectPath]:
    """Whether ``path`` lies in an object store (an :class:`ObjectPath`): ``not``
    :func:`is_local`. Either question narrows ``path``'s type on both of its branches."""
    return not is_local(path)


def kvstore(path: str | os.PathLike[str] | ObjectPath) -> dict[str, Any]:
    """The TensorStore kvstore spec of the folder ``path`` (its keys are the names below it)."""
    where = as_path(path)
    if in_object_store(where):
        return where.kvstore()
    return {"driver": "file", "path": str(where).rstrip("/") + "/"}


def relative_key(path: StoragePath, root: StoragePath) -> str:
    """``path`` below the folder ``root``, as a '/'-separated name (how checkpoints record their
    files); ValueError when it is not inside (a local path is never inside an object store's
    folder, nor the reverse)."""
    if is_local(path) and is_local(root):
        return path.relative_to(root).as_posix()
    if in_object_store(path) and in_object_store(root):
        return path.relative_to(root).as_posix()
    raise ValueError(f"{path} is not inside {root}")


@functools.cache
def memory_context() -> ts.Context:
    """The one TensorStore context every ``memory://`` open shares (data lives as long as it)."""
    return ts.Context()


def context_for(path: str | os.PathLike[str] | ObjectPath, **resources: Any) -> ts.Context:
    """A TensorStore context for I/O at ``path``: the shared one for ``memory://``; for
    ``gs://`` and ``s3://`` with this process's retry policy (``_requests``)."""
    where = as_path(path)
    if in_object_store(where):
        if where.scheme == "memory":
            return memory_context()
        policy = _requests.start_transport()
        kind = "gcs" if where.scheme == "gs" else where.scheme
        resources = {f"{kind}_request_retries": policy.retries_resource(), **resources}
    return ts.Context(resources) if resources else ts.Context()


def _s3_settings() -> dict[str, Any]:
    out: dict[str, Any] = {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        out["endpoint"] = endpoint
        # An S3-compatible server checks If-None-Match/If-Match itself: one request, atomic
        # (TensorStore would otherwise emulate it with a HEAD first).
        out["use_conditional_write"] = True
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        out["aws_region"] = region
    if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        # no search of profile files, no instance metadata
        out["aws_credentials"] = {"type": "environment"}
    return out


def _check_gcs_environment() -> None:
    """TensorStore reaches a GCS emulator through ``TENSORSTORE_GCS_HTTP_URL`` only. With the
    usual ``STORAGE_EMULATOR_HOST`` alone it would go to the real GCS instead: refused."""
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    if emulator and not os.environ.get("TENSORSTORE_GCS_HTTP_URL"):
        url = emulator if "://" in emulator else f"http://{emulator}"
        raise UnknownStorageError(
            f"STORAGE_EMULATOR_HOST={emulator!r} names a GCS emulator, but TensorStore (which "
            "milepost's gs:// paths go through) reads only TENSORSTORE_GCS_HTTP_URL, so they "
            f"would reach the real GCS. Set TENSORSTORE_GCS_HTTP_URL={url} as well"
        )


@functools.cache
def _bucket(scheme: str, bucket: str) -> ts.KvStore:
    root = ObjectPath(scheme, bucket, "")
    return ts.KvStore.open(root.kvstore(), context=context_for(root)).result()


def _successor(prefix: bytes) -> bytes:
    """The smallest key greater than every key that starts with ``prefix``."""
    trimmed = prefix.rstrip(b"\xff")
    return trimmed[:-1] + bytes([trimmed[-1] + 1]) if trimmed else b""


class _Memo:
    """What one read-only call learned of object stores: listings, objects, generations."""

    def __init__(self) -> None:
        self.listings: dict[tuple[str, str, str], list[str]] = {}
        self.objects: dict[tuple[str, str, str], tuple[bytes | None, bytes | None]] = {}
        self.generations: dict[tuple[str, str, str], bytes | None] = {}

    def clear(self) -> None:
        self.listings.clear()
        self.objects.clear()
        self.generations.clear()

    def _above(self, where: tuple[str, str, str]) -> tuple[list[str], str] | None:
        """A listing of a folder above ``where``, and ``where``'s key relative to it."""
        scheme, bucket, key = where
        for (s, b, above), keys in list(self.listings.items()):  # (threads of a call add)
            if (s, b) == (scheme, bucket) and (not above or key.startswith(above + "/")):
                return keys, key[len(above) + 1 :] if above else key
        return None

    def listed_below(self, where: tuple[str, str, str]) -> list[str] | None:
        """The keys below folder ``where``, from a listing of a folder above it (None: none)."""
        found = self._above(where)
        if found is None:
            return None
        keys, inner = found
        return [k[len(inner) + 1 :] for k in keys if k.startswith(inner + "/")]

    def listed(self, where: tuple[str, str, str]) -> bool | None:
        """Whether a listing of a folder above ``where`` shows it (None: no such listing)."""
        found = self._above(where)
        return None if found is None else found[1] in found[0]

    def absent(self, where: tuple[str, str, str]) -> bool:
        """Whether a listing of a folder above ``where`` shows it is not there."""
        return self.listed(where) is False


_MEMO: contextvars.ContextVar[_Memo | None] = contextvars.ContextVar(
    "milepost_object_memo", default=None
)


def _forget() -> None:
    """A write: what this thread's read-only call remembered may be stale now."""
    memo = _MEMO.get()
    if memo is not None:
        memo.clear()


@contextlib.contextmanager
def reading_once() -> Iterator[None]:
    """Inside, on this thread, each object-store listing, object and existence check is asked of
    the store once: a read-only call (a load, metadata, a verify) reads each small object once,
    however many of its parts look at it. Nothing may be written meanwhile (the answers would
    be stale); :func:`fresh_reads` asks the store again."""
    if _MEMO.get() is not None:
        yield
        return
    token = _MEMO.set(_Memo())
    try:
        yield
    finally:
        _MEMO.reset(token)


@contextlib.contextmanager
def fresh_reads() -> Iterator[None]:
    """Inside, the store is asked again (whether a checkpoint changed while it was read)."""
    token = _MEMO.set(None)
    try:
        yield
    finally:
        _MEMO.reset(token)


class ObjectPath:
    """A key (or key prefix) in an object store, with a pathlib-like interface: ``scheme``
    ('gs', 's3', 'memory'), ``bucket`` (empty for memory) and ``key`` (no leading or trailing
    '/')."""

    __slots__ = ("bucket", "key", "scheme")

    def __init__(self, scheme: str, bucket: str, key: str) -> None:
        self.scheme = scheme
        self.bucket = bucket
        self.key = key

    # -- naming ---------------------------------------------------------------------------
    def __truediv__(self, name: str | os.PathLike[str]) -> ObjectPath:
        return ObjectPath(self.scheme, self.bucket, f"{self.key}/{os.fspath(name)}".strip("/"))

    def __str__(self) -> str:
        if self.scheme == "memory":
            return f"memory://{self.key}"
        return f"{self.scheme}://{self.bucket}/{self.key}"

    def __repr__(self) -> str:
        return f"ObjectPath({str(self)!r})"

    def _parts(self) -> tuple[str, str, str]:
        return (self.scheme, self.bucket, self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectPath) and other._parts() == self._parts()

    def __hash__(self) -> int:
        return hash(self._parts())

    def __lt__(self, other: ObjectPath) -> bool:
        return self._parts() < other._parts()

    @property
    def name(self) -> str:
        """The last part of the key (as ``Path.name``)."""
        return self.key.rstrip("/").rsplit("/", 1)[-1]

    @property
    def parent(self) -> ObjectPath:
        """The folder above (as ``Path.parent``; the bucket's root stays itself)."""
        head = self.key.rstrip("/").rsplit("/", 1)[0] if "/" in self.key.strip("/") else ""
        return ObjectPath(self.scheme, self.bucket, head)

    def with_name(self, name: str) -> ObjectPath:
        """The path beside this one named ``name``."""
        return self.parent / name

    def relative_to(self, other: ObjectPath) -> PurePosixPath:
        """The key below ``other``; ValueError if this path is not inside it."""
        prefix = other.key.rstrip("/") + "/"
        if (self.scheme, self.bucket) != (other.scheme, other.bucket) or not (
            self.key + "/"
        ).startswith(prefix):
            raise ValueError(f"{self} is not inside {other}")
        return PurePosixPath(self.key[len(prefix) :])

    def as_posix(self) -> str:
        """The URL (``gs://bucket/key``), as ``str()`` writes it."""
        return str(self)

    def absolute(self) -> ObjectPath:
        """Itself: an object path is always absolute."""
        return self

    def resolve(self) -> ObjectPath:
        """Itself: an object store has no links to follow."""
        return self

    # -- TensorStore ----------------------------------------------------------------------
    def kvstore(self) -> dict[str, Any]:
        """The kvstore spec of this path as a folder (its keys are the names below it)."""
        path = self.key.rstrip("/") + "/" if self.key else ""
        if self.scheme == "memory":
            return {"driver": "memory", "path": path}
        if self.scheme == "gs":
            _check_gcs_environment()
            return {"driver": "gcs", "bucket": self.bucket, "path": path}
        return {"driver": "s3", "bucket": self.bucket, "path": path, **_s3_settings()}

    @property
    def _kv(self) -> ts.KvStore:
        return _bucket(self.scheme, self.bucket)

    # -- the store ------------------------------------------------------------------------
    def keys(self) -> list[str]:
        """Every key below this folder, relative to it, sorted (one listing)."""
        memo = _MEMO.get()
        where = (self.scheme, self.bucket, self.key)
        if memo is not None:
            if where in memo.listings:
                return memo.listings[where]
            listed = memo.listed_below(where)
            if listed is not None:
                return listed
        prefix = (self.key + "/").lstrip("/").encode()
        every = ts.KvStore.KeyRange(prefix, _successor(prefix)) if prefix else ts.KvStore.KeyRange()
        out = sorted(k[len(prefix) :].decode() for k in self._kv.list(every).result())
        if memo is not None:
            memo.listings[where] = out
        return out

    def read_bytes(self) -> bytes:
        """The object's bytes; FileNotFoundError when it does not exist."""
        raw, _ = self.read_with_generation()
        if raw is None:
            raise FileNotFoundError(errno.ENOENT, "no such object", str(self))
        return raw

    def read_with_generation(self) -> tuple[bytes | None, bytes | None]:
        """The object's bytes and generation; (None, None) when it does not exist."""
        memo = _MEMO.get()
        where = (self.scheme, self.bucket, self.key)
        if memo is not None and where in memo.objects:
            return memo.objects[where]
        if memo is not None and memo.absent(where):
            return None, None
        result = self._kv.read(self.key).result()
        out = (
            (bytes(result.value), bytes(result.stamp.generation))
            if result.state == "value"
            else (None, None)
        )
        if memo is not None:
            memo.objects[where] = out
        return out

    def generation(self) -> bytes | None:
        """The object's generation (changes on every write); None when it does not exist."""
        memo = _MEMO.get()
        where = (self.scheme, self.bucket, self.key)
        if memo is not None:
            if where in memo.objects:
                return memo.objects[where][1]
            if where in memo.generations:
                return memo.generations[where]
            if memo.absent(where):
                return None
        result = self._kv.read(self.key, byte_range=slice(0, 0)).result()
        out = bytes(result.stamp.generation) if result.state == "value" else None
        if memo is not None:
            memo.generations[where] = out
        return out

    def read_text(self) -> str:
        """The object's bytes as UTF-8 text; FileNotFoundError when it does not exist."""
        return self.read_bytes().decode()

    def write_bytes(self, data: bytes, *, if_generation: bytes | None = None) -> bytes:
        """Write the object (durable when this returns); with ``if_generation`` only if its
        generation is that (``NO_VALUE``: only if it does not exist). Returns the new
        generation, ``b''`` when the condition failed."""
        _forget()
        if if_generation is None:
            return bytes(self._kv.write(self.key, data).result().generation)
        return bytes(self._kv.write(self.key, data, if_equal=if_generation).result().generation)

    def write_text(self, text: str) -> None:
        """Write ``text`` (UTF-8) as the object, durable when this returns."""
        self.write_bytes(text.encode())

    def is_file(self) -> bool:
        """Whether an object has this key."""
        memo = _MEMO.get()
        if memo is not None:
            where = (self.scheme, self.bucket, self.key)
            if where in memo.objects:
                return memo.objects[where][0] is not None
            listed = memo.listed(where)
            if listed is not None:
                return listed
        return self.generation() is not None

    def is_dir(self) -> bool:
        """Whether any key lies below this one (a folder exists only while it holds objects)."""
        return bool(self.keys())

    def exists(self) -> bool:
        """Whether it is an object or a folder holding some."""
        return self.is_file() or self.is_dir()

    def is_symlink(self) -> bool:
        """False: an object store has no links."""
        return False

    def iterdir(self) -> Iterator[ObjectPath]:
        """The objects and folders right below this folder."""
        children = sorted({key.split("/", 1)[0] for key in self.keys()})
        return iter([self / child for child in children])

    def glob(self, pattern: str) -> Iterator[ObjectPath]:
        """The entries right below this folder whose names match ``pattern`` (``fnmatch``; no
        ``**``)."""
        return iter([p for p in self.iterdir() if fnmatch.fnmatchcase(p.name, pattern)])

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Nothing to do: a folder exists while a key is below it."""

    def unlink(self, missing_ok: bool = False, *, if_generation: bytes | None = None) -> bool:
        """Delete the object; with ``if_generation`` only if its generation is that."""
        _forget()
        if not missing_ok and not self.is_file():
            raise FileNotFoundError(errno.ENOENT, "no such object", str(self))
        if if_generation is None:
            self._kv.write(self.key, None).result()
            return True
        written = self._kv.write(self.key, None, if_equal=if_generation).result()
        return bytes(written.generation) != b""

    def delete_tree(self) -> ts.Future[None]:
        """Start deleting every key below this folder; returns the future."""
        _forget()
        prefix = (self.key + "/").encode()
        return self._kv.delete_range(ts.KvStore.KeyRange(prefix, _successor(prefix)))


StoragePath = Path | ObjectPath
"""Where a checkpoint lives: a local folder (a ``pathlib.Path``) or a path in an object store
(an :class:`ObjectPath`), as :func:`as_path` returns it. Code names this type, not the two."""
