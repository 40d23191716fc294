"""Shared benchmark helpers: data, page-cache eviction, peak-RSS sampling, subprocess workers.

Imports nothing beyond NumPy at the top: accelerator_bench.py runs on a machine image without
psutil."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np


def evict(path: str | Path) -> None:
    """Drop ``path``'s files (a folder's, or the one file) from the page cache so the next read
    is cold."""
    paths = (
        [str(path)]
        if os.path.isfile(path)
        else [os.path.join(root, f) for root, _, files in os.walk(path) for f in files]
    )
    for file in paths:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 3 + [ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_PROT_READ, _MAP_SHARED, _MAP_FAILED = 1, 1, ctypes.c_void_p(-1).value


def resident_bytes(file: str) -> int:
    """How many bytes of ``file`` are in the page cache (mincore over a read-only mapping)."""
    size = os.path.getsize(file)
    if size == 0:
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    fd = os.open(file, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap {file}")
        try:
            vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {file}")
            return int((np.frombuffer(vec, np.uint8) & 1).sum()) * page
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def make_cold(path: str | Path) -> dict[str, int | bool]:
    """Evict ``path``'s files (a folder's, or the one file) from the page cache, and with root
    drop the caches too; report how many of their bytes stay cached."""
    path = str(path)
    if os.path.isfile(path):
        files = [path]
    else:
        files = [os.path.join(root, f) for root, _, names in os.walk(path) for f in names]
    evict(path)
    try:  # needs root; the fadvise is what we rely on
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
        dropped = True
    except OSError:
        dropped = False
    return {
        "files": len(files),
        "file_bytes": sum(os.path.getsize(f) for f in files),
        "cached_bytes_after_evict": sum(resident_bytes(f) for f in files),
        "drop_caches": dropped,
    }


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
        import psutil

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
