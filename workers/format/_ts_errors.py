"""TensorStore's failures as the builtins a caller catches (TensorStore raises
``ValueError("<STATUS>: ...")`` for everything)."""

from __future__ import annotations

import errno

from milepost.workers import _requests
from milepost.workers._errors import CorruptCheckpointError
from milepost.workers.format._ts_internals import (
    says_damaged,
    says_no_space,
    says_over_quota,
    status_of,
)


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
