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
get its answers through the host group's broadcast (:mod:`._collective`).

The Checkpointer coordinates parts it owns: the tiers (:mod:`._tiers`, each a :mod:`._tier`),
what it knows of their steps (:mod:`._state`), the save path (:mod:`._saving`), the load path
(:mod:`._loading`), the deletions asked for (:mod:`._deleting`), retention (:mod:`._retention`),
the mirror (:mod:`._mirror`), the preemption requests (:mod:`._preemption`), the peer tier
(:mod:`.peers`) and its table (:mod:`._table`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from milepost import _api, _hosts, _options, _views
from milepost._checkpoint import CheckpointMetadata, LoadHandle
from milepost.colocated import Slice
from milepost.training._collective import Collective
from milepost.training._deleting import Deletions
from milepost.training._loading import Loads, read_state
from milepost.training._mirror import Mirror
from milepost.training._options import CheckpointerOptions
from milepost.training._policies import RetentionPolicy, SavePolicy
from milepost.training._preemption import PreemptionWatch
from milepost.training._retention import Retention, best_step
from milepost.training._saving import DATA_ITER, STATE, Saves
from milepost.training._state import StepState, check_step, plain_metrics
from milepost.training._table import table, text
from milepost.training._tier import tier_at
from milepost.training._tiers import Tiers, check_apart, given_naming
from milepost.training.peers import PeerTier, PeerTierRunner, Recovery
from milepost.workers import ObjectPath, StoragePath, as_path

log = logging.getLogger("milepost.training")


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
        check_apart(self.local, self.root)
        context = _options.current()
        """The options in force when the Checkpointer was opened; its background work uses them."""
        self._timeout = float(
            timeout_secs if timeout_secs is not None else context.async_.timeout_secs
        )
        self._mirror_timeout = float(
            mirror_timeout_secs if mirror_timeout_secs is not None else self._timeout
        )
        self._group = _hosts.check_storage(_hosts.host_group_for([]), self.root)
        self._shared = Collective(self._group, self.root, self._timeout)
        self._primary = self._shared.primary
        self._closed = False
        self._make_parts(context)
        self._open()
        self._preemption = PreemptionWatch(self.save_policy)
        self._saves = Saves(
            self._tiers, self._mirror, self._retention, self._preemption, self.options, self._shared
        )

    def _make_parts(self, context: _options.Options) -> None:
        """The parts it owns, each given what it works on: the steps known (``_state``), the
        tiers, retention, the mirror (with a local tier), the peer tier, the loads and the
        deletions. The save path comes last, once the preemption watch exists."""
        lease_secs = context.saving.lease_secs
        state = self._state = StepState(self._timeout)
        tiers = self._tiers = Tiers(
            tier_at(self.root, lease_secs),
            tier_at(self.local, lease_secs) if self.local is not None else None,
            state,
            given_naming(self.options),
            self.read_only,
        )
        retention = Retention(
            state, tiers.durable, tiers.fast, self.keep, self.local_keep, self._primary
        )
        self._retention = retention
        self._mirror = (
            Mirror(state, self.local, self.root, retention, self._mirror_timeout, context)
            if self.local is not None
            else None
        )
        self._peers = (
            PeerTierRunner(self.options.peers, str(self.root), self._timeout)
            if self.options.peers is not None
            else None
        )
        self._loads = Loads(tiers, retention, self._shared, lambda: self._closed)
        self._deletions = Deletions(tiers, retention)

    def _open(self) -> None:
        """Open the tiers (the primary lists them; every process adopts its listing), then mirror
        the steps only in the local tier: a mirror that did not finish before the last run ended.
        The mirror requests come after the listing is adopted (they name steps from it) and only
        once every part (state, retention, mirror) exists."""
        self._tiers.adopt(self._shared("open", self._tiers.open))
        if self._mirror is not None and not self.read_only:
            self._mirror.resume(self._group)

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

    # -- listing ------------------------------------------------------------------------
    def reload(self) -> None:
        """Wait for saves in flight, then list the root again (steps written by another job)."""
        self.wait()
        self._tiers.adopt(self._shared("reload", self._tiers.scan))

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
        return best_step(self.keep, self.local_keep, self._state, self.root)

    def path(self, step: int) -> StoragePath:
        """Where ``step`` is (or would be) stored durably: ``root/<step>`` (or the folder the
        root's step naming gives it, e.g. ``root/checkpoint_000010``)."""
        return self._tiers.durable.step(check_step(step))

    # -- deciding -----------------------------------------------------------------------
    def preempt(self) -> None:
        """Ask a :class:`Preemption` policy for a save at the next ``should_save`` (what its
        signal handler does)."""
        self._preemption.request()

    @property
    def preempted(self) -> bool:
        """True once a ``should_save`` saw a preemption request: save, then stop training.
        Every process gets the same value at the same step."""
        return self._saves.preempted

    def should_save(self, step: int) -> bool:
        """Whether the save policy (or a preemption) asks for a save at ``step``.

        Every process gets the primary's answer, so all save at the same step. Asking twice for
        the same step gives the same answer."""
        return self._saves.should_save(check_step(step))

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
        self._state.raise_failure()
        metrics_ = plain_metrics(metrics)
        kept = self._peers is not None and self._peers.due(step) and STATE in checkpointables
        if kept:
            assert self._peers is not None
            self._peers.save(step, checkpointables[STATE])
        if not force and not self.should_save(step):
            return kept
        self._saves.start(step, checkpointables, metrics_, custom_metadata, force)
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
        cancelled = self._shared("cancel", lambda: self._saves.cancel(step))
        if cancelled and self._primary:
            log.info("cancelled the saves of steps %s in %s", cancelled, self.root)
        return cancelled

    # -- deleting -----------------------------------------------------------------------
    def delete(self, step: int) -> None:
        """Delete the committed ``step`` now (not while it is being saved or loaded)."""
        step = check_step(step)
        self._check_writable("delete steps")
        self._state.raise_failure()
        self._shared(f"delete:{step}", lambda: self._deletions.delete(step))
        if self._primary:
            log.info("deleted step %s of %s (asked)", step, self.root)
        else:
            self._deletions.forget(step)

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
        self._state.raise_failure()
        self._shared(
            f"delete-checkpointable:{step}:{name}",
            lambda: self._deletions.delete_checkpointable(step, name),
        )
        log.info("deleted the checkpointable %r of step %s of %s", name, step, self.root)

    # -- loading ------------------------------------------------------------------------
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
        return self._loads.read(
            step, lambda where: read_state(where, abstract_state, partial, data_iter)
        )

    def load_checkpointables(
        self,
        step: int | None = None,
        checkpointables: Mapping[str, Any] | None = None,
        *,
        partial: bool = False,
    ) -> dict[str, Any]:
        """Load the named checkpointables of ``step`` (default: the latest; all when None)."""
        return self._loads.read(
            step, lambda where: _api.load_checkpointables(where, checkpointables, partial=partial)
        )

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
        return self._loads.start(step, abstract_state, partial, data_iter)

    def metadata(self, step: int | None = None) -> CheckpointMetadata:
        """Shapes, dtypes, shardings, metrics and custom metadata of ``step`` (default: the
        latest), without reading array data."""
        return self._loads.read(step, _api.metadata)

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
        return self._peers.recover(lost, abstract_state, self._loads.from_storage, self.latest)

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
            self._loads.wait_for_none()
            self.wait()
        finally:
            self._closed = True
            if self._mirror is not None:
                self._mirror.stop(self._timeout)
            self._retention.stop(self._timeout)
            self._preemption.close()
            if self._peers is not None:
                self._peers.close()

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
    def __repr__(self) -> str:
        return text(*table(self, self._state.rows(), self._closed))

    def _repr_html_(self) -> str:
        title, columns, rows = table(self, self._state.rows(), self._closed)
        return _views.html_table(columns, rows, title=title)
