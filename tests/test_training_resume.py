"""Resume bit-exactly after an interruption; SIGKILL at random points never yields a partial step."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from milepost.training import Checkpointer
from tests import _subproc, _train_loop

ROOT = Path(__file__).resolve().parents[1]


def run_loop(root: Path, steps: int, every: int, kill_after_saves: int | None = None, kill_delay: float = 0.0) -> str | None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests._train_loop", str(root), str(steps), "--every", str(every)],
        cwd=ROOT, env=_subproc.env(8), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None
    saves = 0
    try:
        for line in proc.stdout:
            if line.startswith("done"):
                proc.wait(60)
                return line.split()[1]
            if line.startswith("saved"):
                saves += 1
                if kill_after_saves is not None and saves >= kill_after_saves:
                    time.sleep(kill_delay)
                    proc.send_signal(signal.SIGKILL)
                    proc.wait(60)
                    return None
        raise AssertionError(f"training loop failed: {proc.stderr.read() if proc.stderr else ''}")
    finally:
        proc.kill()
        proc.wait(60)


def check_latest_is_exact(root: Path) -> int | None:
    """The latest committed step loads bit-exactly equal to an uninterrupted run's state."""
    with Checkpointer(root) as ckpt:
        latest = ckpt.latest
        if latest is None:
            return None
        expected = _train_loop.state_at(latest)
        data = _train_loop.DataIterator()
        got = ckpt.load_checkpointables(None, {"state": _train_loop.abstract_like(expected), "data": data})
    for a, b in zip(jax.tree_util.tree_leaves(got["state"]), jax.tree_util.tree_leaves(expected), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b)), f"step {latest} is not bit-exact"
    assert data.position == latest
    return latest


def test_interrupted_run_resumes_bit_identical(tmp_path: Path) -> None:
    reference = _train_loop.digest(_train_loop.state_at(12))
    # killed after its second save, then resumed to the end
    assert run_loop(tmp_path / "r", 12, every=3, kill_after_saves=2) is None
    assert check_latest_is_exact(tmp_path / "r") in (3, 6)
    assert run_loop(tmp_path / "r", 12, every=3) == reference


@pytest.mark.parametrize("delay", [0.0, 0.3])
def test_kill_during_save_restarts_from_committed_step(tmp_path: Path, delay: float) -> None:
    run_loop(tmp_path / "r", 30, every=1, kill_after_saves=3, kill_delay=delay)
    latest = check_latest_is_exact(tmp_path / "r")
    assert latest is None or latest <= 30


@pytest.mark.slow
def test_twenty_random_kill_points(tmp_path: Path) -> None:
    rng = random.Random(1234)
    root = tmp_path / "r"
    resumed_from: list[int | None] = []
    for _ in range(20):
        run_loop(root, 10_000, every=1, kill_after_saves=rng.randint(1, 4), kill_delay=rng.uniform(0.0, 0.5))
        resumed_from.append(check_latest_is_exact(root))
        # nothing but committed steps is left visible
        with Checkpointer(root) as ckpt:
            assert all((root / str(s) / "commit_success.txt").exists() for s in ckpt.steps)
    assert any(s is not None for s in resumed_from)
    assert resumed_from == sorted(resumed_from, key=lambda s: -1 if s is None else s)
