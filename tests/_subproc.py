"""Running a Python snippet in a fresh process with N fake CPU devices."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


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
