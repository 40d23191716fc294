"""The commit of an H-host save, simulated: merge H per-process OCDBT databases and write the
metadata.

    python benchmarks/merge_sim.py [--hosts 8,64,512] [--arrays 2000] [--devices-per-host 8]
                                   [--writers 1] [--dir /tmp/x] [--keep]

No hosts run. For each H, the script writes what the hosts of an H-host save of a 2,000-array
model leave behind, straight with TensorStore and milepost's own OCDBT settings
(``workers._tensorstore.OCDBT_CONFIG``): every array is sharded along its first axis over the H
hosts (a (H, devices-per-host) mesh, ``PartitionSpec("data")``), so each of the H (x writers)
per-process databases ``ocdbt.process_<p>[.<k>]`` holds its one shard ``c/<p>/0`` of every array
(and host 0's also every array's ``zarr.json``, as the save asks one host per array to write
it): 1 KiB of values with the zarr3 shard index and CRC32C after it (1,044 bytes, so it lives in
a data file like real chunks, not inline in the B-tree). The hosts' acks (every array's write
shape and the CRC32C of its chunk) are built as the engine builds them.

Then it times, on the controller, what the commit does with them (``_pytree_save.finish_tree``
and ``_checkpoint_save.commit``'s checksums), each step apart:

* ``metadata``: ``_METADATA``, ``_sharding``, ``_milepost.json`` and ``array_metadatas/process_<p>``
  (``_pytree_format.write_tree``);
* ``merge``: the root OCDBT view referencing every per-process database (``workers.merge_ocdbt``);
* ``checksums``: the checkpoint's own files and ``_milepost_checksums.json`` over every file but
  array data (``Checksums.compute``), then the commit marker;

and, once committed, ``mp.metadata(path)`` (which reads every format file back),
and checks the result: the root view lists every key of every database, and a read of one
array through it returns every host's shard exactly. Prints times, sizes and file counts per H,
and the growth from one H to the next against linear.
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts

import milepost as mp
from milepost import _format as fmt
from milepost import _format as tree_format
from milepost import _tree, workers
from milepost._tree import ValueType
from milepost.workers import _checksum
from milepost.workers import _tensorstore as tsu

COLS = 256  # float32: 1 KiB per host per array
HEADERS_EVERYWHERE = False
"""True: every host's database has every array's zarr.json (milepost before the save asked one
host per array to write it; ``--headers-everywhere``)."""
MIB = 2**20


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


def shard_value(host: int, k: int) -> tuple[bytes, int]:
    """The stored shard of host ``host`` of array ``k`` (values, then the shard index and its
    CRC32C), and the CRC32C of its values."""
    values = np.full(COLS, host * 10_000 + k, np.float32).tobytes()
    index = struct.pack("<QQ", 0, len(values))
    return values + index + struct.pack("<I", _checksum.crc32c(index)), _checksum.crc32c(values)


def write_process(
    directory: Path, process: int, writer: int, names: list[str], header: dict[str, bytes]
) -> list[Any]:
    """One host's (one writer's) database: the arrays ``names`` of it, in one transaction."""
    store = workers.StoreSpec(directory=str(directory), use_ocdbt=True)
    kv = ts.KvStore.open(tsu.write_kvstore(store, process, writer)).result()
    txn = ts.Transaction()
    written = []
    for name in names:
        k = int(name[-2:]) + 20 * int(name[13:16])
        value, crc = shard_value(process, k)
        if process == 0 or HEADERS_EVERYWHERE:
            kv.with_transaction(txn)[f"{name}/zarr.json"] = header[name]
        kv.with_transaction(txn)[f"{name}/c/{process}/0"] = value
        written.append(
            workers.WrittenArray(
                name=name,
                write_shape=(1, COLS),
                chunk_shape=(1, COLS),
                chunk_crc32c=(((process, 0), crc),),
            )
        )
    txn.commit_async().result()
    return written


def simulate(
    root: Path, hosts: int, n_arrays: int, devices_per_host: int, writers: int
) -> dict[str, Any]:
    ckpt = root / f"h{hosts}"
    directory = ckpt / "state"
    directory.mkdir(parents=True)
    names = array_names(n_arrays)
    header = headers(names, hosts)
    t0 = time.perf_counter()
    parts = [(p, k, names[k::writers]) for p in range(hosts) for k in range(writers)]
    with ThreadPoolExecutor(8) as pool:
        written = list(
            pool.map(
                lambda part: write_process(directory, part[0], part[1], part[2], header), parts
            )
        )
    write_secs = time.perf_counter() - t0
    acks = []
    for p in range(hosts):
        mine = [w for (q, _, _), ws in zip(parts, written, strict=True) if q == p for w in ws]
        acks.append(
            workers.SaveAck(process_index=p, bytes_written=len(mine) * 4 * COLS, arrays=tuple(mine))
        )

    tree: dict[str, Any] = {}
    for name in names:
        node = tree
        *path, leaf = name.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = 0
    mesh = (hosts, devices_per_host)
    sharding = workers.ShardingSpec.named(
        mesh, ("data", "model"), tuple(range(hosts * devices_per_host)), ("data",)
    )
    leaves, _ = _tree.flatten(tree)
    files = tree_format.TreeFiles(
        leaves={
            leaf.name: tree_format.SavedLeaf.of(leaf, ValueType.JAX_ARRAY, (1, COLS))
            for leaf in leaves
        },
        use_ocdbt=True,
        shardings={name: sharding for name in names},
    )

    out: dict[str, Any] = {"hosts": hosts, "databases": hosts * writers, "write_secs": write_secs}
    t0 = time.perf_counter()
    tree_format.write_tree(directory, files, acks, "cpu")
    out["metadata_secs"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    workers.merge_ocdbt(directory)
    out["merge_secs"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    fmt.write_file(
        ckpt / fmt.ORBAX_MARKER, b""
    )  # the checkpoint's own files, as _checkpoint_save.commit writes them
    fmt.write_json(
        ckpt / fmt.CHECKPOINT_METADATA,
        {
            "item_handlers": {"state": fmt.PYTREE_HANDLER_TYPESTR},
            "metrics": {},
            "performance_metrics": {},
            "init_timestamp_nsecs": time.time_ns(),
            "commit_timestamp_nsecs": time.time_ns(),
            "custom_metadata": {},
        },
    )
    checksums = fmt.Checksums.compute(ckpt)
    checksums.write()
    fmt.write_file(ckpt / fmt.COMMIT_MARKER, "Checkpoint commit was successful")
    out["checksums_secs"] = time.perf_counter() - t0
    out["commit_secs"] = out["metadata_secs"] + out["merge_secs"] + out["checksums_secs"]
    # What every later load and metadata call pays for these files: mp.metadata reads them all.
    t0 = time.perf_counter()
    meta = mp.metadata(ckpt)
    out["read_metadata_secs"] = time.perf_counter() - t0
    assert len(meta.leaves()) == n_arrays

    def size(path: Path) -> int:
        return path.stat().st_size if path.exists() else 0

    out["sizes"] = {
        "_METADATA": size(directory / fmt.TREE_METADATA),
        "_sharding": size(directory / fmt.SHARDING),
        "_milepost.json": size(directory / fmt.MILEPOST_INFO),
        "array_metadatas/": sum(size(p) for p in (directory / fmt.ARRAY_METADATAS).iterdir()),
        "root manifest + B-tree": size(directory / "manifest.ocdbt")
        + sum(size(p) for p in (directory / "d").iterdir()),
        "_milepost_checksums.json": size(ckpt / fmt.CHECKSUMS),
    }
    out["files"] = sum(1 for p in ckpt.rglob("*") if p.is_file())
    out["checksummed_files"] = (
        len(json.loads((ckpt / fmt.CHECKSUMS).read_bytes()).get("files", {}))
        if (ckpt / fmt.CHECKSUMS).exists()
        else 0
    )

    # The merged view: every key of every database, and one array read back whole.
    t0 = time.perf_counter()
    kv = ts.KvStore.open(tsu.ocdbt_kvstore(str(directory))).result()
    keys = kv.list().result()
    out["keys"] = len(keys)
    out["list_secs"] = time.perf_counter() - t0
    assert len(keys) == n_arrays * (hosts + 1), (len(keys), n_arrays, hosts)
    k = n_arrays // 2
    array = ts.open(
        tsu.open_spec(tsu.ocdbt_kvstore(str(directory)), names[k]), open=True, read=True
    ).result()
    got = array.read().result()
    want = np.asarray([[p * 10_000 + k] * COLS for p in range(hosts)], np.float32)
    assert np.array_equal(got, want), "the merged view does not give back every host's shard"
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hosts", default="8,64,512")
    parser.add_argument("--arrays", type=int, default=2000)
    parser.add_argument("--devices-per-host", type=int, default=8)
    parser.add_argument(
        "--writers",
        type=int,
        default=1,
        help="OCDBT databases per host (SaveOptions.ocdbt_writers_per_host)",
    )
    parser.add_argument("--dir", default=None)
    parser.add_argument("--keep", action="store_true", help="keep the simulated checkpoints")
    parser.add_argument(
        "--headers-everywhere",
        action="store_true",
        help="every host writes every zarr.json (the old save)",
    )
    args = parser.parse_args()
    global HEADERS_EVERYWHERE
    HEADERS_EVERYWHERE = args.headers_everywhere
    root = Path(tempfile.mkdtemp(prefix="milepost-merge-sim-", dir=args.dir))
    results = []
    try:
        for hosts in (int(h) for h in args.hosts.split(",")):
            res = simulate(root, hosts, args.arrays, args.devices_per_host, args.writers)
            results.append(res)
            print(
                f"H={hosts}: {res['databases']} databases written in {res['write_secs']:.1f} s; "
                f"commit {res['commit_secs']:.2f} s (metadata {res['metadata_secs']:.2f}, "
                f"merge {res['merge_secs']:.2f}, checksums {res['checksums_secs']:.2f}); "
                f"{res['keys']} keys listed in {res['list_secs']:.2f} s; {res['files']} files; "
                f"mp.metadata {res['read_metadata_secs']:.2f} s",
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
        f"{'H':>5} {'metadata s':>11} {'merge s':>8} {'checksums s':>12} {'commit s':>9} "
        f"{'x prev':>7} {'H x prev':>9} {'mp.metadata s':>14}"
    )
    for i, r in enumerate(results):
        growth = r["commit_secs"] / results[i - 1]["commit_secs"] if i else float("nan")
        hosts_growth = r["hosts"] / results[i - 1]["hosts"] if i else float("nan")
        print(
            f"{r['hosts']:>5} {r['metadata_secs']:>11.2f} {r['merge_secs']:>8.2f} "
            f"{r['checksums_secs']:>12.2f} {r['commit_secs']:>9.2f} {growth:>7.1f} "
            f"{hosts_growth:>9.1f} {r['read_metadata_secs']:>14.2f}"
        )
    print("\nsizes (MiB):")
    for r in results:
        print(
            f"  H={r['hosts']}: "
            + ", ".join(f"{k} {v / MIB:.2f}" for k, v in r["sizes"].items())
            + f"; {r['checksummed_files']} files checksummed"
        )
    last = results[-1]
    verdict = "PASS" if last["commit_secs"] < 10 else "FAIL"
    print(f"\n{verdict}  commit at H={last['hosts']}: {last['commit_secs']:.2f} s (target < 10 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
