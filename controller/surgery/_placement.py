"""Where a surgery's arrays live and run: this process's devices (embedded and multi-controller
JAX) or a slice's hosts. The rest of the surgery code is the same for both."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from milepost import _checkpoint, _hosts
from milepost.colocated import AbstractArray, HostGroup, Slice, SliceSharding
from milepost.workers import ShardingSpec


def fits(spec: ShardingSpec | None, shape: tuple[int, ...]) -> bool:
    """Whether ``spec`` can shard an array of ``shape`` (its mesh divides the sharded dims)."""
    if spec is None:
        return False
    try:
        spec.shard_shape(tuple(shape))
    except ValueError:
        return False
    return True


class Placement:
    def __init__(self, slice: Slice | None = None) -> None:
        self.slice = slice
        self.group: HostGroup = slice.group if slice is not None else _hosts.host_group_for([])
        self.device_ids: tuple[int, ...] = tuple(
            slice.device_ids if slice is not None else (d.id for d in jax.devices())
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Placement) and other.slice is self.slice

    def __hash__(self) -> int:
        return id(self.slice)

    def describe(self) -> str:
        return (
            repr(self.slice)
            if self.slice is not None
            else f"this process ({len(self.device_ids)} devices)"
        )

    # -- shardings ----------------------------------------------------------------------
    def usable(self, spec: ShardingSpec | None, shape: tuple[int, ...]) -> bool:
        """Whether arrays of ``shape`` can be placed with ``spec`` here."""
        return (
            spec is not None and set(spec.device_ids) <= set(self.device_ids) and fits(spec, shape)
        )

    def default_spec(self, shape: tuple[int, ...]) -> ShardingSpec:
        """Over every device: the first dimension the device count divides is split, else the
        array is replicated."""
        n = len(self.device_ids)
        entries: tuple[Any, ...] = ()
        for d, size in enumerate(shape):
            if size >= n and size % n == 0:
                entries = (None,) * d + ("all",)
                break
        return ShardingSpec.named((n,), ("all",), self.device_ids, entries)

    def spec_for(self, preferred: ShardingSpec | None, shape: tuple[int, ...]) -> ShardingSpec:
        """``preferred`` if arrays of ``shape`` fit it here, else :meth:`default_spec`; with
        automatic axes (XLA places the intermediate values of a surgery as it likes)."""
        spec = preferred if self.usable(preferred, shape) else self.default_spec(shape)
        assert spec is not None
        if spec.kind == "named" and any(t != "Auto" for t in spec.axis_types):
            spec = dataclasses.replace(spec, axis_types=("Auto",) * len(spec.mesh_shape))
        return spec

    def sharding(self, spec: ShardingSpec) -> Any:
        """The sharding object arrays here take: a jax sharding, or a slice sharding."""
        if self.slice is not None:
            return SliceSharding(self.group, spec)
        return spec.to_jax()

    def abstract(self, shape: tuple[int, ...], dtype: Any, spec: ShardingSpec) -> Any:
        if self.slice is not None:
            return AbstractArray(tuple(shape), np.dtype(dtype), self.sharding(spec))
        return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=self.sharding(spec))

    def bytes_per_host(self, shape: tuple[int, ...], dtype: Any, spec: ShardingSpec) -> int:
        """The most bytes of one such array any one host holds (each distinct shard once)."""
        if not all(shape):
            return 0
        per_host: dict[Any, set[Any]] = {}
        for device, box in _checkpoint.device_boxes(spec, tuple(shape)).items():
            per_host.setdefault(self.group.process_of_device(device), set()).add(box)
        itemsize = np.dtype(dtype).itemsize
        return max(
            sum(math.prod(b - a for a, b in box) for box in boxes) * itemsize
            for boxes in per_host.values()
        )

    # -- running ------------------------------------------------------------------------
    def run(self, fn: Any, inputs: list[Any], out_specs: list[ShardingSpec]) -> list[Any]:
        """``jax.jit(fn, out_shardings=...)(*inputs)`` where the arrays are."""
        shardings = [self.sharding(s) for s in out_specs]
        if self.slice is not None:
            return list(self.slice.run(fn, *inputs, out_shardings=shardings))
        return list(jax.jit(fn, out_shardings=shardings)(*inputs))

    def fetch(self, values: list[Any]) -> list[np.ndarray]:
        """The values on the controller (small results: previews, statistics)."""
        if self.slice is not None:
            return [np.asarray(v) for v in self.slice.fetch(list(values))]
        out = []
        for v in values:
            if isinstance(v, jax.Array) and not v.is_fully_addressable:
                from jax.experimental import multihost_utils

                v = multihost_utils.process_allgather(v, tiled=True)
            out.append(np.asarray(v))
        return out
