"""A picklable, device-free description of a sharding, and its index arithmetic.

The controller of a slice owns no devices, so it describes shardings by global device ids
(``ShardingSpec``) and hosts turn them into real ``jax.sharding`` objects. Device ids are not
contiguous across processes: everything maps by id, never by position.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from milepost.workers import _declared as declared
from milepost.workers._errors import MissingDevicesError

AxisEntry = str | tuple[str, ...] | None
AXIS_TYPES = ("Auto", "Explicit", "Manual")
"""JAX's ``jax.sharding.AxisType`` names."""


@dataclass(frozen=True, kw_only=True)
class ShardingSpec:
    """``kind`` 'named': a mesh of global device ids with axis names and a PartitionSpec;
    'single': one device."""

    kind: str
    mesh_shape: tuple[int, ...] = ()
    """The mesh's size along each axis ('named' only)."""
    axis_names: tuple[str, ...] = ()
    """The mesh's axis names ('named' only)."""
    device_ids: tuple[int, ...] = ()
    """Mesh device ids in row-major order of ``mesh_shape``; for 'single', one id."""
    spec: tuple[AxisEntry, ...] = ()
    """The PartitionSpec, one entry per array dimension: None, an axis name, or a tuple of them."""
    axis_types: tuple[str, ...] = ()
    """'Auto', 'Explicit' or 'Manual' per mesh axis (``named`` fills in JAX's default, Auto)."""
    memory_kind: str | None = None
    """The memory the array lives in when it is not its devices' default, e.g. 'pinned_host' for
    host-offloaded state; None: the default memory."""

    def __hash__(self) -> int:
        # Of a bounded part (equal specs hash equal; unequal ones that share it are told apart
        # by ==): a load of 2,000 arrays at 4,096 hosts looked each array's sharding up, and
        # hashing its 32,768 device ids took 0.1 ms each time, 0.2 s in all.
        ids = self.device_ids
        return hash(
            (
                self.kind,
                self.mesh_shape,
                self.axis_names,
                len(ids),
                ids[:16],
                ids[-16:],
                self.spec,
                self.axis_types,
                self.memory_kind,
            )
        )

    # ---- construction -------------------------------------------------------------------
    @staticmethod
    def named(
        mesh_shape: tuple[int, ...],
        axis_names: tuple[str, ...],
        device_ids: tuple[int, ...],
        spec: tuple[AxisEntry, ...],
        axis_types: tuple[str, ...] = (),
    ) -> ShardingSpec:
        """A 'named' spec, checked: ValueError when the mesh's size and its device ids disagree, an
        id or axis name repeats, or an axis type is unknown."""
        if math.prod(mesh_shape) != len(device_ids):
            raise ValueError(
                f"mesh of shape {mesh_shape} needs {math.prod(mesh_shape)} "
                f"device ids, got {len(device_ids)}"
            )
        if len(set(device_ids)) != len(device_ids):
            raise ValueError(f"mesh device ids must be distinct, got {device_ids}")
        if len(axis_names) != len(mesh_shape) or len(set(axis_names)) != len(axis_names):
            raise ValueError(
                f"a mesh of shape {mesh_shape} needs as many distinct axis names, got "
                f"{declared.shown(list(axis_names))}"
            )
        if not all(isinstance(a, str) for a in axis_names):
            raise ValueError(f"mesh axis names must be strings: {declared.shown(list(axis_names))}")
        # JAX's Mesh default is Auto for every axis; spell it out so equal shardings compare
        # equal.
        types = tuple(str(t).rsplit(".", 1)[-1] for t in axis_types) or ("Auto",) * len(axis_names)
        if len(types) != len(axis_names) or not set(types) <= set(AXIS_TYPES):
            raise ValueError(
                f"a mesh's axis types must be one of {list(AXIS_TYPES)} per axis, got "
                f"{declared.shown(list(axis_types))}"
            )
        return ShardingSpec(
            kind="named",
            mesh_shape=tuple(mesh_shape),
            axis_names=tuple(axis_names),
            device_ids=tuple(int(d) for d in device_ids),
            spec=_normalized(spec, tuple(axis_names)),
            axis_types=types,
        )

    def with_spec(self, spec: tuple[AxisEntry, ...] | list[Any]) -> ShardingSpec:
        """This 'named' sharding's mesh with another PartitionSpec (checked against the mesh's
        axes as in ``named``); the mesh's tuples are shared, not copied or checked again."""
        return dataclasses.replace(self, spec=_normalized(spec, self.axis_names))

    @staticmethod
    def single(device_id: int) -> ShardingSpec:
        """A spec of the one device ``device_id``."""
        return ShardingSpec(kind="single", device_ids=(int(device_id),))

    @staticmethod
    def from_jax(sharding: Any) -> ShardingSpec:
        """The spec of a JAX ``NamedSharding`` or ``SingleDeviceSharding`` (its memory kind
        kept); TypeError for another kind, saying to reshard onto a ``NamedSharding``."""
        import jax

        if isinstance(sharding, jax.sharding.NamedSharding):
            mesh = sharding.mesh
            ids = tuple(int(d.id) for d in mesh.devices.flat)
            types = tuple(str(t) for t in getattr(mesh, "axis_types", ()))
            spec = ShardingSpec.named(
                tuple(mesh.devices.shape), tuple(mesh.axis_names), ids, tuple(sharding.spec), types
            )
        elif isinstance(sharding, jax.sharding.SingleDeviceSharding):
            device: jax.Device  # (jax's annotation of device_set does not resolve)
            (device,) = sharding.device_set
            spec = ShardingSpec.single(device.id)
        else:
            raise TypeError(
                "milepost saves jax.Arrays with NamedSharding or SingleDeviceSharding, got "
                f"{type(sharding).__name__}; reshard the array onto a NamedSharding "
                "(jax.device_put(x, NamedSharding(mesh, spec))) before saving"
            )
        kind = sharding.memory_kind
        default = next(iter(sharding.device_set)).default_memory().kind
        return spec if kind in (None, default) else dataclasses.replace(spec, memory_kind=kind)

    # ---- jax ----------------------------------------------------------------------------
    def to_jax(self) -> Any:
        """The JAX sharding it describes, on this runtime's devices."""
        return _to_jax(self)

    # ---- arithmetic ---------------------------------------------------------------------
    def partitions(self, ndim: int) -> tuple[int, ...]:
        """How many blocks each array dimension is cut into."""
        if self.kind == "single":
            return (1,) * ndim
        if len(self.spec) > ndim:
            raise ValueError(
                f"PartitionSpec {self.spec} has more entries than the array has dimensions ({ndim})"
            )
        sizes = dict(zip(self.axis_names, self.mesh_shape, strict=True))
        out = []
        for d in range(ndim):
            entry = self.spec[d] if d < len(self.spec) else None
            out.append(math.prod(sizes[a] for a in _axes(entry)))
        return tuple(out)

    def shard_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of each shard of an array of global ``shape``; ValueError if a sharded
        dimension does not divide."""
        parts = self.partitions(len(shape))
        for dim, p in zip(shape, parts, strict=True):
            if dim % p:
                raise ValueError(
                    f"sharding {self.describe()} cuts a dimension of size {dim} "
                    f"into {p} parts, which does not divide it"
                )
        return tuple(dim // p for dim, p in zip(shape, parts, strict=True))

    def device_indices(self, shape: tuple[int, ...]) -> dict[int, tuple[tuple[int, int], ...]]:
        """Global device id -> the box of the array that device holds."""
        if self.kind == "single":
            return {self.device_ids[0]: tuple((0, n) for n in shape)}
        shard = self.shard_shape(shape)
        sizes = dict(zip(self.axis_names, self.mesh_shape, strict=True))
        out: dict[int, tuple[tuple[int, int], ...]] = {}
        for flat, dev in enumerate(self.device_ids):
            coords = dict(zip(self.axis_names, _unravel(flat, self.mesh_shape), strict=True))
            box = []
            for d in range(len(shape)):
                entry = self.spec[d] if d < len(self.spec) else None
                block = 0
                for a in _axes(entry):
                    block = block * sizes[a] + coords[a]
                box.append((block * shard[d], (block + 1) * shard[d]))
            out[dev] = tuple(box)
        return out

    def describe(self) -> str:
        """The one notation milepost writes a sharding in (``milepost inspect``, reprs, logs,
        errors): ``P('data', 'model') on {data: 2, model: 4}``, ``device 3``, and a memory kind
        other than the default as ``[pinned_host]``."""
        memory = f" [{self.memory_kind}]" if self.memory_kind else ""
        if self.kind == "single":
            return f"device {self.device_ids[0]}{memory}"
        entries = ", ".join(
            "None"
            if e is None
            else repr(e)
            if isinstance(e, str)
            else "(" + ", ".join(map(repr, e)) + ")"
            for e in self.spec
        )
        mesh = ", ".join(f"{a}: {n}" for a, n in zip(self.axis_names, self.mesh_shape, strict=True))
        return f"P({entries}) on {{{mesh}}}{memory}"

    # ---- Orbax ``_sharding`` JSON -------------------------------------------------------
    def to_orbax_json(self, platform: str = "cpu") -> str:
        """The spec as the JSON Orbax records in a checkpoint's ``_sharding`` file."""
        # A non-default memory kind goes under the key Orbax's sharding metadata reserves for it
        # ('memory_kind'); Orbax 0.12 reads the keys it knows and ignores it.
        memory = {"memory_kind": self.memory_kind} if self.memory_kind else {}
        if self.kind == "single":
            return json.dumps(
                {
                    "sharding_type": "SingleDeviceSharding",
                    "device_str": f"{platform}:{self.device_ids[0]}",
                    **memory,
                }
            )
        nested: Any = [{"id": i} for i in self.device_ids]
        for size in reversed(self.mesh_shape[1:]):
            nested = [nested[i : i + size] for i in range(0, len(nested), size)]
        spec = [list(e) if isinstance(e, tuple) else e for e in self.spec]
        return json.dumps(
            {
                "sharding_type": "NamedSharding",
                "shape": list(self.mesh_shape),
                "axis_names": list(self.axis_names),
                "axis_types": [f"AxisType.{t}" for t in self.axis_types],
                "partition_spec": spec,
                "device_mesh": {"mesh": nested},
                **memory,
            }
        )

    @staticmethod
    def from_orbax_json(text: str, where: str = "a sharding") -> ShardingSpec:
        """The sharding of Orbax's JSON ``text`` (read from ``where``). One of a kind milepost
        does not know is a ValueError or KeyError; one that breaks
        :mod:`._declared`'s rules (a mesh of more devices than it allows, ...) a
        CorruptCheckpointError."""
        d = declared.mapping(declared.loads(text, where, "a sharding"), where, "a sharding")
        kind = d.get("sharding_type")
        if kind == "SingleDeviceSharding":
            out = ShardingSpec.single(device_id_of(str(d["device_str"])))
        elif kind == "NamedSharding":
            shape = declared.shape(d["shape"], where, "the mesh shape", minimum=1)
            size = declared.devices(shape, where, "the mesh shape")
            ids: list[int] = []
            if "device_mesh" in d:
                _flatten_ids(d["device_mesh"]["mesh"], ids, where)
            else:  # Orbax before 0.6 recorded no devices: it lays the mesh over jax.devices()
                ids = list(range(size))
            spec = tuple(
                tuple(e) if isinstance(e, list) else e for e in d.get("partition_spec", [])
            )
            types = tuple(d.get("axis_types") or ())
            out = ShardingSpec.named(shape, tuple(d["axis_names"]), tuple(ids), spec, types)
        else:
            raise ValueError(f"unsupported saved sharding type {kind!r}")
        memory_kind = d.get("memory_kind")
        if memory_kind is not None and not isinstance(memory_kind, str):
            raise ValueError(f"memory_kind must be a string, got {memory_kind!r}")
        return dataclasses.replace(out, memory_kind=memory_kind) if memory_kind else out


_DEVICE_STR = re.compile(r"^(?:TFRT_CPU_|[A-Za-z]+[_:])(\d+)(?:\(|$)")


def device_id_of(text: str) -> int:
    """The device id in ``str(device)`` as Orbax records it: ``cpu:3``, ``TFRT_CPU_3`` (jax
    before 0.10), ``cuda:3``, ``TPU_3(process=0,(1,1,0,0))``."""
    match = _DEVICE_STR.match(text)
    if match is None:
        raise ValueError(f"cannot tell the device id of the saved device {text!r}")
    return int(match.group(1))


def _normalized(spec: Any, axis_names: tuple[str, ...]) -> tuple[AxisEntry, ...]:
    """A PartitionSpec's entries as ShardingSpec keeps them (None, an axis name, or a tuple of
    names), every name one of ``axis_names``."""
    norm: list[AxisEntry] = []
    used: set[str] = set()
    for entry in spec:
        names = _axes(entry)
        for n in names:
            if not isinstance(n, str) or n not in axis_names:
                raise ValueError(
                    f"PartitionSpec names mesh axis {declared.shown(n)}, but the mesh has axes "
                    f"{axis_names}"
                )
            if n in used:
                raise ValueError(f"PartitionSpec names mesh axis {n!r} twice")
            used.add(n)
        norm.append(
            None
            if not names
            else names[0]
            if len(names) == 1 and isinstance(entry, str)
            else tuple(names)
        )
    return tuple(norm)


def _axes(entry: AxisEntry | Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, tuple | list):
        return tuple(entry)
    return ()  # PartitionSpec.UNCONSTRAINED and friends: treat as replicated


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    coords = []
    for size in reversed(shape):
        coords.append(flat % size)
        flat //= size
    return tuple(reversed(coords))


def _flatten_ids(mesh: Any, out: list[int], where: str) -> None:
    """The device ids of Orbax's nested ``device_mesh`` lists, in row-major order."""
    stack = [mesh]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            out.append(declared.integer(node["id"], where, "a device id"))
        elif isinstance(node, list):
            stack.extend(reversed(node))
        else:
            raise ValueError(f"a device mesh holds {declared.shown(node)}")
        if len(out) + len(stack) > declared.MAX_DEVICES:
            raise declared.bad(
                where, "the device mesh", f"lists over {declared.MAX_DEVICES} devices"
            )


@functools.lru_cache(maxsize=1024)
def _to_jax(spec: ShardingSpec) -> Any:
    import jax
    import numpy as np

    by_id = {d.id: d for d in jax.devices()}
    missing = [i for i in spec.device_ids if i not in by_id]
    if missing:
        raise MissingDevicesError(
            f"the sharding {spec.describe()} uses devices {missing[:8]}"
            f"{'...' if len(missing) > 8 else ''} that this JAX runtime does not have (it has "
            f"{len(by_id)}, ids {sorted(by_id)[:8]}{'...' if len(by_id) > 8 else ''}); load "
            "without an abstract tree (the saved shardings are placed on the devices here), or "
            "pass one with shardings over the devices you have",
            sharding=spec,
            missing=tuple(missing),
            available=tuple(sorted(by_id)),
        )
    if spec.kind == "single":
        return jax.sharding.SingleDeviceSharding(
            by_id[spec.device_ids[0]], memory_kind=spec.memory_kind
        )
    devices = np.array([by_id[i] for i in spec.device_ids], dtype=object).reshape(spec.mesh_shape)
    if spec.axis_types:
        types = tuple(getattr(jax.sharding.AxisType, t) for t in spec.axis_types)
        mesh = jax.sharding.Mesh(devices, spec.axis_names, axis_types=types)
    else:
        mesh = jax.sharding.Mesh(devices, spec.axis_names)
    return jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(*spec.spec), memory_kind=spec.memory_kind
    )
