"""What the controller holds of a slice's data: handles, never bytes.

A ``RemoteArray`` is an id, a shape, a dtype and a sharding over the slice's global device ids.
``SliceMesh``/``SliceSharding`` describe placements by device id only (no JAX devices on the
controller), so they work whatever devices this process has. Each handle and sharding carries
``__milepost_host_group__``: checkpoint calls on a tree of them run on that slice's hosts.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

import milepost.workers as workers


class SliceSharding:
    """A sharding over a slice's global devices, described by device ids only.

    ``milepost_spec`` is its picklable :class:`milepost.ShardingSpec`; hosts turn it into a JAX
    sharding with ``to_jax()``.
    """

    def __init__(self, group: Any, spec: workers.ShardingSpec) -> None:
        self.milepost_spec = spec
        self.__milepost_host_group__ = group

    @property
    def spec(self) -> tuple[Any, ...]:
        """The PartitionSpec entries."""
        return self.milepost_spec.spec

    @property
    def device_ids(self) -> tuple[int, ...]:
        """The global ids of the devices it spans, in the mesh's order."""
        return tuple(self.milepost_spec.device_ids)

    def shard_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The shape of each shard of an array of global ``shape``; ValueError if a sharded
        dimension does not divide."""
        return self.milepost_spec.shard_shape(tuple(shape))

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, SliceSharding)
            and other.__milepost_host_group__ is self.__milepost_host_group__
            and other.milepost_spec == self.milepost_spec
        )

    def __hash__(self) -> int:
        return hash(self.milepost_spec)

    def __repr__(self) -> str:
        return f"SliceSharding({workers.sharding_str(self.milepost_spec)})"


class SliceMesh:
    """A mesh over a slice's global device ids (controller-side; no JAX devices needed)."""

    def __init__(self, group: Any, axes: Mapping[str, int], device_ids: Sequence[int]) -> None:
        size = math.prod(axes.values())
        if size != len(device_ids):
            raise ValueError(
                f"mesh {dict(axes)} has {size} devices but the slice has {len(device_ids)}; "
                f"choose axis sizes whose product is {len(device_ids)}"
            )
        self._group = group
        self.shape: dict[str, int] = dict(axes)
        """Each axis's size, by name."""
        self.axis_names: tuple[str, ...] = tuple(axes)
        """The axes' names, in order."""
        self.device_ids: tuple[int, ...] = tuple(device_ids)
        """The global device ids, in row-major order of the axes."""

    def sharding(self, spec: Any = None) -> SliceSharding:
        """The sharding of ``PartitionSpec`` ``spec`` over this mesh (None: replicated)."""
        entries = tuple(spec) if spec is not None else ()
        unknown = {
            a
            for e in entries
            for a in ((e,) if isinstance(e, str) else (e or ()))
            if a not in self.shape
        }
        if unknown:
            raise ValueError(
                f"PartitionSpec {spec} names axes {sorted(unknown)} that mesh {self.shape} lacks"
            )
        return SliceSharding(
            self._group,
            workers.ShardingSpec.named(
                tuple(self.shape.values()), self.axis_names, self.device_ids, entries
            ),
        )

    def __repr__(self) -> str:
        return f"SliceMesh({self.shape})"


@dataclasses.dataclass(frozen=True)
class AbstractArray:
    """Shape, dtype and (slice or JAX) sharding of an array to load: the leaf of an abstract
    tree when the target devices belong to a slice (``jax.ShapeDtypeStruct`` otherwise).

    >>> mesh = s.mesh({"data": 2, "model": 4})
    >>> abstract = {"w": mp.AbstractArray((1024, 1024), np.float32, mesh.sharding(P("data")))}
    """

    shape: tuple[int, ...]
    """The global shape."""
    dtype: Any
    """The dtype (anything ``numpy.dtype`` takes)."""
    sharding: Any = None
    """Where to place it: a slice's sharding (``mesh.sharding(...)``) or a JAX one; None: as
    saved."""


class RemoteArray:
    """The controller's handle to a global array held by a slice's hosts.

    Dropping the last reference frees the array on the hosts. Bring the data back with
    ``slice.fetch``; compute on it with ``slice.run``; checkpoint it with ``milepost.save``.
    """

    def __init__(
        self,
        group: Any,
        array_id: str,
        shape: Sequence[int],
        dtype: Any,
        spec: workers.ShardingSpec,
    ) -> None:
        self.id = array_id
        """The hosts' name for the array (unique in its slice)."""
        self.shape: tuple[int, ...] = tuple(int(d) for d in shape)
        """The global shape."""
        self.dtype: np.dtype = workers.dtype_of(dtype)
        """The NumPy dtype."""
        self.sharding: SliceSharding = SliceSharding(group, spec)
        """How it is spread over the slice's devices."""
        self.__milepost_host_group__ = group
        self._finalizer = weakref.finalize(self, group.release, array_id)

    @property
    def ndim(self) -> int:
        """The number of dimensions."""
        return len(self.shape)

    @property
    def size(self) -> int:
        """The number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole (global) array."""
        return self.size * self.dtype.itemsize

    def __reduce__(self) -> Any:
        raise TypeError(
            "a RemoteArray is a handle to data on a slice's hosts and cannot be pickled; "
            "use slice.fetch(x) for its values or milepost.save to checkpoint it"
        )

    def _facts(self) -> dict[str, str]:
        spec = self.sharding.milepost_spec
        return {
            "shape": workers.shape_str(self.shape),
            "dtype": str(self.dtype),
            "bytes": workers.human_bytes(self.nbytes),
            "sharding": workers.sharding_str(spec),
            "shard shape": workers.shape_str(spec.shard_shape(self.shape)),
            "devices": ", ".join(map(str, spec.device_ids)),
            "id": self.id,
        }

    def __repr__(self) -> str:
        facts = self._facts()
        return (
            f"RemoteArray({facts['dtype']}{facts['shape']}, {facts['bytes']}, "
            f"sharding={facts['sharding']}, shard shape {facts['shard shape']})"
        )

    def _repr_html_(self) -> str:
        return workers.html_fields("RemoteArray (on the slice's hosts)", self._facts())
