"""Many devices in one process: what a save and a load cost, and how many bytes of metadata
they write, as the device count grows with the data fixed. milepost, Orbax v1 and what JAX
itself costs (the floor), side by side, each device count in a fresh process.

    python benchmarks/many_devices_bench.py [--devices 8,512] [--only milepost,orbax,floor]
        [--reference /path/to/earlier/checkout]

Data: 100 float32 arrays of (512, 64) (12.8 MiB in all) on a (n/8, 8) mesh, the even ones
sharded along the second axis (replicated n/8 times), the odd ones along the first (replicated 8
times). Reported per device count:

- save, load (into the saved shardings; exact values checked), seconds, one of each;
- metadata: the bytes of every file of the checkpoint that is not array data (``d/`` data
  files excluded), ``_sharding`` and ``_milepost.json`` (and the bytes of each of the latter's
  parts: the compact shardings, chunk checksums...), and the six largest files;
- the floor (JAX alone, warm, same process): a host view of every addressable shard (what a
  save must read), and building every array with ``jax.make_array_from_callback`` (what a load
  must build);
- ``--reference``: milepost from an earlier checkout too (its packages through
  ``docs/_hooks/package_view.py``), in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, os, shutil, sys, tempfile, time
n, who = int(sys.argv[1]), sys.argv[2]
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n}"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

mesh = jax.make_mesh((n // 8, 8), ("a", "b"))
specs = {f"w{i}": P(None, "b") if i % 2 == 0 else P("a", None) for i in range(100)}
values = {k: np.full((512, 64), i, np.float32) for i, k in enumerate(specs)}
tree = {k: jax.device_put(values[k], NamedSharding(mesh, s)) for k, s in specs.items()}
jax.block_until_ready(tree)
out = {"devices": n, "who": who}
if who == "floor":
    for _ in range(2):  # the second, warm
        t = time.perf_counter()
        views = [np.asarray(s.data) for a in tree.values() for s in a.addressable_shards]
        out["host_views"] = round(time.perf_counter() - t, 3)
        t = time.perf_counter()
        built = {
            k: jax.make_array_from_callback(
                (512, 64), NamedSharding(mesh, specs[k]), lambda idx, v=values[k]: v[idx]
            )
            for k in specs
        }
        jax.block_until_ready(built)
        out["make_arrays"] = round(time.perf_counter() - t, 3)
    print(json.dumps(out), flush=True)
    sys.exit(0)
root = tempfile.mkdtemp()
path = os.path.join(root, "c")
abstract = {k: jax.ShapeDtypeStruct((512, 64), np.float32, sharding=NamedSharding(mesh, s))
            for k, s in specs.items()}
if who == "orbax":
    import orbax.checkpoint.experimental.v1 as ocp
    save, load = (lambda: ocp.save_pytree(path, tree)), (lambda: ocp.load_pytree(path, abstract))
else:
    import milepost as mp
    save, load = (lambda: mp.save(path, tree)), (lambda: mp.load(path))
t = time.perf_counter(); save(); out["save"] = round(time.perf_counter() - t, 3)
t = time.perf_counter(); got = load(); jax.block_until_ready(got)
out["load"] = round(time.perf_counter() - t, 3)
out["exact"] = all(np.array_equal(np.asarray(got[k]), values[k]) for k in values)
sizes = {}
for dirpath, _, names in os.walk(path):
    for name in names:
        rel = os.path.relpath(os.path.join(dirpath, name), path)
        if "/d/" not in "/" + rel:
            sizes[rel] = os.path.getsize(os.path.join(dirpath, name))
out["metadata_bytes"] = sum(sizes.values())
out["sharding_bytes"] = sizes.get("state/_sharding", sizes.get("_sharding", 0))
out["milepost_json_bytes"] = sizes.get("state/_milepost.json", 0)
if out["milepost_json_bytes"]:  # its parts: the compact shardings, chunk checksums, types
    with open(os.path.join(path, "state", "_milepost.json")) as f:
        out["milepost_json_parts"] = {k: len(json.dumps(v)) for k, v in json.load(f).items()}
out["largest_files"] = dict(sorted(sizes.items(), key=lambda kv: -kv[1])[:6])
shutil.rmtree(root)
print(json.dumps(out), flush=True)
"""


def run(devices: int, who: str, view: Path | None) -> dict:
    env = dict(os.environ)
    if view is not None:
        env["PYTHONPATH"] = str(view)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(devices), "milepost" if who == "reference" else who],
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"devices": devices, "who": who, "error": proc.stderr[-400:]}
    out = json.loads(lines[-1])
    out["who"] = who
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", default="8,512")
    parser.add_argument("--only", default="floor,milepost,orbax")
    parser.add_argument("--reference", type=Path)
    args = parser.parse_args()
    view = None
    if args.reference is not None:
        view = Path(tempfile.mkdtemp(prefix="milepost-view-"))
        subprocess.run(
            [sys.executable, "docs/_hooks/package_view.py", str(view)],
            cwd=args.reference,
            check=True,
        )
    whos = args.only.split(",") + (["reference"] if view is not None else [])
    for devices in (int(d) for d in args.devices.split(",")):
        for who in whos:
            print(json.dumps(run(devices, who, view if who == "reference" else None)), flush=True)


if __name__ == "__main__":
    main()
