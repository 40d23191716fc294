"""save_async: the checkpoint holds the values of call time, whatever the caller does next;
done()/result(); a background failure is re-raised by result() and nothing is committed."""

from __future__ import annotations

import gc
import json
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost.workers import format as _format
from tests._helpers import assert_tree_equal, gate_merge, listing, put, same_bits


def big_state(mesh: jax.sharding.Mesh, mib: int = 32) -> dict[str, Any]:
    rows = mib * (1 << 20) // (4 * 1024) // 8
    rng = np.random.default_rng(0)
    return {
        f"w{i}": put(rng.standard_normal((rows, 1024), dtype=np.float32), mesh, P("data", "model"))
        for i in range(8)
    }


class Position:
    """A data-iterator position: a StatefulCheckpointable that snapshots itself in save()."""

    def __init__(self, index: int = 0) -> None:
        self.index = index

    def save(self, directory: Path) -> Callable[[], None]:
        snapshot = self.index
        return lambda: (directory / "position.json").write_text(json.dumps({"index": snapshot}))

    def load(self, directory: Path) -> None:
        self.index = json.loads((directory / "position.json").read_text())["index"]


def test_caller_may_delete_donate_and_overwrite_after_save_async(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    s = NamedSharding(mesh24, P("data", "model"))
    rng = np.random.default_rng(1)
    donated = jax.device_put(rng.standard_normal((512, 512), dtype=np.float32), s)
    deleted = jax.device_put(
        rng.standard_normal((512, 256), dtype=np.float32), NamedSharding(mesh24, P())
    )
    dropped = jax.device_put(
        jnp.arange(4096, dtype=jnp.bfloat16), NamedSharding(mesh24, P("model"))
    )
    single = jax.device_put(rng.standard_normal((300,), dtype=np.float32), jax.devices()[5])
    host = rng.standard_normal((256, 256))
    ints = np.arange(1000, dtype=np.int32)
    items = [np.ones(10, np.float32)]
    state = {
        "donated": donated,
        "deleted": deleted,
        "dropped": dropped,
        "single": single,
        "host": host,
        "ints": ints,
        "items": items,
        "step": 3,
    }
    want = jax.tree_util.tree_map(
        lambda x: np.array(x) if isinstance(x, jax.Array | np.ndarray) else x, state
    )
    want["items"] = [np.ones(10, np.float32)]
    it = Position(100)

    handle = mp.save_checkpointables_async(tmp_path / "c", {"state": state, "data": it})

    # The caller goes on at once: donate, delete, drop, overwrite in place, mutate containers.
    out = jax.jit(lambda x: x * 0, donate_argnums=0)(donated)
    assert donated.is_deleted() and not np.asarray(out).any()
    deleted.delete()
    single.delete()
    del state["dropped"], dropped
    gc.collect()
    host[:] = -1.0
    ints += 7
    items[0][:] = 5.0
    items.append(np.zeros(3))
    state["new_key"] = 1
    it.index = 999

    assert handle.result(timeout=120) == (tmp_path / "c").absolute()
    assert handle.done()
    restored = mp.load_checkpointables(tmp_path / "c", {"state": None, "data": Position()})
    got = jax.tree_util.tree_map(
        lambda x: np.asarray(x) if isinstance(x, jax.Array) else x, restored["state"]
    )
    assert set(got) == set(want)
    for k in want:
        if isinstance(want[k], np.ndarray):
            assert same_bits(got[k], want[k]), k
    assert len(got["items"]) == 1 and same_bits(got["items"][0], want["items"][0])
    assert got["step"] == 3
    assert restored["data"].index == 100


def test_save_async_of_a_large_tree_holds_call_time_values(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = gate_merge(monkeypatch)  # the save stays in flight until the arrays are donated
    state = big_state(mesh24, mib=64)
    want = {k: np.asarray(v).copy() for k, v in state.items()}
    handle = mp.save_async(tmp_path / "c", state)
    # Donate every array right away: the device buffers are reused by the computation.
    outs = [jax.jit(lambda x: x + 1, donate_argnums=0)(state[k]) for k in sorted(state)]
    del state
    gc.collect()
    assert not handle.done()  # held: the donation came before the save ended
    gate.set()
    handle.result(timeout=300)
    restored = mp.load(tmp_path / "c")
    for k, v in want.items():
        assert same_bits(restored[k], v), k
    assert len(outs) == 8


def test_save_async_creates_arrays_it_writes_no_chunks_of(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    """Arrays are opened by their first write, off the caller's thread; an array with no chunks to
    write (zero-size) is still created, and a header-only array among staged ones is complete."""
    state = {
        "w": put(np.arange(64 * 32, dtype=np.float32).reshape(64, 32), mesh24, P("data", "model")),
        "empty": put(np.zeros((0, 32), np.float32), mesh24, P(None, "model")),
        "vector": put(np.arange(8, dtype=np.int32), mesh24, P()),
        "host_empty": np.zeros((0,), np.int64),
        "scalar": np.float32(2.5),
    }
    for k in range(3):  # the first save allocates its staging buffers, later ones reuse them
        mp.save_async(tmp_path / str(k), state).result(60)
        restored = mp.load(tmp_path / str(k))
        assert_tree_equal(restored, state)
        assert restored["empty"].shape == (0, 32) and restored["host_empty"].shape == (0,)


def test_done_and_result_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = gate_merge(monkeypatch)
    handle = mp.save_async(tmp_path / "c", {"x": np.arange(10)}, custom_metadata={"k": "v"})
    assert not handle.done()  # it cannot finish before the gate opens
    with pytest.raises(TimeoutError, match="did not finish within 0.2s"):
        handle.result(timeout=0.2)
    assert not (tmp_path / "c").exists()  # not visible before it is committed
    assert (tmp_path / "c.orbax-checkpoint-tmp").is_dir()
    gate.set()
    assert handle.result(timeout=60) == (tmp_path / "c").absolute()
    assert handle.done()
    assert handle.result() == (tmp_path / "c").absolute()  # result() may be called again
    assert mp.metadata(tmp_path / "c").custom_metadata == {"k": "v"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def _fail_commit_marker(monkeypatch: pytest.MonkeyPatch) -> None:
    real = _format.write_file

    def write_file(path: Path, data: bytes | str) -> None:
        if Path(path).name == _format.COMMIT_MARKER:
            raise OSError(28, "No space left on device (injected)")
        real(path, data)

    monkeypatch.setattr(_format, "write_file", write_file)


def _remove_tmp_during_finalize(monkeypatch: pytest.MonkeyPatch) -> None:
    real = mp.workers.format.merge_ocdbt

    def merge(directory: Path) -> None:
        shutil.rmtree(directory.parent)  # someone deletes the temporary directory mid-save
        real(directory)

    monkeypatch.setattr(mp.workers.format, "merge_ocdbt", merge)


def _fail_host_write(monkeypatch: pytest.MonkeyPatch) -> None:
    real = mp.workers.PendingSave.wait

    def wait(self: Any, timeout: float | None = None) -> Any:
        real(self, timeout)
        raise OSError(5, "Input/output error while writing a shard (injected)")

    monkeypatch.setattr(mp.workers.PendingSave, "wait", wait)


FAILURES = {
    "commit-marker": (_fail_commit_marker, OSError, "No space left"),
    "tmp-dir-removed": (_remove_tmp_during_finalize, Exception, None),
    "host-write": (_fail_host_write, OSError, "Input/output error"),
}


@pytest.mark.parametrize("failure", list(FAILURES))
@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
def test_background_failure_is_reraised_and_nothing_committed(
    tmp_path: Path,
    mesh24: jax.sharding.Mesh,
    monkeypatch: pytest.MonkeyPatch,
    failure: str,
    overwrite: bool,
) -> None:
    inject, exc, words = FAILURES[failure]
    old = {"x": put(np.full((16, 16), 7.0, np.float32), mesh24, P("data")), "tag": "old"}
    if overwrite:
        mp.save(tmp_path / "c", old)
    before = listing(tmp_path)
    inject(monkeypatch)
    state = {
        "x": put(np.arange(256, dtype=np.float32).reshape(16, 16), mesh24, P("data", "model")),
        "n": np.arange(5),
    }
    handle = mp.save_async(tmp_path / "c", state, overwrite=overwrite)
    with pytest.raises(exc, match=words):
        handle.result(timeout=120)
    assert handle.done()
    with pytest.raises(exc, match=words):  # and again: the failure is kept
        handle.result()
    assert listing(tmp_path) == before  # nothing committed, the temporary directory is gone
    if overwrite:
        assert_tree_equal(mp.load(tmp_path / "c"), old)  # the previous checkpoint is intact
    monkeypatch.undo()
    mp.save(tmp_path / "c", state, overwrite=overwrite)  # the path is usable again
    assert_tree_equal(mp.load(tmp_path / "c"), state)


def test_failure_in_the_blocking_part_raises_at_the_call(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    class Broken:
        def save(self, directory: Path) -> None:
            raise RuntimeError("iterator state is not serializable (injected)")

        def load(self, directory: Path) -> None:
            raise AssertionError("never loaded")

    with pytest.raises(RuntimeError, match="not serializable"):
        mp.save_checkpointables_async(
            tmp_path / "c", {"state": big_state(mesh24, mib=8), "data": Broken()}
        )
    assert listing(tmp_path) == []


def test_options_are_snapshotted_at_call_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = threading.Event()
    real = mp.workers.format.merge_ocdbt
    monkeypatch.setattr(mp.workers.format, "merge_ocdbt", lambda d: (gate.wait(60), real(d)))
    with mp.Context(saving=mp.SaveOptions(compression="zstd", chunk_byte_size=512)):
        handle = mp.save_async(tmp_path / "c", {"x": np.zeros((64, 64), np.float32)})
    with mp.Context(saving=mp.SaveOptions(use_ocdbt=False)):  # changes nothing in flight
        gate.set()
        handle.result(timeout=60)
    meta = mp.metadata(tmp_path / "c").tree["x"]
    assert meta.chunk_shape != meta.write_shape
    assert json.loads((tmp_path / "c" / "state" / "_METADATA").read_text())["use_ocdbt"] is True


def test_concurrent_saves_to_different_paths(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    states = [
        {"x": put(np.full((64, 64), float(i), np.float32), mesh24, P("data", "model")), "i": i}
        for i in range(4)
    ]
    handles = [mp.save_async(tmp_path / str(i), s) for i, s in enumerate(states)]
    with pytest.raises(mp.CheckpointExistsError, match="in flight|already exists"):
        mp.save_async(tmp_path / "0", states[0]).result(60)
    for i, h in enumerate(handles):
        assert h.result(timeout=120) == (tmp_path / str(i)).absolute()
    for i, s in enumerate(states):
        assert_tree_equal(mp.load(tmp_path / str(i)), s)


class FailingFinish:
    """A StatefulCheckpointable whose background part fails."""

    def save(self, directory: Path) -> Callable[[], None]:
        def finish() -> None:
            raise OSError(122, "Disk quota exceeded (injected)")

        return finish

    def load(self, directory: Path) -> None:
        raise AssertionError("never loaded")


def test_failure_leaves_no_temporary_directory_behind_in_flight_writes(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    """Found by this test: when one checkpointable failed, the writes another had already issued
    were still in flight when the temporary directory was removed, and recreated it."""
    # The failure comes first (the background part of 'data'), while 'state' is still writing.
    handle = mp.save_checkpointables_async(
        tmp_path / "bg", {"data": FailingFinish(), "state": big_state(mesh24, mib=64)}
    )
    with pytest.raises(OSError, match="quota"):
        handle.result(timeout=300)
    assert listing(tmp_path) == []
    # The failure comes in the blocking part, after 'state' has issued its writes.
    with pytest.raises(mp.UnsupportedLeafError, match="'bad'"):
        mp.save_checkpointables(
            tmp_path / "fg", {"state": big_state(mesh24, mib=64), "extra": {"bad": object()}}
        )
    assert listing(tmp_path) == []
    mp.save(tmp_path / "ok", {"x": np.arange(3)})  # some time later, still nothing stray
    assert listing(tmp_path) == sorted(["ok", *(f"ok/{p}" for p in listing(tmp_path / "ok"))])


# ------------------------------------------------------------------------------------------
# Staging buffers kept between saves
# ------------------------------------------------------------------------------------------


def test_consecutive_saves_reuse_staging_memory_and_keep_every_checkpoint_exact(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    from milepost.workers.save import _staging

    _staging.POOL.clear()
    states = [big_state(mesh24, mib=4) for _ in range(3)]
    for k, s in enumerate(states):  # same shapes, different values
        states[k] = jax.tree.map(lambda a, k=k: a + k, s)
    first = mp.save_async(tmp_path / "0", states[0])
    first.result(60)
    pooled = _staging.POOL.pooled_bytes
    assert pooled >= 4 << 20, "the first save's buffers are kept for the next"
    taken: list[int] = []
    real_take = _staging.POOL.take

    def take(shape: Any, dtype: Any) -> Any:
        view, raw = real_take(shape, dtype)
        taken.append(raw.ctypes.data)
        return view, raw

    with pytest.MonkeyPatch.context() as m:
        m.setattr(_staging.POOL, "take", take)
        for k in (1, 2):
            mp.save_async(tmp_path / str(k), states[k]).result(60)
    assert len(set(taken)) == len(taken) // 2, (
        "the second and third saves copied into the same buffers"
    )
    for k, s in enumerate(states):  # reusing a buffer never changed what an earlier save wrote
        assert_tree_equal(mp.load(tmp_path / str(k)), s)


def test_a_buffer_still_referenced_is_not_reused_and_idle_buffers_are_freed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from milepost.workers.save._staging import StagingPool

    pool = StagingPool(idle_secs=600)  # nothing is freed for idleness while this part runs
    view, raw = pool.take((256, 256), np.dtype(np.float32))
    assert view.ctypes.data % 64 == 0 and view.shape == (256, 256)
    nbytes = raw.nbytes
    raws = [raw]
    del raw  # the pool's caller holds its raw buffers in a list only
    pool.give_back(raws, keep_bytes=1 << 30)
    assert pool.pooled_bytes == 0, (
        "a live view (as TensorStore may still hold) keeps its buffer out of the pool"
    )
    view, raw = pool.take((256, 256), np.dtype(np.float32))
    raws = [raw]
    del raw, view
    pool.give_back(raws, keep_bytes=1 << 30)
    assert pool.pooled_bytes == nbytes
    again, raw = pool.take((256, 256), np.dtype(np.float32))
    assert pool.pooled_bytes == 0
    other, raw3 = pool.take((128, 128), np.dtype(np.float32))  # another size: a new buffer
    assert raw3.ctypes.data != raw.ctypes.data
    raws = [raw, raw3]
    del raw, raw3, again, other
    pool.give_back(raws, keep_bytes=nbytes)  # at most one save's bytes are kept
    assert pool.pooled_bytes == nbytes
    reused, raw = pool.take((256, 256), np.dtype(np.float32))
    assert reused.ctypes.data - raw.ctypes.data < 64 and raw.nbytes == nbytes
    raws = [raw]
    del raw, reused
    pool.give_back(raws, keep_bytes=nbytes)
    assert pool.pooled_bytes == nbytes
    pool.clear()

    # Freed once idle for idle_secs: the idle timer's clear is watched, not slept past.
    idle = StagingPool(idle_secs=0.2)
    cleared = threading.Event()
    when: list[tuple[float, int]] = []
    real_clear = idle.clear

    def clear() -> None:
        when.append((time.monotonic(), idle.pooled_bytes))
        real_clear()
        cleared.set()

    monkeypatch.setattr(idle, "clear", clear)
    view, raw = idle.take((256, 256), np.dtype(np.float32))
    raws = [raw]
    del raw, view
    given = time.monotonic()
    idle.give_back(raws, keep_bytes=1 << 30)
    assert cleared.wait(30), "the idle buffers were never freed"
    (fired, pooled), *_ = when
    assert pooled == nbytes, "the buffer was kept until the timer fired"
    assert fired - given >= 0.2, f"freed {fired - given:.3f}s after it went idle, before 0.2s"
    assert idle.pooled_bytes == 0, "freed after the idle time"
