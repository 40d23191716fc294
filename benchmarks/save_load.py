"""Save and load ~1 GiB of sharded float32 with milepost, Orbax v1 and plain NumPy, in one run.

    python benchmarks/save_load.py [--gib 1.0] [--repeats 3] [--dir /tmp/x] [--only milepost,orbax,numpy,hostcopy]

Every variant runs in its own fresh process (clean peak RSS). Loads are cold: the checkpoint's
files are evicted from the page cache first. Prints a table and the issue's target ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PeakRss, evict, median, run_worker, timer

LAYOUTS = {
    # every byte on exactly one device: device memory == checkpoint bytes
    "sharded": [("a", "b"), ("b", "a"), (("a", "b"), None), (None, ("a", "b"))],
    # partially and fully replicated arrays too: device memory is 2.25x the checkpoint bytes
    "mixed": [("a", "b"), ("b", None), (None, "a"), ("a", "b")],
}


def build(gib: float, layout: str = "sharded"):  # type: ignore[no-untyped-def]
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, 4), ("a", "b"))
    n_arrays = 8
    rows = max(8, int(gib * 2**30 / n_arrays / 4 / 8192) // 8 * 8)
    rng = np.random.default_rng(0)
    tree = {}
    for i in range(n_arrays):
        specs = LAYOUTS[layout]
        spec = P(*specs[i % len(specs)])
        tree[f"layer{i}"] = jax.device_put(rng.standard_normal((rows, 8192), dtype=np.float32), NamedSharding(mesh, spec))
    jax.block_until_ready(tree)
    return tree


def worker(variant: str, directory: str, gib: float, layout: str) -> dict:
    import hashlib

    import jax
    import numpy as np

    base_rss = PeakRss().process.memory_info().rss
    tree = build(gib, layout)
    nbytes = sum(x.nbytes for x in tree.values())
    abstract = {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for k, x in tree.items()}
    digests = {k: hashlib.sha1(np.asarray(x).tobytes()).hexdigest() for k, x in list(tree.items())[:3]}

    def exact(restored: dict) -> bool:
        return all(hashlib.sha1(np.asarray(restored[k]).tobytes()).hexdigest() == d for k, d in digests.items())

    out: dict = {"bytes": nbytes, "base_rss": base_rss}
    path = os.path.join(directory, variant)
    if variant == "milepost":
        import milepost as mp

        with PeakRss() as rss, timer(out, "save"):
            mp.save(path, tree)
        out["save_rss_peak"], out["save_rss_growth"] = rss.peak, rss.growth
        with PeakRss() as rss, timer(out, "async_total"):
            with timer(out, "async_block"):
                handle = mp.save_async(path + "_async", tree)
            handle.result()
        out["async_rss_peak"], out["async_rss_growth"] = rss.peak, rss.growth
        shutil.rmtree(path + "_async")
        del tree
        evict(path)
        with PeakRss() as rss, timer(out, "load"):
            restored = mp.load(path, abstract)
            jax.block_until_ready(restored)
        out["load_rss_peak"], out["load_rss_growth"] = rss.peak, rss.growth
        out["exact"] = exact(restored)
    elif variant == "orbax":
        import orbax.checkpoint.experimental.v1 as ocp

        with PeakRss() as rss, timer(out, "save"):
            ocp.save(path, tree)
        out["save_rss_peak"], out["save_rss_growth"] = rss.peak, rss.growth
        del tree
        evict(path)
        with PeakRss() as rss, timer(out, "load"):
            restored = ocp.load(path, abstract)
            jax.block_until_ready(restored)
        out["load_rss_peak"], out["load_rss_growth"] = rss.peak, rss.growth
        out["exact"] = exact(restored)
    elif variant == "numpy":
        os.makedirs(path)
        with PeakRss() as rss, timer(out, "save"):
            for k, x in tree.items():
                host = np.asarray(x)
                with open(os.path.join(path, k), "wb") as f:
                    host.tofile(f)
                    f.flush()
                    os.fsync(f.fileno())
        out["save_rss_peak"], out["save_rss_growth"] = rss.peak, rss.growth
        del tree
        evict(path)
        with PeakRss() as rss, timer(out, "load"):
            arrays = {k: np.fromfile(os.path.join(path, k), dtype=np.float32).reshape(a.shape) for k, a in abstract.items()}
        out["load_rss_peak"], out["load_rss_growth"] = rss.peak, rss.growth
        with timer(out, "load_put"):
            placed = {k: jax.device_put(a, abstract[k].sharding) for k, a in arrays.items()}
            jax.block_until_ready(placed)
        out["exact"] = exact(placed)
    elif variant == "hostcopy":
        with timer(out, "copy"):
            copies = [np.array(s.data, copy=True) for x in tree.values() for s in x.addressable_shards if s.replica_id == 0]
        out["copied"] = sum(c.nbytes for c in copies)
    shutil.rmtree(path, ignore_errors=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--only", default="milepost,orbax,numpy,hostcopy")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="sharded")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.dir, args.gib, args.layout)))
        return 0

    directory = args.dir or tempfile.mkdtemp(prefix="milepost-bench-")
    os.makedirs(directory, exist_ok=True)
    variants = args.only.split(",")
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    try:
        for r in range(args.repeats):
            for v in variants:
                res = run_worker(__file__, ["--worker", v, "--dir", directory, "--gib", str(args.gib), "--layout", args.layout])
                runs[v].append(res)
                print(f"  run {r + 1} {v}: " + ", ".join(f"{k}={val:.3f}" if isinstance(val, float) else f"{k}={val}" for k, val in res.items()), flush=True)
    finally:
        if not args.dir:
            shutil.rmtree(directory, ignore_errors=True)

    def med(v: str, key: str) -> float:
        return median([r[key] for r in runs[v]]) if v in runs and runs[v] and key in runs[v][0] else float("nan")

    nbytes = runs[variants[0]][0]["bytes"]
    gib = nbytes / 2**30
    print(f"\n{gib:.2f} GiB of float32 ({args.layout} layout) over 8 fake CPU devices, median of {args.repeats} runs")
    print("peak RSS is counted above the process's RSS before the data was built (Python + JAX + libraries),")
    print("as a multiple of the checkpoint bytes; the save figure includes the live arrays being saved.")
    print(f"{'variant':<10} {'save s':>8} {'load(cold) s':>13} {'save peak RSS':>14} {'load peak RSS':>14}")

    def rel(v: str, key: str) -> float:
        return (med(v, key) - med(v, "base_rss")) / nbytes

    for v in ("milepost", "orbax", "numpy"):
        if v in runs:
            print(f"{v:<10} {med(v, 'save'):>8.3f} {med(v, 'load'):>13.3f} {rel(v, 'save_rss_peak'):>13.2f}x {rel(v, 'load_rss_peak'):>13.2f}x")
    if "numpy" in runs:
        print(f"numpy load + device_put: {med('numpy', 'load_put') + med('numpy', 'load'):.3f}s")
    if "hostcopy" in runs:
        print(f"plain host copy of every shard: {med('hostcopy', 'copy'):.3f}s")
    if "milepost" in runs:
        print(f"milepost save_async blocking: {med('milepost', 'async_block'):.3f}s")

    def target(name: str, value: float, limit: float) -> None:
        ok = "PASS" if value <= limit else "FAIL"
        print(f"  {ok}  {name}: {value:.2f} (target <= {limit})")

    print("\nTargets")
    if "milepost" in runs:
        if "orbax" in runs:
            target("save / Orbax save", med("milepost", "save") / med("orbax", "save"), 0.6)
            target("cold load / Orbax cold load", med("milepost", "load") / med("orbax", "load"), 0.6)
        if "numpy" in runs:
            target("save / NumPy tofile+fsync", med("milepost", "save") / med("numpy", "save"), 1.2)
            target("cold load / NumPy cold fromfile", med("milepost", "load") / med("numpy", "load"), 1.3)
        if "hostcopy" in runs:
            target("save_async blocking / plain host copy", med("milepost", "async_block") / med("hostcopy", "copy"), 1.5)
        target("save_async peak RSS / checkpoint bytes", rel("milepost", "async_rss_peak"), 2.2)
        target("load peak RSS / checkpoint bytes", rel("milepost", "load_rss_peak"), 1.3)
        print(f"  info  growth during save {med('milepost', 'save_rss_growth') / nbytes:.2f}x, "
              f"during save_async {med('milepost', 'async_rss_growth') / nbytes:.2f}x, "
              f"during load {med('milepost', 'load_rss_growth') / nbytes:.2f}x of checkpoint bytes; "
              f"exact round trip: {all(r['exact'] for r in runs['milepost'])}")
    print("  exact: " + ", ".join(f"{v}={all(r.get('exact', True) for r in runs[v])}" for v in runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
