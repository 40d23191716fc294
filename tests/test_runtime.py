"""The runtime owns every thread milepost starts: each is named ``milepost-...``, known to the
runtime while it lives, and stopped in one place. Its pools keep threads for the next job, end
them when idle, and run every job submitted even while the interpreter exits."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost.training import Checkpointer, KeepLatest
from milepost.workers import RUNTIME, Runtime
from tests._helpers import assert_tree_equal, put


def milepost_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("milepost-") and t.is_alive()]


def assert_all_owned() -> None:
    """Every milepost thread alive was started by the runtime (none escapes its stop)."""
    owned = set(RUNTIME.threads())
    stray = [t.name for t in milepost_threads() if t not in owned]
    assert not stray, f"milepost threads the runtime does not own: {stray}"


def wait_until(condition: object, secs: float = 10.0) -> bool:
    deadline = time.monotonic() + secs
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return bool(condition())  # type: ignore[operator]


@pytest.fixture
def runtime() -> Iterator[Runtime]:
    r = Runtime(idle_secs=0.2)
    yield r
    r.stop()


def test_a_pool_reuses_its_threads_and_ends_them_when_idle(runtime: Runtime) -> None:
    pool = runtime.pool("test-idle", 2)
    seen = [pool.submit(threading.current_thread).result(5) for _ in range(3)]
    assert len(set(seen)) == 1 and seen[0].name == "milepost-test-idle" and seen[0].daemon
    assert seen[0] in runtime.threads()
    assert wait_until(lambda: pool.threads == 0), "an idle thread ends after idle_secs"
    assert runtime.threads() == []
    assert pool.submit(lambda: 7).result(5) == 7, "and a new one starts for the next job"


def test_a_pool_runs_at_most_its_threads_and_skips_cancelled_jobs(runtime: Runtime) -> None:
    pool = runtime.pool("test-max", 2)
    gate = threading.Event()
    running: list[int] = []
    first = [pool.submit(lambda i=i: (running.append(i), gate.wait(10))) for i in range(2)]
    waiting = pool.submit(lambda: running.append(99))
    assert wait_until(lambda: len(running) == 2)
    assert pool.threads == 2 and waiting.cancel(), "the third job waits for a thread"
    gate.set()
    for f in first:
        f.result(5)
    assert pool.submit(lambda: 1).result(5) == 1
    assert 99 not in running, "a cancelled job never runs"


def test_stop_ends_every_thread_after_its_jobs_and_the_runtime_starts_again(
    runtime: Runtime,
) -> None:
    pool = runtime.pool("test-stop", 3)
    slow = [pool.submit(time.sleep, 0.2) for _ in range(3)]
    stopped = threading.Event()
    worker = runtime.thread("test-worker", stopped.wait, stop=stopped.set)
    fired: list[str] = []
    timer = runtime.call_later(60, lambda: fired.append("late"))
    runtime.stop(timeout=10)
    assert all(f.done() and f.exception() is None for f in slow), "jobs submitted run first"
    assert not worker.is_alive() and not timer.is_alive() and fired == []
    assert runtime.threads() == []
    assert pool.submit(lambda: 2).result(5) == 2


def test_timers_share_one_clock_thread_that_ends_when_none_is_due(runtime: Runtime) -> None:
    fired: list[int] = []
    runtime.call_later(0.05, lambda: fired.append(1))
    dropped = runtime.call_later(0.05, lambda: fired.append(2))
    dropped.cancel()
    runtime.call_later(0.1, lambda: fired.append(3))
    clocks = [t for t in runtime.threads() if t.name == "milepost-clock"]
    assert len(clocks) == 1
    assert wait_until(lambda: fired == [1, 3])
    assert wait_until(lambda: not clocks[0].is_alive()), "the clock ends with nothing due"


def test_where_no_thread_can_start_a_pool_runs_the_job_on_the_caller(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python 3.12 starts no thread once the interpreter exits (a save in flight at exit still
    hands jobs to its pools: tests/test_background.py runs that for real on 3.12). A pool with
    no free thread then runs the job on the thread that submits it; a timer is dropped."""
    busy = runtime.pool("test-refused", 2)
    gate, taken = threading.Event(), threading.Event()
    holding = busy.submit(lambda: (taken.set(), gate.wait(10))[1])
    assert taken.wait(10)  # one thread, busy
    real_start = threading.Thread.start

    def refuse(thread: threading.Thread) -> None:
        if thread.name.startswith("milepost-"):
            raise RuntimeError("can't create new thread at interpreter shutdown")
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", refuse)
    me = threading.current_thread()
    fresh = runtime.pool("test-refused-fresh", 2)
    assert fresh.submit(threading.current_thread).result(0) is me and fresh.threads == 0
    assert busy.submit(threading.current_thread).result(0) is me, "the busy thread is not waited"
    fired: list[int] = []
    timer = runtime.call_later(0.01, lambda: fired.append(1))
    assert not timer.is_alive() and fired == []
    assert [t.name for t in runtime.threads()] == ["milepost-test-refused"], "none started"
    monkeypatch.setattr(threading.Thread, "start", real_start)
    gate.set()
    assert holding.result(5) is True
    assert fresh.submit(threading.current_thread).result(5) is not me, "threads again after"


def test_a_save_load_cycle_leaves_only_threads_the_runtime_stops(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    tree = {"w": put(np.arange(64 * 256, dtype=np.float32).reshape(64, 256), mesh24, P("data"))}
    mp.save_async(tmp_path / "a", tree).result()
    abstract = {
        "w": jax.ShapeDtypeStruct((64, 256), np.float32, sharding=NamedSharding(mesh24, P("data")))
    }
    with mp.Context(progress=mp.ProgressOptions(delay_secs=0, file=open(tmp_path / "bar", "w"))):
        assert_tree_equal(mp.load(tmp_path / "a", abstract), tree)
    mp.wait_for_saves()
    assert_all_owned()
    RUNTIME.stop(timeout=30)
    assert milepost_threads() == [], [t.name for t in milepost_threads()]
    # ... and what is asked afterwards starts its threads again
    mp.save_async(tmp_path / "b", tree).result()
    assert_tree_equal(mp.load(tmp_path / "b", abstract), tree)
    assert_all_owned()


def test_a_checkpointers_close_ends_its_threads(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    tree = {"w": put(np.arange(64.0, dtype=np.float32).reshape(8, 8), mesh24, P("data"))}
    with Checkpointer(tmp_path / "r", keep=KeepLatest(n=1), local=tmp_path / "l") as ckpt:
        for step in range(3):
            ckpt.save(step, tree)
        ckpt.wait()
        mine = [
            t
            for t in milepost_threads()
            if t.name.startswith(("milepost-mirror", "milepost-retention"))
        ]
        assert len(mine) == 2, [t.name for t in milepost_threads()]
    assert wait_until(lambda: not any(t.is_alive() for t in mine)), "close() stops them"
    assert_all_owned()


@pytest.mark.usefixtures("ray_runtime")
def test_a_slices_exit_leaves_only_threads_the_runtime_stops(tmp_path: Path) -> None:
    from jax.sharding import PartitionSpec

    before = set(milepost_threads())
    with mp.Slice.start(hosts=2, devices_per_host=2) as s:
        mesh = s.mesh({"data": 4})
        x = s.put({"w": np.arange(32.0, dtype=np.float32)}, mesh.sharding(PartitionSpec("data")))
        mp.save(tmp_path / "c", x)
        abstract = {"w": mp.AbstractArray((32,), np.float32, mesh.sharding(PartitionSpec("data")))}
        got = mp.load(tmp_path / "c", abstract)
        assert np.array_equal(s.fetch(got["w"]), np.arange(32.0, dtype=np.float32))
        del x, got
        gc.collect()
    assert not s.healthy
    assert_all_owned()
    RUNTIME.stop(timeout=30)
    assert [t.name for t in milepost_threads() if t not in before] == []
