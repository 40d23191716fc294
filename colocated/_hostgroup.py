"""Host groups: how a controller's plans reach the hosts that own the devices.

The controller builds one plan per host process and hands the whole mapping to its host group;
the group runs each plan where the data lives (here, in this process) and returns small acks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import milepost.workers as workers


@runtime_checkable
class PendingHostSave(Protocol):
    def wait(self, timeout: float | None = None) -> list[workers.SaveAck]:
        """Block until every host has made its writes durable; raise naming a host that failed."""
        ...


@runtime_checkable
class HostGroup(Protocol):
    """What the controller needs from a set of hosts."""

    name: str

    def process_of_device(self, device_id: int) -> int:
        """The host process that owns global device ``device_id``."""
        ...

    def processes(self) -> Sequence[int]:
        """Every host process index, in order."""
        ...

    def is_primary(self) -> bool:
        """Whether this controller process writes metadata and commits (False only for the
        non-primary processes of a multi-controller job)."""
        ...

    def start_save(self, plans: Mapping[int, workers.SavePlan], sources: Sequence[Any], timeout: float) -> PendingHostSave:
        """Stage on every host (blocking: returns once every host acknowledged its D2H copy)."""
        ...

    def load(self, plans: Mapping[int, workers.LoadPlan], timeout: float) -> list[Any]:
        """Read and place on every host; return the controller's view of each task's array."""
        ...

    def check_devices(self, spec: workers.ShardingSpec, name: str) -> None:
        """Raise ValueError naming leaf ``name`` if ``spec`` uses devices this group lacks."""
        ...

    def barrier(self, name: str, timeout: float) -> None:
        """Wait until every controller process arrived (a no-op with a single controller)."""
        ...

    def broadcast(self, name: str, value: Any, timeout: float) -> Any:
        """The primary's ``value`` on every controller process (identity with one controller)."""
        ...


class _LocalPending:
    def __init__(self, pending: workers.PendingSave) -> None:
        self._pending = pending

    def wait(self, timeout: float | None = None) -> list[workers.SaveAck]:
        return [self._pending.wait(timeout)]

    def settle(self, timeout: float | None = None) -> None:
        """After a failure elsewhere: wait for these writes to land, ignoring their outcome."""
        self._pending.settle(timeout)


class LocalHostGroup:
    """The embedded default: this process is the controller and the only host."""

    name = "local"

    def __init__(self, process_index: int = 0) -> None:
        self._process_index = process_index

    def process_of_device(self, device_id: int) -> int:
        return self._process_index

    def processes(self) -> Sequence[int]:
        return (self._process_index,)

    def is_primary(self) -> bool:
        return True

    def start_save(self, plans: Mapping[int, workers.SavePlan], sources: Sequence[Any], timeout: float) -> _LocalPending:
        (plan,) = plans.values()
        return _LocalPending(workers.start_save(plan, sources))

    def load(self, plans: Mapping[int, workers.LoadPlan], timeout: float) -> list[Any]:
        (plan,) = plans.values()
        return workers.load(plan)

    def check_devices(self, spec: workers.ShardingSpec, name: str) -> None:
        try:
            spec.to_jax()
        except ValueError as e:
            raise ValueError(f"cannot load {name!r} with its saved sharding: {e}") from None

    def barrier(self, name: str, timeout: float) -> None:
        return None

    def broadcast(self, name: str, value: Any, timeout: float) -> Any:
        return value
