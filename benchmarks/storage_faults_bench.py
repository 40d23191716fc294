"""Storage that misbehaves: a stalled write, throttling and the requests a load makes, for this
milepost and a reference (an earlier checkout) side by side in one run.

    python benchmarks/storage_faults_bench.py --reference /path/to/earlier/checkout
        [--timeout 10] [--throttle-every 5] [--mib 4]

An S3 server (moto, on 127.0.0.1) behind the tests' fault-injecting proxy
(``tests/_faulty_proxy.py``); each operation runs in a fresh process of the version measured,
which sees the proxy as its endpoint. Cases:

- ``stall``: every data-file PUT of a save is held unanswered; ``AsyncOptions(timeout_secs=
  --timeout)``. Measured: when the save reports its failure, when its process can exit (a
  failed save's writes must stop before it is cleaned up), and, after the proxy lets the held
  writes reach the server late, whether a new save of the same path succeeds.
- ``throttle``: every ``--throttle-every``-th request answered ``503 SlowDown``: a save and a
  load of a ``--mib`` MiB tree (exact values checked), timed.
- ``requests``: the requests one load of that tree makes (listings, and all).

The reference is run from a symlink view of its packages (``docs/_hooks/package_view.py``),
so it needs no install.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CHILD = r"""
import json, sys, time
import numpy as np
import milepost as mp

op, url, timeout, mib = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
n = int(mib * (1 << 20) / 8)
tree = {"w": np.arange(n, dtype=np.float64), "b": np.arange(1000, dtype=np.int32)}
out = {}
start = time.monotonic()
try:
    with mp.Context(async_=mp.AsyncOptions(timeout_secs=timeout)):
        if op == "save":
            mp.save(url, tree)
        else:
            got = mp.load(url)
            assert all(np.array_equal(got[k], tree[k]) for k in tree), "wrong values"
    out["error"] = None
except Exception as e:
    out["error"] = f"{type(e).__name__}: {str(e)[:160]}"
out["secs"] = round(time.monotonic() - start, 2)
print(json.dumps(out), flush=True)
"""


def view_of(checkout: Path) -> Path:
    """A folder whose ``milepost`` package is ``checkout``'s code."""
    view = Path(tempfile.mkdtemp(prefix="milepost-view-"))
    subprocess.run(
        [sys.executable, str(checkout / "docs/_hooks/package_view.py"), str(view)],
        cwd=checkout,
        check=True,
    )
    return view


def child(
    view: Path | None,
    endpoint: str,
    op: str,
    url: str,
    timeout: float,
    mib: float,
    exit_cap: float = 3600.0,
) -> tuple[dict, float | None]:
    """The operation's outcome (the JSON line the child prints when it is done) and when the
    child process exited (None: still running ``exit_cap`` seconds after it started; killed)."""
    env = {**os.environ, "AWS_ENDPOINT_URL": endpoint, "JAX_PLATFORMS": "cpu"}
    if view is not None:
        env["PYTHONPATH"] = str(view)
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, op, url, str(timeout), str(mib)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    out: dict = {"error": "crashed"}
    for line in proc.stdout:  # the outcome as soon as it is printed
        if line.startswith("{"):
            out = json.loads(line)
            break
    try:
        proc.wait(max(1.0, exit_cap - (time.monotonic() - start)))
        return out, time.monotonic() - start
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return out, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reference", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--throttle-every", type=int, default=5)
    parser.add_argument("--mib", type=float, default=4.0)
    parser.add_argument("--only", default="stall,throttle,requests")
    parser.add_argument("--versions", default="this,reference")
    parser.add_argument(
        "--exit-cap", type=float, default=900.0, help="stop waiting for a stalled child's exit"
    )
    args = parser.parse_args()

    import boto3
    from moto import server as moto_server

    from tests._faulty_proxy import FaultyProxy

    lines: list[str] = []

    class Log(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    werkzeug = logging.getLogger("werkzeug")
    werkzeug.setLevel(logging.INFO)
    werkzeug.propagate = False
    werkzeug.addHandler(Log())
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    upstream = f"http://{host}:{port}"
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
    )
    s3 = boto3.client("s3", endpoint_url=upstream, region_name="us-east-1")
    versions = {
        name: None if name == "this" else view_of(args.reference.resolve())
        for name in args.versions.split(",")
    }
    only = set(args.only.split(","))
    try:
        for name, view in versions.items():
            bucket = f"bench-{uuid.uuid4().hex[:8]}"
            s3.create_bucket(Bucket=bucket)
            if "stall" in only:
                proxy = FaultyProxy(upstream)
                url = f"s3://{bucket}/stall"
                rule = proxy.fail(
                    "PUT", "/stall/state/ocdbt.process_controller/d/", "stall", count=10**6
                )
                out, exited = child(
                    view, proxy.url, "save", url, args.timeout, 0.1, exit_cap=args.exit_cap
                )
                held = rule.hits
                proxy.release()
                deadline = time.monotonic() + 120
                while rule.forwarded < rule.hits and time.monotonic() < deadline:
                    time.sleep(0.05)
                proxy.close()
                again, _ = child(view, upstream, "save", url, 600, 0.1)
                print(
                    f"{name:9s} stall   timeout {args.timeout:g}s: failed after {out['secs']}s "
                    f"({out['error']}); process exited after "
                    + (f"{exited:.1f}s" if exited is not None else f"> {args.exit_cap:g}s (killed)")
                    + f"; {held} PUTs held, "
                    f"landed late; next save of the path: {again['error'] or 'committed'}"
                )
            if "throttle" in only or "requests" in only:
                url = f"s3://{bucket}/data"
                plain_save, _ = child(view, upstream, "save", url, 600, args.mib)
                before = len(lines)
                plain_load, _ = child(view, upstream, "load", url, 600, args.mib)
                requests = lines[before:]
                if "requests" in only:
                    listings = sum("list-type=2" in line for line in requests)
                    print(
                        f"{name:9s} requests one load of {args.mib:g} MiB: {len(requests)} "
                        f"requests, {listings} listings"
                    )
            if "throttle" in only:
                proxy = FaultyProxy(upstream)
                for method in ("GET", "PUT", "HEAD", "DELETE", "POST"):
                    proxy.fail(method, "/", "throttle", count=10**6, every=args.throttle_every)
                url2 = f"s3://{bucket}/throttled"
                save, _ = child(view, proxy.url, "save", url2, 600, args.mib)
                load, _ = child(view, proxy.url, "load", url2, 600, args.mib)
                proxy.close()
                print(
                    f"{name:9s} throttle 1 in {args.throttle_every}: save {save['secs']}s "
                    f"(unthrottled {plain_save['secs']}s) {save['error'] or 'ok'}; load "
                    f"{load['secs']}s (unthrottled {plain_load['secs']}s) "
                    f"{load['error'] or 'exact'}"
                )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
