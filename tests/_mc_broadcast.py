"""One process of a multi-controller load-and-broadcast job (see tests/_mc.py). Prints one JSON
line.

python -m tests._mc_broadcast broadcast <index> <count> <port> <root>
"""

from __future__ import annotations

import json
import sys
import traceback

import jax
import numpy as np

SCENARIO, INDEX, COUNT, PORT = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
ARGS = sys.argv[5:]

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{PORT}", num_processes=COUNT, process_id=INDEX)

from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import milepost as mp  # noqa: E402


def broadcast(root: str) -> dict:
    mesh = jax.make_mesh((2, 4), ("data", "model"))  # data 0 on process 0, data 1 on process 1
    rng = np.random.default_rng(3)
    values = {
        "w": rng.standard_normal((64, 256)).astype(np.float32),
        "i": rng.integers(0, 2**31 - 1, (32, 64), dtype=np.int32),
    }
    values["w"][0, 0] = -0.0
    tree = {
        k: jax.make_array_from_callback(
            v.shape, NamedSharding(mesh, P("data", "model")), lambda idx, v=v: v[idx]
        )
        for k, v in values.items()
    }
    mp.save(f"{root}/c", tree)
    abstract = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, P(None, "model")))
        for k, v in values.items()
    }
    stats = {}
    exact = True
    for name, options in (
        ("plain", mp.LoadOptions()),
        ("broadcast", mp.LoadOptions(load_and_broadcast=True, replica_axis="data")),
    ):
        with mp.Context(loading=options):
            before = mp.io_stats()
            loaded = mp.load(f"{root}/c", abstract)
            got = mp.io_stats() - before
        stats[name] = {
            "read": [h.bytes_read for h in got.hosts],
            "sent": [h.bytes_sent for h in got.hosts],
            "received": [h.bytes_received for h in got.hosts],
        }
        for k, v in values.items():
            exact &= loaded[k].sharding == abstract[k].sharding
            exact &= all(
                np.asarray(s.data).tobytes() == v[s.index].tobytes()
                for s in loaded[k].addressable_shards
            )
    return {"stats": stats, "exact": bool(exact), "nbytes": sum(v.nbytes for v in values.values())}


SCENARIOS = {"broadcast": broadcast}

if __name__ == "__main__":
    try:
        result = {"process": INDEX, **SCENARIOS[SCENARIO](*ARGS)}
    except Exception:
        result = {"process": INDEX, "exception": traceback.format_exc()}
    print(json.dumps(result), flush=True)
    jax.distributed.shutdown()
