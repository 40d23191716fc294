"""A save_async whose commit holds at a gate while the process exits, for
tests/test_exit_truth.py.

Run as a script: ``python -m tests._gated_exit PATH GATE TIMEOUT``. GATE: ``merge`` (before the
commit point: the writes have not all landed) or ``publish`` (after it: the commit marker is
written, the rename into place is next). It prints ``returned`` once save_async returned (with
``AsyncOptions(timeout_secs=TIMEOUT)``), then exits; at the gate it prints ``at the gate`` and
holds until a line comes on stdin.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

import milepost as mp
from milepost._storage import LocalWorkspace


def gate() -> None:
    print("at the gate", flush=True)
    sys.stdin.readline()  # the test opens it


def hold_at(gate_at: str) -> None:
    if gate_at == "merge":
        real_merge = mp.workers.format.merge_ocdbt

        def merge(directory: Any) -> None:
            gate()
            real_merge(directory)

        mp.workers.format.merge_ocdbt = merge
    else:
        real_publish = LocalWorkspace.publish

        def publish(self: Any) -> None:
            gate()
            real_publish(self)

        LocalWorkspace.publish = publish  # type: ignore[method-assign]


if __name__ == "__main__":
    path, gate_at, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
    hold_at(gate_at)
    with mp.Context(async_=mp.AsyncOptions(timeout_secs=timeout)):
        mp.save_async(path, {"x": np.arange(1000)})
    print("returned", flush=True)
