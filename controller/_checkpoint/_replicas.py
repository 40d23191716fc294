"""Load-and-broadcast planning: which arrays of a load are read by replica 0 only.

With ``LoadOptions(load_and_broadcast=True, replica_axis=axis)`` an array whose target sharding
is replicated along ``axis`` is read only by the devices at index 0 of the axis; the hosts move
the shards to the other replicas by a collective (the hosts' ``milepost.workers.load``). The
controller only marks the tasks: it decides from device ids and the group's device owners,
never from array data.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from milepost import workers
from milepost._checkpoint._planning import sharding_spec
from milepost._options import LoadOptions


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def mark(tasks: list[workers.LoadTask], loading: LoadOptions, group: Any) -> list[workers.LoadTask]:
    """``tasks`` with ``broadcast_axis`` set on those whose replicas along the axis live on other
    hosts than their replica 0. Raises ValueError for a target mesh without the axis."""
    axis = loading.replica_axis
    if not loading.load_and_broadcast or axis is None:
        return tasks
    out = []
    for task in tasks:
        spec = sharding_spec(task.sharding) if task.sharding is not None else None
        if spec is None or spec.kind != "named":  # one device: no replicas
            out.append(task)
            continue
        if axis not in spec.axis_names:
            raise ValueError(
                f"array {task.name!r} is loaded onto a mesh with axes {spec.axis_names}, which has "
                f"no axis {axis!r} (LoadOptions.replica_axis); set replica_axis to the mesh axis "
                f"your replicas lie along (one of {spec.axis_names}), or load this array without "
                "load_and_broadcast (in its own load call)"
            )
        sharded_along = any(axis in _axes(entry) for entry in spec.spec)
        if sharded_along or not _replicas_elsewhere(spec, axis, group):
            out.append(task)  # nothing another host would read twice
            continue
        out.append(dataclasses.replace(task, broadcast_axis=axis))
    return out


def _replicas_elsewhere(spec: workers.ShardingSpec, axis: str, group: Any) -> bool:
    """Whether some device off index 0 of ``axis`` is on another host than its replica 0."""
    where = spec.axis_names.index(axis)
    if spec.mesh_shape[where] < 2:
        return False
    owners = np.array([group.process_of_device(d) for d in spec.device_ids]).reshape(
        spec.mesh_shape
    )
    first = np.take(owners, [0], axis=where)
    return bool((owners != first).any())
