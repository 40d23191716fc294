"""Many small arrays: save, cold load and metadata of an unstacked 100-layer model, milepost vs
Orbax v1.

    python benchmarks/small_arrays_bench.py [--layers 100] [--per-layer 20] [--repeats 3]
                                            [--only milepost,orbax] [--dir /tmp/x] [--profile OP]

The tree is ``{"layers": {"layer_000": {"w00": ..., ..., "w19": ...}, ...}}``: 2,000 float32
arrays of (rows, 1024) with rows drawn from 1..64 (4 KiB to 256 KiB each, ~256 MiB in all), on a
(2, 4) mesh of 8 fake CPU devices. Every fourth array is replicated (norms, biases), the others
are sharded over all 8 devices along the columns, or over both axes when the rows allow it.

Every operation runs in its own fresh process (imports and JAX start-up outside the clock):

* save: build the tree, then ``milepost.save`` / ``ocp.save_pytree`` (blocking, committed);
* load: evict the checkpoint's files from the page cache, then load every array in its saved
  sharding from an abstract tree, and only afterwards check every value exactly;
* metadata: evict, then ``milepost.metadata(path)`` / ``ocp.pytree_metadata(path)``, and check
  that every leaf's shape is reported.

Variants alternate within each repeat (the order rotates), so both see the same machine. Prints
the medians and the milepost/Orbax ratios against the 0.3x target. ``--profile milepost-save``
(or -load, -metadata) runs that one operation under cProfile in this process and prints the top
functions by cumulative and by own time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

_DEVICE_FLAG = "--xla_force_host_platform_device_count=8"
if _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np  # noqa: E402
from _common import evict  # noqa: E402

COLS = 1024
MIB = 2**20
VARIANTS = ("milepost", "orbax")
OPS = ("save", "load", "metadata")


# ----------------------------------------------------------------------------------------- data


def layout(layers: int, per_layer: int) -> list[tuple[str, str, int, str]]:
    """(layer, leaf, rows, sharding kind) of every array, the same on every call."""
    rng = np.random.default_rng(16)
    out = []
    for layer in range(layers):
        for k in range(per_layer):
            rows = int(rng.integers(1, 65))
            if k % 4 == 3:
                kind = "replicated"
            elif rows % 2 == 0:
                kind = "both"  # rows over 'a', columns over 'b'
            else:
                kind = "columns"  # columns over all 8 devices
            out.append((f"layer_{layer:03d}", f"w{k:02d}", rows, kind))
    return out


def _sharding(mesh: Any, kind: str) -> Any:
    from jax.sharding import NamedSharding, PartitionSpec

    spec = {
        "replicated": PartitionSpec(),
        "both": PartitionSpec("a", "b"),
        "columns": PartitionSpec(None, ("a", "b")),
    }[kind]
    return NamedSharding(mesh, spec)


def _values(layer: str, leaf: str, rows: int) -> np.ndarray:
    seed = int(layer[6:]) * 1000 + int(leaf[1:])
    return np.random.default_rng(seed).standard_normal((rows, COLS), dtype=np.float32)


def build_tree(args: argparse.Namespace) -> dict[str, Any]:
    import jax

    mesh = jax.make_mesh((2, 4), ("a", "b"))
    tree: dict[str, dict[str, Any]] = {}
    for layer, leaf, rows, kind in layout(args.layers, args.per_layer):
        tree.setdefault(layer, {})[leaf] = jax.device_put(
            _values(layer, leaf, rows), _sharding(mesh, kind)
        )
    return jax.block_until_ready({"layers": tree})


def abstract_tree(args: argparse.Namespace) -> dict[str, Any]:
    import jax

    mesh = jax.make_mesh((2, 4), ("a", "b"))
    tree: dict[str, dict[str, Any]] = {}
    for layer, leaf, rows, kind in layout(args.layers, args.per_layer):
        tree.setdefault(layer, {})[leaf] = jax.ShapeDtypeStruct(
            (rows, COLS), np.dtype(np.float32), sharding=_sharding(mesh, kind)
        )
    return {"layers": tree}


def check(restored: dict[str, Any], args: argparse.Namespace) -> bool:
    return all(
        np.array_equal(np.asarray(restored["layers"][layer][leaf]), _values(layer, leaf, rows))
        for layer, leaf, rows, _ in layout(args.layers, args.per_layer)
    )


def check_metadata(meta: Any, args: argparse.Namespace) -> bool:
    return all(
        tuple(meta["layers"][layer][leaf].shape) == (rows, COLS)
        for layer, leaf, rows, _ in layout(args.layers, args.per_layer)
    )


# ------------------------------------------------------------------------------------- workers


def run_op(variant: str, op: str, path: str, args: argparse.Namespace) -> dict[str, Any]:
    import jax

    if variant == "milepost":
        import milepost as mp
    else:
        import orbax.checkpoint.experimental.v1 as ocp
    out: dict[str, Any] = {}
    if op == "save":
        tree = build_tree(args)
        out["ckpt_bytes"] = sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))
        out["arrays"] = len(jax.tree_util.tree_leaves(tree))
        t0 = time.perf_counter()
        if variant == "milepost":
            mp.save(path, tree)
        else:
            ocp.save_pytree(path, tree)
        out["time"] = time.perf_counter() - t0
        out["files"] = sum(len(files) for _, _, files in os.walk(path))
    elif op == "load":
        abstract = abstract_tree(args)
        evict(path)
        t0 = time.perf_counter()
        restored = (
            mp.load(path, abstract) if variant == "milepost" else ocp.load_pytree(path, abstract)
        )
        jax.block_until_ready(restored)
        out["time"] = time.perf_counter() - t0
        out["exact"] = check(restored, args)
    elif op == "metadata":
        evict(path)
        t0 = time.perf_counter()
        if variant == "milepost":
            meta = mp.metadata(path).tree
        else:
            meta = ocp.pytree_metadata(path).metadata
        out["time"] = time.perf_counter() - t0
        out["exact"] = check_metadata(meta, args)
    else:
        raise ValueError(f"unknown op {op!r}")
    return out


def profile(target: str, args: argparse.Namespace) -> None:
    """Run the save (and the op asked for, on what it saved) here, under cProfile."""
    import cProfile
    import pstats

    variant, _, op = target.partition("-")
    root = Path(tempfile.mkdtemp(prefix="milepost-small-prof-", dir=args.dir))
    path = str(root / "ckpt")
    try:
        if op != "save":
            run_op(variant, "save", path, args)
        prof = cProfile.Profile()
        prof.enable()
        res = run_op(variant, op, path, args)
        prof.disable()
        print(f"{target}: {res}")
        stats = pstats.Stats(prof).strip_dirs()
        stats.sort_stats("cumulative").print_stats(45)
        stats.sort_stats("tottime").print_stats(30)
    finally:
        shutil.rmtree(root, ignore_errors=True)


# -------------------------------------------------------------------------------------- parent


def spawn(variant: str, op: str, path: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        f"{variant}-{op}",
        "--path",
        path,
        "--layers",
        str(args.layers),
        "--per-layer",
        str(args.per_layer),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    return {"error": f"exit code {proc.returncode}: {proc.stderr[-3000:]}"}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=100)
    parser.add_argument("--per-layer", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default=",".join(VARIANTS))
    parser.add_argument(
        "--dir", default=None, help="where checkpoints go (default: a fresh dir under /tmp)"
    )
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument(
        "--profile", default=None, help="e.g. milepost-save: run it here under cProfile"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.profile:
        profile(args.profile, args)
        return 0
    if args.worker:
        variant, _, op = args.worker.partition("-")
        try:
            out = run_op(variant, op, args.path, args)
        except Exception as e:
            out = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        print(json.dumps(out), flush=True)
        return 0

    variants = [v for v in args.only.split(",") if v]
    root = Path(tempfile.mkdtemp(prefix="milepost-small-", dir=args.dir))
    results: dict[str, dict[str, list[dict[str, Any]]]] = {
        v: {op: [] for op in OPS} for v in variants
    }
    info: dict[str, Any] = {}
    try:
        for rep in range(args.repeats):
            order = variants[rep % len(variants) :] + variants[: rep % len(variants)]
            for variant in order:
                path = str(root / f"{variant}-{rep}")
                for op in OPS:
                    if op != "save" and "error" in results[variant]["save"][-1]:
                        res: dict[str, Any] = {"error": "skipped: the save failed"}
                    else:
                        os.sync()
                        res = spawn(variant, op, path, args)
                    results[variant][op].append(res)
                    if op == "save" and "error" not in res:
                        info.update({k: res[k] for k in ("ckpt_bytes", "arrays")})
                        info[f"{variant}_files"] = res["files"]
                    shown = (
                        res["error"][:2000]
                        if "error" in res
                        else f"{res['time']:.3f} s"
                        + (f", exact={res['exact']}" if "exact" in res else "")
                    )
                    print(f"repeat {rep + 1}/{args.repeats} {variant} {op}: {shown}", flush=True)
                shutil.rmtree(path, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def med(variant: str, op: str) -> float:
        times = [r["time"] for r in results.get(variant, {}).get(op, []) if "time" in r]
        return statistics.median(times) if times else float("nan")

    if info:
        print(
            f"\n{info['arrays']} float32 arrays, {info['ckpt_bytes'] / MIB:.0f} MiB, "
            "(2, 4) mesh of 8 CPU devices; "
            f"median of {args.repeats}, fresh process per operation, load and metadata cold"
        )
        print(
            "files per checkpoint: "
            + ", ".join(f"{v} {info[f'{v}_files']}" for v in variants if f"{v}_files" in info)
        )
    print(
        f"\n{'operation':<10}"
        + "".join(f"{v + ' s':>14}" for v in variants)
        + f"{'ratio':>10}   runs"
    )
    for op in OPS:
        ratio = med("milepost", op) / med("orbax", op) if len(variants) == 2 else float("nan")
        verdict = "" if ratio != ratio else ("PASS" if ratio <= 0.3 else "FAIL")
        runs = "; ".join(
            f"{v}: " + " ".join(f"{r['time']:.3f}" for r in results[v][op] if "time" in r)
            for v in variants
        )
        print(
            f"{op:<10}"
            + "".join(f"{med(v, op):>14.3f}" for v in variants)
            + f"{ratio:>9.2f}x {verdict:>4}   {runs}"
        )
    checks = [
        r.get("exact")
        for v in variants
        for op in ("load", "metadata")
        for r in results[v][op]
        if "exact" in r
    ]
    print(f"\nall loads exact and all metadata complete: {all(checks) and bool(checks)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
