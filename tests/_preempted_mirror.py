"""A training loop preempted (SIGTERM) that is killed while its Checkpointer mirrors the
preemption save from the local tier to the durable root, for tests/test_local_tier.py.

Run as a script: ``python -m tests._preempted_mirror ROOT LOCAL``. It prints ``ready``, then
``saved <step>`` after the preemption save, and ``mirroring`` once the hosts' files are copied
to ROOT (the controller's part of the mirror then holds until the process is killed).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost import workers
from milepost.training import Checkpointer, Preemption


def hold_the_controllers_copy() -> None:
    """The mirror's copy job holds on the controller (the hosts' files are copied: the root
    holds part of the step) after saying ``mirroring``."""
    real = workers.JOBS["copy_files"]

    def stuck(plan: Any, process_index: int | str) -> Any:
        if process_index == "controller":
            print("mirroring", flush=True)
            threading.Event().wait(600)
        return real(plan, process_index)

    workers.JOBS["copy_files"] = stuck


def state(k: int) -> dict[str, Any]:
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    rng = np.random.default_rng(k)
    return {
        "w": jax.device_put(
            rng.standard_normal((64, 128), dtype=np.float32),
            NamedSharding(mesh, P("data", "model")),
        ),
        "b": jax.device_put(np.arange(128, dtype=np.float32) + k, NamedSharding(mesh, P())),
        "host": np.arange(300) * (k + 1),
        "step": k,
    }


def main(root: str, local: str) -> None:
    hold_the_controllers_copy()
    with mp.Context(saving=mp.SaveOptions(lease_secs=2.0)):
        ckpt = Checkpointer(root, local=local, save_policy=Preemption())
        print("ready", flush=True)
        for step in range(10_000):
            if ckpt.should_save(step):
                ckpt.save(step, state(step))
                print("saved", step, flush=True)
            if ckpt.preempted:
                ckpt.close()  # waits for the mirror "if time allows": it is killed first
                break
            time.sleep(0.01)  # (a training step)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
