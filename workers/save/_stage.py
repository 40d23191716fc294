"""A host's part of a save: copy its shards to host memory (the blocking part), then write
them with TensorStore into OCDBT databases of its own.

:func:`start_save` opens every array of the plan in this host's databases (one host per array
writes its ``zarr.json``; the others write chunks only), starts the device-to-host transfers,
and issues the writes; it returns a :class:`PendingSave` once the caller's arrays are free.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import tensorstore as ts

from milepost.workers import _keys, _progress
from milepost.workers._boxes import box_to_slices
from milepost.workers._memory import on_copy_pool, parallel_copy
from milepost.workers._messages import ArraySpec, Region, SavePlan, SaveTask
from milepost.workers.format import from_tensorstore, specs
from milepost.workers.save import _adaptive, _device, _packed, _staging
from milepost.workers.save._pending import PendingSave


def start_save(plan: SavePlan, sources: Sequence[Any]) -> PendingSave:
    """Open every array of ``plan``, issue its writes and return once the data is staged.

    With ``plan.copy`` the return means every region's bytes are in host buffers of our own, so
    the caller may delete, donate or overwrite its arrays. Without it TensorStore references the
    caller's memory until :meth:`PendingSave.wait` returns. With ``plan.adaptive_staging`` the
    budget is the one this host's earlier saves of the checkpointable lead to, and this save's
    peak sets the next one's.
    """
    adaptive = plan.adaptive_staging if plan.copy else None
    name = plan.store.directory.rstrip("/").rpartition("/")[2]
    if adaptive is not None:
        bound = _adaptive.REGULATOR.bound(adaptive, name, plan.process_index)
        plan = replace(plan, staging_budget_bytes=bound)
    context = specs.new_context(plan.store.directory)
    tasks = [t for t in plan.tasks if t.regions or t.create]
    parts = _split_among_writers(tasks, plan.writers if plan.store.use_ocdbt else 1)
    pending = PendingSave(plan, context)
    sources = _key_data(plan, sources)
    opens = []
    headers: set[str] = set()  # arrays whose zarr.json one of our writers writes
    for writer, task, _ in parts:
        spec = specs.create_spec(
            specs.write_kvstore(plan.store, plan.process_index, plan.first_writer + writer),
            task.spec,
        )
        create = task.write_metadata and task.spec.name not in headers
        if create:
            headers.add(task.spec.name)
        # else chunks only: the array's header is written by another writer or host
        database = (
            specs.process_dir_name(plan.process_index, plan.first_writer + writer)
            if plan.store.use_ocdbt
            else None
        )
        opens.append(_Opening(spec, create, context, pending, database))
    try:
        held = _issue_writes(plan, sources, parts, opens, pending)
    except BaseException as e:
        if isinstance(e, TimeoutError) and not str(e):  # the deadline: settled by the caller
            raise pending.staging_timeout() from None
        pending.settle()  # opens and writes already issued must land before the caller cleans up
        mapped = from_tensorstore(e, "creating the checkpoint's arrays", plan.store.directory)
        if mapped is e:
            raise
        raise mapped from e
    if adaptive is not None:
        _adaptive.REGULATOR.record(adaptive, name, plan.process_index, held)
    return pending


_Part = tuple[int, SaveTask, tuple[Region, ...]]


class _Opening:
    """One array's open in one writer's database, started by its first use (on whichever
    thread gets there first): the opens of arrays whose regions are all staged then run off
    the caller's thread with their writes (each ``ts.open`` costs CPU)."""

    def __init__(
        self,
        spec: dict[str, Any],
        create: bool,
        context: Any,
        pending: PendingSave,
        database: str | None = None,
    ) -> None:
        self.database = database
        """The OCDBT database written into (None: a plain zarr3 folder)."""
        self._spec = spec
        self._create = create
        self._context = context
        self._pending = pending
        self._future: Any = None
        self._lock = threading.Lock()
        self.needed = create
        """Whether to open it at all: it creates the array's header, or a region is written
        through it (not packed)."""

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
                self._pending.track(self._future, name=self._spec["kvstore"]["path"].rstrip("/"))
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
_DeviceWrite = tuple[_Opening, tuple[tuple[int, int], ...], _device.DevicePart, ArraySpec]
"""(the array's opening, box, the region on its way from device memory, its spec)."""


@dataclass
class _Regions:
    """A host's regions of one save, sorted by how their bytes reach storage."""

    packer: _packed.Packer | None
    """Small shards, encoded into one packed database (None: not an OCDBT save)."""
    room: int | None
    """What is left of the staging budget (None: no budget)."""
    writes: list[_Write] = field(default_factory=list)
    """From memory that is ours, or that the caller lends us until durable."""
    blocking: list[_Write] = field(default_factory=list)
    """From the caller's memory, durable before we return (beyond the staging budget)."""
    copies: list[tuple[_Write, np.ndarray]] = field(default_factory=list)
    """Staged: (the write of a staging copy, the data to copy)."""
    from_devices: list[_DeviceWrite] = field(default_factory=list)
    """In accelerator memory: written as each copy arrives in host memory."""
    packed_parts: list[_device.DevicePart] = field(default_factory=list)
    """In accelerator memory and packed: copied into the packed buffer."""
    transfers: _device.Transfers = field(default_factory=lambda: _device.Transfers())
    """The device copies (the class looked up per save: tests record them)."""


def _issue_writes(
    plan: SavePlan,
    sources: Sequence[Any],
    parts: list[_Part],
    opens: list[_Opening],
    pending: PendingSave,
) -> int:
    """Issue every region's write. Regions that may be the caller's memory are first copied
    into staging buffers of our own (with ``plan.copy``); with a staging budget, the regions
    beyond it are written from the caller's memory instead, and waited for here. Regions in
    accelerator memory are copied to host memory of our own (:mod:`._device`), all copies
    started before any wait, each written as soon as it is in host memory.

    Returns the most bytes held in staging at once, under a budget: the staged and packed
    copies (held until durable) and the device copies' peak (0 without a budget)."""
    regions = _sort_regions(plan, sources, parts, opens)
    write = _writer(pending)
    # The device copies start first (the packed ones, small, before the others): every copy
    # the room allows runs while we go on.
    regions.transfers.start(regions.packed_parts)
    window = _device.Window(
        regions.transfers,
        [item[2] for item in regions.from_devices],
        regions.room if plan.copy else None,
    )
    window.begin()
    packed = _packed_copies(regions, pending)
    if regions.writes or regions.blocking or regions.from_devices or not regions.copies:
        # Writes issued here: every open first, so they run together (and the writes reach
        # TensorStore together: one by one, each after its array's open, a save's data spread
        # over more files). Only a save that stages everything opens off the caller's thread.
        _start_opens(opens)
    # The writes the caller waits for go first, so their I/O overlaps the copies. They and
    # their checksums read the caller's memory, which is the caller's again once we return.
    waits = [future for item in regions.blocking for future in write(item)]
    for item in regions.writes:
        write(item)
    if regions.from_devices:
        _write_from_devices(regions.from_devices, window, write, pending)
    if regions.copies:
        _write_staged(regions.copies, packed, opens, write, pending)
    elif packed:
        parallel_copy(packed)
    for part in regions.packed_parts:  # (their values are in the packed buffer now)
        part.release()
    if packed:  # (written off the caller's thread, as the staged copies' writes are)
        assert regions.packer is not None
        pending.packing(regions.packer, on_copy_pool(regions.packer.write), _progress.counter())
    for future in waits:
        future.result(timeout=pending.staging_left())
    budget = plan.staging_budget_bytes if plan.copy else None
    if budget is None or regions.room is None:
        return 0
    return budget - regions.room + regions.transfers.peak_bytes


def _sort_regions(
    plan: SavePlan, sources: Sequence[Any], parts: list[_Part], opens: list[_Opening]
) -> _Regions:
    """Every region of ``parts``, sorted (:class:`_Regions`); the packer takes the small ones.
    An array is opened by the first write into it (``needed``): the staged copies' writes run
    off the caller's thread, so a save that stages everything neither opens nor waits for an
    open (creating arrays' headers cost milliseconds of a save's blocking part)."""
    out = _Regions(
        packer=(
            _packed.Packer(
                plan.store, specs.process_dir_name(plan.process_index, plan.first_writer)
            )
            if plan.store.use_ocdbt
            else None
        ),
        room=plan.staging_budget_bytes,
    )
    for (_, task, regions), store in zip(parts, opens, strict=True):
        source = sources[task.source]
        shards = _shards_by_device(source)
        mode = _device.mode_of(source, plan.device_staging)
        for region in regions:
            data: np.ndarray | _device.DevicePart
            if mode is not None and region.device_id >= 0:
                shard = _shard_of(shards, region.device_id, task.spec)
                data = out.transfers.add(shard, region.index, mode, task.spec)
            else:
                data = _region_data(source, shards, region.device_id, region.index, task.spec)
            room = out.room
            packed_bytes = out.packer.add(task.spec, region.index, data, room) if out.packer else 0
            if packed_bytes:
                out.room = None if room is None else room - packed_bytes
                if isinstance(data, _device.DevicePart):
                    out.packed_parts.append(data)
                continue
            store.needed = True
            if isinstance(data, _device.DevicePart):
                out.from_devices.append((store, region.index, data, task.spec))
            elif not (plan.copy and _may_alias_caller_memory(source, region.device_id)):
                out.writes.append((store, region.index, data, task.spec))
            elif room is None or data.nbytes <= room:
                out.room = None if room is None else room - data.nbytes
                out.copies.append(((store, region.index, data, task.spec), data))
            else:
                out.blocking.append((store, region.index, data, task.spec))
    return out


def _writer(pending: PendingSave) -> Callable[[_Write], Any]:
    """Issues one region's write (the array opened first) and its checksum, tracked by
    ``pending``: (the write's commit future, the checksum's future)."""
    progress = _progress.counter()

    def write(item: _Write) -> Any:
        opening, box, data, spec = item
        written = (
            opening.start()
            .result(timeout=pending.staging_left())[box_to_slices(box)]
            .write(data, can_reference_source_data_indefinitely=True)
        )
        pending.track(written.commit, data.nbytes, spec.name)
        if progress is not None:  # a progress bar counts each write once durable
            written.commit.add_done_callback(
                lambda f, n=data.nbytes: f.exception() is None and progress(n)
            )
        return written.commit, pending.checksum(spec, box, data, opening.database)

    return write


def _start_opens(opens: list[_Opening]) -> None:
    for opening in opens:
        if opening.needed:
            opening.start()


def _packed_copies(regions: _Regions, pending: PendingSave) -> list[tuple[np.ndarray, np.ndarray]]:
    """The packed database's buffer, held by ``pending``, and the copies that fill it; the
    staging pool keeps only what this save's buffers will reuse."""
    packer = regions.packer
    packed_size = packer.layout() if packer is not None and packer.nbytes else 0
    if regions.copies or packed_size:
        sizes = [data.nbytes for _, data in regions.copies]
        _staging.POOL.keep_only([*sizes, packed_size] if packed_size else sizes)
    if packer is None or not packed_size:
        return []
    buffer, raw = _staging.POOL.take((packed_size,), np.dtype(np.uint8))
    pending.hold(raw)
    return packer.copies(buffer)


def _write_from_devices(
    from_devices: list[_DeviceWrite],
    window: _device.Window,
    write: Callable[[_Write], Any],
    pending: PendingSave,
) -> None:
    """Each region as soon as its copy is in host memory: the writes overlap the copies still
    running. The copies are ours: the caller's arrays are free once the last one is done."""
    of_part = {id(item[2]): item for item in from_devices}

    def write_part(part: _device.DevicePart) -> Any:
        opening, box, _, spec = of_part[id(part)]
        return write((opening, box, part.host(), spec))[0]

    def wait(future: Any) -> None:
        future.result(timeout=pending.staging_left())

    if window.room is None:  # issued on the copy pool: we only wait for the copies
        pending.issued_by(on_copy_pool(window.write_all, write_part, wait))
        window.wait_copies()
    else:  # (a copy may wait for earlier writes to be durable)
        window.write_all(write_part, wait)


def _write_staged(
    copies: list[tuple[_Write, np.ndarray]],
    packed: list[tuple[np.ndarray, np.ndarray]],
    opens: list[_Opening],
    write: Callable[[_Write], Any],
    pending: PendingSave,
) -> None:
    """Copy into aligned staging buffers of our own (TensorStore then references them until
    the writes are durable instead of copying again, and the caller's arrays are free), with
    the packed copies; their writes are issued off the caller's thread."""
    staged: list[_Write] = []
    for (store, box, data, spec), _ in copies:
        buffer, raw = _staging.POOL.take(data.shape, data.dtype)
        pending.hold(raw)
        staged.append((store, box, buffer, spec))
    # Every copy before any write: the writes would compete with the copies for memory
    # bandwidth and cores, and the copies are what the caller waits for (overlapping them
    # on 2 cores cut the total by about what it added to the blocking part).
    parallel_copy(
        [(item[2], data) for item, (_, data) in zip(staged, copies, strict=True)] + packed
    )

    # The copies' writes read only our buffers: they are issued off the caller's thread
    # (many writes and their checksum jobs cost milliseconds of the blocking part),
    # after every open they wait for has started (so the opens run together).
    def issue() -> None:
        _start_opens(opens)
        for item in staged:
            write(item)

    pending.issued_by(on_copy_pool(issue))


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


def _shard_of(shards: dict[int, Any], device_id: int, spec: ArraySpec) -> Any:
    shard = shards.get(device_id)
    if shard is None:
        raise ValueError(
            f"array {spec.name!r}: the plan asks this host to write the shard on device "
            f"{device_id}, which is not addressable here (addressable: {sorted(shards)})"
        )
    return shard


def _region_data(
    source: Any,
    shards: dict[int, Any],
    device_id: int,
    box: tuple[tuple[int, int], ...],
    spec: ArraySpec,
) -> np.ndarray:
    if device_id < 0:
        data = np.asarray(source)[box_to_slices(box)]
    else:
        shard = _shard_of(shards, device_id, spec)
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
