"""A Checkpointer for a sequence of training steps in one root directory.

Each step is a complete checkpoint in ``root/<step>/`` (readable alone by ``milepost.load`` and
Orbax v1). At most one save is in flight by default; the next waits for it. A background failure
is re-raised on the caller's next call. Retention runs in the background after each commit and
never deletes the latest committed step, a step being saved, or a step being loaded.

With a local tier (``local=``, a fast local disk), each step is committed there first and
mirrored to ``root`` in the background (``milepost.copy``: each host copies the files it wrote);
local retention never deletes a step whose mirror has not committed, so rotation never removes
the only durable copy.

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

from milepost import _api, _checkpoint, _copy, _dispatch, _options, _paths
from milepost.colocated import HostGroup
from milepost.training._policies import (
    FixedInterval,
    KeepAll,
    KeepLatest,
    RetentionPolicy,
    SaveContext,
    SavePolicy,
    StepInfo,
    preemption_signals,
)
from milepost.training._tier import StepBusyError, Tier

log = logging.getLogger("milepost.training")

T = TypeVar("T")
STATE = "state"


class StepExistsError(FileExistsError):
    """A committed checkpoint of this step exists already, or a save of it is in flight."""


class StepNotFoundError(FileNotFoundError):
    """No committed checkpoint of this step (or none at all)."""


class BackgroundSaveError(RuntimeError):
    """A save that ran in the background failed; ``step`` says which, ``__cause__`` why."""

    def __init__(self, step: int, cause: BaseException) -> None:
        super().__init__(
            f"the background save of step {step} failed: {type(cause).__name__}: {cause}. "
            "Nothing of that step was committed; earlier steps are intact. Save again to retry."
        )
        self.step = step


class MirrorError(BackgroundSaveError):
    """The mirror of a step from the local tier to the root failed or timed out; the step is
    kept in the local tier, and the next Checkpointer on these folders mirrors it again."""

    def __init__(self, step: int, local: Any, root: Any, cause: BaseException) -> None:
        RuntimeError.__init__(
            self,
            f"mirroring step {step} from {local} to {root} failed: {type(cause).__name__}: {cause}. The step is kept in "
            f"{local} (retention will not delete it); open a Checkpointer on these folders again to retry the mirror.",
        )
        self.step = step


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not hasattr(step, "__index__"):
        raise TypeError(f"step must be a non-negative int, got {step!r} ({type(step).__name__})")
    value = int(step.__index__())
    if value < 0:
        raise ValueError(f"step must be a non-negative int, got {value}")
    return value


def _plain_metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    """Metrics with NumPy/JAX scalars turned into Python numbers (they are stored as JSON)."""
    out: dict[str, Any] = {}
    for key, value in dict(metrics or {}).items():
        if not isinstance(key, str):
            raise TypeError(f"metric names must be str, got {key!r}")
        if isinstance(value, np.generic) or (
            isinstance(value, np.ndarray | jax.Array) and value.shape == ()
        ):
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

    ``local`` (a folder on a fast local disk) adds a local tier: ``save`` commits each step
    there, and a background mirror copies it to ``root`` (then durable); ``local_keep`` (default
    ``KeepLatest(n=2)``) says which steps the local tier keeps, and never deletes one whose mirror
    has not committed. ``steps`` and ``latest`` see both tiers; ``load`` reads the local copy when
    there is one. A mirror that fails, or does not finish within ``mirror_timeout_secs``, keeps
    the local step and raises :class:`MirrorError` on the next call; a Checkpointer opened on
    folders holding unmirrored steps mirrors them.

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
        local: str | os.PathLike[str] | None = None,
        local_keep: RetentionPolicy | None = None,
        mirror_timeout_secs: float | None = None,
    ) -> None:
        self.root = _paths.as_path(root)
        self.local: Path | None = None
        if local is not None:
            where = _paths.as_path(local)
            if not isinstance(where, Path):
                raise ValueError(
                    f"local={local!r} is not a local folder; the local tier is a fast local disk (e.g. /local_ssd/ckpt), "
                    "and root is where steps are mirrored to (it may be gs:// or s3://)"
                )
            if isinstance(self.root, Path) and (
                where == self.root or self.root in where.parents or where in self.root.parents
            ):
                raise ValueError(
                    f"local={str(where)!r} and root={str(self.root)!r} overlap; give the local tier its own folder"
                )
            self.local = where
        elif local_keep is not None:
            raise ValueError(
                "local_keep applies to the local tier; pass local=<folder> too, or drop local_keep"
            )
        if not isinstance(read_only, bool):
            raise TypeError(f"read_only must be True or False, got {read_only!r}")
        self.read_only = read_only
        self.save_policy: SavePolicy = (
            save_policy if save_policy is not None else FixedInterval(interval=1)
        )
        self.keep: RetentionPolicy = keep if keep is not None else KeepAll()
        if not isinstance(self.save_policy, SavePolicy):
            raise TypeError(
                f"save_policy={self.save_policy!r} is not a save policy (it needs should_save(ctx)); e.g. FixedInterval(interval=100)"
            )
        if not isinstance(self.keep, RetentionPolicy):
            raise TypeError(
                f"keep={self.keep!r} is not a retention policy (it needs keep(steps)); e.g. KeepLatest(n=3)"
            )
        self.local_keep: RetentionPolicy = local_keep if local_keep is not None else KeepLatest(n=2)
        if not isinstance(self.local_keep, RetentionPolicy):
            raise TypeError(
                f"local_keep={self.local_keep!r} is not a retention policy (it needs keep(steps)); e.g. KeepLatest(n=2)"
            )
        if (
            isinstance(max_in_flight, bool)
            or not isinstance(max_in_flight, int)
            or max_in_flight < 1
        ):
            raise ValueError(f"max_in_flight must be an int >= 1, got {max_in_flight!r}")
        self.max_in_flight = max_in_flight
        self.asynchronous = bool(asynchronous)
        if timeout_secs is not None:
            _options.AsyncOptions(timeout_secs=timeout_secs)  # the same checks, the same errors
        self._timeout = (
            float(timeout_secs)
            if timeout_secs is not None
            else _options.current().async_.timeout_secs
        )
        if mirror_timeout_secs is not None:
            _options.AsyncOptions(timeout_secs=mirror_timeout_secs)
        self._mirror_timeout = (
            float(mirror_timeout_secs) if mirror_timeout_secs is not None else self._timeout
        )
        self._options = _options.current()
        """The options when the Checkpointer was opened; its background work (mirrors) uses them."""
        self._lease_secs = lease_secs = self._options.saving.lease_secs
        self._group = _dispatch.check_storage(_dispatch.host_group_for([]), self.root)
        self._durable = Tier(self.root, lease_secs)
        self._fast = Tier(self.local, lease_secs) if self.local is not None else None
        self._primary = self._group.is_primary()

        self._cond = threading.Condition(threading.RLock())
        self._gc_lock = threading.Lock()
        self._steps: dict[int, dict[str, Any]] = {}
        """Committed steps in root (durable), with their metrics."""
        self._local_steps: dict[int, dict[str, Any]] = {}
        """Committed steps in the local tier."""
        self._mirrors: dict[int, HostGroup] = {}
        """Local steps waiting for their mirror or being mirrored (in order), with the hosts that copy."""
        self._unmirrored: set[int] = set()
        """Local steps whose mirror failed: kept until a later Checkpointer mirrors them."""
        self._mirror_worker = _Worker(self._mirror_next, f"milepost-mirror:{self.root.name}")
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

        durable, fast = self._shared("open", self._open_on_primary)
        self._steps = {int(k): dict(v) for k, v in durable.items()}
        self._local_steps = {int(k): dict(v) for k, v in fast.items()}
        if not self.read_only:
            for step in sorted(
                set(self._local_steps) - set(self._steps)
            ):  # a mirror that did not finish
                log.warning(
                    "step %s is only in %s; mirroring it to %s", step, self.local, self.root
                )
                self._mirrors[step] = self._group
                self._mirror_worker.submit()

        signals = preemption_signals(self.save_policy)
        self._jax_preemption = signal.SIGTERM in signals and _jax_preemption_service()
        for sig in signals:
            if sig == signal.SIGTERM and self._jax_preemption:
                continue  # JAX's preemption service owns SIGTERM and agrees on the step
            self._install_signal(sig)

    # -- collectives --------------------------------------------------------------------
    def _shared(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()`` on the primary; its result (or its error) on every process."""
        return _dispatch.shared(
            self._group, f"milepost.training:{what}:{self.root}", fn, self._timeout
        )

    # -- listing ------------------------------------------------------------------------
    def _open_on_primary(self) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, Any]]]:
        fast = self._fast.open(self.read_only) if self._fast is not None else {}
        return self._durable.open(self.read_only), fast

    def _scan(self) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, Any]]]:
        return self._durable.scan(), (self._fast.scan() if self._fast is not None else {})

    def reload(self) -> None:
        """Wait for saves in flight, then list the root again (steps written by another job)."""
        self.wait()
        durable, fast = self._shared("reload", self._scan)
        with self._cond:
            self._steps = {int(k): dict(v) for k, v in durable.items()}
            self._local_steps = {int(k): dict(v) for k, v in fast.items()}

    @property
    def steps(self) -> list[int]:
        """Committed steps of both tiers, oldest first (steps in flight are not listed until
        they commit)."""
        with self._cond:
            return sorted(self._steps.keys() | self._local_steps.keys())

    @property
    def latest(self) -> int | None:
        """The newest committed step (None when there is none)."""
        steps = self.steps
        return steps[-1] if steps else None

    @property
    def durable_steps(self) -> list[int]:
        """Steps committed in ``root`` (with a local tier: the ones mirrored)."""
        with self._cond:
            return sorted(self._steps)

    def path(self, step: int) -> Path | _paths.ObjectPath:
        """Where ``step`` is (or would be) stored durably: ``root/<step>``."""
        return self.root / str(_check_step(step))

    def _where(self, step: int) -> Path | _paths.ObjectPath:
        """Where to read ``step``: its local copy when there is one."""
        with self._cond:
            if self.local is not None and step in self._local_steps:
                return self.local / str(step)
        return self.root / str(step)

    # -- deciding -----------------------------------------------------------------------
    def _install_signal(self, sig: int) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.warning(
                "the Checkpointer was opened off the main thread, so it cannot handle "
                "signal %s; call ckpt.preempt() from your own handler instead",
                signal.Signals(sig).name,
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
            known = set(self._steps) | set(self._local_steps) | set(self._in_flight)
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
        if preempted and answer:
            log.warning(
                "preempted: saving step %s, after which training should stop (ckpt.preempted is True)",
                step,
            )
        elif not answer:
            log.debug(
                "skipped step %s: the save policy %r does not ask for it", step, self.save_policy
            )
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
                lambda: (
                    f"the saves of steps {sorted(self._in_flight)} did not finish within {self._timeout}s, "
                    f"so step {step} was not saved"
                ),
            )
            self._raise_failure()  # the save we waited for may have failed
            self._check_free(step)
            self._in_flight[step] = None  # reserved
            decided = self._decision
            served = (
                decided[2]
                if (not force and decided is not None and decided[0] == step)
                else self._signals_seen
            )
            self._decision = None
            self._last_save_start = time.monotonic()
        try:
            target = self.local / str(step) if self.local is not None else self.path(step)
            group = _dispatch.host_group_for(_checkpoint._all_leaves(checkpointables))
            handle = _api.save_checkpointables_async(
                target, checkpointables, custom_metadata=custom_metadata, metrics=plain_metrics
            )
        except BaseException:
            with self._cond:
                del self._in_flight[step]
                self._cond.notify_all()
            raise
        log.debug("saving step %s to %s", step, target)
        with self._cond:
            self._signals_served = max(self._signals_served, served)
            self._in_flight[step] = handle
        handle.add_done_callback(lambda h: self._finish(step, h, plain_metrics, group))
        if not self.asynchronous:
            self.wait()
        return True

    def _check_free(self, step: int) -> None:
        if step in self._in_flight:
            raise StepExistsError(
                f"a save of step {step} is already in flight in {self.root}; wait() for it, or save another step"
            )
        if step in self._steps or step in self._local_steps:
            raise StepExistsError(
                f"step {step} already has a committed checkpoint at {self._where(step)}; "
                "delete(step) it first, or save another step"
            )

    def _finish(
        self, step: int, handle: _checkpoint.SaveHandle, metrics: dict[str, Any], group: HostGroup
    ) -> None:
        """The save of ``step`` ended (on the thread that finished it): record the step, or the
        failure for the next call to raise, and ask for retention (and its mirror)."""
        try:
            handle.result(0)
        except BaseException as e:
            log.error("the save of step %s failed: %s: %s", step, type(e).__name__, e)
            with self._cond:
                if self._failure is None:
                    self._failure = BackgroundSaveError(step, e)
                    self._failure.__cause__ = e
                self._in_flight.pop(step, None)
                self._cond.notify_all()
            return
        shown = f" ({', '.join(f'{k}={v}' for k, v in metrics.items())})" if metrics else ""
        if self.local is not None:
            log.info(
                "saved step %s to %s%s; mirroring it to %s", step, self.local, shown, self.root
            )
        else:
            log.info("saved step %s to %s%s", step, self.root, shown)
        with self._cond:
            if self.local is not None:
                self._local_steps[step] = metrics
                self._mirrors[step] = group
            else:
                self._steps[step] = metrics
            self._in_flight.pop(step, None)
            self._gc_active += 1
            self._cond.notify_all()
        if self.local is not None:
            self._mirror_worker.submit()
        self._retention.submit()

    def _mirror_next(self) -> None:
        """Mirror the oldest local step waiting for it to ``root`` (on the mirror worker)."""
        with self._cond:
            if not self._mirrors:
                return
            step, group = next(iter(self._mirrors.items()))
            metrics = self._local_steps.get(step, {})
        assert self.local is not None
        try:
            if step not in self._steps:
                # A mirror a killed process left may still hold its lease: wait for it to expire.
                _copy.copy_with(
                    group,
                    self.local / str(step),
                    self.path(step),
                    overwrite=False,
                    timeout=self._mirror_timeout,
                    options=self._options,
                    wait_for_writer_secs=min(self._mirror_timeout, 1.5 * self._lease_secs),
                )
        except Exception as e:
            log.error(
                "mirroring step %s to %s failed: %s: %s", step, self.root, type(e).__name__, e
            )
            with self._cond:
                if self._failure is None:
                    self._failure = MirrorError(step, self.local, self.root, e)
                    self._failure.__cause__ = e
                self._unmirrored.add(step)
                del self._mirrors[step]
                self._cond.notify_all()
            return
        log.info("mirrored step %s to %s", step, self.root)
        with self._cond:
            self._steps[step] = metrics
            del self._mirrors[step]
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
        """Apply the retention policies, on the retention worker (``_gc_active`` was raised by
        whoever asked for this run)."""
        try:
            with self._gc_lock:
                with self._cond:
                    busy = set(self._in_flight) | set(self._loading) | set(self._mirrors)
                    doomed = self._doomed(self.keep, self._steps, busy)
                    # The local tier keeps every step not yet durable: rotation must never delete
                    # the only copy that is to reach root.
                    durable = set(self._steps) | (
                        set(self._local_steps) - set(self._mirrors) - self._unmirrored
                    )
                    doomed_local = self._doomed(
                        self.local_keep,
                        self._local_steps,
                        busy | (set(self._local_steps) - durable),
                    )
                    letting_go = self._doomed(self.keep, self._steps, set()) + self._doomed(
                        self.local_keep, self._local_steps, set()
                    )
                    self._gc_deferred = any(s in self._loading for s in letting_go)
                    for s in doomed:
                        del self._steps[s]
                    for s in doomed_local:
                        del self._local_steps[s]
                if not self._primary:
                    return
                for tier, steps in ((self._durable, doomed), (self._fast, doomed_local)):
                    if tier is None or not steps:
                        continue
                    deleted = tier.delete(steps)
                    if deleted:
                        policy = self.keep if tier is self._durable else self.local_keep
                        log.info("deleted steps %s of %s (retention: %r)", deleted, tier, policy)
        except Exception as e:  # retention must never break training
            log.error("retention in %s failed: %s: %s", self.root, type(e).__name__, e)
        finally:
            with self._cond:
                self._gc_active -= 1
                self._cond.notify_all()

    @staticmethod
    def _doomed(
        policy: RetentionPolicy, steps: Mapping[int, dict[str, Any]], spared: set[int]
    ) -> list[int]:
        """The steps ``policy`` lets go, but the latest and ``spared``."""
        infos = [StepInfo(step=s, metrics=steps[s]) for s in sorted(steps)]
        if not infos:
            return []
        wanted = set(policy.keep(infos))
        return [
            i.step
            for i in infos
            if i.step not in wanted and i.step != infos[-1].step and i.step not in spared
        ]

    def delete(self, step: int) -> None:
        """Delete the committed ``step`` now (not while it is being saved or loaded)."""
        step = _check_step(step)
        self._check_writable("delete steps")
        self._raise_failure()

        def on_primary() -> None:
            with self._gc_lock:
                with self._cond:
                    if step in self._in_flight or step in self._mirrors:
                        raise StepBusyError(
                            f"step {step} is being saved or mirrored; wait() before deleting it"
                        )
                    if self._loading[step]:
                        raise StepBusyError(
                            f"step {step} is being loaded; delete it after the load returns"
                        )
                    if step not in self._steps and step not in self._local_steps:
                        raise StepNotFoundError(
                            f"no committed step {step} in {self.root} (steps: {self.steps})"
                        )
                for steps, tier in ((self._steps, self._durable), (self._local_steps, self._fast)):
                    if tier is not None and step in steps:
                        tier.delete_one(step)
                        with self._cond:
                            steps.pop(step, None)
                            self._unmirrored.discard(step)

        self._shared(f"delete:{step}", on_primary)
        if self._primary:
            log.info("deleted step %s of %s (asked)", step, self.root)
        if not self._primary:
            with self._cond:
                self._steps.pop(step, None)
                self._local_steps.pop(step, None)

    # -- loading ------------------------------------------------------------------------
    def _protect(self, step: int | None) -> int:
        """Resolve ``step`` (None: the latest) on the primary and keep retention away from it
        until :meth:`_release`."""
        wanted = None if step is None else _check_step(step)

        def on_primary() -> int:
            with self._cond:
                committed = self._steps.keys() | self._local_steps.keys()
                if wanted is None:
                    if not committed:
                        raise StepNotFoundError(
                            f"no committed checkpoint in {self.root} yet; nothing to load"
                        )
                    resolved = max(committed)
                elif wanted in committed:
                    resolved = wanted
                elif wanted in self._in_flight:
                    raise StepNotFoundError(
                        f"step {wanted} is still being saved; wait() for it before loading it"
                    )
                else:
                    raise StepNotFoundError(
                        f"no committed step {wanted} in {self.root} (steps: {sorted(committed)})"
                    )
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

    def load(
        self, step: int | None = None, abstract_state: Any = None, *, partial: bool = False
    ) -> Any:
        """Load the tree saved by :meth:`save` at ``step`` (default: the latest committed).

        ``abstract_state`` gives the structure and target shardings (see ``milepost.load``)."""
        self._raise_failure()
        s = self._protect(step)
        try:
            return _api.load(self._where(s), abstract_state, partial=partial)
        finally:
            self._release(s)

    def load_checkpointables(
        self,
        step: int | None = None,
        checkpointables: Mapping[str, Any] | None = None,
        *,
        partial: bool = False,
    ) -> dict[str, Any]:
        """Load the named checkpointables of ``step`` (default: the latest; all when None)."""
        self._raise_failure()
        s = self._protect(step)
        try:
            return _api.load_checkpointables(self._where(s), checkpointables, partial=partial)
        finally:
            self._release(s)

    def metadata(self, step: int | None = None) -> _checkpoint.CheckpointMetadata:
        """Shapes, dtypes, shardings, metrics and custom metadata of ``step`` (default: the
        latest), without reading array data."""
        self._raise_failure()
        s = self._protect(step)
        try:
            return _api.metadata(self._where(s))
        finally:
            self._release(s)

    # -- lifecycle ----------------------------------------------------------------------
    def wait(self) -> None:
        """Wait for every save in flight, every mirror and retention; re-raise a background
        failure."""
        with self._cond:
            self._wait_while(
                lambda: bool(self._in_flight or self._gc_active or self._mirrors),
                lambda: (
                    f"the saves of steps {sorted(self._in_flight)} (mirrors of {sorted(self._mirrors)}) in "
                    f"{self.root} did not finish within {self._timeout}s"
                ),
                self._timeout + (self._mirror_timeout if self._mirrors else 0.0),
            )
        self._raise_failure()

    def _wait_while(
        self, busy: Callable[[], bool], message: Callable[[], str], timeout: float | None = None
    ) -> None:
        """With ``self._cond`` held: wait while ``busy()``, at most ``timeout`` (default: the
        Checkpointer's)."""
        deadline = time.monotonic() + (self._timeout if timeout is None else timeout)
        while busy():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(message())
            self._cond.wait(left)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(
                f"the Checkpointer for {self.root} is closed; open a new one to save"
            )

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
            self._mirror_worker.stop(self._timeout)
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
            log.error("while closing after an error: %s: %s", type(e).__name__, e)

    def _step_rows(self) -> list[dict[str, Any]]:
        """One row per step this Checkpointer knows (committed, being saved or mirrored), oldest
        first: ``step``, ``tier`` (``durable``, ``local`` or both), ``state`` and ``metrics``.
        What the steps table in a notebook shows; ``milepost ls ROOT`` lists the folders."""
        with self._cond:
            steps = sorted(
                set(self._steps)
                | set(self._local_steps)
                | set(self._in_flight)
                | set(self._mirrors)
                | self._unmirrored
            )
            rows = []
            for s in steps:
                tiers = [
                    name
                    for name, known in (("local", self._local_steps), ("durable", self._steps))
                    if s in known
                ]
                if s in self._in_flight:
                    state = "saving"
                elif s in self._mirrors:
                    state = "committed, mirroring"
                elif s in self._unmirrored:
                    state = "committed, mirror failed"
                else:
                    state = "committed"
                metrics = self._steps.get(s) or self._local_steps.get(s) or {}
                rows.append(
                    {
                        "step": s,
                        "tier": " + ".join(tiers) or "-",
                        "state": state,
                        "metrics": dict(metrics),
                    }
                )
            return rows

    def _table(self) -> tuple[str, tuple[str, ...], list[tuple[Any, ...]]]:

        rows = self._step_rows()
        names = sorted({k for r in rows for k in r["metrics"]})
        columns = ("step", "tier", "state", *names)
        table = [
            (r["step"], r["tier"], r["state"], *(_metric(r["metrics"].get(k)) for k in names))
            for r in rows
        ]
        where = repr(str(self.root)) + (
            f", local={str(self.local)!r}" if self.local is not None else ""
        )
        mode = ", read_only=True" if self.read_only else ""
        title = (
            f"Checkpointer({where}{mode}): {len(rows)} step{'' if len(rows) == 1 else 's'}, latest {self.latest}; "
            f"save_policy={self.save_policy!r}, "
            f"keep={self.keep!r}"
            + (f", local_keep={self.local_keep!r}" if self.local is not None else "")
            + (", preempted" if self._preempted else "")
            + (", closed" if self._closed else "")
        )
        return title, columns, table

    def __repr__(self) -> str:
        from milepost import _views

        title, columns, rows = self._table()
        if not rows:
            return f"{title}"
        shown = rows[-_views.MAX_ROWS :]
        text = title + ("" if len(shown) == len(rows) else f" (the last {len(shown)} shown)")
        return text + "\n" + _views.text_table(columns, shown)

    def _repr_html_(self) -> str:
        from milepost import _views

        title, columns, rows = self._table()
        return _views.html_table(columns, rows, title=title)


def _metric(value: Any) -> str:
    if value is None:
        return ""
    return f"{value:.6g}" if isinstance(value, float) else str(value)


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
