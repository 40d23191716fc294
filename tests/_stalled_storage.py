"""Saves and loads whose storage stalls, each in a fresh process with its own storage policy
(silence_secs=2, one retry), for tests/test_storage_faults.py (which runs a faulty proxy in
front of S3).

Run as a script: ``python -m tests._stalled_storage <scenario> <args...>``:

- ``save URL TIMEOUT``: a save with ``AsyncOptions(timeout_secs=TIMEOUT)``; one JSON line: the
  error (``TimeoutError`` or its repr), message and notes, how long it took, how long until
  the failed save was cleaned up, and the storage policy's budget.
- ``load URL``: a load; one JSON line: the error, message, how long it took, the budget.
- ``loop URL``: a Checkpointer saving steps 0-2; one JSON line of the steps whose save failed
  (with the cause's type) and the steps kept. Then, once a line comes on stdin, another run
  saves step 3 and prints the steps kept.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np

import milepost as mp


def configure() -> None:
    mp.configure_storage(
        mp.StorageOptions(
            silence_secs=2, max_retries=1, retry_delay_secs=0.2, retry_max_delay_secs=0.2
        )
    )


def save(url: str, timeout: float) -> dict[str, Any]:
    start = time.monotonic()
    out: dict[str, Any]
    try:
        with mp.Context(async_=mp.AsyncOptions(timeout_secs=timeout)):
            mp.save(url, {"x": np.arange(1000.0), "y": np.ones(10, np.int32)})
        out = {"error": None}
    except Exception as e:
        error = "TimeoutError" if isinstance(e, TimeoutError) else repr(e)
        out = {"error": error, "message": str(e), "notes": getattr(e, "__notes__", [])}
    out["secs"] = time.monotonic() - start
    mp.wait_for_saves()  # the failed save's cleanup, once its writes stopped
    out["cleaned_secs"] = time.monotonic() - start
    out["budget"] = mp.workers.storage_budget_secs()
    return out


def load(url: str) -> dict[str, Any]:
    start = time.monotonic()
    out: dict[str, Any]
    try:
        mp.load(url)
        out = {"error": None}
    except Exception as e:
        out = {"error": type(e).__name__, "message": str(e)}
    out["secs"] = time.monotonic() - start
    out["budget"] = mp.workers.storage_budget_secs()
    return out


def loop(url: str) -> dict[str, Any]:
    from milepost.training import BackgroundSaveError, Checkpointer, KeepLatest

    out: dict[Any, Any] = {}
    with Checkpointer(url, keep=KeepLatest(n=2)) as ckpt:
        for step in range(3):
            try:
                ckpt.save(step, {"x": np.arange(1000.0) + step}, force=True)
                ckpt.wait()
            except BackgroundSaveError as e:
                out[step] = type(e.__cause__).__name__
        out["steps"] = ckpt.steps
    print(json.dumps(out), flush=True)
    sys.stdin.readline()  # the test releases the stalled writes, then lets this go on
    with Checkpointer(url, keep=KeepLatest(n=2)) as ckpt:
        ckpt.save(3, {"x": np.arange(1000.0) + 3}, force=True)
        ckpt.wait()
        return {"steps": ckpt.steps}


if __name__ == "__main__":
    configure()
    scenario, args = sys.argv[1], sys.argv[2:]
    if scenario == "save":
        print(json.dumps(save(args[0], float(args[1]))))
    elif scenario == "load":
        print(json.dumps(load(args[0])))
    elif scenario == "loop":
        print(json.dumps(loop(args[0])))
    else:
        sys.exit(f"no scenario {scenario!r}")
