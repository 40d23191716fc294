"""The one owner of every thread milepost starts.

Each thread is started here, named ``milepost-<what>``, and known until it ends:

- **pools** (:meth:`Runtime.pool`): shared by every call, started on first use; a pool's
  threads end after :attr:`Runtime.idle_secs` without work and start again when work comes
  (the copy pool, background saves, safetensors reads);
- **scoped pools** (:meth:`Runtime.scoped`): the threads of one call (a load's direct reads,
  a copy job's files), stopped when the call ends;
- **threads** (:meth:`Runtime.thread`): one worker with a stop function (a Checkpointer's
  mirror and retention, a lease's heartbeat, the progress ticker, the read pool's keeper);
- **timers** (:meth:`Runtime.call_later`): callbacks run after a delay, all on one clock
  thread that ends when no timer is pending (the staging pool's idle release).

:meth:`Runtime.stop` stops all of them and waits for them (the interpreter's exit does, once
the saves in flight have finished); whatever is asked of the runtime afterwards starts anew.

Pools run their jobs on daemon threads of their own rather than ``concurrent.futures``'s:
those refuse new work once the interpreter begins to exit, before ``atexit`` handlers run,
while a save that the exit waits for still hands jobs to its pools. Python 3.12 starts no new
thread at all by then: a pool with no free thread runs the job on the thread that submits it,
and a timer asked for then is dropped (nothing is due after the exit).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

log = logging.getLogger("milepost")

T = TypeVar("T")
R = TypeVar("R")

PREFIX = "milepost-"
"""Every thread milepost starts has a name beginning with this."""

_STOP = object()


class Pool:
    """Threads that run submitted jobs, at most ``threads`` at once (None: as many as jobs
    waiting). A thread ends after ``idle_secs`` without a job; :meth:`stop` ends them all
    once the jobs already submitted have run."""

    def __init__(self, runtime: Runtime, name: str, threads: int | None, idle_secs: float) -> None:
        if threads is not None and threads < 1:
            raise ValueError(f"a pool needs at least one thread, got {threads}")
        self.name = name
        self._runtime = runtime
        self._max = threads
        self._idle_secs = idle_secs
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads: set[threading.Thread] = set()
        self._waiting = 0
        """Threads blocked on (or about to block on) the queue."""
        self._queued = 0
        """Jobs in the queue that no thread has taken yet."""

    @property
    def max_threads(self) -> int | None:
        """The most threads it runs at once (None: no bound)."""
        return self._max

    @property
    def threads(self) -> int:
        """Threads alive now."""
        with self._lock:
            return len(self._threads)

    @property
    def idle_threads(self) -> int:
        """Threads waiting for a job now: the next job submitted runs on one of them."""
        with self._lock:
            return self._waiting

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Run ``fn(*args, **kwargs)`` on a thread of the pool; its future. A job whose
        future was cancelled before a thread took it does not run."""
        future: Future[T] = Future()
        alone = False
        with self._lock:
            self._jobs.put((future, fn, args, kwargs))
            self._queued += 1
            if self._queued > self._waiting and (
                self._max is None or len(self._threads) < self._max
            ):
                alone = not self._start()  # (every thread is busy, and none can start)
        if alone:
            self._run_here(future)
        return future

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
        """``[fn(item) for item in items]``, run on the pool; the first failure is raised once
        every job has ended."""
        futures = [self.submit(fn, item) for item in items]
        for future in futures:
            future.exception()  # wait for every one, failed or not
        return [future.result() for future in futures]

    def _start(self) -> bool:
        """Start a thread (under the lock); False if none can start now."""
        thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
        self._threads.add(thread)
        self._runtime._started(thread)
        try:
            thread.start()
        except RuntimeError:
            # Python 3.12 starts no thread once the interpreter exits (its atexit handlers,
            # where a save in flight at exit finishes); then the caller runs the jobs itself.
            self._threads.discard(thread)
            self._runtime._ended(thread)
            return False
        return True

    def _run_here(self, future: Future[Any]) -> None:
        """Run this pool's queued jobs on the calling thread until ``future``'s job has run:
        no thread of the pool is free, and none can start."""
        while not future.done():
            with self._lock:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    return
                if job is _STOP:
                    continue
                self._queued -= 1
            _run_job(job)

    def _serve(self) -> None:
        me = threading.current_thread()
        try:
            while True:
                with self._lock:
                    self._waiting += 1
                try:
                    job = self._jobs.get(timeout=self._idle_secs)
                except queue.Empty:
                    job = None
                with self._lock:
                    self._waiting -= 1
                    if job is None:
                        try:  # a job queued between the timeout and the lock is ours
                            job = self._jobs.get_nowait()
                        except queue.Empty:
                            self._threads.discard(me)
                            return
                    if job is _STOP:
                        self._threads.discard(me)
                        return
                    self._queued -= 1
                _run_job(job)
                del job  # nothing of a job outlives it here
        finally:
            self._runtime._ended(me)

    def stop(self, timeout: float | None = None) -> None:
        """Let the threads finish the jobs submitted so far, then end them (waiting at most
        ``timeout``). The pool takes work again afterwards (with new threads)."""
        with self._lock:
            threads = list(self._threads)
            for _ in threads:
                self._jobs.put(_STOP)
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))


def _run_job(job: tuple[Future[Any], Callable[..., Any], Any, Any]) -> None:
    future, fn, args, kwargs = job
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn(*args, **kwargs)
    except BaseException as e:
        future.set_exception(e)
    else:
        future.set_result(result)


class Timer:
    """A callback due at ``when`` on the runtime's clock; :meth:`cancel` drops it."""

    def __init__(self, when: float, fn: Callable[[], Any], name: str) -> None:
        self.when = when
        self.fn = fn
        self.name = name
        self.cancelled = False
        self.fired = False

    def cancel(self) -> None:
        self.cancelled = True

    def is_alive(self) -> bool:
        """Still due: neither fired nor cancelled."""
        return not (self.cancelled or self.fired)


class Runtime:
    """Owns milepost's threads (see the module's docstring). One per process: :data:`RUNTIME`."""

    def __init__(self, idle_secs: float = 60.0) -> None:
        self.idle_secs = idle_secs
        """How long a thread of a shared pool waits for work before it ends."""
        self._lock = threading.RLock()
        self._pools: dict[str, Pool] = {}
        self._live: set[threading.Thread] = set()
        self._stops: dict[threading.Thread, Callable[[], None]] = {}
        self._timers: list[tuple[float, int, Timer]] = []
        self._clock: threading.Thread | None = None
        self._clock_wake = threading.Condition(self._lock)
        self._order = itertools.count()

    # -- bookkeeping ----------------------------------------------------------------------
    def _started(self, thread: threading.Thread) -> None:
        with self._lock:
            self._live.add(thread)

    def _ended(self, thread: threading.Thread) -> None:
        with self._lock:
            self._live.discard(thread)
            self._stops.pop(thread, None)

    def threads(self) -> list[threading.Thread]:
        """The threads this runtime started that are still alive."""
        with self._lock:
            return [t for t in self._live if t.is_alive()]

    # -- pools ----------------------------------------------------------------------------
    def pool(self, name: str, threads: int | None) -> Pool:
        """The shared pool ``name`` (``milepost-<name>`` threads), made on first use."""
        with self._lock:
            found = self._pools.get(name)
            if found is None:
                found = self._pools[name] = Pool(self, PREFIX + name, threads, self.idle_secs)
            return found

    def call_pool(self, name: str, threads: int) -> Pool:
        """A pool for one call (``milepost-<name>`` threads), which stops it when it ends."""
        return Pool(self, PREFIX + name, threads, self.idle_secs)

    @contextlib.contextmanager
    def scoped(self, name: str, threads: int) -> Iterator[Pool]:
        """A pool for the block: its threads end when the block does (after their jobs)."""
        pool = self.call_pool(name, threads)
        try:
            yield pool
        finally:
            pool.stop()

    # -- threads --------------------------------------------------------------------------
    def thread(
        self, name: str, target: Callable[[], Any], *, stop: Callable[[], None]
    ) -> threading.Thread:
        """Start ``target`` on a thread of its own, ``milepost-<name>``; ``stop`` makes it end
        (called by :meth:`stop`; its owner calls it too, and joins the thread)."""
        thread = threading.Thread(target=self._run, args=(target,), name=PREFIX + name, daemon=True)
        with self._lock:
            self._live.add(thread)
            self._stops[thread] = stop
        thread.start()
        return thread

    def _run(self, target: Callable[[], Any]) -> None:
        try:
            target()
        except BaseException as e:  # a worker's own failure: its owner reports what it must
            log.error(
                "milepost thread %s failed: %s: %s",
                threading.current_thread().name,
                type(e).__name__,
                e,
            )
        finally:
            self._ended(threading.current_thread())

    # -- timers ---------------------------------------------------------------------------
    def call_later(self, delay: float, fn: Callable[[], Any], name: str = "timer") -> Timer:
        """Run ``fn()`` once ``delay`` seconds from now, on the clock thread."""
        timer = Timer(time.monotonic() + delay, fn, name)
        with self._lock:
            heapq.heappush(self._timers, (timer.when, next(self._order), timer))
            if self._clock is None:
                self._clock = threading.Thread(
                    target=self._tick, name=PREFIX + "clock", daemon=True
                )
                self._live.add(self._clock)
                try:
                    self._clock.start()
                except RuntimeError:  # the interpreter is exiting (Python 3.12): no timers due
                    self._live.discard(self._clock)
                    self._clock = None
                    self._timers.clear()
                    timer.cancel()
            else:
                self._clock_wake.notify()
        return timer

    def _tick(self) -> None:
        me = threading.current_thread()
        try:
            while True:
                with self._lock:
                    while self._timers and self._timers[0][2].cancelled:
                        heapq.heappop(self._timers)
                    if not self._timers:
                        self._clock = None
                        return
                    when, _, timer = self._timers[0]
                    left = when - time.monotonic()
                    if left > 0:
                        self._clock_wake.wait(left)
                        continue
                    heapq.heappop(self._timers)
                    timer.fired = True
                try:
                    timer.fn()
                except Exception as e:
                    log.error("milepost timer %s failed: %s: %s", timer.name, type(e).__name__, e)
        finally:
            self._ended(me)

    # -- stopping -------------------------------------------------------------------------
    def stop(self, timeout: float = 30.0) -> None:
        """Stop every thread: pools after the jobs they hold, workers through their stop
        functions, timers dropped. Waits at most ``timeout`` in all."""
        deadline = time.monotonic() + timeout
        with self._lock:
            pools = list(self._pools.values())
            stops = list(self._stops.items())
            for _, _, timer in self._timers:
                timer.cancel()
            self._timers.clear()
            clock = self._clock
            self._clock_wake.notify_all()
        for thread, stop in stops:
            try:
                stop()
            except Exception as e:
                log.error(
                    "stopping milepost thread %s failed: %s: %s", thread.name, type(e).__name__, e
                )
        for pool in pools:
            pool.stop(max(0.0, deadline - time.monotonic()))
        for thread in [t for t, _ in stops] + ([clock] if clock is not None else []):
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))


RUNTIME = Runtime()
"""This process's runtime."""
