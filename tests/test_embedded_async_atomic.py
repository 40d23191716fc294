"""save_async semantics (copy before return, failures re-raised) and atomic commit under SIGKILL."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost import _pytree
from tests import _subproc


def test_arrays_may_be_deleted_donated_and_overwritten_after_save_async(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    s = NamedSharding(mesh24, P("data", "model"))
    a = jax.device_put(jnp.arange(4096, dtype=jnp.float32).reshape(64, 64), s)
    b = jax.device_put(jnp.ones((64, 64), jnp.float32), s)
    n = np.arange(100, dtype=np.int64)
    expect_a, expect_b, expect_n = np.asarray(a).copy(), np.asarray(b).copy(), n.copy()
    handle = mp.save_async(tmp_path / "c", {"a": a, "b": b, "n": n})
    donated = jax.jit(lambda x: x * 0 - 7, donate_argnums=0)(a)
    assert a.is_deleted()
    b.delete()
    del b
    n[:] = -1
    assert float(np.asarray(donated)[0, 0]) == -7
    assert handle.result(timeout=60) == (tmp_path / "c").absolute()
    assert handle.done()
    out = mp.load(tmp_path / "c")
    assert np.array_equal(np.asarray(out["a"]), expect_a)
    assert np.array_equal(np.asarray(out["b"]), expect_b)
    assert np.array_equal(out["n"], expect_n)


def test_background_failure_is_reraised_and_nothing_committed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_merge(directory: Path) -> None:
        raise OSError(f"disk full while merging {directory}")

    monkeypatch.setattr(_pytree, "merge_ocdbt", broken_merge)
    handle = mp.save_async(tmp_path / "c", {"x": np.arange(10)})
    with pytest.raises(OSError, match="disk full"):
        handle.result(timeout=60)
    assert not (tmp_path / "c").exists()
    assert list(tmp_path.iterdir()) == []  # the temporary directory is gone too
    monkeypatch.undo()
    mp.save(tmp_path / "c", {"x": np.arange(10)})  # the path is free again
    assert np.array_equal(mp.load(tmp_path / "c")["x"], np.arange(10))


def test_second_save_to_same_path_while_in_flight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = __import__("threading").Event()
    real = _pytree.merge_ocdbt

    def slow_merge(directory: Path) -> None:
        gate.wait(30)
        real(directory)

    monkeypatch.setattr(_pytree, "merge_ocdbt", slow_merge)
    h = mp.save_async(tmp_path / "c", {"x": np.arange(3)})
    with pytest.raises(mp.CheckpointExistsError, match="in flight"):
        mp.save_async(tmp_path / "c", {"x": np.arange(3)})
    gate.set()
    h.result(timeout=60)


SAVER = """
import sys, time
import jax, numpy as np
import milepost as mp
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((2, 4), ("a", "b"))
rng = np.random.default_rng(0)
tree = {f"w{i}": jax.device_put(rng.standard_normal((2048, 4096), dtype=np.float32), NamedSharding(mesh, P("a", "b")))
        for i in range(12)}
print("ready", flush=True)
h = mp.save_async(sys.argv[1] if len(sys.argv) > 1 else PATH, tree)
print("staged", flush=True)
h.result()
print("committed", flush=True)
"""


@pytest.mark.parametrize("kill_after", ["ready", "staged", 0.05, 0.2], ids=str)
def test_sigkill_mid_save_leaves_no_checkpoint(tmp_path: Path, kill_after: str | float) -> None:
    mesh = jax.make_mesh((8,), ("x",))
    other = mp.save(tmp_path / "other", {"v": jax.device_put(np.arange(64.0), NamedSharding(mesh, P("x")))})
    target = tmp_path / "target"
    proc = _subproc.popen(SAVER.replace("PATH", repr(str(target))))
    assert proc.stdout is not None
    try:
        wanted = kill_after if isinstance(kill_after, str) else "staged"
        for line in proc.stdout:
            if line.strip() == wanted:
                break
            assert line.strip() != "committed", "the save finished before the kill point"
        else:
            pytest.fail(f"saver exited early: {proc.stderr.read() if proc.stderr else ''}")
        if isinstance(kill_after, float):
            time.sleep(kill_after)
        proc.send_signal(signal.SIGKILL)
        rest = proc.stdout.read()
    finally:
        proc.kill()
        proc.wait(30)
    if "committed" in rest:
        pytest.skip("the save committed before the kill landed (machine too fast for this kill point)")
    assert not target.exists(), "a killed save must leave nothing at the final path"
    assert np.array_equal(np.asarray(mp.load(other)["v"]), np.arange(64.0))
    # A later save to the same path succeeds and removes the stale temporary directory.
    mp.save(target, {"x": np.arange(3)})
    assert np.array_equal(mp.load(target)["x"], np.arange(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "target"]
