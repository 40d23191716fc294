"""Progress and accounting of long operations: saves, loads, verifies.

Every save, load and verify is an :class:`Operation`: the bytes planned (each checkpointable
adds its share when it is planned), the bytes done (counted by this process's engine as writes
become durable and reads land, and by a slice's acks as each host finishes), its times, and a
bar when ``Context(progress=...)`` asks for one (on the primary process only). Its ``summary``
is what the INFO log line of the operation says.

Bars: in a terminal a ``rich`` progress display shared by the operations running at once (one
line each, redrawn in place); in Jupyter an HTML bar in the output of the cell that started the
operation, updated in place through its display id (no widget library needed); in a file or a
pipe only the final line. A bar appears once the operation has run ``delay_secs``.
"""

from __future__ import annotations

import contextlib
import contextvars
import html
import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from milepost import _options, workers
from milepost._views import human_bytes, printable
from milepost.workers import ShardingSpec
from milepost.workers import progress as sink

log = logging.getLogger("milepost")

_VERBS = {
    "save": "saved",
    "load": "loaded",
    "verify": "verified",
    "copy": "copied",
    "stats": "computed statistics of",
    "diff": "compared",
}


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "-:--:--"
    s = int(seconds + 0.5)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


RATE_MIN_BYTES = 1 << 20
"""Operations smaller than this log no rate."""


def rate_str(bytes_per_sec: float) -> str:
    """``'1.28 GB/s'``, or in MB/s (``'85.3 MB/s'``) below 1 GB/s."""
    if bytes_per_sec >= 1e9:
        return f"{bytes_per_sec / 1e9:.2f} GB/s"
    return f"{bytes_per_sec / 1e6:.3g} MB/s"


class Operation:
    """One save, load or verify: bytes planned and done, its times, and (when asked) its bar.

    It is the engine's progress sink while :meth:`active`; :meth:`close` ends it."""

    def __init__(self, kind: str, path: Any, progress: _options.ProgressOptions | None) -> None:
        self.kind = kind
        self.path = path
        self.total = 0
        """Bytes planned."""
        self._added = 0
        self._acked: dict[Any, int] = {}
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self.blocking_secs: float | None = None
        """How long the caller was blocked (a ``save_async``: until the hosts had copied)."""
        self.ended: float | None = None
        self.ok: bool | None = None
        self._options = progress
        self._bar: _Bar | None = None
        self._drawn = 0.0
        self._draw_lock = threading.Lock()
        if progress is not None:
            _TICKER.register(self)

    # -- the sink ---------------------------------------------------------------------------
    def expect(self, nbytes: int) -> None:
        with self._lock:
            self.total += nbytes

    def add(self, nbytes: int) -> None:
        with self._lock:
            self._added += nbytes
        if self._options is not None:
            self.tick()

    def acked(self, host: Any, nbytes: int) -> None:
        with self._lock:
            self._acked[host] = nbytes
        if self._options is not None:
            self.tick()

    def active(self) -> contextlib.AbstractContextManager[None]:
        """Count what the engine and the hosts' acks report on this thread into this operation."""
        return sink.reporting(self)

    # -- figures ----------------------------------------------------------------------------
    @property
    def done(self) -> int:
        """Bytes moved so far (all of them once the operation succeeded)."""
        with self._lock:
            return self._added + sum(self._acked.values())

    @property
    def seconds(self) -> float:
        return (self.ended if self.ended is not None else time.monotonic()) - self.started

    def blocked(self) -> None:
        """The caller is free again (the blocking part of a save ended)."""
        self.blocking_secs = time.monotonic() - self.started

    def summary(self) -> str:
        """``'512.0 MiB in 0.42 s (1.28 GB/s)'`` (+ the blocking time of a save); below 1 MiB
        no rate (it would measure the latency, not the throughput)."""
        nbytes, secs = max(self.done, self.total), self.seconds
        rate = f" ({rate_str(nbytes / secs)})" if secs > 0 and nbytes >= RATE_MIN_BYTES else ""
        blocking = (
            f", blocking {self.blocking_secs:.3f} s"
            if self.blocking_secs is not None and self.kind == "save"
            else ""
        )
        return f"{human_bytes(nbytes)} in {secs:.2f} s{rate}{blocking}"

    def close(self, ok: bool) -> None:
        """End the operation; on success every planned byte counts as done."""
        if self.ended is not None:
            return
        self.ended = time.monotonic()
        self.ok = ok
        if ok:
            with self._lock:
                missing = self.total - self._added - sum(self._acked.values())
                if missing > 0:
                    self._added += missing
        options = self._options
        if options is not None:
            _TICKER.unregister(self)
            with self._draw_lock:
                try:
                    if self._bar is None and self.seconds >= options.delay_secs:
                        self._bar = _open_bar(self, options)
                    if self._bar is not None:
                        self._bar.close(self)
                except Exception as e:
                    log.debug(
                        "the progress bar of %s failed: %s: %s", self.path, type(e).__name__, e
                    )

    def log(self) -> None:
        """The INFO line of a finished operation."""
        log.info("%s %s: %s", _VERBS.get(self.kind, self.kind), self.path, self.summary())

    # -- drawing ----------------------------------------------------------------------------
    def description(self) -> str:
        """What the bar says: the operation and its folder's name (escaped: ``printable``)."""
        name = getattr(self.path, "name", "") or str(self.path)
        return printable(f"{self.kind} {name}")

    def tick(self) -> None:
        """Draw if due (from the ticker thread, or when bytes arrive)."""
        options = self._options
        if options is None or self.ended is not None:
            return
        now = time.monotonic()
        if now - self._drawn < options.refresh_secs or now - self.started < options.delay_secs:
            return
        if not self._draw_lock.acquire(blocking=False):
            return  # another thread is drawing
        try:
            if self.ended is not None:
                return
            self._drawn = now
            if self._bar is None:
                self._bar = _open_bar(self, options)
            self._bar.update(self)
        except Exception as e:  # a bar must never break a save or a load
            log.debug("the progress bar of %s failed: %s: %s", self.path, type(e).__name__, e)
            self._options = None
        finally:
            self._draw_lock.release()

    def rate_and_eta(self) -> tuple[float | None, float | None]:
        done, secs = self.done, self.seconds
        if done <= 0 or secs <= 0:
            return None, None
        rate = done / secs
        return rate, max(0.0, (self.total - done) / rate) if self.total >= done else 0.0


_WATCHER: contextvars.ContextVar[Callable[[Operation], None] | None] = contextvars.ContextVar(
    "milepost_operation_watcher", default=None
)


@contextlib.contextmanager
def watching(fn: Callable[[Operation], None]) -> Iterator[None]:
    """Hand each operation that starts inside the block (on this thread) to ``fn``: a
    ``LoadHandle`` shows the bytes of the load it runs."""
    token = _WATCHER.set(fn)
    try:
        yield
    finally:
        _WATCHER.reset(token)


@contextlib.contextmanager
def operation(kind: str, path: Any, *, primary: bool = True) -> Iterator[Operation]:
    """An operation of the current context's progress options, active inside the block; closed
    (and logged at INFO on the primary) when the block ends."""
    options = _options.current().progress if primary else None
    op = Operation(kind, path, options)
    if (watcher := _WATCHER.get()) is not None:
        watcher(op)
    try:
        with op.active():
            yield op
    except BaseException:
        op.close(ok=False)
        raise
    op.close(ok=True)
    if primary:
        op.log()


def read_bytes(tasks: Any, group: Any) -> int:
    """About what the hosts of ``group`` read for these load tasks: each host reads every
    distinct box its devices need once; a task without a sharding is read whole (controller)."""
    total = 0
    elements: dict[
        Any, int
    ] = {}  # (sharding, shape) -> elements read: the layers of a model share them

    def read_elements(sharding: Any, shape: tuple[int, ...]) -> int:
        spec = sharding if isinstance(sharding, ShardingSpec) else ShardingSpec.from_jax(sharding)
        boxes: set[tuple[Any, Any]] = set()
        for device, box in spec.device_indices(shape).items():
            boxes.add((group.process_of_device(device), box))
        return sum(
            math.prod(max(0, min(b, n) - a) for (a, b), n in zip(box, shape, strict=True))
            for _, box in boxes
        )

    for task in tasks:
        itemsize = np.dtype(task.dtype).itemsize
        whole = math.prod(task.shape) * itemsize
        sharding = task.sharding
        if sharding is None:
            total += whole
            continue
        shape = tuple(task.shape)
        try:
            try:
                n = elements[sharding, shape]
            except KeyError:
                n = elements[sharding, shape] = read_elements(sharding, shape)
            except TypeError:  # an unhashable sharding
                n = read_elements(sharding, shape)
            total += n * itemsize
        except Exception:  # a sharding this cannot describe: count the array once
            total += whole
    return total


# ------------------------------------------------------------------------------------------
# Bars
# ------------------------------------------------------------------------------------------


class _Bar:
    def update(self, op: Operation) -> None: ...

    def close(self, op: Operation) -> None: ...


def _in_jupyter() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def _open_bar(op: Operation, options: _options.ProgressOptions) -> _Bar:
    if options.file is None and _in_jupyter():
        return _NotebookBar(op)
    return _Terminal.of(options.file if options.file is not None else sys.stderr).open(op)


class _Html:
    def __init__(self, html_text: str, text: str) -> None:
        self._html, self._text = html_text, text

    def _repr_html_(self) -> str:
        return self._html

    def __repr__(self) -> str:
        return self._text


class _NotebookBar(_Bar):
    """An HTML bar in the cell's output, replaced in place through its display id."""

    def __init__(self, op: Operation) -> None:
        from IPython.display import display

        self._handle = display(self._render(op), display_id=True)

    @staticmethod
    def _render(op: Operation) -> _Html:
        done, total = op.done, max(op.total, op.done)
        rate, eta = op.rate_and_eta()
        state = {None: "", True: " — done", False: " — failed"}[op.ok]
        text = (
            f"{op.description()}: {human_bytes(done)} / {human_bytes(total)}, "
            f"{human_bytes(rate) + '/s' if rate else '-'}, "
            + (f"{op.seconds:.1f} s{state}" if op.ended is not None else f"ETA {_clock(eta)}")
        )
        bar = (
            f'<progress value="{done}" max="{max(total, 1)}" '
            'style="width: 24em; vertical-align: middle"></progress>'
        )
        return _Html(f"<div>{bar} <code>{html.escape(text)}</code></div>", text)

    def update(self, op: Operation) -> None:
        if self._handle is not None:
            self._handle.update(self._render(op))

    def close(self, op: Operation) -> None:
        self.update(op)


class _Terminal:
    """One ``rich`` progress display per stream, shared by the operations drawing on it; it
    stops (leaving the final lines) once the last of them closed."""

    _all: dict[int, _Terminal] = {}
    _all_lock = threading.Lock()

    def __init__(self, file: Any) -> None:
        self.file = file
        self.lock = threading.RLock()
        self.progress: Any = None
        self.open_tasks = 0

    @classmethod
    def of(cls, file: Any) -> _Terminal:
        with cls._all_lock:
            found = cls._all.get(id(file))
            if found is None or found.file is not file:
                found = cls._all[id(file)] = _Terminal(file)
            return found

    def open(self, op: Operation) -> _TerminalBar:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        with self.lock:
            if self.progress is None:
                self.progress = Progress(
                    TextColumn("{task.description}", markup=False),
                    BarColumn(),
                    DownloadColumn(binary_units=True),
                    TransferSpeedColumn(),
                    TimeRemainingColumn(),
                    console=Console(file=self.file),
                    auto_refresh=False,
                    redirect_stdout=False,
                    redirect_stderr=False,
                )
                self.progress.start()
            self.open_tasks += 1
            task = self.progress.add_task(op.description(), total=op.total or None)
            return _TerminalBar(self, task)

    def update(self, task: Any, op: Operation, final: bool = False) -> None:
        with self.lock:
            if self.progress is None:
                return
            done = op.done
            description = op.description() + ("" if op.ok is not False else " (failed)")
            self.progress.update(
                task, completed=done, total=max(op.total, done) or None, description=description
            )
            self.progress.refresh()
            if final:
                self.open_tasks -= 1
                if self.open_tasks == 0:
                    self.progress.stop()
                    self.progress = None


class _TerminalBar(_Bar):
    def __init__(self, terminal: _Terminal, task: Any) -> None:
        self._terminal, self._task = terminal, task

    def update(self, op: Operation) -> None:
        self._terminal.update(self._task, op)

    def close(self, op: Operation) -> None:
        self._terminal.update(self._task, op, final=True)


class _Ticker:
    """One thread that redraws the open operations' bars while any is open (so a bar appears
    after its delay and its clock moves even while no bytes arrive)."""

    PERIOD = 0.05

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ops: set[Operation] = set()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def register(self, op: Operation) -> None:
        with self._lock:
            self._ops.add(op)
            if self._thread is None:
                self._stopped = False
                self._thread = workers.RUNTIME.thread("progress", self._run, stop=self._stop)

    def _stop(self) -> None:
        with self._lock:
            self._stopped = True

    def unregister(self, op: Operation) -> None:
        with self._lock:
            self._ops.discard(op)

    def _run(self) -> None:
        while True:
            with self._lock:
                ops = list(self._ops)
                if not ops or self._stopped:
                    self._thread = None
                    return
            for op in ops:
                try:
                    op.tick()
                except Exception as e:  # a bar must never break a save
                    log.debug("progress bar failed: %s: %s", type(e).__name__, e)
                    self.unregister(op)
            time.sleep(self.PERIOD)


_TICKER = _Ticker()
