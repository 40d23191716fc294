"""Errors about a checkpoint's contents, raised where they are found (often on a host).

The controller re-exports them as ``milepost.CheckpointNotFoundError`` and
``milepost.CorruptCheckpointError``; each subclasses the builtin a caller would catch.
"""

from __future__ import annotations

import errno
from typing import Any

from milepost.workers import _requests, _views
from milepost.workers._ts_internals import says_damaged, says_no_space, says_over_quota, status_of


class CheckpointNotFoundError(FileNotFoundError):
    """The path is not a committed checkpoint, or a file a checkpoint needs is missing."""


class StillWritingError(TimeoutError):
    """A wait for a save's writes ran out of time while some are still in flight. Whoever
    removes what they write into first settles them (``unsettled``: the pending writes the
    raiser did not hand back otherwise), or they would land after it."""

    def __init__(self, *args: object, unsettled: list[Any] | None = None) -> None:
        super().__init__(*args)
        self.unsettled: list[Any] = list(unsettled or [])


class LostWriteError(OSError):
    """A file a save wrote is missing, or shorter than written, when the save confirms its
    files before the commit: the storage acknowledged a write it did not keep (a proxy or
    gateway that drops writes), or another program removed or cut the file. Nothing was
    committed; save again. ``path``: the file; ``expected_bytes``: what it must at least hold;
    ``found_bytes``: what it holds (None: missing). ``errno`` is ``EIO``."""

    def __init__(
        self,
        *args: Any,
        path: str | None = None,
        expected_bytes: int = 0,
        found_bytes: int | None = None,
    ) -> None:
        super().__init__(*args)
        self.path = path
        self.expected_bytes = expected_bytes
        self.found_bytes = found_bytes


class HostMemoryError(MemoryError):
    """A load cannot allocate the host buffer a box of an array needs: ``nbytes`` for
    ``shape`` of ``dtype``. Either the array is larger than this host can hold (load a part of
    the tree, or onto more hosts), or its header declares more than the checkpoint holds
    (crafted or damaged: ``milepost verify`` reports the chunks it lacks)."""

    def __init__(self, message: str, *, shape: tuple[int, ...], dtype: str, nbytes: int) -> None:
        super().__init__(message)
        self.shape = shape
        self.dtype = dtype
        self.nbytes = nbytes


class MissingDevicesError(ValueError):
    """An array would be placed on devices this JAX runtime does not have: a sharding (a saved
    one from ``milepost.metadata``, or one of the abstract tree) over more devices, or other
    device ids, than are here. ``sharding``: that sharding (a ``ShardingSpec``);
    ``missing``: the device ids not here; ``available``: the ids that are. Load without an
    abstract tree (the saved shardings are placed on the devices here), or pass one with
    shardings over the devices you have."""

    def __init__(
        self,
        message: str,
        *,
        sharding: Any = None,
        missing: tuple[int, ...] = (),
        available: tuple[int, ...] = (),
    ) -> None:
        super().__init__(message)
        self.sharding = sharding
        self.missing = missing
        self.available = available


class CorruptCheckpointError(ValueError):
    """A checkpoint's file is present but damaged: metadata that does not parse or has the
    wrong form, array data that is missing, cut short or fails its checksum.

    What was found damaged, when known, is also data: ``array`` (the array's name), ``chunk``
    (its index in the array's chunk grid), ``path`` (the file, or the folder read) and ``field``
    (what in the file is wrong: ``"shape"``, ``"data_offsets"``...). The
    message may name what a hostile file holds, so it is kept printable (control and
    bidirectional characters as escapes: ``milepost.workers.printable``) for the traceback that
    shows it; the fields keep the names as they are."""

    def __init__(
        self,
        message: str,
        *,
        array: str | None = None,
        chunk: tuple[int, ...] | None = None,
        path: str | None = None,
        field: str | None = None,
    ) -> None:
        super().__init__(_views.printable(message))
        self.array = array
        self.chunk = chunk
        self.path = path
        self.field = field


def from_tensorstore(
    error: BaseException, doing: str, path: str = "", *, reading: bool = False
) -> BaseException:
    """The builtin error a caller would catch for a TensorStore failure (TensorStore raises
    ``ValueError("<STATUS>: ...")`` for everything): a full disk is an ``OSError`` with
    ``errno.ENOSPC``, a denied permission a ``PermissionError``, damaged or missing data read
    from a checkpoint a :class:`CorruptCheckpointError`. ``doing`` and ``path`` name what failed.
    Other errors (not TensorStore's, or a status with no better builtin) are returned unchanged."""
    status = status_of(error)
    if not isinstance(error, ValueError):
        return error
    if status is None:
        # Some decoding failures carry no status (a damaged manifest or B-tree node: "Error
        # decoding manifest: ZSTD_decompressStream() failed: ...", a crafted node's "Invalid key").
        if reading and says_damaged(error):
            return CorruptCheckpointError(
                f"{doing}{f' ({path})' if path else ''} failed: the checkpoint's metadata is "
                f"damaged ({error}). Load an earlier checkpoint."
            )
        return error
    text = str(error)
    where = f" ({path})" if path else ""
    if says_no_space(error) or (status == "RESOURCE_EXHAUSTED" and not reading):
        return OSError(
            errno.ENOSPC,
            f"no space left on the device while {doing}{where}; "
            f"free space or save elsewhere. {text}",
            path or None,
        )
    if says_over_quota(error):
        return OSError(
            errno.EDQUOT, f"disk quota exceeded while {doing}{where}. {text}", path or None
        )
    if status == "PERMISSION_DENIED":
        return PermissionError(
            errno.EACCES, f"permission denied while {doing}{where}. {text}", path or None
        )
    if reading and status in (
        "DATA_LOSS",
        "NOT_FOUND",
        "OUT_OF_RANGE",
        "FAILED_PRECONDITION",
        "INVALID_ARGUMENT",
    ):
        return CorruptCheckpointError(
            f"{doing}{where} failed: the checkpoint's data is missing or "
            f"damaged ({text}). Load an earlier checkpoint."
        )
    if status == "NOT_FOUND":
        return FileNotFoundError(
            errno.ENOENT, f"not found while {doing}{where}. {text}", path or None
        )
    if "Timeout was reached" in text or "curl_code='28'" in text:
        policy = _requests.current()
        return TimeoutError(
            errno.ETIMEDOUT,
            f"the storage did not answer while {doing}{where}: each of "
            f"{policy.max_retries + 1} attempts moved nothing for "
            f"{_requests.silence_in_effect()} s. Check the storage or the network; "
            "milepost.configure_storage(StorageOptions(silence_secs=..., max_retries=...)) "
            "sets how long a request may be silent and how often it is retried. "
            + text.split(" [tensorstore_spec=")[0],
        )
    if status in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
        return OSError(
            errno.EIO, f"storage unavailable while {doing}{where}; try again. {text}", path or None
        )
    return error
