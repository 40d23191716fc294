"""Loading with the saved shardings on whatever devices are here.

A checkpoint records each array's sharding by global device ids (Orbax's ``_sharding`` a
single device by its name, ``cuda:0`` or ``TPU_3(...)``, read as its id). Loaded without a
sharding to use instead, a saved sharding is placed as follows, each distinct saved mesh worked
out once per load and each change said in one log line:

- every saved device id exists here: as saved;
- else the saved mesh's shape, axis names and PartitionSpecs, each axis cut to a divisor of its
  saved size (so every array dimension still divides), the product as large as the devices here
  allow (among equal products, the earlier axes kept larger): the whole mesh when there are
  enough devices, all axes 1 on one device. A mesh of every device here is laid out as the group
  lays a mesh (``mesh_device_ids``: ``jax.make_mesh``'s order, or ``jax.set_mesh``'s mesh of
  those axes); a smaller one over the group's first devices;
- a single-device sharding on a device not here: the group's first device;
- a memory kind the devices here do not offer: their default memory.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

from milepost._errors import StructureMismatchError
from milepost.workers import CorruptCheckpointError, ShardingSpec, StoragePath
from milepost.workers import format as fmt

log = logging.getLogger("milepost")

_ADVICE = "pass an abstract tree to choose the placement"


class SavedShardings:
    """The saved shardings of one load, placed on the group's devices (see the module)."""

    def __init__(self, files: fmt.TreeFiles, group: Any, directory: StoragePath) -> None:
        self._files = files
        self._group = group
        self._directory = directory
        self._here: Any = None
        """``group.devices_here()``, asked at the first saved sharding."""
        self._present: frozenset[int] = frozenset()
        self._meshes: dict[tuple[Any, ...], ShardingSpec | None] = {}
        """Per saved mesh (or single device): the mesh it is placed on (None: as saved)."""
        self._done: dict[tuple[Any, ...], tuple[tuple[int, ...], ShardingSpec | None]] = {}
        """Per distinct saved sharding (its ids tuple by identity: the arrays of a mesh share
        it, and holding the tuple keeps its id from being reused): its ids, and its placement
        (None: as saved)."""
        self._memory_said: set[str] = set()

    def sharding(
        self, name: str, message: str, shape: tuple[int, ...] | None = None
    ) -> ShardingSpec:
        """Leaf ``name``'s saved sharding as placed here; ``message``: the error when none was
        saved. ``shape``: the array's, from its header, which the saved sharding must divide
        (they were written together: a sharding that does not is damage)."""
        spec = self._files.shardings.get(name)
        if spec is None:
            raise StructureMismatchError(message)
        if shape is not None:
            self._check_fits(spec, name, shape)
        key = (
            id(spec.device_ids),
            spec.kind,
            spec.mesh_shape,
            spec.axis_names,
            spec.axis_types,
            spec.spec,
            spec.memory_kind,
        )
        known = self._done.get(key)
        if known is None:
            known = self._done[key] = (spec.device_ids, self._place(spec, name))
        return spec if known[1] is None else known[1]

    def _check_fits(self, spec: ShardingSpec, name: str, shape: tuple[int, ...]) -> None:
        try:
            spec.shard_shape(shape)
        except ValueError as e:
            where = self._directory / (self._files.sharding_files or (fmt.SHARDING,))[0]
            raise CorruptCheckpointError(
                f"{where}: the sharding recorded for array {name!r} does not fit the shape "
                f"{list(shape)} its header gives ({e}); the checkpoint is damaged or crafted. "
                "Load an earlier checkpoint.",
                array=name,
                path=str(where),
                field="sharding",
            ) from None

    def _place(self, spec: ShardingSpec, name: str) -> ShardingSpec | None:
        """``spec`` placed here (None: as saved), checked with the group."""
        if self._here is None:
            self._here = self._group.devices_here()
            self._present = frozenset(self._here.ids)
        placed = self._mesh_placed(spec) if spec.kind == "named" else self._single_placed(spec)
        placed = self._memory_placed(placed)
        self._group.check_devices(placed, name)
        return None if placed is spec else placed

    # -- phases ---------------------------------------------------------------------------
    def _mesh_placed(self, spec: ShardingSpec) -> ShardingSpec:
        key = (spec.mesh_shape, spec.axis_names, spec.axis_types, spec.device_ids)
        if key not in self._meshes:
            fits = self._present.issuperset(spec.device_ids)
            self._meshes[key] = None if fits else self._new_mesh(spec)
        mesh = self._meshes[key]
        if mesh is None:
            return spec
        return dataclasses.replace(mesh.with_spec(spec.spec), memory_kind=spec.memory_kind)

    def _new_mesh(self, spec: ShardingSpec) -> ShardingSpec:
        """The mesh a saved mesh whose devices are not all here is placed on, said in a log
        line."""
        ids: tuple[int, ...] = tuple(self._here.ids)
        sizes = fitted_sizes(spec.mesh_shape, len(ids))
        used = math.prod(sizes)
        placed_ids = ids[:used]
        if used == len(ids):
            try:
                placed_ids = tuple(self._group.mesh_device_ids(spec.axis_names, sizes))
            except ValueError:
                pass
        mesh = ShardingSpec.named(sizes, spec.axis_names, placed_ids, (), spec.axis_types)
        saved = dict(zip(spec.axis_names, spec.mesh_shape, strict=True))
        where = self._here.where
        if sizes == spec.mesh_shape:
            what = f"which {where} lacks ({len(ids)} devices here): placed the saved mesh"
        else:
            placed = dict(zip(spec.axis_names, sizes, strict=True))
            what = f"{where} has {len(ids)}: placed on mesh {placed}"
        log.info(
            "loading %s: saved over %d devices %s (ids %s), %s (devices %s); %s",
            self._directory,
            len(spec.device_ids),
            saved,
            ids_text(spec.device_ids),
            what,
            ids_text(placed_ids),
            _ADVICE,
        )
        return mesh

    def _single_placed(self, spec: ShardingSpec) -> ShardingSpec:
        if spec.device_ids[0] in self._present:
            return spec
        first = int(self._here.ids[0])
        key = ("single", spec.device_ids[0])
        if key not in self._meshes:
            self._meshes[key] = None
            log.info(
                "loading %s: saved on device %d, which %s lacks: placed on device %d; %s",
                self._directory,
                spec.device_ids[0],
                self._here.where,
                first,
                _ADVICE,
            )
        return dataclasses.replace(ShardingSpec.single(first), memory_kind=spec.memory_kind)

    def _memory_placed(self, spec: ShardingSpec) -> ShardingSpec:
        kinds = self._here.memory_kinds
        kind = spec.memory_kind
        if kind is None or kinds is None or kind in kinds:
            return spec
        if kind not in self._memory_said:
            self._memory_said.add(kind)
            log.info(
                "loading %s: saved in memory kind %r, which the devices of %s do not offer "
                "(they offer %s): placed in their default memory; %s",
                self._directory,
                kind,
                self._here.where,
                sorted(kinds),
                _ADVICE,
            )
        return dataclasses.replace(spec, memory_kind=None)


def fitted_sizes(saved: tuple[int, ...], devices: int) -> tuple[int, ...]:
    """Per axis a divisor of its ``saved`` size, the product as large as fits in ``devices``;
    among equal products the earlier axes larger (the first found, searching larger divisors
    of earlier axes first)."""
    options = [sorted(_divisors(n), reverse=True) for n in saved]
    best: tuple[int, tuple[int, ...]] = (0, ())

    def walk(axis: int, product: int, chosen: tuple[int, ...]) -> bool:
        """True once a product of exactly ``devices`` is found (nothing can beat it)."""
        nonlocal best
        if axis == len(options):
            if product > best[0]:
                best = (product, chosen)
            return product == devices
        return any(
            walk(axis + 1, product * d, (*chosen, d))
            for d in options[axis]
            if product * d <= devices
        )

    walk(0, 1, ())
    return best[1]


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def ids_text(ids: tuple[int, ...]) -> str:
    """Device ids for a log line: ``0..7`` when consecutive, else the first few."""
    if len(ids) > 2 and ids == tuple(range(ids[0], ids[0] + len(ids))):
        return f"{ids[0]}..{ids[-1]}"
    return str(list(ids[:8]))[:-1] + (", ...]" if len(ids) > 8 else "]")
