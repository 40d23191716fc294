"""A Checkpointer for a sequence of training steps in one root directory.

Each step is a complete checkpoint in ``root/<step>/`` (readable alone by ``milepost.load`` and
Orbax v1). At most one save is in flight by default; the next waits for it. A background failure
is re-raised on the caller's next call. Retention runs in the background after each commit and
never deletes the latest committed step, a step being saved, or a step being loaded.

With several controller processes (mcJAX) every method is collective: call it in every process,
in the same order. The primary lists the root, decides ``should_save`` and deletes; the others
get its answers through the host group's broadcast.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import jax
import numpy as np

from milepost import _api, _checkpoint, _dispatch, _layout, _options, _ownership, _paths, _workspace
from milepost import _format as fmt
from milepost.training._policies import (
    FixedInterval,
    KeepAll,
    RetentionPolicy,
    SaveContext,
    SavePolicy,
    StepInfo,
    preemption_signals,
)

log = logging.getLogger("milepost.training")

T = TypeVar("T")
STATE = "state"
DELETING_SUFFIX = ".milepost-deleting"


class StepExistsError(FileExistsError):
    """A committed checkpoint of this step exists already, or a save of it is in flight."""


class StepNotFoundError(FileNotFoundError):
    """No committed checkpoint of this step (or none at all)."""


class StepBusyError(RuntimeError):
    """The step is being saved or loaded right now, so it cannot be deleted."""


class BackgroundSaveError(RuntimeError):
    """A save that ran in the background failed; ``step`` says which, ``__cause__`` why."""

    def __init__(self, step: int, cause: BaseException) -> None:
        super().__init__(
            f"the background save of step {step} failed: {type(cause).__name__}: {cause}. "
            "Nothing of that step was committed; earlier steps are intact. Save again to retry."
        )
        self.step = step


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not hasattr(step, "__index__"):
        raise TypeError(f"step must be a non-negative int, got {step!r} ({type(step).__name__})")
    value = int(step.__index__())
    if value < 0:
        raise ValueError(f"step must be a non-negative int, got {value}")
    return value


def _is_step_name(name: str) -> bool:
    return name.isdigit() and str(int(name)) == name


def _leftover_of_step(name: str) -> bool:
    """``<step>.orbax-checkpoint-tmp[...]`` or ``<step>.milepost-deleting``."""
    for marker in (fmt.TMP_SUFFIX, DELETING_SUFFIX):
        head, found, _ = name.partition(marker)
        if found and _is_step_name(head):
            return True
    return False


def _plain_metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    """Metrics with NumPy/JAX scalars turned into Python numbers (they are stored as JSON)."""
    out: dict[str, Any] = {}
    for key, value in dict(metrics or {}).items():
        if not isinstance(key, str):
            raise TypeError(f"metric names must be str, got {key!r}")
        if isinstance(value, np.generic) or (isinstance(value, np.ndarray | jax.Array) and value.shape == ()):
            value = np.asarray(value).item()
        out[key] = value
    return out


def _jax_preemption_service() -> bool:
    """Whether JAX's preemption sync service runs (multi-process ``jax.distributed``)."""
    if jax.process_count() <= 1:
        return False
    try:
        from jax._src import distributed
    except ImportError:  # pragma: no cover - a JAX without it
        return False
    return getattr(distributed.global_state, "preemption_sync_manager", None) is not None


class Checkpointer:
    """Save every few steps, keep what the retention policy says, resume from the latest.

    >>> policy = AnyOf(FixedInterval(interval=1000), Preemption())
    >>> with Checkpointer("/ckpt", save_policy=policy, keep=KeepLatest(n=3)) as ckpt:
    ...     if ckpt.latest is not None:
    ...         state = ckpt.load(abstract_state=abstract(state))
    ...     for step in range(int(state["step"]), total):
    ...         state = train_step(state)
    ...         ckpt.save(step + 1, state, metrics={"loss": loss})
    ...         if ckpt.preempted:
    ...             break

    ``save_policy`` (default: every step) decides which steps ``save`` writes; ``keep``
    (default :class:`KeepAll`) which committed steps survive. ``max_in_flight`` saves may run in
    the background at once (the next waits); ``asynchronous=False`` makes ``save`` return only
    once the step is committed. ``timeout_secs`` bounds every wait (default: the current
    ``AsyncOptions.timeout_secs``).

    ``read_only=True`` (an eval watcher, a notebook looking at a run) lists and loads but never
    writes or deletes anything. A writing Checkpointer removes what an unfinished save or
    deletion left behind only once it holds that step's writer lock, so a save running in
    another process is never touched.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        save_policy: SavePolicy | None = None,
        keep: RetentionPolicy | None = None,
        max_in_flight: int = 1,
        asynchronous: bool = True,
        timeout_secs: float | None = None,
        read_only: bool = False,
    ) -> None:
        self.root = _paths.as_path(root)
        if not isinstance(read_only, bool):
            raise TypeError(f"read_only must be True or False, got {read_only!r}")
        self.read_only = read_only
        self.save_policy: SavePolicy = save_policy if save_policy is not None else FixedInterval(interval=1)
        self.keep: RetentionPolicy = keep if keep is not None else KeepAll()
        if not isinstance(self.save_policy, SavePolicy):
            raise TypeError(f"save_policy={self.save_policy!r} is not a save policy (it needs should_save(ctx)); e.g. FixedInterval(interval=100)")
        if not isinstance(self.keep, RetentionPolicy):
            raise TypeError(f"keep={self.keep!r} is not a retention policy (it needs keep(steps)); e.g. KeepLatest(n=3)")
        if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise ValueError(f"max_in_flight must be an int >= 1, got {max_in_flight!r}")
        self.max_in_flight = max_in_flight
        self.asynchronous = bool(asynchronous)
        if timeout_secs is not None:
            _options.AsyncOptions(timeout_secs=timeout_secs)  # the same checks, the same errors
        self._timeout = float(timeout_secs) if timeout_secs is not None else _options.current().async_.timeout_secs
        self._lease_secs = _options.current().saving.lease_secs
        self._group = _dispatch.host_group_for([])
        self._primary = self._group.is_primary()

        self._cond = threading.Condition(threading.RLock())
        self._gc_lock = threading.Lock()
        self._steps: dict[int, dict[str, Any]] = {}
        self._in_flight: dict[int, _checkpoint.SaveHandle | None] = {}
        """Steps being saved: their handles (None while the save is starting)."""
        self._loading: collections.Counter[int] = collections.Counter()
        self._gc_active = 0
        """Retention runs requested and not finished (``wait`` waits for them)."""
        self._gc_deferred = False
        self._retention = _Worker(self._collect_garbage, f"milepost-retention:{self.root.name}")
        self._failure: BackgroundSaveError | None = None
        self._last_save_start: float | None = None
        self._decision: tuple[int, bool, int] | None = None
        """(step, answer, signals seen) of the last should_save, reused by a save of that step."""
        self._signals_seen = 0
        self._signals_served = 0
        self._preempted = False
        self._closed = False
        self._previous_handlers: dict[int, Any] = {}

        listing = self._shared("open", self._open_on_primary)
        self._steps = {int(k): dict(v) for k, v in listing.items()}

        signals = preemption_signals(self.save_policy)
        self._jax_preemption = signal.SIGTERM in signals and _jax_preemption_service()
        for sig in signals:
            if sig == signal.SIGTERM and self._jax_preemption:
                continue  # JAX's preemption service owns SIGTERM and agrees on the step
            self._install_signal(sig)

    # -- collectives --------------------------------------------------------------------
    def _shared(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()`` on the primary; its result (or its error) on every process."""
        return _dispatch.shared(self._group, f"milepost.training:{what}:{self.root}", fn, self._timeout)

    # -- listing ------------------------------------------------------------------------
    def _open_on_primary(self) -> dict[int, dict[str, Any]]:
        if self.root.exists() and not self.root.is_dir():
            raise NotADirectoryError(
                f"checkpoint root {self.root} is a file; pass a directory (it is created if missing)"
            )
        if self.read_only:
            return self._scan()
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_uncommitted()
        return self._scan()

    def _remove_uncommitted(self) -> None:
        """Remove what saves and deletions that did not finish left behind: a step's temporary
        directory (or one being made), an uncommitted step folder, a half-deleted step. Each
        only if no live process holds its lock (its lease, in an object store): a save in
        progress, in any process, does."""
        busy = _checkpoint.saves_in_flight(self.root)  # saves of this process: not leftovers
        if not isinstance(self.root, Path):
            self._remove_uncommitted_objects(busy)
            return
        for p in sorted(self.root.iterdir()):
            name = p.name
            partial = _is_step_name(name) and p.is_dir() and not p.is_symlink() and not _layout.is_committed(p)
            making = name.startswith(".") and _ownership.NEW_MARKER in name and _is_step_name(name[1:].partition(".")[0])
            if not (partial or making or (_leftover_of_step(name) and (p.is_dir() or p.is_symlink()))):
                continue
            if name.lstrip(".").partition(".")[0] in busy:
                continue
            if _ownership.remove_if_abandoned(p):
                log.warning("milepost.training: removed %s, left by a save or deletion that did not finish", p)
            else:
                log.info("milepost.training: left %s alone: a live process holds it", p)

    def _remove_uncommitted_objects(self, busy: set[str]) -> None:
        """In an object store: a step folder without its commit marker whose save is gone (no
        lease, or an expired one) is removed; one listing for the whole root."""
        committed, folders = self._listing()
        for name in sorted(folders - committed - busy):
            path = self.root / name
            if _workspace.remove_if_abandoned(path, self._lease_secs):
                log.warning("milepost.training: removed %s, left by a save or deletion that did not finish", path)
            else:
                log.info("milepost.training: left %s alone: a live save owns it", path)

    def _listing(self) -> tuple[set[str], set[str]]:
        """Object stores: (committed step names, every step folder name), from one listing."""
        committed, folders = set(), set()
        for key in self.root.keys():  # type: ignore[union-attr]
            head, _, rest = key.partition("/")
            if rest and _is_step_name(head):
                folders.add(head)
                if rest == fmt.COMMIT_MARKER:
                    committed.add(head)
        return committed, folders

    def _scan(self) -> dict[int, dict[str, Any]]:
        out: dict[int, dict[str, Any]] = {}
        if not self.root.exists():
            return out
        if isinstance(self.root, Path):
            steps = [p for p in self.root.iterdir() if _is_step_name(p.name) and _layout.is_committed(p)]
        else:
            steps = [self.root / name for name in self._listing()[0]]
        for p in steps:
            try:
                meta = fmt.read_json(p / fmt.CHECKPOINT_METADATA, "checkpoint metadata")
            except (FileNotFoundError, ValueError) as e:
                log.warning("milepost.training: ignoring step %s: %s", p.name, e)
                continue
            metrics = meta.get("metrics") if isinstance(meta, dict) else None
            out[int(p.name)] = dict(metrics) if isinstance(metrics, dict) else {}
        return out

    def reload(self) -> None:
        """Wait for saves in flight, then list the root again (steps written by another job)."""
        self.wait()
        listing = self._shared("reload", self._scan)
        with self._cond:
            self._steps = {int(k): dict(v) for k, v in listing.items()}

    @property
    def steps(self) -> list[int]:
        """Committed steps, oldest first (steps in flight are not listed until they commit)."""
        with self._cond:
            return sorted(self._steps)

    @property
    def latest(self) -> int | None:
        """The newest committed step (None when there is none)."""
        with self._cond:
            return max(self._steps) if self._steps else None

    def path(self, step: int) -> Path:
        """Where ``step`` is (or would be) stored: ``root/<step>``."""
        return self.root / str(_check_step(step))

    # -- deciding -----------------------------------------------------------------------
    def _install_signal(self, sig: int) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.warning(
                "milepost.training: the Checkpointer was opened off the main thread, so it cannot handle "
                "signal %s; call ckpt.preempt() from your own handler instead", signal.Signals(sig).name
            )
            return
        previous = signal.getsignal(sig)

        def handler(signum: int, frame: Any) -> None:
            self._signals_seen += 1
            if callable(previous):
                previous(signum, frame)

        signal.signal(sig, handler)
        self._previous_handlers[sig] = previous

    def preempt(self) -> None:
        """Ask a :class:`Preemption` policy for a save at the next ``should_save`` (what its
        signal handler does)."""
        self._signals_seen += 1

    @property
    def preempted(self) -> bool:
        """True once a ``should_save`` saw a preemption request: save, then stop training.
        Every process gets the same value at the same step."""
        return self._preempted

    def should_save(self, step: int) -> bool:
        """Whether the save policy (or a preemption) asks for a save at ``step``.

        Every process gets the primary's answer, so all save at the same step. Asking twice for
        the same step gives the same answer."""
        step = _check_step(step)
        self._raise_failure()
        with self._cond:
            if self._decision is not None and self._decision[0] == step:
                return self._decision[1]
            seen = self._signals_seen
            known = set(self._steps) | set(self._in_flight)
            ctx = SaveContext(
                step=step,
                latest_step=max(known) if known else None,
                last_save_start=self._last_save_start,
                save_in_flight=bool(self._in_flight),
                now=time.monotonic(),
                preempted=seen > self._signals_served,
            )
        if self._jax_preemption:  # collective: every process, every step
            from jax.experimental import multihost_utils

            if multihost_utils.reached_preemption_sync_point(step):
                ctx = replace(ctx, preempted=True)

        def decide() -> tuple[bool, bool]:
            return bool(self.save_policy.should_save(ctx)), ctx.preempted

        answer, preempted = self._shared("should-save", decide)
        with self._cond:
            self._decision = (step, answer, seen)
            if preempted and answer:
                self._preempted = True
        return answer

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

        Returns once the arrays are copied to host memory (you may then change or donate them);
        the write and commit continue in the background. ``metrics`` (JSON numbers, e.g. a loss)
        are stored in the step's ``_CHECKPOINT_METADATA`` and feed :class:`KeepBest`."""
        return self.save_checkpointables(
            step, {STATE: state}, metrics=metrics, custom_metadata=custom_metadata, force=force
        )

    def save_checkpointables(
        self,
        step: int,
        checkpointables: Mapping[str, Any],
        *,
        metrics: Mapping[str, Any] | None = None,
        custom_metadata: Mapping[str, Any] | None = None,
        force: bool = False,
    ) -> bool:
        """Like :meth:`save`, with several named checkpointables (``{"state": tree, "data":
        iterator}``), each in its own folder of the step."""
        step = _check_step(step)
        self._check_writable("save steps")
        self._raise_failure()
        plain_metrics = _plain_metrics(metrics)
        if not force and not self.should_save(step):
            return False
        with self._cond:
            self._check_free(step)
            self._wait_while(
                lambda: len(self._in_flight) >= self.max_in_flight,
                lambda: f"the saves of steps {sorted(self._in_flight)} did not finish within {self._timeout}s, "
                f"so step {step} was not saved",
            )
            self._raise_failure()  # the save we waited for may have failed
            self._check_free(step)
            self._in_flight[step] = None  # reserved
            decided = self._decision
            served = decided[2] if (not force and decided is not None and decided[0] == step) else self._signals_seen
            self._decision = None
            self._last_save_start = time.monotonic()
        try:
            handle = _api.save_checkpointables_async(
                self.path(step), checkpointables, custom_metadata=custom_metadata, metrics=plain_metrics
            )
        except BaseException:
            with self._cond:
                del self._in_flight[step]
                self._cond.notify_all()
            raise
        with self._cond:
            self._signals_served = max(self._signals_served, served)
            self._in_flight[step] = handle
        handle.add_done_callback(lambda h: self._finish(step, h, plain_metrics))
        if not self.asynchronous:
            self.wait()
        return True

    def _check_free(self, step: int) -> None:
        if step in self._in_flight:
            raise StepExistsError(
                f"a save of step {step} is already in flight in {self.root}; wait() for it, or save another step"
            )
        if step in self._steps:
            raise StepExistsError(
                f"step {step} already has a committed checkpoint at {self.root / str(step)}; "
                "delete(step) it first, or save another step"
            )

    def _finish(self, step: int, handle: _checkpoint.SaveHandle, metrics: dict[str, Any]) -> None:
        """The save of ``step`` ended (on the thread that finished it): record the step, or the
        failure for the next call to raise, and ask for retention."""
        try:
            handle.result(0)
        except BaseException as e:
            log.error("milepost.training: the save of step %s failed: %s: %s", step, type(e).__name__, e)
            with self._cond:
                if self._failure is None:
                    self._failure = BackgroundSaveError(step, e)
                    self._failure.__cause__ = e
                self._in_flight.pop(step, None)
                self._cond.notify_all()
            return
        with self._cond:
            self._steps[step] = metrics
            self._in_flight.pop(step, None)
            self._gc_active += 1
            self._cond.notify_all()
        self._retention.submit()

    def _raise_failure(self) -> None:
        with self._cond:
            failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    # -- retention ----------------------------------------------------------------------
    def _collect_garbage(self) -> None:
        """Apply the retention policy, on the retention worker (``_gc_active`` was raised by
        whoever asked for this run)."""
        try:
            with self._gc_lock:
                with self._cond:
                    infos = [StepInfo(step=s, metrics=self._steps[s]) for s in sorted(self._steps)]
                    if not infos:
                        return
                    wanted = set(self.keep.keep(infos))
                    protected = {infos[-1].step} | set(self._in_flight) | set(self._loading)
                    doomed = [i.step for i in infos if i.step not in wanted and i.step not in protected]
                    self._gc_deferred = any(i.step not in wanted and i.step in self._loading for i in infos)
                    for s in doomed:
                        del self._steps[s]
                if self._primary and not isinstance(self.root, Path):
                    doomed = self._remove_step_objects(doomed)
                elif self._primary:
                    for s in list(doomed):
                        try:
                            self._remove_step_dir(s)
                        except StepBusyError as e:
                            log.warning("milepost.training: retention skipped step %s: %s", s, e)
                            doomed.remove(s)
                if doomed:
                    log.info("milepost.training: retention deleted steps %s of %s", doomed, self.root)
        except Exception as e:  # retention must never break training
            log.error("milepost.training: retention in %s failed: %s: %s", self.root, type(e).__name__, e)
        finally:
            with self._cond:
                self._gc_active -= 1
                self._cond.notify_all()

    def _remove_step_dir(self, step: int) -> None:
        path = self.root / str(step)
        if not isinstance(path, Path):
            self._remove_step_objects([step])
            return
        if not path.exists():
            return
        lock = _ownership.try_lock(path)
        if lock is None:
            raise StepBusyError(f"step {step} in {self.root} is held by another process (being committed); it was not deleted")
        with lock:
            # Rename first: a crash mid-delete leaves a name that is never listed, not half a step.
            trash = path.with_name(path.name + DELETING_SUFFIX)
            if trash.exists():
                _ownership.remove_tree(trash)
            os.rename(path, trash)
            _ownership.remove_tree(trash)

    def _remove_step_objects(self, steps: list[int]) -> list[int]:
        """Object stores: delete committed steps, all at once. Under each step's lease, the
        commit marker goes first (the step stops being loadable), then every key, in parallel;
        a step another save owns is skipped. Returns the steps deleted."""
        owned = []
        for step in steps:
            path = self.root / str(step)
            assert isinstance(path, _paths.ObjectPath)
            workspace = _workspace.ObjectWorkspace(path, overwrite=True, wait_secs=0.0, lease_secs=self._lease_secs)
            try:
                workspace.acquire()
            except FileExistsError as e:
                log.warning("milepost.training: retention skipped step %s: %s", step, e)
                continue
            owned.append((step, workspace))
        try:
            for step, _ in owned:
                (self.root / str(step) / fmt.COMMIT_MARKER).unlink(missing_ok=True)
            deletions = [(self.root / str(step)).delete_tree() for step, _ in owned]  # type: ignore[union-attr]
            for deletion in deletions:
                deletion.result()
        finally:
            for _, workspace in owned:
                workspace.release()
        return [step for step, _ in owned]

    def delete(self, step: int) -> None:
        """Delete the committed ``step`` now (not while it is being saved or loaded)."""
        step = _check_step(step)
        self._check_writable("delete steps")
        self._raise_failure()

        def on_primary() -> None:
            with self._gc_lock:
                with self._cond:
                    if step in self._in_flight:
                        raise StepBusyError(f"step {step} is being saved; wait() before deleting it")
                    if self._loading[step]:
                        raise StepBusyError(f"step {step} is being loaded; delete it after the load returns")
                    if step not in self._steps:
                        raise StepNotFoundError(f"no committed step {step} in {self.root} (steps: {sorted(self._steps)})")
                    metrics = self._steps.pop(step)
                try:
                    self._remove_step_dir(step)
                except BaseException:
                    with self._cond:
                        self._steps[step] = metrics
                    raise

        self._shared(f"delete:{step}", on_primary)
        if not self._primary:
            with self._cond:
                self._steps.pop(step, None)

    # -- loading ------------------------------------------------------------------------
    def _protect(self, step: int | None) -> int:
        """Resolve ``step`` (None: the latest) on the primary and keep retention away from it
        until :meth:`_release`."""
        wanted = None if step is None else _check_step(step)

        def on_primary() -> int:
            with self._cond:
                if wanted is None:
                    if not self._steps:
                        raise StepNotFoundError(f"no committed checkpoint in {self.root} yet; nothing to load")
                    resolved = max(self._steps)
                elif wanted in self._steps:
                    resolved = wanted
                elif wanted in self._in_flight:
                    raise StepNotFoundError(f"step {wanted} is still being saved; wait() for it before loading it")
                else:
                    raise StepNotFoundError(f"no committed step {wanted} in {self.root} (steps: {sorted(self._steps)})")
                self._loading[resolved] += 1
                return resolved

        resolved = self._shared("resolve", on_primary)
        if not self._primary:
            with self._cond:
                # the primary saw the commit; this process's watcher may lag a moment behind
                self._cond.wait_for(lambda: resolved not in self._in_flight, self._timeout)
                self._loading[resolved] += 1
        return resolved

    def _release(self, step: int) -> None:
        with self._cond:
            self._loading[step] -= 1
            if self._loading[step] <= 0:
                del self._loading[step]
            again = self._gc_deferred and not self._loading and not self._closed
            if again:
                self._gc_deferred = False
                self._gc_active += 1
        if again:  # retention spared a step for this load; finish the job in the background
            self._retention.submit()

    def load(self, step: int | None = None, abstract_state: Any = None, *, partial: bool = False) -> Any:
        """Load the tree saved by :meth:`save` at ``step`` (default: the latest committed).

        ``abstract_state`` gives the structure and target shardings (see ``milepost.load``)."""
        self._raise_failure()
        s = self._protect(step)
        try:
            return _api.load(self.root / str(s), abstract_state, partial=partial)
        finally:
            self._release(s)

    def load_checkpointables(
        self, step: int | None = None, checkpointables: Mapping[str, Any] | None = None, *, partial: bool = False
    ) -> dict[str, Any]:
        """Load the named checkpointables of ``step`` (default: the latest; all when None)."""
        self._raise_failure()
        s = self._protect(step)
        try:
            return _api.load_checkpointables(self.root / str(s), checkpointables, partial=partial)
        finally:
            self._release(s)

    def metadata(self, step: int | None = None) -> _checkpoint.CheckpointMetadata:
        """Shapes, dtypes, shardings, metrics and custom metadata of ``step`` (default: the
        latest), without reading array data."""
        self._raise_failure()
        s = self._protect(step)
        try:
            return _api.metadata(self.root / str(s))
        finally:
            self._release(s)

    # -- lifecycle ----------------------------------------------------------------------
    def wait(self) -> None:
        """Wait for every save in flight and for retention; re-raise a background failure."""
        with self._cond:
            self._wait_while(
                lambda: bool(self._in_flight or self._gc_active),
                lambda: f"the saves of steps {sorted(self._in_flight)} in {self.root} did not finish "
                f"within {self._timeout}s",
            )
        self._raise_failure()

    def _wait_while(self, busy: Callable[[], bool], message: Callable[[], str]) -> None:
        """With ``self._cond`` held: wait while ``busy()``, at most the Checkpointer's timeout."""
        deadline = time.monotonic() + self._timeout
        while busy():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(message())
            self._cond.wait(left)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the Checkpointer for {self.root} is closed; open a new one to save")

    def _check_writable(self, doing: str) -> None:
        self._check_open()
        if self.read_only:
            raise PermissionError(
                f"this Checkpointer of {self.root} is read-only, so it cannot {doing}; open one with read_only=False"
            )

    def close(self) -> None:
        """Wait for saves in flight and retention (re-raising a failure), stop the retention
        worker and restore signal handlers."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._retention.stop(self._timeout)
            if threading.current_thread() is threading.main_thread():
                for sig, previous in self._previous_handlers.items():
                    signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
                self._previous_handlers.clear()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # do not mask the original error with a save failure
            self.close()
        except Exception as e:
            log.error("milepost.training: while closing after an error: %s: %s", type(e).__name__, e)

    def __repr__(self) -> str:
        with self._cond:
            return f"Checkpointer({str(self.root)!r}, steps={sorted(self._steps)}, in_flight={sorted(self._in_flight)})"


class _Worker:
    """One background thread that runs ``fn`` once per :meth:`submit`, in order; started at the
    first submit and stopped by a sentinel in :meth:`stop`."""

    _STOP = object()

    def __init__(self, fn: Callable[[], None], name: str) -> None:
        self._fn = fn
        self._name = name
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._queue.put(None)

    def _run(self) -> None:
        while self._queue.get() is not self._STOP:
            self._fn()

    def stop(self, timeout: float) -> None:
        """Finish the runs asked for, then end the thread (waiting at most ``timeout``)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(self._STOP)
            thread.join(timeout)
