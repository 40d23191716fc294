"""The ``milepost`` command: ``milepost demo`` saves and loads a sharded toy model."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def demo(directory: str | None, size_mib: int, devices: int) -> int:
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", devices)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import milepost as mp

    if len(jax.devices()) < devices:
        print(f"JAX already started with {len(jax.devices())} devices; run the demo in a fresh process", file=sys.stderr)
        return 2
    mesh = jax.make_mesh((2, devices // 2), ("data", "model"))
    d = 1024
    layers = max(1, size_mib * 2**20 // (2 * d * d * 4))
    key = jax.random.key(0)
    params = {}
    for i in range(layers):
        key, k1, k2 = jax.random.split(key, 3)
        params[f"layer{i}"] = {
            "kernel": jax.device_put(jax.random.normal(k1, (d, d)), NamedSharding(mesh, P("data", "model"))),
            "proj": jax.device_put(jax.random.normal(k2, (d, d)), NamedSharding(mesh, P("model", None))),
            "bias": jax.device_put(jnp.zeros((d,), jnp.bfloat16), NamedSharding(mesh, P())),
        }
    state = {"params": params, "step": 1000, "tokens_seen": np.int64(123_456_789), "run": "milepost-demo"}
    nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))

    root = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="milepost-demo-"))
    path = root / "ckpt_1000"
    print(f"milepost demo: {layers} layers, {_human(nbytes)} of arrays over {devices} CPU devices, mesh {dict(mesh.shape)}")

    t0 = time.perf_counter()
    handle = mp.save_async(path, state, custom_metadata={"demo": True})
    t1 = time.perf_counter()
    handle.result()
    t2 = time.perf_counter()
    on_disk = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    print(f"save_async returned after {t1 - t0:.3f}s (arrays copied to host); committed after {t2 - t0:.3f}s")
    print(f"  checkpoint at {path}: {_human(on_disk)} on disk, {sum(1 for _ in path.rglob('*'))} files and folders")

    meta = mp.metadata(path)
    k0 = meta.tree["params"]["layer0"]["kernel"]
    print(f"metadata: layer0.kernel shape={k0.shape} dtype={k0.dtype} write_shape={k0.write_shape} "
          f"sharding={k0.sharding.describe()}; custom={meta.custom_metadata}")

    other = jax.make_mesh((devices // 2, 2), ("x", "y"))
    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(other, P(None, "x")))
        if x.ndim == 2 else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(other, P("y"))),
        params,
    )
    t0 = time.perf_counter()
    restored = mp.load(path, {"params": abstract, "step": 0, "tokens_seen": np.int64(0), "run": ""})
    t1 = time.perf_counter()
    same = all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(restored["params"]), strict=True)
    )
    k = restored["params"]["layer0"]["kernel"]
    print(f"load resharded onto mesh {dict(other.shape)} P(None, 'x') in {t1 - t0:.3f}s: "
          f"layer0.kernel shard shape {k.addressable_shards[0].data.shape} (was {params['layer0']['kernel'].addressable_shards[0].data.shape})")
    print(f"values identical: {same}; step={restored['step']}, tokens_seen={restored['tokens_seen']!r}, run={restored['run']!r}")
    if not directory:
        shutil.rmtree(root)
    return 0 if same and restored["step"] == 1000 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="milepost", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="save and load a sharded toy model over fake CPU devices")
    d.add_argument("--dir", default=None, help="where to write (default: a temporary directory, removed after)")
    d.add_argument("--size-mib", type=int, default=256, help="approximate model size")
    d.add_argument("--devices", type=int, default=8, help="fake CPU devices (even)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo(args.dir, args.size_mib, args.devices)
    return 2


if __name__ == "__main__":
    sys.exit(main())
