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


MEMORY_PROBES = r"""
def hwm():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))

def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))
"""
"""For snippets that measure their own memory: ``hwm()`` (the peak resident set, which writing
5 to ``/proc/self/clear_refs`` resets) and ``rss()`` (the resident set now), in bytes."""
