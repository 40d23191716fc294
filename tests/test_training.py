"""milepost.training.Checkpointer: policies, retention, async saves, failures, bad input."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost import _hosts as _dispatch
from milepost.colocated import LocalHostGroup
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
    Preemption,
    SaveContext,
    SpecificSteps,
    StepBusyError,
    StepExistsError,
    StepInfo,
    StepNotFoundError,
)


def ctx(step: int, **kw: Any) -> SaveContext:
    base: dict[str, Any] = {
        "latest_step": None,
        "last_save_start": None,
        "save_in_flight": False,
        "now": 100.0,
    }
    base.update(kw)
    return SaveContext(step=step, **base)


def tree(mesh: jax.sharding.Mesh, value: int) -> dict:
    w = jax.device_put(np.full((16, 8), value, np.float32), NamedSharding(mesh, P("data", "model")))
    return {"w": w, "step": value}


def names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


class Gate:
    """Holds the OCDBT merge (the background part of a save) of chosen steps until released."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, steps: set[int] | None = None) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.order: list[str] = []
        real = mp.workers.format.merge_ocdbt

        def merge(directory: Path) -> None:
            step = int(directory.parent.name.split(".")[0])
            self.order.append(f"merge {step}")
            if steps is None or step in steps:
                self.entered.set()
                assert self.release.wait(60), "the test never released the gate"
            real(directory)

        monkeypatch.setattr(mp.workers.format, "merge_ocdbt", merge)


# -- policies -----------------------------------------------------------------------------


def test_save_policies() -> None:
    assert [s for s in range(10) if FixedInterval(interval=3).should_save(ctx(s))] == [0, 3, 6, 9]
    assert [s for s in range(10) if SpecificSteps(steps=[5, 7]).should_save(ctx(s))] == [5, 7]
    assert InitialStep().should_save(ctx(4)) and not InitialStep().should_save(
        ctx(4, latest_step=3)
    )
    c = Continuous(min_interval_secs=10)
    assert c.should_save(ctx(1)) and not c.should_save(ctx(1, save_in_flight=True))
    assert not c.should_save(ctx(1, last_save_start=95.0)) and c.should_save(
        ctx(1, last_save_start=90.0)
    )
    assert Continuous().should_save(ctx(1, last_save_start=100.0))
    assert Preemption().should_save(ctx(1, preempted=True)) and not Preemption().should_save(ctx(1))
    both = AnyOf(InitialStep(), FixedInterval(interval=100), Preemption(signals=(signal.SIGUSR1,)))
    assert [s for s in (7, 200, 201) if both.should_save(ctx(s, latest_step=7))] == [200]
    assert both.should_save(ctx(7)) and both.should_save(ctx(201, latest_step=7, preempted=True))
    for bad in (
        lambda: FixedInterval(interval=0),
        lambda: FixedInterval(interval=2.5),
        lambda: Continuous(min_interval_secs=-1),
    ):
        with pytest.raises(ValueError):
            bad()
    with pytest.raises(ValueError, match="non-negative ints"):
        SpecificSteps(steps=[3, -1])
    with pytest.raises(TypeError, match="not a save policy"):
        AnyOf(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="never save"):
        AnyOf()


def test_retention_policies() -> None:
    losses = {
        0: 10.0,
        5: 5.0,
        10: 7.0,
        15: 9.0,
        20: 4.0,
        25: 6.0,
        30: 8.0,
        35: 10.0,
        40: 5.0,
        45: 7.0,
    }
    infos = [StepInfo(step=s, metrics={"loss": v}) for s, v in losses.items()]
    assert KeepLatest(n=2).keep(infos) == {40, 45}
    assert KeepLatest(n=20).keep(infos) == set(losses)
    assert KeepEvery(n=20).keep(infos) == {0, 20, 40}
    assert KeepBest(n=2, metric="loss").keep(infos) == {20, 40}  # 5.0 twice: the newer wins
    assert KeepBest(n=1, metric="loss", mode="max").keep(infos) == {35}
    assert KeepBest(n=3, metric="missing").keep(infos) == set()
    odd = [
        StepInfo(step=1, metrics={"loss": "n/a"}),
        StepInfo(step=2, metrics={"loss": float("nan")}),
        StepInfo(step=3, metrics={"loss": 2}),
    ]
    assert KeepBest(n=2, metric="loss").keep(odd) == {3}
    assert KeepAll().keep(infos) == set(losses)
    assert KeepUnion(KeepLatest(n=1), KeepEvery(n=25), KeepBest(n=1, metric="loss")).keep(
        infos
    ) == {0, 20, 25, 45}
    assert KeepLatest(n=3).keep([]) == set()
    for bad in (
        lambda: KeepLatest(n=0),
        lambda: KeepEvery(n=0),
        lambda: KeepBest(n=0, metric="x"),
        lambda: KeepUnion(),
        lambda: KeepLatest(n=True),
    ):
        with pytest.raises(ValueError, match="keep nothing"):
            bad()
    with pytest.raises(ValueError, match="'min' or 'max'"):
        KeepBest(n=1, metric="x", mode="best")  # type: ignore[arg-type]


def test_keep_best_by_a_function() -> None:
    infos = [
        StepInfo(step=1, metrics={"loss": 4.0, "acc": 0.5}),
        StepInfo(step=2, metrics={"loss": 1.0}),  # no acc: the fn raises KeyError
        StepInfo(step=3, metrics={"loss": 2.0, "acc": 0.9}),
        StepInfo(step=4, metrics={"loss": 3.0, "acc": "n/a"}),  # TypeError
        StepInfo(step=5, metrics={"loss": 0.5, "acc": float("inf")}),  # not finite
        StepInfo(step=6, metrics={"loss": 9.0, "acc": 0.1}),
    ]
    gap = KeepBest(n=2, fn=lambda m: m["loss"] - m["acc"])
    assert gap.ranked(infos) == [3, 1, 6] and gap.keep(infos) == {1, 3}
    assert KeepBest(n=1, fn=lambda m: m["acc"] * 2, mode="max").keep(infos) == {3}
    assert KeepBest(n=9, fn=lambda m: str(m["loss"])).keep(infos) == set()  # not a number
    assert KeepBest(n=9, fn=lambda m: m["loss"] > 1).keep(infos) == set()  # a bool is none
    assert KeepBest(n=1, fn=lambda m: np.float32(m["loss"])).keep(infos) == {5}

    def boom(m: Any) -> float:
        raise RuntimeError("a bug of the fn is not a missing metric")

    with pytest.raises(RuntimeError, match="bug"):
        KeepBest(n=1, fn=boom).keep(infos)
    for both_or_neither in (
        lambda: KeepBest(n=1, metric="loss", fn=lambda m: m["loss"]),
        lambda: KeepBest(n=1),
    ):
        with pytest.raises(ValueError, match="exactly one of metric= .* and fn="):
            both_or_neither()
    with pytest.raises(TypeError, match="not a function"):
        KeepBest(n=1, fn="loss")  # type: ignore[arg-type]


# -- saving, listing, loading --------------------------------------------------------------


def test_save_load_latest_delete_and_retention(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    root = tmp_path / "run"
    with Checkpointer(root, save_policy=FixedInterval(interval=2), keep=KeepLatest(n=2)) as ckpt:
        assert ckpt.latest is None and ckpt.steps == []
        saved = [
            s
            for s in range(7)
            if ckpt.save(s, tree(mesh24, s), metrics={"loss": np.float32(s / 2)})
        ]
        assert saved == [0, 2, 4, 6]
        ckpt.wait()
        assert ckpt.steps == [4, 6] and ckpt.latest == 6 and names(root) == ["4", "6"]
        out = ckpt.load()
        assert (
            np.array_equal(np.asarray(out["w"]), np.full((16, 8), 6, np.float32))
            and out["step"] == 6
        )
        assert out["w"].sharding == NamedSharding(mesh24, P("data", "model"))
        assert ckpt.load(4)["step"] == 4
        meta = ckpt.metadata()
        assert meta.tree["w"].shape == (16, 8) and meta.metrics == {"loss": 3.0}
        assert ckpt.metadata(4).metrics == {"loss": 2.0}
        # each step is a complete checkpoint on its own
        assert mp.load(root / "6")["step"] == 6 and ckpt.path(6) == root / "6"
        ckpt.delete(4)
        assert ckpt.steps == [6] and names(root) == ["6"]
        assert ckpt.save(8, tree(mesh24, 8), custom_metadata={"run": "a"})
        ckpt.wait()
        assert ckpt.metadata(8).custom_metadata == {"run": "a"}
    with Checkpointer(root) as again:  # a new Checkpointer finds what is on disk
        assert again.steps == [6, 8] and again.latest == 8


def test_orbax_v1_reads_a_single_step(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    ocp = pytest.importorskip("orbax.checkpoint.experimental.v1")
    with Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save(100, tree(mesh24, 100))
    restored = ocp.load(tmp_path / "run" / "100")
    assert (
        np.array_equal(np.asarray(restored["w"]), np.full((16, 8), 100, np.float32))
        and int(restored["step"]) == 100
    )


def test_keep_best_reads_metrics_back_and_never_drops_latest(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    losses = {0: 5.0, 1: 1.0, 2: 3.0, 3: 9.0}
    with Checkpointer(tmp_path / "r", keep=KeepBest(n=1, metric="loss")) as ckpt:
        for s, loss in losses.items():
            ckpt.save(s, tree(mesh24, s), metrics={"loss": loss})
        ckpt.wait()
        assert ckpt.steps == [1, 3]  # the best (1) and the latest (3)
    with Checkpointer(tmp_path / "r", keep=KeepBest(n=1, metric="loss")) as again:
        again.save(4, tree(mesh24, 4), metrics={"loss": 2.0})
        again.wait()
        assert again.steps == [1, 4]  # step 1's loss was read back from its _CHECKPOINT_METADATA


def test_keep_best_fn_and_best_step_in_a_loop(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    metrics: dict[int, dict[str, float]] = {
        0: {"loss": 5.0, "acc": 0.2},
        1: {"loss": 1.0},  # no acc: fn raises KeyError, never among the best
        2: {"loss": 3.0, "acc": 0.6},
        3: {"loss": 2.0, "acc": 0.9},
        4: {"loss": 4.0, "acc": 0.4},
    }
    best = KeepBest(n=2, fn=lambda m: m["acc"], mode="max")
    with Checkpointer(tmp_path / "r", keep=best) as ckpt:
        assert ckpt.best_step() is None  # no step yet
        for s, m in metrics.items():
            ckpt.save(s, tree(mesh24, s), metrics=m)
        ckpt.wait()
        assert ckpt.steps == [2, 3, 4] and ckpt.best_step() == 3  # 2 and 3 best, 4 the latest
    keep = KeepUnion(KeepLatest(n=1), KeepBest(n=1, fn=lambda m: m["loss"] / m["acc"]))
    with Checkpointer(tmp_path / "r", keep=keep) as again:  # metrics read back from disk
        assert again.best_step() == 3  # 2.0/0.9 < 3.0/0.6 < 4.0/0.4
        again.save(5, tree(mesh24, 5), metrics={"loss": 0.1, "acc": 0.5})
        again.wait()
        assert again.steps == [5] and again.best_step() == 5
    with Checkpointer(tmp_path / "m", keep=KeepBest(n=1, metric="loss")) as low:
        for s, loss in ((0, 3.0), (1, 1.0), (2, 2.0)):
            low.save(s, tree(mesh24, s), metrics={"loss": loss})
        low.wait()
        assert low.best_step() == 1
    with Checkpointer(tmp_path / "m", keep=KeepBest(n=1, metric="loss", mode="max")) as high:
        assert high.best_step() == 2  # of the steps kept (1, 2), the highest loss
    with Checkpointer(tmp_path / "m", keep=KeepBest(n=1, metric="acc")) as unscored:
        assert unscored.best_step() is None
    with Checkpointer(tmp_path / "m", keep=KeepLatest(n=3)) as no_best:
        with pytest.raises(ValueError, match="keep=KeepBest"):
            no_best.best_step()


def test_policies_in_a_loop(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    initial = AnyOf(InitialStep(), SpecificSteps(steps=[7]))
    with Checkpointer(tmp_path / "a", save_policy=initial) as ckpt:
        assert [s for s in range(3, 9) if ckpt.save(s, tree(mesh24, s))] == [3, 7]
    with Checkpointer(tmp_path / "a", save_policy=initial) as ckpt:
        assert not ckpt.should_save(8)  # the root has checkpoints now
    gate = Gate(monkeypatch)
    with Checkpointer(tmp_path / "b", save_policy=Continuous()) as ckpt:
        assert ckpt.save(0, tree(mesh24, 0))
        assert gate.entered.wait(60)
        assert not ckpt.save(1, tree(mesh24, 1)) and not ckpt.should_save(2)  # the save of 0 runs
        gate.release.set()
        ckpt.wait()
        assert ckpt.save(3, tree(mesh24, 3))
    assert Checkpointer(tmp_path / "b").steps == [0, 3]


def test_synchronous_mode_commits_before_returning(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    with Checkpointer(tmp_path / "r", asynchronous=False, keep=KeepLatest(n=1)) as ckpt:
        ckpt.save(1, tree(mesh24, 1))
        assert ckpt.steps == [1] and (tmp_path / "r" / "1" / "commit_success.txt").is_file()
        ckpt.save(2, tree(mesh24, 2))
        assert ckpt.steps == [2] and names(tmp_path / "r") == ["2"]


def test_at_most_one_save_in_flight(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(monkeypatch, steps={0})
    with Checkpointer(tmp_path / "r") as ckpt:
        ckpt.save(0, tree(mesh24, 0))
        assert gate.entered.wait(60)
        with pytest.raises(StepExistsError, match="already in flight"):
            ckpt.save(0, tree(mesh24, 0), force=True)
        with pytest.raises(StepNotFoundError, match="still being saved"):
            ckpt.load(0)
        with pytest.raises(StepBusyError, match="being saved"):
            ckpt.delete(0)
        second = threading.Thread(target=lambda: ckpt.save(1, tree(mesh24, 1)))
        second.start()
        second.join(1.0)
        assert second.is_alive(), "the second save must wait for the first"
        gate.order.append("release")
        gate.release.set()
        second.join(60)
        ckpt.wait()
        assert gate.order == ["merge 0", "release", "merge 1"] and ckpt.steps == [0, 1]


def test_background_failure_reraised_with_step_and_only_checkpoint_kept(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "r"
    with Checkpointer(root, keep=KeepLatest(n=1)) as ckpt:
        ckpt.save(0, tree(mesh24, 0))
        ckpt.wait()

        def broken(directory: Path) -> None:
            raise OSError("simulated disk failure")

        monkeypatch.setattr(mp.workers.format, "merge_ocdbt", broken)
        assert ckpt.save(1, tree(mesh24, 1))
        # the failure surfaces on the next call, whichever it is
        with pytest.raises(
            BackgroundSaveError, match=r"step 1 failed: OSError: simulated disk failure"
        ) as info:
            ckpt.save(2, tree(mesh24, 2))
        assert info.value.step == 1 and isinstance(info.value.__cause__, OSError)
        assert ckpt.steps == [0] and ckpt.latest == 0 and names(root) == ["0"]
        assert ckpt.save(2, tree(mesh24, 2))  # reported once; the next save runs (and fails too)
        with pytest.raises(BackgroundSaveError, match="step 2"):
            ckpt.wait()
        assert (
            names(root) == ["0"] and ckpt.load()["step"] == 0
        )  # never deleted: the only committed step
        monkeypatch.undo()
        ckpt.save(3, tree(mesh24, 3))
        ckpt.wait()
        assert ckpt.steps == [3] and names(root) == ["3"]


def test_failure_reraised_by_close(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        mp.workers.format, "merge_ocdbt", lambda d: (_ for _ in ()).throw(OSError("disk full"))
    )
    ckpt = Checkpointer(tmp_path / "r")
    ckpt.save(5, tree(mesh24, 5))
    with pytest.raises(BackgroundSaveError, match="step 5 failed: OSError: disk full"):
        ckpt.close()
    with pytest.raises(RuntimeError, match="closed"):
        ckpt.save(6, tree(mesh24, 6))


# -- retention never touches what is in use -------------------------------------------------


def test_retention_never_deletes_a_step_in_flight(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(monkeypatch, steps={0})
    root = tmp_path / "r"
    with Checkpointer(root, keep=KeepLatest(n=1), max_in_flight=2) as ckpt:
        ckpt.save(0, tree(mesh24, 0))
        assert gate.entered.wait(60)
        ckpt.save(1, tree(mesh24, 1))
        state = ckpt._state
        with state.cond:  # step 1 committed and retention ran while step 0 is in flight
            assert state.cond.wait_for(lambda: 1 in state.durable and not state.gc_active, 60)
        assert names(root) == ["0.orbax-checkpoint-tmp", "1"]
        gate.release.set()
        ckpt.wait()
        assert ckpt.steps == [1] and names(root) == ["1"]  # 0 committed after 1, then aged out


def test_retention_never_deletes_a_step_being_loaded(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "r"
    with Checkpointer(root, keep=KeepLatest(n=1)) as ckpt:
        ckpt.save(0, tree(mesh24, 0))
        ckpt.wait()
        in_load, release = threading.Event(), threading.Event()
        real_load = mp._api.load

        def slow_load(*a: Any, **k: Any) -> Any:
            in_load.set()
            assert release.wait(60)
            return real_load(*a, **k)

        monkeypatch.setattr(mp._api, "load", slow_load)
        result: list[Any] = []
        loader = threading.Thread(target=lambda: result.append(ckpt.load(0)))
        loader.start()
        assert in_load.wait(60)
        ckpt.save(1, tree(mesh24, 1))
        ckpt.wait()
        assert names(root) == ["0", "1"], "step 0 is being loaded: retention must keep it"
        with pytest.raises(StepBusyError, match="being loaded"):
            ckpt.delete(0)
        release.set()
        loader.join(60)
        assert result and result[0]["step"] == 0
        ckpt.wait()  # retention finishes the deferred deletion in the background
        assert ckpt.steps == [1] and names(root) == ["1"]


def test_retention_keeps_the_latest_even_if_the_policy_does_not(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    with Checkpointer(tmp_path / "r", keep=KeepEvery(n=10)) as ckpt:
        for s in (10, 13, 14, 20, 21):
            ckpt.save(s, tree(mesh24, s))
            ckpt.wait()
            assert ckpt.latest == s and (tmp_path / "r" / str(s)).is_dir()
        assert ckpt.steps == [10, 20, 21]


# -- start-up, bad input, preemption ---------------------------------------------------------


def test_uncommitted_steps_are_ignored_and_removed_at_start(
    tmp_path: Path, mesh24: jax.sharding.Mesh, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "r"
    mp.save(root / "3", tree(mesh24, 3))
    (root / "5").mkdir()
    (root / "5" / "_CHECKPOINT_METADATA").write_text("{}")  # no commit marker
    (root / "7.orbax-checkpoint-tmp" / "state").mkdir(parents=True)
    (root / "2.milepost-deleting").mkdir()
    (root / "notes.txt").write_text("user file")
    (root / "logs").mkdir()
    with caplog.at_level("WARNING", logger="milepost.training"), Checkpointer(root) as ckpt:
        assert ckpt.steps == [3] and ckpt.latest == 3
        with pytest.raises(StepNotFoundError):
            ckpt.load(5)
    assert names(root) == ["3", "logs", "notes.txt"]
    assert caplog.text.count("did not finish") == 3 and "7.orbax-checkpoint-tmp" in caplog.text


def test_start_up_leaves_a_save_in_flight_alone(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(monkeypatch)
    root = tmp_path / "r"
    root.mkdir()
    handle = mp.save_async(root / "4", tree(mesh24, 4))
    assert gate.entered.wait(60)
    with Checkpointer(root) as ckpt:
        assert ckpt.steps == [] and names(root) == ["4.orbax-checkpoint-tmp"]
    gate.release.set()
    handle.result(60)
    assert Checkpointer(root).steps == [4]


def test_bad_input(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        Checkpointer(tmp_path / "file")
    assert (tmp_path / "file").read_text() == "x"
    with pytest.raises(TypeError, match="retention policy"):
        Checkpointer(tmp_path / "r", keep=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="save policy"):
        Checkpointer(tmp_path / "r", save_policy=100)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_in_flight"):
        Checkpointer(tmp_path / "r", max_in_flight=0)
    root = tmp_path / "r"
    with Checkpointer(root) as ckpt:
        with pytest.raises(StepNotFoundError, match="nothing to load"):
            ckpt.load()
        with pytest.raises(StepNotFoundError, match="nothing to load"):
            ckpt.metadata()
        for step, err, match in (
            (-1, ValueError, "non-negative"),
            (1.5, TypeError, "non-negative int"),
            (True, TypeError, "non-negative int"),
            ("3", TypeError, "non-negative int"),
        ):
            with pytest.raises(err, match=match):
                ckpt.save(step, {"x": 1})  # type: ignore[arg-type]
            with pytest.raises(err, match=match):
                ckpt.should_save(step)  # type: ignore[arg-type]
        assert ckpt.save(np.int64(2), tree(mesh24, 2))
        ckpt.wait()
        with pytest.raises(StepExistsError, match="already has a committed checkpoint") as info:
            ckpt.save(2, tree(mesh24, 99))
        assert isinstance(info.value, FileExistsError)
        with pytest.raises(TypeError, match="JSON"):
            ckpt.save(3, tree(mesh24, 3), metrics={"loss": object()})
        with pytest.raises(StepNotFoundError, match="no committed step 3") as missing:
            ckpt.delete(3)
        assert isinstance(missing.value, FileNotFoundError)
        with pytest.raises(StepNotFoundError, match="no committed step 7"):
            ckpt.load(7)
        assert ckpt.steps == [2] and names(root) == ["2"]
        assert ckpt.load(2)["step"] == 2  # nothing on disk was lost


def test_preemption_signal_saves_at_the_next_step(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    before_usr1, before_term = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    policy = AnyOf(FixedInterval(interval=1000), Preemption(signals=(signal.SIGUSR1,)))
    with Checkpointer(tmp_path / "r", save_policy=policy) as ckpt:
        assert signal.getsignal(signal.SIGTERM) == before_term  # only the signals the policy names
        assert not ckpt.should_save(3) and not ckpt.preempted
        signal.raise_signal(signal.SIGUSR1)
        assert ckpt.should_save(4) and ckpt.should_save(4)  # asked twice: one decision
        signal.raise_signal(signal.SIGUSR1)  # arrives after the decision: not consumed by it
        assert ckpt.save(4, tree(mesh24, 4)) and ckpt.preempted
        assert ckpt.save(5, tree(mesh24, 5))
        assert not ckpt.should_save(6)  # both requests served
        ckpt.preempt()
        assert ckpt.save(7, tree(mesh24, 7))
        ckpt.wait()
        assert ckpt.steps == [4, 5, 7]
    assert signal.getsignal(signal.SIGUSR1) == before_usr1
    with Checkpointer(tmp_path / "s"):
        assert signal.getsignal(signal.SIGTERM) == before_term  # no Preemption policy: untouched


# -- several controller processes: the primary decides ---------------------------------------


class Follower(LocalHostGroup):
    """A non-primary controller process whose primary answers from a script."""

    def __init__(self, answers: dict[str, Any]) -> None:
        super().__init__(0)
        self.answers = answers
        self.asked: list[str] = []

    def is_primary(self) -> bool:
        return False

    def broadcast(self, name: str, value: Any, timeout: float) -> Any:
        assert value is None, "a non-primary process has nothing to publish"
        what = name.split(":")[1]
        self.asked.append(what)
        return self.answers[what]


def test_a_non_primary_process_takes_the_primarys_listing_and_decisions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = {5: "5", 10: "checkpoint_10"}
    listing = ({5: {"loss": 1.0}, 10: {}}, {}, names, {}, ("run", 4), {5: 1_000_000})
    group = Follower({"open": (True, listing), "should-save": (True, (True, True))})
    monkeypatch.setattr(_dispatch, "_default_group", lambda: group)
    root = tmp_path / "r"
    with Checkpointer(root, save_policy=FixedInterval(interval=1000)) as ckpt:
        assert ckpt.steps == [5, 10] and ckpt.latest == 10
        assert ckpt._state.times == {5: 1_000_000}  # commit times, for KeepRecent
        assert ckpt.path(10) == root / "checkpoint_10" and ckpt.path(11) == root / "run_0011"
        assert not root.exists(), "only the primary lists and creates the root"
        assert (
            ckpt.should_save(11) and ckpt.preempted
        )  # its own policy says no; the primary says yes
    assert group.asked == ["open", "should-save"]
    monkeypatch.setattr(
        group, "answers", {"open": (False, NotADirectoryError(f"checkpoint root {root} is a file"))}
    )
    with pytest.raises(NotADirectoryError, match="is a file"):  # the primary's error, not a hang
        Checkpointer(root)
