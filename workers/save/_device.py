"""Device-to-host copies of the regions a save writes from accelerator memory.

A region on a GPU or TPU reaches host memory through a copy of our own, never through the
caller's array: ``np.asarray`` of a caller's shard caches the host copy in that array (its
``_npy_value``, and the array's host value in jaxlib), so the caller would keep a host copy of
the whole state alive for as long as it keeps the state. Two ways, by ``SavePlan.device_staging``:

* ``'pinned_host'`` (the default on GPUs): one batched ``jax.device_put`` into the device's
  'pinned_host' memory. Page-locked memory takes the DMA at the bus's full rate (pageable memory
  goes through a bounce buffer), and a pinned buffer is host memory that NumPy views without a
  copy (jaxlib's zero-copy rule: ``IsOnCpu()`` is true for pinned-host buffers, of dense
  layout, on the GPU clients). XLA's GPU clients take it from one pool per process (a BFC
  allocator, 64 GiB at most unless ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` says otherwise) that
  keeps what it allocated for the next save: a save puts at most half that limit there
  (:func:`pinned_window_bytes`), its other parts go the ``'host_copy'`` way. On TPUs
  pinned-host buffers may carry device layouts, which ``np.asarray`` unpacks with a copy.
* ``'host_copy'`` (the default elsewhere): ``copy_to_host_async`` on an array object of our own
  over the same device buffer, then ``np.asarray`` of it: JAX's own copy, into pageable memory.

Every copy starts before the first wait. A region that is only part of its shard (a replicated
shard split among its replicas) is first cut out on its device, so only its bytes cross the
bus; the parts cut out but not yet copied stay within :data:`CUT_WINDOW_BYTES` per device.
:class:`Window` then waits for each copy in order and issues its write, so the writes overlap
the copies still running; with a host staging budget the copies in host memory at once stay
within it (the next copy starts once an earlier write is durable).

On CPU devices a shard is host memory already (the save writes or stages it without a
transfer); ``device_staging='pinned_host'`` sends their shards through this path too, which is
how the tests and ``benchmarks/accelerator_bench.py --cpu`` run it without an accelerator.
"""

from __future__ import annotations

import collections
import functools
import math
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from milepost.workers._memory import alias
from milepost.workers._messages import ArraySpec

CUT_WINDOW_BYTES = 256 << 20
"""At most this many bytes of parts cut out on one device wait for their copy at once (device
memory beyond the state's own; a larger part is cut alone)."""


def pinned_window_bytes() -> int:
    """The most bytes one save copies into 'pinned_host' memory: half of XLA's GPU pinned-host
    pool (``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``, 64 GiB by default), which JAX's own transfers
    and the caller's host-offloaded arrays share."""
    try:
        gib = float(os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "64"))
    except ValueError:
        gib = 64.0
    return int(gib * (1 << 30)) // 2


def mode_of(source: Any, option: str) -> str | None:
    """How the regions of ``source`` reach host memory: None (they are host memory: NumPy, CPU
    devices, arrays in a host memory kind), ``'pinned_host'`` or ``'host_copy'``."""
    if isinstance(source, np.ndarray | np.generic):
        return None
    if getattr(source.sharding, "memory_kind", None) in ("pinned_host", "unpinned_host"):
        return None
    device = next(iter(source.sharding.addressable_devices), None)
    if device is None:  # (no shard of it is here: nothing to write)
        return None
    if option == "host_copy":
        return None if device.platform == "cpu" else "host_copy"
    if option == "auto":
        if device.platform == "cpu":
            return None
        return "pinned_host" if device.platform == "gpu" and _has_pinned(device) else "host_copy"
    if not _has_pinned(device):
        raise ValueError(
            f"SaveOptions(device_staging='pinned_host'): device {device} offers no 'pinned_host' "
            f"memory (it has {_memory_kinds(device)}); use device_staging='auto' or 'host_copy'"
        )
    return "pinned_host"


def _memory_kinds(device: Any) -> list[str]:
    try:
        return sorted(m.kind for m in device.addressable_memories())
    except Exception:  # (a runtime without memory kinds)
        return []


def _has_pinned(device: Any) -> bool:
    return "pinned_host" in _memory_kinds(device)


class DevicePart:
    """One region of a device shard, on its way to host memory. Until :meth:`host` it stands
    for its values where only their shape and type are needed (the packer's choice)."""

    def __init__(
        self, shard: Any, box: tuple[tuple[int, int], ...], mode: str, spec: ArraySpec
    ) -> None:
        data = shard.data
        if np.dtype(data.dtype) != np.dtype(spec.dtype):
            raise TypeError(
                f"array {spec.name!r}: planned dtype {spec.dtype} but the data is {data.dtype}"
            )
        offsets = [s.start or 0 for s in shard.index] if shard.index else []
        self.local = tuple(slice(a - o, b - o) for (a, b), o in zip(box, offsets, strict=True))
        self.shape = tuple(sl.stop - sl.start for sl in self.local)
        self.dtype = np.dtype(data.dtype)
        self.ndim = len(self.shape)
        self.size = math.prod(self.shape)
        self.nbytes = self.size * self.dtype.itemsize
        self.device = shard.device
        self.mode = mode
        self.whole = self.shape == tuple(data.shape)
        """The region is the whole shard (else the part is cut out on the device first)."""
        self._source: Any = data  # the caller's array: dropped once the copy started
        self._staged: Any = None  # our array whose host copy is on its way
        self._host: np.ndarray | None = None
        self._lock = threading.Lock()  # (the caller waits for the copy, a pool job writes it)
        self.copied = False
        """The copy is done (:meth:`host` returned)."""

    @property
    def started(self) -> bool:
        return self._source is None

    def host(self) -> np.ndarray:
        """The values in host memory of our own (waits for the copy)."""
        with self._lock:
            if self._host is None:
                assert not self.copied, "DevicePart.host after release"
                assert self._staged is not None, "DevicePart.host before Transfers.start"
                self._host = np.asarray(self._staged)
                self._staged = None
                self.copied = True
            return self._host

    def __getitem__(self, key: Any) -> np.ndarray:
        return self.host()[key]

    def release(self) -> None:
        """Drop our reference to the host copy (its memory goes once nothing else uses it)."""
        self._host = None


class Transfers:
    """The device-to-host copies of one save on one host."""

    def __init__(self) -> None:
        self.parts: list[DevicePart] = []
        self.started_bytes = 0
        """Bytes whose copy was started."""
        self.peak_bytes = 0
        """The most bytes held in host memory at once by copies not yet written durably
        (:class:`Window`)."""
        self._cuts: dict[Any, collections.deque[DevicePart]] = collections.defaultdict(
            collections.deque
        )
        self._cut_bytes: dict[Any, int] = collections.defaultdict(int)
        self.pinned_bytes = 0
        """Bytes copied into 'pinned_host' memory (at most :func:`pinned_window_bytes`; the
        parts beyond go the 'host_copy' way)."""
        self._pinned_window = pinned_window_bytes()

    def add(
        self, shard: Any, box: tuple[tuple[int, int], ...], mode: str, spec: ArraySpec
    ) -> DevicePart:
        part = DevicePart(shard, box, mode, spec)
        self.parts.append(part)
        return part

    def start(self, parts: Sequence[DevicePart]) -> None:
        """Start the copies of ``parts``, in order, together: one ``device_put`` for those into
        pinned memory (a part cut out on its device waits, if need be, for the copies of the
        parts cut out before it there)."""
        sources: list[Any] = []
        targets: list[Any] = []
        into: list[DevicePart] = []

        def issue() -> None:
            if sources:
                for part, staged in zip(into, _device_put(sources, targets), strict=True):
                    part._staged = staged
                sources.clear()
                targets.clear()
                into.clear()

        for part in parts:
            if part.started:
                continue
            if part.mode == "pinned_host":
                if self.pinned_bytes + part.nbytes > self._pinned_window:
                    part.mode = "host_copy"
                else:
                    self.pinned_bytes += part.nbytes
            source = part._source
            if not part.whole:
                cuts = self._cuts[part.device]
                while cuts and self._cut_bytes[part.device] + part.nbytes > CUT_WINDOW_BYTES:
                    issue()  # (the copies waited for below must have started)
                    done = cuts.popleft()
                    if not done.copied:
                        done.host()
                    self._cut_bytes[part.device] -= done.nbytes
                source = _cut(source, part.local)
                cuts.append(part)
                self._cut_bytes[part.device] += part.nbytes
            elif part.mode == "host_copy":
                source = alias(source)  # (the host copy is cached on this object, ours)
            part._source = None
            self.started_bytes += part.nbytes
            if part.mode == "pinned_host":
                sources.append(source)
                targets.append(_pinned(part.device))
                into.append(part)
            else:
                source.copy_to_host_async()
                part._staged = source
        issue()


class Window:
    """Writes device parts in order, each as soon as its copy is in host memory, with at most
    ``room`` bytes of copies in host memory whose writes are not yet durable (None: no bound; a
    part larger than ``room`` is copied alone): a copy starts once enough earlier writes are
    durable."""

    def __init__(self, transfers: Transfers, parts: Sequence[DevicePart], room: int | None) -> None:
        self.transfers = transfers
        self.parts = parts
        self.room = room
        self._durable: collections.deque[tuple[DevicePart, Any]] = collections.deque()
        self._held = 0
        self._next = 0  # the next part to start

    def begin(self) -> None:
        """Start the copies the room allows now (no wait)."""
        self._start_more(-1)

    def wait_copies(self) -> None:
        """Wait until every copy is in host memory (without a room, all started at once)."""
        assert self.room is None and self._next == len(self.parts)
        for part in self.parts:
            part.host()

    def write_all(self, write: Callable[[DevicePart], Any], wait: Callable[[Any], None]) -> None:
        """``write`` issues the write of a part (from :meth:`DevicePart.host`) and returns its
        commit future; ``wait`` waits for one. Returns once every copy is done (the last
        writes, within the room, go on)."""
        for i, part in enumerate(self.parts):
            if i >= self._next or self.room is not None:
                self._start_more(i, wait)
            self._durable.append((part, write(part)))

    def _free(self, wait: Callable[[Any], None] | None) -> bool:
        """Release the oldest write once durable (waiting for it if ``wait`` is given)."""
        if not self._durable or (wait is None and not self._durable[0][1].done()):
            return False
        part, commit = self._durable.popleft()
        if wait is not None:
            wait(commit)
        else:
            commit.result()  # (done: raises its error, if any)
        part.release()
        self._held -= part.nbytes
        return True

    def _start_more(self, upto: int, wait: Callable[[Any], None] | None = None) -> None:
        """Start what the room allows, waiting for writes (``wait``) until part ``upto`` has
        started."""
        first = self._next
        while self._next < len(self.parts):
            need = self.parts[self._next].nbytes
            if self.room is not None and self._held and self._held + need > self.room:
                while self._free(None):
                    pass
                if self._held and self._held + need > self.room:
                    if self._next > upto or wait is None:
                        break
                    self.transfers.start(self.parts[first : self._next])
                    first = self._next
                    if not self._free(wait):  # (only written parts are held before ``upto``)
                        raise AssertionError("a device copy waits for nothing written")
                    continue
            self._held += need
            self.transfers.peak_bytes = max(self.transfers.peak_bytes, self._held)
            self._next += 1
        self.transfers.start(self.parts[first : self._next])


def _pinned(device: Any) -> Any:
    import jax

    return jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")


def _device_put(sources: list[Any], targets: list[Any]) -> list[Any]:
    """One batched ``jax.device_put`` (asynchronous: the copies run while we go on)."""
    import jax

    return list(jax.device_put(sources, targets))


def _cut(array: Any, local: tuple[slice, ...]) -> Any:
    """``array[local]``, cut out on its device (one compiled program per shape and part shape,
    whatever the part's offset)."""
    starts = tuple(sl.start for sl in local)
    sizes = tuple(sl.stop - sl.start for sl in local)
    return _cutter()(array, starts, sizes)


@functools.cache
def _cutter() -> Callable[..., Any]:
    import jax
    from jax import lax

    return jax.jit(lax.dynamic_slice, static_argnums=2)
