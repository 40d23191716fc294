"""Shared benchmark helpers: data, page-cache eviction, peak-RSS sampling, subprocess workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil


def evict(path: str | Path) -> None:
    """Drop ``path``'s files from the page cache so the next read is cold."""
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _vm_hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmHWM in /proc/self/status")


class PeakRss:
    """Peak RSS of this process during a block, from the kernel's high-water mark.

    Entering resets the mark (``echo 5 > /proc/self/clear_refs``), so the reading costs nothing
    while the measured code runs (a sampling thread slowed page-faulting code several-fold).
    """

    def __init__(self) -> None:
        self.process = psutil.Process()
        self.baseline = 0
        self.peak = 0

    def __enter__(self) -> PeakRss:
        self.baseline = self.process.memory_info().rss
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return self

    def __exit__(self, *exc: object) -> None:
        self.peak = max(_vm_hwm(), self.process.memory_info().rss)

    @property
    def growth(self) -> int:
        return self.peak - self.baseline


@contextmanager
def timer(out: dict[str, float], key: str) -> Iterator[None]:
    t0 = time.perf_counter()
    yield
    out[key] = time.perf_counter() - t0


def run_worker(script: str, args: list[str], devices: int = 8, timeout: float = 1800) -> dict:
    """Run ``script --worker ...`` in a fresh process; it prints one JSON line last."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, script, *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise RuntimeError(f"worker {args} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2
