"""Load-and-broadcast: only the devices at index 0 of a replica axis read an array from storage;
the other replicas receive its shards from them by a collective among the hosts.

The hosts of a slice (and the processes of a multi-controller job) form one ``jax.distributed``
runtime, so one jitted program over the array's mesh moves the shards device to device; nothing
passes through the controller. Every host runs the same program for the same arrays in the same
order (the load plan is the same on every host), which is what a collective needs.

The program is a doubling broadcast along the axis made of ``ppermute``s: in round ``k``
(1, 2, 4, ...) the replicas ``0..k-1`` send to ``k..2k-1``, so ``R`` replicas need
``ceil(log2 R)`` rounds and every receiving device gets its shard exactly once. Receivers keep
what arrives with a select, so the values are the read bytes, bit for bit (no arithmetic: NaN
payloads and signed zeros survive).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from milepost.workers._iostats import count_between_hosts
from milepost.workers._memory import read_buffer


@dataclass(frozen=True)
class Route:
    """What one host does for one array: which of its devices read, and the bytes it will send
    to and receive from other hosts."""

    readers: frozenset[int]
    """Ids of this host's devices at index 0 of the axis: they read; the others receive."""
    sent: int
    received: int


def route(sharding: Any, shape: tuple[int, ...], itemsize: int, axis: str) -> Route:
    """This host's part in broadcasting an array of ``shape`` with ``sharding`` (a
    ``NamedSharding`` replicated along ``axis``)."""
    import jax

    mesh = sharding.mesh
    where = tuple(mesh.axis_names).index(axis)
    replicas = int(mesh.devices.shape[where])
    me = jax.process_index()
    shard_bytes = math.prod(sharding.shard_shape(shape)) * itemsize
    sent = received = 0
    for src, dst in _pairs(replicas):
        for a, b in zip(
            np.take(mesh.devices, src, axis=where).flat,
            np.take(mesh.devices, dst, axis=where).flat,
            strict=True,
        ):
            if a.process_index != b.process_index:
                sent += shard_bytes if a.process_index == me else 0
                received += shard_bytes if b.process_index == me else 0
    readers = frozenset(
        d.id for d in np.take(mesh.devices, 0, axis=where).flat if d.process_index == me
    )
    return Route(readers=readers, sent=sent, received=received)


def _rounds(replicas: int) -> list[list[tuple[int, int]]]:
    """The ``(source, destination)`` replica pairs of each round of the doubling broadcast."""
    rounds, k = [], 1
    while k < replicas:
        rounds.append([(s, s + k) for s in range(k) if s + k < replicas])
        k *= 2
    return rounds


def _pairs(replicas: int) -> list[tuple[int, int]]:
    return [pair for pairs in _rounds(replicas) for pair in pairs]


@functools.lru_cache(maxsize=256)
def _program(mesh: Any, spec: Any, axis: str) -> Any:
    """The jitted broadcast over ``mesh``: takes the stacked ``(R, *shape)`` array sharded
    ``P(axis, *spec)`` (slot ``r`` on the devices of replica ``r``; only slot 0 holds data) and
    returns the array sharded ``spec``, replica 0's values on every replica."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec

    rounds = _rounds(int(mesh.shape[axis]))

    def body(x: Any) -> Any:
        x = x[0]
        me = jax.lax.axis_index(axis)
        k = 1
        for pairs in rounds:
            arrived = jax.lax.ppermute(x, axis, pairs)
            x = jnp.where((me >= k) & (me < 2 * k), arrived, x)
            k *= 2
        return x

    return jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=PartitionSpec(axis, *spec), out_specs=spec, check_vma=False
        )
    )


def _placeholder(device: Any, shape: tuple[int, ...], dtype: np.dtype) -> Any:
    """A buffer of ``shape`` on ``device`` whose values never matter (a receiver's input slot)."""
    import jax

    if device.platform == "cpu":
        return jax.device_put(read_buffer(shape, dtype), device)  # adopted, its pages never touched
    import jax.numpy as jnp

    return jax.jit(
        lambda: jnp.zeros(shape, dtype), out_shardings=jax.sharding.SingleDeviceSharding(device)
    )()


def broadcast(
    shape: tuple[int, ...],
    dtype: np.dtype,
    sharding: Any,
    axis: str,
    route: Route,
    data: Mapping[int, Any],
) -> Any:
    """The global array of ``shape`` with ``sharding``: ``data`` holds, for each of this host's
    reading devices, the shard it read (a NumPy array or a device array on it); every other
    device of the mesh gets the shard of its replica 0. Missing reader data (after a failure
    here) is replaced by placeholders, so the other hosts' collectives still complete."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = sharding.mesh
    spec = sharding.spec
    replicas = int(mesh.shape[axis])
    stacked = NamedSharding(mesh, PartitionSpec(axis, *spec))
    if not stacked.addressable_devices:  # none of the mesh's devices is here: nothing to run
        return jax.make_array_from_single_device_arrays(shape, sharding, [])
    shard = tuple(sharding.shard_shape(shape))
    pieces = []
    device: jax.Device  # (jax annotates its shardings' devices with a type that does not resolve)
    for device in stacked.addressable_devices:
        value = data.get(device.id) if device.id in route.readers else None
        if value is None:
            pieces.append(_placeholder(device, (1, *shard), dtype))
        elif isinstance(value, np.ndarray):
            pieces.append(jax.device_put(value.reshape((1, *shard)), device))
        else:
            pieces.append(value.reshape((1, *shard)))
    stacked_array = jax.make_array_from_single_device_arrays((replicas, *shape), stacked, pieces)
    out = _program(mesh, spec, axis)(stacked_array)
    del stacked_array, pieces
    count_between_hosts(sent=route.sent, received=route.received)
    default = next(iter(sharding.device_set)).default_memory().kind
    if getattr(sharding, "memory_kind", None) not in (None, default):
        return jax.device_put(out, sharding)  # the collective ran in the devices' default memory
    # The same buffers under the caller's sharding object (no copy).
    return jax.make_array_from_single_device_arrays(
        shape, sharding, [s.data for s in out.addressable_shards]
    )
