"""A host's part of a load: read what its devices need of every array, place it, and return
the global arrays.

:func:`load` opens every array with TensorStore while it walks the OCDBT B-tree for the files
its chunks lie in (:class:`~._locator.Locator`), plans each array's boxes (one per distinct box
this host's devices hold), reads them in the order their data lies on disk (for large boxes,
as many far-apart parts of that order at once as threads read: :func:`._direct.spread`) with a
:class:`~._reader.BudgetedReader`, and assembles them (:mod:`._assemble`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from milepost.workers import _keys
from milepost.workers._boxes import addressable_boxes
from milepost.workers._errors import CorruptCheckpointError
from milepost.workers._messages import LoadAck, LoadPlan, LoadTask
from milepost.workers._paths import as_path, is_local
from milepost.workers._sharding import ShardingSpec
from milepost.workers.format import ChunkTables, from_tensorstore, specs
from milepost.workers.load import _locator
from milepost.workers.load._assemble import Assembler, BroadcastAssembler, Broadcasts
from milepost.workers.load._pieces import ShardLayout, shard_layout
from milepost.workers.load._reader import BudgetedReader, Checked


def load(plan: LoadPlan, process_index: int | str = 0) -> tuple[list[Any], LoadAck]:
    """Read what this host's devices need of every task, place it, assemble global arrays.

    Returns one entry per task — a ``jax.Array`` (its addressable shards filled) or, for tasks
    without a sharding, a NumPy array — and this host's :class:`LoadAck`.

    Tasks with a ``broadcast_axis`` (load-and-broadcast) are read only by the devices at index 0
    of that axis and reach the others by a collective every host runs, in plan order. A host
    whose part fails still joins the collectives it has not run (with placeholders) before it
    raises, so the other hosts are not left waiting in them.
    """
    broadcasts = Broadcasts(plan)
    try:
        return _load(plan, process_index, broadcasts)
    except Exception:
        broadcasts.abandon()
        raise


def _load(
    plan: LoadPlan, process_index: int | str, broadcasts: Broadcasts
) -> tuple[list[Any], LoadAck]:
    """The phases of a host's load, in order: open every array while the B-tree is walked,
    choose the read order, plan each array's pieces, read them within the memory budget,
    assemble."""
    _check_device_dtypes(plan.tasks)
    opened = _open(plan)
    order = _order(plan, opened.locator, broadcasts)
    results: list[Any] = [None] * len(plan.tasks)
    assemblers = _assemblers(plan, order, results, broadcasts)
    sizes = [
        [math.prod(b - a for a, b in box) * asm.dtype.itemsize for _, box in asm.pieces]
        for asm in assemblers
    ]
    reader = BudgetedReader(
        plan.memory_budget_bytes,
        plan.store.directory,
        opened.locator,
        sum(map(sum, sizes)),
        sum(map(len, sizes)),
        direct=opened.direct,
    )
    try:
        _read(plan, opened, order, assemblers, sizes, reader, broadcasts)
    finally:
        reader.close()
    for asm in assemblers:
        asm.finish()
    for i, task in enumerate(plan.tasks):
        if task.random_key_impl is not None:
            results[i] = _keys.from_data(results[i], task.random_key_impl)
    return results, LoadAck(
        process_index=process_index, bytes_read=reader.bytes_read, arrays=len(results)
    )


@dataclasses.dataclass
class _Opened:
    """Every array opened, and what is known of where its chunks lie."""

    stores: list[Any]
    metadatas: list[Any]
    locator: _locator.Locator | None
    """The B-tree walk's answers (None when neither direct reads nor checksum tables need it)."""
    direct: bool
    """Pieces are read straight from the local data files."""
    layouts: list[ShardLayout | None]
    tables: ChunkTables | None


def _open(plan: LoadPlan) -> _Opened:
    """Open every array with TensorStore while the OCDBT B-tree is walked for the files its
    chunks lie in (needed for direct reads, and to find each chunk's writer for its checksum
    table: no check is skipped for want of the walk)."""
    opens = _start_opens(plan)
    # straight from local files only
    direct = plan.direct_reads and is_local(as_path(plan.store.directory))
    tabled = any(t.chunk_tables for t in plan.tasks)
    locator = _locator.Locator(plan.store) if direct or tabled else None
    walk_failed: Exception | None = None
    if locator is not None:
        # Every array's chunks: which of them can be read directly is known once they are open.
        try:
            locator.index([t.name for t in plan.tasks if t.tensor is None])
        except Exception as e:  # (a damaged database: the opens below report it, or the walk again)
            walk_failed = e
            locator = _locator.Locator(plan.store)
    stores = _finish_opens(plan, opens)
    if walk_failed is not None and tabled:
        if isinstance(walk_failed, CorruptCheckpointError):
            raise walk_failed
        raise CorruptCheckpointError(
            f"the OCDBT database in {plan.store.directory} could not be walked to find the "
            f"writers of its chunks ({walk_failed}); the checkpoint is damaged. Load an earlier "
            "checkpoint.",
            path=plan.store.directory,
        ) from walk_failed
    metadatas = [specs.zarr_metadata(s) if s is not None else None for s in stores]
    layouts: list[ShardLayout | None] = [None] * len(stores)
    if locator is not None and direct:
        layouts = [
            shard_layout(t.name, s, m) if s is not None else None
            for t, s, m in zip(plan.tasks, stores, metadatas, strict=True)
        ]
        if any(layouts):
            locator.index([layout.name for layout in layouts if layout is not None])
        else:
            direct = False
    tables = ChunkTables(plan.store) if tabled else None
    return _Opened(stores, metadatas, locator, direct, layouts, tables)


def _order(plan: LoadPlan, locator: _locator.Locator | None, broadcasts: Broadcasts) -> list[int]:
    """The arrays in the order their data lies in the files (front to back, file by file), so
    the reads of neighbouring arrays are sequential (and coalesce) instead of jumping around
    each file in tree order. Collectives (load-and-broadcast) keep plan order."""
    order = list(range(len(plan.tasks)))
    if locator is not None and not broadcasts.pending:
        unknown = ("", -1)
        order.sort(key=lambda i: locator.first_location(plan.tasks[i].name) or unknown)
    return order


def _assemblers(
    plan: LoadPlan, order: list[int], results: list[Any], broadcasts: Broadcasts
) -> list[Assembler]:
    """Per array, in read order, what assembles it from its pieces (one per distinct box this
    host's devices hold) into ``results``."""
    layouts_seen: dict[Any, Any] = {}  # the layers of a model share one device layout

    def boxes_of(sharding: Any, shape: tuple[int, ...]) -> Any:
        try:
            return layouts_seen[sharding, shape]
        except TypeError:  # an unhashable sharding
            return addressable_boxes(sharding, shape)
        except KeyError:
            found = layouts_seen[sharding, shape] = addressable_boxes(sharding, shape)
            return found

    assemblers: list[Assembler] = []
    for i in order:
        task = plan.tasks[i]
        if task.sharding is None:
            asm = Assembler(task, None, results, i, [((), (tuple((0, n) for n in task.shape)))])
        else:
            sharding = (
                task.sharding.to_jax() if isinstance(task.sharding, ShardingSpec) else task.sharding
            )
            readers = broadcasts.readers(i, task, sharding)
            if readers is None:
                asm = Assembler(task, sharding, results, i, *boxes_of(sharding, task.shape))
            else:
                pieces, _ = addressable_boxes(sharding, task.shape, readers)
                asm = BroadcastAssembler(task, sharding, results, i, pieces, broadcasts)
        assemblers.append(asm)
    return assemblers


def _read(
    plan: LoadPlan,
    opened: _Opened,
    order: list[int],
    assemblers: list[Assembler],
    sizes: list[list[int]],
    reader: BudgetedReader,
    broadcasts: Broadcasts,
) -> None:
    """Issue every piece's read and wait for them all. With load-and-broadcast, array by array
    in plan order, the collectives of the arrays before one running while its reads are in
    flight; otherwise in the units :func:`_read_order` makes, each a boundary of the reader."""
    stores, layouts = opened.stores, opened.layouts
    checks = [
        _checked(plan.tasks[i], stores[i], opened.metadatas[i], opened.tables, opened.locator)
        for i in order
    ]

    def issue(k: int, pieces: Sequence[int]) -> None:
        """Issue the reads of pieces ``pieces`` of the ``k``-th array in read order."""
        i, asm = order[k], assemblers[k]
        task = plan.tasks[i]
        if task.tensor is not None:
            reader.read_tensor(task.tensor, asm)
            return
        for p in pieces:
            devices, box = asm.pieces[p]
            reader.read(stores[i], layouts[i], box, asm, devices, checks[k])

    if broadcasts.pending:
        waiting: list[Assembler] = []  # broadcast arrays whose collectives run after their reads
        for k, asm in enumerate(assemblers):
            issue(k, range(len(asm.pieces)))
            for earlier in waiting:
                reader.complete(earlier)
                earlier.finish()
            waiting = [asm] if isinstance(asm, BroadcastAssembler) else []
    else:
        for unit in _read_order(plan, order, assemblers, sizes, layouts, reader):
            for k, p in unit:
                issue(k, [p])
            reader.boundary()
    reader.drain()


def _read_order(
    plan: LoadPlan,
    order: list[int],
    assemblers: list[Assembler],
    sizes: list[list[int]],
    layouts: list[ShardLayout | None],
    reader: BudgetedReader,
) -> list[list[tuple[int, int]]]:
    """The reads to issue, ``(k, p)``: piece ``p`` of the ``k``-th array in read order (a
    safetensors tensor is one step: its boxes are read together), in units each ended by a
    batch boundary. In disk order; for large boxes each box by where it lies (an array's shards
    may be in several files), then regrouped so that the reads in flight at once lie far apart
    (:meth:`BudgetedReader.order`)."""
    tensor = [plan.tasks[i].tensor is not None for i in order]
    steps = [
        (k, p)
        for k, asm in enumerate(assemblers)
        for p in ([0] if tensor[k] else range(len(asm.pieces)))
    ]
    if reader.streams() > 1:
        places = {
            (k, p): reader.place(layouts[order[k]], assemblers[k].pieces[p][1]) for k, p in steps
        }
        steps.sort(key=lambda step: (places[step].path, places[step].offset))
    units = reader.order([sum(sizes[k]) if tensor[k] else sizes[k][p] for k, p in steps])
    return [[steps[s] for s in unit] for unit in units]


def _checked(
    task: LoadTask,
    store: Any,
    metadata: Any,
    tables: ChunkTables | None,
    locator: _locator.Locator | None,
) -> Checked | None:
    """What the chunks of ``task``'s array are checked against (None: nothing recorded)."""
    if task.tensor is not None:
        return None
    mine = tables if task.chunk_tables else None
    if task.checksums is None and mine is None:
        return None
    inner, shard = specs.chunk_shapes(store, metadata)
    return Checked(task.name, task.shape, inner, dict(task.checksums or ()), shard, mine, locator)


def _start_opens(plan: LoadPlan) -> list[Any]:
    """Start opening every task's array with TensorStore (None for tasks read from safetensors
    files); :func:`_finish_opens` waits for them."""
    context = specs.new_context(plan.store.directory)
    kvstore = specs.read_kvstore(plan.store)
    return [
        None
        if t.tensor is not None
        else ts.open(
            specs.open_spec(kvstore, t.name, plan.fill_missing, plan.store.zarr_format),
            open=True,
            read=True,
            context=context,
        )
        for t in plan.tasks
    ]


def _finish_opens(plan: LoadPlan, opens: list[Any]) -> list[Any]:
    stores: list[Any] = []
    for task, opening in zip(plan.tasks, opens, strict=True):
        if opening is None:
            stores.append(None)
            continue
        try:
            store = opening.result()
        except Exception as e:  # TensorStore raises ValueError with a long status string
            mapped = from_tensorstore(
                e, f"opening array {task.name!r}", plan.store.directory, reading=True
            )
            if isinstance(mapped, PermissionError | TimeoutError) or (
                isinstance(mapped, OSError) and mapped is not e
            ):
                raise mapped from e
            raise CorruptCheckpointError(
                f"array {task.name!r} could not be opened in {plan.store.directory}: {e}. "
                "The checkpoint is missing data or damaged; load an earlier checkpoint.",
                array=task.name,
                path=plan.store.directory,
            ) from e
        if tuple(store.shape) != tuple(task.shape):
            raise CorruptCheckpointError(
                f"array {task.name!r} is stored with shape {tuple(store.shape)} "
                f"in {plan.store.directory}, but its metadata says "
                f"{task.shape}; the checkpoint is damaged",
                array=task.name,
                path=plan.store.directory,
            )
        stores.append(store)
    return stores


def _check_device_dtypes(tasks: Sequence[LoadTask]) -> None:
    """A 64-bit array placed on devices while JAX runs without x64 would silently lose its upper
    32 bits (int64 -> int32, float64 -> float32): refuse, and say how to get what was saved."""
    import jax

    for task in tasks:
        if task.sharding is None:
            continue
        dtype = np.dtype(task.dtype)
        if np.dtype(jax.dtypes.canonicalize_dtype(dtype)) != dtype:
            raise ValueError(
                f"array {task.name!r} would be loaded as {dtype} onto devices, but JAX runs "
                "without 64-bit types (it would become "
                f"{np.dtype(jax.dtypes.canonicalize_dtype(dtype))}, losing values); enable them "
                "(jax.config.update('jax_enable_x64', True) or `with jax.enable_x64():`), or ask "
                "for a 32-bit dtype in the abstract tree to cast"
            )


Box = tuple[tuple[int, int], ...]
