"""A Checkpointer's load path: choosing the step a load reads (the primary resolves it, every
process gets the same), keeping retention away from it while it is read, and reading it.

A load counts in ``state.loading`` from the moment its step is chosen until it ends, failed or
not; retention spares such a step and runs again once no load is in flight."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from milepost import _api, _checkpoint
from milepost._checkpoint import LoadHandle
from milepost.training._collective import Collective
from milepost.training._errors import StepBusyError, StepNotFoundError
from milepost.training._retention import Retention
from milepost.training._saving import DATA_ITER, STATE
from milepost.training._state import check_step
from milepost.training._tiers import Tiers
from milepost.workers import StoragePath

T = TypeVar("T")


def read_state(where: StoragePath, abstract_state: Any, partial: bool, data_iter: Any) -> Any:
    """The tree ``save`` wrote at ``where`` (restoring ``data_iter`` in place when given)."""
    if data_iter is None:
        return _api.load(where, abstract_state, partial=partial)
    parts = _api.load_checkpointables(
        where, {STATE: abstract_state, DATA_ITER: data_iter}, partial=partial
    )
    return parts[STATE]


class Loads:
    """The loads of one Checkpointer (``closed()``: whether it is closed, when a load ends)."""

    def __init__(
        self,
        tiers: Tiers,
        retention: Retention,
        shared: Collective,
        closed: Callable[[], bool],
    ) -> None:
        self.tiers = tiers
        self.state = tiers.state
        self.retention = retention
        self.shared = shared
        self.closed = closed
        self.root = tiers.durable.path

    def read(self, step: int | None, fn: Callable[[StoragePath], T]) -> T:
        """``fn(where step is)``, ``step`` (None: the latest) kept from retention meanwhile."""
        self.state.raise_failure()
        s = self.protect(step)
        try:
            return fn(self.tiers.where(s))
        finally:
            self.release(s)

    def start(
        self, step: int | None, abstract_state: Any, partial: bool, data_iter: Any
    ) -> LoadHandle[Any]:
        """Choose the step now, read it in the background; it is released when the read
        ends (or now, if the read never starts)."""
        self.state.raise_failure()
        s = self.protect(step)
        where = self.tiers.where(s)

        def read() -> Any:
            try:
                return read_state(where, abstract_state, partial, data_iter)
            finally:
                self.release(s)

        try:
            return _checkpoint.start_load(where, read)
        except BaseException:
            self.release(s)  # it never started
            raise

    def protect(self, step: int | None) -> int:
        """Resolve ``step`` (None: the latest) on the primary and keep retention away from it
        until :meth:`release`."""
        wanted = None if step is None else check_step(step)
        state = self.state

        def on_primary() -> int:
            with state.cond:
                resolved = self.resolve(wanted)
                state.loading[resolved] += 1
                return resolved

        resolved = self.shared("resolve", on_primary)
        if not self.shared.primary:
            with state.cond:
                # the primary saw the commit; this process's watcher may lag a moment behind
                state.cond.wait_for(lambda: resolved not in state.in_flight, state.timeout)
                state.loading[resolved] += 1
        return resolved

    def resolve(self, wanted: int | None) -> int:
        """The committed step a load of ``wanted`` (None: the latest) reads, once no
        checkpointable of it is being deleted (hold ``state.cond``)."""
        state = self.state

        def free() -> bool:  # not having a checkpointable deleted (None: the latest)
            committed = state.committed()
            step = wanted if wanted is not None else max(committed, default=None)
            return step not in state.changing

        if not state.cond.wait_for(free, state.timeout):
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
            return max(committed)
        if wanted in committed:
            return wanted
        if wanted in state.in_flight:
            raise StepNotFoundError(
                f"step {wanted} is still being saved; wait() for it before loading it"
            )
        raise StepNotFoundError(
            f"no committed step {wanted} in {self.root} (steps: {sorted(committed)})"
        )

    def release(self, step: int) -> None:
        """The load of ``step`` ended: retention may delete it again."""
        state = self.state
        with state.cond:
            state.loading[step] -= 1
            if state.loading[step] <= 0:
                del state.loading[step]
            state.cond.notify_all()  # close() waits for the loads in flight
            if state.gc_deferred and not state.loading and not self.closed():
                # retention spared a step for this load; finish the job in the background
                state.gc_deferred = False
                self.retention.request()

    def wait_for_none(self) -> None:
        """Wait (at most ``timeout_secs``) until no load of a step is in flight: a load's end
        may hand retention the steps it spared."""
        state = self.state
        with state.cond:
            state.wait_while(
                lambda: bool(state.loading),
                lambda: (
                    f"the loads of steps {sorted(state.loading)} from {self.root} did not "
                    f"finish within {state.timeout}s"
                ),
            )

    def from_storage(self, abstract: Any) -> tuple[int, Any, str, int]:
        """The newest committed step, loaded as ``abstract`` (a recovery's fallback)."""
        with self.state.cond:
            step = max(self.state.committed(), default=None)
        if step is None or abstract is None:
            raise FileNotFoundError(
                f"nothing to recover: no step is complete in node memory, and {self.root} "
                "holds no committed step; start training again from its initial state"
            )
        state = self.read(step, lambda where: read_state(where, abstract, False, None))
        tier = "local" if step in self.state.local else "durable"
        nbytes = sum(
            x.nbytes for x in _checkpoint.all_leaves({STATE: state}) if hasattr(x, "nbytes")
        )
        return step, state, tier, nbytes
