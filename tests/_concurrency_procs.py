"""The other processes of tests/test_concurrency.py: writers racing for one path (or waiting
for it), a training loop, an overwriter, a save onto a full file system.

Run as a script: ``python -m tests._concurrency_procs <scenario> <args...>``:

- ``writer ME ROUNDS ROOT OVERWRITE``: for each round, say ``ready <r>``, wait for the file
  ``ROOT/go<r>``, save its own tree to ``ROOT/c<r>``, print ``outcome`` and [round, outcome].
- ``waiting_writer PATH``: an overwrite of PATH that waits for the writer holding it
  (``wait_for_writer_secs=60``); prints ``waiting`` when it finds that writer's temporary
  directory locked, then ``saved``.
- ``trainer ROOT``: a Checkpointer saving steps 0-9, then ``trained <steps>``.
- ``overwriter PATH SECONDS``: saves PATH, says ``ready``, overwrites it with one of two trees
  in turn for SECONDS, then prints ``overwrites <n>``.
- ``full_disk MOUNT ASYNC``: mounts a 4 MiB tmpfs at MOUNT (in the mount namespace it runs in),
  prints ``started``, then one JSON line: what an 8 MiB save raised, what it left, the space
  used afterwards, and whether a small save fits again.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

import numpy as np


def writer(me: int, rounds: int, root: str, overwrite: bool) -> None:
    import milepost as mp

    tree: dict[str, Any] = {
        f"w{i}": np.full((256, 1024), me * 1000 + i, np.float32) for i in range(8)
    }  # 8 MiB
    tree["who"] = f"writer{me}"
    for r in range(rounds):
        print(f"ready {r}", flush=True)
        go = os.path.join(root, f"go{r}")
        while not os.path.exists(go):  # (both writers start at once: a busy wait)
            time.sleep(0.001)
        try:
            mp.save(os.path.join(root, f"c{r}"), tree, overwrite=overwrite)
            outcome = "committed"
        except mp.CheckpointExistsError as e:
            outcome = "exists: " + str(e)
        except Exception as e:
            outcome = f"error: {type(e).__name__}: {e}"
        print("outcome " + json.dumps([r, outcome]), flush=True)


def waiting_writer(path: str) -> None:
    import milepost as mp
    from milepost._storage import _ownership

    real_try_lock = _ownership.try_lock

    def try_lock(directory: Any) -> Any:
        got = real_try_lock(directory)
        if got is None and directory.exists():
            print("waiting", flush=True)
        return got

    _ownership.try_lock = try_lock
    with mp.Context(saving=mp.SaveOptions(wait_for_writer_secs=60)):
        mp.save(path, {"x": np.arange(5)}, overwrite=True)
    print("saved", flush=True)


def trainer(root: str) -> None:
    from milepost.training import Checkpointer

    with Checkpointer(root) as ckpt:
        for step in range(10):
            ckpt.save(step, {"w": np.full((512, 1024), step, np.float32), "step": step})
            time.sleep(0.05)  # (a training step)
        ckpt.wait()
    print("trained", ckpt.steps, flush=True)


def overwriter(path: str, seconds: float) -> None:
    import milepost as mp

    trees = [
        {"a": np.full((256, 1024), k, np.float32), "b": np.full((512,), k, np.int64), "k": k}
        for k in (0, 1)
    ]
    mp.save(path, trees[0])
    print("ready", flush=True)
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        n += 1
        mp.save(path, trees[n % 2], overwrite=True)
    print("overwrites", n, flush=True)


def full_disk(mount: str, asynchronous: bool) -> None:
    print("started", flush=True)
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", mount], capture_output=True, text=True
    )
    if proc.returncode != 0:
        print(json.dumps({"mounted": False, "why": proc.stderr.strip()}), flush=True)
        return
    try:
        print(json.dumps(_fill(mount, asynchronous)), flush=True)
    finally:
        subprocess.run(["umount", "-l", mount], capture_output=True)


def _fill(mount: str, asynchronous: bool) -> dict[str, Any]:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import milepost as mp

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    x = jax.device_put(np.ones((1024, 2048), np.float32), NamedSharding(mesh, P("data", "model")))
    out: dict[str, Any] = {"mounted": True, "size": shutil.disk_usage(mount).total, "error": None}
    try:  # 8 MiB onto 4 MiB
        if asynchronous:
            mp.save_async(os.path.join(mount, "c"), {"x": x}).result(120)
        else:
            mp.save(os.path.join(mount, "c"), {"x": x})
    except OSError as e:
        out["error"] = {"type": type(e).__name__, "errno": e.errno, "message": str(e)}
    out["left"] = sorted(
        os.path.relpath(os.path.join(d, n), mount) for d, ds, fs in os.walk(mount) for n in ds + fs
    )
    out["used"] = shutil.disk_usage(mount).used
    mp.save(os.path.join(mount, "small"), {"x": np.arange(10)})
    out["small"] = mp.load(os.path.join(mount, "small"))["x"].tolist()
    return out


if __name__ == "__main__":
    scenario, args = sys.argv[1], sys.argv[2:]
    if scenario == "writer":
        writer(int(args[0]), int(args[1]), args[2], args[3] == "1")
    elif scenario == "waiting_writer":
        waiting_writer(args[0])
    elif scenario == "trainer":
        trainer(args[0])
    elif scenario == "overwriter":
        overwriter(args[0], float(args[1]))
    elif scenario == "full_disk":
        full_disk(args[0], args[1] == "1")
    else:
        sys.exit(f"no scenario {scenario!r}")
