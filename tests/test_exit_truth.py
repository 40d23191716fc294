"""An interpreter exit that stops waiting for a save in flight (Ctrl-C, or the save's timeout
running out) logs what became of it, and the disk agrees: committed (the marker there, the
checkpoint sound) or abandoned (nothing at the path, no temporary directory left).

Each test runs a real process whose save is held at a gate the test opens through the
process's stdin: before the commit point (the OCDBT merge) or after it (the rename into place).
The test sends SIGINT once the process says it waits for the save at exit and the save is at
the gate, and opens the gate once the exit has logged its answer to the interrupt."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest

import milepost as mp
from tests import _subproc
from tests._helpers import listing, same_bits

LIMIT = 120.0
"""The longest the test waits for the next line of the process (it never takes that long)."""


class Child:
    """The process, its output read line by line from both pipes as it comes."""

    def __init__(self, path: Path, gate_at: str, timeout: float) -> None:
        self.proc = _subproc.popen_module(
            "tests._gated_exit", str(path), gate_at, repr(timeout), stdin=subprocess.PIPE
        )
        self.lines: queue.Queue[tuple[str, str | None]] = queue.Queue()
        self.seen: dict[str, list[str]] = {"out": [], "err": []}
        self.read = {"out": 0, "err": 0}
        """How many lines of each stream :meth:`until` has looked at."""
        self.open_streams = 2
        for name, stream in (("out", self.proc.stdout), ("err", self.proc.stderr)):
            threading.Thread(target=self._pump, args=(name, stream), daemon=True).start()

    def _pump(self, name: str, stream: Iterable[str]) -> None:
        for line in stream:
            self.lines.put((name, line))
        self.lines.put((name, None))

    def _next(self) -> bool:
        """Take the next line of either stream; False once both ended."""
        while self.open_streams:
            name, line = self.lines.get(timeout=LIMIT)
            if line is None:
                self.open_streams -= 1
                continue
            self.seen[name].append(line)
            return True
        return False

    def until(self, stream: str, text: str) -> str:
        """The next line of ``stream`` (after those returned before) that holds ``text``."""
        while True:
            lines = self.seen[stream]
            while self.read[stream] < len(lines):
                line = lines[self.read[stream]]
                self.read[stream] += 1
                if text in line:
                    return line
            if not self._next():
                err = "".join(self.seen["err"])
                raise AssertionError(f"the process ended before {text!r}:\n{err}")

    def open_gate(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.close()

    def end(self) -> tuple[int, str]:
        rc = self.proc.wait(timeout=LIMIT)
        while self._next():
            pass
        return rc, "".join(self.seen["err"])


def held_at_exit(tmp_path: Path, gate_at: str, timeout: float) -> Child:
    """The process, exiting, waiting for its save, which is held at the gate."""
    child = Child(tmp_path / "c", gate_at, timeout)
    child.until("out", "at the gate")
    child.until("err", "waiting")  # the exit waits for the save
    return child


def answer(child: Child, path: Path) -> str:
    """The exit's first line about the save after it stopped waiting for it."""
    return child.until("err", f"{path}")


def assert_committed(path: Path) -> None:
    assert (path / "commit_success.txt").exists()
    assert mp.verify(path).ok
    assert same_bits(mp.load(path)["x"], np.arange(1000))
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary directory


@pytest.mark.parametrize("stop", ["ctrl-c", "timeout"])
def test_a_save_whose_commit_is_under_way_is_waited_for_and_said_committed(
    tmp_path: Path, stop: str
) -> None:
    # Ctrl-C: a long timeout the test never reaches; timeout: a short one that runs out while
    # the save is held past its commit point.
    child = held_at_exit(tmp_path, "publish", 60.0 if stop == "ctrl-c" else 3.0)
    if stop == "ctrl-c":
        os.kill(child.proc.pid, signal.SIGINT)
    path = tmp_path / "c"
    said = answer(child, path)
    child.open_gate()
    rc, err = child.end()
    assert rc == 0, err
    assert "commit marker is being written" in said, err
    assert f"committed the save to {path} before the interpreter exited" in err, err
    assert "abandoned" not in err and "failed" not in err, err
    assert_committed(path)


def test_ctrl_c_abandons_a_save_before_its_commit(tmp_path: Path) -> None:
    child = held_at_exit(tmp_path, "merge", 60.0)
    os.kill(child.proc.pid, signal.SIGINT)
    path = tmp_path / "c"
    said = answer(child, path)
    # The save goes on once the gate opens, up to its commit point, where it stops.
    child.open_gate()
    rc, err = child.end()
    assert rc == 0, err
    assert listing(tmp_path) == [], err  # no checkpoint, no temporary directory
    assert f"abandoned the save to {path}: the exit was interrupted (Ctrl-C)" in said, err
    assert "nothing of it was committed" in said, err
    assert "committed the save" not in err, err


def test_a_second_ctrl_c_leaves_the_outcome_to_verify(tmp_path: Path) -> None:
    """Ctrl-C twice while the commit is under way: the exit stops waiting for it, and says it
    does not know the outcome (the save is past its commit point, so it may commit); once
    milepost's threads ended (the gate opened meanwhile), it says the save committed."""
    child = held_at_exit(tmp_path, "publish", 60.0)
    path = tmp_path / "c"
    os.kill(child.proc.pid, signal.SIGINT)
    assert "commit marker is being written" in answer(child, path)
    os.kill(child.proc.pid, signal.SIGINT)
    said = child.until("err", "outcome")
    child.open_gate()
    rc, err = child.end()
    assert rc == 0, err
    assert "before the outcome of the save to" in said and "may or may not be committed" in said
    assert f"milepost verify {path}" in said, err
    # The exit still lets milepost's threads end: the commit, let go, finished, and says so.
    assert f"committed the save to {path} after all, as milepost's threads ended" in err, err
    assert_committed(path)
