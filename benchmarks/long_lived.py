"""Saves and loads again and again in one long-lived process (a notebook, a training script).

    python benchmarks/long_lived.py [--gib 0.5] [--rounds 5] [--parts saves,first,loop,budget,loads]

The data is 8 float32 arrays of (rows, 8192), every byte on exactly one of 8 fake CPU devices
(a (2, 4) mesh), ``gib`` GiB in all. Each part runs in a fresh process of its own:

* ``saves``: ``save`` and ``save_async(...).result()`` alternating (order flipped every round)
  after one untimed save of each; the total of each and save_async's blocking part. Target:
  save_async total <= 1.2x save total.
* ``first``: the first ``save`` and the first ``save_async(...).result()`` of a fresh process,
  each in its own, alternating, ``rounds`` each: a save_async must fault in its staging buffers
  (no earlier save left them), a sync save needs none.
* ``loop``: ``save_async`` of the same tree ``rounds`` times, each waited for before the next
  (a Checkpointer's loop); the blocking part of saves 2..n against a warm host copy of the same
  shards (``np.copyto`` into buffers already touched, one thread). Target: <= 1.2x.
* ``budget``: ``save_async`` with ``SaveOptions(host_staging_budget_bytes=gib/4)`` against one
  without a budget, each in a fresh process; blocking, total and peak RSS growth (the kernel's
  high-water mark, reset before the call). Target: growth <= budget + 10%.
* ``loads``: cold loads (page cache evicted) of the same checkpoint by milepost and Orbax v1,
  alternating, ``rounds`` each, the loaded arrays deleted after each; every load checked
  exact; the page faults each load took; once per round, the disk's floor: every file of the
  checkpoint read cold into memory touched before (64 MiB preads on 4 threads, the fastest of
  4-64 MiB pieces on 2-8 threads here). Target: milepost's loads 2..n <= 0.6x Orbax's, same run.
"""

from __future__ import annotations

import argparse
import os
import resource
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

N_ARRAYS = 8
COLS = 8192
SPECS = [("a", "b"), ("b", "a"), (("a", "b"), None), (None, ("a", "b"))]


def build(gib: float) -> dict[str, Any]:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, 4), ("a", "b"))
    rows = max(8, int(gib * 2**30 / N_ARRAYS / 4 / COLS) // 8 * 8)
    rng = np.random.default_rng(0)
    tree = {
        f"layer{i}": jax.device_put(
            rng.standard_normal((rows, COLS), dtype=np.float32),
            NamedSharding(mesh, P(*SPECS[i % 4])),
        )
        for i in range(N_ARRAYS)
    }
    return jax.block_until_ready(tree)


def warm(nbytes: int) -> None:
    """Touch and free memory, so the timed parts start on pages the VM's host already backs
    (benchmarks/NOTES.md: this VM hands freed memory back to its host)."""
    scratch = np.ones(nbytes, np.uint8)
    del scratch


def timed_save(mp: Any, path: str, tree: Any, op: str) -> tuple[float, float | None]:
    """``mp.save`` (op "save") or ``mp.save_async(...).result()`` of ``tree`` to ``path``, which
    is removed after: the total seconds, and save_async's blocking part (None for a save)."""
    t0 = time.perf_counter()
    block = None
    if op == "save":
        mp.save(path, tree)
    else:
        handle = mp.save_async(path, tree)
        block = time.perf_counter() - t0
        handle.result()
    total = time.perf_counter() - t0
    shutil.rmtree(path)
    return total, block


def worker_saves(gib: float, rounds: int, directory: str) -> dict[str, Any]:
    import milepost as mp

    tree = build(gib)
    warm(int(2.5 * gib * 2**30))
    times: dict[str, list[float]] = {"save": [], "save_async": [], "save_async_block": []}
    for r in range(rounds + 1):
        order = ["save", "save_async"] if r % 2 == 0 else ["save_async", "save"]
        for op in order:
            total, block = timed_save(mp, os.path.join(directory, f"{op}-{r}"), tree, op)
            if r > 0:  # round 0 is the untimed warm-up of both
                times[op].append(total)
                if block is not None:
                    times["save_async_block"].append(block)
    return times


def worker_loop(gib: float, rounds: int, directory: str) -> dict[str, Any]:
    import milepost as mp

    tree = build(gib)
    shards = [s.data for x in tree.values() for s in x.addressable_shards]
    warm(int(2.5 * gib * 2**30))
    into = [np.ones(s.shape, s.dtype) for s in shards]
    copies = []
    for _ in range(3):
        t0 = time.perf_counter()
        for out, shard in zip(into, shards, strict=True):
            np.copyto(out, np.asarray(shard))
        copies.append(time.perf_counter() - t0)
    del into
    blocks, totals = [], []
    for k in range(rounds):
        path = os.path.join(directory, f"loop-{k}")
        t0 = time.perf_counter()
        handle = mp.save_async(path, tree)
        blocks.append(time.perf_counter() - t0)
        handle.result()
        totals.append(time.perf_counter() - t0)
    for k in range(rounds):
        shutil.rmtree(os.path.join(directory, f"loop-{k}"))
    return {"hostcopy": copies, "block": blocks, "total": totals}


def worker_first(gib: float, op: str, directory: str) -> dict[str, Any]:
    """The first save of a fresh process (memory touched and freed before, as everywhere here)."""
    import milepost as mp

    tree = build(gib)
    warm(int(2.5 * gib * 2**30))
    total, block = timed_save(mp, os.path.join(directory, f"first-{op}"), tree, op)
    return {"total": total, "block": block}


def worker_budget(gib: float, budget: int | None, directory: str) -> dict[str, Any]:
    import milepost as mp

    tree = build(gib)
    warm(int(2.5 * gib * 2**30))
    path = os.path.join(directory, f"budget-{budget}")
    with mp.Context(saving=mp.SaveOptions(host_staging_budget_bytes=budget)), PeakRss() as rss:
        t0 = time.perf_counter()
        handle = mp.save_async(path, tree)
        block = time.perf_counter() - t0
        handle.result()
        total = time.perf_counter() - t0
    import jax

    loaded = mp.load(
        path,
        {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in tree.items()},
    )
    exact = all(np.array_equal(np.asarray(loaded[k]), np.asarray(v)) for k, v in tree.items())
    shutil.rmtree(path)
    return {"block": block, "total": total, "rss_growth": rss.growth, "exact": exact}


def worker_loads(gib: float, rounds: int, directory: str) -> dict[str, Any]:
    import jax
    import orbax.checkpoint.experimental.v1 as ocp

    import milepost as mp

    tree = build(gib)
    path = os.path.join(directory, "loads")
    mp.save(path, tree)
    abstract = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in tree.items()
    }
    expected = {k: np.asarray(v) for k, v in tree.items()}
    del tree
    times: dict[str, list[float]] = {
        "milepost": [],
        "orbax": [],
        "milepost_faults": [],
        "orbax_faults": [],
        "floor": [],
    }
    floor = _Floor(path)
    exact = True
    for r in range(rounds):
        evict(path)
        times["floor"].append(floor.read())
        for who in ("milepost", "orbax") if r % 2 == 0 else ("orbax", "milepost"):
            evict(path)
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            out = mp.load(path, abstract) if who == "milepost" else ocp.load_pytree(path, abstract)
            jax.block_until_ready(out)
            times[who].append(time.perf_counter() - t0)
            times[f"{who}_faults"].append(
                resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            )
            exact = exact and all(np.array_equal(np.asarray(out[k]), expected[k]) for k in expected)
            del out
    return times | {"exact": exact}


class _Floor:
    """The disk's floor for a cold load: every file of the checkpoint read (4 threads, 64 MiB
    preads) into one buffer touched before, nothing else done with the bytes."""

    PIECE = 64 << 20

    def __init__(self, path: str) -> None:
        files = [os.path.join(d, f) for d, _, names in os.walk(path) for f in names]
        self.pieces = [
            (f, off, min(self.PIECE, os.path.getsize(f) - off))
            for f in files
            for off in range(0, os.path.getsize(f), self.PIECE)
        ]
        self.buffer = np.ones(sum(n for _, _, n in self.pieces), np.uint8)

    def read(self) -> float:
        from concurrent.futures import ThreadPoolExecutor

        flat = memoryview(self.buffer)
        starts = np.cumsum([0] + [n for _, _, n in self.pieces]).tolist()

        def one(k: int) -> None:
            name, off, n = self.pieces[k]
            fd = os.open(name, os.O_RDONLY)
            try:
                assert os.preadv(fd, [flat[starts[k] : starts[k] + n]], off) == n
            finally:
                os.close(fd)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(one, range(len(self.pieces))))
        return time.perf_counter() - t0


def fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} s ({min(xs):.3f}-{max(xs):.3f})"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gib", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--parts", default="saves,first,loop,budget,loads")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import json

        budget = None if args.budget < 0 else args.budget
        fn = {"saves": worker_saves, "loop": worker_loop, "loads": worker_loads}.get(args.worker)
        if args.worker == "budget":
            out = worker_budget(args.gib, budget, args.dir)
        elif args.worker.startswith("first-"):
            out = worker_first(args.gib, args.worker.removeprefix("first-"), args.dir)
        else:
            out = fn(args.gib, args.rounds, args.dir)  # type: ignore[misc]
        print(json.dumps(out))
        return 0
    parts = args.parts.split(",")
    directory = tempfile.mkdtemp(
        prefix="milepost-long-lived-", dir=os.environ.get("TMPDIR", "/tmp")
    )
    here = str(Path(__file__).resolve())
    common = ["--gib", str(args.gib), "--rounds", str(args.rounds), "--dir", directory]
    print(f"{args.gib} GiB over 8 CPU devices; load average {os.getloadavg()[0]:.1f}")
    try:
        if "saves" in parts:
            t = run_worker(here, ["--worker", "saves", *common])
            ratio = statistics.median(t["save_async"]) / statistics.median(t["save"])
            print(
                f"saves:  save {fmt(t['save'])}; save_async total {fmt(t['save_async'])}, blocking "
                f"{fmt(t['save_async_block'])}; total ratio {ratio:.2f}x (target <= 1.2x)"
            )
        if "first" in parts:
            firsts: dict[str, list[float]] = {"save": [], "save_async": []}
            blocks = []
            for r in range(args.rounds):
                for op in ("save", "save_async") if r % 2 == 0 else ("save_async", "save"):
                    t = run_worker(here, ["--worker", f"first-{op}", *common])
                    firsts[op].append(t["total"])
                    if t["block"] is not None:
                        blocks.append(t["block"])
            ratio = statistics.median(firsts["save_async"]) / statistics.median(firsts["save"])
            print(
                f"first:  the first save of a fresh process: save {fmt(firsts['save'])}; "
                f"save_async total {fmt(firsts['save_async'])}, blocking {fmt(blocks)}; "
                f"total ratio {ratio:.2f}x"
            )
        if "loop" in parts:
            t = run_worker(here, ["--worker", "loop", *common])
            copy = min(t["hostcopy"])
            later = t["block"][1:]
            print(
                f"loop:   warm host copy {copy:.3f} s; blocking of save 1 {t['block'][0]:.3f} s, "
                f"saves 2..n {fmt(later)} ({statistics.median(later) / copy:.2f}x the copy, "
                f"target <= 1.2x); totals {fmt(t['total'])}"
            )
        if "budget" in parts:
            budget = int(args.gib * 2**30 / 4)
            free = run_worker(here, ["--worker", "budget", "--budget", "-1", *common])
            capped = run_worker(here, ["--worker", "budget", "--budget", str(budget), *common])
            mib = 2**20
            print(
                f"budget: no budget: blocking {free['block']:.3f} s, total {free['total']:.3f} s, "
                f"peak RSS +{free['rss_growth'] / mib:.0f} MiB; budget {budget / mib:.0f} MiB: "
                f"blocking {capped['block']:.3f} s, total {capped['total']:.3f} s, peak RSS "
                f"+{capped['rss_growth'] / mib:.0f} MiB ({capped['rss_growth'] / budget:.2f}x the "
                f"budget, target <= 1.1x); exact {free['exact'] and capped['exact']}"
            )
        if "loads" in parts:
            t = run_worker(here, ["--worker", "loads", *common])
            later = [m / o for m, o in zip(t["milepost"][1:], t["orbax"][1:], strict=True)]
            print(
                f"loads:  milepost {[round(x, 3) for x in t['milepost']]}, "
                f"Orbax {[round(x, 3) for x in t['orbax']]}; loads 2..n milepost/Orbax median "
                f"{statistics.median(later):.2f}x (target <= 0.6x); exact {t['exact']}; "
                f"page faults per load: milepost {t['milepost_faults']}, Orbax {t['orbax_faults']}"
            )
            floor = statistics.median(t["floor"])
            print(
                "        the disk's floor (the files read cold into touched memory: 64 MiB preads, "
                f"4 threads) {[round(x, 3) for x in t['floor']]}: "
                f"loads 2..n milepost {statistics.median(t['milepost'][1:]) / floor:.2f}x it, "
                f"Orbax {statistics.median(t['orbax'][1:]) / floor:.2f}x it"
            )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
