"""The embedded mode, the Checkpointer and the command run as on a machine without Ray, for
tests/test_without_ray.py.

Run as a script: ``python -m tests._embedded_without_ray ROOT``. It hides ``ray`` and
``cloudpickle`` first (``tests/_without_ray.py``), then saves, loads, checkpoints and verifies
under ROOT, asks for a slice, and prints one JSON line of what it found.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from tests import _without_ray


def main(root: str) -> dict[str, Any]:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import milepost as mp
    from milepost import _cli
    from milepost.training import Checkpointer, KeepLatest

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    w = jax.device_put(
        np.arange(64 * 32, dtype=np.float32).reshape(64, 32),
        NamedSharding(mesh, P("data", "model")),
    )
    state = {"w": w, "step": 3, "note": "no ray"}
    out: dict[str, Any] = {}
    mp.save_async(root + "/a", state).result()
    back = mp.load(root + "/a")
    out["embedded"] = (
        bool(np.array_equal(np.asarray(back["w"]), np.asarray(w))) and back["step"] == 3
    )
    with Checkpointer(root + "/run", keep=KeepLatest(n=1)) as ckpt:
        for step in (1, 2):
            ckpt.save(step, state)
        ckpt.wait()
        again = ckpt.load()
        out["checkpointer"] = [ckpt.steps, bool(np.array_equal(np.asarray(again["w"]), w))]
    out["verify"] = _cli.main(["verify", root + "/a"])
    try:
        mp.Slice.start(hosts=1, devices_per_host=1)
    except ImportError as e:
        out["slice"] = [type(e).__name__, e.name, str(e)]
    out["imported"] = sorted(m for m in sys.modules if m.split(".")[0] in ("ray", "cloudpickle"))
    return out


if __name__ == "__main__":
    _without_ray.block()  # (before anything else is imported)
    print(json.dumps(main(sys.argv[1])))
