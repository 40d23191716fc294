"""Read buffers kept from one load to the next in a long-lived process.

A load reads into private anonymous mappings that the device arrays adopt (CPU). On this kind
of VM the first touch of every 4 KiB page of a fresh mapping is a fault, often a host fault,
and a cold read into fresh memory runs markedly slower than into memory already touched
(docs/performance.md#code-figures). A notebook or a training script loads again and again: once
the arrays of an earlier load are gone, their mappings serve the next.

Safety: a mapping returns here only when no view of it is left. Every array handed out is a
plain view of an owner array (``_Owner``) over the mapping; the owner's finalizer runs once the
last view, and whatever adopted one (an XLA buffer), is gone. The finalizer only puts the
mapping into a ``SimpleQueue`` (reentrant: it never takes a lock, so it may run anywhere, even
inside this module while its lock is held).

Memory: the pool never makes a process hold more than it would without it plus one buffer. A
request it cannot serve with a mapping of the same size first releases pooled mappings of at
least that many bytes, then maps new memory; and a keeper thread releases everything pooled
once no load took a buffer for ``IDLE_SECS``. The keeper never takes mappings off the queue
itself: it wakes on a clock, so what a caller sees pooled does not depend on its timing.
"""

from __future__ import annotations

import mmap
import queue
import threading
import time
from typing import Any

import numpy as np

from milepost.workers._runtime import RUNTIME

IDLE_SECS = 10.0
_HUGE_PAGE_BYTES = 2 << 20
_HUGEPAGE: int | None = getattr(mmap, "MADV_HUGEPAGE", None)


class _Owner(np.ndarray):
    """The array every handed-out view of a pooled mapping descends from."""

    _mapping: Any = None
    _pool: Any = None

    def __del__(self) -> None:
        pool, mapping = self._pool, self._mapping
        if pool is not None and mapping is not None and not pool._closed:
            pool._returned.put(mapping)  # reentrant, never blocks


class ReadPool:
    def __init__(self, idle_secs: float = IDLE_SECS) -> None:
        self._idle_secs = idle_secs
        self._returned: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
        """Mappings whose arrays are gone, not yet moved to ``_free``."""
        self._lock = threading.Lock()
        self._free: dict[int, list[mmap.mmap]] = {}
        self._pooled = 0
        self._last_take = 0.0
        self._keeper: threading.Thread | None = None
        self._stop = threading.Event()
        self._closed = False
        self.hits = self.misses = 0

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 array of ``nbytes`` over a private anonymous mapping (reused if one of that
        size is free), page-aligned, uninitialized."""
        with self._lock:
            self._last_take = time.monotonic()
            self._drain()
            free = self._free.get(nbytes)
            mapping = free.pop() if free else None
            if mapping is not None:
                self._pooled -= nbytes
                self.hits += 1
            else:
                self.misses += 1
                self._release(nbytes)
            self._start_keeper()
        if mapping is None:
            mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if nbytes >= _HUGE_PAGE_BYTES and _HUGEPAGE is not None:
                # Huge pages: a 2 MiB page is one fault where 512 small pages are 512. The
                # hint gets them where the system gives them only on request (THP "madvise")
                # and, with defrag "madvise", where it would otherwise fall back to small pages.
                mapping.madvise(_HUGEPAGE)
        # The owner is built on the mapping itself: NumPy collapses a view's base through
        # arrays of the view's own type that do not own their data, so an owner that were a
        # view of a plain array could be skipped (and finalized while its views live on).
        owner = _Owner((nbytes,), np.uint8, mapping)
        owner._mapping = mapping
        owner._pool = self
        return owner.view(np.ndarray)

    @property
    def pooled_bytes(self) -> int:
        with self._lock:
            self._drain()
            return self._pooled

    def clear(self) -> None:
        """Release every pooled mapping (those still in use come back later, and are released
        by the keeper once idle)."""
        with self._lock:
            self._drain()
            self._release(self._pooled)

    def close(self) -> None:
        """Stop the keeper thread (waiting for it) and release everything pooled; buffers
        still in use are released when they come back."""
        with self._lock:
            keeper, self._keeper = self._keeper, None
            stop = self._stop
            self._closed = True
            self._drain()
            self._release(self._pooled)
        if keeper is not None:
            stop.set()
            keeper.join()

    def _drain(self) -> None:
        while True:
            try:
                mapping = self._returned.get_nowait()
            except queue.Empty:
                return
            if not self._closed:
                self._free.setdefault(len(mapping), []).append(mapping)
                self._pooled += len(mapping)

    def _release(self, nbytes: int) -> None:
        """Drop pooled mappings (largest first) until ``nbytes`` are released or none is left."""
        released = 0
        for size in sorted(self._free, reverse=True):
            free = self._free[size]
            while free and released < nbytes:
                free.pop()
                released += size
                self._pooled -= size
            if not free:
                del self._free[size]
            if released >= nbytes:
                return

    def _start_keeper(self) -> None:
        if self._keeper is None and not self._closed:
            stop = self._stop = threading.Event()  # the new keeper's own
            self._keeper = RUNTIME.thread(
                "readpool", lambda: self._keep(stop), stop=self._stop_keeper
            )

    def _stop_keeper(self) -> None:
        """Stop the keeper (what is pooled stays pooled; the next take starts it again)."""
        with self._lock:
            keeper, self._keeper = self._keeper, None
            stop = self._stop
        if keeper is not None:
            stop.set()
            if keeper is not threading.current_thread():
                keeper.join()

    def _keep(self, stop: threading.Event) -> None:
        """Every half ``idle_secs``: release everything pooled once no buffer was taken for
        ``idle_secs`` (a mapping that comes back later goes at the next wake-up after it came
        back); stops when ``stop`` is set (:meth:`close`, or the runtime stopping it)."""
        while not stop.wait(self._idle_secs / 2):
            with self._lock:
                if time.monotonic() - self._last_take >= self._idle_secs:
                    self._drain()
                    self._release(self._pooled)


POOL = ReadPool()
