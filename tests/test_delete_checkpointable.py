"""Deleting one checkpointable of a checkpoint (mp.delete_checkpointable) or of a step
(Checkpointer.delete_checkpointable): atomic, the rest loading and verifying exactly, typed
errors; a failure at any phase leaves the checkpoint whole."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost.training import Checkpointer, StepBusyError, StepNotFoundError
from tests._helpers import gate_merge

DATASET = {"position": 1234, "epoch": 2}


def parts(mesh: jax.sharding.Mesh) -> dict[str, Any]:
    w = jax.device_put(
        np.arange(128, dtype=np.float32).reshape(16, 8), NamedSharding(mesh, P("data", "model"))
    )
    return {
        "state": {"w": w, "b": np.arange(5, dtype=np.int32)},
        "extra": {"ema": np.full((4, 4), 0.5, np.float32), "note": "keep me?"},
        "dataset": DATASET,
    }


def check_rest(path: Path, kept: set[str]) -> None:
    """What is left of ``path`` loads exactly and verifies."""
    loaded = mp.load_checkpointables(path)
    assert set(loaded) == kept
    if "state" in kept:
        np.testing.assert_array_equal(
            np.asarray(loaded["state"]["w"]), np.arange(128, dtype=np.float32).reshape(16, 8)
        )
        np.testing.assert_array_equal(loaded["state"]["b"], np.arange(5, dtype=np.int32))
    if "extra" in kept:
        np.testing.assert_array_equal(loaded["extra"]["ema"], np.full((4, 4), 0.5, np.float32))
        assert loaded["extra"]["note"] == "keep me?"
    if "dataset" in kept:
        assert loaded["dataset"] == DATASET
    report = mp.verify(path)
    assert report.ok, str(report)
    assert set(mp.metadata(path).checkpointables) == kept


def test_delete_a_checkpointable_of_a_checkpoint(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    path = tmp_path / "ckpt"
    mp.save_checkpointables(path, parts(mesh24), metrics={"loss": 0.5}, custom_metadata={"a": 1})
    before = mp.metadata(path)
    inode = (path / "state" / "_METADATA").stat().st_ino
    mp.delete_checkpointable(path, "extra")
    assert not (path / "extra").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # nothing left beside it
    check_rest(path, {"state", "dataset"})
    after = mp.metadata(path)
    assert (after.commit_timestamp_nsecs, after.init_timestamp_nsecs) == (
        before.commit_timestamp_nsecs,
        before.init_timestamp_nsecs,
    )
    assert after.metrics == {"loss": 0.5} and after.custom_metadata == {"a": 1}
    assert (path / "state" / "_METADATA").stat().st_ino == inode  # linked, not copied
    mp.delete_checkpointable(str(path), "dataset")
    check_rest(path, {"state"})


def test_errors_name_what_to_do(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    path = tmp_path / "ckpt"
    mp.save_checkpointables(path, {"state": parts(mesh24)["state"], "dataset": DATASET})
    with pytest.raises(mp.CheckpointableNotFoundError) as unknown:
        mp.delete_checkpointable(path, "datset")
    assert isinstance(unknown.value, KeyError)
    assert unknown.value.names == ("dataset", "state") and unknown.value.name == "datset"
    assert str(unknown.value) == (
        f"{path} has no checkpointable 'datset'; its checkpointables are 'dataset', 'state'"
    )
    mp.delete_checkpointable(path, "dataset")
    with pytest.raises(mp.LastCheckpointableError, match="delete the checkpoint") as last:
        mp.delete_checkpointable(path, "state")
    assert isinstance(last.value, ValueError) and last.value.name == "state"
    with pytest.raises(mp.CheckpointNotFoundError):
        mp.delete_checkpointable(tmp_path / "nothing", "state")
    single = tmp_path / "single"
    mp.save(single, {"x": np.arange(3)})  # one checkpointable
    with pytest.raises(mp.LastCheckpointableError):
        mp.delete_checkpointable(single, "state")
    with pytest.raises(mp.CheckpointNotFoundError):
        mp.delete_checkpointable("memory://bucket/nothing", "state")
    check_rest(path, {"state"})


def hold(directory: Path) -> int:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def test_a_held_checkpoint_is_left_alone(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ckpt"
    mp.save_checkpointables(path, parts(mesh24))
    fd = hold(path)  # as a deletion of it in another process
    try:
        with pytest.raises(mp.CheckpointExistsError, match="held by another process"):
            mp.delete_checkpointable(path, "extra")
    finally:
        os.close(fd)
    gate = gate_merge(monkeypatch)
    handle = mp.save_checkpointables_async(path, parts(mesh24), overwrite=True)
    try:
        assert gate.entered.wait(60)
        with pytest.raises(mp.CheckpointExistsError):  # a save of the path is in flight
            mp.delete_checkpointable(path, "extra")
    finally:
        gate.set()
    handle.result(60)
    check_rest(path, {"state", "extra", "dataset"})


@pytest.mark.parametrize("phase", ["link", "metadata", "checksums", "marker", "publish"])
def test_a_failure_at_any_phase_leaves_the_checkpoint_whole(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch, phase: str
) -> None:
    from milepost._checkpoint import _drop

    path = tmp_path / "ckpt"
    mp.save_checkpointables(path, parts(mesh24))

    def boom(*args: Any, **kwargs: Any) -> None:
        raise OSError(f"injected at {phase}")

    if phase == "link":
        monkeypatch.setattr(_drop, "_link_tree", boom)
    elif phase == "metadata":
        monkeypatch.setattr(_drop.fmt, "write_json", boom)
    elif phase == "checksums":
        monkeypatch.setattr(_drop.fmt.Checksums, "write", boom)
    elif phase == "marker":
        monkeypatch.setattr(_drop.fmt, "write_file", boom)
    else:
        monkeypatch.setattr(_drop._storage.LocalWorkspace, "publish", boom)
    with pytest.raises(OSError, match="injected"):
        mp.delete_checkpointable(path, "extra")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # the new folder removed
    check_rest(path, {"state", "extra", "dataset"})
    mp.delete_checkpointable(path, "extra")  # nothing left in the way
    check_rest(path, {"state", "dataset"})


def test_a_checkpointer_deletes_a_checkpointable_of_a_step(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "run"
    with Checkpointer(root) as ckpt:
        for s in (1, 2):
            ckpt.save_checkpointables(s, parts(mesh24), metrics={"loss": float(s)})
        ckpt.wait()
        ckpt.delete_checkpointable(1, "dataset")
        assert set(ckpt.load_checkpointables(1)) == {"state", "extra"}
        check_rest(root / "1", {"state", "extra"})
        check_rest(root / "2", {"state", "extra", "dataset"})
        assert ckpt.steps == [1, 2] and ckpt.metadata(1).metrics == {"loss": 1.0}
        with pytest.raises(mp.CheckpointableNotFoundError, match="'extra', 'state'"):
            ckpt.delete_checkpointable(1, "dataset")
        with pytest.raises(StepNotFoundError, match="no committed step 7"):
            ckpt.delete_checkpointable(7, "dataset")
        ckpt.delete_checkpointable(1, "extra")
        with pytest.raises(mp.LastCheckpointableError, match=r"delete\(step\)"):
            ckpt.delete_checkpointable(1, "state")
        gate = gate_merge(monkeypatch)
        ckpt.save_checkpointables(3, parts(mesh24))
        try:
            assert gate.entered.wait(60)
            with pytest.raises(StepBusyError, match="being saved"):
                ckpt.delete_checkpointable(3, "extra")
        finally:
            gate.set()
        ckpt.wait()
        monkeypatch.undo()
        ckpt.delete_checkpointable(3, "extra")
        check_rest(root / "3", {"state", "dataset"})
    with Checkpointer(root, read_only=True) as reader:
        assert reader.steps == [1, 2, 3]
        with pytest.raises(PermissionError, match="read-only"):
            reader.delete_checkpointable(2, "extra")
    check_rest(root / "1", {"state"})
    check_rest(root / "2", {"state", "extra", "dataset"})


def test_a_local_tier_step_loses_it_in_both_tiers(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    with Checkpointer(tmp_path / "root", local=tmp_path / "fast") as ckpt:
        ckpt.save_checkpointables(0, parts(mesh24))
        ckpt.save_checkpointables(1, parts(mesh24))
        ckpt.wait()
        assert ckpt.durable_steps == [0, 1]  # mirrored, and kept locally (local_keep: 2)
        ckpt.delete_checkpointable(0, "extra")
    for tier in ("root", "fast"):
        check_rest(tmp_path / tier / "0", {"state", "dataset"})
        check_rest(tmp_path / tier / "1", {"state", "extra", "dataset"})
