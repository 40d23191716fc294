"""milepost.copy, and the Checkpointer's local tier mirrored to durable storage: rotation never
deletes the only durable copy (a slow mirror holds local retention back, a failed or timed-out
one keeps the local step), a process killed mid-mirror (after a preemption save) leaves root
without a half-visible step and the next Checkpointer finishes the mirror."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost import workers
from milepost import workers as _paths
from milepost.training import Checkpointer, KeepAll, KeepLatest, MirrorError
from milepost.workers import format as fmt
from milepost.workers.jobs import _copy as copy_job
from tests import _subproc
from tests._helpers import assert_tree_equal, put
from tests._object_stores import new_s3_bucket, wait_out_lease

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def state(mesh: jax.sharding.Mesh, k: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(k)
    return {
        "w": put(rng.standard_normal((64, 128), dtype=np.float32), mesh, P("data", "model")),
        "b": put(np.arange(128, dtype=np.float32) + k, mesh, P()),
        "host": np.arange(300) * (k + 1),
        "step": k,
    }


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def committed(folder: Path) -> list[int]:
    return sorted(
        int(p.name)
        for p in folder.iterdir()
        if p.name.isdigit() and (p / fmt.COMMIT_MARKER).is_file()
    )


# ------------------------------------------------------------------------------------------
# milepost.copy
# ------------------------------------------------------------------------------------------


def test_copy_round_trips_between_storages(
    tmp_path: Path, mesh24: jax.sharding.Mesh, s3_endpoint: Any
) -> None:
    want = state(mesh24)
    mp.save(tmp_path / "a", want)
    report = mp.copy(tmp_path / "a", tmp_path / "b")
    assert report.path == tmp_path / "b" and report.files > 10
    assert (
        set(report.by_host) == {"0", "controller"} and report.by_host["0"] > 64 * 128 * 4
    )  # the shards: the host's
    assert_tree_equal(mp.load(tmp_path / "b"), want)
    assert mp.verify(tmp_path / "b").ok
    url = f"s3://{new_s3_bucket(s3_endpoint[0])}/run/1"
    mp.copy(tmp_path / "b", url)
    assert_tree_equal(mp.load(url), want)
    mp.copy(url, tmp_path / "c")  # and back down
    assert_tree_equal(mp.load(tmp_path / "c"), want)
    assert names(tmp_path) == ["a", "b", "c"]


def test_copy_refuses_what_it_must_not_do(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    mp.save(tmp_path / "a", state(mesh24, 0))
    mp.save(tmp_path / "b", state(mesh24, 1))
    with pytest.raises(mp.CheckpointExistsError, match="overwrite=True"):
        mp.copy(tmp_path / "a", tmp_path / "b")
    assert_tree_equal(mp.load(tmp_path / "b"), state(mesh24, 1))
    mp.copy(tmp_path / "a", tmp_path / "b", overwrite=True)
    assert_tree_equal(mp.load(tmp_path / "b"), state(mesh24, 0))
    (tmp_path / "a" / fmt.COMMIT_MARKER).unlink()
    with pytest.raises(mp.CheckpointNotFoundError, match="commit marker"):
        mp.copy(tmp_path / "a", tmp_path / "c")
    with pytest.raises(ValueError, match="onto itself"):
        mp.copy(tmp_path / "b", tmp_path / "b", overwrite=True)
    with pytest.raises(mp.CheckpointNotFoundError):
        mp.copy(tmp_path / "missing", tmp_path / "d")
    (tmp_path / "b" / "state" / "outside").symlink_to("/etc/hostname")
    with pytest.raises(mp.CorruptCheckpointError, match="symbolic link"):
        mp.copy(tmp_path / "b", tmp_path / "e")
    assert names(tmp_path) == ["a", "b"]  # nothing written for any refused copy


def test_a_copy_cut_short_leaves_nothing(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    mp.save(tmp_path / "a", state(mesh24))
    real = workers.JOBS["copy_files"]

    def failing(plan: workers.CopyPlan, process_index: Any) -> Any:
        if process_index != "controller":
            raise OSError(28, "No space left on device (injected)")
        return real(plan, process_index)

    monkeypatch.setitem(workers.JOBS, "copy_files", failing)
    with pytest.raises(OSError, match="injected"):
        mp.copy(tmp_path / "a", tmp_path / "b")
    assert names(tmp_path) == ["a"]


def out_of_time_once_a_file_is_copied(monkeypatch: pytest.MonkeyPatch, timeout: float) -> list[str]:
    """Make local copies hold, after each file, until the copy's ``timeout`` has passed (by its
    own clock: copy_files takes its deadline just before it makes its copier), so the next
    file's check finds the copy out of time after files were copied, however slow the machine.
    Returns the files copied."""
    copied: list[str] = []
    real = copy_job._local_copier

    def copier(source: Any, target: Any) -> Any:
        made = time.monotonic()
        copy = real(source, target)

        def one(name: str) -> int:
            size = int(copy(name))
            copied.append(name)
            while time.monotonic() <= made + timeout:  # a deadline, not a guess
                time.sleep(0.01)
            return size

        return one

    monkeypatch.setattr(copy_job, "_local_copier", copier)
    return copied


def test_a_copy_that_runs_out_of_time_stops(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    mp.save(tmp_path / "a", state(mesh24))
    real = workers.JOBS["copy_files"]
    copied = out_of_time_once_a_file_is_copied(monkeypatch, 0.3)
    with pytest.raises(TimeoutError, match="did not finish copying"):
        mp.copy(tmp_path / "a", tmp_path / "b", timeout_secs=0.3)
    assert copied, "the copy ran out of time before it copied a file"
    assert names(tmp_path) == ["a"]  # what it had copied is gone
    assert workers.JOBS["copy_files"] is real


# ------------------------------------------------------------------------------------------
# The local tier
# ------------------------------------------------------------------------------------------


def test_steps_commit_locally_and_mirror_to_root(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, local = tmp_path / "root", tmp_path / "local"
    with Checkpointer(root, local=local, keep=KeepLatest(n=3)) as ckpt:
        for step in range(5):
            ckpt.save(step, state(mesh24, step), metrics={"loss": 5.0 - step})
        ckpt.wait()
        assert ckpt.steps == [2, 3, 4] and ckpt.durable_steps == [2, 3, 4] and ckpt.latest == 4
        assert committed(root) == [2, 3, 4] and committed(local) == [3, 4]
        read: list[str] = []
        real_load = mp._api.load
        monkeypatch.setattr(
            mp._api,
            "load",
            lambda path, *a, **k: (read.append(str(path)), real_load(path, *a, **k))[1],
        )
        assert_tree_equal(ckpt.load(4), state(mesh24, 4))  # the local copy
        assert_tree_equal(ckpt.load(2), state(mesh24, 2))  # only in root
        assert read == [str(local / "4"), str(root / "2")]
        assert ckpt.metadata(3).metrics == {"loss": 2.0}
        ckpt.delete(3)
        assert ckpt.steps == [2, 4] and committed(root) == [2, 4] and committed(local) == [4]
    assert names(root) == ["2", "4"] and names(local) == ["4"]
    with Checkpointer(root, local=local, read_only=True) as reader:
        assert reader.steps == [2, 4]


def gate_mirrors(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, list[str]]:
    """Copies wait until the event is set; the targets started are recorded."""
    gate, started = threading.Event(), []
    real = workers.JOBS["copy_files"]

    def gated(plan: workers.CopyPlan, process_index: Any) -> Any:
        started.append(plan.target)
        assert gate.wait(60)
        return real(plan, process_index)

    monkeypatch.setitem(workers.JOBS, "copy_files", gated)
    return gate, started


@dataclass
class RetentionRuns:
    cond: threading.Condition
    seen: list[list[int]]
    """The local steps each finished run started from."""


def watch_retention(monkeypatch: pytest.MonkeyPatch) -> RetentionRuns:
    """Record every retention run once it finished, with the local steps it started from."""
    from milepost.training._retention import Retention

    runs = RetentionRuns(threading.Condition(), [])
    real = Retention._run

    def run(self: Retention) -> None:
        with self.state.cond:
            local = sorted(self.state.local)
        real(self)
        with runs.cond:
            runs.seen.append(local)
            runs.cond.notify_all()

    monkeypatch.setattr(Retention, "_run", run)
    return runs


def test_a_slow_mirror_holds_local_rotation_back(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, local = tmp_path / "root", tmp_path / "local"
    gate, started = gate_mirrors(monkeypatch)
    runs = watch_retention(monkeypatch)
    with Checkpointer(root, local=local, keep=KeepAll(), local_keep=KeepLatest(n=1)) as ckpt:
        for step in range(4):
            ckpt.save(step, state(mesh24, step))  # returns while the mirror is stuck
        with runs.cond:  # a retention run that knew the last step has finished
            assert runs.cond.wait_for(lambda: any(3 in seen for seen in runs.seen), 60), runs.seen
        assert committed(local) == [0, 1, 2, 3], "a step not yet mirrored was deleted locally"
        assert committed(root) == [] and ckpt.steps == [0, 1, 2, 3] and ckpt.durable_steps == []
        assert len(started) == 1  # one mirror at a time, oldest first
        gate.set()
        ckpt.wait()
        assert committed(root) == [0, 1, 2, 3] and committed(local) == [3]


def test_a_failed_mirror_keeps_the_local_step(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, local = tmp_path / "root", tmp_path / "local"
    real = workers.JOBS["copy_files"]

    def failing(plan: workers.CopyPlan, process_index: Any) -> Any:
        if plan.target.startswith(str(root / "1")) and process_index != "controller":
            raise OSError(5, "Input/output error (injected)")
        return real(plan, process_index)

    monkeypatch.setitem(workers.JOBS, "copy_files", failing)
    with Checkpointer(root, local=local, local_keep=KeepLatest(n=1)) as ckpt:
        ckpt.save(0, state(mesh24, 0))
        ckpt.save(1, state(mesh24, 1))
        with pytest.raises(MirrorError, match="step 1 .*injected.* kept in"):
            ckpt.wait()
        ckpt.save(2, state(mesh24, 2))
        ckpt.save(3, state(mesh24, 3))
        ckpt.wait()
        assert committed(root) == [0, 2, 3] and committed(local) == [1, 3]  # 1: the only copy, kept
        assert ckpt.steps == [0, 1, 2, 3]
        assert_tree_equal(ckpt.load(1), state(mesh24, 1))
    assert names(root) == ["0", "2", "3"]  # no half of step 1
    monkeypatch.undo()
    with Checkpointer(root, local=local, local_keep=KeepLatest(n=1)) as ckpt:  # mirrors it again
        ckpt.wait()
        assert ckpt.durable_steps == [0, 1, 2, 3]
    assert committed(local) == [3]
    assert_tree_equal(mp.load(root / "1"), state(mesh24, 1))


def test_a_mirror_out_of_time_fails_and_keeps_the_step(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, local = tmp_path / "root", tmp_path / "local"
    copied = out_of_time_once_a_file_is_copied(monkeypatch, 0.3)
    with Checkpointer(root, local=local, mirror_timeout_secs=0.3) as ckpt:
        ckpt.save(0, state(mesh24, 0))
        with pytest.raises(MirrorError, match="did not finish copying"):
            ckpt.wait()
        assert copied, "the mirror ran out of time before it copied a file"
        assert ckpt.steps == [0] and ckpt.durable_steps == []
    assert names(root) == [] and committed(local) == [0]


def test_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a local folder"):
        Checkpointer(tmp_path / "r", local="memory://x")
    with pytest.raises(ValueError, match="overlap"):
        Checkpointer(tmp_path / "r", local=tmp_path / "r" / "fast")
    with pytest.raises(ValueError, match="pass local="):
        Checkpointer(tmp_path / "r", local_keep=KeepLatest(n=1))
    with pytest.raises(TypeError, match="local_keep"):
        Checkpointer(tmp_path / "r", local=tmp_path / "l", local_keep=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout_secs"):
        Checkpointer(tmp_path / "r", local=tmp_path / "l", mirror_timeout_secs=-1)
    assert names(tmp_path) == []


# ------------------------------------------------------------------------------------------
# Preempted, then killed mid-mirror; the next job finishes the mirror
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("durable", ["file", "s3"])
def test_killed_during_the_mirror_of_a_preemption_save(
    tmp_path: Path, mesh24: jax.sharding.Mesh, durable: str, request: pytest.FixtureRequest
) -> None:
    local = tmp_path / "local"
    if durable == "s3":
        endpoint, _ = request.getfixturevalue("s3_endpoint")
        root: Any = f"s3://{new_s3_bucket(endpoint)}/run"
    else:
        root = tmp_path / "root"
    proc = _subproc.popen_module("tests._preempted_mirror", str(root), str(local))
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)  # the preemption notice
        line = proc.stdout.readline().split()
        assert line[0] == "saved", (line, proc.stderr.read() if proc.poll() is not None else "")  # type: ignore[union-attr]
        step = int(line[1])
        assert proc.stdout.readline().strip() == "mirroring"
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
    finally:
        proc.kill()
        proc.wait(60)
    assert committed(local) == [step]
    with pytest.raises(mp.CheckpointNotFoundError):
        mp.load(_paths.as_path(root) / str(step))  # part of it is there, not visible
    if durable == "s3":
        wait_out_lease(_paths.as_path(root) / str(step))  # the killed mirror's lease expires
    with Checkpointer(root, local=local) as ckpt:
        assert ckpt.steps == [step]
        ckpt.wait()  # the mirror is done again
        assert ckpt.durable_steps == [step]
    assert_tree_equal(mp.load(_paths.as_path(root) / str(step)), state(mesh24, step))
    assert mp.verify(_paths.as_path(root) / str(step)).ok
    if durable == "file":
        assert names(tmp_path / "root") == [str(step)]  # the killed mirror's leftovers are gone
    else:
        keys = _paths.as_path(root).keys()
        assert all(k.startswith(f"{step}/") for k in keys), keys
    assert os.path.isdir(local / str(step))
