"""The read pool: a load's buffers serve the next load once every array over them is gone,
never while one still is; it never holds more than one buffer beyond what a process without it
would; idle memory goes back."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost.workers._readpool import ReadPool
from tests._helpers import put, same_bits

MIB = 1 << 20


@pytest.fixture
def pool() -> Iterator[ReadPool]:
    p = ReadPool(idle_secs=60)
    yield p
    p.close()


def test_a_mapping_returns_only_when_its_last_view_is_gone(pool: ReadPool) -> None:
    buffer = pool.take(MIB)
    typed = buffer.view(np.float32).reshape(512, 512)
    rows = typed[::2]  # strided views, views of views
    cell = rows[3:5, 7:9]
    del buffer, typed, rows
    gc.collect()
    assert pool.pooled_bytes == 0, "a live view keeps its mapping out of the pool"
    cell[:] = 1.0
    del cell
    gc.collect()
    assert pool.pooled_bytes == MIB
    again = pool.take(MIB)
    assert pool.pooled_bytes == 0 and pool.hits == 1
    assert type(again) is np.ndarray, "callers get plain arrays"


def test_an_adopted_buffer_returns_only_when_the_device_array_is_gone(pool: ReadPool) -> None:
    host = pool.take(4 * MIB).view(np.float32).reshape(1024, 1024)
    host[:] = 3.0
    pointer = host.ctypes.data
    device = jax.device_put(host, jax.devices()[0])
    del host
    gc.collect()
    if device.unsafe_buffer_pointer() != pointer:
        pytest.skip("this JAX copies on device_put instead of adopting the buffer")
    assert pool.pooled_bytes == 0, "the device array still uses the mapping"
    view = np.asarray(device)
    doubled = jax.jit(lambda x: x * 2, donate_argnums=0)(
        device
    )  # donation does not pass the memory on
    assert doubled.unsafe_buffer_pointer() != pointer
    del device
    gc.collect()
    assert pool.pooled_bytes == 0, "a NumPy view of the device array keeps the mapping"
    assert view[5, 5] == 3.0
    del view
    gc.collect()
    deadline = time.monotonic() + 5  # XLA may release the buffer on one of its threads
    while pool.pooled_bytes == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.pooled_bytes == 4 * MIB
    assert float(doubled[0, 0]) == 6.0


def test_a_finalizer_under_the_pools_own_lock_does_not_block(pool: ReadPool) -> None:
    buffer = pool.take(MIB)
    with pool._lock:  # e.g. a garbage collection inside take()
        del buffer
        gc.collect()
    assert pool.pooled_bytes == MIB


def test_a_miss_releases_pooled_memory_before_mapping_more(pool: ReadPool) -> None:
    buffers = [pool.take(2 * MIB) for _ in range(3)]
    del buffers
    gc.collect()
    assert pool.pooled_bytes == 6 * MIB
    other = pool.take(3 * MIB)  # another size: two pooled buffers (>= 3 MiB) are released first
    assert pool.pooled_bytes == 2 * MIB and pool.misses == 4
    del other
    gc.collect()
    assert pool.pooled_bytes == 5 * MIB


def test_idle_memory_goes_back_and_close_stops_the_keeper() -> None:
    pool = ReadPool(idle_secs=0.3)
    buffers = [pool.take(2 * MIB), pool.take(3 * MIB)]
    del buffers
    gc.collect()
    deadline = (
        time.monotonic() + 10
    )  # released 0.3-0.45 s after the last take (a busy machine: later)
    while pool.pooled_bytes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.pooled_bytes == 0, "everything pooled is released once idle"
    keeper = pool._keeper
    assert keeper is not None and keeper.is_alive()
    kept = pool.take(MIB)
    pool.close()
    assert not keeper.is_alive(), "close() stops the keeper"
    del kept
    gc.collect()
    assert pool.pooled_bytes == 0, "a closed pool keeps nothing"


def test_repeated_loads_reuse_the_read_buffers_and_stay_exact(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    from milepost.workers import _readpool

    rng = np.random.default_rng(7)
    tree = {
        f"w{i}": put(rng.standard_normal((512, 1024), dtype=np.float32), mesh24, P("data", None))
        for i in range(4)
    }
    mp.save(tmp_path / "c", tree)
    abstract = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh24, P("data", None)))
        for k, v in tree.items()
    }
    _readpool.POOL.clear()
    hits = _readpool.POOL.hits
    first = mp.load(tmp_path / "c", abstract)
    kept = {k: np.array(v) for k, v in first.items()}
    held = first["w0"]  # still in use: its buffers must not be reused
    del first
    gc.collect()
    for _ in range(3):
        again = mp.load(tmp_path / "c", abstract)
        for k, v in tree.items():
            assert same_bits(again[k], v), k
        del again
        gc.collect()
    assert _readpool.POOL.hits > hits, "later loads read into the earlier loads' buffers"
    assert same_bits(held, kept["w0"]), "an array still held was never overwritten"
