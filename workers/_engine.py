"""The per-host engine: stage shards to host memory, write them with TensorStore, read and place.

A host runs this for the arrays it can address; it never sees the controller's objects. The same
functions serve the in-process host, a Ray actor and every process of a multi-controller job.
"""

from __future__ import annotations

import collections
import functools
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import tensorstore as ts

from milepost.workers import _checksum, _direct, _keys, _progress, _readpool, _safetensors, _staging
from milepost.workers import _tensorstore as tsu
from milepost.workers._errors import CorruptCheckpointError, from_tensorstore
from milepost.workers._messages import (
    ArraySpec,
    LoadAck,
    LoadPlan,
    LoadTask,
    Region,
    SaveAck,
    SavePlan,
    SaveTask,
    VerifyAck,
    VerifyPlan,
    VerifyTask,
    WrittenArray,
)
from milepost.workers._sharding import ShardingSpec
from milepost.workers._storage import Location


class PendingSave:
    """The TensorStore writes (and array creations) of one :func:`start_save`: a
    :class:`~milepost.workers.PendingWrite` whose ``wait`` returns this host's :class:`SaveAck`."""

    def __init__(self, plan: SavePlan) -> None:
        self._plan = plan
        self._inflight: list[Any] | None = []
        """TensorStore futures that may still write: array opens (they create zarr.json) and
        write commits. Dropped once durable, which frees the staged buffers."""
        self._nbytes = 0
        self._checksums: list[tuple[str, Any]] = []
        """(array name, future of its chunks' checksums), computed while the writes run."""
        self._lock = threading.Lock()
        self._ack: SaveAck | None = None
        self._staged: list[np.ndarray] = []
        """Raw buffers of the staging copies, returned to the pool once the writes are durable."""
        self._staged_bytes = 0
        self._issuing: Any = None
        """The job issuing the staging copies' writes (it adds to ``_inflight`` and
        ``_checksums``): waited for before either is read."""

    def _track(self, future: Any, nbytes: int = 0) -> None:
        assert self._inflight is not None
        self._inflight.append(future)
        self._nbytes += nbytes

    def _checksum(
        self, spec: ArraySpec, box: tuple[tuple[int, int], ...], data: np.ndarray
    ) -> Future[Any]:
        """Compute the checksums of the chunks of ``data`` (the region ``box``) on the copy pool."""
        future = _on_copy_pool(_checksum.region_crc32c, data, box, spec.chunk_shape)
        self._checksums.append((spec.name, future))
        return future

    def wait(self, timeout: float | None = None) -> SaveAck:
        with self._lock:
            if self._ack is None:
                deadline = None if timeout is None else time.monotonic() + timeout
                try:
                    if self._issuing is not None:
                        self._issuing.result(
                            timeout=None
                            if deadline is None
                            else max(0.0, deadline - time.monotonic())
                        )
                    for f in self._inflight or []:
                        f.result(
                            timeout=None
                            if deadline is None
                            else max(0.0, deadline - time.monotonic())
                        )
                except BaseException as e:
                    self._settle(timeout)  # no write may land after the caller cleans up
                    mapped = from_tensorstore(
                        e, "writing the checkpoint's arrays", self._plan.store.directory
                    )
                    if mapped is e:
                        raise
                    raise mapped from e
                self._inflight = None
                checksums: dict[str, list[tuple[tuple[int, ...], int]]] = collections.defaultdict(
                    list
                )
                for name, future in self._checksums:
                    checksums[name].extend(future.result())
                self._checksums = []
                _staging.POOL.give_back(self._staged, keep_bytes=self._staged_bytes)
                arrays = tuple(
                    WrittenArray(
                        name=t.spec.name,
                        write_shape=t.spec.write_shape,
                        chunk_shape=t.spec.chunk_shape,
                        chunk_crc32c=tuple(sorted(checksums.get(t.spec.name, ()))),
                        random_key_impl=t.spec.random_key_impl,
                    )
                    for t in self._plan.tasks
                    if t.regions or t.create
                )
                self._ack = SaveAck(
                    process_index=self._plan.process_index,
                    bytes_written=self._nbytes,
                    arrays=arrays,
                )
            return self._ack

    def settle(self, timeout: float | None = None) -> None:
        with self._lock:
            self._settle(timeout)

    def _settle(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._issuing is not None:
            futures_wait([self._issuing], timeout=timeout)
        for f in self._inflight or []:
            try:
                f.result(
                    timeout=None if deadline is None else max(0.0, deadline - time.monotonic())
                )
            except Exception:
                pass


def start_save(plan: SavePlan, sources: Sequence[Any]) -> PendingSave:
    """Open every array of ``plan``, issue its writes and return once the data is staged.

    With ``plan.copy`` the return means every region's bytes are in host buffers of our own, so
    the caller may delete, donate or overwrite its arrays. Without it TensorStore references the
    caller's memory until :meth:`PendingSave.wait` returns.
    """
    context = tsu.new_context(plan.store.directory)
    tasks = [t for t in plan.tasks if t.regions or t.create]
    parts = _split_among_writers(tasks, plan.writers if plan.store.use_ocdbt else 1)
    pending = PendingSave(plan)
    sources = _key_data(plan, sources)
    opens = []
    headers: set[str] = set()  # arrays whose zarr.json one of our writers writes
    for writer, task, _ in parts:
        spec = tsu.create_spec(
            tsu.write_kvstore(plan.store, plan.process_index, plan.first_writer + writer), task.spec
        )
        create = task.write_metadata and task.spec.name not in headers
        if create:
            headers.add(task.spec.name)
        # else chunks only: the array's header is written by another writer or host
        opens.append(_Opening(spec, create, context, pending))
    try:
        _start_device_to_host(plan, sources)
        _issue_writes(plan, sources, parts, opens, pending)
    except BaseException as e:
        pending.settle()  # opens and writes already issued must land before the caller cleans up
        mapped = from_tensorstore(e, "creating the checkpoint's arrays", plan.store.directory)
        if mapped is e:
            raise
        raise mapped from e
    return pending


_Part = tuple[int, SaveTask, tuple[Region, ...]]


class _Opening:
    """One array's open in one writer's database, started by its first use (on whichever
    thread gets there first): the opens of arrays whose regions are all staged then run off
    the caller's thread with their writes (``ts.open`` costs ~0.3 ms of CPU per array)."""

    def __init__(
        self, spec: dict[str, Any], create: bool, context: Any, pending: PendingSave
    ) -> None:
        self._spec = spec
        self._create = create
        self._context = context
        self._pending = pending
        self._future: Any = None
        self._lock = threading.Lock()

    def start(self) -> Any:
        """The open's TensorStore future (tracked by the save: its writes wait for it)."""
        with self._lock:
            if self._future is None:
                if self._create:
                    self._future = ts.open(
                        self._spec, create=True, open=True, context=self._context
                    )
                else:
                    self._future = ts.open(self._spec, assume_metadata=True, context=self._context)
                self._pending._track(self._future)
            return self._future


def _key_data(plan: SavePlan, sources: Sequence[Any]) -> Sequence[Any]:
    """The sources with every typed PRNG key array replaced by its key data (what is stored)."""
    keyed = {t.source for t in plan.tasks if t.spec.random_key_impl is not None}
    if not keyed:
        return sources
    out = list(sources)
    for k in keyed:
        if _keys.is_key(getattr(out[k], "dtype", None)):
            out[k] = _keys.to_data(out[k])
    return out


def _split_among_writers(tasks: Sequence[SaveTask], writers: int) -> list[_Part]:
    """Give each writer (one OCDBT database each, written in parallel) about the same bytes.

    Whole arrays go to the least loaded writer, largest first; an array larger than a writer's
    fair share is split by region. Each (writer, array) pair opens the array in that database.
    """
    if writers <= 1 or len(tasks) == 0:
        return [(0, t, t.regions) for t in tasks]

    def size(region: Region, spec: ArraySpec) -> int:
        return math.prod(b - a for a, b in region.index) * np.dtype(spec.dtype).itemsize

    total = sum(size(r, t.spec) for t in tasks for r in t.regions)
    share = total / writers
    units: list[tuple[int, int, tuple[Region, ...]]] = []  # (bytes, task index, regions)
    for k, task in enumerate(tasks):
        task_bytes = sum(size(r, task.spec) for r in task.regions)
        if task_bytes > share and len(task.regions) > 1:
            units.extend((size(r, task.spec), k, (r,)) for r in task.regions)
        else:
            units.append((task_bytes, k, task.regions))
    load = [0] * writers
    assigned: dict[tuple[int, int], list[Region]] = {}  # (writer, task index) -> regions, in order
    for nbytes, k, regions in sorted(units, key=lambda u: -u[0]):
        writer = min(range(writers), key=load.__getitem__)
        load[writer] += nbytes
        assigned.setdefault((writer, k), []).extend(regions)
    return [(writer, tasks[k], tuple(regions)) for (writer, k), regions in assigned.items()]


_Write = tuple[_Opening, tuple[tuple[int, int], ...], np.ndarray, ArraySpec]
"""(the array's opening, box, the data to write, its spec)."""


def _issue_writes(
    plan: SavePlan,
    sources: Sequence[Any],
    parts: list[_Part],
    opens: list[_Opening],
    pending: PendingSave,
) -> None:
    """Issue every region's write. Regions that may be the caller's memory are first copied
    into staging buffers of our own (with ``plan.copy``); with a staging budget, the regions
    beyond it are written from the caller's memory instead, and waited for here."""
    writes: list[_Write] = []  # from memory that is ours, or that the caller lends us until durable
    blocking: list[_Write] = []  # from the caller's memory, durable before we return
    copies: list[tuple[_Write, np.ndarray]] = []  # (the write of a staging copy, the data to copy)
    room = plan.staging_budget_bytes
    # The arrays are opened by the first write into each: the staged copies' writes run off
    # the caller's thread, so a save that stages everything neither opens nor waits for an open
    # (creating 8 arrays' headers took ~5 ms of a 512 MiB save's blocking part).
    for (_, task, regions), store in zip(parts, opens, strict=True):
        source = sources[task.source]
        shards = _shards_by_device(source)
        for region in regions:
            data = _region_data(source, shards, region.device_id, region.index, task.spec)
            if not (plan.copy and _may_alias_caller_memory(source, region.device_id)):
                writes.append((store, region.index, data, task.spec))
            elif room is None or data.nbytes <= room:
                room = None if room is None else room - data.nbytes
                copies.append(((store, region.index, data, task.spec), data))
            else:
                blocking.append((store, region.index, data, task.spec))
    progress = _progress.counter()

    def write(item: _Write) -> Any:
        opening, box, data, spec = item
        written = (
            opening.start()
            .result()[tsu.box_to_slices(box)]
            .write(data, can_reference_source_data_indefinitely=True)
        )
        pending._track(written.commit, data.nbytes)
        if progress is not None:  # a progress bar counts each write once durable
            written.commit.add_done_callback(
                lambda f, n=data.nbytes: f.exception() is None and progress(n)
            )
        return written.commit, pending._checksum(spec, box, data)

    if writes or blocking or not copies:
        # Writes issued here: every open first, so they run together (and the writes reach
        # TensorStore together: one by one, each after its array's open, a save's data spread
        # over more files). Only a save that stages everything opens off the caller's thread.
        for opening in opens:
            opening.start()
    # The writes the caller waits for go first, so their I/O overlaps the copies. They and
    # their checksums read the caller's memory, which is the caller's again once we return.
    waits = [future for item in blocking for future in write(item)]
    for item in writes:
        write(item)
    if copies:
        # Our own copies in aligned memory: TensorStore then references them until the writes
        # are durable instead of copying again, and the caller's arrays are free.
        _staging.POOL.keep_only([data.nbytes for _, data in copies])
        staged: list[_Write] = []
        for (store, box, data, spec), _ in copies:
            buffer, raw = _staging.POOL.take(data.shape, data.dtype)
            pending._staged.append(raw)
            pending._staged_bytes += raw.nbytes
            staged.append((store, box, buffer, spec))
        # Every copy before any write: the writes would compete with the copies for memory
        # bandwidth and cores, and the copies are what the caller waits for (overlapping them
        # on 2 cores cut the total by about what it added to the blocking part).
        parallel_copy([(item[2], data) for item, (_, data) in zip(staged, copies, strict=True)])

        # The copies' writes read only our buffers: they are issued off the caller's thread
        # (64 writes and their checksum jobs cost ~10 ms of a 512 MiB save's blocking part),
        # after every open they wait for has started (so the opens run together).
        def issue() -> None:
            for opening in opens:
                opening.start()
            for item in staged:
                write(item)

        pending._issuing = _on_copy_pool(issue)
    for future in waits:
        future.result()


T = TypeVar("T")

_COPY_BLOCK_BYTES = 32 << 20
_INLINE_COPY_BYTES = 2 << 20
"""Copies of fewer bytes in all run on the calling thread: handing them to threads costs more."""


def _copy_threads() -> int:
    return min(8, os.cpu_count() or 1)


@functools.cache
def _copy_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(_copy_threads(), thread_name_prefix="milepost-copy")


def _on_copy_pool(fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
    """``fn(*args, **kwargs)`` on the copy pool; on this thread once the interpreter is exiting
    (``concurrent.futures`` then takes no new work, before ``atexit`` handlers run, and a save
    in flight that the exit waits for must still finish: its issuing job submits checksum jobs)."""
    try:
        return _copy_pool().submit(fn, *args, **kwargs)
    except RuntimeError as e:  # the pool is never shut down but by the interpreter's exit
        if "shutdown" not in str(e):
            raise
    done: Future[T] = Future()
    try:
        done.set_result(fn(*args, **kwargs))
    except BaseException as e:
        done.set_exception(e)
    return done


def parallel_copy(pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    """``np.copyto(dst, src)`` (casting as needed) for every pair, spread over a few threads
    (NumPy releases the GIL while copying). Large arrays are split along their first axis so the
    threads share the work; much of the cost is the first touch of the destination pages, which
    then also runs in parallel.

    The calling thread copies too: it and one job per other copy-pool thread take blocks from
    one queue until none is left, so a pool thread busy with other work costs nothing but its
    share, and a save of many small shards hands the pool a few jobs instead of one per shard.
    """
    blocks: list[tuple[np.ndarray, np.ndarray]] = []
    for dst, src in pairs:
        rows = dst.shape[0] if dst.ndim else 1
        per_row = max(1, dst.nbytes // max(rows, 1))
        step = max(1, _COPY_BLOCK_BYTES // per_row)
        if dst.ndim == 0 or rows <= step:
            blocks.append((dst, src))
        else:
            blocks.extend((dst[i : i + step], src[i : i + step]) for i in range(0, rows, step))
    threads = min(len(blocks), _copy_threads())
    if threads <= 1 or sum(dst.nbytes for dst, _ in blocks) < _INLINE_COPY_BYTES:
        for dst, src in blocks:
            np.copyto(dst, src, casting="unsafe")
        return
    queue = iter(blocks)
    lock = threading.Lock()

    def drain() -> None:
        while True:
            with lock:
                block = next(queue, None)
            if block is None:
                return
            np.copyto(block[0], block[1], casting="unsafe")

    helpers = [_on_copy_pool(drain) for _ in range(threads - 1)]
    try:
        drain()
    finally:
        # A helper that has not started is not needed (and may be queued behind this very
        # thread, if it is a pool thread); one that has started finishes its last block.
        running = [helper for helper in helpers if not helper.cancel()]
        futures_wait(running)  # all of them, even if a copy failed: none may run on after we return
    for helper in running:
        helper.result()


def _start_device_to_host(plan: SavePlan, sources: Sequence[Any]) -> None:
    """Start the device-to-host transfers of every shard we will write, so they overlap."""
    for task in plan.tasks:
        source = sources[task.source]
        if not task.regions or isinstance(source, np.ndarray | np.generic):
            continue
        wanted = {r.device_id for r in task.regions}
        for shard in source.addressable_shards:
            if shard.device.id in wanted and shard.device.platform != "cpu":
                shard.data.copy_to_host_async()


def _may_alias_caller_memory(source: Any, device_id: int) -> bool:
    """Whether the host view of this region may be the caller's memory (NumPy, a CPU device
    buffer, or an array held in host memory such as 'pinned_host') rather than a fresh
    device-to-host transfer."""
    if device_id < 0 or isinstance(source, np.ndarray | np.generic):
        return True
    if getattr(source.sharding, "memory_kind", None) in ("pinned_host", "unpinned_host"):
        return True
    return any(d.platform == "cpu" for d in source.sharding.device_set)


def _shards_by_device(source: Any) -> dict[int, Any]:
    if isinstance(source, np.ndarray | np.generic):
        return {}
    return {s.device.id: s for s in source.addressable_shards}


def _region_data(
    source: Any,
    shards: dict[int, Any],
    device_id: int,
    box: tuple[tuple[int, int], ...],
    spec: ArraySpec,
) -> np.ndarray:
    if device_id < 0:
        data = np.asarray(source)[tsu.box_to_slices(box)]
    else:
        shard = shards.get(device_id)
        if shard is None:
            raise ValueError(
                f"array {spec.name!r}: the plan asks this host to write the shard on device {device_id}, "
                f"which is not addressable here (addressable: {sorted(shards)})"
            )
        data = np.asarray(shard.data)
        offsets = [s.start or 0 for s in shard.index] if shard.index else []
        local = tuple(slice(a - o, b - o) for (a, b), o in zip(box, offsets, strict=True))
        if any(sl.start != 0 or sl.stop != n for sl, n in zip(local, data.shape, strict=True)):
            data = data[local]
    if data.dtype != np.dtype(spec.dtype):
        raise TypeError(
            f"array {spec.name!r}: planned dtype {spec.dtype} but the data is {data.dtype}"
        )
    return data


# ------------------------------------------------------------------------------------------
# Load
# ------------------------------------------------------------------------------------------


def load(plan: LoadPlan, process_index: int | str = 0) -> tuple[list[Any], LoadAck]:
    """Read what this host's devices need of every task, place it, assemble global arrays.

    Returns one entry per task — a ``jax.Array`` (its addressable shards filled) or, for tasks
    without a sharding, a NumPy array — and this host's :class:`LoadAck`.

    Tasks with a ``broadcast_axis`` (load-and-broadcast) are read only by the devices at index 0
    of that axis and reach the others by a collective every host runs, in plan order. A host
    whose part fails still joins the collectives it has not run (with placeholders) before it
    raises, so the other hosts are not left waiting in them.
    """
    broadcasts = _Broadcasts(plan)
    try:
        return _load(plan, process_index, broadcasts)
    except Exception:
        broadcasts.abandon()
        raise


def _load(
    plan: LoadPlan, process_index: int | str, broadcasts: _Broadcasts
) -> tuple[list[Any], LoadAck]:
    _check_device_dtypes(plan.tasks)
    opens = _start_opens(plan)
    direct = (
        plan.direct_reads and Location.of(plan.store.directory).is_local
    )  # straight from local files only
    locator = _direct.Locator(plan.store) if direct else None
    if locator is not None:
        # Walk the B-tree while TensorStore opens the arrays (every array's chunks: which of
        # them can be read directly is known once they are open).
        try:
            locator.index([t.name for t in plan.tasks if t.tensor is None])
        except Exception:  # (a damaged database: the opens below report it, or the walk again)
            locator = _direct.Locator(plan.store)
    stores = _finish_opens(plan, opens)
    metadatas = [_metadata(s) if s is not None else None for s in stores]
    layouts: list[_direct.ShardLayout | None] = [None] * len(stores)
    if locator is not None:
        layouts = [
            _direct.shard_layout(t.name, s, m) if s is not None else None
            for t, s, m in zip(plan.tasks, stores, metadatas, strict=True)
        ]
        if any(layouts):
            locator.index([layout.name for layout in layouts if layout is not None])
        else:
            locator = None
    results: list[Any] = [None] * len(plan.tasks)
    assemblers: list[_Assembler] = []
    waiting: list[
        _Assembler
    ] = []  # broadcast arrays whose collectives run once their reads are done
    # Arrays of the same shape and sharding (the layers of a model) share one device layout.
    layouts_seen: dict[Any, Any] = {}

    def boxes_of(sharding: Any, shape: tuple[int, ...]) -> Any:
        try:
            return layouts_seen[sharding, shape]
        except TypeError:  # an unhashable sharding
            return _device_boxes(sharding, shape)
        except KeyError:
            found = layouts_seen[sharding, shape] = _device_boxes(sharding, shape)
            return found

    order = list(range(len(plan.tasks)))
    if locator is not None and not broadcasts.pending:
        # Read the arrays in the order their data lies in the files (front to back, file by
        # file), so the reads of neighbouring arrays are sequential (and coalesce) instead of
        # jumping around each file in tree order. Collectives (load-and-broadcast) keep plan order.
        unknown = ("", -1)
        order.sort(key=lambda i: locator.first_location(plan.tasks[i].name) or unknown)
    for i in order:
        task = plan.tasks[i]
        if task.sharding is None:
            asm = _Assembler(task, None, results, i, [((), (tuple((0, n) for n in task.shape)))])
        else:
            sharding = (
                task.sharding.to_jax() if isinstance(task.sharding, ShardingSpec) else task.sharding
            )
            readers = broadcasts.readers(i, task, sharding)
            if readers is None:
                asm = _Assembler(task, sharding, results, i, *boxes_of(sharding, task.shape))
            else:
                pieces, _ = _device_boxes(sharding, task.shape, readers)
                asm = _BroadcastAssembler(task, sharding, results, i, pieces, broadcasts)
        assemblers.append(asm)
    boxes = [
        math.prod(b - a for a, b in box) * asm.dtype.itemsize
        for asm in assemblers
        for _, box in asm.pieces
    ]
    reader = _BudgetedReader(
        plan.memory_budget_bytes, plan.store.directory, locator, sum(boxes), len(boxes)
    )
    try:
        for i, asm in zip(order, assemblers, strict=True):
            task, store, layout = plan.tasks[i], stores[i], layouts[i]
            if task.tensor is not None:
                reader.read_tensor(task.tensor, asm)
            else:
                checked = None
                if task.checksums is not None:
                    inner, shard = _chunk_shapes(store, metadatas[i])
                    checked = _Checked(task.name, task.shape, inner, dict(task.checksums), shard)
                for devices, box in asm.pieces:
                    reader.read(store, layout, box, asm, devices, checked)
            # The collectives of the arrays before this one run while its reads are in flight.
            for earlier in waiting:
                reader.complete(earlier)
                earlier.finish()
            waiting = [asm] if isinstance(asm, _BroadcastAssembler) else []
        reader.drain()
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


def _start_opens(plan: LoadPlan) -> list[Any]:
    """Start opening every task's array with TensorStore (None for tasks read from safetensors
    files); :func:`_finish_opens` waits for them."""
    context = tsu.new_context(plan.store.directory)
    kvstore = tsu.read_kvstore(plan.store)
    return [
        None
        if t.tensor is not None
        else ts.open(
            tsu.open_spec(kvstore, t.name, plan.fill_missing, plan.store.zarr_format),
            open=True,
            read=True,
            context=context,
        )
        for t in plan.tasks
    ]


def _finish_opens(plan: LoadPlan, opens: list[Any]) -> list[Any]:
    stores = []
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
                "The checkpoint is missing data or damaged; load an earlier checkpoint."
            ) from e
        if tuple(store.shape) != tuple(task.shape):
            raise CorruptCheckpointError(
                f"array {task.name!r} is stored with shape {tuple(store.shape)} in {plan.store.directory}, but its "
                f"metadata says {task.shape}; the checkpoint is damaged"
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
                f"array {task.name!r} would be loaded as {dtype} onto devices, but JAX runs without 64-bit types "
                f"(it would become {np.dtype(jax.dtypes.canonicalize_dtype(dtype))}, losing values); enable them "
                "(jax.config.update('jax_enable_x64', True) or `with jax.enable_x64():`), or ask for a 32-bit dtype "
                "in the abstract tree to cast"
            )


_Box = tuple[tuple[int, int], ...]


def _device_boxes(
    sharding: Any, shape: tuple[int, ...], readers: frozenset[int] | None = None
) -> tuple[list[tuple[tuple[Any, ...], _Box]], dict[Any, _Box]]:
    """The distinct boxes this host's devices hold (each with its devices; each box is read
    once, its replicas get copies in memory), and every device's box. ``readers``: only these
    device ids read (load-and-broadcast)."""
    by_box: dict[_Box, list[Any]] = {}
    of_device: dict[Any, _Box] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        box = of_device[device] = _slices_to_box(index, shape)
        if readers is None or device.id in readers:
            by_box.setdefault(box, []).append(device)
    return [(tuple(d), box) for box, d in by_box.items()], of_device


def _slices_to_box(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return (
        tuple(
            (s.start or 0, n if s.stop is None else s.stop)
            for s, n in zip(index, shape, strict=True)
        )
        if index
        else tuple((0, n) for n in shape)
    )


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype, alignment: int = 64) -> np.ndarray:
    """An uninitialized array whose data is ``alignment``-byte aligned.

    XLA's CPU client adopts such buffers without a copy on ``device_put``, so a loaded shard is
    read from disk straight into the memory the device array will own.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    offset = (-raw.ctypes.data) % alignment
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)


_MAPPED_MIN_BYTES = 1 << 20


def read_buffer(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialized, aligned array for file reads to fill (see :func:`aligned_empty`).

    Buffers of a MiB or more are private anonymous mappings, from the read pool
    (:mod:`._readpool`): a mapping whose arrays are all gone serves the next load of the same
    size instead of faulting in fresh memory. NumPy marks its large allocations MADV_HUGEPAGE,
    and with that hint cold loads were about twice as slow (benchmarks/NOTES.md has the
    figures); a mapping of our own follows the system's huge-page policy. In-memory copies
    (staging, casts) keep NumPy's allocation: there the hint made save_async's copies faster.
    """
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes >= _MAPPED_MIN_BYTES:
        try:
            return _readpool.POOL.take(nbytes).view(dtype).reshape(shape)
        except OSError:  # e.g. vm.max_map_count reached: NumPy's allocator still works
            pass
    return aligned_empty(shape, dtype)


class _Assembler:
    """Collects the pieces of one array as they are read and builds the result."""

    def __init__(
        self,
        task: LoadTask,
        sharding: Any,
        results: list[Any],
        slot: int,
        pieces: list[Any],
        device_boxes: dict[Any, _Box] | None = None,
    ) -> None:
        self.task = task
        self.sharding = sharding
        self.results = results
        self.slot = slot
        self.pieces = pieces
        self.device_boxes = device_boxes
        """Every addressable device's box (None: worked out when needed)."""
        self.placed: list[Any] = []
        self.unplaced: list[tuple[np.ndarray, Any]] = []
        self.copying: list[tuple[Any, tuple[Any, ...]]] = []
        """Replicas of a box being copied on a copy thread, and their devices."""
        self.dtype = np.dtype(task.dtype)
        self.on_cpu = all(d.platform == "cpu" for devices, _ in pieces for d in devices)

    def _cast(self, data: np.ndarray) -> np.ndarray:
        target = self.dtype
        if data.dtype != target:
            cast = aligned_empty(data.shape, target)
            parallel_copy([(cast, data)])
            data = cast
        return data

    def take(self, devices: tuple[Any, ...], data: np.ndarray) -> None:
        data = self._cast(data)
        if self.sharding is None:
            self.results[self.slot] = data
            return

        # A device array adopts an aligned buffer without a copy (CPU), so every device gets
        # its own: two devices sharing memory would clobber each other on donation.
        if len(devices) == 1:
            self.unplaced.append((data, devices[0]))
        elif self.on_cpu:
            # Made on a copy thread while this one goes on reading; finish() collects them.
            self.copying.append((_on_copy_pool(_replicas_of, data, len(devices) - 1), devices[1:]))
            self.unplaced.append((data, devices[0]))
        else:
            extras = [aligned_empty(data.shape, data.dtype) for _ in devices[1:]]
            parallel_copy([(extra, data) for extra in extras])
            self.unplaced.extend(zip([data, *extras], devices, strict=True))
        # On CPU the buffer becomes the device memory, so placing the whole array in one call
        # costs nothing extra; elsewhere place now, so host buffers stay within the budget.
        if not self.on_cpu:
            self._place()

    def _collect_copies(self) -> None:
        for future, devices in self.copying:
            self.unplaced.extend(zip(future.result(), devices, strict=True))
        self.copying = []

    def _place(self) -> None:
        import jax

        if self.unplaced:
            buffers, devices = zip(*self.unplaced, strict=True)
            # Into the memory the target sharding names (e.g. 'pinned_host' for offloaded state).
            memory_kind = getattr(self.sharding, "memory_kind", None)
            targets: list[Any] = list(devices)
            if memory_kind is not None:
                targets = [
                    jax.sharding.SingleDeviceSharding(d, memory_kind=memory_kind) for d in devices
                ]
            self.placed.extend(jax.device_put(list(buffers), targets))
            self.unplaced = []

    def finish(self) -> None:
        if self.sharding is None:
            return
        import jax

        self._collect_copies()
        if not self.placed and self.unplaced and not self.sharding.is_fully_replicated:
            # Every buffer is still on the host (CPU devices): one batched transfer for the whole
            # array, several times cheaper per array than placing each buffer on its own. Each
            # device still gets its own buffer (replicas of a box included).
            of_device = self.device_boxes
            if of_device is None:
                of_device = _device_boxes(self.sharding, self.task.shape)[1]
            by_box: dict[_Box, list[np.ndarray]] = {}
            for buffer, device in self.unplaced:
                by_box.setdefault(of_device[device], []).append(buffer)
            self.unplaced = []
            self.results[self.slot] = jax.make_array_from_callback(
                self.task.shape,
                self.sharding,
                lambda index: by_box[_slices_to_box(index, self.task.shape)].pop(),
            )
            return
        self._place()
        self.results[self.slot] = jax.make_array_from_single_device_arrays(
            self.task.shape, self.sharding, self.placed
        )
        self.placed = []


def _replicas_of(data: np.ndarray, n: int) -> list[np.ndarray]:
    """``n`` aligned copies of ``data``."""
    out = [aligned_empty(data.shape, data.dtype) for _ in range(n)]
    for extra in out:
        np.copyto(extra, data)
    return out


class _BroadcastAssembler(_Assembler):
    """An array loaded by load-and-broadcast: ``pieces`` are the boxes of this host's reading
    devices only; ``finish`` runs the collective that gives every device its shard."""

    def __init__(
        self,
        task: LoadTask,
        sharding: Any,
        results: list[Any],
        slot: int,
        pieces: list[Any],
        broadcasts: _Broadcasts,
    ) -> None:
        super().__init__(task, sharding, results, slot, pieces)
        self.broadcasts = broadcasts
        self.data: dict[int, Any] = {}
        self.finished = False

    def take(self, devices: tuple[Any, ...], data: np.ndarray) -> None:
        import jax

        data = self._cast(data)
        extras = [aligned_empty(data.shape, data.dtype) for _ in devices[1:]]
        parallel_copy([(extra, data) for extra in extras])
        for buffer, device in zip([data, *extras], devices, strict=True):
            # Off CPU the shard goes to its device now, so host buffers stay within the budget.
            self.data[device.id] = (
                buffer if device.platform == "cpu" else jax.device_put(buffer, device)
            )

    def finish(self) -> None:
        if not self.finished:
            self.finished = True
            self.results[self.slot] = self.broadcasts.run(
                self.slot, self.task, self.sharding, self.data
            )
            self.data = {}


class _Broadcasts:
    """The load-and-broadcast arrays of one load on this host. Every host runs their collectives
    in plan order; ``abandon`` runs the ones not yet run with placeholders, after a failure here."""

    def __init__(self, plan: LoadPlan) -> None:
        self.plan = plan
        self.pending = [
            i
            for i, t in enumerate(plan.tasks)
            if t.broadcast_axis is not None and t.sharding is not None
        ]
        self.routes: dict[int, Any] = {}
        self.broken = False
        """A collective itself failed: the others would fail (or wait) the same way."""

    def readers(self, slot: int, task: LoadTask, sharding: Any) -> frozenset[int] | None:
        """The ids of this host's devices that read task ``slot`` (None: every device, as usual)."""
        if task.broadcast_axis is None:
            return None
        return self._route(slot, task, sharding).readers

    def _route(self, slot: int, task: LoadTask, sharding: Any) -> Any:
        from milepost.workers import _broadcast

        if slot not in self.routes:
            self.routes[slot] = _broadcast.route(
                sharding, task.shape, np.dtype(task.dtype).itemsize, task.broadcast_axis
            )  # type: ignore[arg-type]
        return self.routes[slot]

    def run(self, slot: int, task: LoadTask, sharding: Any, data: dict[int, Any]) -> Any:
        from milepost.workers import _broadcast

        route = self._route(slot, task, sharding)
        self.pending.remove(slot)
        try:
            return _broadcast.broadcast(
                task.shape, np.dtype(task.dtype), sharding, task.broadcast_axis, route, data
            )  # type: ignore[arg-type]
        except Exception:
            self.broken = True
            raise

    def abandon(self) -> None:
        """After a failure on this host: join the collectives not run yet, so the other hosts
        finish theirs (and report their own outcome) instead of waiting for this one."""
        while self.pending and not self.broken:
            slot = self.pending[0]
            task = self.plan.tasks[slot]
            try:
                sharding = (
                    task.sharding.to_jax()
                    if isinstance(task.sharding, ShardingSpec)
                    else task.sharding
                )
                self.run(slot, task, sharding, {})
            except Exception:
                return


@dataclass(frozen=True)
class _Checked:
    """What a load checks an array's chunks against: the recorded checksum of each chunk."""

    name: str
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    expected: dict[tuple[int, ...], int]
    shard_shape: tuple[int, ...] = ()
    """The stored shards' shape (its chunk grid), which may hold several chunks."""

    def key(self, grid: tuple[int, ...]) -> str:
        """The storage key of the shard holding chunk ``grid``."""
        shard = self.shard_shape or self.chunk_shape
        return f"{self.name}/c" + "".join(
            f"/{g * c // s}" for g, c, s in zip(grid, self.chunk_shape, shard, strict=True)
        )


def _metadata(store: Any) -> dict[str, Any]:
    """An opened array's zarr metadata (from its spec's JSON, which costs tens of microseconds:
    a load takes it once per array)."""
    return store.spec().to_json().get("metadata", {})


def _chunk_shapes(
    store: Any, metadata: dict[str, Any] | None = None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shape of the array's stored chunks (inner chunks of a sharded zarr3 array) and of
    its shards."""
    return tsu.header_chunks(_metadata(store) if metadata is None else metadata)


def _inner_chunk_shape(store: Any) -> tuple[int, ...]:
    return _chunk_shapes(store)[0]


class _DirectRead:
    """The direct reads of one box in flight (each checks its chunk's checksum on its thread);
    if one of them turns out not to be directly readable (its chunk is missing), the whole box
    is read through TensorStore instead."""

    def __init__(
        self,
        handle: _direct.BoxHandle,
        store: Any,
        box: tuple[tuple[int, int], ...],
        out: np.ndarray,
        whole: tuple[tuple[int, int], ...],
    ) -> None:
        self.handle = handle
        self.store = store
        self.box = box
        self.out = out
        self.whole = whole
        self.staged: np.ndarray | None = None
        """After a fallback: the whole chunks the box touches, read to be checked (when more than the box)."""

    def result(self) -> bool:
        """Wait; True if the box was read through TensorStore after all (as ``whole``, the
        chunks a checked box touches, into ``staged`` when that is more than the box)."""
        if self.handle.result():
            if self.whole != self.box:
                self.staged = read_buffer(tuple(b - a for a, b in self.whole), self.out.dtype)
                ts.array(self.staged).write(_box_view(self.store, self.whole)).result()
            else:
                ts.array(self.out).write(_box_view(self.store, self.box)).result()
            return True
        return False


def _box_view(store: Any, box: tuple[tuple[int, int], ...]) -> Any:
    """The TensorStore view of ``box`` (indexing a TensorStore costs tens of microseconds: done
    only for reads that go through it)."""
    return store[tsu.box_to_slices(box)] if box else store


class _TensorRead:
    """Every box one host needs of one safetensors tensor, read together (rows that several
    boxes share are read once)."""

    def __init__(self, tensor: _safetensors.Tensor, asm: _Assembler) -> None:
        dtype = np.dtype(_safetensors._numpy_dtype(tensor.dtype))
        self.asm = asm
        self.targets = [
            (devices, box, read_buffer(tuple(b - a for a, b in box), dtype))
            for devices, box in asm.pieces
        ]
        self.nbytes = sum(out.nbytes for _, _, out in self.targets)
        self.futures = _safetensors.read_boxes(tensor, [(box, out) for _, box, out in self.targets])

    def finish(self) -> int:
        futures_wait(self.futures)
        got = sum(f.result() for f in self.futures)
        for devices, _, out in self.targets:
            self.asm.take(devices, out)
        self.targets = []
        return got


@dataclass
class _Read:
    future: Any
    out: np.ndarray
    asm: _Assembler
    devices: tuple[Any, ...]
    nbytes: int
    checked: _Checked | None = None
    """Checked here once read (TensorStore reads); direct reads check on their own threads."""
    whole: tuple[tuple[int, int], ...] = ()
    """The chunk-aligned box read (when checked), into ``staged`` if it is larger than the box."""
    box: tuple[tuple[int, int], ...] = ()
    staged: np.ndarray | None = None
    scratch: int = 0
    """Bytes held while in flight beyond ``nbytes`` (direct pieces read beside the box first)."""


class _BudgetedReader:
    """Issues reads, keeping at most ``budget`` bytes of read buffers in flight.

    A box goes straight from its file into the destination buffer when the locator can find it
    (see :mod:`._direct`), otherwise through TensorStore. With recorded checksums every chunk a
    box touches is read whole and checked before its values go anywhere: a box that covers
    chunks only partly is read through TensorStore as the whole chunks, then cut out.
    """

    def __init__(
        self,
        budget: int | None,
        directory: str = "",
        locator: _direct.Locator | None = None,
        total_bytes: int = 0,
        boxes: int = 0,
    ) -> None:
        """``total_bytes`` in ``boxes`` boxes: about what the load will read."""
        self.budget = budget
        self.directory = directory
        self.locator = locator
        self.direct = (
            _direct.DirectReader(total_bytes, boxes) if locator is not None else None
        )  # with the locator
        self.inflight: collections.deque[_Read | _TensorRead] = collections.deque()
        self.inflight_bytes = 0
        self.bytes_read = 0
        self.progress = _progress.counter()

    def read(
        self,
        store: Any,
        layout: _direct.ShardLayout | None,
        box: tuple[tuple[int, int], ...],
        asm: _Assembler,
        devices: tuple[Any, ...],
        checked: _Checked | None = None,
    ) -> None:
        dtype = store.dtype.numpy_dtype
        nbytes = math.prod(b - a for a, b in box) * dtype.itemsize
        direct: tuple[list[_direct.BoxRead], list[Any]] | None = None
        scratch = 0
        if layout is not None and self.locator is not None:
            # (with checksums, every chunk the box touches is read whole, and the box's part placed)
            pieces = _direct.box_reads(layout, box, whole_chunks=checked is not None) or []
            if checked is not None and not all(p.whole for p in pieces):
                pieces = []  # a partial chunk cannot be checked: read it whole, below
            values = [self.locator.locate(piece.key) for piece in pieces]
            if pieces and all(v is not None for v in values):
                direct = pieces, values
                scratch = sum(p.scratch for p in pieces)  # read beside the box
        whole = box
        if checked is not None:
            whole = _checksum.aligned_box(box, checked.chunk_shape, checked.shape)
            if whole != box and direct is None:
                nbytes += math.prod(b - a for a, b in whole) * dtype.itemsize
        if self.budget is not None:
            while self.inflight and self.inflight_bytes + nbytes + scratch > self.budget:
                self._complete_one()
        out = read_buffer(tuple(b - a for a, b in box), dtype)
        read = _Read(None, out, asm, devices, nbytes, checked, whole, box, scratch=scratch)
        if direct is not None:
            pieces, values = direct
            expected = [
                checked.expected.get(p.grid, -1) if checked is not None else None for p in pieces
            ]
            handle = self.direct.read_box(values, pieces, out, expected, asm.task.name)  # type: ignore[union-attr]
            read.future = _DirectRead(
                handle, store, box, out, whole
            )  # checked again only after a fallback
        elif whole == box:
            read.future = ts.array(out).write(_box_view(store, box))
        else:
            read.staged = read_buffer(tuple(b - a for a, b in whole), dtype)
            read.future = ts.array(read.staged).write(_box_view(store, whole))
        self.inflight.append(read)
        self.inflight_bytes += nbytes + scratch

    def read_tensor(self, tensor: _safetensors.Tensor, asm: _Assembler) -> None:
        """Read every box ``asm`` needs of a safetensors tensor."""
        if self.budget is not None:
            needed = (
                sum(math.prod(b - a for a, b in box) for _, box in asm.pieces)
                * tensor.nbytes
                // max(1, math.prod(tensor.shape))
            )
            while self.inflight and self.inflight_bytes + needed > self.budget:
                self._complete_one()
        read = _TensorRead(tensor, asm)
        self.inflight.append(read)
        self.inflight_bytes += read.nbytes

    def _complete_one(self) -> None:
        read = self.inflight.popleft()
        if isinstance(read, _TensorRead):
            self.bytes_read += read.finish()
            self.inflight_bytes -= read.nbytes
            if self.progress is not None:
                self.progress(read.nbytes)
            return
        asm = read.asm
        try:
            fell_back = read.future.result()
            if fell_back:
                read.staged = read.future.staged
            if read.checked is not None and (not isinstance(read.future, _DirectRead) or fell_back):
                self._check(read)
        except (
            Exception
        ) as e:  # TensorStore's ValueError("NOT_FOUND: ..."), a bad checksum, a short file...
            if isinstance(e, CorruptCheckpointError) and str(e).startswith(
                f"array {asm.task.name!r}"
            ):
                raise  # already names the array and says what is wrong
            mapped = from_tensorstore(
                e, f"reading array {asm.task.name!r}", self.directory, reading=True
            )
            if (
                isinstance(mapped, OSError)
                and not isinstance(mapped, FileNotFoundError)
                and mapped is not e
            ):
                raise mapped from e
            raise CorruptCheckpointError(
                f"array {asm.task.name!r}: reading a {read.out.shape} box from {self.directory} failed ({e}); the "
                "checkpoint's data files are missing or damaged. Load an earlier checkpoint."
            ) from e
        asm.take(read.devices, read.out)
        self.inflight_bytes -= read.nbytes + read.scratch
        self.bytes_read += read.nbytes
        if self.progress is not None:
            self.progress(
                read.out.nbytes
            )  # the box delivered (a checked read may read whole chunks around it)

    def _check(self, read: _Read) -> None:
        """Check every chunk of a box read through TensorStore, then cut the box out."""
        checked = read.checked
        assert checked is not None
        buffer = read.staged if read.staged is not None else read.out
        for grid, crc in _checksum.region_crc32c(buffer, read.whole, checked.chunk_shape):
            _checksum.check(checked.name, grid, crc, checked.expected, self._where(checked, grid))
        if read.staged is not None:
            local = tuple(
                slice(a - w, b - w) for (a, b), (w, _) in zip(read.box, read.whole, strict=True)
            )
            parallel_copy([(read.out, read.staged[local])])
            read.staged = None

    def _where(self, checked: _Checked, grid: tuple[int, ...]) -> str:
        key = checked.key(grid)
        value = self.locator.locate(key) if self.locator is not None else None
        return (
            f"{value.path} at byte {value.offset}"
            if value is not None
            else f"{self.directory}, key {key!r}"
        )

    def drain(self) -> None:
        while self.inflight:
            self._complete_one()

    def complete(self, asm: _Assembler) -> None:
        """Finish the reads in flight for ``asm`` (and the reads issued before them)."""
        while any(read.asm is asm for read in self.inflight):
            self._complete_one()

    def close(self) -> None:
        """Wait for direct reads still running (after a failure) and close their files."""
        if self.direct is not None:
            self.direct.close()


# ------------------------------------------------------------------------------------------
# Verify
# ------------------------------------------------------------------------------------------


def verify(plan: VerifyPlan, process_index: int | str = 0) -> VerifyAck:
    """Read every chunk of the plan and check it against its recorded checksum; report what is
    damaged, missing or unreadable instead of raising."""
    verifier = _Verifier(plan)
    for task in plan.tasks:
        verifier.check_array(task)
    return VerifyAck(
        process_index=process_index,
        chunks_checked=verifier.checked,
        bytes_read=verifier.nbytes,
        problems=tuple(verifier.problems),
    )


class _Verifier:
    def __init__(self, plan: VerifyPlan) -> None:
        self.plan = plan
        self.context = tsu.new_context(plan.tasks[0].store.directory if plan.tasks else None)
        self.budget = plan.memory_budget_bytes or (256 << 20)
        self.problems: list[str] = []
        self.checked = self.nbytes = 0
        self.progress = _progress.counter()

    def check_array(self, task: VerifyTask) -> None:
        spec = tsu.open_spec(
            tsu.read_kvstore(task.store), task.name, task.fill_missing, task.store.zarr_format
        )
        try:
            store = ts.open(spec, open=True, read=True, context=self.context).result()
            chunk_shape = _inner_chunk_shape(store)
        except Exception as e:
            self.problems.append(f"array {task.name!r}: cannot be opened ({e})")
            return
        shape = tuple(store.shape)
        expected = dict(task.expected) if task.expected is not None else None
        inflight: collections.deque[tuple[tuple[int, ...], Any, np.ndarray]] = collections.deque()
        held = 0
        for grid in task.chunks:
            box = tuple(
                (g * c, min((g + 1) * c, n))
                for g, c, n in zip(grid, chunk_shape, shape, strict=True)
            )
            out = np.empty(tuple(b - a for a, b in box), store.dtype.numpy_dtype)
            while inflight and held + out.nbytes > self.budget:
                held -= self._finish(task, expected, *inflight.popleft())
            inflight.append(
                (grid, ts.array(out).write(store[tsu.box_to_slices(box)] if box else store), out)
            )
            held += out.nbytes
        while inflight:
            self._finish(task, expected, *inflight.popleft())

    def _finish(
        self,
        task: VerifyTask,
        expected: dict[tuple[int, ...], int] | None,
        grid: tuple[int, ...],
        future: Any,
        out: np.ndarray,
    ) -> int:
        name = task.name
        try:
            future.result()
        except Exception as e:
            self.problems.append(f"array {name!r}: chunk {grid} is missing or unreadable ({e})")
            return out.nbytes
        self.checked += 1
        self.nbytes += out.nbytes
        if self.progress is not None:
            self.progress(out.nbytes)
        if expected is not None:
            try:
                _checksum.check(
                    name, grid, _checksum.values_crc32c(out), expected, task.store.directory
                )
            except CorruptCheckpointError as e:
                self.problems.append(str(e))
        return out.nbytes
