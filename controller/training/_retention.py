"""Retention: after each commit (and mirror), delete the steps the policies let go, on a
background thread of its own. Never the latest step, a step being saved, loaded or mirrored, or
the only copy of a step that is still to reach the durable root."""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Mapping
from typing import Any

from milepost.training._policies import RetentionPolicy, StepInfo, keep_best_in
from milepost.training._state import StepState
from milepost.training._tier import Tier
from milepost.training._worker import Worker

log = logging.getLogger("milepost.training")


EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)


def utc_time(nsecs: int) -> datetime.datetime:
    """Nanoseconds since the epoch as a UTC datetime (to the microsecond, truncated)."""
    return EPOCH + datetime.timedelta(microseconds=nsecs // 1000)


def step_infos(steps: Mapping[int, Any], times: Mapping[int, int]) -> list[StepInfo]:
    """``steps`` (step -> metrics) as a policy sees them, oldest first, with their commit
    times (``times``: step -> nanoseconds since the epoch)."""
    return [
        StepInfo(step=s, metrics=steps[s], time=utc_time(times[s]) if s in times else None)
        for s in sorted(steps)
    ]


def doomed(
    policy: RetentionPolicy,
    steps: Mapping[int, Any],
    spared: set[int],
    times: Mapping[int, int] | None = None,
) -> list[int]:
    """The steps ``policy`` lets go, but the latest and ``spared``."""
    infos = step_infos(steps, times or {})
    if not infos:
        return []
    wanted = set(policy.keep(infos))
    return [
        i.step
        for i in infos
        if i.step not in wanted and i.step != infos[-1].step and i.step not in spared
    ]


def best_step(
    keep: RetentionPolicy, local_keep: RetentionPolicy, state: StepState, root: Any
) -> int | None:
    """The best committed step by the first :class:`KeepBest` in ``keep``, else in
    ``local_keep`` (None when no step has a score); ValueError when neither has one."""
    policy = keep_best_in(keep) or keep_best_in(local_keep)
    if policy is None:
        raise ValueError(
            f"best_step() ranks steps by the Checkpointer's KeepBest, and {root} is "
            f"open with keep={keep!r}: open it with keep=KeepBest(n=..., metric=...) "
            "(or KeepUnion(..., KeepBest(...)))"
        )
    with state.cond:
        metrics = {**state.local, **state.durable}
        times = dict(state.times)
    ranked = policy.ranked(step_infos(metrics, times))
    return ranked[0] if ranked else None


class Retention:
    """Applies ``keep`` to the durable tier and ``local_keep`` to the local one. Only the
    primary deletes; every process forgets the same steps."""

    def __init__(
        self,
        state: StepState,
        durable: Tier,
        fast: Tier | None,
        keep: RetentionPolicy,
        local_keep: RetentionPolicy,
        primary: bool,
    ) -> None:
        self.state = state
        self.durable = durable
        self.fast = fast
        self.keep = keep
        self.local_keep = local_keep
        self.primary = primary
        self.lock = threading.Lock()
        """Held while steps are deleted (retention's, or a ``delete`` asked for)."""
        self._worker = Worker(self._run, f"retention:{durable.path.name}")

    def request(self) -> None:
        """Ask for a run (after a commit or a mirror; callers holding ``state.cond`` make it
        part of their change, so that a waiter never sees the step without the run)."""
        with self.state.cond:
            self.state.gc_active += 1
        self._worker.submit()

    def stop(self, timeout: float) -> None:
        self._worker.stop(timeout)

    def _run(self) -> None:
        """One run, on the retention thread (``gc_active`` was raised by whoever asked)."""
        state = self.state
        try:
            with self.lock:
                with state.cond:
                    busy = set(state.in_flight) | set(state.loading) | set(state.mirrors)
                    gone = doomed(self.keep, state.durable, busy, state.times)
                    # The local tier keeps every step not yet durable: rotation must never
                    # delete the only copy that is to reach root.
                    durable = set(state.durable) | (
                        set(state.local) - set(state.mirrors) - state.unmirrored
                    )
                    gone_local = doomed(
                        self.local_keep,
                        state.local,
                        busy | (set(state.local) - durable),
                        state.times,
                    )
                    letting_go = doomed(self.keep, state.durable, set(), state.times) + doomed(
                        self.local_keep, state.local, set(), state.times
                    )
                    state.gc_deferred = any(s in state.loading for s in letting_go)
                    for s in gone:
                        del state.durable[s]
                    for s in gone_local:
                        del state.local[s]
                    for s in set(gone) | set(gone_local):
                        if s not in state.committed():
                            state.times.pop(s, None)
                if not self.primary:
                    return
                for tier, steps in ((self.durable, gone), (self.fast, gone_local)):
                    if tier is None or not steps:
                        continue
                    deleted = tier.delete(steps)
                    if deleted:
                        policy = self.keep if tier is self.durable else self.local_keep
                        log.info("deleted steps %s of %s (retention: %r)", deleted, tier, policy)
        except Exception as e:  # retention must never break training
            log.error("retention in %s failed: %s: %s", self.durable, type(e).__name__, e)
        finally:
            with state.cond:
                state.gc_active -= 1
                state.cond.notify_all()
