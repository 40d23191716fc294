"""Host memory for shards: aligned buffers that device arrays adopt, read buffers from the read
pool, and copies spread over the copy pool's threads."""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from typing import Any, TypeVar

import numpy as np

from milepost.workers import _readpool
from milepost.workers._errors import HostMemoryError
from milepost.workers._runtime import RUNTIME, Pool

T = TypeVar("T")


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
    size instead of faulting in fresh memory. Mappings of 2 MiB or more ask for huge pages
    (MADV_HUGEPAGE, as NumPy does for its large allocations): fewer faults while the reads fill
    them (docs/performance.md#read-buffers has the figures). In-memory copies (staging, casts)
    keep NumPy's allocation.
    """
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes >= _MAPPED_MIN_BYTES:
        try:
            return _readpool.POOL.take(nbytes).view(dtype).reshape(shape)
        except OSError:  # e.g. vm.max_map_count reached: NumPy's allocator still works
            pass
    try:
        return aligned_empty(shape, dtype)
    except MemoryError:
        raise HostMemoryError(
            f"this host cannot allocate {nbytes:,} bytes to read a box of shape {shape} "
            f"({dtype.name}). If the array is that large, load a part of the tree "
            "(partial=True) or onto more hosts; if it is not, its header declares more than "
            "the checkpoint holds: `milepost verify` reports what is missing",
            shape=shape,
            dtype=dtype.name,
            nbytes=nbytes,
        ) from None


_COPY_BLOCK_BYTES = 32 << 20
_INLINE_COPY_BYTES = 2 << 20
"""Copies of fewer bytes in all run on the calling thread: handing them to threads costs more."""


def copy_threads() -> int:
    return min(8, os.cpu_count() or 1)


def copy_pool() -> Pool:
    """The pool that copies, checksums and issues writes beside the caller (``milepost-copy``)."""
    return RUNTIME.pool("copy", copy_threads())


def on_copy_pool(fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
    """``fn(*args, **kwargs)`` on the copy pool."""
    return copy_pool().submit(fn, *args, **kwargs)


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
    threads = min(len(blocks), copy_threads())
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

    helpers = [on_copy_pool(drain) for _ in range(threads - 1)]
    try:
        drain()
    finally:
        # A helper that has not started is not needed (and may be queued behind this very
        # thread, if it is a pool thread); one that has started finishes its last block.
        running = [helper for helper in helpers if not helper.cancel()]
        futures_wait(running)  # all of them, even if a copy failed: none may run on after we return
    for helper in running:
        helper.result()


def alias(array: Any) -> Any:
    """A new array object over the same device buffer as single-device ``array`` (no copy).
    JAX caches a host copy on the array object it was made through (``np.asarray``,
    ``copy_to_host_async``): through an alias of our own, it never stays on the caller's."""
    import jax

    return jax.make_array_from_single_device_arrays(array.shape, array.sharding, [array])


def host_views(shards: Sequence[Any]) -> list[np.ndarray]:
    """NumPy views of single-device arrays: those in host memory as they are, the others copied
    to host memory by JAX through aliases of our own (:func:`alias`), every copy started before
    the first wait."""
    on_host = [in_host_memory(s) for s in shards]
    own = [s if host else alias(s) for s, host in zip(shards, on_host, strict=True)]
    for s, host in zip(own, on_host, strict=True):
        if not host:
            s.copy_to_host_async()
    return [np.asarray(s) for s in own]


def in_host_memory(array: Any) -> bool:
    """Whether ``array``'s buffers are host memory (CPU devices, or a host memory kind)."""
    return all(d.platform == "cpu" for d in array.devices()) or getattr(
        array.sharding, "memory_kind", None
    ) in ("pinned_host", "unpinned_host")
