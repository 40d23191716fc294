"""Where checkpoints live: local folders, and object stores (``gs://``, ``s3://``) or memory
(``memory://``) through TensorStore's kvstores.

A :class:`Location` is parsed once from what the user passed; an unknown scheme is an error
before anything is written (a URL is never mistaken for a local path). Array data and small
files alike go through the same kvstore client, configured from the standard places:

- S3: credentials from ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``
  (or ``AWS_PROFILE`` and the shared files, or the instance's role); the endpoint from
  ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` (MinIO, a local server; TensorStore itself only
  takes it from the spec, so milepost puts it there) and the region from ``AWS_REGION`` or
  ``AWS_DEFAULT_REGION``.
- GCS: application-default credentials; an emulator from ``TENSORSTORE_GCS_HTTP_URL``, or the
  conventional ``STORAGE_EMULATOR_HOST`` (copied to the former).
- ``memory://``: one store per process, shared by every open (handy in tests and notebooks).
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from typing import Any

SCHEMES = ("file", "gs", "s3", "memory")
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(//?)(.*)$")


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
)
"""The variables that decide how this module and TensorStore reach gs:// and s3:// (endpoints,
regions, credentials, emulators): a host process must see the controller's to open its paths."""


def storage_environment() -> dict[str, str]:
    """The :data:`STORAGE_ENV_VARS` set in this process, to give to host processes it starts."""
    return {name: value for name in STORAGE_ENV_VARS if (value := os.environ.get(name)) is not None}


class UnknownStorageError(ValueError):
    """A path names a storage milepost does not write to (or cannot reach)."""


@dataclass(frozen=True, order=True)
class Location:
    """A checkpoint path: ``scheme`` ('file', 'gs', 's3', 'memory'), ``bucket`` (object stores)
    and ``key`` (file: an absolute path; otherwise a prefix without leading or trailing '/')."""

    scheme: str
    bucket: str
    key: str

    @staticmethod
    def of(path: Any) -> Location:
        """Parse a path or URL (a ``str``, ``os.PathLike``, ``etils.epath.Path`` or Location)."""
        if isinstance(path, Location):
            return path
        text = str(path) if not isinstance(path, str | os.PathLike) else os.fspath(path)
        if not isinstance(text, str):
            text = os.fsdecode(text)
        match = _URL.match(text)
        if match is None or (
            len(match.group(1)) == 1 and os.name == "nt"
        ):  # no scheme (or a Windows drive)
            return Location("file", "", os.path.abspath(text))
        scheme, _, rest = match.groups()
        scheme = scheme.lower()
        if scheme == "file":
            return Location("file", "", os.path.abspath("/" + rest.lstrip("/")))
        if scheme not in SCHEMES:
            raise UnknownStorageError(
                f"milepost does not know the storage {scheme}:// of {text!r}; it reads and writes local paths (or "
                "file://), gs://, s3:// and memory://. Nothing was written."
            )
        if scheme == "memory":
            return Location("memory", "", rest.strip("/"))
        bucket, _, key = rest.partition("/")
        if not bucket:
            raise UnknownStorageError(f"{text!r} names no bucket; write {scheme}://<bucket>/<path>")
        return Location(scheme, bucket, key.strip("/"))

    # -- naming ---------------------------------------------------------------------------
    @property
    def is_local(self) -> bool:
        return self.scheme == "file"

    def __str__(self) -> str:
        if self.is_local:
            return self.key
        if self.scheme == "memory":
            return f"memory://{self.key}"
        return f"{self.scheme}://{self.bucket}/{self.key}"

    def __truediv__(self, name: str) -> Location:
        if self.is_local:
            return Location("file", "", os.path.join(self.key, name))
        return Location(self.scheme, self.bucket, f"{self.key}/{name}".strip("/"))

    @property
    def name(self) -> str:
        return self.key.rstrip("/").rsplit("/", 1)[-1]

    @property
    def parent(self) -> Location:
        head = self.key.rstrip("/").rsplit("/", 1)[0] if "/" in self.key.strip("/") else ""
        return Location(self.scheme, self.bucket, head if not self.is_local else (head or "/"))

    def with_name(self, name: str) -> Location:
        return self.parent / name

    def relative_to(self, other: Location) -> str:
        prefix = other.key.rstrip("/") + "/"
        if (self.scheme, self.bucket) != (other.scheme, other.bucket) or not (
            self.key + "/"
        ).startswith(prefix):
            raise ValueError(f"{self} is not inside {other}")
        return self.key[len(prefix) :]

    # -- TensorStore ----------------------------------------------------------------------
    def kvstore(self) -> dict[str, Any]:
        """The kvstore of this location as a folder (its keys are the names below it)."""
        path = self.key.rstrip("/") + "/" if self.key else ""
        if self.is_local:
            return {"driver": "file", "path": path}
        if self.scheme == "memory":
            return {"driver": "memory", "path": path}
        if self.scheme == "gs":
            _gcs_environment()
            return {"driver": "gcs", "bucket": self.bucket, "path": path}
        return {"driver": "s3", "bucket": self.bucket, "path": path, **_s3_settings()}


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
        out["aws_credentials"] = {
            "type": "environment"
        }  # no search of profile files, no instance metadata
    return out


def _gcs_environment() -> None:
    """TensorStore reaches a GCS emulator through ``TENSORSTORE_GCS_HTTP_URL`` only; the usual
    ``STORAGE_EMULATOR_HOST`` means the same."""
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    if emulator and not os.environ.get("TENSORSTORE_GCS_HTTP_URL"):
        os.environ["TENSORSTORE_GCS_HTTP_URL"] = (
            emulator if "://" in emulator else f"http://{emulator}"
        )


@functools.cache
def memory_context() -> Any:
    """The one TensorStore context every ``memory://`` open shares (data lives as long as it)."""
    import tensorstore as ts

    return ts.Context()


def context_for(location: Location, **resources: Any) -> Any:
    """A TensorStore context for I/O at ``location``: the shared one for memory://."""
    import tensorstore as ts

    if location.scheme == "memory":
        return memory_context()
    return ts.Context(resources) if resources else ts.Context()
