"""Peak memory of a surgery and of budgeted saves, each measured in a fresh process with 8 fake
devices, for tests/test_surgery.py and tests/test_staging_budget.py.

Run as a script: ``python -m tests._memory_peaks <scenario> ROOT``; it prints one JSON line:

- ``surgery``: ``{"growth": bytes}``, the peak resident set's growth while a 256 MiB checkpoint
  is cast to bfloat16 under a 64 MiB memory budget (the output in ``ROOT/big-out``).
- ``staging``: ``{"capped": bytes, "uncapped": bytes}``, the peak growth while ``save_async``
  saves 256 MiB with a 64 MiB host staging budget, and with none.
"""

from __future__ import annotations

import gc
import json
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import milepost as mp


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def hwm() -> int:
    """The peak resident set, in bytes (since the last :func:`reset_peak`)."""
    return _status("VmHWM:")


def rss() -> int:
    """The resident set now, in bytes."""
    return _status("VmRSS:")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def surgery(root: str) -> dict[str, Any]:
    from milepost import surgery as ms

    sharding = NamedSharding(jax.make_mesh((2, 4), ("data", "model")), P("data", "model"))
    # 8 leaves of 32 KiB, then of 32 MiB (256 MiB in all)
    for name, rows in (("small", 64), ("big", 2048)):
        mp.save(
            f"{root}/{name}",
            {
                f"w{i}": jax.device_put(jnp.full((rows, 4096), i, jnp.float32), sharding)
                for i in range(8)
            },
        )
    jax.clear_caches()
    budget = 64 << 20
    ms.write(  # warm
        f"{root}/small-out",
        ms.cast(ms.open(f"{root}/small").tree, jnp.bfloat16),
        memory_budget_bytes=budget,
    )
    gc.collect()
    base = rss()
    reset_peak()
    ms.write(
        f"{root}/big-out",
        ms.cast(ms.open(f"{root}/big").tree, jnp.bfloat16),
        memory_budget_bytes=budget,
    )
    return {"growth": hwm() - base}


def staging(root: str) -> dict[str, Any]:
    from milepost.workers.save import _staging

    sharding = NamedSharding(jax.make_mesh((2, 4), ("data", "model")), P("data", "model"))
    rng = np.random.default_rng(0)
    tree = {  # 256 MiB
        f"w{i}": jax.device_put(rng.standard_normal((2048, 4096), dtype=np.float32), sharding)
        for i in range(8)
    }
    mp.save_async(
        f"{root}/warm", {"x": jax.device_put(np.ones((64, 64), np.float32), sharding)}
    ).result()
    out = {}
    for name, budget in (("capped", 64 << 20), ("uncapped", None)):
        _staging.POOL.clear()
        gc.collect()
        base = rss()
        reset_peak()
        with mp.Context(saving=mp.SaveOptions(host_staging_budget_bytes=budget)):
            mp.save_async(f"{root}/{name}", tree).result()
        out[name] = hwm() - base
    return out


if __name__ == "__main__":
    scenario = {"surgery": surgery, "staging": staging}[sys.argv[1]]
    print(json.dumps(scenario(sys.argv[2])))
