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

The Checkpointer coordinates parts it owns: the tiers (:mod:`._tier`), what it knows of their
steps (:mod:`._state`), retention (:mod:`._retention`), the mirror (:mod:`._mirror`) and the
preemption requests (:mod:`._preemption`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from milepost import _api, _checkpoint, _hosts, _options, _views
from milepost._checkpoint import CheckpointMetadata, LoadHandle
from milepost._errors import SaveCancelledError
from milepost.colocated import HostGroup, Slice
from milepost.training._errors import (
    BackgroundSaveError,
    StepBusyError,
    StepExistsError,
    StepNamingError,
    StepNotFoundError,
)
from milepost.training._mirror import Mirror
from milepost.training._naming import PLAIN, StepNaming, naming_of
from milepost.training._options import CheckpointerOptions
from milepost.training._policies import (
    RetentionPolicy,
    SaveContext,
    SavePolicy,
    keep_best_in,
)
from milepost.training._preemption import PreemptionWatch
from milepost.training._retention import Retention, step_infos
from milepost.training._state import StepState, check_step, plain_metrics
from milepost.training._tier import Tier
from milepost.training.peers import PeerTier, PeerTierRunner, Recovery
from milepost.workers import ObjectPath, StoragePath, as_path, is_local
from milepost.workers import format as fmt

log = logging.getLogger("milepost.training")

T = TypeVar("T")
_Listing = tuple[
    dict[int, dict[str, Any]],
    dict[int, dict[str, Any]],
    dict[int, str],
    dict[int, str],
    Any,
    dict[int, int],
]
"""What the primary lists: each tier's steps (metrics), their folders' names, the naming, and
the steps' commit times."""
STATE = "state"
DATA_ITER = "data_iter"


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

    Step folders are named ``<step>``, or as Orbax's ``step_prefix`` and
    ``step_format_fixed_length`` name them (``checkpoint_000010``): steps of every such naming
    are listed, loaded and retained, and new steps are named as the root's committed steps are,
    or as ``step_prefix`` and ``step_format_fixed_length`` say (either given: both apply, the
    other None meaning none). A writing Checkpointer on a root whose steps are named several
    ways needs them (:class:`StepNamingError` says so); two folders of one step are an error.

    ``read_only=True`` (an eval watcher, a notebook looking at a run) lists and loads but never
    writes or deletes anything. A writing Checkpointer removes what an unfinished save or
    deletion left behind only once it holds that step's writer lock, so a save running in
    another process is never touched.

    The keyword arguments are checked together as a :class:`CheckpointerOptions`
    (``ckpt.options``).
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | ObjectPath,
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
        peers: PeerTier | None = None,
        step_prefix: str | None = None,
        step_format_fixed_length: int | None = None,
    ) -> None:
        given: dict[str, Any] = {"save_policy": save_policy, "keep": keep}
        self.options: CheckpointerOptions = CheckpointerOptions(
            **{k: v for k, v in given.items() if v is not None},
            max_in_flight=max_in_flight,
            asynchronous=asynchronous,
            timeout_secs=timeout_secs,
            read_only=read_only,
            local=local,
            local_keep=local_keep,
            mirror_timeout_secs=mirror_timeout_secs,
            peers=peers,
            step_prefix=step_prefix,
            step_format_fixed_length=step_format_fixed_length,
        )
        """Every option, as given or defaulted (a :class:`CheckpointerOptions`)."""
        self.root: StoragePath = as_path(root)
        self.local: Path | None = self.options.local_path()
        self._check_tiers_apart()
        context = _options.current()
        """The options in force when the Checkpointer was opened; its background work uses them."""
        self._timeout = float(
            timeout_secs if timeout_secs is not None else context.async_.timeout_secs
        )
        self._mirror_timeout = float(
            mirror_timeout_secs if mirror_timeout_secs is not None else self._timeout
        )
        self._group = _hosts.check_storage(_hosts.host_group_for([]), self.root)
        self._primary = self._group.is_primary()
        lease_secs = context.saving.lease_secs
        self._durable = Tier(self.root, lease_secs)
        self._fast = Tier(self.local, lease_secs) if self.local is not None else None
        for tier in self._tiers():
            tier.naming = self._given_naming() or PLAIN
        self._state = StepState(self._timeout)
        self._retention = Retention(
            self._state, self._durable, self._fast, self.keep, self.local_keep, self._primary
        )
        self._mirror = (
            Mirror(
                self._state, self.local, self.root, self._retention, self._mirror_timeout, context
            )
            if self.local is not None
            else None
        )
        self._peers = (
            PeerTierRunner(self.options.peers, str(self.root), self._timeout)
            if self.options.peers is not None
            else None
        )
        self._last_save_start: float | None = None
        self._decision: tuple[int, bool, int] | None = None
        """(step, answer, requests seen) of the last should_save, reused by a save of that step."""
        self._preempted = False
        self._closed = False

        self._open()
        self._preemption = PreemptionWatch(self.save_policy)

    def _check_tiers_apart(self) -> None:
        """The local tier and the root are different folders, neither inside the other; checked
        before any tier, thread or listing is made, so a refused Checkpointer leaves nothing."""
        if self.local is not None and is_local(self.root):
            if (
                self.local == self.root
                or self.root in self.local.parents
                or self.local in self.root.parents
            ):
                raise ValueError(
                    f"local={str(self.local)!r} and root={str(self.root)!r} overlap; give the "
                    "local tier its own folder"
                )

    def _open(self) -> None:
        """Open the tiers (the primary lists them; every process adopts its listing), then mirror
        the steps only in the local tier: a mirror that did not finish before the last run ended.
        The mirror requests come after the listing is adopted (they name steps from it) and only
        once every part (state, retention, mirror) exists."""
        self._adopt(self._shared("open", self._open_on_primary))
        with self._state.cond:
            unmirrored = sorted(set(self._state.local) - set(self._state.durable))
        if self._mirror is not None and not self.read_only:
            for step in unmirrored:  # a mirror that did not finish
                log.warning(
                    "step %s is only in %s; mirroring it to %s", step, self.local, self.root
                )
                self._mirror.request(step, self._group)

    # -- what it was opened with --------------------------------------------------------
    @property
    def save_policy(self) -> SavePolicy:
        return self.options.save_policy

    @property
    def keep(self) -> RetentionPolicy:
        return self.options.keep

    @property
    def local_keep(self) -> RetentionPolicy:
        return self.options.local_retention

    @property
    def read_only(self) -> bool:
        """True when opened to read only: ``save`` and ``delete`` raise."""
        return self.options.read_only

    @property
    def max_in_flight(self) -> int:
        return self.options.max_in_flight

    @property
    def asynchronous(self) -> bool:
        """Whether ``save`` returns before the step is written (it commits in the background)."""
        return self.options.asynchronous

    # -- collectives --------------------------------------------------------------------
    def _shared(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()`` on the primary; its result (or its error) on every process."""
        return _hosts.shared(
            self._group, f"milepost.training:{what}:{self.root}", fn, self._timeout
        )

    # -- listing ------------------------------------------------------------------------
    def _tiers(self) -> list[Tier]:
        return [self._durable] if self._fast is None else [self._durable, self._fast]

    def _given_naming(self) -> StepNaming | None:
        o = self.options
        if o.step_prefix is None and o.step_format_fixed_length is None:
            return None
        return StepNaming(o.step_prefix, o.step_format_fixed_length)

    def _open_on_primary(self) -> _Listing:
        fast = self._fast.open(self.read_only) if self._fast is not None else {}
        return self._listed(self._durable.open(self.read_only), fast)

    def _scan(self) -> _Listing:
        fast = self._fast.scan() if self._fast is not None else {}
        return self._listed(self._durable.scan(), fast)

    def _listed(self, durable: dict[int, Any], fast: dict[int, Any]) -> _Listing:
        """The tiers' listing, with the naming of new steps: the one given, else the one of
        the committed steps (StepNamingError, when writing, if they have several)."""
        local_names = self._fast.names if self._fast is not None else {}
        naming = self._given_naming() or naming_of(
            {*self._durable.names.values(), *local_names.values()}
        )
        if naming is None and self.read_only:
            naming = PLAIN  # names no step
        if naming is None:
            names = {**self._durable.names, **local_names}
            newest = {naming_of([names[s]]): names[s] for s in sorted(names)}
            latest = naming_of([names[max(names)]])
            raise StepNamingError(
                self.root,
                tuple(newest.values()),
                f"the steps of {self.root} are named more than one way "
                f"({', '.join(repr(n) for n in newest.values())}), so new steps' names are not "
                f"known: pass step_prefix= and step_format_fixed_length= (the latest step's "
                f"naming: {latest}), or open it with read_only=True",
            )
        times = {**(self._fast.times if self._fast is not None else {}), **self._durable.times}
        naming_ = (naming.prefix, naming.fixed_length)
        return durable, fast, self._durable.names, local_names, naming_, times

    def _adopt(self, listing: _Listing) -> None:
        """The primary's listing, in this process: the steps, their folders, the naming."""
        durable, fast, durable_names, local_names, (prefix, length), times = listing
        for tier, names in ((self._durable, durable_names), (self._fast, local_names)):
            if tier is not None:
                tier.names = {int(k): str(v) for k, v in names.items()}
                tier.naming = StepNaming(prefix, length)
        with self._state.cond:
            self._state.durable = {int(k): dict(v) for k, v in durable.items()}
            self._state.local = {int(k): dict(v) for k, v in fast.items()}
            self._state.times = {int(k): int(v) for k, v in times.items()}

    def reload(self) -> None:
        """Wait for saves in flight, then list the root again (steps written by another job)."""
        self.wait()
        self._adopt(self._shared("reload", self._scan))

    @property
    def steps(self) -> list[int]:
        """Committed steps of both tiers, oldest first (steps in flight are not listed until
        they commit)."""
        with self._state.cond:
            return sorted(self._state.committed())

    @property
    def latest(self) -> int | None:
        """The newest committed step (None when there is none)."""
        steps = self.steps
        return steps[-1] if steps else None

    @property
    def durable_steps(self) -> list[int]:
        """Steps committed in ``root`` (with a local tier: the ones mirrored)."""
        with self._state.cond:
            return sorted(self._state.durable)

    def best_step(self) -> int | None:
        """The best committed step by the :class:`KeepBest` in ``keep`` (else in
        ``local_retention``; inside a :class:`KeepUnion` too, the first one), as Orbax's
        ``best_step()``; None when no committed step has a score. A ValueError when neither
        policy has a KeepBest."""
        policy = keep_best_in(self.keep) or keep_best_in(self.local_keep)
        if policy is None:
            raise ValueError(
                f"best_step() ranks steps by the Checkpointer's KeepBest, and {self.root} is "
                f"open with keep={self.keep!r}: open it with keep=KeepBest(n=..., metric=...) "
                "(or KeepUnion(..., KeepBest(...)))"
            )
        with self._state.cond:
            metrics = {**self._state.local, **self._state.durable}
            times = dict(self._state.times)
        ranked = policy.ranked(step_infos(metrics, times))
        return ranked[0] if ranked else None

    def path(self, step: int) -> StoragePath:
        """Where ``step`` is (or would be) stored durably: ``root/<step>`` (or the folder the
        root's step naming gives it, e.g. ``root/checkpoint_000010``)."""
        return self._durable.step(check_step(step))

    def _where(self, step: int) -> StoragePath:
        """Where to read ``step``: its local copy when there is one."""
        with self._state.cond:
            if self._fast is not None and step in self._state.local:
                return self._fast.step(step)
        return self._durable.step(step)

    # -- deciding -----------------------------------------------------------------------
    def preempt(self) -> None:
        """Ask a :class:`Preemption` policy for a save at the next ``should_save`` (what its
        signal handler does)."""
        self._preemption.request()

    @property
    def preempted(self) -> bool:
        """True once a ``should_save`` saw a preemption request: save, then stop training.
        Every process gets the same value at the same step."""
        return self._preempted

    def should_save(self, step: int) -> bool:
        """Whether the save policy (or a preemption) asks for a save at ``step``.

        Every process gets the primary's answer, so all save at the same step. Asking twice for
        the same step gives the same answer."""
        step = check_step(step)
        state = self._state
        state.raise_failure()
        with state.cond:
            if self._decision is not None and self._decision[0] == step:
                return self._decision[1]
            seen = self._preemption.seen
            known = state.committed() | set(state.in_flight)
            ctx = SaveContext(
                step=step,
                latest_step=max(known) if known else None,
                last_save_start=self._last_save_start,
                save_in_flight=bool(state.in_flight),
                now=time.monotonic(),
                preempted=seen > self._preemption.served,
            )
        if self._preemption.reached_sync_point(step):  # collective: every process, every step
            ctx = replace(ctx, preempted=True)

        def decide() -> tuple[bool, bool]:
            return bool(self.save_policy.should_save(ctx)), ctx.preempted

        answer, preempted = self._shared("should-save", decide)
        with state.cond:
            self._decision = (step, answer, seen)
            if preempted and answer:
                self._preempted = True
        if preempted and answer:
            log.warning(
                "preempted: saving step %s, after which training should stop (ckpt.preempted "
                "is True)",
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
        data_iter: Any = None,
    ) -> bool:
        """Save ``state`` as ``step`` if the policy says so (or ``force``); True if a save started.

        Returns once the arrays are copied to host memory (you may then change or donate them);
        the write and commit continue in the background. ``metrics`` (JSON numbers, e.g. a loss)
        are stored in the step's ``_CHECKPOINT_METADATA`` and feed :class:`KeepBest`.
        ``data_iter``: the training data's iterator (a Grain iterator, or any object with
        ``get_state()``/``set_state()``), whose position is saved with the step as its
        ``data_iter`` checkpointable (in every process of a multi-controller job, each its own);
        :meth:`load` with ``data_iter=`` restores it."""
        parts = {STATE: state} if data_iter is None else {STATE: state, DATA_ITER: data_iter}
        return self.save_checkpointables(
            step, parts, metrics=metrics, custom_metadata=custom_metadata, force=force
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
        step = check_step(step)
        self._check_writable("save steps")
        state = self._state
        state.raise_failure()
        metrics_ = plain_metrics(metrics)
        kept = self._peers is not None and self._peers.due(step) and STATE in checkpointables
        if kept:
            assert self._peers is not None
            self._peers.save(step, checkpointables[STATE])
        if not force and not self.should_save(step):
            return kept
        with state.cond:
            self._check_free(step)
            state.wait_while(
                lambda: len(state.in_flight) >= self.max_in_flight,
                lambda: (
                    f"the saves of steps {sorted(state.in_flight)} did not finish within "
                    f"{self._timeout}s, so step {step} was not saved"
                ),
            )
            state.raise_failure()  # the save we waited for may have failed
            self._check_free(step)
            state.in_flight[step] = None  # reserved
            decided = self._decision
            served = (
                decided[2]
                if (not force and decided is not None and decided[0] == step)
                else self._preemption.seen
            )
            self._decision = None
            self._last_save_start = time.monotonic()
        try:
            target = (self._fast or self._durable).step(step)
            group = _hosts.host_group_for(_checkpoint.all_leaves(checkpointables))
            handle = _api.save_checkpointables_async(
                target, checkpointables, custom_metadata=custom_metadata, metrics=metrics_
            )
        except BaseException:
            with state.cond:
                del state.in_flight[step]
                state.cond.notify_all()
            raise
        log.debug("saving step %s to %s", step, target)
        with state.cond:
            self._preemption.served = max(self._preemption.served, served)
            state.in_flight[step] = handle
        handle.add_done_callback(lambda h: self._finish(step, h, metrics_, group))
        if not self.asynchronous:
            self.wait()
        return True

    def cancel(self, step: int | None = None) -> list[int]:
        """Cancel the saves in flight whose commit has not begun (``step``: only that step's);
        never waits. Returns the steps cancelled, in order (empty if there was none, or each
        had begun its commit and goes on).

        A cancelled step never commits: once its writes in flight stop, everything it wrote is
        removed (see :meth:`milepost.SaveHandle.cancel`); it is never in :attr:`steps`,
        retention never counts it, and it is no failure (no later call raises for it). Saves
        whose commit has begun, mirrors and retention go on. :meth:`wait` waits until the
        cancelled saves have removed what they wrote; the next save waits for them as for any
        save in flight (``max_in_flight``), and may save a cancelled step again. With several
        controller processes it is collective: the primary decides, and every process gets
        its answer."""
        if step is not None:
            step = check_step(step)
        self._check_open()
        state = self._state

        def on_primary() -> list[int]:
            with state.cond:
                handles = [
                    (s, h)
                    for s, h in sorted(state.in_flight.items())
                    if h is not None and (step is None or s == step)
                ]
            return [s for s, h in handles if h.cancel()]

        cancelled = self._shared("cancel", on_primary)
        if cancelled and self._primary:
            log.info("cancelled the saves of steps %s in %s", cancelled, self.root)
        return cancelled

    def _check_free(self, step: int) -> None:
        if step in self._state.in_flight:
            raise StepExistsError(
                f"a save of step {step} is already in flight in {self.root}; wait() for it, or "
                "save another step"
            )
        if step in self._state.committed():
            raise StepExistsError(
                f"step {step} already has a committed checkpoint at {self._where(step)}; "
                "delete(step) it first, or save another step"
            )

    def _finish(
        self, step: int, handle: _checkpoint.SaveHandle, metrics: dict[str, Any], group: HostGroup
    ) -> None:
        """The save of ``step`` ended (on the thread that finished it): record the step, or the
        failure for the next call to raise, and ask for retention (and its mirror)."""
        state = self._state
        try:
            where = handle.result(0)
        except SaveCancelledError:
            log.info("the save of step %s was cancelled; what it wrote is removed", step)
            with state.cond:
                state.in_flight.pop(step, None)
                state.cond.notify_all()
            return
        except BaseException as e:
            log.error("the save of step %s failed: %s: %s", step, type(e).__name__, e)
            with state.cond:
                state.in_flight.pop(step, None)
                state.fail(BackgroundSaveError(step, e))
            return
        shown = f" ({', '.join(f'{k}={v}' for k, v in metrics.items())})" if metrics else ""
        if self.local is not None:
            log.info(
                "saved step %s to %s%s; mirroring it to %s", step, self.local, shown, self.root
            )
        else:
            log.info("saved step %s to %s%s", step, self.root, shown)
        committed_ns = _commit_time(where)
        with state.cond:  # one change: committed, its mirror and retention asked for
            state.times[step] = committed_ns
            if self._mirror is not None:
                state.local[step] = metrics
                self._mirror.request(step, group)
            else:
                state.durable[step] = metrics
            state.in_flight.pop(step, None)
            self._retention.request()
            state.cond.notify_all()

    # -- deleting -----------------------------------------------------------------------
    def delete(self, step: int) -> None:
        """Delete the committed ``step`` now (not while it is being saved or loaded)."""
        step = check_step(step)
        self._check_writable("delete steps")
        state = self._state
        state.raise_failure()

        def on_primary() -> None:
            with self._retention.lock:
                with state.cond:
                    if step in state.in_flight or step in state.mirrors:
                        raise StepBusyError(
                            f"step {step} is being saved or mirrored; wait() before deleting it"
                        )
                    if state.loading[step]:
                        raise StepBusyError(
                            f"step {step} is being loaded; delete it after the load returns"
                        )
                    if step not in state.committed():
                        raise StepNotFoundError(
                            f"no committed step {step} in {self.root} (steps: {self.steps})"
                        )
                for steps, tier in ((state.durable, self._durable), (state.local, self._fast)):
                    if tier is not None and step in steps:
                        tier.delete_one(step)
                        with state.cond:
                            steps.pop(step, None)
                            state.unmirrored.discard(step)
                with state.cond:
                    state.times.pop(step, None)

        self._shared(f"delete:{step}", on_primary)
        if self._primary:
            log.info("deleted step %s of %s (asked)", step, self.root)
        else:
            with state.cond:
                state.durable.pop(step, None)
                state.local.pop(step, None)
                state.times.pop(step, None)

    def delete_checkpointable(self, step: int, name: str) -> None:
        """Delete the checkpointable ``name`` of the committed ``step`` (e.g. its
        ``"data_iter"``), in every tier that holds the step, as
        :func:`milepost.delete_checkpointable` does: atomically, the rest of the step loading
        and verifying as before.

        ``CheckpointableNotFoundError`` lists the checkpointables the step has;
        ``LastCheckpointableError`` says to ``delete(step)`` instead; ``StepBusyError`` while
        the step is being saved, mirrored or loaded; ``PermissionError`` when read-only."""
        step = check_step(step)
        self._check_writable("delete checkpointables")
        state = self._state
        state.raise_failure()

        def on_primary() -> None:
            with self._retention.lock:  # retention deletes no step meanwhile
                with state.cond:
                    self._check_idle(step, "deleting a checkpointable of it")
                    held = ((state.local, self._fast), (state.durable, self._durable))
                    tiers = [t for steps, t in held if t is not None and step in steps]
                    state.changing.add(step)  # a load of it waits until this is done
                try:
                    _drop_in_tiers(tiers, step, name)
                finally:
                    with state.cond:
                        state.changing.discard(step)
                        state.cond.notify_all()

        self._shared(f"delete-checkpointable:{step}:{name}", on_primary)
        log.info("deleted the checkpointable %r of step %s of %s", name, step, self.root)

    def _check_idle(self, step: int, doing: str) -> None:
        """StepBusyError unless the committed ``step`` is free (hold ``state.cond``);
        StepNotFoundError unless it is committed."""
        state = self._state
        if step in state.in_flight or step in state.mirrors:
            raise StepBusyError(f"step {step} is being saved or mirrored; wait() before {doing}")
        if state.loading[step]:
            raise StepBusyError(f"step {step} is being loaded; try {doing} after the load returns")
        if step not in state.committed():
            raise StepNotFoundError(
                f"no committed step {step} in {self.root} (steps: {sorted(state.committed())})"
            )

    # -- loading ------------------------------------------------------------------------
    def _protect(self, step: int | None) -> int:
        """Resolve ``step`` (None: the latest) on the primary and keep retention away from it
        until :meth:`_release`."""
        wanted = None if step is None else check_step(step)
        state = self._state

        def on_primary() -> int:
            def free() -> bool:  # not having a checkpointable deleted (None: the latest)
                committed = state.committed()
                step = wanted if wanted is not None else max(committed, default=None)
                return step not in state.changing

            with state.cond:
                if not state.cond.wait_for(free, self._timeout):
                    raise StepBusyError(
                        f"a checkpointable of step {wanted} is being deleted (None: the latest); "
                        "load it once delete_checkpointable returns"
                    )
                committed = state.committed()
                if wanted is None:
                    if not committed:
                        raise StepNotFoundError(
                            f"no committed checkpoint in {self.root} yet; nothing to load"
                        )
                    resolved = max(committed)
                elif wanted in committed:
                    resolved = wanted
                elif wanted in state.in_flight:
                    raise StepNotFoundError(
                        f"step {wanted} is still being saved; wait() for it before loading it"
                    )
                else:
                    raise StepNotFoundError(
                        f"no committed step {wanted} in {self.root} (steps: {sorted(committed)})"
                    )
                state.loading[resolved] += 1
                return resolved

        resolved = self._shared("resolve", on_primary)
        if not self._primary:
            with state.cond:
                # the primary saw the commit; this process's watcher may lag a moment behind
                state.cond.wait_for(lambda: resolved not in state.in_flight, self._timeout)
                state.loading[resolved] += 1
        return resolved

    def _release(self, step: int) -> None:
        state = self._state
        with state.cond:
            state.loading[step] -= 1
            if state.loading[step] <= 0:
                del state.loading[step]
            state.cond.notify_all()  # close() waits for the loads in flight
            if state.gc_deferred and not state.loading and not self._closed:
                # retention spared a step for this load; finish the job in the background
                state.gc_deferred = False
                self._retention.request()

    def load(
        self,
        step: int | None = None,
        abstract_state: Any = None,
        *,
        partial: bool = False,
        data_iter: Any = None,
    ) -> Any:
        """Load the tree saved by :meth:`save` at ``step`` (default: the latest committed).

        ``abstract_state`` gives the structure and target shardings (see ``milepost.load``).
        ``data_iter``: the iterator to restore, in place, to the position saved with the step
        by ``save(..., data_iter=)``; it then yields what the saved run would have yielded."""
        self._state.raise_failure()
        s = self._protect(step)
        try:
            return self._read(self._where(s), abstract_state, partial, data_iter)
        finally:
            self._release(s)

    def _read(self, where: StoragePath, abstract_state: Any, partial: bool, data_iter: Any) -> Any:
        if data_iter is None:
            return _api.load(where, abstract_state, partial=partial)
        parts = _api.load_checkpointables(
            where, {STATE: abstract_state, DATA_ITER: data_iter}, partial=partial
        )
        return parts[STATE]

    def load_checkpointables(
        self,
        step: int | None = None,
        checkpointables: Mapping[str, Any] | None = None,
        *,
        partial: bool = False,
    ) -> dict[str, Any]:
        """Load the named checkpointables of ``step`` (default: the latest; all when None)."""
        self._state.raise_failure()
        s = self._protect(step)
        try:
            return _api.load_checkpointables(self._where(s), checkpointables, partial=partial)
        finally:
            self._release(s)

    def load_async(
        self,
        step: int | None = None,
        abstract_state: Any = None,
        *,
        partial: bool = False,
        data_iter: Any = None,
    ) -> LoadHandle[Any]:
        """Like :meth:`load`, but returns a :class:`~milepost.LoadHandle` at once and reads in
        the background (see ``milepost.load_async``): compile while the step is read, then
        ``handle.result()``.

        The step is chosen now (``StepNotFoundError`` is raised here), and retention keeps it
        until the load ends, failed or not. ``data_iter`` is restored in place when the load
        ends: use it after ``result()``. :meth:`close` waits for the loads in flight (at most
        ``timeout_secs``). With several controller processes, call it in every process in the
        same order, as every method.

        >>> handle = ckpt.load_async(abstract_state=abstract_state)
        >>> step_fn = jax.jit(train_step).lower(abstract_state, batch).compile()
        >>> state = handle.result()
        """
        self._state.raise_failure()
        s = self._protect(step)
        where = self._where(s)

        def read() -> Any:
            try:
                return self._read(where, abstract_state, partial, data_iter)
            finally:
                self._release(s)

        try:
            return _checkpoint.start_load(where, read)
        except BaseException:
            self._release(s)  # it never started
            raise

    def metadata(self, step: int | None = None) -> CheckpointMetadata:
        """Shapes, dtypes, shardings, metrics and custom metadata of ``step`` (default: the
        latest), without reading array data."""
        self._state.raise_failure()
        s = self._protect(step)
        try:
            return _api.metadata(self._where(s))
        finally:
            self._release(s)

    # -- lifecycle ----------------------------------------------------------------------
    def wait(self) -> None:
        """Wait for every save in flight, every mirror and retention; re-raise a background
        failure."""
        state = self._state
        with state.cond:
            state.wait_while(
                lambda: bool(state.in_flight or state.gc_active or state.mirrors),
                lambda: (
                    f"the saves of steps {sorted(state.in_flight)} (mirrors of "
                    f"{sorted(state.mirrors)}) in {self.root} did not finish within "
                    f"{self._timeout}s"
                ),
                self._timeout + (self._mirror_timeout if state.mirrors else 0.0),
            )
        state.raise_failure()
        if self._peers is not None:
            self._peers.finish()

    # -- recovery -----------------------------------------------------------------------
    def recover(self, lost: Slice | None = None, *, abstract_state: Any = None) -> Recovery:
        """The newest step recoverable on every shard, from node memory (the peer tier) when it
        holds one, else from the local tier or the root (``Recovery.tier`` says which).

        On a slice, after a host or node of ``lost`` died: a new slice of its topology
        (:meth:`Slice.recover`) holding that step (``Recovery.slice``); saves in flight on the
        lost slice are abandoned (nothing of theirs is committed). Without ``lost``, the
        newest step every part of which the node folders hold, restored onto the hosts of
        ``abstract_state`` (the tree to restore, as for :meth:`load`): in a multi-controller job
        restarted with a node replaced (or one process restarted), call it in every process; a
        restarted controller (its slice's hosts ended with it, the nodes live on) starts a new
        slice over the nodes and passes a tree of ``AbstractArray``s on it.

        >>> try:
        ...     state = s.run(train_step, state); ckpt.save(step, state)
        ... except mp.HostError:
        ...     r = ckpt.recover(s); s, state, step = r.slice, r.state, r.step
        """
        self._check_writable("recover")
        if self._peers is None:
            raise ValueError(
                "this Checkpointer keeps no peer tier to recover from; open it with "
                "peers=PeerTier(...), or start a new slice and load(step, abstract_state)"
            )
        self._peers.check(lost, abstract_state)
        try:
            self.wait()
        except Exception as e:  # the lost slice's saves: abandoned
            log.warning("recovery: a save on the lost slice failed: %s: %s", type(e).__name__, e)
        return self._peers.recover(lost, abstract_state, self._from_storage, self.latest)

    def _from_storage(self, abstract: Any) -> tuple[int, Any, str, int]:
        """The newest committed step, loaded as ``abstract`` (a recovery's fallback)."""
        step = self.latest
        if step is None or abstract is None:
            raise FileNotFoundError(
                f"nothing to recover: no step is complete in node memory, and {self.root} "
                "holds no committed step; start training again from its initial state"
            )
        state = self.load(step, abstract)
        tier = "local" if step in self._state.local else "durable"
        nbytes = sum(
            x.nbytes for x in _checkpoint.all_leaves({STATE: state}) if hasattr(x, "nbytes")
        )
        return step, state, tier, nbytes

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(
                f"the Checkpointer for {self.root} is closed; open a new one to save"
            )

    def _check_writable(self, doing: str) -> None:
        self._check_open()
        if self.read_only:
            raise PermissionError(
                f"this Checkpointer of {self.root} is read-only, so it cannot {doing}; open one "
                "with read_only=False"
            )

    def close(self) -> None:
        """Wait for loads and saves in flight and retention (re-raising a save's failure), stop
        the mirror and retention threads and restore the signal handlers."""
        if self._closed:
            return
        try:
            self._wait_for_loads()
            self.wait()
        finally:
            self._closed = True
            if self._mirror is not None:
                self._mirror.stop(self._timeout)
            self._retention.stop(self._timeout)
            self._preemption.close()
            if self._peers is not None:
                self._peers.close()

    def _wait_for_loads(self) -> None:
        """Wait (at most ``timeout_secs``) until no load of a step is in flight: a load's end
        may hand retention the steps it spared."""
        state = self._state
        with state.cond:
            state.wait_while(
                lambda: bool(state.loading),
                lambda: (
                    f"the loads of steps {sorted(state.loading)} from {self.root} did not "
                    f"finish within {self._timeout}s"
                ),
            )

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

    # -- views --------------------------------------------------------------------------
    def _table(self) -> tuple[str, tuple[str, ...], list[tuple[Any, ...]]]:
        rows = self._state.rows()
        names = sorted({k for r in rows for k in r["metrics"]})
        columns = ("step", "tier", "state", *names)
        table = [
            (
                r["step"],
                r["tier"],
                r["state"],
                *(_views.metric_cell(r["metrics"].get(k)) for k in names),
            )
            for r in rows
        ]
        where = repr(str(self.root)) + (
            f", local={str(self.local)!r}" if self.local is not None else ""
        )
        mode = ", read_only=True" if self.read_only else ""
        title = (
            f"Checkpointer({where}{mode}): {len(rows)} step{'' if len(rows) == 1 else 's'}, "
            f"latest {self.latest}; save_policy={self.save_policy!r}, keep={self.keep!r}"
            + (f", local_keep={self.local_keep!r}" if self.local is not None else "")
            + (", preempted" if self._preempted else "")
            + (", closed" if self._closed else "")
        )
        return title, columns, table

    def __repr__(self) -> str:
        title, columns, rows = self._table()
        if not rows:
            return f"{title}"
        shown = rows[-_views.MAX_ROWS :]
        text = title + ("" if len(shown) == len(rows) else f" (the last {len(shown)} shown)")
        return text + "\n" + _views.text_table(columns, shown)

    def _repr_html_(self) -> str:
        title, columns, rows = self._table()
        return _views.html_table(columns, rows, title=title)


def _commit_time(step: StoragePath) -> int:
    """The commit time the committed ``step``'s metadata records (nanoseconds since the epoch);
    where it cannot be read (a local tier of another host), this process's clock now, a moment
    after the commit."""
    try:
        meta = fmt.read_json(step / fmt.CHECKPOINT_METADATA, "checkpoint metadata", user_data=True)
        stamp = meta.get("commit_timestamp_nsecs") if isinstance(meta, dict) else None
    except (OSError, ValueError) as e:
        log.debug("the commit time of %s is not readable (%s); using the clock", step, e)
        stamp = None
    if isinstance(stamp, int) and not isinstance(stamp, bool):
        return stamp
    return time.time_ns()


def _drop_in_tiers(tiers: list[Any], step: int, name: str) -> None:
    """Delete the checkpointable ``name`` of ``step`` in each tier in turn; a failure after the
    first tier says what was deleted already and how to finish."""
    for k, tier in enumerate(tiers):
        try:
            _checkpoint.drop_checkpointable(tier.step(step), name)
        except Exception as e:
            if k:
                e.add_note(
                    f"The checkpointable {name!r} of step {step} was already deleted from "
                    f"{tiers[0].path}: finish with "
                    f"milepost.delete_checkpointable({str(tier.step(step))!r}, {name!r})."
                )
            raise
