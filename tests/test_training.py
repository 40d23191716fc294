"""milepost.training.Checkpointer: policies, retention, async saves, failures, bad input."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost import _pytree
from milepost.training import (
    AnyOf,
    BackgroundSaveError,
    Checkpointer,
    Continuous,
    FixedInterval,
    InitialStep,
    KeepAll,
    KeepBest,
    KeepEvery,
    KeepLatest,
    KeepUnion,
    SaveContext,
    SpecificSteps,
    StepExistsError,
    StepInfo,
    StepNotFoundError,
)


def ctx(step: int, **kw: object) -> SaveContext:
    base = {"latest_step": None, "last_save_start": None, "save_in_flight": False, "now": 100.0}
    base.update(kw)
    return SaveContext(step=step, **base)  # type: ignore[arg-type]


def test_save_policies() -> None:
    assert [s for s in range(10) if FixedInterval(interval=3).should_save(ctx(s))] == [0, 3, 6, 9]
    assert SpecificSteps(steps=[5, 7]).should_save(ctx(7)) and not SpecificSteps(steps=[5]).should_save(ctx(6))
    assert InitialStep().should_save(ctx(4)) and not InitialStep().should_save(ctx(4, latest_step=3))
    c = Continuous(min_interval_secs=10)
    assert c.should_save(ctx(1)) and not c.should_save(ctx(1, save_in_flight=True))
    assert not c.should_save(ctx(1, last_save_start=95.0)) and c.should_save(ctx(1, last_save_start=89.0))
    both = AnyOf(InitialStep(), FixedInterval(interval=100))
    assert both.should_save(ctx(7)) and both.should_save(ctx(200, latest_step=7)) and not both.should_save(ctx(201, latest_step=7))
    with pytest.raises(ValueError, match="positive"):
        FixedInterval(interval=0)
    with pytest.raises(TypeError, match="not a save policy"):
        AnyOf(object())  # type: ignore[arg-type]


def test_retention_policies() -> None:
    infos = [StepInfo(step=s, metrics={"loss": float(10 - s % 7)}) for s in range(0, 50, 5)]
    assert KeepLatest(n=2).keep(infos) == {40, 45}
    assert KeepEvery(n=20).keep(infos) == {0, 20, 40}
    # losses: 0->10, 5->5, 10->7, 15->9, 20->4, 25->6, 30->8, 35->10, 40->5, 45->7
    assert KeepBest(n=2, metric="loss").keep(infos) == {20, 5} or KeepBest(n=2, metric="loss").keep(infos) == {20, 40}
    assert KeepBest(n=1, metric="loss", mode="max").keep(infos) in ({0}, {35})
    assert KeepBest(n=3, metric="missing").keep(infos) == set()
    assert KeepAll().keep(infos) == {i.step for i in infos}
    assert KeepUnion(KeepLatest(n=1), KeepEvery(n=25)).keep(infos) == {0, 25, 45}
    for bad in (lambda: KeepLatest(n=0), lambda: KeepBest(n=0, metric="x"), lambda: KeepUnion()):
        with pytest.raises(ValueError, match="keep nothing"):
            bad()


def tree(mesh: jax.sharding.Mesh, value: float) -> dict:
    return {"w": jax.device_put(np.full((16, 8), value, np.float32), NamedSharding(mesh, P("data", "model"))), "step": int(value)}


def test_save_load_latest_and_retention(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    with Checkpointer(tmp_path / "run", save_policy=FixedInterval(interval=2), keep=KeepLatest(n=2)) as ckpt:
        assert ckpt.latest is None and ckpt.steps == []
        saved = [s for s in range(7) if ckpt.save(s, tree(mesh24, s))]
        assert saved == [0, 2, 4, 6]
        ckpt.wait()
        assert ckpt.steps == [4, 6] and ckpt.latest == 6
        assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["4", "6"]
        out = ckpt.load()
        assert np.array_equal(np.asarray(out["w"]), np.full((16, 8), 6, np.float32)) and out["step"] == 6
        assert ckpt.load(4)["step"] == 4
        assert ckpt.metadata().tree["w"].shape == (16, 8)
        # each step is a plain milepost checkpoint
        assert mp.load(tmp_path / "run" / "6")["step"] == 6
        with pytest.raises(StepExistsError, match="already has a committed"):
            ckpt.save(6, tree(mesh24, 6), force=True)
        with pytest.raises(StepNotFoundError, match="no committed step 5"):
            ckpt.load(5)
        ckpt.delete(4)
        assert ckpt.steps == [6]
    # a new Checkpointer finds what is on disk
    with Checkpointer(tmp_path / "run") as again:
        assert again.steps == [6]


def test_keep_best_uses_metrics_and_never_drops_latest(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    losses = {0: 5.0, 1: 1.0, 2: 3.0, 3: 9.0}
    with Checkpointer(tmp_path / "r", keep=KeepBest(n=1, metric="loss")) as ckpt:
        for s, loss in losses.items():
            ckpt.save(s, tree(mesh24, s), metrics={"loss": loss})
        ckpt.wait()
        assert ckpt.steps == [1, 3]  # best (1) and the latest (3)
    with Checkpointer(tmp_path / "r", keep=KeepBest(n=1, metric="loss")) as again:
        again.save(4, tree(mesh24, 4), metrics={"loss": 0.5})
        again.wait()
        assert again.steps == [4]  # metrics of old steps were read back from disk


def test_background_failure_reraised_with_step_and_latest_kept(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Checkpointer(tmp_path / "r", keep=KeepLatest(n=1)) as ckpt:
        ckpt.save(0, tree(mesh24, 0))
        ckpt.wait()

        def broken(directory: Path) -> None:
            raise OSError("simulated disk failure")

        monkeypatch.setattr(_pytree, "merge_ocdbt", broken)
        assert ckpt.save(1, tree(mesh24, 1))
        with pytest.raises(BackgroundSaveError, match="step 1 failed: OSError: simulated disk failure") as info:
            ckpt.wait()
        assert info.value.step == 1 and isinstance(info.value.__cause__, OSError)
        monkeypatch.undo()
        assert ckpt.steps == [0] and ckpt.latest == 0
        assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["0"]
        assert ckpt.load()["step"] == 0
        ckpt.save(1, tree(mesh24, 1))  # the failure was reported once; saving goes on
        ckpt.wait()
        assert ckpt.steps == [1]


def test_at_most_one_save_in_flight(tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    real = _pytree.merge_ocdbt
    started: list[float] = []

    def slow(directory: Path) -> None:
        started.append(time.monotonic())
        gate.wait(30)
        real(directory)

    monkeypatch.setattr(_pytree, "merge_ocdbt", slow)
    with Checkpointer(tmp_path / "r") as ckpt:
        ckpt.save(0, tree(mesh24, 0))
        with pytest.raises(StepExistsError, match="in flight"):
            ckpt.save(0, tree(mesh24, 0), force=True)
        second_done = threading.Event()

        def second() -> None:
            ckpt.save(1, tree(mesh24, 1))
            second_done.set()

        t = threading.Thread(target=second)
        t.start()
        time.sleep(0.5)
        assert not second_done.is_set(), "the second save must wait for the first"
        gate.set()
        t.join(30)
        assert second_done.is_set()
        ckpt.wait()
        assert ckpt.steps == [0, 1]


def test_gc_never_deletes_a_step_being_loaded(tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch) -> None:
    with Checkpointer(tmp_path / "r", keep=KeepLatest(n=1)) as ckpt:
        ckpt.save(0, tree(mesh24, 0))
        ckpt.wait()
        in_load = threading.Event()
        release = threading.Event()
        real_load = mp._api.load

        def slow_load(*a: object, **k: object) -> object:
            in_load.set()
            release.wait(30)
            return real_load(*a, **k)  # type: ignore[arg-type]

        monkeypatch.setattr(mp._api, "load", slow_load)
        result: list[object] = []
        t = threading.Thread(target=lambda: result.append(ckpt.load(0)))
        t.start()
        assert in_load.wait(30)
        ckpt.save(1, tree(mesh24, 1))
        ckpt.wait()
        assert (tmp_path / "r" / "0").exists(), "step 0 is being loaded: retention must keep it"
        release.set()
        t.join(30)
        assert result and result[0]["step"] == 0  # type: ignore[index]
        ckpt.save(2, tree(mesh24, 2))
        ckpt.wait()
        assert ckpt.steps == [2]


def test_uncommitted_steps_are_ignored_and_removed(tmp_path: Path, mesh24: jax.sharding.Mesh, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "r"
    mp.save(root / "3", tree(mesh24, 3))
    (root / "5").mkdir()
    (root / "5" / "_CHECKPOINT_METADATA").write_text("{}")
    (root / "7.orbax-checkpoint-tmp").mkdir()
    (root / "notes.txt").write_text("user file")
    with caplog.at_level("WARNING"), Checkpointer(root) as ckpt:
        assert ckpt.steps == [3] and ckpt.latest == 3
    assert sorted(p.name for p in root.iterdir()) == ["3", "notes.txt"]
    assert "did not commit" in caplog.text


def test_bad_input(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        Checkpointer(tmp_path / "file")
    with Checkpointer(tmp_path / "r") as ckpt:
        with pytest.raises(ValueError, match="non-negative"):
            ckpt.save(-1, {"x": 1})
        with pytest.raises(TypeError, match="non-negative int"):
            ckpt.save(1.5, {"x": 1})  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="non-negative int"):
            ckpt.save(True, {"x": 1})  # type: ignore[arg-type]
        with pytest.raises(StepNotFoundError, match="nothing to load"):
            ckpt.load()
        with pytest.raises(StepNotFoundError):
            ckpt.delete(3)
        assert ckpt.save(np.int64(2), {"x": 1})
    with pytest.raises(TypeError, match="retention policy"):
        Checkpointer(tmp_path / "r", keep=3)  # type: ignore[arg-type]


def test_preemption_signal_forces_a_save(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    previous = signal.getsignal(signal.SIGUSR1)
    with Checkpointer(tmp_path / "r", save_policy=FixedInterval(interval=1000), preemption_signals=(signal.SIGUSR1,)) as ckpt:
        assert not ckpt.should_save(3)
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert ckpt.should_save(4)
        assert ckpt.save(4, tree(mesh24, 4))
        assert not ckpt.should_save(5)  # the request is consumed by the save
    assert signal.getsignal(signal.SIGUSR1) == previous
