"""Two writers, one path: real processes racing. Exactly one writer's checkpoint is ever
committed (never a mix), a reader never deletes a live save, and a load racing an overwrite
returns the old or the new checkpoint whole, or says it was replaced. (A save's directory
deleted under it: tests/test_tmp_removed.py.)"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import milepost as mp
from tests import _subproc
from tests._helpers import assert_tree_equal, gate_merge, listing, put, same_bits

PROCS = "tests._concurrency_procs"
"""The other processes: writers, one that waits, a training loop, an overwriter, a save onto a
full disk."""


def _writer_tree(me: int) -> dict[str, Any]:
    tree: dict[str, Any] = {
        f"w{i}": np.full((256, 1024), me * 1000 + i, np.float32) for i in range(8)
    }
    tree["who"] = f"writer{me}"
    return tree


def _race(tmp_path: Path, rounds: int, overwrite: bool) -> list[list[str]]:
    """Two writer processes save to ``c<r>`` at the same moment, ``rounds`` times; each one's
    outcome per round."""
    procs = [
        _subproc.popen_module(
            PROCS, "writer", str(me), str(rounds), str(tmp_path), "1" if overwrite else "0"
        )
        for me in (1, 2)
    ]
    outcomes: list[list[str]] = [["" for _ in range(rounds)] for _ in procs]
    try:
        for r in range(rounds):
            for proc in procs:
                assert proc.stdout is not None
                line = proc.stdout.readline()
                assert line.strip() == f"ready {r}", (
                    line,
                    proc.stderr.read() if proc.poll() is not None else "",
                )  # type: ignore[union-attr]
            (tmp_path / f"go{r}").touch()
            for k, proc in enumerate(procs):
                assert proc.stdout is not None
                line = proc.stdout.readline()
                assert line.startswith("outcome "), (
                    line,
                    proc.stderr.read() if proc.poll() is not None else "",
                )  # type: ignore[union-attr]
                got_round, outcome = json.loads(line[len("outcome ") :])
                assert got_round == r
                outcomes[k][r] = outcome
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(60)
    return outcomes


def test_two_writers_of_one_path_never_commit_a_mix(tmp_path: Path) -> None:
    rounds = 8
    outcomes = _race(tmp_path, rounds, overwrite=False)
    for r in range(rounds):
        first, second = outcomes[0][r], outcomes[1][r]
        assert sorted([first == "committed", second == "committed"]) == [False, True], (
            r,
            first,
            second,
        )
        loser = second if first == "committed" else first
        # Raced while the winner wrote ("is writing it now"), or after it committed ("already
        # exists").
        assert loser.startswith("exists: ") and (
            "is writing it now" in loser or "already exists" in loser
        ), loser
        winner = 1 if first == "committed" else 2
        assert_tree_equal(mp.load(tmp_path / f"c{r}"), _writer_tree(winner))
    leftovers = [p for p in listing(tmp_path) if not p.startswith(("c", "go"))]
    assert leftovers == [], leftovers
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("c")) == [
        f"c{r}" for r in range(rounds)
    ]


def test_two_overwriting_writers_leave_one_whole_checkpoint(tmp_path: Path) -> None:
    rounds = 8
    outcomes = _race(tmp_path, rounds, overwrite=True)
    for r in range(rounds):
        committed = [k + 1 for k in range(2) if outcomes[k][r] == "committed"]
        assert committed, (r, outcomes[0][r], outcomes[1][r])
        for k in range(2):  # whoever did not commit was told another writer was busy
            assert outcomes[k][r] == "committed" or "is writing it now" in outcomes[k][r], outcomes[
                k
            ][r]
        restored = mp.load(tmp_path / f"c{r}")
        winner = 1 if restored["who"] == "writer1" else 2
        assert winner in committed
        assert_tree_equal(restored, _writer_tree(winner))  # all of one writer, none of the other


def test_a_waiting_writer_goes_after_the_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SaveOptions(wait_for_writer_secs=...) waits for the other writer instead of failing. The
    other process says when it found this save's temporary directory locked (its lock attempt
    failed), so the test knows it is waiting, not still starting, when this save commits."""
    gate = gate_merge(monkeypatch)
    handle = mp.save_async(tmp_path / "c", {"x": np.arange(3)})
    other = _subproc.popen_module(PROCS, "waiting_writer", str(tmp_path / "c"))
    try:
        assert other.stdout is not None
        line = other.stdout.readline()
        if line.strip() != "waiting":
            other.kill()
            pytest.fail(f"the other writer is not waiting: {line!r}\n{other.communicate(60)[1]}")
        assert not handle.done() and not (tmp_path / "c").exists()  # this save holds the path
        assert other.poll() is None  # it waits for us
        gate.set()
        handle.result(60)
        out, err = other.communicate(timeout=120)
    finally:
        gate.set()
        other.kill()
    assert other.returncode == 0 and "saved" in out, err
    assert same_bits(mp.load(tmp_path / "c")["x"], np.arange(5))


# ------------------------------------------------------------------------------------------
# Readers and a training loop in other processes
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("read_only", [True, False], ids=["read-only", "writer"])
def test_a_polling_checkpointer_never_deletes_a_live_save(tmp_path: Path, read_only: bool) -> None:
    from milepost.training import Checkpointer

    root = tmp_path / "run"
    trainer = _subproc.popen_module(PROCS, "trainer", str(root))
    seen: dict[int, int] = {}
    polls = 0
    try:
        while trainer.poll() is None:
            if root.exists():
                with Checkpointer(root, read_only=read_only) as watcher:
                    polls += 1
                    latest = watcher.latest
                    if latest is not None:
                        try:
                            got = watcher.load(latest)
                        except mp.CheckpointReplacedError:
                            continue
                        assert (
                            same_bits(got["w"], np.full((512, 1024), latest, np.float32))
                            and got["step"] == latest
                        )
                        seen[latest] = seen.get(latest, 0) + 1
            time.sleep(0.02)
        out, err = trainer.communicate(timeout=300)
    finally:
        trainer.kill()
    assert trainer.returncode == 0, err
    assert "trained [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]" in out, (out, err)
    assert polls >= 5 and seen, (polls, seen)
    with Checkpointer(root, read_only=True) as done:
        assert done.steps == list(range(10))
        for step in done.steps:
            assert same_bits(done.load(step)["w"], np.full((512, 1024), step, np.float32))
    assert not any(".orbax-checkpoint-tmp" in p or "milepost-new" in p for p in listing(root))


def test_a_read_only_checkpointer_writes_and_deletes_nothing(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    from milepost.training import Checkpointer

    root = tmp_path / "run"
    with Checkpointer(root) as ckpt:
        ckpt.save(1, {"x": put(np.arange(8.0), mesh24, P("model"))})
    leftover = root / "2.orbax-checkpoint-tmp"  # as if a save of step 2 had died
    leftover.mkdir()
    before = listing(root)
    with Checkpointer(tmp_path / "missing", read_only=True) as nothing:
        assert nothing.steps == []
    assert not (tmp_path / "missing").exists()
    with Checkpointer(root, read_only=True) as reader:
        assert reader.steps == [1]
        with pytest.raises(PermissionError, match="read-only"):
            reader.save(3, {"x": 1}, force=True)
        with pytest.raises(PermissionError, match="read-only"):
            reader.delete(1)
    assert listing(root) == before
    with Checkpointer(
        root
    ) as writer:  # a writer removes what a dead save left, once it holds its lock
        assert writer.steps == [1]
    assert not leftover.exists()


# ------------------------------------------------------------------------------------------
# Loads racing overwrites
# ------------------------------------------------------------------------------------------


def test_loads_racing_overwrites_get_one_checkpoint_whole(tmp_path: Path) -> None:
    path = tmp_path / "c"
    writer = _subproc.popen_module(PROCS, "overwriter", str(path), "8.0")
    assert writer.stdout is not None
    assert writer.stdout.readline().strip() == "ready"
    outcomes: dict[str, int] = {}
    try:
        while writer.poll() is None:
            try:
                got = mp.load(path)
            except mp.CheckpointReplacedError:
                outcomes["replaced"] = outcomes.get("replaced", 0) + 1
                continue
            k = got["k"]
            assert k in (0, 1)
            assert same_bits(got["a"], np.full((256, 1024), k, np.float32)), (
                "a load mixed two checkpoints"
            )
            assert same_bits(got["b"], np.full((512,), k, np.int64)), "a load mixed two checkpoints"
            outcomes[f"whole {k}"] = outcomes.get(f"whole {k}", 0) + 1
        out, err = writer.communicate(timeout=120)
    finally:
        writer.kill()
    assert writer.returncode == 0, err
    overwrites = int(out.split("overwrites")[-1])
    assert overwrites >= 5 and outcomes.get("whole 0", 0) + outcomes.get("whole 1", 0) >= 3, (
        overwrites,
        outcomes,
    )


# ------------------------------------------------------------------------------------------
# A full file system
# ------------------------------------------------------------------------------------------


# How to get a mount of one's own, tried in order: a user and mount namespace (no privileges
# needed), a mount namespace (root where user namespaces are off), mounting here (root).
MOUNTERS: list[list[str]] = [
    ["unshare", "--user", "--map-root-user", "--mount"],
    ["unshare", "--mount"],
    [],
]


def save_onto_a_full_tmpfs(tmp_path: Path, asynchronous: bool) -> dict[str, Any]:
    """Run the full_disk scenario with the first way of mounting that works here; skip (saying
    why) only if none does."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    flag = "1" if asynchronous else "0"
    tried = []
    for prefix in MOUNTERS:
        if prefix and shutil.which(prefix[0]) is None:
            tried.append(f"{' '.join(prefix)}: no {prefix[0]} command")
            continue
        if not prefix and os.geteuid() != 0:
            tried.append("mount: not root")
            continue
        proc = subprocess.run(
            [*prefix, sys.executable, "-m", PROCS, "full_disk", str(mount), flag],
            cwd=_subproc.ROOT,
            env=_subproc.env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        lines = proc.stdout.splitlines()
        how = " ".join(prefix) or "mount as root"
        if "started" not in lines:  # the namespace could not be made
            tried.append(f"{how}: {proc.stderr.strip()}")
            continue
        assert proc.returncode == 0 and lines[-1].startswith("{"), (how, proc.stdout, proc.stderr)
        out: dict[str, Any] = json.loads(lines[-1])
        if not out["mounted"]:
            tried.append(f"{how}: {out['why']}")
            continue
        out["how"] = how
        return out
    pytest.skip("cannot mount a small tmpfs here in any way: " + "; ".join(tried))


@pytest.mark.parametrize("asynchronous", [False, True], ids=["save", "save_async"])
def test_a_full_disk_is_enospc_and_leaves_nothing(tmp_path: Path, asynchronous: bool) -> None:
    """A real full file system (a 4 MiB tmpfs, mounted without privileges in namespaces of the
    saving process's own where it can be): the save is an ENOSPC naming the path, leaves nothing
    and frees every byte it wrote."""
    out = save_onto_a_full_tmpfs(tmp_path, asynchronous)
    mount = str(tmp_path / "tmpfs")
    assert out["size"] == 4 << 20, out
    error = out["error"]
    assert error is not None, f"8 MiB were saved onto 4 MiB ({out['how']})"
    assert error["errno"] == errno.ENOSPC, error
    assert mount in error["message"], error
    assert out["left"] == [], out
    assert out["used"] == 0, f"the failed save's files still hold space: {out}"
    assert out["small"] == list(range(10)), out  # the space is free again
