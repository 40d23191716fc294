"""A process that exits while a background save or load is in flight, for
tests/test_background.py and tests/test_load_async.py.

Run as a script: ``python -m tests._exit_in_flight <scenario> PATH``; it prints ``returned``
once the call returned, then exits:

- ``save-wait``: a save_async (timeout 60 s) whose merge waits until the interpreter has begun
  to exit (an atexit hook of its own, which runs before milepost's), then goes on: the exit
  waits for it, and it commits.
- ``save-hang``: a save_async (timeout 2 s) whose merge never ends: the exit abandons it.
- ``load``: a load_async (timeout 1 s) whose read waits until the exit said it abandoned it.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
from typing import Any

import jax.numpy as jnp
import numpy as np

import milepost as mp


def save(path: str, hang: bool) -> None:
    exiting = threading.Event()
    real = mp.workers.format.merge_ocdbt

    def merge(directory: Any) -> None:
        if hang:
            threading.Event().wait(600)
        assert exiting.wait(60), "the interpreter never began to exit"
        real(directory)

    mp.workers.format.merge_ocdbt = merge
    with mp.Context(async_=mp.AsyncOptions(timeout_secs=2 if hang else 60)):
        # host and device data
        mp.save_async(path, {"x": np.arange(1000), "y": jnp.arange(1 << 20, dtype=jnp.int32)})
    atexit.register(exiting.set)  # (after milepost's exit hook: run before it)
    print("returned", flush=True)


def load(path: str) -> None:
    mp.save(path, {"x": np.arange(10)})
    abandoned = threading.Event()

    class Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "abandoned the load of" in record.getMessage():
                abandoned.set()  # the exit gave up on the load: let its read end

    logging.basicConfig(level=logging.WARNING)  # to stderr
    logging.getLogger("milepost").addHandler(Watch())
    real = mp.workers.load

    def gated(plan: Any, *args: Any, **kwargs: Any) -> Any:
        assert abandoned.wait(120)
        return real(plan, *args, **kwargs)

    mp.workers.load = gated
    with mp.Context(async_=mp.AsyncOptions(timeout_secs=1)):
        mp.load_async(path)
    print("returned", flush=True)


if __name__ == "__main__":
    scenario, where = sys.argv[1], sys.argv[2]
    if scenario == "load":
        load(where)
    else:
        save(where, hang=scenario == "save-hang")
