"""Save and load ~1 GiB of sharded float32 arrays with milepost, Orbax v1 and plain NumPy.

    python benchmarks/save_load.py [--gib 1.0] [--repeats 3] [--dir /tmp/x] [--warm]
                                   [--only milepost,orbax,numpy,hostcopy] [--layout sharded|mixed]

The data is 8 float32 arrays of (rows, 8192) random values (``gib`` GiB in all), each a jax.Array
sharded over a (2, 4) mesh of 8 fake CPU devices. In the default ``sharded`` layout every byte lives
on exactly one device (the devices hold 1x the checkpoint bytes): 1 GiB sharded over 8 devices. In
the ``mixed`` layout some arrays are partially replicated, so the devices hold 2x the checkpoint
bytes: a load must then also fill the replicas, and the loaded arrays alone take 2x the
checkpoint's memory, which no loader can fit in the 1.3x load-memory target.

Every measured operation runs in its own fresh process (the script re-invokes itself with
``--worker OP``), so each peak RSS is clean:

* a save worker builds the data, records its RSS, then saves (fresh directory every repeat);
* a load worker evicts the checkpoint's files from the page cache, records its RSS, loads them
  cold into the saved shardings, and only then rebuilds the expected values and checks every array
  with ``np.array_equal`` (so the data is not in memory while loading);
* the host-copy workers time ``np.array(shard.data, copy=True)`` over every addressable shard
  (the reference for save_async's blocking part) and, for comparison, over replica 0 only.

``--warm``: right before its timed part, every worker (milepost and the references alike) touches
and frees 2.5x the checkpoint bytes. This VM hands freed guest memory back to the hypervisor
(virtio-balloon free page reporting, a few seconds after it is freed), and the first touch of such a
page costs a host fault: the same copy of the same shards measured 0.2 s or 1.2 s depending on what
ran before it. Warmed, each operation starts on memory the host already backs, so the ratios show
the software rather than the order of the runs. Without ``--warm`` (the default) nothing is done.

Peak RSS comes from the kernel's high-water marks (VmHWM and getrusage ru_maxrss, reset through
/proc/self/clear_refs). Only where the kernel does not allow that reset does a thread sample psutil
RSS every 5 ms instead: such a thread changes what it measures (with it, a cold load whose buffers
carry NumPy's huge-page hint ran 1.7x faster than without it). Prints the medians, the memory
figures and the targets with PASS/FAIL.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import psutil
from _common import make_cold

if TYPE_CHECKING:
    import jax

# Must be set before jax is imported (only the workers import it, and only inside functions).
_DEVICE_FLAG = "--xla_force_host_platform_device_count=8"
if _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

Result = dict[str, Any]

N_ARRAYS = 8
COLS = 8192
MESH_SHAPE = (2, 4)
MESH_AXES = ("a", "b")
SpecTuple = tuple[str | tuple[str, ...] | None, ...]
LAYOUTS: dict[str, list[SpecTuple]] = {
    # fully sharded, replicated 2x (over 'a'), replicated 4x (over 'b'), fully sharded
    "mixed": [("a", "b"), ("b", None), (None, "a"), ("b", "a")],
    # every byte on exactly one device: device bytes == checkpoint bytes
    "sharded": [("a", "b"), ("b", "a"), (("a", "b"), None), (None, ("a", "b"))],
}
# Operations of each variant, in the order they run; a variant's "load" reads what its "save" wrote.
OPS: dict[str, list[str]] = {
    "milepost": ["save", "save_async", "load"],
    "orbax": ["save", "load"],
    "numpy": ["save", "load"],
    "hostcopy": ["copy", "copy_replica0"],
}
MIB = 2**20
WARM = False  # set in a worker by --warm


def warm_memory(gib: float) -> None:
    """With --warm: touch and free 2.5x the checkpoint bytes, so the timed part that follows
    reuses pages the hypervisor already backs (see the module docstring)."""
    if WARM:
        scratch = np.ones(int(2.5 * gib * 2**30), dtype=np.uint8)
        del scratch


# ----------------------------------------------------------------------------------------- data


def array_shape(gib: float) -> tuple[int, int]:
    rows = max(8, round(gib * 2**30 / N_ARRAYS / 4 / COLS / 8) * 8)  # divisible by every mesh axis
    return rows, COLS


def host_arrays(gib: float) -> Iterator[tuple[str, np.ndarray]]:
    """The benchmark's values, regenerated identically on every call."""
    rng = np.random.default_rng(0)
    for i in range(N_ARRAYS):
        yield f"layer{i}", rng.standard_normal(array_shape(gib), dtype=np.float32)


def shardings(layout: str) -> dict[str, jax.sharding.NamedSharding]:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.make_mesh(MESH_SHAPE, MESH_AXES)
    specs = LAYOUTS[layout]
    return {
        f"layer{i}": NamedSharding(mesh, PartitionSpec(*specs[i % len(specs)]))
        for i in range(N_ARRAYS)
    }


def build_tree(gib: float, layout: str) -> dict[str, jax.Array]:
    import jax

    target = shardings(layout)
    tree = {name: jax.device_put(values, target[name]) for name, values in host_arrays(gib)}
    return jax.block_until_ready(tree)


def abstract_tree(gib: float, layout: str) -> dict[str, jax.ShapeDtypeStruct]:
    import jax

    return {
        name: jax.ShapeDtypeStruct(array_shape(gib), np.dtype(np.float32), sharding=s)
        for name, s in shardings(layout).items()
    }


def sizes(tree: dict[str, jax.Array]) -> Result:
    return {
        "ckpt_bytes": sum(x.nbytes for x in tree.values()),
        "device_bytes": sum(s.data.nbytes for x in tree.values() for s in x.addressable_shards),
    }


def check(
    restored: dict[str, jax.Array], abstract: dict[str, jax.ShapeDtypeStruct], gib: float
) -> Result:
    """After timing: every array equals the saved values exactly and has the requested sharding."""
    exact = sharding_ok = True
    for name, expected in host_arrays(gib):
        got = restored[name]
        sharding_ok &= got.sharding.is_equivalent_to(abstract[name].sharding, got.ndim)
        exact &= bool(np.array_equal(np.asarray(got), expected))
    return {"exact": exact, "sharding_ok": sharding_ok}


# ------------------------------------------------------------------------------ page cache, RSS


def _vm_hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class RssMonitor:
    """Peak RSS of this process during a ``with`` block.

    On entry the kernel's RSS high-water mark is reset (``5`` into /proc/self/clear_refs), so
    VmHWM and getrusage's ru_maxrss then cover the block alone, every spike included. Where the
    kernel does not allow the reset, a daemon thread samples psutil RSS every ``interval``
    seconds instead (it perturbs page-fault-heavy code, so it runs only as the fallback).
    ``peak`` is the highest valid reading; ``baseline`` is the RSS right before the block.
    """

    def __init__(self, interval: float = 0.005) -> None:
        self._process = psutil.Process()
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self.baseline = self.sampled_peak = self.vm_hwm = self.ru_maxrss = 0
        self.hwm_reset = False

    def _rss(self) -> int:
        return int(self._process.memory_info().rss)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.sampled_peak = max(self.sampled_peak, self._rss())
            self._stop.wait(self._interval)

    def __enter__(self) -> RssMonitor:
        self.baseline = self.sampled_peak = self._rss()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.hwm_reset = True
        except OSError:
            self.hwm_reset = False
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.sampled_peak = max(self.sampled_peak, self._rss())
        self.vm_hwm = _vm_hwm()
        self.ru_maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

    @property
    def peak(self) -> int:
        kernel = max(self.vm_hwm, self.ru_maxrss) if self.hwm_reset else 0
        return max(self.sampled_peak, kernel)

    def report(self) -> Result:
        return {
            "rss_baseline": self.baseline,
            "rss_peak": self.peak,
            "rss_growth": self.peak - self.baseline,
            "rss_sampled_peak": self.sampled_peak,
            "rss_vm_hwm": self.vm_hwm,
            "rss_ru_maxrss": self.ru_maxrss,
            "rss_hwm_reset": self.hwm_reset,
        }


# ------------------------------------------------------------------------------------- workers


def numpy_save(path: str, tree: dict[str, jax.Array]) -> None:
    os.makedirs(path)
    for name, x in tree.items():
        host = np.asarray(x)
        with open(os.path.join(path, name), "wb") as f:
            host.tofile(f)
            f.flush()
            os.fsync(f.fileno())


def worker_save(variant: str, path: str, gib: float, layout: str) -> Result:
    if variant == "milepost":
        import milepost
    elif variant == "orbax":
        import orbax.checkpoint.experimental.v1 as ocp
    tree = build_tree(gib, layout)
    out = sizes(tree)
    warm_memory(gib)
    with RssMonitor() as rss:
        t0 = time.perf_counter()
        if variant == "milepost":
            milepost.save(path, tree)
        elif variant == "orbax":
            ocp.save_pytree(path, tree)
        else:
            numpy_save(path, tree)
        out["time"] = time.perf_counter() - t0
    return out | rss.report()


def worker_save_async(path: str, gib: float, layout: str) -> Result:
    import milepost

    tree = build_tree(gib, layout)
    out = sizes(tree)
    warm_memory(gib)
    with RssMonitor() as rss:
        t0 = time.perf_counter()
        handle = milepost.save_async(path, tree)
        out["time_block"] = time.perf_counter() - t0
        handle.result()
        out["time"] = time.perf_counter() - t0
    return out | rss.report()


def worker_load(variant: str, path: str, gib: float, layout: str) -> Result:
    import jax

    if variant == "milepost":
        import milepost
    elif variant == "orbax":
        import orbax.checkpoint.experimental.v1 as ocp
    abstract = abstract_tree(gib, layout)
    out = make_cold(path)
    warm_memory(gib)
    with RssMonitor() as rss:
        t0 = time.perf_counter()
        if variant == "milepost":
            restored = milepost.load(path, abstract)
        elif variant == "orbax":
            restored = ocp.load_pytree(path, abstract)
        else:
            host = {
                name: np.fromfile(os.path.join(path, name), dtype=a.dtype).reshape(a.shape)
                for name, a in abstract.items()
            }
            out["time"] = time.perf_counter() - t0  # the reference: a plain cold read
            restored = {
                name: jax.device_put(host[name], a.sharding) for name, a in abstract.items()
            }
        jax.block_until_ready(restored)
        out["time_put" if variant == "numpy" else "time"] = time.perf_counter() - t0
    return out | rss.report() | check(restored, abstract, gib)


def worker_hostcopy(gib: float, layout: str, replica0_only: bool) -> Result:
    """Copy shards to host memory and keep the copies, as a save_async must.

    ``replica0_only`` copies each distinct shard once (the bytes a checkpoint holds) instead of
    every addressable shard; it runs in its own process so neither run reuses the other's pages.
    """
    tree = build_tree(gib, layout)
    out = sizes(tree)
    shards = [
        s
        for x in tree.values()
        for s in x.addressable_shards
        if not replica0_only or s.replica_id == 0
    ]
    warm_memory(gib)
    with RssMonitor() as rss:
        t0 = time.perf_counter()
        copies = [np.array(s.data, copy=True) for s in shards]
        out["time"] = time.perf_counter() - t0
    out["copied_bytes"] = sum(c.nbytes for c in copies)
    return out | rss.report()


def run_worker_op(op: str, path: str, gib: float, layout: str) -> Result:
    variant, _, action = op.partition("-")
    if action == "save":
        return worker_save(variant, path, gib, layout)
    if action == "save_async":
        return worker_save_async(path, gib, layout)
    if action == "load":
        return worker_load(variant, path, gib, layout)
    if action in ("copy", "copy_replica0"):
        return worker_hostcopy(gib, layout, replica0_only=action == "copy_replica0")
    raise ValueError(f"unknown worker op {op!r}")


# -------------------------------------------------------------------------------------- parent


def spawn(op: str, path: str, args: argparse.Namespace) -> Result:
    """Run one operation in a fresh process; its last stdout line is a JSON result."""
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        op,
        "--path",
        path,
        "--gib",
        str(args.gib),
        "--layout",
        args.layout,
    ]
    if args.warm:
        cmd.append("--warm")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s", "traceback": ""}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = proc.stderr.strip().splitlines()
    return {
        "error": f"exit code {proc.returncode}: {tail[-1] if tail else ''}",
        "traceback": proc.stderr[-6000:],
    }


def median(runs: list[Result], key: str) -> float:
    values = [r[key] for r in runs if key in r]
    return statistics.median(values) if values else float("nan")


def version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def report(results: dict[str, dict[str, list[Result]]], args: argparse.Namespace) -> None:
    ok = [r for ops in results.values() for rs in ops.values() for r in rs if "ckpt_bytes" in r]
    if not ok:
        print("\nno operation succeeded")
        return
    ckpt, device = ok[0]["ckpt_bytes"], ok[0]["device_bytes"]
    shape = array_shape(args.gib)

    def runs(variant: str, op: str) -> list[Result]:
        return [r for r in results.get(variant, {}).get(op, []) if "error" not in r]

    def med(variant: str, op: str, key: str) -> float:
        return median(runs(variant, op), key)

    print(
        f"\n{ckpt / 2**30:.3f} GiB checkpoint: {N_ARRAYS} float32 arrays {shape}, "
        f"'{args.layout}' layout over a {MESH_SHAPE} mesh of 8 CPU devices "
        f"(devices hold {device / ckpt:.2f}x the checkpoint bytes)"
    )
    print(
        f"jax {version('jax')}, orbax-checkpoint {version('orbax-checkpoint')}, "
        f"milepost {version('milepost')}; "
        f"median of {args.repeats} repeat(s), each operation in a fresh process, loads cold"
        + (", memory warmed before timing (--warm)" if args.warm else "")
    )

    time_rows = [
        ("milepost save", "milepost", "save", "time"),
        ("milepost save_async, until it returns", "milepost", "save_async", "time_block"),
        ("milepost save_async, until result()", "milepost", "save_async", "time"),
        ("milepost load (cold)", "milepost", "load", "time"),
        ("orbax save_pytree", "orbax", "save", "time"),
        ("orbax load_pytree (cold)", "orbax", "load", "time"),
        ("numpy asarray + tofile + fsync", "numpy", "save", "time"),
        ("numpy fromfile (cold)", "numpy", "load", "time"),
        ("numpy fromfile + device_put (cold)", "numpy", "load", "time_put"),
        ("host copy, every addressable shard", "hostcopy", "copy", "time"),
        ("host copy, replica-0 shards only", "hostcopy", "copy_replica0", "time"),
    ]
    print(f"\n{'Time':<40} {'median s':>9} {'ckpt GiB/s':>10}   runs (s)")
    for label, variant, op, key in time_rows:
        if variant not in results:
            continue
        values = [r[key] for r in runs(variant, op) if key in r]
        if not values:
            errors = [r["error"] for r in results[variant][op] if "error" in r]
            print(f"{label:<40} {'FAILED':>9}   {errors[0] if errors else 'no result'}")
            continue
        m = statistics.median(values)
        print(
            f"{label:<40} {m:>9.3f} {ckpt / 2**30 / m:>10.2f}   "
            + " ".join(f"{v:.3f}" for v in values)
        )

    print(
        "\nPeak RSS (median MiB). 'absolute' is the whole process's peak RSS "
        "(interpreter, JAX and, for saves,\n"
        "the live arrays being saved); 'growth' is that peak minus the RSS right before the "
        "operation.\n"
        "Load workers hold no data before loading. Ratios are to the checkpoint bytes."
    )
    print(
        f"{'Operation':<22} {'before':>8} {'absolute':>9} {'growth':>8} {'absolute/ckpt':>14} "
        f"{'growth/ckpt':>12}   {'sampled':>8} {'VmHWM':>8} {'ru_maxrss':>9}"
    )
    for variant, ops in results.items():
        for op in ops:
            rs = runs(variant, op)
            if not rs or "rss_peak" not in rs[0]:
                continue
            base, peak, growth = (median(rs, k) for k in ("rss_baseline", "rss_peak", "rss_growth"))
            print(
                f"{variant + ' ' + op:<22} {base / MIB:>8.0f} {peak / MIB:>9.0f} "
                f"{growth / MIB:>8.0f} {peak / ckpt:>13.2f}x {growth / ckpt:>11.2f}x   "
                f"{median(rs, 'rss_sampled_peak') / MIB:>8.0f}"
                f" {median(rs, 'rss_vm_hwm') / MIB:>8.0f} {median(rs, 'rss_ru_maxrss') / MIB:>9.0f}"
            )

    loads = [(v, r) for v, ops in results.items() for r in ops.get("load", []) if "error" not in r]
    if loads:
        print(
            "\nLoad checks (all repeats): "
            + "; ".join(
                f"{v}: exact={all(r['exact'] for r in rs)} "
                f"sharding={all(r['sharding_ok'] for r in rs)}"
                for v in results
                if (rs := [r for vv, r in loads if vv == v])
            )
        )
        cached = max(r["cached_bytes_after_evict"] for _, r in loads)
        print(
            f"Cold loads: at most {cached / MIB:.1f} MiB of a checkpoint stayed in the page cache "
            "after eviction (fsync + POSIX_FADV_DONTNEED; drop_caches "
            f"{'also used' if all(r['drop_caches'] for _, r in loads) else 'not available'})"
        )

    print("\nTargets")

    def target(name: str, value: float, limit: float) -> None:
        verdict = "n/a " if value != value else ("PASS" if value <= limit else "FAIL")
        print(f"  {verdict}  {name:<62} {value:>6.2f}x  (target <= {limit}x)")

    mp = "milepost" in results
    if not mp:
        print("  (milepost not run)")
    if mp and "orbax" in results:
        target(
            "milepost save / orbax save",
            med("milepost", "save", "time") / med("orbax", "save", "time"),
            0.6,
        )
    if mp and "numpy" in results:
        target(
            "milepost save / numpy tofile+fsync",
            med("milepost", "save", "time") / med("numpy", "save", "time"),
            1.2,
        )
    if mp and "orbax" in results:
        target(
            "milepost cold load / orbax cold load",
            med("milepost", "load", "time") / med("orbax", "load", "time"),
            0.6,
        )
    if mp and "numpy" in results:
        target(
            "milepost cold load / numpy cold fromfile",
            med("milepost", "load", "time") / med("numpy", "load", "time"),
            1.25,  # issue 26
        )
    if mp and "hostcopy" in results:
        target(
            "milepost save_async blocking / host copy of every shard",
            med("milepost", "save_async", "time_block") / med("hostcopy", "copy", "time"),
            1.5,
        )
    if mp:
        for op, label, limit in (
            ("save", "save", 2.2),
            ("save_async", "save_async", 2.2),
            ("load", "load", 1.3),
        ):
            target(
                f"milepost {label} peak RSS, absolute / ckpt bytes",
                med("milepost", op, "rss_peak") / ckpt,
                limit,
            )
            target(
                f"milepost {label} peak RSS, growth over before / ckpt bytes",
                med("milepost", op, "rss_growth") / ckpt,
                limit,
            )
        if device > ckpt:
            print(
                f"  note: in the '{args.layout}' layout the loaded arrays alone take "
                f"{device / ckpt:.2f}x the checkpoint bytes of (host) device memory, "
                "and a save's live arrays as much; '--layout sharded' makes it 1.00x"
            )

    errors = [
        (v, op, r)
        for v, ops in results.items()
        for op, rs in ops.items()
        for r in rs
        if "error" in r
    ]
    if errors:
        print("\nErrors")
        for v, op, r in errors:
            print(f"--- {v} {op}: {r['error']}\n{r['traceback']}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--gib", type=float, default=1.0, help="checkpoint size in GiB (default 1.0)"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="repeats of every operation (default 3)"
    )
    parser.add_argument(
        "--dir", default=None, help="where checkpoints go (default: a fresh dir under /tmp)"
    )
    parser.add_argument(
        "--only", default=",".join(OPS), help="comma-separated variants (default: all)"
    )
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="sharded")
    parser.add_argument(
        "--timeout", type=float, default=1800, help="per-operation timeout in seconds"
    )
    parser.add_argument(
        "--warm",
        action="store_true",
        help="workers touch and free memory before timing (see above)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        global WARM
        WARM = args.warm
        try:
            out = run_worker_op(args.worker, args.path, args.gib, args.layout)
        except Exception as e:
            out = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        print(json.dumps(out), flush=True)
        return 0

    variants = [v for v in args.only.split(",") if v]
    unknown = set(variants) - set(OPS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {list(OPS)}")
    root = (
        Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="milepost-bench-", dir="/tmp"))
    )
    root.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, list[Result]]] = {v: {op: [] for op in OPS[v]} for v in variants}
    try:
        for rep in range(args.repeats):
            for variant in variants:
                work = root / f"{variant}-{rep}"
                work.mkdir()
                for op in OPS[variant]:
                    path = work / ("ckpt_async" if op == "save_async" else "ckpt")
                    if op == "load" and "error" in results[variant]["save"][-1]:
                        res: Result = {"error": "skipped: the save failed", "traceback": ""}
                    else:
                        os.sync()  # earlier writes must not be flushed during this operation
                        res = spawn(f"{variant}-{op}", str(path), args)
                    results[variant][op].append(res)
                    shown = (
                        res["error"]
                        if "error" in res
                        else ", ".join(
                            f"{k}={v:.3f}" for k, v in res.items() if k.startswith("time")
                        )
                    )
                    print(f"repeat {rep + 1}/{args.repeats} {variant} {op}: {shown}", flush=True)
                shutil.rmtree(work, ignore_errors=True)
    finally:
        if args.dir:
            for rep in range(args.repeats):
                for variant in variants:
                    shutil.rmtree(root / f"{variant}-{rep}", ignore_errors=True)
        else:
            shutil.rmtree(root, ignore_errors=True)
    report(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
