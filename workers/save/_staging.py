"""Host buffers that ``save_async`` copies shards into, kept from one save to the next.

A training loop saves the same tree again and again; faulting in fresh pages for every save's
copies costs more than the copy itself on a VM that hands freed memory back to its host. After a
save's writes are durable its buffers return here and the next save of the same shapes copies
into memory that is already backed. A buffer goes back only if nothing references it any more
(TensorStore let go of it), and everything pooled is freed once no save asked for a buffer for
``IDLE_SECS``, so an idle process does not keep a checkpoint's worth of memory.
"""

from __future__ import annotations

import math
import sys
import threading

import numpy as np

from milepost.workers._runtime import RUNTIME, Timer

IDLE_SECS = 30.0
ALIGNMENT = 64


class StagingPool:
    def __init__(self, idle_secs: float = IDLE_SECS) -> None:
        self._free: dict[int, list[np.ndarray]] = {}
        """Unused raw byte buffers by the size they serve."""
        self._pooled = 0
        self._lock = threading.Lock()
        self._idle_secs = idle_secs
        self._timer: Timer | None = None

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        """An uninitialized ``ALIGNMENT``-aligned array of ``shape``/``dtype``, and the raw
        buffer under it (to :meth:`give_back` once nothing uses the array)."""
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        with self._lock:
            self._cancel_timer()
            free = self._free.get(nbytes)
            raw = free.pop() if free else None
            if raw is not None:
                self._pooled -= raw.nbytes
        if raw is None:
            raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
        offset = (-raw.ctypes.data) % ALIGNMENT
        return raw[offset : offset + nbytes].view(dtype).reshape(shape), raw

    def give_back(self, raws: list[np.ndarray], keep_bytes: int) -> None:
        """Pool the buffers no one references any more, up to ``keep_bytes`` in all; drop the
        rest. Starts the idle timer."""
        with self._lock:
            for raw, references in zip(raws, _references(raws), strict=True):
                if references > _UNREFERENCED or self._pooled + raw.nbytes > keep_bytes:
                    continue
                self._free.setdefault(raw.nbytes - ALIGNMENT, []).append(raw)
                self._pooled += raw.nbytes
            raws.clear()
            self._cancel_timer()
            if self._pooled:
                self._timer = RUNTIME.call_later(self._idle_secs, self.clear, "staging-idle")

    def keep_only(self, sizes: list[int]) -> None:
        """Free the pooled buffers that a save taking buffers of these byte sizes would not
        use, so that what the pool holds plus what that save allocates stays within what it
        stages."""
        wanted: dict[int, int] = {}
        for n in sizes:
            wanted[n] = wanted.get(n, 0) + 1
        with self._lock:
            for n in list(self._free):
                free = self._free[n]
                keep = wanted.get(n, 0)
                for raw in free[keep:]:
                    self._pooled -= raw.nbytes
                del free[keep:]
                if not free:
                    del self._free[n]

    def clear(self) -> None:
        """Free every pooled buffer."""
        with self._lock:
            self._cancel_timer()
            self._free.clear()
            self._pooled = 0

    @property
    def pooled_bytes(self) -> int:
        with self._lock:
            return self._pooled

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _references(items: list[np.ndarray]) -> list[int]:
    """The reference count of each item, as seen from here."""
    return [sys.getrefcount(item) for item in items]


_UNREFERENCED = _references([np.empty(0)])[0]
"""What :func:`_references` counts for an item held by its list only (a view of a buffer, as
TensorStore may keep, holds the buffer as its base). Measured rather than assumed: which
references the interpreter counts (loop variables, call arguments) differs between versions."""

POOL = StagingPool()
