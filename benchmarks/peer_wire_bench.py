"""The multi-controller peer tier's transport (``workers/peers/_wire.py``) against itself
before issue #43 (cleartext secret, per-receive timeouts): put and get throughput over
loopback, both versions in one run.

    python benchmarks/peer_wire_bench.py [--mib 256] [--rounds 20] [--before 0e09dda]
        [--dir /dev/shm]

The version before is read from git (``--before``, a commit) and imported beside this one.
Each version runs its own ``PeerServer`` on 127.0.0.1 over a folder under ``--dir`` (a RAM disk
by default, so that the folder's write is a memory copy). A part of one box of ``--mib`` MiB is
put (sent, checked by the server, written) then got back (read, checked on both sides) with each
version in turn, ``--rounds`` times, which goes first alternating. The got part is compared with
the sent one once per version. Prints the medians, GB/s, the ratios (after / before, in
throughput) and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

from milepost.workers import peers
from milepost.workers.format._checksum import crc32c

ROOT = Path(__file__).resolve().parents[1]


def before_module(rev: str) -> types.ModuleType:
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:workers/peers/_wire.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    module = types.ModuleType("milepost.workers.peers._wire_before")
    exec(compile(source, f"{rev}:workers/peers/_wire.py", "exec"), module.__dict__)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--before", default="0e09dda", help="the commit of the version before")
    parser.add_argument("--dir", default="/dev/shm")
    args = parser.parse_args()

    n = args.mib << 20
    data = np.arange(n // 8, dtype=np.uint64).view(np.uint8)
    box = peers.Box(array=0, index=((0, n),), offset=0, nbytes=n, crc32c=crc32c(data))
    part = peers.Part(step=1, owner=1, token="t", hosts=2, dtypes=("uint8",), boxes=(box,))
    secret = os.urandom(16)
    versions = {"before": before_module(args.before), "after": peers}
    times: dict[str, dict[str, list[float]]] = {v: {"put": [], "get": []} for v in versions}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        servers = {
            v: m.PeerServer(Path(tmp) / v, secret, host="127.0.0.1", timeout=120)
            for v, m in versions.items()
        }
        try:
            for r in range(args.rounds):
                order = list(versions) if r % 2 == 0 else list(reversed(versions))
                for v in order:
                    m, address = versions[v], ("127.0.0.1", servers[v].port)
                    t0 = time.perf_counter()
                    m.send_part(address, secret, part, data, 120, "the server")
                    t1 = time.perf_counter()
                    got, back = m.fetch_part(address, secret, 1, 1, "t", 120, "the server")
                    t2 = time.perf_counter()
                    if r < 2 and not (got == part and np.array_equal(back, data)):
                        sys.exit(f"{v}: the part got back is not the part sent")
                    del back
                    times[v]["put"].append(t1 - t0)
                    times[v]["get"].append(t2 - t1)
        finally:
            for s in servers.values():
                s.close()

    medians = {v: {op: statistics.median(ts) for op, ts in t.items()} for v, t in times.items()}
    print(f"{args.rounds} rounds of a {args.mib} MiB part, medians:")
    for v, ops in medians.items():
        print(
            f"  {v:6s} put {ops['put']:.3f} s ({n / ops['put'] / 1e9:.2f} GB/s)"
            f"   get {ops['get']:.3f} s ({n / ops['get'] / 1e9:.2f} GB/s)"
        )
    ratio = {op: medians["before"][op] / medians["after"][op] for op in ("put", "get")}
    print(f"  throughput after / before: put {ratio['put']:.2f}x, get {ratio['get']:.2f}x")
    print(json.dumps({"mib": args.mib, "rounds": args.rounds, "medians": medians, "ratio": ratio}))


if __name__ == "__main__":
    main()
