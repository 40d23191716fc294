"""Running a Python snippet, or a module of tests/, in a fresh process with N fake CPU
devices."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def env(devices: int = 8) -> dict[str, str]:
    e = dict(os.environ)
    e["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    e["JAX_PLATFORMS"] = "cpu"
    e["PYTHONUNBUFFERED"] = "1"
    return e


def popen(code: str, devices: int = 8, **kwargs: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env(devices),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,  # type: ignore[arg-type]
    )


def popen_module(
    module: str, *args: str, devices: int = 8, **kwargs: object
) -> subprocess.Popen[str]:
    """``python -m <module> <args>`` (a module of tests/, e.g. ``tests._atomic_saver``) from the
    repository's root, its output piped as text."""
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=env(devices),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,  # type: ignore[arg-type]
    )


class Lines:
    """The lines a child process prints, read by a thread of the test's own so that every wait
    for one is bounded: ``next(timeout)`` fails the test (with what the child wrote to stderr)
    instead of hanging when the child stops printing."""

    def __init__(self, child: subprocess.Popen[str]) -> None:
        import queue
        import threading

        assert child.stdout is not None
        self._child = child
        self._lines: queue.Queue[str | None] = queue.Queue()
        stdout = child.stdout

        def pump() -> None:
            for line in stdout:
                self._lines.put(line.rstrip("\n"))
            self._lines.put(None)

        threading.Thread(target=pump, daemon=True, name="test-child-stdout").start()

    def next(self, timeout: float) -> str:
        import queue

        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the child printed no line within {timeout} s") from None
        if line is None:
            code = self._child.wait(30)
            err = self._child.stderr.read() if self._child.stderr is not None else ""
            raise AssertionError(f"the child ended (exit {code}) without a line: {err[-3000:]}")
        return line
