"""A Checkpointer for a sequence of training steps in one root directory.

Each step is a complete checkpoint in ``root/<step>/`` (readable alone by ``milepost.load`` and
Orbax v1). At most one save is in flight by default; the next waits for it. A background failure
is re-raised on the caller's next call. Retention runs after each commit and never deletes the
latest committed step, a step being saved, or a step being loaded.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from milepost import _api, _checkpoint, _dispatch, _options
from milepost import _format as fmt
from milepost.training._policies import (
    FixedInterval,
    KeepAll,
    RetentionPolicy,
    SaveContext,
    SavePolicy,
    StepInfo,
)

log = logging.getLogger("milepost.training")

STATE = "state"


class StepExistsError(FileExistsError):
    """A committed checkpoint of this step already exists."""


class StepNotFoundError(FileNotFoundError):
    """No committed checkpoint of this step (or none at all)."""


class BackgroundSaveError(RuntimeError):
    """A save that ran in the background failed; ``step`` says which."""

    def __init__(self, step: int, cause: BaseException) -> None:
        super().__init__(f"the background save of step {step} failed: {type(cause).__name__}: {cause}")
        self.step = step


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not hasattr(step, "__index__"):
        raise TypeError(f"step must be a non-negative int, got {step!r} ({type(step).__name__})")
    value = int(step.__index__())
    if value < 0:
        raise ValueError(f"step must be non-negative, got {value}")
    return value


def _is_step_name(name: str) -> bool:
    return name.isdigit() and str(int(name)) == name


class Checkpointer:
    """Save every few steps, keep what the retention policy says, resume from the latest.

    >>> with Checkpointer("/ckpt", save_policy=FixedInterval(interval=100), keep=KeepLatest(n=3)) as ckpt:
    ...     start = 0 if ckpt.latest is None else ckpt.latest + 1
    ...     for step in range(start, steps):
    ...         state = train_step(state)
    ...         ckpt.save(step, state)
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        save_policy: SavePolicy | None = None,
        keep: RetentionPolicy | None = None,
        max_in_flight: int = 1,
        preemption_signals: Sequence[int] = (signal.SIGTERM,),
    ) -> None:
        self.root = Path(root).absolute()
        self.save_policy: SavePolicy = save_policy if save_policy is not None else FixedInterval(interval=1)
        self.keep: RetentionPolicy = keep if keep is not None else KeepAll()
        if not isinstance(self.save_policy, SavePolicy):
            raise TypeError(f"save_policy {self.save_policy!r} is not a save policy (it needs should_save(ctx))")
        if not isinstance(self.keep, RetentionPolicy):
            raise TypeError(f"keep {self.keep!r} is not a retention policy (it needs keep(steps))")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self._group = _dispatch.host_group_for([])
        self._timeout = _options.current().async_.timeout_secs
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._in_flight: dict[int, threading.Thread] = {}
        self._loading: dict[int, int] = {}
        self._failure: BackgroundSaveError | None = None
        self._last_save_start: float | None = None
        self._preempted = threading.Event()
        self._closed = False

        primary = self._group.is_primary()
        if primary:
            if self.root.exists() and not self.root.is_dir():
                raise NotADirectoryError(f"checkpoint root {self.root} is a file; pass a directory (it is created if missing)")
            self.root.mkdir(parents=True, exist_ok=True)
            self._remove_uncommitted()
        listing = self._group.broadcast(f"ckpt-list:{self.root}", self._scan() if primary else None, self._timeout)
        self._steps: dict[int, dict[str, Any]] = {int(k): v for k, v in listing.items()}
        self._previous_handlers: dict[int, Any] = {}
        for sig in preemption_signals:
            self._install_signal(sig)

    # -- listing ------------------------------------------------------------------------
    def _remove_uncommitted(self) -> None:
        for p in sorted(self.root.iterdir()):
            partial_step = _is_step_name(p.name) and p.is_dir() and not fmt.is_checkpoint(p)
            if partial_step or p.name.endswith(fmt.TMP_SUFFIX) or ".milepost-deleting" in p.name:
                log.warning("milepost.training: removing %s, left by a save that did not commit", p)
                shutil.rmtree(p, ignore_errors=True)

    def _scan(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for p in self.root.iterdir():
            if _is_step_name(p.name) and fmt.is_checkpoint(p):
                try:
                    meta = fmt.read_json(p / fmt.CHECKPOINT_METADATA, "checkpoint metadata")
                except (FileNotFoundError, ValueError):
                    continue
                out[p.name] = dict(meta.get("metrics") or {})
        return out

    @property
    def steps(self) -> list[int]:
        """Committed steps, oldest first."""
        with self._lock:
            return sorted(self._steps)

    @property
    def latest(self) -> int | None:
        """The newest committed step (None when there is none)."""
        with self._lock:
            return max(self._steps) if self._steps else None

    def path(self, step: int) -> Path:
        return self.root / str(_check_step(step))

    # -- policies -----------------------------------------------------------------------
    def _install_signal(self, sig: int) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.info("milepost.training: not on the main thread, so no handler for signal %s", sig)
            return
        previous = signal.getsignal(sig)

        def handler(signum: int, frame: Any) -> None:
            self._preempted.set()
            if callable(previous) and previous not in (signal.SIG_IGN, signal.SIG_DFL):
                previous(signum, frame)

        signal.signal(sig, handler)
        self._previous_handlers[sig] = previous

    def preempt(self) -> None:
        """Ask for a save at the next ``should_save`` (what the signal handler does)."""
        self._preempted.set()

    def should_save(self, step: int) -> bool:
        """Whether the policy (or a preemption signal) asks for a save at ``step``.

        Every process gets the primary's answer, so all save at the same step."""
        step = _check_step(step)
        self._raise_failure()
        with self._lock:
            known = set(self._steps) | set(self._in_flight)
            ctx = SaveContext(
                step=step,
                latest_step=max(known) if known else None,
                last_save_start=self._last_save_start,
                save_in_flight=bool(self._in_flight),
                now=time.monotonic(),
            )
        answer = self._preempted.is_set() or self.save_policy.should_save(ctx)
        return bool(self._group.broadcast(f"should-save:{self.root}:{step}", answer, self._timeout))

    # -- saving -------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: Any,
        *,
        metrics: Mapping[str, Any] | None = None,
        custom_metadata: Mapping[str, Any] | None = None,
        force: bool = False,
    ) -> bool:
        """Save ``state`` as ``step`` if the policy says so (or ``force``); True if a save started.

        Returns once the arrays are copied to host memory; the write and commit continue in the
        background."""
        return self.save_checkpointables(step, {STATE: state}, metrics=metrics, custom_metadata=custom_metadata, force=force)

    def save_checkpointables(
        self,
        step: int,
        checkpointables: Mapping[str, Any],
        *,
        metrics: Mapping[str, Any] | None = None,
        custom_metadata: Mapping[str, Any] | None = None,
        force: bool = False,
    ) -> bool:
        step = _check_step(step)
        self._check_open()
        self._raise_failure()
        if not force and not self.should_save(step):
            return False
        with self._lock:
            if step in self._in_flight:
                raise StepExistsError(f"a save of step {step} is already in flight; wait() for it, or save another step")
            if step in self._steps:
                raise StepExistsError(f"step {step} already has a committed checkpoint at {self.path(step)}; delete(step) it first")
        self._wait_for_slot()
        self._raise_failure()
        with self._lock:
            self._last_save_start = time.monotonic()
        handle = _api.save_checkpointables_async(
            self.path(step), checkpointables, custom_metadata=custom_metadata, metrics=metrics
        )
        self._preempted.clear()
        watcher = threading.Thread(
            target=self._finish, args=(step, handle, dict(metrics or {})), name=f"milepost-step-{step}", daemon=True
        )
        with self._lock:
            self._in_flight[step] = watcher
        watcher.start()
        return True

    def _wait_for_slot(self) -> None:
        deadline = time.monotonic() + self._timeout
        with self._cond:
            while len(self._in_flight) >= self.max_in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"previous saves of steps {sorted(self._in_flight)} did not finish within {self._timeout}s"
                    )
                self._cond.wait(left)

    def _finish(self, step: int, handle: _checkpoint.SaveHandle, metrics: dict[str, Any]) -> None:
        try:
            handle.result(self._timeout)
        except BaseException as e:
            log.error("milepost.training: save of step %s failed: %s", step, e)
            with self._cond:
                if self._failure is None:
                    self._failure = BackgroundSaveError(step, e)
                    self._failure.__cause__ = e
                del self._in_flight[step]
                self._cond.notify_all()
            return
        with self._lock:
            self._steps[step] = metrics
        try:
            self._collect_garbage()
        except Exception as e:  # retention must never break training
            log.error("milepost.training: garbage collection after step %s failed: %s", step, e)
        finally:
            with self._cond:
                del self._in_flight[step]
                self._cond.notify_all()

    def _raise_failure(self) -> None:
        with self._lock:
            failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    # -- retention ----------------------------------------------------------------------
    def _collect_garbage(self) -> None:
        with self._lock:
            infos = [StepInfo(step=s, metrics=self._steps[s]) for s in sorted(self._steps)]
            if not infos:
                return
            keep = set(self.keep.keep(infos)) | {infos[-1].step} | set(self._in_flight) | set(self._loading)
            doomed = [i.step for i in infos if i.step not in keep]
            for s in doomed:
                del self._steps[s]
        if self._group.is_primary():
            for s in doomed:
                self._remove_step_dir(s)
        if doomed:
            log.info("milepost.training: retention deleted steps %s", doomed)

    def _remove_step_dir(self, step: int) -> None:
        path = self.root / str(step)
        if not path.exists():
            return
        # Rename first: a crash mid-delete leaves a name that is never listed, not half a step.
        trash = path.with_name(f"{path.name}.milepost-deleting")
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)

    def delete(self, step: int) -> None:
        step = _check_step(step)
        self._raise_failure()
        with self._lock:
            if step in self._in_flight:
                raise StepExistsError(f"step {step} is being saved; wait() before deleting it")
            if step in self._loading:
                raise StepExistsError(f"step {step} is being loaded; delete it after the load returns")
            if step not in self._steps:
                raise StepNotFoundError(f"no committed step {step} in {self.root} (steps: {sorted(self._steps)})")
            del self._steps[step]
        if self._group.is_primary():
            self._remove_step_dir(step)
        self._group.barrier(f"deleted:{self.root}:{step}", self._timeout)

    # -- loading ------------------------------------------------------------------------
    def _resolve(self, step: int | None) -> int:
        with self._lock:
            if step is None:
                if not self._steps:
                    raise StepNotFoundError(f"no committed checkpoint in {self.root} yet; nothing to load")
                return max(self._steps)
            step = _check_step(step)
            if step not in self._steps:
                raise StepNotFoundError(f"no committed step {step} in {self.root} (steps: {sorted(self._steps)})")
            return step

    def _loaded(self, step: int) -> None:
        with self._lock:
            self._loading[step] -= 1
            if not self._loading[step]:
                del self._loading[step]

    def _protect(self, step: int | None) -> int:
        """Resolve ``step`` and keep retention away from it until :meth:`_loaded`."""
        with self._lock:
            resolved = self._resolve(step)
            self._loading[resolved] = self._loading.get(resolved, 0) + 1
        return resolved

    def load(self, step: int | None = None, abstract_state: Any = None, *, partial: bool = False) -> Any:
        """Load ``step`` (default: the latest committed)."""
        self._raise_failure()
        s = self._protect(step)
        try:
            return _api.load(self.root / str(s), abstract_state, partial=partial)
        finally:
            self._loaded(s)

    def load_checkpointables(
        self, step: int | None = None, checkpointables: Mapping[str, Any] | None = None, *, partial: bool = False
    ) -> dict[str, Any]:
        self._raise_failure()
        s = self._protect(step)
        try:
            return _api.load_checkpointables(self.root / str(s), checkpointables, partial=partial)
        finally:
            self._loaded(s)

    def metadata(self, step: int | None = None) -> _checkpoint.CheckpointMetadata:
        s = self._protect(step)
        try:
            return _api.metadata(self.root / str(s))
        finally:
            self._loaded(s)

    # -- lifecycle ----------------------------------------------------------------------
    def wait(self) -> None:
        """Wait for every save in flight; re-raise a failure."""
        deadline = time.monotonic() + self._timeout
        with self._cond:
            while self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"saves of steps {sorted(self._in_flight)} did not finish within {self._timeout}s")
                self._cond.wait(left)
        self._raise_failure()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the Checkpointer for {self.root} is closed")

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            if threading.current_thread() is threading.main_thread():
                for sig, previous in self._previous_handlers.items():
                    signal.signal(sig, previous)
            self._previous_handlers.clear()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:  # do not mask the original error with a save failure
            try:
                self.close()
            except Exception as e:
                log.error("milepost.training: while closing after an error: %s", e)

    def __repr__(self) -> str:
        return f"Checkpointer({str(self.root)!r}, steps={self.steps}, in_flight={sorted(self._in_flight)})"
