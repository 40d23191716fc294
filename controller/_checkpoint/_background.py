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
  and logs which it waits for; one that fails is logged with its error. When it stops waiting
  for a save (its timeout ran out, or Ctrl-C), it asks the save to stop (the save's ``stop``):
  one that had not begun its commit never begins it, and is logged as abandoned (nothing of it
  is committed; its temporary directory is removed once its writes stop, or by the next save
  of the path); one whose commit marker is being written is waited for (at most its timeout,
  or the storage's request budget if longer; a second Ctrl-C stops that) and logged as
  committed or failed, or, if it is still committing then, as not known. After a Ctrl-C the
  saves and loads after it are not waited for. Then it stops every milepost thread
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


INTERRUPTED = "the exit was interrupted (Ctrl-C)"


class _Job:
    def __init__(
        self,
        name: str,
        timeout: float,
        future: futures.Future[Any],
        stop: Callable[[], str | None] | None,
    ) -> None:
        self.name = name
        self.timeout = timeout
        self.future = future
        self.stop = stop
        """Called when an exit stops waiting for the job: None when it will commit nothing (it
        had not begun its commit, and now never does), else why its outcome is still to come
        (its commit is under way). None: a job that commits nothing (a load, a cleanup)."""


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
        self._unknown: list[tuple[str, _Job]] = []
        """Jobs an exit stopped waiting for while their commit was under way."""
        self._threads = workers.RUNTIME.pool(kind, threads)

    def submit(
        self,
        name: str,
        fn: Callable[[], T],
        timeout: float,
        stop: Callable[[], str | None] | None = None,
    ) -> futures.Future[T]:
        """Run ``fn`` on a thread of the pool; ``name`` (the path) and ``timeout`` (its longest
        wait) say what an exit waits for and how long; ``stop`` is how an exit that stops
        waiting for it abandons it (see :class:`_Job`)."""
        future: futures.Future[T] = futures.Future()
        entry = _Job(name, timeout, future, stop)

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

    def wait_at_exit(self, interrupted: bool = False) -> bool:
        """Wait for the jobs in flight, each at most its timeout, and log how each ended. Once
        the wait is interrupted (Ctrl-C; ``interrupted``: an earlier wait was), stop each job
        still running without waiting for it. Returns whether the exit was interrupted."""
        with self._lock:
            running = list(self._running)
        for job in running:
            if job.future.done():
                continue
            what = f"{self._doing} {job.name}"
            why = INTERRUPTED
            if not interrupted:
                try:
                    log.warning(
                        "the interpreter is exiting; waiting (at most %gs) for %s to end",
                        job.timeout,
                        what,
                    )
                    if _wait(job.future, job.timeout):
                        if (error := job.future.exception()) is not None:
                            _failed(what, error, "")
                        continue
                    why = f"it did not finish within {job.timeout:g}s before the interpreter exited"
                except KeyboardInterrupt:
                    interrupted = True
            interrupted = self._stop(job, what, why) or interrupted
        return interrupted

    def _stop(self, job: _Job, what: str, why: str) -> bool:
        """Stop waiting for ``job`` (``why``) and log what became of it: abandoned before its
        commit, or, its commit under way, its outcome (waited for at most its timeout or the
        storage's request budget, unless Ctrl-C is pressed again). Returns whether it was."""
        if job.stop is None:
            if not job.future.done():
                log.error("abandoned %s: %s%s", what, why, self._abandoned)
            return False
        going_on = job.stop()
        if going_on is None:
            log.error(
                "abandoned %s: %s, and it had not begun its commit; nothing of it was committed "
                "(its temporary directory is removed once its writes stop, or else by the next "
                "save of the path; it is never loaded)",
                what,
                why,
            )
            return False
        # What is left are a few storage requests (the marker, reading back, the rename): each
        # ends within the storage's request budget.
        bound = max(job.timeout, workers.storage_budget_secs())
        again = False
        try:
            if not job.future.done():
                log.warning(
                    "%s: %s, but %s; waiting (at most %gs) for its outcome",
                    what,
                    why,
                    going_on,
                    bound,
                )
            done = _wait(job.future, bound)
        except KeyboardInterrupt:
            done, again = False, True
        if done:
            if (error := job.future.exception()) is not None:
                _failed(what, error, "; nothing of it was committed")
            else:
                log.warning("committed %s before the interpreter exited", what)
            return False
        log.error(
            "the interpreter exits before the outcome of %s is known (%s): it may or may not be "
            "committed; check it with `milepost verify %s`",
            what,
            going_on,
            job.name,
        )
        self._unknown.append((what, job))
        return again

    def log_late_outcomes(self) -> None:
        """Once milepost's threads ended: the outcome of each job whose outcome an exit did not
        know, if it has one now."""
        for what, job in self._unknown:
            if not job.future.done():
                continue
            if (error := job.future.exception()) is not None:
                _failed(what, error, "; nothing of it was committed")
            else:
                log.warning("committed %s after all, as milepost's threads ended", what)


_TICK = 0.1
"""How often an exit's wait wakes to let a Ctrl-C through."""


def _wait(future: futures.Future[Any], timeout: float) -> bool:
    """Whether ``future`` ended within ``timeout`` seconds (its own ``TimeoutError``, if it
    failed with one, is not taken for this wait's). Waits in ticks: the kernel may hand a Ctrl-C's
    SIGINT to a thread other than the main one, and Python raises ``KeyboardInterrupt`` there
    only once it runs again."""
    deadline = time.monotonic() + timeout
    while not future.done():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        futures.wait([future], timeout=min(left, _TICK))
    return True


def _failed(what: str, e: BaseException, outcome: str) -> None:
    log.error(
        "%s failed while the interpreter exited%s: %s: %s",
        what,
        outcome,
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
    """Wait for the saves, then the loads, in flight (each at most its timeout; after a Ctrl-C
    none more), then stop every milepost thread (a Ctrl-C stops that wait too), and log the
    outcome of the saves it stopped waiting for mid-commit, if they have one by then."""
    try:
        LOADS.wait_at_exit(SAVES.wait_at_exit())
        workers.RUNTIME.stop()
        SAVES.log_late_outcomes()
    except KeyboardInterrupt:
        log.error("the interpreter exits without waiting for milepost's threads (Ctrl-C)")


def wait_for_saves(timeout: float | None = None) -> None:
    """Wait for every ``save_async`` still running in this process (each handle's ``result()``
    tells how it ended). ``TimeoutError`` if some are still running after ``timeout`` seconds."""
    SAVES.wait(timeout)
