"""Putting a loaded array together: the boxes a host read become device buffers (replicas
copied in memory, each device its own buffer), then one global ``jax.Array``. Arrays loaded by
load-and-broadcast get the other replicas' shards from a collective among the hosts
(:mod:`._broadcast`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from milepost.workers._boxes import Box, addressable_boxes, slices_to_box
from milepost.workers._memory import aligned_empty, on_copy_pool, parallel_copy
from milepost.workers._messages import LoadPlan, LoadTask
from milepost.workers._sharding import ShardingSpec
from milepost.workers.load import _broadcast

DEVICE_PATH_ON_CPU = False
"""Place each box on its devices as it arrives, as on accelerators, on CPU devices too (the
tests and ``benchmarks/accelerator_bench.py --cpu`` set it to run that path without one)."""


class Assembler:
    """Collects the pieces of one array as they are read and builds the result."""

    def __init__(
        self,
        task: LoadTask,
        sharding: Any,
        results: list[Any],
        slot: int,
        pieces: list[Any],
        device_boxes: dict[Any, Box] | None = None,
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
        self.host_devices = all(d.platform == "cpu" for devices, _ in pieces for d in devices)
        """Every device is a CPU: its arrays adopt host buffers."""
        self.on_cpu = self.host_devices and not DEVICE_PATH_ON_CPU
        """Assemble the CPU way: every buffer placed at once by :meth:`finish`."""

    def _cast(self, data: np.ndarray) -> np.ndarray:
        target = self.dtype
        if data.dtype != target:
            cast = aligned_empty(data.shape, target)
            parallel_copy([(cast, data)])
            data = cast
        return data

    def take(self, devices: tuple[Any, ...], data: np.ndarray) -> list[Any]:
        """Take the values of one box for ``devices``; returns the device arrays whose
        transfers from host buffers started now (they read ``data`` until they are ready)."""
        data = self._cast(data)
        if self.sharding is None:
            self.results[self.slot] = data
            return []

        # A device array adopts an aligned buffer without a copy (CPU), so every device gets
        # its own: two devices sharing memory would clobber each other on donation.
        if len(devices) == 1:
            self.unplaced.append((data, devices[0]))
        elif self.on_cpu:
            # Made on a copy thread while this one goes on reading; finish() collects them.
            self.copying.append((on_copy_pool(_replicas_of, data, len(devices) - 1), devices[1:]))
            self.unplaced.append((data, devices[0]))
        elif self.host_devices:
            extras = [aligned_empty(data.shape, data.dtype) for _ in devices[1:]]
            parallel_copy([(extra, data) for extra in extras])
            self.unplaced.extend(zip([data, *extras], devices, strict=True))
        else:  # (a transfer copies: one host buffer feeds every replica's)
            self.unplaced.extend((data, device) for device in devices)
        # On CPU the buffer becomes the device memory, so placing the whole array in one call
        # costs nothing extra; elsewhere place now: the transfers (asynchronous) run while the
        # next boxes are read, and the reader counts their host buffers until they are done.
        if not self.on_cpu:
            return self._place()
        return []

    def _collect_copies(self) -> None:
        for future, devices in self.copying:
            self.unplaced.extend(zip(future.result(), devices, strict=True))
        self.copying = []

    def _place(self) -> list[Any]:
        """Start placing every buffer not yet placed; returns the new device arrays."""
        import jax

        placed: list[Any] = []
        if self.unplaced:
            buffers, devices = zip(*self.unplaced, strict=True)
            # Into the memory the target sharding names (e.g. 'pinned_host' for offloaded state).
            memory_kind = getattr(self.sharding, "memory_kind", None)
            targets: list[Any] = list(devices)
            if memory_kind is not None:
                targets = [
                    jax.sharding.SingleDeviceSharding(d, memory_kind=memory_kind) for d in devices
                ]
            placed = list(jax.device_put(list(buffers), targets))
            self.placed.extend(placed)
            self.unplaced = []
        return placed

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
                of_device = addressable_boxes(self.sharding, self.task.shape)[1]
            by_box: dict[Box, list[np.ndarray]] = {}
            for buffer, device in self.unplaced:
                by_box.setdefault(of_device[device], []).append(buffer)
            self.unplaced = []
            self.results[self.slot] = jax.make_array_from_callback(
                self.task.shape,
                self.sharding,
                lambda index: by_box[slices_to_box(index, self.task.shape)].pop(),
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


class BroadcastAssembler(Assembler):
    """An array loaded by load-and-broadcast: ``pieces`` are the boxes of this host's reading
    devices only; ``finish`` runs the collective that gives every device its shard."""

    def __init__(
        self,
        task: LoadTask,
        sharding: Any,
        results: list[Any],
        slot: int,
        pieces: list[Any],
        broadcasts: Broadcasts,
    ) -> None:
        super().__init__(task, sharding, results, slot, pieces)
        self.broadcasts = broadcasts
        self.data: dict[int, Any] = {}
        self.finished = False

    def take(self, devices: tuple[Any, ...], data: np.ndarray) -> list[Any]:
        import jax

        data = self._cast(data)
        extras = [aligned_empty(data.shape, data.dtype) for _ in devices[1:]]
        parallel_copy([(extra, data) for extra in extras])
        placed: list[Any] = []
        for buffer, device in zip([data, *extras], devices, strict=True):
            # Off CPU the shard goes to its device now, so host buffers stay within the budget.
            if device.platform == "cpu":
                self.data[device.id] = buffer
            else:
                self.data[device.id] = jax.device_put(buffer, device)
                placed.append(self.data[device.id])
        return placed

    def finish(self) -> None:
        if not self.finished:
            self.finished = True
            self.results[self.slot] = self.broadcasts.run(
                self.slot, self.task, self.sharding, self.data
            )
            self.data = {}


class Broadcasts:
    """The load-and-broadcast arrays of one load on this host. Every host runs their collectives
    in plan order; ``abandon`` runs the ones not yet run with placeholders, after a failure here."""

    def __init__(self, plan: LoadPlan) -> None:
        self.plan = plan
        self.pending = [
            i
            for i, t in enumerate(plan.tasks)
            if t.broadcast_axis is not None and t.sharding is not None
        ]
        self.routes: dict[int, _broadcast.Route] = {}
        self.broken = False
        """A collective itself failed: the others would fail (or wait) the same way."""

    def readers(self, slot: int, task: LoadTask, sharding: Any) -> frozenset[int] | None:
        """The ids of this host's devices that read task ``slot`` (None: every device, as usual)."""
        if task.broadcast_axis is None:
            return None
        return self._route(slot, task, sharding).readers

    def _route(self, slot: int, task: LoadTask, sharding: Any) -> _broadcast.Route:
        if slot not in self.routes:
            axis = task.broadcast_axis
            assert axis is not None  # only the tasks in ``pending`` are routed
            self.routes[slot] = _broadcast.route(
                sharding, task.shape, np.dtype(task.dtype).itemsize, axis
            )
        return self.routes[slot]

    def run(self, slot: int, task: LoadTask, sharding: Any, data: dict[int, Any]) -> Any:
        route = self._route(slot, task, sharding)
        self.pending.remove(slot)
        axis = task.broadcast_axis
        assert axis is not None  # (routed above)
        try:
            return _broadcast.broadcast(
                task.shape, np.dtype(task.dtype), sharding, axis, route, data
            )
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
