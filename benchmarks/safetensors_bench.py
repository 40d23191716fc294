"""safetensors in and out, 1 GiB, side by side in one run, each operation in a fresh process.

    python benchmarks/safetensors_bench.py [--gib 1.0] [--repeats 3] [--dir /tmp/x]

- load: one ``.safetensors`` file (8 float32 tensors) onto 8 CPU devices sharded ``(2, 4)``,
  cold (the file evicted from the page cache first): milepost ``load`` vs
  ``safetensors.numpy.load_file`` + ``jax.device_put`` vs Orbax v1's safetensors layout. Peak
  RSS growth of each.
- export: a milepost checkpoint of the same arrays to safetensors (``milepost.safetensors.export``)
  vs ``safetensors.numpy.save_file`` of the same arrays already in host memory.

Targets (issue #11): load <= 0.7x the safetensors library, peak RSS growth <= 1.3x the file;
export <= 1.2x save_file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PeakRss, evict, run_worker

N = 8
COLS = 8192


def shape(gib: float) -> tuple[int, int]:
    return max(8, round(gib * 2**30 / N / 4 / COLS / 8) * 8), COLS


def arrays(gib: float) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {f"layer{i}.w": rng.standard_normal(shape(gib), dtype=np.float32) for i in range(N)}


def abstract(gib: float) -> dict[str, Any]:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    s = NamedSharding(jax.make_mesh((2, 4), ("a", "b")), PartitionSpec("a", "b"))
    return {
        f"layer{i}": {"w": jax.ShapeDtypeStruct(shape(gib), np.float32, sharding=s)}
        for i in range(N)
    }


def worker(op: str, path: str, gib: float) -> dict[str, Any]:
    import jax

    out: dict[str, Any] = {}
    if op == "prepare":
        from safetensors.numpy import save_file

        import milepost as mp

        data = arrays(gib)
        save_file(data, os.path.join(path, "model.safetensors"))
        tree = {k.split(".")[0]: {"w": v} for k, v in data.items()}
        mp.save(os.path.join(path, "ckpt"), tree)
        return {"bytes": sum(v.nbytes for v in data.values())}
    if op.startswith("load-"):
        file = os.path.join(path, "model.safetensors")
        evict(file)
        target = abstract(gib)
        with PeakRss() as rss:
            t0 = time.perf_counter()
            if op == "load-milepost":
                import milepost as mp

                got = mp.load(file, target)
            elif op == "load-safetensors":
                from safetensors.numpy import load_file

                host = load_file(file)
                got = {
                    k: {"w": jax.device_put(host[f"{k}.w"], v["w"].sharding)}
                    for k, v in target.items()
                }
            else:  # orbax v1's safetensors layout
                import orbax.checkpoint.experimental.v1 as ocp

                with ocp.Context(checkpoint_layout=ocp.options.CheckpointLayout.SAFETENSORS):
                    flat = ocp.load_pytree(file)
                got = {
                    k: {"w": jax.device_put(flat[f"{k}.w"], v["w"].sharding)}
                    for k, v in target.items()
                }
            jax.block_until_ready(got)
            out["time"] = time.perf_counter() - t0
        out["rss_growth"] = rss.growth
        want = arrays(gib)
        out["exact"] = all(
            np.array_equal(np.asarray(got[k.split(".")[0]]["w"]), v) for k, v in want.items()
        )
        return out
    if op == "export-milepost":
        import milepost.safetensors

        dest = os.path.join(path, "export")
        shutil.rmtree(dest, ignore_errors=True)
        t0 = time.perf_counter()
        milepost.safetensors.export(os.path.join(path, "ckpt"), dest)
        out["time"] = time.perf_counter() - t0
        return out
    if op == "export-safetensors":
        from safetensors.numpy import save_file

        data = arrays(gib)
        dest = os.path.join(path, "ref.safetensors")
        t0 = time.perf_counter()
        save_file(data, dest)
        fd = os.open(dest, os.O_RDONLY)
        os.fsync(fd)  # milepost's export is durable; so must the reference be
        os.close(fd)
        out["time"] = time.perf_counter() - t0
        os.unlink(dest)
        return out
    raise ValueError(op)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.path, args.gib)), flush=True)
        return 0
    root = Path(args.dir or tempfile.mkdtemp(prefix="milepost-st-", dir="/tmp"))
    root.mkdir(parents=True, exist_ok=True)
    script = str(Path(__file__).resolve())
    size = run_worker(script, ["--worker", "prepare", "--path", str(root), "--gib", str(args.gib)])[
        "bytes"
    ]
    ops = [
        "load-milepost",
        "load-safetensors",
        "load-orbax",
        "export-milepost",
        "export-safetensors",
    ]
    results: dict[str, list[dict[str, Any]]] = {op: [] for op in ops}
    try:
        for rep in range(args.repeats):
            for op in ops if rep % 2 == 0 else reversed(ops):
                os.sync()
                res = run_worker(
                    script, ["--worker", op, "--path", str(root), "--gib", str(args.gib)]
                )
                results[op].append(res)
                print(
                    f"repeat {rep + 1} {op}: "
                    + ", ".join(
                        f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in res.items()
                    ),
                    flush=True,
                )
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)

    def med(op: str, key: str = "time") -> float:
        return statistics.median(r[key] for r in results[op])

    print(
        f"\n{size / 2**30:.2f} GiB, {N} float32 tensors {shape(args.gib)}, 8 CPU devices (2, 4); "
        f"median of {args.repeats}"
    )
    for op in ops:
        extra = (
            f", peak RSS growth {med(op, 'rss_growth') / size:.2f}x the file"
            if "rss_growth" in results[op][0]
            else ""
        )
        exact = (
            f", exact={all(r['exact'] for r in results[op])}" if "exact" in results[op][0] else ""
        )
        print(f"  {op:<22} {med(op):7.3f} s{extra}{exact}")
    print("\nTargets")
    for name, value, limit in (
        (
            "milepost load / safetensors load_file + device_put",
            med("load-milepost") / med("load-safetensors"),
            0.7,
        ),
        (
            "milepost load peak RSS growth / file size",
            med("load-milepost", "rss_growth") / size,
            1.3,
        ),
        (
            "milepost export / safetensors save_file (arrays in memory)",
            med("export-milepost") / med("export-safetensors"),
            1.2,
        ),
    ):
        print(
            f"  {'PASS' if value <= limit else 'FAIL'}  {name:<62} {value:5.2f}x "
            f"(target <= {limit}x)"
        )
    print(
        "  (for reference: milepost load / orbax safetensors load: "
        f"{med('load-milepost') / med('load-orbax'):.2f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
