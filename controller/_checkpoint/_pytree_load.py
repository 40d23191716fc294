"""Loading a pytree checkpointable, and describing one without reading array data.

A load reads the format files and array headers once (on the primary, shared with the other
controller processes), matches them against the abstract tree, plans one task per array
(device arrays for the hosts, NumPy arrays and scalars for the controller), runs the plans, and
assembles the result in the abstract tree's structure (or the saved one).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from milepost import _hosts, _progress, _tree, _views, workers
from milepost._checkpoint._anywhere import SavedShardings
from milepost._checkpoint._calls import LoadCall
from milepost._checkpoint._pytree_save import CONTROLLER, SCALAR_TYPES
from milepost._checkpoint._replicas import mark as mark_replicas
from milepost._errors import CheckpointNotFoundError, CorruptCheckpointError, StructureMismatchError
from milepost._tree import PLACEHOLDER, ValueType
from milepost.workers import ShardingSpec, StoragePath, progress
from milepost.workers import format as fmt

log = logging.getLogger("milepost")


@dataclass(frozen=True, kw_only=True)
class LeafMetadata:
    """What ``milepost.metadata`` reports for one leaf (no array data read).

    >>> leaf = milepost.metadata("/ckpt/100").tree["params"]["w"]
    >>> leaf.shape, leaf.dtype, leaf.nbytes
    ((1024, 1024), dtype('float32'), 4194304)
    """

    name: str
    """The key path, parts joined by '.' (``params.layer0.kernel``)."""
    value_type: ValueType
    """What the leaf is, in Orbax's words (``jax.Array``, ``np.ndarray``, ``scalar``,
    ``string``...)."""
    shape: tuple[int, ...] | None = None
    """The array's global shape (None for a scalar or a string)."""
    dtype: np.dtype | None = None
    """The array's dtype (None for a scalar or a string)."""
    sharding: ShardingSpec | None = None
    """How it was sharded when saved (None: a NumPy array, a scalar, or not recorded)."""
    write_shape: tuple[int, ...] | None = None
    """The shape of the boxes it was written in (a shard, or a replica's share of one)."""
    chunk_shape: tuple[int, ...] | None = None
    """The shape of its stored chunks (smaller than ``write_shape`` when subchunked)."""

    @property
    def nbytes(self) -> int | None:
        """Bytes of its values (None for strings and other leaves that are not arrays)."""
        if self.shape is None or self.dtype is None:
            return None
        # (a typed PRNG key's dtype is JAX's, not NumPy's: its itemsize is its key data's)
        itemsize = getattr(self.dtype, "itemsize", None) or np.dtype(self.dtype).itemsize
        return int(np.prod(self.shape, dtype=np.int64)) * int(itemsize)

    def __repr__(self) -> str:
        if self.shape is None:
            return f"LeafMetadata({self.name!r}: {self.value_type})"
        parts = [
            f"{self.name!r}: {self.value_type} {self.dtype}{_views.shape_str(self.shape)}",
            _views.human_bytes(self.nbytes),
        ]
        if self.sharding is not None:
            parts.append(f"sharding={_views.sharding_str(self.sharding)}")
        if self.write_shape is not None:
            parts.append(f"write_shape={_views.shape_str(self.write_shape)}")
        if self.chunk_shape is not None and self.chunk_shape != self.write_shape:
            parts.append(f"chunk_shape={_views.shape_str(self.chunk_shape)}")
        return f"LeafMetadata({', '.join(parts)})"

    def _repr_html_(self) -> str:
        return _views.html_table(_views.LEAF_COLUMNS, [_views.leaf_row(self)], title="LeafMetadata")


def header_shape_dtype(header: dict[str, Any]) -> tuple[tuple[int, ...], np.dtype]:
    return fmt.header_shape(header), np.dtype(jax.numpy.dtype(fmt.header_dtype_name(header)))


def array_headers(
    directory: StoragePath,
    files: fmt.TreeFiles,
    names: list[str],
    damaged: dict[str, Exception] | None = None,
) -> dict[str, dict[str, Any]]:
    """The ``zarr.json`` of each named array: through the root view with OCDBT (whose B-tree
    carries checksums), else as files (checked against the checkpoint's file checksums); each
    checked as :func:`milepost.workers.declared.zarr_header` says. ``damaged``: where to keep
    the error of each header that is not (by name) instead of raising it."""
    store = files.store(directory)
    if files.use_ocdbt:
        return fmt.read_array_headers(store, names, damaged)
    out = {}
    for name in names:
        where = directory / fmt.header_key(store, name)
        try:
            header = fmt.read_json_object(where, f"the header of array {name!r}")
            out[name] = workers.declared.zarr_header(header, name, str(where))
        except CorruptCheckpointError as e:
            if damaged is None:
                raise
            damaged[name] = e
        except CheckpointNotFoundError as e:
            raise CorruptCheckpointError(
                f"array {name!r} is listed in {directory / fmt.TREE_METADATA} but its data is "
                "missing; the checkpoint is damaged. Load an earlier checkpoint.",
                array=name,
                path=str(directory),
            ) from e
    return out


def tree_metadata(directory: StoragePath) -> Any:
    """The tree of :class:`LeafMetadata` (and empty containers), from metadata and headers."""
    files = fmt.read_tree(directory)
    arrays = [
        n
        for n, leaf in files.leaves.items()
        if leaf.value_type.is_array and n not in files.aggregated
    ]
    headers = array_headers(directory, files, arrays)
    built = []
    for name, saved in files.leaves.items():
        vt = saved.value_type
        leaf: Any
        if name in headers:
            try:
                shape, dtype = header_shape_dtype(headers[name])
                inner, grid = fmt.header_chunks(headers[name])
            except (KeyError, TypeError, ValueError, IndexError) as e:
                raise CorruptCheckpointError(
                    f"the header of array {name!r} in {directory} "
                    f"lacks {e}; the checkpoint is damaged"
                ) from e
            impl = files.key_impls.get(name)
            if impl is not None:  # typed PRNG keys: described as keys, not as their stored data
                shape, dtype = (
                    shape[: len(shape) - len(workers.key_words(impl))],
                    workers.dtype_of(f"key<{impl}>"),
                )
            leaf = LeafMetadata(
                name=name,
                value_type=vt,
                shape=shape,
                dtype=dtype,
                sharding=files.shardings.get(name),
                write_shape=grid,
                chunk_shape=inner,
            )
        elif vt.is_empty:
            leaf = vt.empty_value()
        elif isinstance(files.aggregated.get(name), np.ndarray):
            value = files.aggregated[name]
            leaf = LeafMetadata(name=name, value_type=vt, shape=value.shape, dtype=value.dtype)
        else:
            leaf = LeafMetadata(name=name, value_type=vt)
        built.append((saved.keys, leaf))
    return _tree.build_nested(built)


# ------------------------------------------------------------------------------------------
# Load
# ------------------------------------------------------------------------------------------


def _is_abstract_array(x: Any) -> bool:
    return (
        hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, np.ndarray | np.generic)
    )


@dataclass(frozen=True)
class _Target:
    """One leaf to produce: its key path, storage name and abstract value (None: as saved)."""

    keys: fmt.Keys
    name: str
    abstract: Any


def _targets(files: fmt.TreeFiles, abstract: Any, partial: bool) -> tuple[list[_Target], Any]:
    """The leaves to produce, and the abstract tree's treedef (None: rebuild the saved tree)."""
    if abstract is None:
        return [_Target(leaf.keys, n, None) for n, leaf in files.leaves.items()], None
    leaves, treedef = _tree.flatten(abstract)
    saved = list(files.leaves)
    wanted = {leaf.name for leaf in leaves}
    missing = [
        leaf.name
        for leaf in leaves
        if leaf.name not in files.leaves and leaf.value is not PLACEHOLDER
    ]
    extra = [n for n in saved if n not in wanted]
    if missing:
        raise StructureMismatchError(
            f"the abstract tree asks for {missing[:5]}{'...' if len(missing) > 5 else ''}, which "
            f"the checkpoint does not have (it has {saved[:8]}{'...' if len(saved) > 8 else ''}); "
            "fix the abstract tree or mark those leaves milepost.PLACEHOLDER"
        )
    if extra and not partial:
        raise StructureMismatchError(
            "the checkpoint has leaves the abstract tree lacks: "
            f"{extra[:5]}{'...' if len(extra) > 5 else ''}; pass partial=True to load only the "
            "leaves you give, or add them to the abstract tree"
        )
    return [_Target(leaf.keys, leaf.name, leaf.value) for leaf in leaves], treedef


def _task(
    files: fmt.TreeFiles,
    header: dict[str, Any],
    target: _Target,
    group: Any,
    saved: SavedShardings,
) -> workers.LoadTask:
    """How to read one array: shape, target dtype, and target sharding (None: a NumPy array;
    ``saved``: the saved shardings, placed on the group's devices)."""
    name, abstract = target.name, target.abstract
    shape, dtype = header_shape_dtype(header)
    impl = files.key_impls.get(name)
    if impl is not None and (
        abstract is None or (_is_abstract_array(abstract) and workers.is_key(abstract.dtype))
    ):
        return _key_task(files, header, target, impl, group, saved)
    if _is_abstract_array(abstract) and workers.is_key(abstract.dtype):
        raise StructureMismatchError(
            f"leaf {name!r}: the abstract tree asks for PRNG keys ({abstract.dtype}) but the "
            f"checkpoint holds a plain {dtype} array of shape {shape}; ask for that array "
            "(and wrap it with jax.random.wrap_key_data)"
        )
    sharding: Any = None
    if abstract is None:
        if files.leaves[name].value_type is ValueType.JAX_ARRAY:
            sharding = saved.sharding(
                name,
                f"array {name!r} was saved without a sharding milepost can rebuild; pass an "
                "abstract tree (jax.ShapeDtypeStruct with a sharding) to load it",
                shape,
            )
    elif _is_abstract_array(abstract):
        if tuple(abstract.shape) != shape:
            raise StructureMismatchError(
                f"leaf {name!r}: the abstract tree says shape "
                f"{tuple(abstract.shape)} but the checkpoint holds {shape}; fix the "
                "abstract shape (milepost reshards but does not reshape)"
            )
        dtype = np.dtype(abstract.dtype)
        sharding = getattr(abstract, "sharding", None)
        if sharding is None:  # no target sharding given: the saved one
            sharding = saved.sharding(
                name,
                f"leaf {name!r} has no sharding in the abstract tree and none was saved; give one",
                shape,
            )
        elif getattr(sharding, "milepost_spec", None) is not None:  # a slice sharding: ids only
            sharding = sharding.milepost_spec
    elif isinstance(abstract, np.ndarray):
        if tuple(abstract.shape) != shape:
            raise StructureMismatchError(
                f"leaf {name!r}: the abstract array has shape "
                f"{abstract.shape}, the checkpoint {shape}"
            )
        dtype = abstract.dtype
    return workers.LoadTask(
        name=name,
        shape=shape,
        dtype=np.dtype(dtype).name,
        sharding=concrete_sharding(sharding, group, name),
        checksums=recorded_checksums(files, name),
        chunk_tables=files.chunk_tables,
    )


def read_tree_files(directory: StoragePath) -> fmt.TreeFiles:
    files = fmt.read_tree(directory)
    if (files.chunk_crc32c or files.chunk_tables) and not fmt.verified():
        raise CorruptCheckpointError(
            f"{directory / fmt.MILEPOST_INFO} records chunk checksums, so this checkpoint was "
            f"written with file checksums too, but its {fmt.CHECKSUMS} is missing: the "
            "checkpoint is damaged. Load an earlier checkpoint."
        )
    return files


def _key_task(
    files: fmt.TreeFiles,
    header: dict[str, Any],
    target: _Target,
    impl: str,
    group: Any,
    saved: SavedShardings,
) -> workers.LoadTask:
    """Typed PRNG keys: read their stored key data, hand back keys of the saved implementation."""
    name, abstract = target.name, target.abstract
    shape, _ = header_shape_dtype(header)
    words = workers.key_words(impl)
    keys_shape = shape[: len(shape) - len(words)]
    if abstract is None:
        sharding: Any = saved.sharding(
            name,
            f"PRNG key array {name!r} was saved without a sharding milepost can rebuild; pass an "
            "abstract tree (jax.ShapeDtypeStruct with a sharding) to load it",
        )
    else:
        wanted = workers.key_impl_name(abstract.dtype)
        if wanted != impl:
            raise StructureMismatchError(
                f"leaf {name!r}: the abstract tree asks for {wanted} keys but the checkpoint holds "
                f"{impl} keys; ask for jax.random.key(..., impl={impl!r}) keys"
            )
        if tuple(abstract.shape) != keys_shape:
            raise StructureMismatchError(
                f"leaf {name!r}: the abstract tree asks for keys of shape {tuple(abstract.shape)} "
                f"but the checkpoint holds keys of shape {keys_shape}; fix the abstract shape"
            )
        sharding = getattr(abstract, "sharding", None)
        if sharding is None:
            sharding = saved.sharding(
                name,
                f"leaf {name!r} has no sharding in the abstract tree and none was saved; give one",
            )
        elif getattr(sharding, "milepost_spec", None) is not None:
            sharding = sharding.milepost_spec
    return workers.LoadTask(
        name=name,
        shape=shape,
        dtype="uint32",
        sharding=concrete_sharding(sharding, group, name),
        checksums=recorded_checksums(files, name),
        chunk_tables=files.chunk_tables,
        random_key_impl=impl,
    )


def concrete_sharding(sharding: Any, group: Any, name: str) -> Any:
    """A sharding the hosts can place shards with. One on an ``AbstractMesh`` (what
    ``jax.eval_shape`` and ``nnx.eval_shape`` give) is resolved against the group's devices of the
    same axis names and sizes."""
    mesh = getattr(sharding, "mesh", None)
    if not isinstance(mesh, jax.sharding.AbstractMesh):
        return sharding
    names, sizes = tuple(mesh.axis_names), tuple(int(n) for n in mesh.axis_sizes)
    try:
        ids = group.mesh_device_ids(names, sizes)
    except ValueError as e:
        raise StructureMismatchError(f"leaf {name!r}: {e}") from None
    spec = ShardingSpec.named(
        sizes, names, ids, tuple(sharding.spec), tuple(str(t) for t in mesh.axis_types)
    )
    memory_kind = getattr(sharding, "memory_kind", None)
    return (
        dataclasses.replace(spec, memory_kind=memory_kind)
        if memory_kind not in (None, "device")
        else spec
    )


def recorded_checksums(
    files: fmt.TreeFiles, name: str
) -> tuple[tuple[tuple[int, ...], int], ...] | None:
    recorded = files.chunk_crc32c.get(name)
    return tuple(sorted(recorded.items())) if recorded is not None else None


def load(directory: StoragePath, abstract: Any, call: LoadCall) -> Any:
    timeout = call.options.async_.timeout_secs
    group = call.group
    files = _hosts.shared(
        group, f"pytree-meta:{directory}", lambda: read_tree_files(directory), timeout
    )
    targets, treedef = _targets(files, abstract, call.partial)
    store = files.store(directory)
    array_names = [
        t.name
        for t in targets
        if t.abstract is not PLACEHOLDER
        and t.name in files.leaves
        and files.leaves[t.name].value_type.is_array
        and t.name not in files.aggregated
    ]
    headers = _hosts.shared(
        group,
        f"pytree-headers:{directory}",
        lambda: array_headers(directory, files, array_names),
        timeout,
    )

    device_tasks: list[workers.LoadTask] = []
    host_tasks: list[workers.LoadTask] = []
    saved = SavedShardings(files, group, directory)
    for t in targets:
        if t.abstract is not PLACEHOLDER and t.name in headers:
            task = _task(files, headers[t.name], t, group, saved)
            (host_tasks if task.sharding is None else device_tasks).append(task)

    loading = call.options.loading
    device_tasks = mark_replicas(device_tasks, loading, group)  # load-and-broadcast
    device_bytes = _progress.read_bytes(device_tasks, group)
    own_bytes = _progress.read_bytes(host_tasks, group)
    progress.expect(device_bytes + own_bytes)
    log.debug(
        "load plan for %s: %d arrays read by %d hosts (%d bytes), %d by the "
        "controller (%d bytes), memory budget %s per host",
        directory,
        len(device_tasks),
        len(group.processes()),
        device_bytes,
        len(host_tasks),
        own_bytes,
        loading.memory_budget_bytes,
    )

    def plan_of(tasks: list[workers.LoadTask]) -> workers.LoadPlan:
        return workers.LoadPlan(
            store=store,
            tasks=tuple(tasks),
            memory_budget_bytes=loading.memory_budget_bytes,
            fill_missing=files.fill_missing,
            direct_reads=loading.direct_reads,
        )

    values: dict[str, Any] = {}
    with workers.RUNTIME.scoped("controller-load", 1) as pool:
        own = (
            pool.submit(_hosts.controller_host().load, {CONTROLLER: plan_of(host_tasks)}, timeout)
            if host_tasks
            else None
        )
        if device_tasks:
            loaded = group.load(_plans_per_process(device_tasks, headers, group, plan_of), timeout)
            values.update(zip((t.name for t in device_tasks), loaded.arrays, strict=True))
        if own is not None:
            values.update(
                zip((t.name for t in host_tasks), own.result(timeout).arrays, strict=True)
            )
    return _assemble(files, directory, targets, treedef, values)


def _plans_per_process(
    tasks: list[workers.LoadTask], headers: dict[str, dict[str, Any]], group: Any, plan_of: Any
) -> dict[Any, workers.LoadPlan]:
    """Every process's load plan. Each host picks the boxes of its own devices from the tasks'
    shardings, so without recorded chunk checksums to trim per host every process gets the same
    plan, built once: the controller's work is O(arrays) plus a dict entry per host (a group
    sends one plan object shared by many hosts once, ``RayHostGroup.load``)."""
    if not any(t.checksums for t in tasks):
        plan = plan_of(tasks)
        return dict.fromkeys(group.processes(), plan)
    by_process = _checksums_per_process(tasks, headers, group)
    return {p: plan_of(mine) for p, mine in by_process.items()}


def _checksums_per_process(
    tasks: list[workers.LoadTask], headers: dict[str, dict[str, Any]], group: Any
) -> dict[Any, list[workers.LoadTask]]:
    """Each process's tasks, an array's recorded checksums trimmed to the chunks its devices'
    boxes touch: a host is sent the checksums it may check, not every chunk's (with 1 MiB bands
    that was an entry per MiB of checkpoint to every host). The work is the chunks each host
    touches, not chunks x hosts. Trimming too much cannot pass wrong data: a chunk read without
    its recorded checksum is an error (``_checksum.check``)."""
    processes = list(group.processes())
    if len(processes) == 1:
        return {processes[0]: tasks}
    out: dict[Any, list[workers.LoadTask]] = {p: [] for p in processes}
    boxes_seen: dict[Any, dict[Any, list[Any]]] = {}

    def boxes(sharding: Any, shape: tuple[int, ...]) -> dict[Any, list[Any]]:
        """process -> the distinct boxes its devices hold."""
        spec = sharding if isinstance(sharding, ShardingSpec) else ShardingSpec.from_jax(sharding)
        found: dict[Any, set[Any]] = {p: set() for p in processes}
        for device, box in spec.device_indices(shape).items():
            found[group.process_of_device(device)].add(box)
        return {p: sorted(mine) for p, mine in found.items()}

    for task in tasks:
        if task.checksums is None or task.sharding is None or not task.checksums:
            for p in processes:
                out[p].append(task)
            continue
        try:
            chunk = fmt.header_chunks(headers[task.name])[0]
            key = (task.sharding, task.shape)
            try:
                per_process = boxes_seen[key]
            except KeyError:
                per_process = boxes_seen[key] = boxes(task.sharding, task.shape)
            except TypeError:  # an unhashable sharding
                per_process = boxes(task.sharding, task.shape)
        except (
            Exception
        ) as e:  # a sharding or header this cannot describe: every host gets every checksum
            log.debug("array %r: checksums not trimmed per host (%s)", task.name, e)
            for p in processes:
                out[p].append(task)
            continue
        recorded = dict(task.checksums)
        for p in processes:
            touched: set[tuple[int, ...]] = set()
            for box in per_process[p]:
                # the chunk grid's block that overlaps the box
                spans = [
                    range(a // c, -(-min(b, n) // c))
                    for (a, b), c, n in zip(box, chunk, task.shape, strict=True)
                ]
                touched.update(itertools.product(*spans))
            kept = tuple((g, recorded[g]) for g in sorted(touched) if g in recorded)
            out[p].append(dataclasses.replace(task, checksums=kept))
    return out


def _assemble(
    files: fmt.TreeFiles,
    directory: StoragePath,
    targets: list[_Target],
    treedef: Any,
    values: dict[str, Any],
) -> Any:
    """The loaded tree, in the abstract tree's structure (``treedef``) or the saved one."""
    out: list[Any] = []
    for t in targets:
        if t.abstract is PLACEHOLDER:
            out.append(PLACEHOLDER)
            continue
        saved = files.leaves.get(t.name)
        vt = saved.value_type if saved is not None else None
        if t.name in values:
            value = values[t.name]
            if vt is ValueType.SCALAR and isinstance(value, np.ndarray):
                value = to_scalar(value, files.python_types.get(t.name), t.abstract)
        elif t.name in files.aggregated:
            value = _tree.value_as_abstract(
                files.aggregated[t.name], t.abstract, t.name, f"{directory / fmt.AGGREGATE}"
            )
        elif vt is ValueType.STRING:
            if t.name not in files.strings:
                raise CorruptCheckpointError(
                    f"string leaf {t.name!r} is missing from {directory / fmt.STRINGS}; the "
                    "checkpoint is damaged. Load an earlier checkpoint."
                )
            value = files.strings[t.name]
        elif t.abstract is not None:
            value = t.abstract
        elif vt is not None and vt.is_empty:
            value = vt.empty_value()
        else:
            value = None
        out.append((t.keys, value))
    if treedef is None:
        return _tree.build_nested(out)
    return _tree.unflatten(treedef, [v if v is PLACEHOLDER else v[1] for v in out])


def to_scalar(value: np.ndarray, python_type: str | None, abstract: Any) -> Any:
    if abstract is not None and isinstance(abstract, SCALAR_TYPES):
        target = type(abstract)
        return (
            target(value.item())
            if not isinstance(abstract, np.generic)
            else value.astype(abstract.dtype)[()]
        )
    if python_type is None:
        return value.item()
    if python_type.startswith("np."):
        return value.astype(python_type[3:])[()]
    return {"bool": bool, "int": int, "float": float, "complex": complex}.get(
        python_type, lambda v: v
    )(value.item())
