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
