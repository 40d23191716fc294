"""Host groups: how a controller's plans reach the hosts that own the devices.

The controller builds one plan per host process and hands the whole mapping to its host group;
the group runs each plan where the data lives and returns small acks. Three groups implement
:class:`HostGroup`: :class:`LocalHostGroup` (this process; the embedded default, and the
controller's own NumPy leaves in every mode), ``RayHostGroup`` (a slice's actors) and
``MultiControllerHostGroup`` (every process of a ``jax.distributed`` job).

A save, in the order the controller calls a group (after ``start_save`` returns, the caller's
arrays are free; until ``wait`` or ``settle`` returns, a host may still write):

1. ``start_save(plans, sources, timeout)`` -> a :class:`~milepost.workers.PendingWrite`;
2. ``pending.wait(timeout)`` -> every host's :class:`~milepost.workers.SaveAck`, or an error
   naming a host, raised only after this group's writes settled;
3. after a failure elsewhere, ``pending.settle(timeout)`` before the temporary directory goes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

import milepost.workers as workers

PendingHostSave = workers.PendingWrite[list[workers.SaveAck]]
"""The hosts' writes of one save; ``wait`` returns every host's ack (on the primary)."""


@dataclass(frozen=True)
class HostLoad:
    """What a group's ``load`` returns: the controller's view of each task's array, and the
    hosts' acks (every host's on the primary; in other controller processes their own)."""

    arrays: list[Any]
    """The controller's view of each task's array, in the plans' order."""
    acks: list[workers.LoadAck]
    """The hosts' acks: what each read."""


class DevicesHere(NamedTuple):
    """A group's devices, for placing a checkpoint's saved shardings on them."""

    ids: tuple[int, ...]
    """Every device id, in the order the group lays a mesh over them (``jax.devices()``'s; a
    slice's host by host)."""
    memory_kinds: frozenset[str] | None
    """The memory kinds the devices offer (None: not known to the controller)."""
    where: str
    """The group in words for a log line: 'this runtime', 'this slice'."""


@runtime_checkable
class HostGroup(Protocol):
    """What the controller needs from a set of hosts."""

    name: str
    """A short name for logs and messages (``local``, ``slice``, ``mcjax``)."""

    def process_of_device(self, device_id: int) -> int:
        """The host process that owns global device ``device_id``."""
        ...

    def processes(self) -> Sequence[int | str]:
        """Every host process index, in order (``"controller"`` for the controller's own leaves)."""
        ...

    def is_primary(self) -> bool:
        """Whether this controller process writes metadata and commits (False only for the
        non-primary processes of a multi-controller job)."""
        ...

    def start_save(
        self, plans: Mapping[Any, workers.SavePlan], sources: Sequence[Any], timeout: float
    ) -> PendingHostSave:
        """Stage on every host (blocking: returns once every host acknowledged its D2H copy)."""
        ...

    def load(self, plans: Mapping[Any, workers.LoadPlan], timeout: float) -> HostLoad:
        """Read and place on every host."""
        ...

    def run(self, job: str, plans: Mapping[Any, Any], timeout: float) -> list[Any]:
        """Run the host job ``job`` (``milepost.workers.JOBS``: verify, export...) with each
        host's plan; every host's ack, in host order (on the primary)."""
        ...

    def check_devices(self, spec: workers.ShardingSpec, name: str) -> None:
        """Raise ValueError naming leaf ``name`` if ``spec`` uses devices this group lacks."""
        ...

    def mesh_device_ids(
        self, axis_names: tuple[str, ...], axis_sizes: tuple[int, ...]
    ) -> tuple[int, ...]:
        """Device ids, in row-major mesh order, of a concrete mesh of these axes (for abstract
        trees whose shardings are on an ``AbstractMesh``); ValueError saying how to give one."""
        ...

    def devices_here(self) -> DevicesHere:
        """The group's devices (a load without an abstract tree places saved shardings on
        them when the saved devices are not all here)."""
        ...

    def barrier(self, name: str, timeout: float) -> None:
        """Wait until every controller process arrived (a no-op with a single controller)."""
        ...

    def broadcast(self, name: str, value: Any, timeout: float) -> Any:
        """The primary's ``value`` on every controller process (identity with one controller)."""
        ...


class _LocalPending:
    """This process's writes, as a group's pending save."""

    def __init__(self, pending: workers.PendingSave) -> None:
        self._pending = pending

    def wait(self, timeout: float | None = None) -> list[workers.SaveAck]:
        return [self._pending.wait(timeout)]

    def settle(self, timeout: float | None = None) -> None:
        self._pending.settle(timeout)


class JaxDevices:
    """The devices of this process's JAX runtime, for groups whose controller has them (in
    one process, and in each process of a multi-controller job)."""

    def check_devices(self, spec: workers.ShardingSpec, name: str) -> None:
        try:
            spec.to_jax()
        except ValueError as e:
            raise ValueError(f"cannot load {name!r} with its saved sharding: {e}") from None

    def mesh_device_ids(
        self, axis_names: tuple[str, ...], axis_sizes: tuple[int, ...]
    ) -> tuple[int, ...]:
        return jax_mesh_device_ids(axis_names, axis_sizes)

    def devices_here(self) -> DevicesHere:
        import jax

        ids = tuple(int(d.id) for d in jax.devices())
        try:  # (every process's devices are alike: this process's first one answers)
            memories = jax.local_devices()[0].addressable_memories()
        except (AttributeError, NotImplementedError, RuntimeError):
            return DevicesHere(ids, None, "this runtime")
        return DevicesHere(ids, frozenset(str(m.kind) for m in memories), "this runtime")


class LocalHostGroup(JaxDevices):
    """This process is the only host: the embedded default (``process_index`` 0, or this
    process's index), and the controller's own leaves (``process_index="controller"``)."""

    name = "local"
    """``local``."""

    def __init__(self, process_index: int | str = 0) -> None:
        self._process_index = process_index

    def process_of_device(self, device_id: int) -> int:
        """This process (every device is its own); ValueError for the controller's group, which
        holds none."""
        if not isinstance(self._process_index, int):
            raise ValueError(f"the {self._process_index} host group holds no devices")
        return self._process_index

    def processes(self) -> Sequence[int | str]:
        """This process alone."""
        return (self._process_index,)

    def is_primary(self) -> bool:
        """Always true: this process is the only one."""
        return True

    def start_save(
        self, plans: Mapping[Any, workers.SavePlan], sources: Sequence[Any], timeout: float
    ) -> PendingHostSave:
        """Start the one plan's writes in this process."""
        (plan,) = plans.values()
        return _LocalPending(workers.start_save(plan, sources))

    def load(self, plans: Mapping[Any, workers.LoadPlan], timeout: float) -> HostLoad:
        """Run the one plan's reads in this process."""
        (plan,) = plans.values()
        arrays, ack = workers.load(plan, self._process_index)
        return HostLoad(arrays, [ack])

    def run(self, job: str, plans: Mapping[Any, Any], timeout: float) -> list[Any]:
        """Run the job's plans in this process, in order."""
        return [workers.run_job(job, plan, self._process_index) for plan in plans.values()]

    def barrier(self, name: str, timeout: float) -> None:
        """Nothing to wait for: one process."""
        return None

    def broadcast(self, name: str, value: Any, timeout: float) -> Any:
        """``value`` itself: one process."""
        return value

    def __repr__(self) -> str:
        return f"LocalHostGroup(process_index={self._process_index!r})"


def jax_mesh_device_ids(
    axis_names: tuple[str, ...], axis_sizes: tuple[int, ...]
) -> tuple[int, ...]:
    """This JAX runtime's concrete mesh of these axes: the one set with ``jax.set_mesh`` if it
    matches, else ``jax.make_mesh`` over every device when the sizes cover them exactly."""
    import math

    import jax

    wanted = dict(zip(axis_names, axis_sizes, strict=True))
    current = jax.sharding.get_mesh()
    if (
        not current.empty
        and dict(current.shape) == wanted
        and tuple(current.axis_names) == tuple(axis_names)
    ):
        return tuple(int(d.id) for d in current.devices.flat)
    if math.prod(axis_sizes) == jax.device_count():
        return tuple(
            int(d.id) for d in jax.make_mesh(tuple(axis_sizes), tuple(axis_names)).devices.flat
        )
    raise ValueError(
        f"the sharding is on an AbstractMesh {wanted} (as jax.eval_shape and "
        "nnx.eval_shape give), and no concrete mesh of those axes is at hand: "
        f"this runtime has {jax.device_count()} devices"
        + (
            f" and the mesh set with jax.set_mesh is {dict(current.shape)}"
            if not current.empty
            else ""
        )
        + ". Load inside `with jax.set_mesh(mesh):` with your mesh, or give the "
        "abstract tree NamedShardings over a concrete mesh"
    )
