"""Every TensorStore spec milepost uses: kvstores for the on-disk layout (zarr3 arrays,
optionally inside OCDBT), array specs, reading array headers and merging OCDBT stores.

Layout of a checkpointable folder with OCDBT: each host writes its own databases
``ocdbt.process_<i>`` (and ``ocdbt.process_<i>.<k>`` for extra writers; the controller's own
leaves go to ``ocdbt.process_controller``); the commit merges them into a root database in the
folder itself, which references their data files without copying. Without OCDBT each array is a
plain zarr3 folder named after its leaf.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tensorstore as ts

from milepost.workers import _declared
from milepost.workers._declared import ZARR3_DTYPES as ZARR3_DTYPES
from milepost.workers._errors import CorruptCheckpointError
from milepost.workers._messages import ArraySpec, StoreSpec
from milepost.workers._paths import (
    ObjectPath,
    as_path,
    context_for,
    is_local,
    kvstore,
)
from milepost.workers.format import _ocdbt_merge
from milepost.workers.format._confirm import confirm_files, root_sizes
from milepost.workers.format._ocdbt_format import FormatError, note_fallback
from milepost.workers.format._ts_errors import from_tensorstore

PROCESS_PREFIX = "ocdbt.process_"
OCDBT_CONFIG = {
    # Small values (zarr.json, scalars) inline in the B-tree, array chunks in data files.
    "max_inline_value_bytes": 1024,
    "max_decoded_node_bytes": 100_000_000,
    # One writer per database: the single-file manifest is enough and cheapest.
    "manifest_kind": "single",
}

ROOT_OCDBT_CONFIG = {
    **OCDBT_CONFIG,
    # The merged root view holds a key per chunk per host (a million at 512 hosts x 2,000
    # arrays). With 100 MB nodes that was one huge leaf, decoded whole by every header read
    # of every load; 8 MB nodes read faster, and merge as fast (docs/performance.md).
    "max_decoded_node_bytes": 8_000_000,
}

REMOTE_READ_COALESCING = {
    # In an object store every read is a request: reads of one data file less than 1 MiB apart
    # (the inner chunks of a shard, small arrays written together) are merged into one ranged
    # GET of at most 256 MiB, issued after waiting 1 ms for neighbours.
    "experimental_read_coalescing_threshold_bytes": 1 << 20,
    "experimental_read_coalescing_merged_bytes": 1 << 28,
    "experimental_read_coalescing_interval": "1ms",
}


def new_context(where: Any = None, file_io_concurrency: int = 64) -> ts.Context:
    """A context for I/O at ``where`` (a path or URL; the shared one for memory://)."""
    if where is not None and isinstance(as_path(where), ObjectPath):
        return context_for(where)
    return ts.Context({"file_io_concurrency": {"limit": file_io_concurrency}})


# ------------------------------------------------------------------------------------------
# kvstores
# ------------------------------------------------------------------------------------------


def file_kvstore(path: Any) -> dict[str, Any]:
    """A folder (a local path, or a prefix in an object store) as a kvstore."""
    return kvstore(path)


def ocdbt_kvstore(
    path: Any, *, writable: bool = False, config: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The OCDBT database whose manifest is in folder ``path`` (``config``: the one a new
    writable database is created with, by default ``OCDBT_CONFIG``)."""
    spec: dict[str, Any] = {"driver": "ocdbt", "base": file_kvstore(path)}
    if writable:
        spec["config"] = OCDBT_CONFIG if config is None else config
    elif isinstance(as_path(path), ObjectPath):
        spec.update(REMOTE_READ_COALESCING)
    return spec


PACKED_SUFFIX = ".p"
"""A host's packed database (``workers.save._packed``) is its writer database's folder with this
after it. Short, as its table's key (``.milepost/chunk_crc32c/<database>``) is often a save's
longest: 43 bytes at 4,096 hosts x 2,000 arrays, against the chunks' 29 (the commit's merge
keeps the longest few keys apart from its rows, ``_ocdbt_merge._width``)."""


def process_dir_name(process_index: int | str, writer: int = 0) -> str:
    return f"{PROCESS_PREFIX}{process_index}" + (f".{writer}" if writer else "")


def write_kvstore(store: StoreSpec, process_index: int | str, writer: int = 0) -> dict[str, Any]:
    """The kvstore a host's writer writes into: its own OCDBT database, or the plain folder."""
    if not store.use_ocdbt:
        return file_kvstore(store.directory)
    return ocdbt_kvstore(
        as_path(store.directory) / process_dir_name(process_index, writer), writable=True
    )


def read_kvstore(store: StoreSpec) -> dict[str, Any]:
    """The kvstore a reader sees: the merged root OCDBT view, or the plain folder."""
    if not store.use_ocdbt:
        return file_kvstore(store.directory)
    return ocdbt_kvstore(store.directory)


def _array_kvstore(kvstore: dict[str, Any], name: str) -> dict[str, Any]:
    """The kvstore of one array: a key prefix inside OCDBT, a sub-folder of a plain folder."""
    if kvstore["driver"] != "ocdbt":
        return {**kvstore, "path": kvstore.get("path", "") + name + "/"}
    return {**kvstore, "path": name + "/"}


# ------------------------------------------------------------------------------------------
# Arrays
# ------------------------------------------------------------------------------------------


def create_spec(kvstore: dict[str, Any], spec: ArraySpec) -> dict[str, Any]:
    inner: list[dict[str, Any]] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if spec.compression == "zstd":
        inner.append({"name": "zstd", "configuration": {"level": 3, "checksum": False}})
    elif spec.compression is not None:
        raise ValueError(f"unknown compression {spec.compression!r}; use None or 'zstd'")
    return {
        "driver": "zarr3",
        "kvstore": _array_kvstore(kvstore, spec.name),
        # Orbax reads with fill_missing_data_reads=False: every chunk must exist, zeros included.
        "store_data_equal_to_fill_value": True,
        "metadata": {
            "shape": list(spec.shape),
            "data_type": spec.dtype,
            "chunk_grid": {
                "name": "regular",
                "configuration": {"chunk_shape": list(spec.write_shape)},
            },
            "chunk_key_encoding": {"name": "default"},
            "codecs": [
                {
                    "name": "sharding_indexed",
                    "configuration": {
                        "chunk_shape": list(spec.chunk_shape),
                        "codecs": inner,
                        "index_codecs": [
                            {"name": "bytes", "configuration": {"endian": "little"}},
                            {"name": "crc32c"},
                        ],
                    },
                }
            ],
        },
    }


def header_key(store: StoreSpec, name: str) -> str:
    """The key of an array's header: ``zarr.json`` (zarr3) or ``.zarray`` (zarr2)."""
    return f"{name}/.zarray" if store.zarr_format == 2 else f"{name}/zarr.json"


def open_spec(
    kvstore: dict[str, Any], name: str, fill_missing: bool = False, zarr_format: int = 3
) -> dict[str, Any]:
    return {
        "driver": "zarr" if zarr_format == 2 else "zarr3",
        "kvstore": _array_kvstore(kvstore, name),
        "recheck_cached_data": False,
        "recheck_cached_metadata": False,
        "fill_missing_data_reads": fill_missing,
    }


def read_array_headers(
    store: StoreSpec, names: Sequence[str], damaged: dict[str, Exception] | None = None
) -> dict[str, dict[str, Any]]:
    """The ``zarr.json`` of each named array (small reads through the root view), each checked
    (:func:`._declared.zarr_header`). An array whose header is missing or breaks those rules
    is a :class:`CorruptCheckpointError` naming it, raised, or kept in ``damaged`` (by name)
    when given (``verify`` goes on with the others)."""
    if not names:
        return {}
    try:
        kv = ts.KvStore.open(read_kvstore(store), context=new_context(store.directory)).result()
        reads = {n: kv.read(header_key(store, n)) for n in names}
        results = {n: r.result() for n, r in reads.items()}
    except ValueError as e:  # a damaged manifest or B-tree node: DATA_LOSS
        raise from_tensorstore(
            e, "reading the arrays' headers", store.directory, reading=True
        ) from e
    out = {}
    for name, result in results.items():
        if result.state != "value":
            raise CorruptCheckpointError(
                f"array {name!r} is listed in the tree metadata of "
                f"{store.directory} but its data is missing; the checkpoint is "
                "damaged or was not merged. Load an earlier checkpoint.",
                array=name,
                path=store.directory,
            )
        where = f"{store.directory}/{header_key(store, name)}"
        try:
            header = _declared.loads(bytes(result.value), where, f"the header of array {name!r}")
            out[name] = _declared.zarr_header(header, name, where)
        except CorruptCheckpointError as e:
            if damaged is None:
                raise
            damaged[name] = e
    return out


# ------------------------------------------------------------------------------------------
# The commit's merge
# ------------------------------------------------------------------------------------------


def process_stores(directory: Any) -> list[Path] | list[ObjectPath]:
    """The per-process OCDBT databases (``ocdbt.process_*``) in a checkpointable's folder."""
    where = as_path(directory)
    if is_local(where):
        return sorted(p for p in where.glob(f"{PROCESS_PREFIX}*") if p.is_dir())
    kv = ts.KvStore.open(where.kvstore(), context=context_for(where)).result()
    prefix = PROCESS_PREFIX.encode()
    keys = kv.list(ts.KvStore.KeyRange(prefix, prefix[:-1] + bytes([prefix[-1] + 1]))).result()
    return sorted({where / k.decode().split("/", 1)[0] for k in keys})


MERGE_BATCH_KEYS = 1 << 19
"""About this many keys are merged per transaction: the merge holds the B-tree nodes of one
batch in memory, not the whole root view's (at 4,096 hosts x 2,000 arrays, 8 M keys)."""


def merge_ocdbt(directory: Any) -> None:
    """Make the root OCDBT view in ``directory`` reference every per-process database
    (``ocdbt.process_*``); no data is copied, only B-tree entries. Then confirm that every data
    file the view references is there, at least as long as its last value's end (one listing
    per folder: :func:`~._confirm.confirm_files`), or raise
    :class:`~._errors.LostWriteError` naming one that is not: a view that calls for data the
    storage lost is never committed.

    milepost's own writer (:func:`~._ocdbt_merge.write_root`) writes the view; databases in a
    form it does not read are merged by TensorStore instead, said once at WARNING with the
    reason (:func:`~._ocdbt_format.note_fallback`).

    With many databases the key space is cut into ranges of about :data:`MERGE_BATCH_KEYS` keys
    (estimated from one database's keys: hosts write about the same arrays), each merged
    in a transaction of its own, committed while the next range is copied in; the ranges cover
    every key, whatever the estimate. The root view is not a checkpoint until the commit (the
    rename, or the commit marker), so it need not appear at once."""
    children = process_stores(directory)
    if not children:
        return
    try:
        sizes = _ocdbt_merge.write_root(directory, [c.name for c in children], ROOT_OCDBT_CONFIG)
    except FormatError as e:  # (a form the direct writer does not read: TensorStore merges,
        note_fallback("merge", "TensorStore's copy_range_to", e)  # or says what is wrong)
        _merge_with_tensorstore(directory, children)
        sizes = root_sizes(directory)
    confirm_files(directory, sizes)


def _merge_with_tensorstore(directory: Any, children: list[Path] | list[ObjectPath]) -> None:
    """The root view merged by TensorStore: in key ranges, a transaction each."""
    context = new_context(directory)
    parent = ts.KvStore.open(
        ocdbt_kvstore(directory, writable=True, config=ROOT_OCDBT_CONFIG), context=context
    ).result()
    opened = [ts.KvStore.open(ocdbt_kvstore(child), context=context) for child in children]
    try:
        stores = [o.result() for o in opened]
        bounds = [b"", b""]  # one range: every key (b"" as the end: no upper bound)
        if len(stores) * 1024 > MERGE_BATCH_KEYS:  # (a database may hold 1,024 keys or more)
            # (a middle one: the first may hold every array's header besides its chunks; a
            # packed one if any, as small chunks are packed and writer databases may hold
            # headers only)
            names = [c.name for c in children]
            some = [s for n, s in zip(names, stores, strict=True) if n.endswith(PACKED_SUFFIX)]
            some = some or stores
            keys = sorted(some[len(some) // 2].list().result())
            batches = min(len(keys), -(-len(keys) * len(stores) // MERGE_BATCH_KEYS))
            if batches > 1:
                cuts = (keys[i * len(keys) // batches] for i in range(1, batches))
                bounds = [b"", *cuts, b""]
        commits: list[ts.Future[None]] = []  # in flight, oldest first
        try:
            for low, high in itertools.pairwise(bounds):
                part = ts.KvStore.KeyRange(low, high)
                txn = ts.Transaction(atomic=True)
                copies = [
                    s.experimental_copy_range_to(parent.with_transaction(txn), source_range=part)
                    for s in stores
                ]
                for c in copies:
                    c.result()
                # A range's commit (writing B-tree nodes) runs while the next range is copied
                # in (reading the databases' leaves) and beside the next one's commit: a third
                # off the merge at 4,096 hosts (docs/performance.md#the-commit-at-many-hosts).
                commits.append(txn.commit_async())
                if len(commits) > 1:
                    commits.pop(0).result()
            while commits:
                commits.pop(0).result()
        finally:
            for f in commits:  # (after a failure: no commit goes on writing into the folder)
                with contextlib.suppress(Exception):
                    f.result()
    except ValueError as e:
        mapped = from_tensorstore(e, "merging the per-process OCDBT stores", str(directory))
        if mapped is e:
            raise
        raise mapped from e


def header_shape(header: dict[str, Any]) -> tuple[int, ...]:
    return tuple(int(n) for n in header["shape"])


def header_chunks(header: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """An array header's (stored chunk shape, shard shape): the inner chunks of a sharded zarr3
    array and its shards; for other arrays the chunk shape twice."""
    if header.get("zarr_format") == 2 or "chunks" in header:
        chunks = tuple(int(n) for n in header["chunks"])
        return chunks, chunks
    grid = tuple(int(n) for n in header["chunk_grid"]["configuration"]["chunk_shape"])
    codecs = header.get("codecs") or [{}]
    if codecs[0].get("name") == "sharding_indexed":
        return tuple(int(n) for n in codecs[0]["configuration"]["chunk_shape"]), grid
    return grid, grid


def zarr_metadata(store: Any) -> dict[str, Any]:
    """An opened array's zarr metadata (from its spec's JSON, which costs tens of microseconds:
    a load takes it once per array)."""
    return store.spec().to_json().get("metadata", {})


def chunk_shapes(
    store: Any, metadata: dict[str, Any] | None = None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shape of an opened array's stored chunks (inner chunks of a sharded zarr3 array) and
    of its shards (``metadata``: its :func:`zarr_metadata`, if the caller has it)."""
    return header_chunks(zarr_metadata(store) if metadata is None else metadata)


def header_dtype_name(header: dict[str, Any]) -> str:
    """The stored dtype's name in a header: zarr3's ``data_type``, or zarr2's ``dtype`` (a NumPy
    type string such as ``<f4``, or ``bfloat16``)."""
    if "data_type" in header:
        return str(header["data_type"])
    return str(header["dtype"])
