"""Saving a pytree checkpointable: plan it (blocking, on the controller), stage it on the hosts
(blocking), then wait for the writes (background); the commit writes its format files and merges
its databases (``_commit``).

``plan`` decides, per leaf, where its bytes go: device arrays to the hosts that hold their
shards (``ocdbt.process_<i>``), NumPy arrays and scalars to the controller's own store
(``ocdbt.process_controller``), strings and empty containers into the format files. ``start``
hands the plans to the host groups and returns a :class:`PendingTree`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from milepost import _hosts, _options, _tree, workers
from milepost._checkpoint import _planning
from milepost._checkpoint._calls import SaveCall, WrittenTree
from milepost._errors import InvalidKeyError, UnsupportedLeafError
from milepost._options import SaveOptions
from milepost._tree import Leaf, ValueType
from milepost.colocated import HostGroup
from milepost.workers import StoragePath, progress
from milepost.workers import format as fmt

log = logging.getLogger("milepost")

CONTROLLER = _hosts.CONTROLLER
"""Name of the store the controller writes its own (host-memory) leaves into."""

SCALAR_TYPES = (bool, int, float, complex, np.generic)


def value_type(value: Any) -> ValueType:
    if hasattr(value, "__milepost_host_group__") or isinstance(value, jax.Array):
        return ValueType.JAX_ARRAY
    if isinstance(value, np.ndarray):
        return ValueType.NP_ARRAY
    if isinstance(value, SCALAR_TYPES):
        return ValueType.SCALAR
    if isinstance(value, str):
        return ValueType.STRING
    if _tree.is_empty_node(value):
        return _tree.empty_value_type(value)
    raise UnsupportedLeafError(
        f"cannot save a leaf of type {type(value).__module__}.{type(value).__qualname__}; "
        "milepost saves jax.Array, np.ndarray, Python/NumPy scalars, str, None and empty "
        "containers. Convert the leaf (e.g. np.asarray(x)), register it as a pytree node, or save "
        "it in its own checkpointable with a handler."
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
            raise UnsupportedLeafError(
                f"the int {value} does not fit in int64; save it as a string or an array"
            ) from e
    if isinstance(value, float):
        return np.asarray(value, dtype=np.float64)
    return np.asarray(value, dtype=np.complex128)


def _python_type(value: Any) -> str:
    if isinstance(value, np.generic):
        return f"np.{value.dtype.name}"
    return type(value).__name__


def _named(leaf: Leaf, fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn``; an UnsupportedLeafError it raises names the leaf."""
    try:
        return fn(*args)
    except UnsupportedLeafError as e:
        if e.leaf == leaf.name:
            raise
        raise UnsupportedLeafError(f"leaf {leaf.name!r}: {e}", leaf=leaf.name) from None


def _check_dtype(name: str, dtype: np.dtype) -> None:
    if dtype.kind in "OUS":
        raise UnsupportedLeafError(
            f"leaf {name!r} has dtype {dtype}, which has no on-disk form; "
            "save numeric arrays, or strings as str leaves",
            leaf=name,
        )
    if dtype.name not in fmt.ZARR3_DTYPES:
        raise UnsupportedLeafError(
            f"leaf {name!r} has dtype {dtype.name}, which the zarr3 format cannot "
            f"store (it stores {', '.join(sorted(fmt.ZARR3_DTYPES))}); cast "
            "the leaf to one of those before saving",
            leaf=name,
        )


_PLAIN_ZARR3_RESERVED = frozenset(
    {fmt.TREE_METADATA, fmt.SHARDING, fmt.STRINGS, fmt.MILEPOST_INFO, fmt.ARRAY_METADATAS}
)


@dataclass
class TreeSavePlan:
    """Where every leaf of one tree goes."""

    options: SaveOptions
    leaves: dict[str, fmt.SavedLeaf] = field(default_factory=dict)
    shardings: dict[str, workers.ShardingSpec] = field(default_factory=dict)
    strings: dict[str, str] = field(default_factory=dict)
    python_types: dict[str, str] = field(default_factory=dict)
    key_impls: dict[str, str] = field(default_factory=dict)
    """Typed PRNG key leaves: their implementation."""
    host_tasks: dict[int | str, list[workers.SaveTask]] = field(
        default_factory=lambda: defaultdict(list)
    )
    host_sources: list[Any] = field(default_factory=list)
    """Device arrays (or slice handles), indexed by ``SaveTask.source``."""
    controller_tasks: list[workers.SaveTask] = field(default_factory=list)
    controller_sources: list[np.ndarray] = field(default_factory=list)
    """NumPy arrays and scalars the controller holds, written by the controller."""
    headers_by_host: dict[int | str, int] = field(default_factory=lambda: defaultdict(int))
    """How many arrays' ``zarr.json`` each host writes (see ``SaveTask.write_metadata``)."""

    @property
    def files(self) -> fmt.TreeFiles:
        return fmt.TreeFiles(
            leaves=self.leaves,
            use_ocdbt=self.options.use_ocdbt,
            shardings=self.shardings,
            strings=self.strings,
            python_types=self.python_types,
            key_impls=self.key_impls,
            orbax_sharding_max_bytes=self.options.orbax_sharding_max_bytes,
        )


def plan_tree(tree: Any, options: SaveOptions, group: HostGroup) -> TreeSavePlan:
    """Validate every leaf of ``tree`` and decide who writes what (no data moves)."""
    out = TreeSavePlan(options)
    leaves, _ = _tree.flatten(tree)
    for leaf in leaves:
        _named(leaf, _plan_leaf, out, leaf, group)
    return out


def _plan_leaf(out: TreeSavePlan, leaf: Leaf, group: HostGroup) -> None:
    kind = value_type(leaf.value)
    if kind.is_array and not out.options.use_ocdbt and leaf.name in _PLAIN_ZARR3_RESERVED:
        raise InvalidKeyError(
            f"leaf {leaf.name!r} would be stored in a folder with the name of a metadata "
            "file, which plain zarr3 (SaveOptions(use_ocdbt=False)) cannot do; rename the "
            "key, or save with use_ocdbt=True (the default)"
        )
    write_shape = None
    if kind is ValueType.JAX_ARRAY:
        write_shape = _plan_device_array(out, leaf, group)
    elif kind in (ValueType.NP_ARRAY, ValueType.SCALAR):
        array = np.asarray(leaf.value) if kind is ValueType.NP_ARRAY else _scalar_array(leaf.value)
        _check_dtype(leaf.name, array.dtype)
        if kind is ValueType.SCALAR:
            out.python_types[leaf.name] = _python_type(leaf.value)
        spec = _planning.host_array_spec(
            leaf.name, array, out.options.compression, out.options.chunk_byte_size
        )
        regions = (
            (workers.Region(device_id=-1, index=tuple((0, n) for n in array.shape)),)
            if array.size
            else ()
        )
        out.controller_tasks.append(
            workers.SaveTask(
                source=len(out.controller_sources), spec=spec, regions=regions, create=True
            )
        )
        out.controller_sources.append(array)
    elif kind is ValueType.STRING:
        out.strings[leaf.name] = leaf.value
    elif kind is ValueType.TUPLE:
        out.python_types[leaf.name] = "tuple"
    out.leaves[leaf.name] = fmt.SavedLeaf.of(leaf, kind, write_shape)


def _plan_device_array(out: TreeSavePlan, leaf: Leaf, group: HostGroup) -> tuple[int, ...]:
    value = leaf.value
    is_deleted = getattr(value, "is_deleted", None)
    if callable(is_deleted) and is_deleted():
        raise ValueError(
            f"leaf {leaf.name!r} is a deleted jax.Array (deleted, or donated to a jitted "
            "function); save it before donating it, or save the array the computation returned"
        )
    shape = tuple(value.shape)
    spec = _planning.sharding_spec(value.sharding)
    key_impl = None
    if workers.is_key(value.dtype):  # typed PRNG keys: their key data is what is stored
        key_impl = workers.key_impl_name(value.dtype)
        shape = (*shape, *workers.key_words(key_impl))
        dtype = np.dtype(np.uint32)
        out.key_impls[leaf.name] = key_impl
        if (
            spec is not None and spec.kind == "named"
        ):  # as Orbax records it: None for the key dimensions
            entries = spec.spec + (None,) * (len(shape) - len(spec.spec))
            spec = dataclasses.replace(spec, spec=entries)
    else:
        dtype = np.dtype(value.dtype)
    _check_dtype(leaf.name, dtype)
    if spec is not None:
        out.shardings[leaf.name] = spec
    boxes = _planning.device_boxes(spec if spec is not None else value.sharding, shape)
    write_shape, regions = _planning.write_regions(
        boxes,
        out.options.replica_parallel,
        dtype.itemsize,
        turn=len(out.host_sources),
        min_write_bytes=out.options.min_write_bytes,
    )
    if not all(shape):
        regions = []
    array_spec = workers.ArraySpec(
        name=leaf.name,
        shape=shape,
        dtype=dtype.name,
        write_shape=write_shape,
        chunk_shape=_planning.inner_chunk_shape(
            write_shape, dtype.itemsize, out.options.chunk_byte_size
        ),
        compression=out.options.compression,
        random_key_impl=key_impl,
    )
    source = len(out.host_sources)
    out.host_sources.append(value)
    by_process: dict[int | str, list[workers.Region]] = defaultdict(list)
    for region in regions:
        by_process[group.process_of_device(region.device_id)].append(region)
    if not by_process:  # zero-size: someone must still create the array's metadata
        by_process[group.processes()[0]] = []
    # One host writes the array's zarr.json, the others chunks only: the one of its writers with
    # the fewest headers so far. Creating a header is a commit of its own in the host's database
    # (milliseconds each on a busy machine), so one host writing them all made the slowest host.
    header_by = min(by_process, key=lambda p: (out.headers_by_host[p], p))
    out.headers_by_host[header_by] += 1
    for process, mine in by_process.items():
        out.host_tasks[process].append(
            workers.SaveTask(
                source=source,
                spec=array_spec,
                regions=tuple(mine),
                create=not mine,
                write_metadata=process == header_by,
            )
        )
    return write_shape


# ------------------------------------------------------------------------------------------
# Staging and the background part
# ------------------------------------------------------------------------------------------


def stage_tree(
    planned: TreeSavePlan,
    directory: StoragePath,
    call: SaveCall,
    *,
    first_writer: int = 0,
    finish: bool = True,
) -> PendingTree:
    """Stage every host's shards and the controller's own leaves (the blocking part of a save);
    the returned pending write waits for them and hands the tree to the commit (a
    :class:`WrittenTree`). ``first_writer`` numbers the OCDBT databases written from there;
    ``finish=False``: it hands nothing (a caller writing one tree in several parts gathers the
    parts' acks, ``PendingTree.acks``, and hands the whole tree itself)."""
    timeout = call.options.async_.timeout_secs
    group = call.group
    # One token names the data files of every database this save writes itself (drawn by the
    # primary: one per save, not per host; see workers' write_database)
    token = _hosts.shared(group, f"file-token:{directory}", lambda: os.urandom(4).hex(), timeout)
    store = workers.StoreSpec(
        directory=str(directory), use_ocdbt=planned.options.use_ocdbt, file_token=token
    )
    host_bytes = {p: _task_bytes(tasks) for p, tasks in planned.host_tasks.items()}
    own_bytes = _task_bytes(planned.controller_tasks) if group.is_primary() else 0
    progress.expect(sum(host_bytes.values()) + own_bytes)
    log.debug(
        "save plan for %s: %d leaves; %d arrays on %d hosts (bytes by host: %s); %d leaves "
        "written by the controller (%d bytes); %d strings",
        directory,
        len(planned.leaves),
        len({t.spec.name for ts in planned.host_tasks.values() for t in ts}),
        len(host_bytes),
        host_bytes,
        len(planned.controller_tasks),
        own_bytes,
        len(planned.strings),
    )
    hosts: workers.PendingWrite[list[workers.SaveAck]] | None = None
    if planned.host_tasks:
        plans = {
            p: _plan(planned, store, p, tasks, call.copy, first_writer, host_bytes[p], timeout)
            for p, tasks in planned.host_tasks.items()
        }
        hosts = group.start_save(plans, planned.host_sources, timeout)
    own: workers.PendingWrite[list[workers.SaveAck]] | None = None
    try:
        if planned.controller_tasks and group.is_primary():
            plan = _plan(
                planned,
                store,
                CONTROLLER,
                planned.controller_tasks,
                call.copy,
                first_writer,
                own_bytes,
                timeout,
            )
            own = _hosts.controller_host().start_save(
                {CONTROLLER: plan}, planned.controller_sources, timeout
            )
    except workers.StillWritingError as e:
        e.unsettled.append(hosts)  # the caller settles every write before it cleans up
        raise
    except BaseException:
        workers.settle_all([hosts])
        raise
    planned.controller_sources = []
    return PendingTree(
        directory, planned.files, group, hosts, own, timeout, finish, call.check, call.written
    )


def _plan(
    planned: TreeSavePlan,
    store: workers.StoreSpec,
    process: Any,
    tasks: list[workers.SaveTask],
    copy: bool,
    first_writer: int,
    nbytes: int,
    timeout: float,
) -> workers.SavePlan:
    """The plan of one writer (a host, or the controller) of ``planned``'s tasks."""
    return workers.SavePlan(
        store=store,
        process_index=process,
        tasks=tuple(tasks),
        copy=copy,
        first_writer=first_writer,
        writers=_options.writers_for(planned.options, nbytes),
        staging_budget_bytes=planned.options.host_staging_budget_bytes,
        adaptive_staging=planned.options.adaptive_staging,
        device_staging=planned.options.device_staging,
        timeout_secs=timeout,
    )


def _task_bytes(tasks: list[workers.SaveTask]) -> int:
    return sum(
        math.prod(b - a for a, b in r.index) * np.dtype(t.spec.dtype).itemsize
        for t in tasks
        for r in t.regions
    )


class PendingTree:
    """A staged pytree checkpointable: the hosts' writes and the controller's writes. ``wait``
    only waits for them; on the primary it returns the tree for the commit (``finish``)."""

    def __init__(
        self,
        directory: StoragePath,
        files: fmt.TreeFiles,
        group: HostGroup,
        hosts: workers.PendingWrite[list[workers.SaveAck]] | None,
        own: workers.PendingWrite[list[workers.SaveAck]] | None,
        timeout: float,
        finish: bool = True,
        check: Callable[[str, Any], None] | None = None,
        written: list[WrittenTree] | None = None,
    ) -> None:
        self.finish = finish
        self.check = check
        """The save's workspace check, run once the data landed (``SaveCall.check``)."""
        self.acks: list[workers.SaveAck] = []
        """Every host's ack (on the primary), once waited for."""
        self.directory = directory
        self.files = files
        self.group = group
        self.hosts = hosts
        self.own = own
        self.timeout = timeout
        self.written = written
        """Where the tree goes for the commit (``SaveCall.written``)."""

    def wait(self, timeout: float | None = None) -> WrittenTree | None:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        try:
            acks = self.hosts.wait(left()) if self.hosts is not None else []
        except workers.StillWritingError as e:
            e.unsettled.append(self)  # out of time: the caller settles (on a thread it chooses)
            raise
        except BaseException:
            self.settle()
            raise
        self.group.barrier(f"pytree-written:{self.directory}", left())
        if not self.group.is_primary():
            return None
        # The controller's own leaves: a failure here is the primary's alone; it reaches the
        # other controller processes through the commit outcome.
        try:
            if self.own is not None:
                acks = [*acks, *self.own.wait(left())]
        except workers.StillWritingError as e:
            e.unsettled.append(self)
            raise
        except BaseException:
            self.settle()
            raise
        self.acks = list(acks)
        if not self.finish:
            return None
        if self.check is not None:  # this tree's writes landed (others may still run)
            self.check("after the data writes", self.directory)
        tree = WrittenTree(self.directory, self.files, self.acks)
        if self.written is not None:
            self.written.append(tree)
        return tree

    def settle(self, timeout: float | None = None) -> None:
        """Local only: let this process's writes land (no host coordination); None: as long as
        the storage may take to give up on them."""
        workers.settle_all([self.hosts, self.own], timeout)
