"""One process of a multi-controller test job (see tests/_mc.py). Prints one JSON line."""

from __future__ import annotations

import json
import os
import sys
import time
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
from tests._mc import SHAPES, global_value  # noqa: E402


def make_tree(mesh: jax.sharding.Mesh) -> dict:
    specs = {"w": P("data", "model"), "b": P("model"), "r": P()}
    tree: dict = {}
    for k, (shape, dtype) in SHAPES.items():
        g = global_value(k, shape, dtype)
        s = NamedSharding(mesh, specs[k])
        tree[k] = jax.make_array_from_callback(shape, s, lambda idx, g=g: g[idx])
    tree["step"] = 7
    tree["note"] = "mc"
    tree["host"] = np.arange(5)
    return tree


def check(tree: dict, expect_sharding: dict | None = None) -> int:
    """Compare every addressable shard with the global value; returns how many were checked."""
    n = 0
    for k, (shape, dtype) in SHAPES.items():
        g = global_value(k, shape, dtype)
        arr = tree[k]
        assert arr.shape == shape and arr.dtype == np.dtype(dtype), (k, arr.shape, arr.dtype)
        if expect_sharding is not None:
            assert arr.sharding == expect_sharding[k], (k, arr.sharding, expect_sharding[k])
        for shard in arr.addressable_shards:
            assert np.array_equal(np.asarray(shard.data), g[shard.index]), (k, shard.index)
            n += 1
    assert tree["step"] == 7 and tree["note"] == "mc" and np.array_equal(tree["host"], np.arange(5))
    return n


def resharded_abstract(mesh: jax.sharding.Mesh) -> dict:
    specs = {"w": P(None, mesh.axis_names[0]), "b": P(mesh.axis_names[-1]), "r": P(mesh.axis_names[0])}
    out: dict = {k: jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=NamedSharding(mesh, specs[k]))
                 for k, (shape, dtype) in SHAPES.items()}
    out.update(step=0, note="", host=np.zeros(5, np.int64))
    return out


def main() -> dict:
    root = ARGS[0]
    devices = jax.devices()
    out: dict = {"process": INDEX, "global_devices": len(devices), "device_ids": [d.id for d in jax.local_devices()]}
    if SCENARIO == "save_and_reshard":
        mesh = jax.make_mesh((2, len(devices) // 2), ("data", "model"))
        tree = make_tree(mesh)
        mp.save(os.path.join(root, "a"), tree, custom_metadata={"procs": COUNT})
        h = mp.save_async(os.path.join(root, "b"), tree)
        h.result(120)
        out["meta_procs"] = mp.metadata(os.path.join(root, "a")).custom_metadata["procs"]
        out["checked_same"] = check(mp.load(os.path.join(root, "a")), {k: tree[k].sharding for k in SHAPES})
        other = jax.make_mesh((len(devices) // 2, 2), ("x", "y"))
        abstract = resharded_abstract(other)
        out["checked_resharded"] = check(mp.load(os.path.join(root, "b"), abstract))
        with mp.training.Checkpointer(os.path.join(root, "run")) as ckpt:
            for step in range(3):
                ckpt.save(step, tree)
            ckpt.wait()
            out["ckpt_steps"] = ckpt.steps
        try:
            mp.save(os.path.join(root, "a"), tree)
        except FileExistsError as e:
            out["exists_error"] = type(e).__name__
    elif SCENARIO == "load_elsewhere":
        mesh = jax.make_mesh((len(devices) // 2, 2), ("x", "y"))
        for name in ARGS[1:]:
            out[f"checked_{os.path.basename(name)}"] = check(mp.load(name, resharded_abstract(mesh)))
    elif SCENARIO == "orbax_save":
        import orbax.checkpoint.experimental.v1 as ocp

        mesh = jax.make_mesh((2, len(devices) // 2), ("data", "model"))
        tree = make_tree(mesh)
        ocp.save(os.path.join(root, "orbax"), tree)
        out["checked_orbax"] = check(mp.load(os.path.join(root, "orbax"), resharded_abstract(jax.make_mesh((len(devices) // 2, 2), ("x", "y")))))
    elif SCENARIO == "die_mid_save":
        mesh = jax.make_mesh((2, len(devices) // 2), ("data", "model"))
        tree = make_tree(mesh)
        from milepost import _pytree

        if INDEX == 1:  # this process dies after staging, before the other arrives at the commit barrier
            real = _pytree.PyTreeSave.stage

            def stage_then_die(self, directory, copy):  # type: ignore[no-untyped-def]
                real(self, directory, copy)
                print(json.dumps({"process": INDEX, "died": True}), flush=True)
                os._exit(17)

            _pytree.PyTreeSave.stage = stage_then_die  # type: ignore[method-assign]
        t0 = time.monotonic()
        try:
            with mp.Context(async_=mp.AsyncOptions(timeout_secs=float(ARGS[1]))):
                mp.save(os.path.join(root, "dead"), tree)
            out["error"] = None
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {e}"
        out["seconds"] = time.monotonic() - t0
        out["committed"] = os.path.exists(os.path.join(root, "dead"))
        print(json.dumps(out), flush=True)
        os._exit(0)  # the job is broken: skip jax.distributed's shutdown barrier
    return out


if __name__ == "__main__":
    try:
        result = main()
    except Exception:
        result = {"process": INDEX, "exception": traceback.format_exc()}
    print(json.dumps(result), flush=True)
    jax.distributed.shutdown()
