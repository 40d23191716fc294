"""Background work with an owner: the part of every ``save_async`` that runs after it returns,
and every ``load_async``.

Each background save runs on a thread of the runtime's ``save`` pool (its threads wait for the
next save: starting a thread waits for it to be scheduled, which a training loop's save would pay
in its blocking part while the previous writes keep every core busy); each background load on
the one thread of the runtime's ``load`` pool, so that a process's loads run one after another
in the order they were asked for (in a multi-controller job every process then meets the
loads' barriers in the same order). Each is registered with its owner (:data:`SAVES`,
:data:`LOADS`) until it ends, so that

- ``milepost.wait_for_saves()`` waits for every save in flight in this process;
- an interpreter exit with saves or loads in flight waits for them (each at most its timeout)
  and logs which it waits for; one that still does not finish is logged as abandoned (nothing
  of a save is committed then: its temporary directory stays, and is never loaded), one that
  fails is logged with its error. Then it stops every milepost thread
  (``milepost.workers.RUNTIME``).

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


class _Job:
    def __init__(self, name: str, timeout: float, future: futures.Future[Any]) -> None:
        self.name = name
        self.timeout = timeout
        self.future = future


class Background:
    """The owner of one kind of this process's background work: ``kind`` (``'save'``) names
    its runtime pool and its messages, ``threads`` bounds the jobs running at once (None: no
    bound), ``doing`` says what a job is before its name (``'the save to'``) and ``abandoned``
    what an abandoned job leaves (or ``''``)."""

    def __init__(self, kind: str, threads: int | None, *, doing: str, abandoned: str) -> None:
        self.kind = kind
        self._doing = doing
        self._abandoned = abandoned
        self._lock = threading.Lock()
        self._running: list[_Job] = []
        self._threads = workers.RUNTIME.pool(kind, threads)

    def submit(self, name: str, fn: Callable[[], T], timeout: float) -> futures.Future[T]:
        """Run ``fn`` on a thread of the pool; ``name`` (the path) and ``timeout`` (its longest
        wait) say what an exit waits for and how long."""
        future: futures.Future[T] = futures.Future()
        entry = _Job(name, timeout, future)

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

        _watch_exit()
        with self._lock:
            self._running.append(entry)
        try:
            self._threads.submit(run)
        except BaseException:
            with self._lock:
                self._running.remove(entry)
            raise
        return future

    def in_flight(self) -> list[str]:
        """Names of the jobs still running (or waiting for a thread), oldest first."""
        with self._lock:
            return [s.name for s in self._running]

    def wait(self, timeout: float | None = None) -> None:
        """Wait until no job is running (those started meanwhile included). Failures are not
        raised here: each job's handle re-raises its own."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                running = [s.future for s in self._running]
            if not running:
                return
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(
                    f"{len(running)} milepost {self.kind}(s) still "
                    f"running after {timeout}s: {self.in_flight()}"
                )
            futures.wait(running, timeout=left)

    def wait_at_exit(self) -> None:
        """Wait for the jobs in flight, each at most its timeout, and log how each ended."""
        with self._lock:
            running = list(self._running)
        for job in running:
            if job.future.done():
                continue
            what = f"{self._doing} {job.name}"
            log.warning(
                "the interpreter is exiting; waiting (at most %gs) for %s to end", job.timeout, what
            )
            try:
                job.future.result(timeout=job.timeout)
            except futures.TimeoutError:
                log.error(
                    "abandoned %s: it did not finish within %gs before the interpreter exited%s",
                    what,
                    job.timeout,
                    self._abandoned,
                )
            except BaseException as e:
                log.error(
                    "%s failed while the interpreter exited: %s: %s",
                    what,
                    type(e).__name__,
                    e,
                    exc_info=e,
                )


SAVES = Background("save", None, doing="the save to", abandoned="; nothing of it was committed")
LOADS = Background("load", 1, doing="the load of", abandoned="")

_exit_lock = threading.Lock()
_exit_hook = False


def _watch_exit() -> None:
    """Register the exit hook, once, at the first background job: after
    ``jax.distributed.initialize`` registered its own shutdown (atexit runs last-registered
    first), so the jobs end first."""
    global _exit_hook
    with _exit_lock:
        if not _exit_hook:
            atexit.register(_at_exit)
            _exit_hook = True


def _at_exit() -> None:
    """Wait for the saves, then the loads, in flight (each at most its timeout), then stop every
    milepost thread."""
    SAVES.wait_at_exit()
    LOADS.wait_at_exit()
    workers.RUNTIME.stop()


def wait_for_saves(timeout: float | None = None) -> None:
    """Wait for every ``save_async`` still running in this process (each handle's ``result()``
    tells how it ended). ``TimeoutError`` if some are still running after ``timeout`` seconds."""
    SAVES.wait(timeout)
