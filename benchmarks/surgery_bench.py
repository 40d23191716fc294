"""Checkpoint surgery: milepost.surgery against what users do today (Orbax v1 loads the whole
tree, a Python transform, Orbax saves), in one run.

    python benchmarks/surgery_bench.py [--gib 1.0] [--repeats 3] [--budget-mib 128] [--dir /tmp/x]

The source checkpoint (written once, by milepost): ``params`` (8 float32 arrays, half the
bytes) and ``opt_state`` (the same shapes again), sharded over a (2, 4) mesh of 8 fake CPU
devices. Three surgeries, each by both tools:

* ``full``: rename ``params.*`` to ``model.*``, drop ``opt_state``, cast to bfloat16;
* ``prune``: the rename and the drop only (the kept arrays are written anew: a relinked output
  would still hold the dropped arrays' bytes in the data files it shares);
* ``rename``: the rename only, ``opt_state`` kept (relinked: no array bytes move).

Every run is a fresh process (``--worker``) whose memory is warmed first (see save_load.py's
``--warm``); it reports its wall time and its peak RSS growth (the kernel's high-water mark),
then checks the output against the source exactly. Prints medians, ratios and the targets
(full <= 0.5x time and <= 0.3x peak RSS growth; rename-only <= 0.1x time; prune is reported).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import PeakRss, run_worker


def shape(gib: float) -> tuple[int, int]:
    rows = max(8, int(gib * 2**30 / 2 / 8 / 4 / 4096) // 8 * 8)
    return rows, 4096


def make_source(path: str, gib: float) -> None:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import milepost as mp

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    sharding = NamedSharding(mesh, P("data", "model"))
    rng = np.random.default_rng(0)
    params = {
        f"w{i}": jax.device_put(rng.standard_normal(shape(gib), dtype=np.float32), sharding)
        for i in range(8)
    }
    opt = {f"w{i}": jax.device_put(np.ones(shape(gib), np.float32) * i, sharding) for i in range(8)}
    mp.save(path, {"params": params, "opt_state": {"mu": opt}, "step": 7})


def warm(gib: float) -> None:
    import numpy as np

    block = np.ones(int(2.5 * gib * 2**30) // 8)
    del block


def run(tool: str, surgery: str, source: str, out: str, budget: int) -> dict[str, float]:
    # Imports and JAX's start-up before the clock starts, for both tools: they are not the surgery.
    import jax
    import jax.numpy as jnp
    from orbax.checkpoint.experimental import v1 as ocp

    from milepost import surgery as ms

    jax.devices()
    with PeakRss() as rss:
        t0 = time.perf_counter()
        if tool == "milepost":
            renames = {r"^params\.(.*)": r"model.\1"}
            if surgery != "rename":
                renames[r"^opt_state\..*"] = None
            t = ms.rename(ms.open(source).tree, renames)
            if surgery == "full":
                t = ms.cast(t, jnp.bfloat16)
            ms.write(out, t, memory_budget_bytes=budget)
        else:
            tree = ocp.load_pytree(source)
            new = {"model": tree["params"], "step": tree["step"]}
            if surgery == "rename":
                new["opt_state"] = tree["opt_state"]
            del tree
            if surgery == "full":
                new["model"] = {k: v.astype(jnp.bfloat16) for k, v in new["model"].items()}
            ocp.save_pytree(out, new)
        took = time.perf_counter() - t0
    return {"seconds": took, "rss_growth": rss.growth}


def check(source: str, out: str, surgery: str) -> None:
    import ml_dtypes
    import numpy as np

    import milepost as mp

    src = mp.load(source)
    got = mp.load(out)
    for k, v in src["params"].items():
        want = np.asarray(v).astype(ml_dtypes.bfloat16) if surgery == "full" else np.asarray(v)
        assert np.array_equal(np.asarray(got["model"][k]).view(np.uint8), want.view(np.uint8)), k
    if surgery == "rename":
        for k, v in src["opt_state"]["mu"].items():
            assert np.array_equal(
                np.asarray(got["opt_state"]["mu"][k]).view(np.uint8), np.asarray(v).view(np.uint8)
            ), k
    else:
        assert "opt_state" not in got
    assert int(got["step"]) == 7


def worker(args: argparse.Namespace) -> None:
    warm(args.gib)
    result = run(args.tool, args.surgery, args.source, args.out, args.budget_mib << 20)
    check(args.source, args.out, args.surgery)
    print(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget-mib", type=int, default=128)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--tool")
    ap.add_argument("--surgery")
    ap.add_argument("--source")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    work = tempfile.mkdtemp(prefix="milepost-surgery-", dir=args.dir)
    try:
        source = os.path.join(work, "source")
        import subprocess

        env = dict(
            os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8"
        )
        subprocess.run(
            [
                sys.executable,
                "-c",
                f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                f"import surgery_bench as b; b.make_source({source!r}, {args.gib})",
            ],
            env=env,
            check=True,
        )
        results: dict[tuple[str, str], list[dict[str, float]]] = {}
        cases = [(t, s) for s in ("full", "prune", "rename") for t in ("milepost", "orbax")]
        for r in range(args.repeats):
            for tool, surgery in cases[r % 2 :] + cases[: r % 2]:  # rotate the order
                out = os.path.join(work, f"{tool}-{surgery}-{r}")
                got = run_worker(
                    __file__,
                    [
                        "--worker",
                        "--tool",
                        tool,
                        "--surgery",
                        surgery,
                        "--source",
                        source,
                        "--out",
                        out,
                        "--gib",
                        str(args.gib),
                        "--budget-mib",
                        str(args.budget_mib),
                    ],
                )
                results.setdefault((tool, surgery), []).append(got)
                shutil.rmtree(out, ignore_errors=True)
        med = {
            k: {m: statistics.median(x[m] for x in v) for m in ("seconds", "rss_growth")}
            for k, v in results.items()
        }
        print(
            f"{args.gib:g} GiB source (half params, half optimizer state), {args.repeats} repeats, "
            f"budget {args.budget_mib} MiB, "
            f"load average {os.getloadavg()[0]:.1f}"
        )
        for surgery in ("full", "prune", "rename"):
            m, o = med[("milepost", surgery)], med[("orbax", surgery)]
            t_ratio, r_ratio = (
                m["seconds"] / o["seconds"],
                m["rss_growth"] / max(o["rss_growth"], 1),
            )
            print(
                f"  {surgery:<7} milepost {m['seconds']:.2f}s {m['rss_growth'] / 2**20:7.0f} MiB | "
                f"orbax {o['seconds']:.2f}s {o['rss_growth'] / 2**20:7.0f} MiB | "
                f"time {t_ratio:.2f}x, peak RSS growth {r_ratio:.2f}x"
            )
        full = med[("milepost", "full")]["seconds"] / med[("orbax", "full")]["seconds"]
        full_rss = med[("milepost", "full")]["rss_growth"] / max(
            med[("orbax", "full")]["rss_growth"], 1
        )
        rename = med[("milepost", "rename")]["seconds"] / med[("orbax", "rename")]["seconds"]
        print(
            f"  targets: full time <= 0.5x {'PASS' if full <= 0.5 else 'FAIL'}; full RSS <= 0.3x "
            f"{'PASS' if full_rss <= 0.3 else 'FAIL'}; "
            f"rename-only time <= 0.1x {'PASS' if rename <= 0.1 else 'FAIL'}"
        )
        print(json.dumps({f"{t}-{s}": v for (t, s), v in med.items()}))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
