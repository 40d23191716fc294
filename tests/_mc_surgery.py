"""One process of a 2-process multi-controller job running a surgery (see tests/_mc.py):

    python -m tests._mc_surgery run <index> <count> <port> <root>

Every process runs the same script; the surgery's loads, computations and writes are
collective. Prints one JSON line."""

from __future__ import annotations

import json
import sys
import traceback

import jax

_, INDEX, COUNT, PORT, ROOT = (
    sys.argv[1],
    int(sys.argv[2]),
    int(sys.argv[3]),
    int(sys.argv[4]),
    sys.argv[5],
)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{PORT}", num_processes=COUNT, process_id=INDEX)

import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import milepost as mp  # noqa: E402
from milepost import surgery as ms  # noqa: E402


def value(i: int) -> np.ndarray:
    return np.arange(32 * 64, dtype=np.float32).reshape(32, 64) * (i + 1) - 7


def main() -> dict:
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    sharding = NamedSharding(mesh, P("data", "model"))
    tree = {
        f"layer{i}": jax.make_array_from_callback(
            (32, 64), sharding, lambda idx, i=i: value(i)[idx]
        )
        for i in range(3)
    }
    mp.save(f"{ROOT}/src", {"params": tree, "step": 5})
    ck = ms.open(f"{ROOT}/src")
    t = ms.stack(
        ms.cast(ms.rename(ck.tree, {r"^params\.(.*)": r"model.\1"}), jnp.bfloat16),
        r"^model\.layer(\d+)$",
        "model.all",
    )
    ms.write(f"{ROOT}/out", t, memory_budget_bytes=8 << 10)  # several groups
    ms.write(f"{ROOT}/renamed", ms.rename(ck.tree, {r"^params\.(.*)": r"p.\1"}))
    out = mp.load(
        f"{ROOT}/out",
        {
            "model": {
                "all": jax.ShapeDtypeStruct(
                    (3, 32, 64), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "data"))
                )
            },
            "step": 0,
        },
    )
    want = np.stack([value(i) for i in range(3)]).astype(ml_dtypes.bfloat16)
    exact = 0
    for shard in out["model"]["all"].addressable_shards:
        assert np.array_equal(
            np.asarray(shard.data).view(np.uint16), want[shard.index].view(np.uint16)
        ), shard.index
        exact += 1
    renamed = mp.load(
        f"{ROOT}/renamed",
        {"p": {"layer1": jax.ShapeDtypeStruct((32, 64), jnp.float32, sharding=sharding)}},
        partial=True,
    )
    for shard in renamed["p"]["layer1"].addressable_shards:
        assert np.array_equal(np.asarray(shard.data), value(1)[shard.index])
        exact += 1
    return {
        "process": INDEX,
        "exact": exact,
        "step": int(out["step"]),
        "equal": ms.diff(ck.tree, ms.open(f"{ROOT}/src").tree).equal,
        "preview": np.asarray(ck.tree["params"]["layer2"][1, :3]).tolist(),
    }


if __name__ == "__main__":
    try:
        result = main()
    except Exception:
        result = {"process": INDEX, "exception": traceback.format_exc()}
    print(json.dumps(result), flush=True)
