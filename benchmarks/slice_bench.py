"""Slice mode (4 hosts x 2 devices on Ray) against the embedded mode on the same data size.

    python benchmarks/slice_bench.py [--gib 2.0 ...] [--hosts 4] [--devices-per-host 2]
                                     [--repeat 2] [--rounds 1]

Reports save blocking and total time, cold load time, the controller's peak RSS growth and the
bytes that passed between controller and hosts, and the slice/embedded ratios. ``load repl bc``
is the replicated load with load-and-broadcast (``LoadOptions(load_and_broadcast=True,
replica_axis='data')``): in a slice only replica 0's hosts read, the others receive by a
collective; embedded it changes nothing. Bytes read from storage and moved between hosts per
load come from ``milepost.io_stats``. With ``--rounds N`` the embedded and slice workers (fresh
processes) alternate N times, order flipped each round, and the figures are medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PeakRss, evict, median, run_worker

N_ARRAYS = 8
COLS = 4096
LOADS = {"load": ("model", "data"), "load_repl": ("model",), "load_repl_bc": ("model",)}
"""Cold loads, all resharded from the saved P('data', 'model'): every device a distinct box, and
replicated over 'data' (the embedded mode reads each box once and copies it to both devices; a
slice's hosts each read the boxes of their own devices, twice the reading in all), and the same
with load-and-broadcast (a slice's replica-0 hosts read, the others receive)."""
BROADCAST = {"load_repl_bc"}


def rows_for(gib: float) -> int:
    return max(8, int(gib * 2**30 / N_ARRAYS / 4 / COLS) // 8 * 8)


def embedded(directory: str, gib: float, repeat: int) -> dict:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import milepost as mp

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    rows = rows_for(gib)
    make = jax.jit(
        lambda k: jax.random.normal(k, (rows, COLS)),
        out_shardings=NamedSharding(mesh, P("data", "model")),
    )
    tree = {f"w{i}": make(jax.random.key(i)) for i in range(N_ARRAYS)}
    jax.block_until_ready(tree)
    abstracts = {
        key: {
            k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P(*spec)))
            for k, x in tree.items()
        }
        for key, spec in LOADS.items()
    }
    path = os.path.join(directory, "embedded")
    out: dict = {"bytes": sum(x.nbytes for x in tree.values())}
    out.update(timed_save(mp, path, tree, repeat))
    del tree
    loads = {
        key: lambda a=abstract: jax.block_until_ready(mp.load(path, a))
        for key, abstract in abstracts.items()
    }
    out.update(timed_loads(mp, path, loads, repeat, lambda: mp.io_stats()))
    shutil.rmtree(path)
    return out


def timed_save(mp: Any, path: str, tree: Any, repeat: int) -> dict:
    """Best of ``repeat`` saves (the machine is shared: the minimum is the least noisy); the
    largest peak RSS growth."""
    best: dict = {}
    growth = 0
    every: list[float] = []
    for _ in range(repeat):
        if os.path.exists(path):
            shutil.rmtree(path)
        with PeakRss() as rss:
            t0 = time.perf_counter()
            h = mp.save_async(path, tree)
            block = time.perf_counter() - t0
            h.result()
            total = time.perf_counter() - t0
        growth = max(growth, rss.growth)
        every.append(total)
        if not best or total < best["save_total"]:
            best = {"save_block": block, "save_total": total}
    return {
        **best,
        "save_rss_growth": growth,
        "save_total_every": every,
        "loadavg_after_save": os.getloadavg()[0],
    }


def timed_loads(mp: Any, path: str, loads: dict[str, Any], repeat: int, io_stats: Any) -> dict:
    """Best of ``repeat`` cold loads of each kind (kinds interleaved within a repeat); the
    largest peak RSS growth; the storage bytes read and bytes moved between hosts (last repeat)."""
    best = dict.fromkeys(loads, float("inf"))
    out: dict = {f"{key}_rss_growth": 0 for key in loads}
    out.update({f"{key}_every": [] for key in loads})
    for _ in range(repeat):
        for key, load in loads.items():
            options = (
                mp.LoadOptions(load_and_broadcast=True, replica_axis="data")
                if key in BROADCAST
                else mp.LoadOptions()
            )
            evict(path)
            before = io_stats()
            with mp.Context(loading=options), PeakRss() as rss:
                t0 = time.perf_counter()
                loaded = load()
                best[key] = min(best[key], time.perf_counter() - t0)
            out[f"{key}_every"].append(time.perf_counter() - t0)
            moved = io_stats() - before
            del loaded
            out[f"{key}_rss_growth"] = max(out[f"{key}_rss_growth"], rss.growth)
            out[f"{key}_read"] = moved.bytes_read
            out[f"{key}_between_hosts"] = moved.bytes_between_hosts
    out["loadavg_after_loads"] = os.getloadavg()[0]
    return {**out, **best}


def on_slice(directory: str, gib: float, hosts: int, per_host: int, repeat: int) -> dict:
    import jax
    import ray
    from jax.sharding import PartitionSpec as P

    import milepost as mp

    ray.init(
        num_cpus=max(8, hosts),
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=512 << 20,
    )
    rows = rows_for(gib)
    with mp.Slice.start(hosts=hosts, devices_per_host=per_host) as s:
        mesh = s.mesh({"data": 2, "model": hosts * per_host // 2})
        sharding = mesh.sharding(P("data", "model"))
        tree = {
            f"w{i}": s.run(
                lambda i=i: jax.random.normal(jax.random.key(i), (rows, COLS)),
                out_shardings=sharding,
            )
            for i in range(N_ARRAYS)
        }
        abstracts = {
            key: {
                k: mp.AbstractArray(v.shape, v.dtype, mesh.sharding(P(*spec)))
                for k, v in tree.items()
            }
            for key, spec in LOADS.items()
        }
        path = os.path.join(directory, "slice")
        out: dict = {"bytes": sum(x.nbytes for x in tree.values())}
        b0 = s.traffic()
        out.update(timed_save(mp, path, tree, repeat))
        out["save_controller_bytes"] = (s.traffic() - b0).total_bytes // repeat
        del tree
        b0 = s.traffic()
        loads = {key: lambda a=abstract: mp.load(path, a) for key, abstract in abstracts.items()}
        out.update(timed_loads(mp, path, loads, repeat, lambda: mp.io_stats(slice=s)))
        out["loads_controller_bytes"] = (s.traffic() - b0).total_bytes // repeat
        shutil.rmtree(path)
    ray.shutdown()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--gib", type=float, nargs="+", default=[2.0], help="checkpoint sizes, each run on its own"
    )
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--devices-per-host", type=int, default=2)
    parser.add_argument(
        "--repeat",
        type=int,
        default=2,
        help="best of N saves and of N loads (shared machines are noisy)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="alternate embedded and slice workers N times; medians over rounds",
    )
    parser.add_argument("--dir", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "embedded":
        print(json.dumps(embedded(args.dir, args.gib[0], args.repeat)))
        return 0
    if args.worker == "slice":
        print(
            json.dumps(
                on_slice(args.dir, args.gib[0], args.hosts, args.devices_per_host, args.repeat)
            )
        )
        return 0
    for gib in args.gib:
        report(gib, args)
    return 0


def report(gib_wanted: float, args: argparse.Namespace) -> None:
    directory = args.dir or tempfile.mkdtemp(prefix="milepost-slicebench-")
    common = [
        "--dir",
        directory,
        "--gib",
        str(gib_wanted),
        "--hosts",
        str(args.hosts),
        "--devices-per-host",
        str(args.devices_per_host),
        "--repeat",
        str(args.repeat),
    ]
    runs: dict[str, list[dict]] = {"embedded": [], "slice": []}
    loadavg = [os.getloadavg()[0]]
    try:
        for r in range(args.rounds):
            for side in ("embedded", "slice") if r % 2 == 0 else ("slice", "embedded"):
                devices = args.hosts * args.devices_per_host if side == "embedded" else 1
                runs[side].append(
                    run_worker(__file__, ["--worker", side, *common], devices=devices)
                )
                loadavg.append(os.getloadavg()[0])
    finally:
        if not args.dir:
            shutil.rmtree(directory, ignore_errors=True)
    emb = {
        k: median([run[k] for run in runs["embedded"]])
        for k in runs["embedded"][0]
        if not k.endswith("_every")
    }
    sl = {
        k: median([run[k] for run in runs["slice"]])
        for k in runs["slice"][0]
        if not k.endswith("_every")
    }
    gib = sl["bytes"] / 2**30
    print(
        f"\n{gib:.3f} GiB in {N_ARRAYS} float32 arrays; "
        f"slice {args.hosts} hosts x {args.devices_per_host} devices vs embedded "
        f"{args.hosts * args.devices_per_host} devices; medians of {args.rounds} round(s), "
        f"each the best of {args.repeat}; "
        f"1-min load average {min(loadavg):.2f}-{max(loadavg):.2f}"
    )
    times = ("save_block", "save_total", "load", "load_repl", "load_repl_bc")
    print(f"{'':<10}" + "".join(f"{k.replace('_', ' '):>14}" for k in times))
    for name, r in (("embedded", emb), ("slice", sl)):
        print(f"{name:<10}" + "".join(f"{r[k]:>13.3f}s" for k in times))
    if args.rounds > 1:
        for name in ("embedded", "slice"):
            spread = "".join(
                f"{min(x[k] for x in runs[name]):>6.3f}-{max(x[k] for x in runs[name]):<7.3f}"
                for k in times
            )
            print(f"{name + ' range':<10}{spread}")
    # Every call of every round (the best of each round is what the medians take): the swings.
    for name in ("embedded", "slice"):
        for r, run in enumerate(runs[name]):
            calls = "  ".join(
                f"{k.replace('_', ' ')} " + "/".join(f"{t:.3f}" for t in run[f"{k}_every"])
                for k in ("save_total", *LOADS)
            )
            print(
                f"  {name} round {r + 1} "
                f"(load average {run['loadavg_after_save']:.1f} after the saves, "
                f"{run['loadavg_after_loads']:.1f} after the loads): {calls}"
            )
    print(
        "(load: cold, resharded to P('model', 'data'); "
        "load repl: cold, to P('model'), replicated over 'data'; "
        "load repl bc: the same with load-and-broadcast)"
    )
    for name, r in (("embedded", emb), ("slice", sl)):
        read = " / ".join(f"{r[f'{k}_read'] / r['bytes']:.2f}x" for k in LOADS)
        print(
            f"{name:<10} storage bytes read per load (load / repl / repl bc), "
            f"of the checkpoint: {read}; "
            f"moved between hosts by repl bc: {r['load_repl_bc_between_hosts'] / r['bytes']:.2f}x"
        )
    print(
        f"controller<->host bytes: save {sl['save_controller_bytes']:.0f} "
        f"({sl['save_controller_bytes'] / N_ARRAYS:.0f}/array), "
        f"{len(LOADS)} loads {sl['loads_controller_bytes']:.0f} "
        f"({sl['loads_controller_bytes'] / N_ARRAYS / len(LOADS):.0f}/array/load)"
    )
    ratios = {key: sl[key] / emb[key] for key in ("save_total", "load", "load_repl")}
    ratios["load_repl_bc (vs embedded load_repl)"] = sl["load_repl_bc"] / emb["load_repl"]
    ratios["save_total+load"] = (sl["save_total"] + sl["load"]) / (emb["save_total"] + emb["load"])
    for key, ratio in ratios.items():
        print(
            f"  {'PASS' if ratio <= 1.3 else 'FAIL'}  slice/embedded {key}: {ratio:.2f} "
            "(target <= 1.3)"
        )
    growth = max(sl["save_rss_growth"], *(sl[f"{k}_rss_growth"] for k in LOADS)) / 2**20
    print(
        f"  {'PASS' if growth <= 100 else 'FAIL'}  controller peak RSS growth {growth:.1f} MiB "
        "(bound 100 MiB)"
    )


if __name__ == "__main__":
    sys.exit(main())
