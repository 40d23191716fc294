"""Atomic commit: a save killed (SIGKILL) at any point leaves nothing at its final path (or, when
overwriting, the previous checkpoint), other checkpoints untouched, and the path usable again;
overwrite rules."""

from __future__ import annotations

import hashlib
import signal
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import milepost as mp
from tests import _subproc
from tests._helpers import assert_tree_equal, listing, put, same_bits


def run_and_kill(path: Path, point: str, mode: str, overwrite: bool) -> str:
    """Start the saver (``tests/_atomic_saver.py``), SIGKILL it when it prints ``point``;
    returns what it printed."""
    proc = _subproc.popen_module("tests._atomic_saver", str(path), point, mode, str(overwrite))
    assert proc.stdout is not None and proc.stderr is not None
    seen: list[str] = []
    try:
        for line in proc.stdout:
            seen.append(line.strip())
            if seen[-1] == point:
                proc.send_signal(signal.SIGKILL)
                break
        else:
            pytest.fail(
                f"the saver exited before {point!r} (printed {seen}): {proc.stderr.read()[-3000:]}"
            )
        seen.extend(line.strip() for line in proc.stdout)
    finally:
        proc.kill()
        proc.wait(60)
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    assert "committed" not in seen, seen
    return "\n".join(seen)


def fingerprint(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        if p.is_file()
        else "dir"
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture
def bystander(tmp_path: Path) -> tuple[Path, dict[str, Any], dict[str, str]]:
    """A committed checkpoint at another path that no kill may touch."""
    mesh = jax.make_mesh((8,), ("x",))
    state = {"v": put(np.arange(64.0, dtype=np.float32), mesh, P("x")), "note": "keep"}
    path = mp.save(tmp_path / "other", state)
    return path, state, fingerprint(path)


def check_bystander(bystander: tuple[Path, dict[str, Any], dict[str, str]]) -> None:
    path, state, prints = bystander
    assert fingerprint(path) == prints
    assert_tree_equal(mp.load(path), state)


KILL_POINTS = [
    ("ready", "async"),  # before the save starts (nothing at all may appear)
    ("staged", "async"),  # save_async returned; writes in flight
    ("writing", "sync"),  # a blocking save, writes issued
    ("metadata", "async"),
    ("merged", "sync"),
    ("commit-marker", "async"),  # everything durable except the rename
]
SLOW_POINTS = {"ready"}


@pytest.mark.parametrize(
    ("point", "mode"),
    [
        pytest.param(p, m, marks=[pytest.mark.slow] if p in SLOW_POINTS else [], id=f"{p}-{m}")
        for p, m in KILL_POINTS
    ],
)
def test_sigkill_mid_save_leaves_nothing_at_the_final_path(
    tmp_path: Path, bystander: tuple[Path, dict[str, Any], dict[str, str]], point: str, mode: str
) -> None:
    target = tmp_path / "target"
    run_and_kill(target, point, mode, overwrite=False)
    assert not target.exists(), "a killed save must leave nothing at the final path"
    with pytest.raises(mp.CheckpointNotFoundError):
        mp.load(target)
    check_bystander(bystander)
    # A later save to the same path succeeds and removes the stale temporary directory.
    state = {"x": np.arange(3), "s": "fresh"}
    mp.save(target, state)
    assert_tree_equal(mp.load(target), state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "target"]


@pytest.mark.parametrize(
    "point",
    ["staged", "commit-marker", "swapped", pytest.param("metadata", marks=pytest.mark.slow)],
)
def test_sigkill_during_overwrite_keeps_old_or_new(
    tmp_path: Path, bystander: tuple[Path, dict[str, Any], dict[str, str]], point: str
) -> None:
    target = tmp_path / "target"
    old = {"x": np.full((4, 4), 3.0), "s": "old"}
    mp.save(target, old)
    run_and_kill(target, point, "async", overwrite=True)
    # The final path holds a complete checkpoint: the old one, or (once swapped) the new one.
    restored = mp.load(target)
    if point == "swapped":
        assert restored["step"] == 7 and restored["layer3"]["w"].shape == (2048, 2048)
    else:
        assert_tree_equal(restored, old)
    check_bystander(bystander)
    mp.save(target, {"y": 1}, overwrite=True)
    assert mp.load(target) == {"y": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "target"]


# ------------------------------------------------------------------------------------------
# Overwrite rules (in process)
# ------------------------------------------------------------------------------------------


def test_overwrite_false_raises_and_writes_nothing(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    state = {
        "w": put(np.arange(32, dtype=np.float32).reshape(4, 8), mesh24, P("data", "model")),
        "step": 1,
    }
    ckpt = mp.save(tmp_path / "c", state, custom_metadata={"v": 1})
    prints = fingerprint(tmp_path)
    for call in (
        lambda: mp.save(ckpt, {"x": 2}),
        lambda: mp.save_async(ckpt, {"x": 2}),
        lambda: mp.save_checkpointables(ckpt, {"state": {"x": 2}, "other": {"y": 1}}),
    ):
        with pytest.raises(
            mp.CheckpointExistsError, match=r"(?s)already exists.*overwrite=True"
        ) as info:
            call()
        assert str(ckpt) in str(info.value) and isinstance(info.value, FileExistsError)
        assert fingerprint(tmp_path) == prints
    assert_tree_equal(mp.load(ckpt), state)


def test_overwrite_true_replaces(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    ckpt = mp.save(
        tmp_path / "c", {"w": put(np.ones((8, 8), np.float32), mesh24, P("data")), "old_only": 1}
    )
    new = {"w": put(np.full((8, 8), 2.0, np.float32), mesh24, P(None, "model")), "new_only": "yes"}
    handle = mp.save_async(ckpt, new, overwrite=True, custom_metadata={"v": 2})
    assert_tree_equal(
        mp.load(ckpt)["w"], put(np.ones((8, 8), np.float32), mesh24, P("data"))
    )  # old until committed
    handle.result(timeout=120)
    assert_tree_equal(mp.load(ckpt), new)
    assert mp.metadata(ckpt).custom_metadata == {"v": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # no leftovers of the old one
    assert not any("old_only" in p for p in listing(ckpt))


def test_overwrite_refuses_what_is_not_a_committed_checkpoint(tmp_path: Path) -> None:
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "data.txt").write_text("keep me")
    uncommitted = mp.save(tmp_path / "uncommitted", {"x": 1})
    (uncommitted / "commit_success.txt").unlink()
    (uncommitted / "orbax.checkpoint").unlink()
    prints = fingerprint(tmp_path)
    for path in (precious, uncommitted):
        with pytest.raises(mp.CheckpointExistsError, match="not a committed checkpoint"):
            mp.save(path, {"x": 1}, overwrite=True)
    assert fingerprint(tmp_path) == prints


def test_stale_temporary_directory_is_replaced(tmp_path: Path) -> None:
    stale = tmp_path / "c.orbax-checkpoint-tmp"
    (stale / "state" / "ocdbt.process_0").mkdir(parents=True)
    (stale / "state" / "junk").write_bytes(b"\0" * 1000)
    (stale / "_CHECKPOINT_METADATA").write_text("{}")
    mp.save(tmp_path / "c", {"x": np.arange(5)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    assert "state/junk" not in listing(tmp_path / "c")
    assert same_bits(mp.load(tmp_path / "c")["x"], np.arange(5))


def test_commit_rename_failure_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If the final rename fails, an overwritten checkpoint is put back (without an atomic swap
    the old one is first moved aside)."""
    from milepost._storage import _workspace

    ckpt = mp.save(tmp_path / "c", {"x": np.arange(4)})
    monkeypatch.setattr(_workspace, "renameat2", lambda a, b, flag: False)  # no renameat2
    real_rename = _workspace.os.rename

    def rename(a: Any, b: Any) -> None:
        if str(a).endswith(".orbax-checkpoint-tmp"):
            raise OSError(16, "Device or resource busy (injected)")
        real_rename(a, b)

    monkeypatch.setattr(_workspace.os, "rename", rename)
    with pytest.raises(OSError, match="busy"):
        mp.save(ckpt, {"x": np.arange(9)}, overwrite=True)
    monkeypatch.undo()
    assert same_bits(mp.load(ckpt)["x"], np.arange(4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_a_checkpoint_that_appears_while_a_save_runs_is_never_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another program commits at the path while this save is in its background part: the
    save's commit refuses to replace it, and what appeared is intact (the promise of
    overwrite=False holds at the commit, not only when the save began)."""
    from tests._helpers import gate_merge

    final = tmp_path / "c"
    other = mp.save(tmp_path / "other", {"y": np.arange(9)})
    gate = gate_merge(monkeypatch)
    handle = mp.save_async(final, {"x": np.arange(3)})
    other.rename(final)  # the other program's checkpoint takes the path meanwhile
    gate.set()
    with pytest.raises(mp.CheckpointExistsError, match="appeared"):
        handle.result(timeout=120)
    assert_tree_equal(mp.load(final), {"y": np.arange(9)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # and nothing of this save left
