"""The commit and the load planning of an H-host save, simulated: merge H per-process OCDBT
databases, write the metadata, then read it back and plan a load onto the H hosts.

    python benchmarks/merge_sim.py [--hosts 512,1024,4096] [--arrays 2000] [--devices-per-host 8]
                                   [--writers 1] [--dir /work] [--keep] [--warm GIB]
                                   [--commits 3]

No hosts run. For each H, a subprocess writes what the hosts of an H-host save of a 2,000-array
model leave behind, the way the engine writes it: every array is sharded along its first axis
over the H hosts (a (H, devices-per-host) mesh, ``PartitionSpec("data")``), so each host holds
one shard ``c/<p>/0`` of every array, 1 KiB of values (1,044 bytes with the zarr3 shard index
and its CRC32C). Each host's shards go into its packed database ``ocdbt.process_<p>.p``,
written by the engine's own packer (``workers.save._packed``: the shards in key order in one
data file, then the database's chunk checksum table), and host 0's writer databases
``ocdbt.process_0[.<k>]`` hold every array's ``zarr.json`` (the save asks one host per array to
write it), with milepost's own OCDBT settings (``format._tensorstore.OCDBT_CONFIG``). It also
pickles each host's ack on its own, as a host sends it: its packed database's table, and the
arrays whose header it wrote (host 0: every array; the others: none), as the engine builds
them.

Then a second subprocess, the controller, unpickles the H acks (one message each) and times
what the commit does with them (the phases of ``milepost._checkpoint._commit``), each step
apart, ``--commits`` times on the same databases (the median reported):

* ``metadata``: ``_METADATA``, ``_sharding``, ``_milepost.json`` and ``array_metadatas/``
  (``_pytree_format.write_tree``);
* ``merge``: the root OCDBT view referencing every per-process database (``format.merge_ocdbt``),
  with what confirms the data files before it (the databases' manifests) and after it (every
  file the view references, at least as long as its last value): ``confirm``, timed apart too;
* ``checksums``: the checkpoint's own files and ``_milepost_checksums.json`` over every file but
  array data (``Checksums.compute``), then the commit marker;

then what a load of the whole tree onto the same H hosts does on the controller before any host
reads (``read + plan``): read ``_milepost_checksums.json``, the format files and every array's
header through the root view, and build every host's load plan (``_pytree_load.load`` with the
saved shardings, against a stand-in host group of H hosts x devices-per-host device ids whose
``load`` keeps the plans instead of sending them); and apart from it the bytes of those plans
pickled once per host, as a Ray call sends them (``plans sent``). Also ``mp.metadata(path)``,
and what each host of that load does first (``host index``): find where every array's chunks
lie through the root view (``Locator.index``), its time and peak RSS growth, and on the first
100 arrays the same against TensorStore's walk (``ocdbt.dump``), which the locator used before.

Measures per H: total metadata bytes (every file but array data: the format files,
``array_metadatas/``, the per-process manifests, the root manifest and B-tree, the checksums
file), commit time, read + plan time, and the controller process's peak RSS growth over the
acks, the commit and the read + plan (``VmHWM`` minus ``VmRSS`` once its modules are imported,
the mark reset before the commit and before the read + plan, each phase's peak printed apart;
the hosts' writes ran in another process). It checks the result: the root view lists every key
of every database, and a read of one array through it returns every host's shard exactly.
Prints a table, the growth of each measure from the first H to the last, and PASS/FAIL against
the targets of issue 26 at the largest H.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts

import milepost as mp
from milepost import _options, _tree, workers
from milepost._checkpoint import PyTreeHandler, WrittenTree
from milepost._checkpoint import _commit as commit_phases
from milepost._tree import ValueType
from milepost.workers import format as fmt
from milepost.workers import format as tree_format
from milepost.workers.format import _tensorstore as tsu
from milepost.workers.save import _packed

COLS = 256  # float32: 1 KiB per host per array
HEADERS_EVERYWHERE = False
"""True: every host's database has every array's zarr.json (milepost before the save asked one
host per array to write it; ``--headers-everywhere``)."""
MIB = 2**20
WARM_BYTES = 0
"""``--warm GIB``: bytes touched and freed right before each timed phase of the controller (the
commit, the read + plan, the host index). This VM hands freed memory back to its host, and the
first touch of such a page is a host fault (``save_load.py --warm`` says more): warmed, a phase
starts on memory the host backs, and its time shows the software, not what ran before it."""
COMMITS = 3
"""``--commits N``: the commit is timed N times on the same databases (what it wrote removed
between), and the run of median commit time is the one reported and checked. Within a run the
repeats agree to ~3%; from one run to the next (new databases, this VM) a 512-host commit of
~0.7 s moves by 0.1 s, which the median does not remove (benchmarks/NOTES.md)."""
REFERENCE_ARRAYS = 100
"""Arrays a host's chunk index is timed on with TensorStore's walk too (``host_index``)."""


def array_names(n: int) -> list[str]:
    per_layer = 20
    return [f"layers.layer_{i // per_layer:03d}.w{i % per_layer:02d}" for i in range(n)]


def spec_of(name: str, hosts: int) -> workers.ArraySpec:
    return workers.ArraySpec(
        name=name,
        shape=(hosts, COLS),
        dtype="float32",
        write_shape=(1, COLS),
        chunk_shape=(1, COLS),
        compression=None,
    )


def headers(names: list[str], hosts: int) -> dict[str, bytes]:
    """Each array's zarr.json exactly as TensorStore writes it (one array created in memory, the
    others differ only in their shape)."""
    kv = {"driver": "memory"}
    store = ts.open(tsu.create_spec(kv, spec_of("a", hosts)), create=True, open=True).result()
    template = store.kvstore.read("zarr.json").result().value
    assert json.loads(template)["shape"] == [hosts, COLS]
    return {name: template for name in names}


def shard_values(host: int, k: int) -> np.ndarray:
    """Host ``host``'s shard of array ``k``: one row of ``COLS`` float32."""
    return np.full((1, COLS), host * 10_000 + k, np.float32)


def write_process(
    directory: Path,
    process: int,
    hosts: int,
    names: list[str],
    header: dict[str, bytes],
    writers: int,
    token: str,
) -> tuple[list[Any], str]:
    """One host's databases as the engine leaves them: its shard of every array packed by the
    engine's own packer (``workers.save._packed``: one database, the shards in key order, then
    its chunk checksum table), and on host 0 every array's ``zarr.json`` in its writer
    databases (``names[k::writers]`` in ``ocdbt.process_0[.<k>]``, where TensorStore creates
    them), its data files named by the save's ``token`` (one for every host, as the controller
    draws it). What the host reports in its ack, and the packed database's name."""
    store = workers.StoreSpec(directory=str(directory), use_ocdbt=True, file_token=token)
    written = []
    if process == 0 or HEADERS_EVERYWHERE:
        for writer in range(writers):
            kv = ts.KvStore.open(tsu.write_kvstore(store, process, writer)).result()
            txn = ts.Transaction()
            for name in names[writer::writers]:
                kv.with_transaction(txn)[f"{name}/zarr.json"] = header[name]
                written.append(
                    workers.WrittenArray(name=name, write_shape=(1, COLS), chunk_shape=(1, COLS))
                )
            txn.commit_async().result()
    packer = _packed.Packer(store, tsu.process_dir_name(process))
    for name in names:
        k = int(name[-2:]) + 20 * int(name[13:16])
        box = ((process, process + 1), (0, COLS))
        assert packer.add(spec_of(name, hosts), box, shard_values(process, k))
    buffer = np.empty(packer.layout(), np.uint8)
    for dst, src in packer.copies(buffer):
        np.copyto(dst, src)
    packer.write()
    return written, packer.database


def tree_of(names: list[str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name in names:
        node = tree
        *path, leaf = name.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = 0
    return tree


def sharding_of(hosts: int, devices_per_host: int) -> workers.ShardingSpec:
    return workers.ShardingSpec.named(
        (hosts, devices_per_host),
        ("data", "model"),
        tuple(range(hosts * devices_per_host)),
        ("data",),
    )


def write_hosts(ckpt: Path, hosts: int, n_arrays: int, writers: int) -> None:
    """The hosts' part (its own process): every database, and each host's ack pickled apart."""
    directory = ckpt / "state"
    directory.mkdir(parents=True)
    names = array_names(n_arrays)
    header = headers(names, hosts)
    t0 = time.perf_counter()
    token = os.urandom(4).hex()  # (the save's: the controller draws one for every host)
    with ThreadPoolExecutor(8) as pool:
        written = list(
            pool.map(
                lambda p: write_process(directory, p, hosts, names, header, writers, token),
                range(hosts),
            )
        )
    acks = []
    for p, (mine, packed) in enumerate(written):
        ack = workers.SaveAck(
            process_index=p,
            bytes_written=n_arrays * 4 * COLS,
            arrays=tuple(mine),
            chunk_tables=(packed,),
        )
        acks.append(pickle.dumps(ack, protocol=pickle.HIGHEST_PROTOCOL))
    (ckpt / "acks.pickle").write_bytes(pickle.dumps(acks, protocol=pickle.HIGHEST_PROTOCOL))
    (ckpt / "write_secs").write_text(str(time.perf_counter() - t0))


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> None:
    """Start the kernel's RSS high-water mark (VmHWM) again from the current RSS (after
    touching and freeing ``WARM_BYTES``, with ``--warm``)."""
    if WARM_BYTES:
        scratch = np.ones(WARM_BYTES, np.uint8)
        del scratch
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class SimGroup:
    """H hosts of ``devices_per_host`` devices (device d on host d // devices_per_host), in this
    process: the Ray group's device checks, and a ``load`` that keeps the plans it would send
    (the read + plan measure stops there)."""

    name = "sim"

    def __init__(self, hosts: int, devices_per_host: int) -> None:
        from milepost.colocated._ray_group import RayHostGroup

        self.hosts = hosts
        self.device_ids = list(range(hosts * devices_per_host))
        self._owner = {d: d // devices_per_host for d in self.device_ids}
        self._checked_ids = None
        self.check_devices = RayHostGroup.check_devices.__get__(self)
        self.process_of_device = RayHostGroup.process_of_device.__get__(self)
        self.devices_here = RayHostGroup.devices_here.__get__(self)
        self.plans: dict[int, workers.LoadPlan] = {}

    def is_primary(self) -> bool:
        return True

    def processes(self) -> range:
        return range(self.hosts)

    def broadcast(self, name: str, value: Any, timeout: float) -> Any:
        return value

    def barrier(self, name: str, timeout: float) -> None:
        return None

    def load(self, plans: Any, timeout: float) -> Any:
        from milepost.colocated import HostLoad

        self.plans = dict(plans)
        (plan, *_) = self.plans.values()
        return HostLoad([None] * len(plan.tasks), [])


class _Timed:
    """Seconds spent in ``workers.format.confirm_files`` (the commit's confirmation of the data
    files: one listing per folder) since last read."""

    def __init__(self) -> None:
        self.secs = 0.0
        self.real = tsu.confirm_files

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        t0 = time.perf_counter()
        try:
            self.real(*args, **kwargs)
        finally:
            self.secs += time.perf_counter() - t0


CONFIRMED = _Timed()
tsu.confirm_files = CONFIRMED  # (where merge_ocdbt finds it)
workers.format.confirm_files = CONFIRMED  # (where the commit's own steps find it)


def _commit(ckpt: Path, directory: Path, files: Any, acks: list[Any]) -> dict[str, float]:
    """One commit of the simulated save (the controller's work after the hosts' acks), each
    step timed."""
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    tree_format.write_tree(directory, files, acks, "cpu")
    out["metadata_secs"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    commit_phases.merge(WrittenTree(directory, files, acks))  # (the databases confirmed, merged)
    out["merge_secs"] = time.perf_counter() - t0
    out["confirm_secs"] = CONFIRMED.secs
    CONFIRMED.secs = 0.0
    t0 = time.perf_counter()
    # the checkpoint's own files, its checksums and its marker, as the commit writes them
    commit_phases.own_files(ckpt, {"state": PyTreeHandler()}, time.time_ns(), "{}", {})
    commit_phases.checksums(ckpt).write()
    commit_phases.marker(ckpt, ckpt, lambda: None)
    out["checksums_secs"] = time.perf_counter() - t0
    out["commit_secs"] = out["metadata_secs"] + out["merge_secs"] + out["checksums_secs"]
    return out


def controller(ckpt: Path, hosts: int, n_arrays: int, devices_per_host: int) -> dict[str, Any]:
    """The controller's part (its own process): the commit, then the read + plan of a load."""
    from milepost._checkpoint import _pytree_load
    from milepost._checkpoint._calls import LoadCall

    directory = ckpt / "state"
    names = array_names(n_arrays)
    rss0 = _status_kib("VmRSS")
    out: dict[str, Any] = {"hosts": hosts}
    raw = pickle.loads((ckpt / "acks.pickle").read_bytes())
    acks = [pickle.loads(b) for b in raw]  # one message per host, unpickled apart
    del raw
    out["acks_rss_mib"] = (_status_kib("VmRSS") - rss0) / 1024
    databases = len(list(directory.glob("ocdbt.process_*")))
    tables = len(list(directory.glob("ocdbt.process_*.p")))  # (one per packed database)
    out["databases"] = databases
    sharding = sharding_of(hosts, devices_per_host)
    leaves, _ = _tree.flatten(tree_of(names))
    files = tree_format.TreeFiles(
        leaves={
            leaf.name: tree_format.SavedLeaf.of(leaf, ValueType.JAX_ARRAY, (1, COLS))
            for leaf in leaves
        },
        use_ocdbt=True,
        shardings={name: sharding for name in names},
    )

    runs = []
    commit_peak = 0.0
    for attempt in range(COMMITS):
        if attempt:  # the same commit again, on the same databases: what it wrote removed first
            (directory / "manifest.ocdbt").unlink()
            shutil.rmtree(directory / "d")
            for name in (
                fmt.ORBAX_MARKER,
                fmt.CHECKPOINT_METADATA,
                fmt.CHECKSUMS,
                fmt.COMMIT_MARKER,
            ):
                (ckpt / name).unlink()
        _reset_peak()
        run = _commit(ckpt, directory, files, acks)
        runs.append(run)
        commit_peak = max(commit_peak, (_status_kib("VmHWM") - rss0) / 1024)
    # (the run of median commit time, and every run's commit time)
    median = sorted(runs, key=lambda r: r["commit_secs"])[len(runs) // 2]
    out.update(median)
    out["commit_runs"] = [r["commit_secs"] for r in runs]
    out["commit_rss_mib"] = commit_peak
    del acks

    # A load of the whole tree onto the same H hosts, up to the plans it sends.
    group = SimGroup(hosts, devices_per_host)
    call = LoadCall(options=_options.current(), group=group)  # type: ignore[arg-type]
    _reset_peak()
    t0 = time.perf_counter()
    with fmt.verifying(fmt.Checksums.read(ckpt)):
        _pytree_load.load(directory, None, call)
    out["read_plan_secs"] = time.perf_counter() - t0
    out["plans_sent_mib"], out["plans_pickle_secs"] = plans_sent(group.plans, hosts, n_arrays)
    del group, call
    out["plan_rss_mib"] = (_status_kib("VmHWM") - rss0) / 1024
    out["rss_growth_mib"] = max(out["commit_rss_mib"], out["plan_rss_mib"])
    t0 = time.perf_counter()
    meta = mp.metadata(ckpt)
    out["read_metadata_secs"] = time.perf_counter() - t0
    assert len(meta.leaves()) == n_arrays

    def size(path: Path) -> int:
        return path.stat().st_size if path.exists() else 0

    manifests = sum(size(p / "manifest.ocdbt") for p in directory.glob("ocdbt.process_*"))
    out["sizes"] = {
        "_METADATA": size(directory / fmt.TREE_METADATA),
        "_sharding": size(directory / fmt.SHARDING),
        "_milepost.json": size(directory / fmt.MILEPOST_INFO),
        "array_metadatas/": sum(size(p) for p in (directory / fmt.ARRAY_METADATAS).iterdir()),
        "root manifest + B-tree": size(directory / "manifest.ocdbt")
        + sum(size(p) for p in (directory / "d").iterdir()),
        "process manifests": manifests,
        "_milepost_checksums.json": size(ckpt / fmt.CHECKSUMS),
        "other": sum(
            size(ckpt / f) for f in (fmt.CHECKPOINT_METADATA, fmt.ORBAX_MARKER, fmt.COMMIT_MARKER)
        ),
    }
    out["metadata_mib"] = sum(out["sizes"].values()) / MIB
    out["files"] = sum(1 for p in ckpt.rglob("*") if p.is_file())

    # The merged view: every key of every database, and one array read back whole.
    t0 = time.perf_counter()
    kv = ts.KvStore.open(tsu.ocdbt_kvstore(str(directory))).result()
    keys = kv.list().result()
    out["keys"] = len(keys)
    out["list_secs"] = time.perf_counter() - t0
    # every chunk, every header, and a chunk checksum table per database
    assert len(keys) == n_arrays * (hosts + 1) + tables, (len(keys), n_arrays, hosts)
    del keys
    k = n_arrays // 2
    array = ts.open(
        tsu.open_spec(tsu.ocdbt_kvstore(str(directory)), names[k]), open=True, read=True
    ).result()
    got = array.read().result()
    want = np.asarray([[p * 10_000 + k] * COLS for p in range(hosts)], np.float32)
    assert np.array_equal(got, want), "the merged view does not give back every host's shard"
    out.update(host_index(directory, names))
    return out


def host_index(directory: Path, names: list[str]) -> dict[str, Any]:
    """What each host of a load does first: find where its arrays' chunks lie, through the
    root view. Every array's (``Locator.index``, the NumPy walk), its time and peak RSS growth;
    and, side by side on the first ``REFERENCE_ARRAYS`` arrays, the NumPy walk against
    TensorStore's walk (``ocdbt.dump``, which the locator used before: it makes a Python object
    per entry, and takes minutes for every array at 4,096 hosts)."""
    from milepost.workers.format._ocdbt_index import Prefixes
    from milepost.workers.format._ts_internals import ocdbt_values
    from milepost.workers.load._locator import Locator

    store = workers.StoreSpec(directory=str(directory), use_ocdbt=True)
    out: dict[str, Any] = {}
    few = names[:REFERENCE_ARRAYS]
    t0 = time.perf_counter()
    Locator(store).index(few)
    out["index_few_secs"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    found = dict(ocdbt_values(str(directory), Prefixes(f"{n}/".encode() for n in few)))
    out["index_few_dump_secs"] = time.perf_counter() - t0
    del found
    rss0 = _status_kib("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    locator = Locator(store)
    locator.index(names)
    out["index_secs"] = time.perf_counter() - t0
    out["index_rss_mib"] = (_status_kib("VmHWM") - rss0) / 1024
    assert locator.locate(f"{names[-1]}/c/0/0") is not None
    return out


def plans_sent(plans: dict[int, Any], hosts: int, n_arrays: int) -> tuple[float, float]:
    """MiB the hosts are sent, and the seconds the controller pickles: each distinct plan
    object once (``RayHostGroup.load``), each host receiving its plan's bytes."""
    assert len(plans) == hosts and all(len(p.tasks) == n_arrays for p in plans.values())
    t0 = time.perf_counter()
    sent = 0
    sizes: dict[int, int] = {}
    for plan in plans.values():
        if id(plan) not in sizes:
            sizes[id(plan)] = len(pickle.dumps(plan, protocol=5))
        sent += sizes[id(plan)]
    return sent / MIB, time.perf_counter() - t0


TARGETS = [  # (measure, limit at the largest H, unit)
    ("metadata_mib", 20.0, "MB"),
    ("read_plan_secs", 2.0, "s"),
    ("commit_secs", 10.0, "s"),
    ("rss_growth_mib", 1024.0, "MiB"),
]
MAX_GROWTH = 8.0
"""From 512 to 4,096 hosts each measure may grow at most 8x (linear in hosts)."""


def run_one(root: Path, args: argparse.Namespace, hosts: int) -> dict[str, Any]:
    ckpt = root / f"h{hosts}"
    common = [sys.executable, __file__, "--arrays", str(args.arrays), "--hosts", str(hosts)]
    common += ["--devices-per-host", str(args.devices_per_host), "--writers", str(args.writers)]
    common += ["--headers-everywhere"] if args.headers_everywhere else []
    common += ["--warm", str(args.warm), "--commits", str(args.commits)]
    subprocess.run([*common, "--phase", "hosts", "--dir", str(ckpt)], check=True)
    # The hosts' writes are on disk before the commit starts, as a save's are: the kernel is
    # not writing them back while the controller is timed.
    os.sync()
    done = subprocess.run(
        [*common, "--phase", "controller", "--dir", str(ckpt)],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    res = json.loads(done.stdout.strip().splitlines()[-1])
    res["write_secs"] = float((ckpt / "write_secs").read_text())
    return res


def main() -> int:
    global HEADERS_EVERYWHERE, WARM_BYTES, COMMITS
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hosts", default="512,1024,4096")
    parser.add_argument("--arrays", type=int, default=2000)
    parser.add_argument("--devices-per-host", type=int, default=8)
    parser.add_argument(
        "--writers",
        type=int,
        default=1,
        help="OCDBT databases per host (SaveOptions.ocdbt_writers_per_host)",
    )
    parser.add_argument("--dir", default=None, help="where to write (a disk, not tmpfs)")
    parser.add_argument("--keep", action="store_true", help="keep the simulated checkpoints")
    parser.add_argument(
        "--headers-everywhere",
        action="store_true",
        help="every host writes every zarr.json (the old save)",
    )
    parser.add_argument(
        "--warm",
        type=float,
        default=0.0,
        help="GiB touched and freed before each timed controller phase (0: none)",
    )
    parser.add_argument(
        "--commits",
        type=int,
        default=COMMITS,
        help="times the commit is timed on the same databases (the median one is reported)",
    )
    parser.add_argument("--phase", choices=("hosts", "controller"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.commits < 1:
        parser.error("--commits: at least 1")
    COMMITS = args.commits
    HEADERS_EVERYWHERE = args.headers_everywhere
    WARM_BYTES = int(args.warm * 2**30)
    if args.phase == "hosts":
        write_hosts(Path(args.dir), int(args.hosts), args.arrays, args.writers)
        return 0
    if args.phase == "controller":
        res = controller(Path(args.dir), int(args.hosts), args.arrays, args.devices_per_host)
        print(json.dumps(res))
        return 0
    root = Path(tempfile.mkdtemp(prefix="milepost-merge-sim-", dir=args.dir))
    results = []
    try:
        for hosts in (int(h) for h in args.hosts.split(",")):
            res = run_one(root, args, hosts)
            results.append(res)
            print(
                f"H={hosts}: {res['databases']} databases written in {res['write_secs']:.1f} s; "
                f"commit {res['commit_secs']:.2f} s (metadata {res['metadata_secs']:.2f}, "
                f"merge {res['merge_secs']:.2f} (confirm {res['confirm_secs']:.3f}), "
                f"checksums {res['checksums_secs']:.2f}; the "
                f"median of {' / '.join(f'{t:.2f}' for t in res['commit_runs'])} s); "
                f"read + plan {res['read_plan_secs']:.2f} s; plans sent "
                f"{res['plans_sent_mib']:.1f} MiB (pickled in {res['plans_pickle_secs']:.2f} s); "
                f"metadata {res['metadata_mib']:.2f} MiB; RSS +{res['rss_growth_mib']:.0f} MiB "
                f"(acks {res['acks_rss_mib']:.0f}, commit {res['commit_rss_mib']:.0f}, "
                f"read + plan {res['plan_rss_mib']:.0f}); {res['keys']} keys listed in "
                f"{res['list_secs']:.2f} s; mp.metadata {res['read_metadata_secs']:.2f} s; "
                f"a host's chunk index: every array {res['index_secs']:.2f} s, RSS "
                f"+{res['index_rss_mib']:.0f} MiB; {REFERENCE_ARRAYS} arrays "
                f"{res['index_few_secs']:.2f} s against {res['index_few_dump_secs']:.2f} s "
                "with TensorStore's walk",
                flush=True,
            )
            if not args.keep:
                shutil.rmtree(root / f"h{hosts}", ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(
        f"\n{args.arrays} arrays, {args.devices_per_host} devices per host, "
        f"{args.writers} writer(s) per host, "
        + (
            "every host writes every zarr.json"
            if args.headers_everywhere
            else "one zarr.json per array"
        )
    )
    print(
        f"{'H':>5} {'metadata s':>11} {'merge s':>8} {'confirm s':>10} {'checksums s':>12} "
        f"{'commit s':>9} "
        f"{'read+plan s':>12} {'metadata MiB':>13} {'RSS +MiB':>9} "
        f"{'plans sent MiB':>15} "
        f"{'mp.metadata s':>14} {'host index s':>13} {'host index +MiB':>16}"
    )
    for r in results:
        print(
            f"{r['hosts']:>5} {r['metadata_secs']:>11.2f} {r['merge_secs']:>8.2f} "
            f"{r['confirm_secs']:>10.3f} {r['checksums_secs']:>12.2f} {r['commit_secs']:>9.2f} "
            f"{r['read_plan_secs']:>12.2f} "
            f"{r['metadata_mib']:>13.2f} {r['rss_growth_mib']:>9.0f} {r['plans_sent_mib']:>15.1f} "
            f"{r['read_metadata_secs']:>14.2f} {r['index_secs']:>13.2f} "
            f"{r['index_rss_mib']:>16.0f}"
        )
    print("\nsizes (MiB):")
    for r in results:
        print(
            f"  H={r['hosts']}: " + ", ".join(f"{k} {v / MIB:.2f}" for k, v in r["sizes"].items())
        )
    first, last = results[0], results[-1]
    print(f"\ntargets at H={last['hosts']} (growth H={first['hosts']} -> {last['hosts']}):")
    for key, limit, unit in TARGETS:
        value = last[key] if unit != "MB" else last[key] * MIB / 1e6
        verdict = "PASS" if value <= limit else "FAIL"
        line = f"  {verdict}  {key}: {value:.2f} {unit} (target <= {limit:g} {unit})"
        if len(results) > 1 and first[key] > 0:
            growth = last[key] / first[key]
            ok = "PASS" if growth <= MAX_GROWTH * last["hosts"] / first["hosts"] / 8 else "FAIL"
            line += f"; growth {growth:.1f}x for {last['hosts'] / first['hosts']:g}x hosts: {ok}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
