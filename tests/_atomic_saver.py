"""A saver in a fresh process with 8 fake devices, for tests/test_atomic.py: it holds (waits)
at the named point of the save after printing it, so the kill lands exactly there; 'staged' and
'ready' need no hook.

Run as a script: ``python -m tests._atomic_saver PATH POINT MODE OVERWRITE`` (MODE: sync or
async; OVERWRITE: True or False). Prints ``ready``, the point, and ``committed`` if it is not
killed.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost._storage import _workspace
from milepost.workers import format as _format


def hold(tag: str) -> None:
    """Say ``tag`` and wait there until killed."""
    print(tag, flush=True)
    threading.Event().wait(600)


def hook(point: str) -> None:
    """Make the save hold at ``point``."""
    if point == "writing":  # the shards are staged, the writes issued, nothing waited for yet

        def wait(self: Any, timeout: float | None = None) -> None:
            hold("writing")

        mp.workers.PendingSave.wait = wait
    elif point == "metadata":  # every byte written, no tree metadata yet

        def write_metadata(directory: Any, files: Any, acks: Any, platform: Any) -> None:
            hold("metadata")

        _format.write_tree = write_metadata
    elif point == "merged":  # tree metadata written and the OCDBT stores merged
        real_merge = mp.workers.format.merge_ocdbt

        def merge(directory: Any) -> None:
            real_merge(directory)
            hold("merged")

        mp.workers.format.merge_ocdbt = merge
    elif point == "commit-marker":  # the commit marker is durable in the temporary directory
        real_fsync_tree = _format.fsync_tree

        def fsync_tree(root: Any) -> None:
            real_fsync_tree(root)
            hold("commit-marker")

        _format.fsync_tree = fsync_tree
    elif point == "swapped":  # overwrite: the new checkpoint is in place, the old not yet removed
        real_exchange, real_rename = _workspace.exchange, os.rename

        def exchange(a: Any, b: Any) -> bool:
            ok = real_exchange(a, b)
            if ok:
                hold("swapped")
            return ok

        def rename(a: Any, b: Any) -> None:
            real_rename(a, b)
            if ".milepost-replaced-" in str(b):
                hold("swapped")

        _workspace.exchange = exchange
        os.rename = rename  # type: ignore[assignment]


def tree() -> dict[str, Any]:
    """16 x 16 MiB of sharded layers, a step, 8 MiB of NumPy."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {
        f"layer{i}": {
            "w": jax.device_put(
                rng.standard_normal((2048, 2048), dtype=np.float32),
                NamedSharding(mesh, P("data", "model")),
            ),
            "b": jax.device_put(
                rng.standard_normal((2048,), dtype=np.float32), NamedSharding(mesh, P())
            ),
        }
        for i in range(16)
    }
    out["step"] = 7
    out["host"] = rng.standard_normal((1 << 20,))
    return out


def main(path: str, point: str, mode: str, overwrite: bool) -> None:
    hook(point)
    state = tree()
    print("ready", flush=True)
    if mode == "async":
        handle = mp.save_async(path, state, overwrite=overwrite)
        print("staged", flush=True)
        handle.result()
    else:
        mp.save(path, state, overwrite=overwrite)
    print("committed", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "True")
