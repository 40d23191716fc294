"""A training loop's blocking time per save with the Checkpointer's local tier, against a host
copy of the same bytes (the reference: what any async save must at least do before training
may go on).

    python benchmarks/local_tier_bench.py [--gib 1.0] [--saves 4] [--step-secs 2.0]
                                          [--root file|s3] [--dir /tmp/x]

The state is 8 float32 arrays sharded over a (2, 4) mesh of 8 fake CPU devices (``gib`` GiB in
all). One fresh process runs, in order, with memory warmed first (see save_load.py's ``--warm``):

* ``hostcopy``: a warm host copy, ``np.copyto`` of every shard into buffers already touched,
  ``saves`` times;
* ``tiered``: a loop of ``saves`` steps, each ``step_secs`` of "training" (a sleep: the mirror
  runs behind it) then ``ckpt.save(step, state)`` on ``Checkpointer(root, local=...)``; the time
  of each ``save`` call is its blocking time (saves 2..n: the first one faults in the staging
  buffers the others reuse). After the loop, ``wait()`` (all mirrored) is timed.
* ``direct``: the same loop on ``Checkpointer(root)`` without a local tier, for comparison (with
  a slow root, a save waits for the previous upload).

``--root s3`` mirrors to a moto S3 server started on 127.0.0.1 in a subprocess. Prints medians
and the target (tiered blocking <= 1.5x hostcopy) with PASS/FAIL.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost.training import Checkpointer, KeepLatest


def make_state(gib: float) -> dict[str, jax.Array]:
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    rows = max(8, int(gib * 2**30 / 8 / 8192 / 4) // 8 * 8)
    rng = np.random.default_rng(0)
    return {
        f"w{i}": jax.device_put(
            rng.standard_normal((rows, 8192), dtype=np.float32),
            NamedSharding(mesh, P("data", "model")),
        )
        for i in range(8)
    }


def warm(nbytes: int) -> None:
    """Touch and free memory so the timed parts start on pages the host already backs."""
    block = np.ones(nbytes // 8, np.float64)
    del block


def host_copy(state: dict[str, jax.Array], into: list[np.ndarray]) -> float:
    """A warm host copy: every shard into memory already touched (``into``)."""
    shards = [s for a in state.values() for s in a.addressable_shards]
    t0 = time.perf_counter()
    for out, shard in zip(into, shards, strict=True):
        np.copyto(out, np.asarray(shard.data))
    return time.perf_counter() - t0


def loop(
    ckpt: Checkpointer, state: dict[str, jax.Array], saves: int, step_secs: float
) -> tuple[list[float], float]:
    blocking = []
    for step in range(saves):
        time.sleep(step_secs)  # training
        t0 = time.perf_counter()
        ckpt.save(step, state, force=True)
        blocking.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    ckpt.wait()
    return blocking, time.perf_counter() - t0


def start_moto(workdir: str) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(os.path.join(workdir, "moto.log"), "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=log,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2).read()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("moto did not start") from None
            time.sleep(0.1)
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
    )
    return proc, endpoint


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--step-secs", type=float, default=2.0)
    ap.add_argument("--root", choices=["file", "s3"], default="file")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="milepost-tier-", dir=args.dir)
    moto = None
    try:
        if args.root == "s3":
            moto, endpoint = start_moto(work)
            import boto3

            bucket = f"bench-{uuid.uuid4().hex[:8]}"
            boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
                Bucket=bucket
            )
            roots = [f"s3://{bucket}/tiered", f"s3://{bucket}/direct"]
        else:
            roots = [os.path.join(work, "tiered"), os.path.join(work, "direct")]
        state = make_state(args.gib)
        nbytes = sum(a.nbytes for a in state.values())
        warm(int(2.5 * nbytes))
        into = [
            np.ones(s.data.shape, np.float32) for a in state.values() for s in a.addressable_shards
        ]
        copies = [host_copy(state, into) for _ in range(args.saves)]
        del into
        with Checkpointer(
            roots[0],
            local=os.path.join(work, "local"),
            keep=KeepLatest(n=2),
            local_keep=KeepLatest(n=2),
        ) as ckpt:
            tiered, tiered_drain = loop(ckpt, state, args.saves, args.step_secs)
        tiered = tiered[1:]  # the first save faults in its staging buffers; the next reuse them
        with Checkpointer(roots[1], keep=KeepLatest(n=2)) as ckpt:
            direct, direct_drain = loop(ckpt, state, args.saves, args.step_secs)
        direct = direct[1:]
        result = {
            "gib": nbytes / 2**30,
            "root": args.root,
            "saves": args.saves,
            "step_secs": args.step_secs,
            "hostcopy_s": statistics.median(copies),
            "tiered_blocking_s": statistics.median(tiered),
            "tiered_blocking_max_s": max(tiered),
            "tiered_drain_s": tiered_drain,
            "direct_blocking_s": statistics.median(direct),
            "direct_blocking_max_s": max(direct),
            "direct_drain_s": direct_drain,
        }
        ratio = result["tiered_blocking_s"] / result["hostcopy_s"]
        print(
            f"{nbytes / 2**30:.2f} GiB, root={args.root}, {args.saves} saves, "
            f"{args.step_secs:g}s steps"
        )
        print(f"  host copy (reference)       {result['hostcopy_s']:.3f}s")
        print(
            f"  tiered save, blocking       {result['tiered_blocking_s']:.3f}s median, "
            f"{max(tiered):.3f}s max; mirrors drained {tiered_drain:.2f}s after the loop"
        )
        print(
            f"  direct save, blocking       {result['direct_blocking_s']:.3f}s median, "
            f"{max(direct):.3f}s max; drained {direct_drain:.2f}s after the loop"
        )
        print(
            f"  tiered blocking / host copy = {ratio:.2f}x (target <= 1.5x): "
            f"{'PASS' if ratio <= 1.5 else 'FAIL'}"
        )
        print(json.dumps(result))
        mp.wait_for_saves()
    finally:
        if moto is not None:
            moto.terminate()
            moto.wait(30)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
