"""A Checkpointer's save path: deciding whether a step is saved, starting its save, and
recording how it ended.

A save reserves its step in ``state.in_flight`` (waiting while ``max_in_flight`` saves run),
starts ``milepost.save_checkpointables_async`` into the local tier (else the root), and returns;
the save's done-callback (:meth:`Saves.finish`, on the thread that finished it) records the
commit, or the failure for the next call to raise, and asks for the mirror and retention."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from milepost import _api, _checkpoint, _hosts
from milepost._errors import SaveCancelledError
from milepost.colocated import HostGroup
from milepost.training._collective import Collective
from milepost.training._errors import BackgroundSaveError, StepExistsError
from milepost.training._mirror import Mirror
from milepost.training._options import CheckpointerOptions
from milepost.training._policies import SaveContext
from milepost.training._preemption import PreemptionWatch
from milepost.training._retention import Retention
from milepost.training._state import Metrics
from milepost.training._tiers import Tiers
from milepost.workers import StoragePath
from milepost.workers import format as fmt

log = logging.getLogger("milepost.training")

STATE = "state"
"""The checkpointable ``save`` writes the training state as."""
DATA_ITER = "data_iter"
"""The checkpointable ``save(..., data_iter=)`` writes the data iterator's position as."""


class Saves:
    """The saves of one Checkpointer: its save policy's decisions, and the saves in flight
    (in ``tiers.state``)."""

    def __init__(
        self,
        tiers: Tiers,
        mirror: Mirror | None,
        retention: Retention,
        preemption: PreemptionWatch,
        options: CheckpointerOptions,
        shared: Collective,
    ) -> None:
        self.tiers = tiers
        self.state = tiers.state
        self.mirror = mirror
        self.retention = retention
        self.preemption = preemption
        self.policy = options.save_policy
        self.max_in_flight = options.max_in_flight
        self.shared = shared
        self.root = tiers.durable.path
        self.last_save_start: float | None = None
        self.decision: tuple[int, bool, int] | None = None
        """(step, answer, requests seen) of the last should_save, reused by a save of that
        step."""
        self.preempted = False
        """Whether a ``should_save`` saw a preemption request (and the policy said save)."""

    # -- deciding -----------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """The primary's answer for ``step`` (the same again for the same step); a preemption
        seen makes :attr:`preempted` True."""
        state = self.state
        state.raise_failure()
        with state.cond:
            if self.decision is not None and self.decision[0] == step:
                return self.decision[1]
            seen = self.preemption.seen
            known = state.committed() | set(state.in_flight)
            ctx = SaveContext(
                step=step,
                latest_step=max(known) if known else None,
                last_save_start=self.last_save_start,
                save_in_flight=bool(state.in_flight),
                now=time.monotonic(),
                preempted=seen > self.preemption.served,
            )
        if self.preemption.reached_sync_point(step):  # collective: every process, every step
            ctx = replace(ctx, preempted=True)

        def decide() -> tuple[bool, bool]:
            return bool(self.policy.should_save(ctx)), ctx.preempted

        answer, preempted = self.shared("should-save", decide)
        with state.cond:
            self.decision = (step, answer, seen)
            if preempted and answer:
                self.preempted = True
        if preempted and answer:
            log.warning(
                "preempted: saving step %s, after which training should stop (ckpt.preempted "
                "is True)",
                step,
            )
        elif not answer:
            log.debug("skipped step %s: the save policy %r does not ask for it", step, self.policy)
        return answer

    # -- starting -----------------------------------------------------------------------
    def start(
        self,
        step: int,
        checkpointables: Mapping[str, Any],
        metrics: Metrics,
        custom_metadata: Mapping[str, Any] | None,
        force: bool,
    ) -> None:
        """Reserve ``step`` (waiting for room), start its save, and have :meth:`finish` called
        when it ends; returns once the arrays are copied to host memory."""
        state = self.state
        served = self.reserve(step, force)
        try:
            target = self.tiers.target(step)
            group = _hosts.host_group_for(_checkpoint.all_leaves(checkpointables))
            handle = _api.save_checkpointables_async(
                target, checkpointables, custom_metadata=custom_metadata, metrics=metrics
            )
        except BaseException:
            with state.cond:
                del state.in_flight[step]
                state.cond.notify_all()
            raise
        log.debug("saving step %s to %s", step, target)
        with state.cond:
            self.preemption.served = max(self.preemption.served, served)
            state.in_flight[step] = handle
        handle.add_done_callback(lambda h: self.finish(step, h, metrics, group))

    def reserve(self, step: int, force: bool) -> int:
        """Wait until fewer than ``max_in_flight`` saves run, then hold ``step`` in flight;
        returns the preemption requests this save serves."""
        state = self.state
        with state.cond:
            self.check_free(step)
            state.wait_while(
                lambda: len(state.in_flight) >= self.max_in_flight,
                lambda: (
                    f"the saves of steps {sorted(state.in_flight)} did not finish within "
                    f"{state.timeout}s, so step {step} was not saved"
                ),
            )
            state.raise_failure()  # the save we waited for may have failed
            self.check_free(step)
            state.in_flight[step] = None  # reserved
            decided = self.decision
            served = (
                decided[2]
                if (not force and decided is not None and decided[0] == step)
                else self.preemption.seen
            )
            self.decision = None
            self.last_save_start = time.monotonic()
        return served

    def check_free(self, step: int) -> None:
        """StepExistsError if ``step`` is being saved or committed (hold ``state.cond``)."""
        if step in self.state.in_flight:
            raise StepExistsError(
                f"a save of step {step} is already in flight in {self.root}; wait() for it, or "
                "save another step"
            )
        if step in self.state.committed():
            raise StepExistsError(
                f"step {step} already has a committed checkpoint at {self.tiers.where(step)}; "
                "delete(step) it first, or save another step"
            )

    def cancel(self, step: int | None) -> list[int]:
        """Cancel the saves in flight (``step``: only its) whose commit has not begun; the
        steps cancelled, in order (on the primary)."""
        state = self.state
        with state.cond:
            handles = [
                (s, h)
                for s, h in sorted(state.in_flight.items())
                if h is not None and (step is None or s == step)
            ]
        return [s for s, h in handles if h.cancel()]

    # -- finishing ----------------------------------------------------------------------
    def finish(
        self, step: int, handle: _checkpoint.SaveHandle, metrics: Metrics, group: HostGroup
    ) -> None:
        """The save of ``step`` ended (on the thread that finished it): record the step, or the
        failure for the next call to raise, and ask for retention (and its mirror)."""
        state = self.state
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
        if self.tiers.fast is not None:
            log.info(
                "saved step %s to %s%s; mirroring it to %s",
                step,
                self.tiers.fast.path,
                shown,
                self.root,
            )
        else:
            log.info("saved step %s to %s%s", step, self.root, shown)
        self.record(step, metrics, group, commit_time(where))

    def record(self, step: int, metrics: Metrics, group: HostGroup, committed_ns: int) -> None:
        """``step`` committed: in one change, listed, its mirror and retention asked for."""
        state = self.state
        with state.cond:
            state.times[step] = committed_ns
            if self.mirror is not None:
                state.local[step] = metrics
                self.mirror.request(step, group)
            else:
                state.durable[step] = metrics
            state.in_flight.pop(step, None)
            self.retention.request()
            state.cond.notify_all()


def commit_time(step: StoragePath) -> int:
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
