"""Background work with an owner: the part of every ``save_async`` that runs after it returns.

Each background save runs on a thread of the runtime's ``save`` pool (its threads wait for the
next save: starting a thread waits for it to be scheduled, which a training loop's save would pay
in its blocking part while the previous writes keep every core busy), registered here until it
ends, so that

- ``milepost.wait_for_saves()`` waits for every save in flight in this process;
- an interpreter exit with saves in flight waits for them (each at most its timeout) and logs
  which it waits for; a save that still does not finish is logged as abandoned (nothing of it
  is committed: its temporary directory stays, and is never loaded). Then it stops every
  milepost thread (``milepost.workers.RUNTIME``).

A process killed outright (SIGKILL) cannot wait: atomic commit is what keeps that safe.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any, TypeVar

from milepost import workers

log = logging.getLogger("milepost")

T = TypeVar("T")


class _Save:
    def __init__(self, name: str, timeout: float, future: futures.Future[Any]) -> None:
        self.name = name
        self.timeout = timeout
        self.future = future


class BackgroundSaves:
    """The owner of this process's background saves."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: list[_Save] = []
        self._exit_hook = False
        self._threads = workers.RUNTIME.pool("save", None)

    def submit(self, name: str, fn: Callable[[], T], timeout: float) -> futures.Future[T]:
        """Run ``fn`` on a thread of its own; ``name`` (the path) and ``timeout`` (its longest
        wait) say what an exit waits for and how long."""
        future: futures.Future[T] = futures.Future()
        entry = _Save(name, timeout, future)

        def run() -> None:
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        result = fn()
                    except BaseException as e:
                        future.set_exception(e)
                    else:
                        future.set_result(result)
            finally:
                with self._lock:
                    self._running.remove(entry)

        with self._lock:
            if not self._exit_hook:
                # Registered at the first save, so after jax.distributed.initialize registered
                # its own shutdown: atexit runs last-registered first, so saves finish first.
                atexit.register(self._at_exit)
                self._exit_hook = True
            self._running.append(entry)
        try:
            self._threads.submit(run)
        except BaseException:
            with self._lock:
                self._running.remove(entry)
            raise
        return future

    def in_flight(self) -> list[str]:
        """Names of the saves still running, oldest first."""
        with self._lock:
            return [s.name for s in self._running]

    def wait(self, timeout: float | None = None) -> None:
        """Wait until no save is running (those started meanwhile included). Failures are not
        raised here: each save's handle re-raises its own."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                running = [s.future for s in self._running]
            if not running:
                return
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(
                    f"{len(running)} milepost save(s) still "
                    f"running after {timeout}s: {self.in_flight()}"
                )
            futures.wait(running, timeout=left)

    def _at_exit(self) -> None:
        """Wait for the saves in flight (each at most its timeout), then stop every milepost
        thread."""
        with self._lock:
            running = list(self._running)
        for save in running:
            if save.future.done():
                continue
            log.warning(
                "the interpreter is exiting; waiting (at most %gs) for the save to %s to end",
                save.timeout,
                save.name,
            )
            try:
                save.future.result(timeout=save.timeout)
            except futures.TimeoutError:
                log.error(
                    "abandoned the save to %s: it did not finish within %gs before the "
                    "interpreter exited; nothing of it was committed",
                    save.name,
                    save.timeout,
                )
            except BaseException as e:
                log.error(
                    "the save to %s failed while the interpreter exited: %s: %s",
                    save.name,
                    type(e).__name__,
                    e,
                    exc_info=e,
                )
        workers.RUNTIME.stop()


SAVES = BackgroundSaves()


def wait_for_saves(timeout: float | None = None) -> None:
    """Wait for every ``save_async`` still running in this process (each handle's ``result()``
    tells how it ended). ``TimeoutError`` if some are still running after ``timeout`` seconds."""
    SAVES.wait(timeout)
