"""How a slice's host actors are made: the Ray actor class with its concurrency groups, the
environment a host process starts with, and a host placed on a chosen node."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import milepost.workers as workers
from milepost.colocated._ray_group import WAIT_GROUP
from milepost.colocated._ray_host import HostActor
from milepost.colocated._ray_peers import PEER_GROUP

if TYPE_CHECKING:
    from milepost.colocated._slice import SliceOptions


def host_remote() -> Any:
    """``HostActor`` as a Ray actor class, with its concurrency groups."""
    import ray

    groups = {WAIT_GROUP: 4, PEER_GROUP: 2}
    # (ray's overloads of remote() omit its concurrency_groups option)
    return ray.remote(concurrency_groups=groups)(HostActor)  # type: ignore[call-overload]


def actor_env(devices_per_host: int | None, options: SliceOptions) -> dict[str, str]:
    """The host actors' environment variables (set before the actor process imports JAX): fake
    CPU devices when asked, and the storage variables the controller has (the hosts open the
    checkpoint paths themselves)."""
    env = workers.storage_environment() if options.forward_storage_env else {}
    if devices_per_host:
        env.update(
            JAX_PLATFORMS="cpu",
            XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_host}",
        )
    return env


def host_on(
    node: str,
    *,
    index: int,
    hosts: int,
    devices_per_host: int | None,
    options: SliceOptions,
    cpus: float,
) -> Any:
    """A host actor on node ``node`` (hard affinity), host ``index`` of ``hosts`` (-1 and 0: a
    standby, which is assigned its place later), reserving ``cpus`` Ray CPUs."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return (
        host_remote()
        .options(
            num_cpus=cpus,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
            runtime_env={"env_vars": actor_env(devices_per_host, options)},
            max_restarts=0,
        )
        .remote(index, hosts, devices_per_host or 0)
    )
