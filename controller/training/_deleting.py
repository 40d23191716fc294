"""The deletions a Checkpointer is asked for: a committed step (``delete``), or one
checkpointable of it in every tier that holds it (``delete_checkpointable``).

Both run on the primary under retention's lock (retention deletes nothing meanwhile) and refuse
a step being saved, mirrored or loaded; a load of a step a checkpointable of which is being
deleted waits until that is done (``state.changing``)."""

from __future__ import annotations

from milepost import _checkpoint
from milepost.training._errors import StepBusyError, StepNotFoundError
from milepost.training._retention import Retention
from milepost.training._tier import Tier
from milepost.training._tiers import Tiers


class Deletions:
    """The deletions of one Checkpointer's steps, in its tiers."""

    def __init__(self, tiers: Tiers, retention: Retention) -> None:
        self.tiers = tiers
        self.state = tiers.state
        self.retention = retention
        self.root = tiers.durable.path

    def delete(self, step: int) -> None:
        """Delete the committed ``step`` from every tier (on the primary)."""
        state = self.state
        with self.retention.lock:
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
                        f"no committed step {step} in {self.root} (steps: "
                        f"{sorted(state.committed())})"
                    )
            held = ((state.durable, self.tiers.durable), (state.local, self.tiers.fast))
            for steps, tier in held:
                if tier is not None and step in steps:
                    tier.delete_one(step)
                    with state.cond:
                        steps.pop(step, None)
                        state.unmirrored.discard(step)
            with state.cond:
                state.times.pop(step, None)

    def forget(self, step: int) -> None:
        """The primary deleted ``step``: this process lists it no more."""
        state = self.state
        with state.cond:
            state.durable.pop(step, None)
            state.local.pop(step, None)
            state.times.pop(step, None)

    def delete_checkpointable(self, step: int, name: str) -> None:
        """Delete the checkpointable ``name`` of the committed ``step`` in every tier that
        holds it, the local one first (on the primary)."""
        state = self.state
        with self.retention.lock:  # retention deletes no step meanwhile
            with state.cond:
                self.check_idle(step, "deleting a checkpointable of it")
                held = ((state.local, self.tiers.fast), (state.durable, self.tiers.durable))
                tiers = [t for steps, t in held if t is not None and step in steps]
                state.changing.add(step)  # a load of it waits until this is done
            try:
                drop_in_tiers(tiers, step, name)
            finally:
                with state.cond:
                    state.changing.discard(step)
                    state.cond.notify_all()

    def check_idle(self, step: int, doing: str) -> None:
        """StepBusyError unless the committed ``step`` is free (hold ``state.cond``);
        StepNotFoundError unless it is committed."""
        state = self.state
        if step in state.in_flight or step in state.mirrors:
            raise StepBusyError(f"step {step} is being saved or mirrored; wait() before {doing}")
        if state.loading[step]:
            raise StepBusyError(f"step {step} is being loaded; try {doing} after the load returns")
        if step not in state.committed():
            raise StepNotFoundError(
                f"no committed step {step} in {self.root} (steps: {sorted(state.committed())})"
            )


def drop_in_tiers(tiers: list[Tier], step: int, name: str) -> None:
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
