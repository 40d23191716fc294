"""How requests to object stores (``gs://``, ``s3://``) are retried and given up on.

TensorStore makes the requests. Left to its defaults it waits for a silent request for a
minute, then retries a failed one up to 32 times with back-off up to 32 s: a stalled write
could hold a save for a quarter of an hour, and land long after the save gave up on it. milepost
gives every process one policy instead, :class:`StorageOptions`:

- ``silence_secs``: a request that moves fewer than 256 bytes a second for this long is
  abandoned (then retried). TensorStore reads it once per process, from the environment
  (``TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS``), at its first request.
- ``max_retries``, ``retry_delay_secs``, ``retry_max_delay_secs``: how a failed request
  (throttled, 5xx, reset, abandoned) is retried, with back-off doubling from the first delay to
  the largest; they go in every context milepost opens an object store with.

So one request ends, one way or the other, within :meth:`StorageOptions.request_budget_secs`:
a failed save waits that long at most for its writes to stop before it cleans up.

The policy is the environment's ``MILEPOST_STORAGE`` (JSON of the fields), or the defaults:
:func:`configure_storage` sets both variables in this process, and hosts a slice starts
inherit them with the other storage variables.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import threading
from dataclasses import dataclass
from typing import Any

from milepost.workers import _check as check

ENV = "MILEPOST_STORAGE"
SILENCE_ENV = "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS"

_lock = threading.Lock()
_started: list[int] = []
"""The silence limit TensorStore took (set once the first object-store context is made)."""


@dataclass(frozen=True, kw_only=True)
class StorageOptions:
    """How milepost's requests to ``gs://`` and ``s3://`` are retried and given up on, in this
    process (and the hosts of slices it starts afterwards).

    >>> milepost.configure_storage(milepost.StorageOptions(silence_secs=60, max_retries=10))
    """

    silence_secs: int = 30
    """A request that moves (almost) nothing for this long is abandoned, then retried."""
    max_retries: int = 5
    """Retries of a failed request (throttled, 5xx, reset, abandoned) before the call fails."""
    retry_delay_secs: float = 0.25
    """The wait before the first retry; it doubles for each next one."""
    retry_max_delay_secs: float = 16.0
    """The longest wait between two attempts."""

    def __post_init__(self) -> None:
        check.integer(self.silence_secs, "StorageOptions.silence_secs (seconds)", minimum=1)
        check.integer(self.max_retries, "StorageOptions.max_retries", minimum=0)
        for name in ("retry_delay_secs", "retry_max_delay_secs"):
            check.number(getattr(self, name), f"StorageOptions.{name}", positive=True)
        if self.retry_max_delay_secs < self.retry_delay_secs:
            raise ValueError(
                "StorageOptions.retry_max_delay_secs must be at least retry_delay_secs, got "
                f"{self.retry_max_delay_secs} < {self.retry_delay_secs}"
            )

    def request_budget_secs(self) -> float:
        """The longest one request may take with its retries before TensorStore gives up: every
        attempt silent for ``silence_secs`` (plus a few seconds each to connect and to be
        noticed), and every back-off at its longest."""
        waits, delay = 0.0, self.retry_delay_secs
        for _ in range(self.max_retries):
            waits += delay
            delay = min(2 * delay, self.retry_max_delay_secs)
        return (self.max_retries + 1) * (self.silence_secs + 10) + waits

    def retries_resource(self) -> dict[str, Any]:
        """TensorStore's ``*_request_retries`` context resource for this policy."""
        return {
            "max_retries": self.max_retries,
            "initial_delay": f"{self.retry_delay_secs}s",
            "max_delay": f"{self.retry_max_delay_secs}s",
        }


@functools.cache
def _from_env(raw: str) -> StorageOptions:
    try:
        fields = json.loads(raw)
        if not isinstance(fields, dict):
            raise TypeError("not a JSON object")
        return StorageOptions(**fields)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"{ENV}={raw!r} is not a storage policy ({e}); set it with "
            "milepost.configure_storage(milepost.StorageOptions(...)), or unset it"
        ) from None


def current() -> StorageOptions:
    """This process's policy: the environment's ``MILEPOST_STORAGE``, or the defaults."""
    raw = os.environ.get(ENV)
    return StorageOptions() if not raw else _from_env(raw)


def silence_in_effect() -> int:
    """The silence limit TensorStore uses (or will use) in this process."""
    with _lock:
        if _started:
            return _started[0]
    return _silence_from_env() or current().silence_secs


def budget_secs() -> float:
    """How long one object-store request may take with its retries in this process."""
    options = current()
    return dataclasses.replace(options, silence_secs=silence_in_effect()).request_budget_secs()


def _silence_from_env() -> int | None:
    raw = os.environ.get(SILENCE_ENV)
    try:
        return int(raw) if raw else None
    except ValueError:
        return None


def configure_storage(options: StorageOptions) -> None:
    """Use ``options`` for this process's object-store requests (and for the hosts of slices
    started afterwards). The silence limit can be set only before the first object-store
    request of the process (TensorStore reads it once); retries can change at any time."""
    if not isinstance(options, StorageOptions):
        raise TypeError(f"configure_storage takes a StorageOptions, got {type(options).__name__}")
    with _lock:
        if _started and _started[0] != options.silence_secs:
            raise ValueError(
                f"this process already talks to object stores with a silence limit of "
                f"{_started[0]} s (TensorStore reads it once, at the first request), so "
                f"silence_secs={options.silence_secs} cannot take effect; call "
                "milepost.configure_storage before the first gs:// or s3:// path is used, "
                f"or set {SILENCE_ENV} in the environment that starts the process"
            )
        os.environ[ENV] = json.dumps(dataclasses.asdict(options))
        os.environ[SILENCE_ENV] = str(options.silence_secs)


def start_transport() -> StorageOptions:
    """Called before every object-store context is made: the first call fixes the silence
    limit TensorStore will read (the environment's, if the user set one); returns the policy."""
    options = current()
    with _lock:
        if not _started:
            silence = _silence_from_env()
            if silence is None:
                silence = options.silence_secs
                os.environ[SILENCE_ENV] = str(silence)
            _started.append(silence)
    return options
