"""The PyTree checkpointable: a tree of arrays, scalars and strings in the Orbax v1 layout."""

from __future__ import annotations

import base64
import contextlib
import json
from collections import defaultdict
from collections.abc import Callable, Mapping
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from milepost import _dispatch, _planning, _tree, workers
from milepost import _format as fmt
from milepost._errors import (
    CorruptCheckpointError,
    InvalidKeyError,
    StructureMismatchError,
    UnsupportedLeafError,
)
from milepost._tree import PLACEHOLDER, Leaf
from milepost.workers import ShardingSpec

CONTROLLER = "controller"
"""Name of the store the controller writes its own (host-memory) leaves into."""

_SCALAR_TYPES = (bool, int, float, complex, np.generic)


@dataclass(frozen=True, kw_only=True)
class LeafMetadata:
    """What ``milepost.metadata`` reports for one leaf (no array data read)."""

    name: str
    value_type: str
    shape: tuple[int, ...] | None = None
    dtype: np.dtype | None = None
    sharding: ShardingSpec | None = None
    write_shape: tuple[int, ...] | None = None
    chunk_shape: tuple[int, ...] | None = None


def value_type(value: Any) -> str:
    if hasattr(value, "__milepost_host_group__") or isinstance(value, jax.Array):
        return "jax.Array"
    if isinstance(value, np.ndarray):
        return "np.ndarray"
    if isinstance(value, _SCALAR_TYPES):
        return "scalar"
    if isinstance(value, str):
        return "string"
    if _tree.is_empty_node(value):
        return _tree.empty_value_type(value)
    raise UnsupportedLeafError(
        f"cannot save a leaf of type {type(value).__module__}.{type(value).__qualname__}; milepost saves jax.Array, "
        "np.ndarray, Python/NumPy scalars, str, None and empty containers. Convert the leaf (e.g. np.asarray(x)), "
        "register it as a pytree node, or save it in its own checkpointable with a handler."
    )


def _scalar_array(value: Any) -> np.ndarray:
    if isinstance(value, np.generic):
        return np.asarray(value)
    if isinstance(value, bool):
        return np.asarray(value, dtype=np.bool_)
    if isinstance(value, int):
        try:
            return np.asarray(value, dtype=np.int64)
        except OverflowError as e:
            raise UnsupportedLeafError(f"the int {value} does not fit in int64; save it as a string or an array") from e
    if isinstance(value, float):
        return np.asarray(value, dtype=np.float64)
    return np.asarray(value, dtype=np.complex128)


def _python_type(value: Any) -> str:
    if isinstance(value, np.generic):
        return f"np.{value.dtype.name}"
    return type(value).__name__


# ------------------------------------------------------------------------------------------
# Save
# ------------------------------------------------------------------------------------------


def _named(leaf: Leaf, fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn``; an UnsupportedLeafError it raises names the leaf."""
    try:
        return fn(*args)
    except UnsupportedLeafError as e:
        if repr(leaf.name) in str(e):
            raise
        raise UnsupportedLeafError(f"leaf {leaf.name!r}: {e}") from None


def _check_dtype(name: str, dtype: np.dtype) -> None:
    if np.dtype(dtype).name not in workers.ZARR3_DTYPES:
        raise UnsupportedLeafError(
            f"leaf {name!r} has dtype {np.dtype(dtype).name}, which the zarr3 format cannot store "
            f"(it stores {', '.join(sorted(workers.ZARR3_DTYPES))}); cast the leaf to one of those before saving"
        )


_PLAIN_ZARR3_RESERVED = frozenset({fmt.TREE_METADATA, fmt.SHARDING, fmt.STRINGS, fmt.MILEPOST_INFO, fmt.ARRAY_METADATAS})


def _check_plain_zarr3_names(leaves: list[Leaf], kinds: list[str]) -> None:
    """Plain zarr3 stores each array in a folder named after its leaf: that folder must not be
    one of the checkpointable's metadata files."""
    for leaf, kind in zip(leaves, kinds, strict=True):
        if kind in ("jax.Array", "np.ndarray", "scalar") and leaf.name in _PLAIN_ZARR3_RESERVED:
            raise InvalidKeyError(
                f"leaf {leaf.name!r} would be stored in a folder with the name of a metadata file, which plain zarr3 "
                "(SaveOptions(use_ocdbt=False)) cannot do; rename the key, or save with use_ocdbt=True (the default)"
            )


class PyTreeSave:
    """A planned save of one tree: ``stage`` does the blocking part, ``finish`` the rest."""

    def __init__(self, tree: Any, call: Any) -> None:
        self.call = call
        self.options = call.options.saving
        self.group = call.group
        self.leaves, _ = _tree.flatten(tree)
        self.kinds = [_named(leaf, value_type, leaf.value) for leaf in self.leaves]
        if not self.options.use_ocdbt:
            _check_plain_zarr3_names(self.leaves, self.kinds)
        self.host_plans: dict[int, list[workers.SaveTask]] = defaultdict(list)
        self.host_sources: list[Any] = []
        self.controller_tasks: list[workers.SaveTask] = []
        self.controller_sources: list[Any] = []
        self.write_shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self.shardings: dict[str, ShardingSpec] = {}
        self.strings: dict[str, str] = {}
        self.python_types: dict[str, str] = {}
        for leaf, kind in zip(self.leaves, self.kinds, strict=True):
            _named(leaf, self._plan_leaf, leaf, kind)

    def _plan_leaf(self, leaf: Leaf, kind: str) -> None:
        value = leaf.value
        if kind == "jax.Array":
            self._plan_device_array(leaf)
        elif kind in ("np.ndarray", "scalar"):
            array = np.asarray(value) if kind == "np.ndarray" else _scalar_array(value)
            if array.dtype.kind in "OUS":
                raise UnsupportedLeafError(
                    f"leaf {leaf.name!r} is a NumPy array of dtype {array.dtype}, which has no on-disk form; "
                    "save numeric arrays, or strings as str leaves"
                )
            _check_dtype(leaf.name, array.dtype)
            if kind == "scalar":
                self.python_types[leaf.name] = _python_type(value)
            spec = _planning.host_array_spec(leaf.name, array, self.options.compression, self.options.chunk_byte_size)
            box = tuple((0, n) for n in array.shape)
            regions = (workers.Region(device_id=-1, index=box),) if array.size else ()
            self.controller_tasks.append(
                workers.SaveTask(source=len(self.controller_sources), spec=spec, regions=regions, create=True)
            )
            self.controller_sources.append(array)
            self.write_shapes[leaf.name] = (spec.write_shape, spec.chunk_shape)
        elif kind == "string":
            self.strings[leaf.name] = value
        elif isinstance(value, tuple) and kind == "Tuple":
            self.python_types[leaf.name] = "tuple"

    def _plan_device_array(self, leaf: Leaf) -> None:
        value = leaf.value
        is_deleted = getattr(value, "is_deleted", None)
        if callable(is_deleted) and is_deleted():
            raise ValueError(
                f"leaf {leaf.name!r} is a deleted jax.Array (deleted, or donated to a jitted function); "
                "save it before donating it, or save the array the computation returned"
            )
        shape = tuple(value.shape)
        dtype = np.dtype(value.dtype)
        if dtype.kind in "OUS":
            raise UnsupportedLeafError(f"leaf {leaf.name!r} has dtype {dtype}, which has no on-disk form")
        _check_dtype(leaf.name, dtype)
        spec = _planning.sharding_spec(value.sharding)
        if spec is not None:
            self.shardings[leaf.name] = spec
        boxes = _planning.device_boxes(value.sharding, shape)
        write_shape, regions = _planning.write_regions(boxes, self.options.replica_parallel)
        if not all(n for n in shape):
            regions = []
        chunk_shape = _planning.inner_chunk_shape(write_shape, dtype.itemsize, self.options.chunk_byte_size)
        array_spec = workers.ArraySpec(
            name=leaf.name,
            shape=shape,
            dtype=dtype.name,
            write_shape=write_shape,
            chunk_shape=chunk_shape,
            compression=self.options.compression,
        )
        self.write_shapes[leaf.name] = (write_shape, chunk_shape)
        source = len(self.host_sources)
        self.host_sources.append(value)
        by_process: dict[int, list[workers.Region]] = defaultdict(list)
        for region in regions:
            by_process[self.group.process_of_device(region.device_id)].append(region)
        if not by_process:  # zero-size: someone must still create the array's metadata
            by_process[self.group.processes()[0]] = []
        for process, mine in by_process.items():
            self.host_plans[process].append(
                workers.SaveTask(source=source, spec=array_spec, regions=tuple(mine), create=not mine)
            )

    # -- the blocking part --------------------------------------------------------------
    def stage(self, directory: Path, copy: bool) -> Callable[[], None]:
        store = workers.StoreSpec(directory=str(directory), use_ocdbt=self.options.use_ocdbt)
        writers = self.options.ocdbt_writers_per_host
        timeout = self.call.options.async_.timeout_secs
        pending_hosts = None
        if self.host_plans:
            plans = {
                p: workers.SavePlan(store=store, process_index=p, tasks=tuple(tasks), copy=copy, writers=writers)
                for p, tasks in self.host_plans.items()
            }
            pending_hosts = self.group.start_save(plans, self.host_sources, timeout)
        pending_local = None

        def settle() -> None:
            """After a failure: wait for the writes issued here (outcome ignored), so that none
            lands after the temporary directory is removed. Local only: no host coordination."""
            for pending in (pending_hosts, pending_local):
                if getattr(pending, "settle", None) is not None:
                    with contextlib.suppress(Exception):
                        pending.settle(timeout)  # type: ignore[union-attr]

        try:
            if self.controller_tasks and self.group.is_primary():
                plan = workers.SavePlan(
                    store=store, process_index=CONTROLLER, tasks=tuple(self.controller_tasks), copy=copy, writers=writers  # type: ignore[arg-type]
                )
                pending_local = workers.start_save(plan, self.controller_sources)
        except BaseException:
            settle()
            raise
        self.controller_sources = []

        def finish() -> None:
            try:
                if pending_hosts is not None:
                    pending_hosts.wait(timeout)
            except BaseException:
                settle()
                raise
            self.group.barrier(f"pytree-written:{directory}", timeout)
            if self.group.is_primary():
                # The controller's own leaves and the metadata: a failure here is the primary's
                # alone; it reaches the other controller processes through the commit outcome.
                try:
                    if pending_local is not None:
                        pending_local.wait(timeout)
                except BaseException:
                    settle()
                    raise
                self._write_metadata(directory, store)

        finish.settle = settle  # type: ignore[attr-defined]
        return finish

    def _write_metadata(self, directory: Path, store: workers.StoreSpec) -> None:
        tree_metadata: dict[str, Any] = {}
        for leaf, kind in zip(self.leaves, self.kinds, strict=True):
            value_metadata: dict[str, Any] = {"value_type": kind, "skip_deserialize": _tree.is_empty_node(leaf.value)}
            if kind == "jax.Array":
                value_metadata["write_shape"] = list(self.write_shapes[leaf.name][0])
            tree_metadata[leaf.tuple_key] = {
                "key_metadata": [{"key": k, "key_type": t} for k, t in leaf.keys],
                "value_metadata": value_metadata,
            }
        fmt.write_json(
            directory / fmt.TREE_METADATA,
            {
                "tree_metadata": tree_metadata,
                "use_ocdbt": self.options.use_ocdbt,
                "use_zarr3": True,
                "store_array_data_equal_to_fill_value": True,
                "custom_metadata": None,
            },
        )
        platform = jax.devices()[0].platform if jax.device_count() else "cpu"
        if self.shardings:
            fmt.write_json(
                directory / fmt.SHARDING,
                {
                    base64.b64encode(name.encode()).decode(): spec.to_orbax_json(platform)
                    for name, spec in self.shardings.items()
                },
            )
        if self.strings:
            fmt.write_json(directory / fmt.STRINGS, self.strings)
        if self.python_types:
            fmt.write_json(directory / fmt.MILEPOST_INFO, {"python_types": self.python_types})
        array_dir = directory / fmt.ARRAY_METADATAS
        array_dir.mkdir(exist_ok=True)
        for process, tasks in sorted(self.host_plans.items()):
            entries = [
                {
                    "array_metadata": {
                        "param_name": t.spec.name,
                        "write_shape": list(t.spec.write_shape),
                        "chunk_shape": list(t.spec.chunk_shape),
                        "ext_metadata": None,
                    }
                }
                for t in tasks
            ]
            fmt.write_json(array_dir / f"process_{process}", {"array_metadatas": entries})
        if store.use_ocdbt:
            merge_ocdbt(directory)


def merge_ocdbt(directory: Path) -> None:
    """Make the root OCDBT view reference every per-process store (no data is copied)."""
    children = sorted(p for p in directory.glob(f"{workers.PROCESS_PREFIX}*") if p.is_dir())
    if not children:
        return
    context = ts.Context()
    root_spec = workers.merge_kvstore(workers.StoreSpec(directory=str(directory)))
    parent = ts.KvStore.open(root_spec, context=context).result()
    opened = [
        ts.KvStore.open({"driver": "ocdbt", "base": {"driver": "file", "path": str(c) + "/"}}, context=context)
        for c in children
    ]
    txn = ts.Transaction(atomic=True)
    copies = [o.result().experimental_copy_range_to(parent.with_transaction(txn)) for o in opened]
    for c in copies:
        c.result()
    txn.commit_async().result()


# ------------------------------------------------------------------------------------------
# Load and metadata
# ------------------------------------------------------------------------------------------


@dataclass
class _Saved:
    """The small metadata files of one pytree checkpointable."""

    directory: Path
    use_ocdbt: bool
    entries: dict[str, dict[str, Any]]  # storage name -> {keys, value_type, write_shape}
    order: list[str]
    shardings: dict[str, ShardingSpec]
    strings: dict[str, str]
    python_types: dict[str, str]
    fill_missing: bool = False
    """True for checkpoints written without every chunk (``store_array_data_equal_to_fill_value``
    false): a missing chunk then means zeros. Milepost and Orbax 0.12 write every chunk, so a
    missing one is lost data and reading it fails."""

    @property
    def store(self) -> workers.StoreSpec:
        return workers.StoreSpec(directory=str(self.directory), use_ocdbt=self.use_ocdbt)


def read_saved(directory: Path) -> _Saved:
    try:
        return _read_saved(directory)
    except CorruptCheckpointError:
        raise
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise CorruptCheckpointError(
            f"the metadata files in {directory} ({fmt.TREE_METADATA}, {fmt.SHARDING}, {fmt.STRINGS}) do not have the "
            f"expected form ({type(e).__name__}: {e}); the checkpoint is damaged. Load an earlier checkpoint."
        ) from e


def _json_object(path: Path, what: str) -> dict[str, Any]:
    value = fmt.read_json(path, what)
    if not isinstance(value, dict):
        raise CorruptCheckpointError(f"{what} {path} is not a JSON object; the checkpoint is damaged. Load an earlier checkpoint.")
    return value


def _read_saved(directory: Path) -> _Saved:
    meta = fmt.read_json(directory / fmt.TREE_METADATA, "tree metadata")
    if not isinstance(meta, dict) or not isinstance(meta.get("tree_metadata"), dict):
        raise CorruptCheckpointError(f"{directory / fmt.TREE_METADATA} has no 'tree_metadata'; the checkpoint is damaged or not a pytree")
    entries: dict[str, dict[str, Any]] = {}
    order: list[str] = []
    for item in meta["tree_metadata"].values():
        keys = tuple((str(k["key"]), int(k["key_type"])) for k in item["key_metadata"])
        name = ".".join(k for k, _ in keys) if keys else "_root"
        entries[name] = {"keys": keys, **item["value_metadata"]}
        order.append(name)
    shardings: dict[str, ShardingSpec] = {}
    if (directory / fmt.SHARDING).exists():
        for encoded, text in _json_object(directory / fmt.SHARDING, "sharding metadata").items():
            if not isinstance(text, str):
                raise TypeError(f"the sharding of {encoded!r} is a {type(text).__name__}, not a JSON string")
            try:
                shardings[base64.b64decode(encoded).decode()] = ShardingSpec.from_orbax_json(text)
            except (ValueError, KeyError):
                continue  # a sharding kind we do not know: loading it needs an abstract tree
    strings = _json_object(directory / fmt.STRINGS, "string leaves") if (directory / fmt.STRINGS).exists() else {}
    info = _json_object(directory / fmt.MILEPOST_INFO, "milepost info") if (directory / fmt.MILEPOST_INFO).exists() else {}
    use_ocdbt = bool(meta.get("use_ocdbt", True))
    fill_missing = not meta.get("store_array_data_equal_to_fill_value", False)
    return _Saved(directory, use_ocdbt, entries, order, shardings, strings, info.get("python_types", {}), fill_missing)


def read_array_headers(saved: _Saved, names: list[str]) -> dict[str, dict[str, Any]]:
    """zarr.json of each named array (small reads through the root view)."""
    if not names:
        return {}
    spec = workers.read_kvstore(saved.store)
    if spec["driver"] == "file":
        kv = ts.KvStore.open({"driver": "file", "path": str(saved.directory) + "/"}).result()
    else:
        kv = ts.KvStore.open(spec).result()
    reads = {n: kv.read(f"{n}/zarr.json") for n in names}
    out = {}
    for n, r in reads.items():
        res = r.result()
        if res.state != "value":
            raise CorruptCheckpointError(
                f"array {n!r} is listed in {saved.directory / fmt.TREE_METADATA} but its data is missing; the checkpoint "
                "is damaged or was not merged. Load an earlier checkpoint."
            )
        out[n] = json.loads(res.value)
    return out


def _header_shape_dtype(header: dict[str, Any]) -> tuple[tuple[int, ...], np.dtype]:
    return tuple(header["shape"]), np.dtype(jax.numpy.dtype(header["data_type"]))


def metadata(directory: Path) -> Any:
    saved = read_saved(directory)
    arrays = [n for n in saved.order if saved.entries[n]["value_type"] in ("jax.Array", "np.ndarray", "scalar")]
    headers = read_array_headers(saved, arrays)
    built = []
    for name in saved.order:
        e = saved.entries[name]
        vt = e["value_type"]
        if name in headers:
            shape, dtype = _header_shape_dtype(headers[name])
            grid = tuple(headers[name]["chunk_grid"]["configuration"]["chunk_shape"])
            codec = headers[name]["codecs"][0]
            inner = tuple(codec["configuration"]["chunk_shape"]) if codec.get("name") == "sharding_indexed" else grid
            leaf: Any = LeafMetadata(
                name=name, value_type=vt, shape=shape, dtype=dtype, sharding=saved.shardings.get(name),
                write_shape=grid, chunk_shape=inner,
            )
        elif vt == "string":
            leaf = LeafMetadata(name=name, value_type=vt)
        else:
            leaf = _tree.empty_from_value_type(vt) if vt in ("None", "Dict", "List", "Tuple", "NamedTuple") else LeafMetadata(name=name, value_type=vt)
        built.append((e["keys"], leaf))
    return _tree.build_nested(built)


def _is_abstract_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, np.ndarray | np.generic)


def load(directory: Path, abstract: Any, partial: bool, call: Any) -> Any:
    timeout = call.options.async_.timeout_secs
    saved = _dispatch.shared(call.group, f"pytree-meta:{directory}", lambda: read_saved(directory), timeout)
    if abstract is None:
        targets = [(saved.entries[n]["keys"], n, None) for n in saved.order]
        treedef = None
    else:
        leaves, treedef = _tree.flatten(abstract)
        targets = [(leaf.keys, leaf.name, leaf.value) for leaf in leaves]
        wanted = {leaf.name for leaf in leaves}
        missing = [leaf.name for leaf in leaves if leaf.name not in saved.entries and leaf.value is not PLACEHOLDER]
        extra = [n for n in saved.order if n not in wanted]
        if missing:
            raise StructureMismatchError(
                f"the abstract tree asks for {missing[:5]}{'...' if len(missing) > 5 else ''}, which the checkpoint does "
                f"not have (it has {saved.order[:8]}{'...' if len(saved.order) > 8 else ''}); fix the abstract tree or "
                "mark those leaves milepost.PLACEHOLDER"
            )
        if extra and not partial:
            raise StructureMismatchError(
                f"the checkpoint has leaves the abstract tree lacks: {extra[:5]}{'...' if len(extra) > 5 else ''}; "
                "pass partial=True to load only the leaves you give, or add them to the abstract tree"
            )
    array_names = [
        n for _k, n, a in targets
        if a is not PLACEHOLDER and n in saved.entries and saved.entries[n]["value_type"] in ("jax.Array", "np.ndarray", "scalar")
    ]
    headers = _dispatch.shared(
        call.group, f"pytree-headers:{directory}", lambda: read_array_headers(saved, array_names), timeout
    )

    device_tasks: list[workers.LoadTask] = []
    host_tasks: list[workers.LoadTask] = []
    slots: dict[str, tuple[str, int]] = {}
    for _keys, name, abst in targets:
        if abst is PLACEHOLDER or name not in headers:
            continue
        vt = saved.entries[name]["value_type"]
        shape, saved_dtype = _header_shape_dtype(headers[name])
        sharding: Any = None
        dtype = saved_dtype
        if abst is None:
            if vt == "jax.Array":
                spec = saved.shardings.get(name)
                if spec is None:
                    raise StructureMismatchError(
                        f"array {name!r} was saved without a sharding milepost can rebuild; pass an abstract tree "
                        "(jax.ShapeDtypeStruct with a sharding) to load it"
                    )
                call.group.check_devices(spec, name)
                sharding = spec
        elif _is_abstract_array(abst):
            if tuple(abst.shape) != shape:
                raise StructureMismatchError(
                    f"leaf {name!r}: the abstract tree says shape {tuple(abst.shape)} but the checkpoint holds {shape}; "
                    "fix the abstract shape (milepost reshards but does not reshape)"
                )
            dtype = np.dtype(abst.dtype)
            sharding = getattr(abst, "sharding", None)
            if sharding is None:  # no target sharding given: the saved one
                spec = saved.shardings.get(name)
                if spec is None:
                    raise StructureMismatchError(f"leaf {name!r} has no sharding in the abstract tree and none was saved; give one")
                call.group.check_devices(spec, name)
                sharding = spec
            elif getattr(sharding, "milepost_spec", None) is not None:  # a slice sharding: ids only
                sharding = sharding.milepost_spec
        elif isinstance(abst, np.ndarray):
            if tuple(abst.shape) != shape:
                raise StructureMismatchError(f"leaf {name!r}: the abstract array has shape {abst.shape}, the checkpoint {shape}")
            dtype = abst.dtype
        task = workers.LoadTask(name=name, shape=shape, dtype=np.dtype(dtype).name, sharding=sharding)
        if sharding is None:
            slots[name] = ("host", len(host_tasks))
            host_tasks.append(task)
        else:
            slots[name] = ("device", len(device_tasks))
            device_tasks.append(task)

    loading = call.options.loading
    budget = loading.memory_budget_bytes
    with futures.ThreadPoolExecutor(1) as pool:
        host_future = pool.submit(
            workers.load,
            workers.LoadPlan(
                store=saved.store, tasks=tuple(host_tasks), memory_budget_bytes=budget, fill_missing=saved.fill_missing,
                direct_reads=loading.direct_reads,
            ),
        ) if host_tasks else None
        device_values: list[Any] = []
        if device_tasks:
            plan = workers.LoadPlan(
                store=saved.store, tasks=tuple(device_tasks), memory_budget_bytes=budget, fill_missing=saved.fill_missing,
                direct_reads=loading.direct_reads,
            )
            device_values = call.group.load({p: plan for p in call.group.processes()}, timeout)
        host_values = host_future.result(timeout) if host_future is not None else []

    out_values = []
    for keys, name, abst in targets:
        if abst is PLACEHOLDER:
            out_values.append(PLACEHOLDER)
            continue
        entry = saved.entries.get(name)
        vt = entry["value_type"] if entry else None
        if name in slots:
            where, i = slots[name]
            value = device_values[i] if where == "device" else host_values[i]
            if vt == "scalar" and where == "host":
                value = _to_scalar(value, saved.python_types.get(name), abst)
            out_values.append((keys, value))
        elif vt == "string":
            if name not in saved.strings:
                raise CorruptCheckpointError(
                    f"string leaf {name!r} is missing from {saved.directory / fmt.STRINGS}; the checkpoint is damaged. "
                    "Load an earlier checkpoint."
                )
            out_values.append((keys, saved.strings[name]))
        else:
            out_values.append((keys, abst if abst is not None else _empty(vt, saved.python_types.get(name))))
    if treedef is None:
        return _tree.build_nested(out_values)
    return _tree.unflatten(treedef, [v if v is PLACEHOLDER else v[1] for v in out_values])


def _empty(vt: str | None, python_type: str | None) -> Any:
    if vt in ("None", "Dict", "List", "Tuple", "NamedTuple"):
        return _tree.empty_from_value_type(vt)
    return None


def _to_scalar(value: np.ndarray, python_type: str | None, abstract: Any) -> Any:
    if abstract is not None and isinstance(abstract, _SCALAR_TYPES):
        target = type(abstract)
        return target(value.item()) if not isinstance(abstract, np.generic) else value.astype(abstract.dtype)[()]
    if python_type is None:
        return value.item()
    if python_type.startswith("np."):
        return value.astype(python_type[3:])[()]
    return {"bool": bool, "int": int, "float": float, "complex": complex}.get(python_type, lambda v: v)(value.item())


def leaf_names(tree: Any) -> Mapping[str, Any]:
    leaves, _ = _tree.flatten(tree)
    return {leaf.name: leaf.value for leaf in leaves}
