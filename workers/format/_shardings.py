"""The shardings of a pytree checkpointable's arrays, in milepost's form and in Orbax's.

Milepost records each distinct mesh once and, per array, its PartitionSpec and memory kind
(``"shardings"`` in ``_milepost.json``); Orbax's ``_sharding`` (base64(leaf name) -> the JSON of
its NamedSharding, the whole mesh per array) is written beside it while it stays under a bound
(``SaveOptions.orbax_sharding_max_bytes``). Reads take milepost's form when it is there, else
``_sharding`` (Orbax's checkpoints, older milepost's).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
from typing import Any

from milepost.workers import _declared as declared
from milepost.workers._errors import CorruptCheckpointError
from milepost.workers._paths import StoragePath
from milepost.workers._sharding import ShardingSpec
from milepost.workers.format._file_checksums import present, read_json_object
from milepost.workers.format._files import MILEPOST_INFO, SHARDING, write_file


def write_shardings(
    directory: StoragePath,
    shardings: dict[str, ShardingSpec],
    platform: str,
    orbax_max_bytes: int,
) -> dict[str, Any]:
    """Write ``_sharding`` if it comes to at most ``orbax_max_bytes``; return milepost's form
    (for ``_milepost.json``), which says whether it was written."""
    compact = compact_shardings(shardings)
    orbax = orbax_sharding_text(shardings, platform, orbax_max_bytes)
    compact["orbax_file"] = orbax is not None
    if orbax is not None:
        write_file(directory / SHARDING, orbax)
    return compact


def read_shardings(
    directory: StoragePath, info: dict[str, Any]
) -> tuple[dict[str, ShardingSpec], tuple[str, ...]]:
    """The arrays' shardings (``info``: ``_milepost.json`` as read), and the files they were
    recorded in (``_sharding`` counted when milepost's form says it was written)."""
    shardings: dict[str, ShardingSpec] = {}
    sharding_files: tuple[str, ...] = ()
    if "shardings" in info:  # milepost's compact form: Orbax's _sharding is not read
        shardings = read_compact_shardings(info["shardings"], directory / MILEPOST_INFO)
        orbax_file = info["shardings"].get("orbax_file", False)
        if not isinstance(orbax_file, bool):
            raise CorruptCheckpointError(
                f"{directory / MILEPOST_INFO} records shardings whose 'orbax_file' is "
                f"{_shown(orbax_file)}, not true or false; the checkpoint is damaged or crafted. "
                "Load an earlier checkpoint."
            )
        sharding_files = (MILEPOST_INFO, SHARDING) if orbax_file else (MILEPOST_INFO,)
    elif present(directory / SHARDING):
        sharding_files = (SHARDING,)
        # The leaves of a model share a few shardings, each listing every device id: parse each
        # distinct text once (with thousands of devices, parsing it per leaf took seconds).
        parsed: dict[str, ShardingSpec | None] = {}
        for encoded, text in read_json_object(directory / SHARDING, "sharding metadata").items():
            if not isinstance(text, str):
                raise TypeError(
                    f"the sharding of {encoded!r} is a {type(text).__name__}, not a JSON string"
                )
            if text not in parsed:
                try:
                    parsed[text] = ShardingSpec.from_orbax_json(text, str(directory / SHARDING))
                except CorruptCheckpointError:
                    raise
                except (ValueError, KeyError, TypeError):
                    parsed[text] = (
                        None  # a sharding kind we do not know: loading it needs an abstract tree
                    )
            spec = parsed[text]
            if spec is not None:
                shardings[base64.b64decode(encoded).decode()] = spec
    return shardings, sharding_files


SHARDINGS_VERSION = 1
"""The version of the compact sharding form in ``_milepost.json`` (``"shardings"``)."""


def compact_shardings(shardings: dict[str, ShardingSpec]) -> dict[str, Any]:
    """Milepost's form of the shardings: each distinct mesh once, and per array what is its own.

    ::

        {"version": 1,
         "meshes": [{"shape": [2, 4], "axis_names": ["data", "model"],
                     "axis_types": ["Auto", "Auto"], "device_ids": {"start": 0, "count": 8}}],
         "arrays": {"params.w": {"mesh": 0, "spec": ["data", null]},
                    "opt.mu": {"mesh": 0, "spec": [["data", "model"]],
                               "memory_kind": "pinned_host"},
                    "rng": {"device": 3}},
         "orbax_file": true}

    ``device_ids`` lists the mesh's ids in row-major order of ``shape``, or, when they are the
    consecutive ids ``start .. start + count - 1`` in that order, just those two numbers.
    ``orbax_file``: whether ``_sharding`` (Orbax's form) was written too.
    """
    meshes: list[dict[str, Any]] = []
    index: dict[tuple[Any, ...], int] = {}
    seen: dict[int, int] = {}  # id(spec) -> its mesh: the leaves of a model share a few specs
    arrays: dict[str, dict[str, Any]] = {}
    for name, spec in shardings.items():
        if spec.kind == "single":
            entry: dict[str, Any] = {"device": spec.device_ids[0]}
        else:
            mesh = seen.get(id(spec))
            if mesh is None:
                key = (spec.mesh_shape, spec.axis_names, spec.axis_types, spec.device_ids)
                mesh = index.get(key)
                if mesh is None:
                    mesh = index[key] = len(meshes)
                    meshes.append(_mesh_json(spec))
                seen[id(spec)] = mesh
            entry = {
                "mesh": mesh,
                "spec": [list(e) if isinstance(e, tuple) else e for e in spec.spec],
            }
        if spec.memory_kind:
            entry["memory_kind"] = spec.memory_kind
        arrays[name] = entry
    return {"version": SHARDINGS_VERSION, "meshes": meshes, "arrays": arrays}


def _mesh_json(spec: ShardingSpec) -> dict[str, Any]:
    ids = spec.device_ids
    first = ids[0] if ids else 0
    consecutive = ids == tuple(range(first, first + len(ids)))
    return {
        "shape": list(spec.mesh_shape),
        "axis_names": list(spec.axis_names),
        "axis_types": list(spec.axis_types),
        "device_ids": {"start": first, "count": len(ids)} if consecutive else list(ids),
    }


def orbax_sharding_text(
    shardings: dict[str, ShardingSpec], platform: str, max_bytes: int
) -> str | None:
    """``_sharding`` as ``json.dumps`` writes it, or None when it would exceed ``max_bytes``
    (found from the sizes of its parts, before it is put together: each distinct sharding is
    encoded once, and a large file is never built)."""
    encoded: dict[int, str] = {}  # id(spec) -> its JSON string value (the specs are kept alive)
    by_spec: dict[ShardingSpec, str] = {}
    parts: list[str] = []
    size = 2 + 2 * (len(shardings) - 1)  # the braces and the ", " between entries
    if size > max_bytes:
        return None
    for name, spec in shardings.items():
        value = encoded.get(id(spec))
        if value is None:
            value = by_spec.get(spec)
            if value is None:
                value = by_spec[spec] = json.dumps(spec.to_orbax_json(platform))
            encoded[id(spec)] = value
        part = f'"{base64.b64encode(name.encode()).decode()}": {value}'
        size += len(part)
        if size > max_bytes:
            return None
        parts.append(part)
    return "{" + ", ".join(parts) + "}"


_AXIS_TYPES = ("Auto", "Explicit", "Manual")
_MAX_ID = 2**62
"""The largest device id or mesh dimension a recorded sharding may hold."""


def read_compact_shardings(raw: Any, path: StoragePath) -> dict[str, ShardingSpec]:
    """The shardings of :func:`compact_shardings`'s form (``raw``, as read from ``path``); any
    entry that is not of that form is a :class:`CorruptCheckpointError` saying which and why."""
    read = _CompactReader(path)
    if not isinstance(raw, dict):
        raise read.bad(f"it is a {type(raw).__name__}, not an object")
    version = raw.get("version")
    if version != SHARDINGS_VERSION:
        raise read.bad(
            f"its version is {version!r}, and this milepost reads version {SHARDINGS_VERSION} "
            "(a later milepost may have written it: load it with that version)"
        )
    meshes_raw, arrays_raw = raw.get("meshes"), raw.get("arrays")
    if not isinstance(meshes_raw, list):
        raise read.bad(f"'meshes' is {_shown(meshes_raw)}, not a list")
    if not isinstance(arrays_raw, dict):
        raise read.bad(f"'arrays' is {_shown(arrays_raw)}, not an object")
    meshes = [read.mesh(mesh, f"mesh {i}") for i, mesh in enumerate(meshes_raw)]
    return {
        str(name): read.array(entry, f"the sharding of array {name!r}", meshes)
        for name, entry in arrays_raw.items()
    }


class _CompactReader:
    """The checks of :func:`read_compact_shardings`, each naming what it found where (``where``)
    in the file at ``path``."""

    def __init__(self, path: StoragePath) -> None:
        self.path = path

    def bad(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f'{self.path} records the arrays\' shardings ("shardings") in a form milepost cannot '
            f"use: {what}; the checkpoint is damaged or crafted, and nothing was loaded from it. "
            "Load an earlier checkpoint."
        )

    def integer(self, value: Any, what: str, minimum: int) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise self.bad(
                f"{what} is {declared.shown(value)}, not an integer of at least {minimum}"
            )
        if value > _MAX_ID:
            raise self.bad(f"{what} is {declared.shown(value)}, more than {_MAX_ID}")
        return value

    def strings(self, value: Any, what: str) -> tuple[str, ...]:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.bad(f"{what} is {_shown(value)}, not a list of strings")
        return tuple(value)

    def mesh(self, mesh: Any, where: str) -> ShardingSpec:
        """One entry of ``meshes``: its shape, axis names and types, and device ids."""
        if not isinstance(mesh, dict):
            raise self.bad(f"{where} is {_shown(mesh)}, not an object")
        shape_raw = mesh.get("shape")
        if not isinstance(shape_raw, list):
            raise self.bad(f"the shape of {where} is {_shown(shape_raw)}, not a list")
        shape = tuple(self.integer(n, f"a dimension of {where}", 1) for n in shape_raw)
        size = declared.devices(shape, str(self.path), f"the shape of {where}")
        names = self.strings(mesh.get("axis_names"), f"the axis names of {where}")
        types = self.strings(mesh.get("axis_types"), f"the axis types of {where}")
        if len(names) != len(shape) or len(types) != len(shape):
            raise self.bad(
                f"{where} has shape {list(shape)} but {len(names)} axis names and "
                f"{len(types)} axis types"
            )
        if len(set(names)) != len(names):
            raise self.bad(f"the axis names of {where} repeat: {list(names)}")
        if unknown := [t for t in types if t not in _AXIS_TYPES]:
            raise self.bad(f"{where} has axis types {unknown}, not one of {list(_AXIS_TYPES)}")
        ids = self.device_ids(mesh.get("device_ids"), where, shape, size)
        return ShardingSpec.named(shape, names, ids, (), types)

    def device_ids(
        self, ids_raw: Any, where: str, shape: tuple[int, ...], size: int
    ) -> tuple[int, ...]:
        """A mesh's device ids: a list of ids, or ``{"start", "count"}`` for a range."""
        if isinstance(ids_raw, dict) and set(ids_raw) == {"start", "count"}:
            start = self.integer(ids_raw["start"], f"the first device id of {where}", 0)
            count = self.integer(ids_raw["count"], f"the device count of {where}", 1)
            if count != size:
                raise self.bad(
                    f"{where} of shape {list(shape)} lists {count} device ids, not {size}"
                )
            ids = tuple(range(start, start + count))
        elif isinstance(ids_raw, list):
            ids = tuple(self.integer(d, f"a device id of {where}", 0) for d in ids_raw)
        else:
            raise self.bad(
                f"the device ids of {where} are {_shown(ids_raw)}, neither a list of ids nor "
                '{"start": <first id>, "count": <number of ids>}'
            )
        if len(ids) != math.prod(shape):
            raise self.bad(
                f"{where} of shape {list(shape)} lists {len(ids)} device ids, not "
                f"{math.prod(shape)}"
            )
        if len(set(ids)) != len(ids):
            raise self.bad(f"the device ids of {where} repeat")
        return ids

    def array(self, entry: Any, where: str, meshes: list[ShardingSpec]) -> ShardingSpec:
        """One entry of ``arrays``: a device, or a mesh of ``meshes`` and a PartitionSpec."""
        if not isinstance(entry, dict):
            raise self.bad(f"{where} is {_shown(entry)}, not an object")
        memory_kind = entry.get("memory_kind")
        if memory_kind is not None and not isinstance(memory_kind, str):
            raise self.bad(f"{where} has memory_kind {_shown(memory_kind)}, not a string")
        if "device" in entry:
            spec = ShardingSpec.single(self.integer(entry["device"], f"the device of {where}", 0))
        elif "mesh" in entry:
            spec = self.on_mesh(entry, where, meshes)
        else:
            raise self.bad(f"{where} names neither a mesh nor a device: {_shown(entry)}")
        return dataclasses.replace(spec, memory_kind=memory_kind) if memory_kind else spec

    def on_mesh(
        self, entry: dict[str, Any], where: str, meshes: list[ShardingSpec]
    ) -> ShardingSpec:
        m = entry["mesh"]
        if not isinstance(m, int) or isinstance(m, bool) or not 0 <= m < len(meshes):
            raise self.bad(
                f"{where} refers to mesh {m!r}, and the file records {len(meshes)} "
                f"mesh(es) (0 to {len(meshes) - 1})"
            )
        entries = entry.get("spec")
        if not isinstance(entries, list) or not all(
            e is None
            or isinstance(e, str)
            or (isinstance(e, list) and all(isinstance(a, str) for a in e))
            for e in entries
        ):
            raise self.bad(
                f"{where} has the PartitionSpec {_shown(entries)}, not a list of null, "
                "axis names and lists of axis names"
            )
        try:
            return meshes[m].with_spec(entries)
        except ValueError as e:
            raise self.bad(f"{where}: {e}") from None


def _shown(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
