"""Launching a multi-controller JAX job on localhost: N processes, each with its own devices."""

from __future__ import annotations

import json
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy)
import numpy as np

from tests import _subproc, _without_ray

ROOT = Path(__file__).resolve().parents[1]

SHAPES = {"w": ((16, 32), "float32"), "b": ((32,), "bfloat16"), "r": ((8, 8), "int32")}
"""The arrays every multi-controller test tree holds: name -> (shape, dtype)."""


def global_value(name: str, shape: tuple[int, ...], dtype: str = "float32") -> np.ndarray:
    seed = sum(name.encode())
    return (np.random.default_rng(seed).standard_normal(shape) * 100).astype(dtype)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Result:
    returncode: int
    out: dict
    stderr: str


def launch(
    scenario: str,
    processes: int,
    devices: int,
    *args: str,
    timeout: float = 240,
    module: str = "tests._mc_worker",
) -> list[Result]:
    """Run ``python -m module scenario INDEX COUNT PORT *args`` in ``processes`` processes on
    localhost; each prints a JSON line last. Ray is absent from them (multi-controller jobs do
    not need it: ``tests/_without_ray.py``)."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                *_without_ray.module_command(module),
                *(scenario, str(i), str(processes), str(port), *args),
            ],
            cwd=ROOT,
            env=_subproc.env(devices),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(processes)
    ]
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        lines = [line for line in out.splitlines() if line.startswith("{")]
        results.append(Result(p.returncode, json.loads(lines[-1]) if lines else {}, err[-3000:]))
    return results
