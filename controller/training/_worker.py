"""One background thread of a Checkpointer's: it runs a function once per request, in order."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from milepost.workers import RUNTIME

_STOP = object()


class Worker:
    """Runs ``fn`` once per :meth:`submit`, in order, on a thread of its own (``milepost-<name>``,
    owned by the runtime); started at the first submit and stopped by a sentinel in
    :meth:`stop`, after the runs already asked for."""

    def __init__(self, fn: Callable[[], None], name: str) -> None:
        self._fn = fn
        self._name = name
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = RUNTIME.thread(self._name, self._run, stop=self._signal_stop)
            self._queue.put(None)

    def _run(self) -> None:
        while self._queue.get() is not _STOP:
            self._fn()
        with self._lock:  # stopped by the runtime: the next submit starts a thread again
            if self._thread is threading.current_thread():
                self._thread = None

    def _signal_stop(self) -> None:
        self._queue.put(_STOP)

    def stop(self, timeout: float) -> None:
        """Finish the runs asked for, then end the thread (waiting at most ``timeout``)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(_STOP)
            thread.join(timeout)
