"""Resume bit-exactly after an interruption; SIGKILL at any point of a save never yields a
partial step."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from milepost.training import Checkpointer
from milepost.workers import format as fmt
from tests import _subproc, _train_loop

ROOT = Path(__file__).resolve().parents[1]


class Reference:
    """States of one uninterrupted run without checkpoints, as NumPy, step by step."""

    def __init__(self) -> None:
        mesh = jax.make_mesh((2, 4), ("data", "model"))
        self._state = _train_loop.initial_state(mesh)
        self._data = _train_loop.DataIterator()
        self._leaves: dict[int, list[np.ndarray]] = {0: self._snapshot()}

    def _snapshot(self) -> list[np.ndarray]:
        return [np.array(leaf) for leaf in jax.tree_util.tree_leaves(self._state)]

    def leaves(self, step: int) -> list[np.ndarray]:
        while self._state["step"] < step:
            self._state = _train_loop.train_step(self._state, self._data)
            self._leaves[self._state["step"]] = self._snapshot()
        return self._leaves[step]


@pytest.fixture(scope="module")
def reference() -> Reference:
    return Reference()


def assert_committed_steps_exact(root: Path, reference: Reference) -> int | None:
    """Open the root like a restarted job would; every visible step is committed and loads
    bit-exactly equal to the uninterrupted run at that step. Returns the latest step."""
    with Checkpointer(root) as ckpt:
        names = sorted(p.name for p in root.iterdir())
        assert names == sorted(str(s) for s in ckpt.steps), f"leftovers after start-up: {names}"
        mesh = jax.make_mesh((2, 4), ("data", "model"))
        abstract = _train_loop.abstract_like(_train_loop.initial_state(mesh))
        for step in ckpt.steps:
            assert (root / str(step) / fmt.COMMIT_MARKER).is_file()
            data = _train_loop.DataIterator()
            got = ckpt.load_checkpointables(step, {"state": abstract, "data": data})
            leaves = jax.tree_util.tree_leaves(got["state"])
            expected = reference.leaves(step)
            assert len(leaves) == len(expected)
            for a, b in zip(leaves, expected, strict=True):
                assert np.array_equal(np.asarray(a), b), f"step {step} is not bit-exact"
            assert data.position == step and got["state"]["step"] == step
        return ckpt.latest


def run_child(
    root: Path,
    steps: int,
    every: int = 1,
    kill_at: str | None = None,
    external_kill: tuple[int, float] | None = None,
) -> tuple[int, str | None]:
    """Run the training loop in a subprocess. ``kill_at`` is the child's own kill point;
    ``external_kill=(n, delay)`` SIGKILLs it from here ``delay`` s after its n-th save.
    Returns (returncode, final digest or None)."""
    cmd = [sys.executable, "-m", "tests._train_loop", str(root), str(steps), "--every", str(every)]
    if kill_at:
        cmd += ["--kill-at", kill_at]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=_subproc.env(8),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    digest = None
    saves = 0
    try:
        for line in proc.stdout:
            if line.startswith("done"):
                digest = line.split()[1]
            elif line.startswith("saved") and external_kill is not None:
                saves += 1
                if saves == external_kill[0]:
                    try:  # (a random moment after the save; a loop that ended is not killed)
                        proc.wait(external_kill[1])
                    except subprocess.TimeoutExpired:
                        proc.send_signal(signal.SIGKILL)
        code = proc.wait(120)
        if code not in (0, -signal.SIGKILL):
            raise AssertionError(f"training loop failed ({code}): {proc.stderr.read()[-3000:]}")
        return code, digest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(60)


def test_interrupted_run_resumes_bit_identical(tmp_path: Path) -> None:
    """In-process: interrupted after step 7 (saves at 3 and 6; the one after 6 never happens),
    resumed from 6 to 12: the same bits as 12 uninterrupted steps."""
    root = tmp_path / "r"
    with pytest.raises(KeyboardInterrupt):
        _train_loop.run(root, 12, every=3, interrupt_after=7)
    with Checkpointer(root) as ckpt:
        assert ckpt.steps == [3, 6]
    final = _train_loop.run(root, 12, every=3)
    assert _train_loop.digest(final) == _train_loop.digest(_train_loop.state_at(12))
    with Checkpointer(root) as ckpt:
        assert ckpt.steps == [9, 12]


@pytest.mark.parametrize("kill_at", ["merge:2:0", "renamed:2:0"])
def test_sigkill_during_save_then_resume(
    tmp_path: Path, kill_at: str, reference: Reference
) -> None:
    """Killed entering the merge of its 2nd save (step 2 is lost) or just after the rename
    that committed it (step 2 is kept); a restart resumes and ends bit-identical."""
    root = tmp_path / "r"
    code, _ = run_child(root, 1000, kill_at=kill_at)
    assert code == -signal.SIGKILL
    latest = assert_committed_steps_exact(root, reference)
    assert latest == (1 if kill_at.startswith("merge") else 2)
    code, digest = run_child(root, latest + 2)
    assert code == 0 and digest == _train_loop.digest(_train_loop.state_at(latest + 2))
    assert assert_committed_steps_exact(root, reference) == latest + 2


@pytest.mark.slow
def test_random_sigkills_across_save_phases(tmp_path: Path, reference: Reference) -> None:
    """28 SIGKILLs at random moments: 4 in each phase of a save (D2H, background write, merge,
    commit, just after the commit rename, mid-retention) at a random occurrence and delay, plus
    4 from outside at a random time after a save returned. After each, a restart sees only
    committed, bit-exact steps, and the latest step never goes back."""
    rng = random.Random(20261122)
    root = tmp_path / "r"
    plan: list[dict[str, Any]] = []
    for phase in _train_loop.PHASES:
        for _ in range(4):
            delay = (
                0.0 if phase in ("renamed", "gc") or rng.random() < 0.3 else rng.uniform(0.0, 0.02)
            )
            plan.append({"phase": phase, "nth": rng.randint(1, 3), "delay": delay})
    rng.shuffle(plan)
    latest_seen: list[int | None] = []
    for kill in plan:
        if kill["phase"] == "saved":
            code, _ = run_child(root, 1000, external_kill=(kill["nth"], rng.uniform(0.0, 0.3)))
        else:
            code, _ = run_child(
                root, 1000, kill_at=f"{kill['phase']}:{kill['nth']}:{kill['delay']}"
            )
        assert code == -signal.SIGKILL, f"{kill} did not kill the loop"
        latest = assert_committed_steps_exact(root, reference)
        if latest_seen and latest_seen[-1] is not None:
            assert latest is not None and latest >= latest_seen[-1], (
                f"{kill}: latest went back to {latest}"
            )
        latest_seen.append(latest)
    assert latest_seen[-1] is not None and latest_seen[-1] >= 10
    end = latest_seen[-1] + 2
    code, digest = run_child(root, end)
    assert code == 0 and digest == _train_loop.digest(_train_loop.state_at(end))
