"""Subchunking and resharding (Orbax paper, the (2, 4) -> (8, 1) case), side by side in one run.

    python benchmarks/subchunk_bench.py [--gib 0.5] [--repeats 3] [--dir /tmp/x]
                                        [--chunk-mib 4 ...] [--no-auto]

8 float32 arrays of (rows, 8192) over 8 fake CPU devices, saved sharded ``P('data', 'model')`` on
a (2, 4) mesh: each written shard is (rows/2, 2048). Loaded:

* ``same``: onto the same (2, 4) sharding (every device reads its own written shard);
* ``reshard``: onto ``P('x', None)`` over 8 devices (a (8, 1) sharding): each target shard is
  (rows/8, 8192), spans four written shards across ``model`` and keeps a quarter of the rows of
  each. Without subchunking every written shard is one chunk, and every chunk read is checked
  whole (its CRC32C), so a device reads 4x what it keeps. With ``chunk_byte_size`` the shard is
  cut into row bands (its first dimension halves first), and a device reads only the bands it
  keeps.

Cases: ``none`` (``chunk_byte_size=None``: one chunk per shard), ``auto`` (the default: bands of
about 1 MiB for shards of 2 MiB and more, here the same as 1 MiB), and each ``--chunk-mib``.
Each checkpoint is saved once per repeat in a fresh
process (the save time is reported too), and each load runs cold (page cache evicted) in a fresh
process; storage bytes read come from ``milepost.io_stats()``. Prints time and bytes read per
case, the ratios, and the issue's targets: subchunked resharded load <= 1.2x the same-topology
load and <= 1.05x the bytes needed; same-topology save and load with the candidate default
within 1.05x of no subchunking.
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

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PeakRss, evict, median, run_worker

N = 8
COLS = 8192


def rows_for(gib: float) -> int:
    return max(64, round(gib * 2**30 / N / 4 / COLS / 64) * 64)


def values(gib: float) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {f"w{i}": rng.standard_normal((rows_for(gib), COLS), dtype=np.float32) for i in range(N)}


def shardings(kind: str) -> Any:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    if kind == "same":
        return NamedSharding(jax.make_mesh((2, 4), ("data", "model")), P("data", "model"))
    return NamedSharding(jax.make_mesh((8,), ("x",)), P("x", None))


def worker(op: str, path: str, gib: float, chunk: int | str | None) -> dict[str, Any]:
    import jax

    import milepost as mp

    if op == "save":
        data = values(gib)
        tree = {k: jax.device_put(v, shardings("same")) for k, v in data.items()}
        del data
        jax.block_until_ready(tree)
        with mp.Context(saving=mp.SaveOptions(chunk_byte_size=chunk)):
            t0, c0 = time.perf_counter(), time.process_time()
            mp.save(path, tree)
            secs, cpu = time.perf_counter() - t0, time.process_time() - c0
        chunk_shape = mp.metadata(path).tree["w0"].chunk_shape
        return {"secs": secs, "cpu": cpu, "chunk_shape": list(chunk_shape)}
    kind = op.removeprefix("load-")
    rows = rows_for(gib)
    abstract = {
        f"w{i}": jax.ShapeDtypeStruct((rows, COLS), np.float32, sharding=shardings(kind))
        for i in range(N)
    }
    evict(path)
    before = mp.io_stats()
    with PeakRss() as rss:
        t0, c0 = time.perf_counter(), time.process_time()
        got = jax.block_until_ready(mp.load(path, abstract))
        secs, cpu = time.perf_counter() - t0, time.process_time() - c0
    read = (mp.io_stats() - before).bytes_read
    expected = values(gib)
    exact = all(np.array_equal(np.asarray(got[k]), v) for k, v in expected.items())
    if not exact:
        raise SystemExit(f"{op} of {path} returned different values")
    needed = sum(
        v.nbytes for v in expected.values()
    )  # every device keeps a distinct part: 1x in all
    return {
        "secs": secs,
        "cpu": cpu,
        "bytes_read": read,
        "needed": needed,
        "rss_growth": rss.growth,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gib", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--chunk-mib", type=float, nargs="*", default=[4.0, 1.0])
    parser.add_argument(
        "--no-auto", action="store_true", help="leave out the default chunking ('auto')"
    )
    parser.add_argument("--worker", default=None)
    parser.add_argument("--path", default=None)
    parser.add_argument("--chunk", default="none")
    args = parser.parse_args()
    if args.worker:
        chunk = (
            None if args.chunk == "none" else "auto" if args.chunk == "auto" else int(args.chunk)
        )
        print(json.dumps(worker(args.worker, args.path, args.gib, chunk)))
        return

    script = os.path.abspath(__file__)
    base = Path(tempfile.mkdtemp(prefix="subchunk-", dir=args.dir))
    cases: dict[str, int | str | None] = {
        "none": None,
        **({} if args.no_auto else {"auto": "auto"}),
    }
    cases.update({f"{m:g} MiB": int(m * 2**20) for m in args.chunk_mib})
    results: dict[str, dict[str, list[float]]] = {c: {} for c in cases}
    cpus: dict[str, dict[str, list[float]]] = {
        c: {} for c in cases
    }  # CPU seconds of the process (all threads)
    shapes: dict[str, Any] = {}
    reads: dict[str, dict[str, int]] = {c: {} for c in cases}
    needed = 0
    try:
        for r in range(args.repeats):
            order = list(cases) if r % 2 == 0 else list(reversed(cases))
            for case in order:
                path = str(base / f"ckpt-{case.replace(' ', '')}")
                shutil.rmtree(path, ignore_errors=True)
                common = [
                    "--gib",
                    str(args.gib),
                    "--path",
                    path,
                    "--chunk",
                    str(cases[case] or "none"),
                ]
                saved = run_worker(script, ["--worker", "save", *common])
                results[case].setdefault("save", []).append(saved["secs"])
                cpus[case].setdefault("save", []).append(saved["cpu"])
                shapes[case] = saved["chunk_shape"]
                kinds = ["same", "reshard"] if r % 2 == 0 else ["reshard", "same"]
                for kind in kinds:
                    got = run_worker(script, ["--worker", f"load-{kind}", *common])
                    results[case].setdefault(kind, []).append(got["secs"])
                    cpus[case].setdefault(kind, []).append(got["cpu"])
                    reads[case][kind] = got["bytes_read"]
                    needed = got["needed"]
                shutil.rmtree(path, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    med = {c: {k: median(v) for k, v in results[c].items()} for c in cases}
    gib = needed / 2**30
    print(
        f"\n{N} arrays of ({rows_for(args.gib)}, {COLS}) float32 = {gib:.2f} GiB; "
        "saved P('data','model') on (2, 4); "
        f"median of {args.repeats} (fresh processes, cold loads)"
    )
    print(
        f"{'chunking':<10} {'chunk shape':<14} {'save s':>7} {'same s':>7} {'reshard s':>10} "
        f"{'reshard/same':>13} {'read same':>10} {'read reshard':>13} "
        f"{'reshard read/needed':>20}"
    )
    for c in cases:
        m = med[c]
        print(
            f"{c:<10} {tuple(shapes[c])!s:<14} {m['save']:>7.3f} {m['same']:>7.3f} "
            f"{m['reshard']:>10.3f} {m['reshard'] / m['same']:>13.2f} "
            f"{reads[c]['same'] / 2**30:>9.2f}G {reads[c]['reshard'] / 2**30:>12.2f}G "
            f"{reads[c]['reshard'] / needed:>20.2f}"
        )
    print("\nevery run, in the order run: seconds (CPU seconds of the process, all threads)")
    for c in cases:
        for k in ("save", "same", "reshard"):
            runs = " ".join(
                f"{x:.3f} ({y:.2f})" for x, y in zip(results[c][k], cpus[c][k], strict=True)
            )
            print(f"  {c:<10} {k:<8} {runs}   median CPU {median(cpus[c][k]):.3f}")
    print("\ntargets (issue #16, part 3):")
    for c in cases:
        if cases[c] is None:
            continue
        ok_time = med[c]["reshard"] <= 1.2 * med["none"]["same"]
        ok_bytes = reads[c]["reshard"] <= 1.05 * needed
        print(
            f"  {c}: resharded load {med[c]['reshard'] / med['none']['same']:.2f}x "
            f"the same-topology load (<= 1.2: {'PASS' if ok_time else 'FAIL'}), "
            f"reads {reads[c]['reshard'] / needed:.3f}x needed "
            f"(<= 1.05: {'PASS' if ok_bytes else 'FAIL'}); "
            f"same-topology save {med[c]['save'] / med['none']['save']:.2f}x, "
            f"load {med[c]['same'] / med['none']['same']:.2f}x of no subchunking "
            "(<= 1.05 for a default)"
        )


if __name__ == "__main__":
    main()
