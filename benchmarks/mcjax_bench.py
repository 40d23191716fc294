"""Multi-controller save/load: 2 processes x 4 fake CPU devices, milepost vs Orbax v1, one run.

    python benchmarks/mcjax_bench.py [--gib 1.0] [--repeats 3] [--processes 2]

Each repeat launches a fresh 2-process jax.distributed job per library; every process times its
save and its cold load (files evicted from the page cache), and the slowest process counts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import evict, median


def worker(variant: str, index: int, count: int, port: int, directory: str, gib: float) -> dict:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=count, process_id=index)
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, len(jax.devices()) // 2), ("a", "b"))
    specs = [P("a", "b"), P("b", "a"), P(("a", "b"), None), P(None, ("a", "b"))]
    rows = max(8, int(gib * 2**30 / 8 / 4 / 8192) // 8 * 8)
    tree = {}
    for i in range(8):
        s = NamedSharding(mesh, specs[i % 4])
        full = np.random.default_rng(i).standard_normal(
            (rows, 8192), dtype=np.float32
        )  # same in every process
        tree[f"layer{i}"] = jax.make_array_from_callback(
            (rows, 8192), s, lambda idx, full=full: full[idx]
        )
        del full
    abstract = {
        k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for k, x in tree.items()
    }
    path = os.path.join(directory, variant)
    sync = multihost_utils.sync_global_devices
    out: dict = {"bytes": sum(x.nbytes for x in tree.values())}
    sync("start")
    t0 = time.perf_counter()
    if variant == "milepost":
        import milepost as mp

        mp.save(path, tree)
    else:
        import orbax.checkpoint.experimental.v1 as ocp

        ocp.save(path, tree)
    out["save"] = time.perf_counter() - t0
    sync("saved")
    if index == 0:
        evict(path)
    sync("evicted")
    t0 = time.perf_counter()
    if variant == "milepost":
        restored = mp.load(path, abstract)
    else:
        restored = ocp.load(path, abstract)
    jax.block_until_ready(restored)
    out["load"] = time.perf_counter() - t0
    out["exact"] = all(
        np.array_equal(np.asarray(a.data), np.asarray(b.data))
        for k in list(tree)[:2]
        for a, b in zip(restored[k].addressable_shards, tree[k].addressable_shards, strict=True)
    )
    sync("done")
    return out


def launch(variant: str, processes: int, directory: str, gib: float) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // processes}",
        JAX_PLATFORMS="cpu",
    )
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                variant,
                "--index",
                str(i),
                "--count",
                str(processes),
                "--port",
                str(port),
                "--dir",
                directory,
                "--gib",
                str(gib),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(processes)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"{variant} process failed:\n{err[-3000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    shutil.rmtree(os.path.join(directory, variant), ignore_errors=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(
            json.dumps(worker(args.worker, args.index, args.count, args.port, args.dir, args.gib)),
            flush=True,
        )
        os._exit(0)  # skip jax.distributed's shutdown barrier: every process already synced

    directory = args.dir or tempfile.mkdtemp(prefix="milepost-mcbench-")
    times: dict[str, dict[str, list[float]]] = {
        v: {"save": [], "load": []} for v in ("milepost", "orbax")
    }
    exact = True
    try:
        for r in range(args.repeats):
            for v in times:
                res = launch(v, args.processes, directory, args.gib)
                for key in ("save", "load"):
                    times[v][key].append(max(x[key] for x in res))
                exact = exact and all(x["exact"] for x in res)
                print(
                    f"  run {r + 1} {v}: save {times[v]['save'][-1]:.3f}s "
                    f"load {times[v]['load'][-1]:.3f}s",
                    flush=True,
                )
    finally:
        if not args.dir:
            shutil.rmtree(directory, ignore_errors=True)
    m = {v: {k: median(x) for k, x in d.items()} for v, d in times.items()}
    print(
        f"\n{args.gib:.2f} GiB, {args.processes} processes x {8 // args.processes} devices, "
        f"median of {args.repeats} (slowest process)"
    )
    print(f"{'':<10} {'save s':>8} {'load s':>8}")
    for v in m:
        print(f"{v:<10} {m[v]['save']:>8.3f} {m[v]['load']:>8.3f}")
    for k in ("save", "load"):
        ratio = m["milepost"][k] / m["orbax"][k]
        print(
            f"  {'PASS' if ratio <= 0.6 else 'FAIL'}  {k} / Orbax {k}: {ratio:.2f} (target <= 0.6)"
        )
    total = (m["milepost"]["save"] + m["milepost"]["load"]) / (
        m["orbax"]["save"] + m["orbax"]["load"]
    )
    print(
        f"  {'PASS' if total <= 0.6 else 'FAIL'}  save+load / Orbax save+load: {total:.2f} "
        "(target <= 0.6)"
    )
    print(f"  exact round trip: {exact}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
