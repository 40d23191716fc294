"""A save's temporary directory removed from outside (a cleanup job's ``rm -rf``) at any stage of
the save: the save fails with ``mp.TemporaryDirectoryRemovedError``, nothing is committed (a
checkpoint being overwritten stays whole), nothing of the save is left, and the path takes the
next save.

Every race here is decided by events, not sleeps: the deletion starts when a named file appears
in the directory (a watcher polling for it) or at a stage boundary (a step of the save, patched),
and the save's rename waits until the deletion is over, so the deletion lands before the commit
is published, at whatever point inside it.
"""

from __future__ import annotations

import errno
import shutil
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost._storage import _ownership, _workspace
from milepost.workers import format as _format
from tests._helpers import assert_tree_equal, put

TMP_SUFFIX = ".orbax-checkpoint-tmp"


def _state(mesh: jax.sharding.Mesh, k: int = 0) -> dict[str, Any]:
    """Host shards, the controller's own leaves and a string: every kind of file a tree has."""
    return {
        "x": put(np.arange(4096, dtype=np.float32).reshape(64, 64) + k, mesh, P("data", "model")),
        "n": np.arange(300) + k,
        "s": f"text {k}",
    }


def _remove_once(tmp: Path, how: str) -> None:
    """One pass of a deletion from outside, as ``rm -rf`` does it: a folder in which a file
    appeared after the pass listed it stays, with what was not listed."""
    if how == "rm":  # a real process
        subprocess.run(["rm", "-rf", str(tmp)], check=False, capture_output=True, timeout=60)
    else:  # a thread of this process
        shutil.rmtree(tmp, ignore_errors=True)


def _remove_all(tmp: Path) -> None:
    """Remove ``tmp`` until it is gone (writers in flight may be making it again)."""
    while tmp.exists():
        shutil.rmtree(tmp, ignore_errors=True)


def _before_rename(monkeypatch: pytest.MonkeyPatch, fn: Callable[[], None]) -> None:
    """Run ``fn`` just before the commit's rename (the plain one, or the overwrite's exchange),
    after every check the save makes before it; once (not before a rename that undoes it)."""
    real_new, real_exchange = _workspace.rename_new, _workspace.exchange
    calls: list[int] = []

    def once() -> None:
        if not calls:
            calls.append(1)
            fn()

    def rename_new(a: Path, b: Path) -> None:
        once()
        real_new(a, b)

    def exchange(a: Path, b: Path) -> bool:
        once()
        return real_exchange(a, b)

    monkeypatch.setattr(_workspace, "rename_new", rename_new)
    monkeypatch.setattr(_workspace, "exchange", exchange)


def _save_and_expect_removed(
    final: Path, state: dict[str, Any], overwrite: bool, old: dict[str, Any] | None
) -> mp.TemporaryDirectoryRemovedError:
    """Save, which must fail as removed; nothing committed (or the old checkpoint whole)."""
    handle = mp.save_async(final, state, overwrite=overwrite)
    with pytest.raises(mp.TemporaryDirectoryRemovedError, match="removed or replaced") as info:
        handle.result(timeout=120)
    assert isinstance(info.value, FileNotFoundError) and info.value.errno == errno.ENOENT
    assert str(final) in str(info.value) and "save again" in str(info.value)
    if old is None:
        assert not final.exists(), "nothing may be committed"
    else:
        assert_tree_equal(mp.load(final), old)
    return info.value


def _check_path_usable(final: Path, state: dict[str, Any], overwrite: bool) -> None:
    """Nothing of the failed save is left, and the path takes the next save."""
    assert sorted(p.name for p in final.parent.iterdir()) == (["c"] if overwrite else [])
    mp.save(final, state, overwrite=overwrite)
    assert_tree_equal(mp.load(final), state)
    assert sorted(p.name for p in final.parent.iterdir()) == ["c"]


# ------------------------------------------------------------------------------------------
# Removed when a file appears in it (a watcher), during whatever the save does then
# ------------------------------------------------------------------------------------------

APPEARING = [
    "state/ocdbt.process_0/d/*",  # a host's first data file
    "state/ocdbt.process_controller/d/*",  # the controller's own leaves
    "state/ocdbt.process_0/manifest.ocdbt",  # a host's database committed
    "state/_METADATA",  # the tree metadata, first of the format files
    "state/_sharding",
    "state/manifest.ocdbt",  # the merged root view
    "state/d/*",  # its B-tree
    "_CHECKPOINT_METADATA",
    "_milepost_checksums.json",
    "commit_success.txt",  # the marker: only the rename is left
]


@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
@pytest.mark.parametrize("how", ["thread", "rm"])
@pytest.mark.parametrize("pattern", APPEARING)
@pytest.mark.parametrize("round_", [0, 1], ids=["r0", "r1"])
def test_removed_when_a_file_appears(
    tmp_path: Path,
    mesh24: jax.sharding.Mesh,
    monkeypatch: pytest.MonkeyPatch,
    pattern: str,
    how: str,
    overwrite: bool,
    round_: int,
) -> None:
    """One pass of ``rm -rf`` (a real process, or a thread) as soon as ``pattern`` appears,
    while the save goes on writing; the rename waits for the pass to end. Two rounds each: the
    pass meets the save at a different point each time."""
    final = tmp_path / "c"
    old = _state(mesh24, 1) if overwrite else None
    if old is not None:
        mp.save(final, old)
    tmp = tmp_path / f"c{TMP_SUFFIX}"
    removed, stop = threading.Event(), threading.Event()

    def watch() -> None:
        while not stop.is_set():
            if any(tmp.glob(pattern)):
                _remove_once(tmp, how)
                removed.set()
                return
            stop.wait(0.0002)

    def rename_waits() -> None:  # the event decides: the deletion is over before the rename
        assert removed.wait(60), f"{pattern} never appeared"

    _before_rename(monkeypatch, rename_waits)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        _save_and_expect_removed(final, _state(mesh24), overwrite, old)
    finally:
        stop.set()
        watcher.join(60)
    assert removed.is_set()
    monkeypatch.undo()
    _check_path_usable(final, _state(mesh24, 2), overwrite)


# ------------------------------------------------------------------------------------------
# Removed, replaced or emptied at a stage boundary of the save (a patched step)
# ------------------------------------------------------------------------------------------


def _at(monkeypatch: pytest.MonkeyPatch, stage: str, attack: Callable[[], None]) -> None:
    """Run ``attack`` at ``stage`` of a save."""
    if stage == "writing":  # the data writes are issued and in flight
        real_start = mp.workers.start_save

        def start_save(*a: Any, **k: Any) -> Any:
            pending = real_start(*a, **k)
            attack()
            return pending

        monkeypatch.setattr(mp.workers, "start_save", start_save)
    elif stage == "data-written":  # the hosts' writes landed, the save not told yet
        real_wait = mp.workers.PendingSave.wait
        calls: list[int] = []

        def wait(self: Any, timeout: float | None = None) -> Any:
            ack = real_wait(self, timeout)
            if not calls:
                calls.append(1)
                attack()
            return ack

        monkeypatch.setattr(mp.workers.PendingSave, "wait", wait)
    elif stage == "data-landed":  # every byte written, no tree metadata yet
        real_write = _format.write_tree

        def write_tree(*a: Any, **k: Any) -> None:
            attack()
            real_write(*a, **k)

        monkeypatch.setattr(_format, "write_tree", write_tree)
    elif stage == "merged":  # tree metadata written and the databases merged
        real_merge = mp.workers.format.merge_ocdbt

        def merge(directory: Any) -> None:
            real_merge(directory)
            attack()

        monkeypatch.setattr(mp.workers.format, "merge_ocdbt", merge)
    elif stage == "checksums":  # the checkpoint metadata written, the checksums next
        real_compute = _format.Checksums.compute

        def compute(root: Path) -> Any:
            attack()
            return real_compute(root)

        monkeypatch.setattr(_format.Checksums, "compute", staticmethod(compute))
    elif stage == "marker":  # everything but the commit marker
        real_write_file = _format.write_file

        def write_file(path: Any, data: Any) -> None:
            if Path(str(path)).name == _format.COMMIT_MARKER:
                attack()
            real_write_file(path, data)

        monkeypatch.setattr(_format, "write_file", write_file)
    else:
        assert stage == "rename", stage  # every check before the rename passed
        _before_rename(monkeypatch, attack)


STAGES = ["writing", "data-written", "data-landed", "merged", "checksums", "marker", "rename"]


def _attack(tmp: Path, what: str) -> Callable[[], None]:
    """``all``: remove the directory until it is gone; ``replace``: then make an empty one in
    its place; ``files``: remove every file in it and keep the folders (as an ``rm -rf`` that
    failed to remove each folder, a file having appeared in it); a folder or a file pattern in
    it: remove that only."""

    def attack() -> None:
        if what == "files":
            for path in [p for p in tmp.rglob("*") if not p.is_dir()]:
                path.unlink(missing_ok=True)
            return
        if what in ("all", "replace"):
            _remove_all(tmp)
            if what == "replace":
                tmp.mkdir(exist_ok=True)  # writes in flight may have made one already
            return
        found = list(tmp.glob(what))
        assert found, f"nothing matches {what} in {tmp}"
        for path in found:
            shutil.rmtree(path) if path.is_dir() else path.unlink()

    return attack


@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
@pytest.mark.parametrize("what", ["all", "replace", "files"])
@pytest.mark.parametrize("stage", STAGES)
def test_removed_at_a_stage_of_the_save(
    tmp_path: Path,
    mesh24: jax.sharding.Mesh,
    monkeypatch: pytest.MonkeyPatch,
    stage: str,
    what: str,
    overwrite: bool,
) -> None:
    """Removed wholly, replaced by an empty folder, or emptied of its files at each boundary:
    data writes in flight, landed, told to the save, tree metadata written, before the
    checksums, before the marker, before the rename."""
    final = tmp_path / "c"
    old = _state(mesh24, 1) if overwrite else None
    if old is not None:
        mp.save(final, old)
    _at(monkeypatch, stage, _attack(tmp_path / f"c{TMP_SUFFIX}", what))
    _save_and_expect_removed(final, _state(mesh24), overwrite, old)
    monkeypatch.undo()
    _check_path_usable(final, _state(mesh24, 2), overwrite)


LATE = [
    "state",
    "state/_METADATA",
    "state/manifest.ocdbt",
    "state/ocdbt.process_0/d/*",
    "_CHECKPOINT_METADATA",  # written by the commit itself
    "orbax.checkpoint",
]
PARTS = [
    *[("data-landed", what) for what in ["state/ocdbt.process_0/d/*", "state/ocdbt.process_0/*"]],
    *[("data-landed", "state/ocdbt.process_controller/d/*")],
    *[(stage, what) for stage in ["checksums", "marker", "rename"] for what in LATE],
]


@pytest.mark.parametrize(("stage", "what"), PARTS)
def test_part_removed_late_in_the_save(
    tmp_path: Path,
    mesh24: jax.sharding.Mesh,
    monkeypatch: pytest.MonkeyPatch,
    stage: str,
    what: str,
) -> None:
    """A folder or files removed from the directory, its owner file left: the folder's identity,
    or the files recorded once the tree's writes landed, from the commit's start and as the
    commit writes them, tell, up to right after the rename (which is then undone)."""
    final = tmp_path / "c"
    _at(monkeypatch, stage, _attack(tmp_path / f"c{TMP_SUFFIX}", what))
    _save_and_expect_removed(final, _state(mesh24), False, None)
    monkeypatch.undo()
    _check_path_usable(final, _state(mesh24, 2), False)


@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
@pytest.mark.parametrize("what", ["all", "replace", "state/_METADATA"])
def test_removed_at_the_rename_without_renameat2(
    tmp_path: Path,
    mesh24: jax.sharding.Mesh,
    monkeypatch: pytest.MonkeyPatch,
    what: str,
    overwrite: bool,
) -> None:
    """Where the system has no renameat2 (no atomic exchange: an overwritten checkpoint is
    moved aside first), the rename is undone the same way and the old checkpoint put back."""
    final = tmp_path / "c"
    old = _state(mesh24, 1) if overwrite else None
    if old is not None:
        mp.save(final, old)
    monkeypatch.setattr(_workspace, "renameat2", lambda a, b, flag: False)
    _at(monkeypatch, "rename", _attack(tmp_path / f"c{TMP_SUFFIX}", what))
    _save_and_expect_removed(final, _state(mesh24), overwrite, old)
    monkeypatch.undo()
    _check_path_usable(final, _state(mesh24, 2), overwrite)


def test_a_file_gone_under_a_read_is_reported_as_the_removal(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deletion still under way when a step of the commit fails on a file it removed (the
    owner file not reached yet): the failure is reported as the removal, caused by the step's
    own error. Here the checksums' walk listed a file that is gone when it is read."""
    final, tmp = tmp_path / "c", tmp_path / f"c{TMP_SUFFIX}"

    def compute(root: Path) -> Any:
        (tmp / _format.CHECKPOINT_METADATA).unlink()
        return (root / _format.CHECKPOINT_METADATA).read_bytes()

    monkeypatch.setattr(_format.Checksums, "compute", staticmethod(compute))
    error = _save_and_expect_removed(final, _state(mesh24), False, None)
    assert isinstance(error.__cause__, FileNotFoundError), repr(error.__cause__)
    assert f"{_format.CHECKPOINT_METADATA} is gone" in str(error), error
    monkeypatch.undo()
    _check_path_usable(final, _state(mesh24, 2), False)


def test_another_saves_directory_at_the_path_is_left_alone(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Removed from outside, then made again by another save that locks it: the failed save
    removes nothing of the other save's."""
    final, tmp = tmp_path / "c", tmp_path / f"c{TMP_SUFFIX}"
    others: list[_ownership.Locked] = []

    def attack() -> None:
        _remove_all(tmp)
        others.append(_ownership.create_locked(tmp)[0])

    _at(monkeypatch, "checksums", attack)
    try:
        error = _save_and_expect_removed(final, _state(mesh24), False, None)
        assert "another folder" in str(error), error
        assert (tmp / _format.OWNER_FILE).exists(), "the other save's directory was removed"
    finally:
        for lock in others:
            lock.release()
