"""Chunk checksum tables: each writer's CRC32Cs in its own database, read by the hosts that read
its chunks (never by the controller).

Every OCDBT database a host writes (``ocdbt.process_<i>[.<k>]``) ends with one more key,
``.milepost/chunk_crc32c/<database>``: the CRC32C of the values of every chunk the writer wrote,
by array and chunk-grid index (JSON, then the little-endian CRC32C of the JSON). The merge
carries it into the root view like any other key: one key per database, whatever the number of
chunks. ``_milepost.json`` says only that the tables exist (``chunk_crc32c_tables``).

A host reading a chunk finds which data file holds it (the walk of the OCDBT B-tree that direct
reads make, :class:`~milepost.workers.load._locator.Locator`): the database that file belongs to
is the chunk's writer, whose table gives the checksum the values must have. The table names its
database, so a data file put in another one's place (holding another writer's values and table)
fails, and a chunk read from another place fails its checksum.

Chunks small enough to live inline in the B-tree (shard values up to OCDBT's
``max_inline_value_bytes``, 1 KiB) have no data file to find their writer by: the writer finds
them in its own database after its writes (for arrays whose shards may be that small:
compressed, or small) and reports their checksums in its ack, which the commit records in
``_milepost.json`` as before the tables (``chunk_crc32c``). A chunk inline in the B-tree that the
commit did not record fails the check (a value put in a chunk's place by hand).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from typing import Any

import tensorstore as ts

from milepost.workers import _declared as declared
from milepost.workers._errors import CorruptCheckpointError
from milepost.workers._messages import StoreSpec
from milepost.workers._paths import as_path, context_for, in_object_store, kvstore
from milepost.workers.format import _checksum
from milepost.workers.format._tensorstore import new_context, read_kvstore
from milepost.workers.format._ts_errors import from_tensorstore
from milepost.workers.format._ts_internals import FileRange, ocdbt_values

TABLE_PREFIX = ".milepost/chunk_crc32c/"
"""The tables' keys: this, then the database's folder name. (A leaf's storage name never starts
with a dot, so no array's keys can be taken for a table's.)"""

FORMAT = 1


def table_key(database: str) -> str:
    return TABLE_PREFIX + database


def encode(database: str, checksums: dict[str, list[tuple[tuple[int, ...], int]]]) -> bytes:
    """A database's table: ``checksums`` (by array, (grid index, CRC32C) per chunk)."""
    body = json.dumps(
        {
            "format": FORMAT,
            "database": database,
            "chunks": {
                name: {_checksum.grid_key(grid): crc for grid, crc in sorted(chunks)}
                for name, chunks in sorted(checksums.items())
            },
        },
        separators=(",", ":"),
    ).encode()
    return body + _checksum.crc32c(body).to_bytes(4, "little")


def decode(database: str, data: bytes, where: str) -> dict[str, dict[tuple[int, ...], int]]:
    """The table of ``database`` from its stored bytes; anything else (damaged, another
    database's, malformed) is a :class:`CorruptCheckpointError` naming ``where``."""
    body, stored = data[:-4], data[-4:]
    if len(data) < 4 or _checksum.crc32c(body) != int.from_bytes(stored, "little"):
        raise CorruptCheckpointError(
            f"the chunk checksum table of {database} in {where} is damaged (its CRC32C does not "
            "match); the checkpoint is damaged. Load an earlier checkpoint.",
            path=where,
        )
    try:
        table = declared.mapping(
            declared.loads(body, where, "a chunk checksum table"), where, "a chunk checksum table"
        )
        if table.get("format") != FORMAT:
            raise ValueError(f"format {table.get('format')!r}, not {FORMAT}")
        if table.get("database") != database:
            raise CorruptCheckpointError(
                f"the chunk checksum table stored for {database} in {where} is the table of "
                f"{table.get('database')!r}: that database's files are in its place, so its "
                "chunks are not the ones the checkpoint names. The checkpoint is damaged; load "
                "an earlier checkpoint.",
                path=where,
            )
        grids: dict[str, tuple[int, ...]] = {}  # (the same keys recur in every array)
        out: dict[str, dict[tuple[int, ...], int]] = {}
        for name, chunks in declared.mapping(table["chunks"], where, "chunks").items():
            mine = out[name] = {}
            for key, crc in declared.mapping(chunks, where, f"chunks[{name!r}]").items():
                grid = grids.get(key)
                if grid is None:
                    grid = grids[key] = declared.grid_key(key, where, f"chunks[{name!r}]")
                mine[grid] = declared.integer(crc, where, f"chunks[{name!r}]", maximum=2**32 - 1)
        return out
    except CorruptCheckpointError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as e:
        raise CorruptCheckpointError(
            f"the chunk checksum table of {database} in {where} does not have the expected "
            f"form ({type(e).__name__}: {e}); the checkpoint is damaged. Load an earlier "
            "checkpoint.",
            path=where,
        ) from e


def database_of(directory: str, path: str) -> str | None:
    """The per-process database the data file ``path`` belongs to (None: a file of the root
    view itself, or outside every database)."""
    root = directory.rstrip("/") + "/"
    inside = path[len(root) :] if path.startswith(root) else ""
    head = inside.split("/", 1)[0]
    return head if head.startswith("ocdbt.process_") and "/" in inside else None


class ChunkTables:
    """The tables one load (or verify) reads, each read once, when first needed."""

    def __init__(self, store: StoreSpec, context: Any = None) -> None:
        self._kvstore = read_kvstore(store)
        self._directory = store.directory
        self._context = new_context(store.directory) if context is None else context
        self._opened: Any = None
        self._tables: dict[str, dict[str, dict[tuple[int, ...], int]]] = {}
        self._reading: dict[str, Any] = {}
        """Reads of tables asked for ahead (:meth:`prefetch`), by database."""
        self._lock = threading.Lock()

    def prefetch(self, files: Iterable[str]) -> None:
        """Start reading the tables of the databases these data files belong to, all at once:
        a load's first reads then need not wait for them one after another."""
        databases = {database_of(self._directory, f) for f in files}
        with self._lock:
            kv = self._open()
            for database in sorted(d for d in databases if d is not None):
                if database not in self._tables and database not in self._reading:
                    self._reading[database] = kv.read(table_key(database))

    def _open(self) -> Any:
        if self._opened is None:
            self._opened = ts.KvStore.open(self._kvstore, context=self._context).result()
        return self._opened

    def expected(self, name: str, grid: tuple[int, ...], value: FileRange) -> int:
        """The checksum chunk ``grid`` of array ``name`` must have, its shard value being
        ``value`` (in a data file); -1 when its writer's table has none for it (which fails
        the check)."""
        database = database_of(self._directory, value.path)
        if database is None:
            raise CorruptCheckpointError(
                f"chunk {grid} of array {name!r} lies in {value.path}, outside every per-process "
                f"database of {self._directory}, so no writer's checksum covers it; the "
                "checkpoint is damaged or crafted. Load an earlier checkpoint.",
                array=name,
                chunk=grid,
                path=value.path,
            )
        try:
            table = self.table(database)
        except CorruptCheckpointError as e:  # (what was being read when it failed: the array)
            raise CorruptCheckpointError(
                f"array {name!r}: chunk {grid} cannot be checked, as the checksum table of its "
                f"writer is missing or damaged: {e}",
                array=name,
                chunk=grid,
                path=value.path,
            ) from e
        return table.get(name, {}).get(grid, -1)

    def table(self, database: str) -> dict[str, dict[tuple[int, ...], int]]:
        with self._lock:
            found = self._tables.get(database)
            if found is not None:
                return found
            reading = self._reading.pop(database, None)
            if reading is None:
                reading = self._open().read(table_key(database))
        where = f"{self._directory}, key {table_key(database)!r}"
        try:
            read = reading.result()
        except Exception as e:
            mapped = from_tensorstore(e, "reading a chunk checksum table", where, reading=True)
            raise mapped from e
        if read.state != "value":
            raise CorruptCheckpointError(
                f"the database {database} of {self._directory} holds chunks but no checksum "
                f"table ({table_key(database)!r} is missing); the checkpoint is damaged. Load an "
                "earlier checkpoint.",
                path=self._directory,
            )
        table = decode(database, bytes(read.value), where)
        with self._lock:
            return self._tables.setdefault(database, table)


def shard_key(
    name: str, grid: tuple[int, ...], chunk_shape: tuple[int, ...], shard_shape: tuple[int, ...]
) -> str:
    """The storage key of the shard holding chunk ``grid`` (an index in the inner chunk grid)."""
    shard = shard_shape or chunk_shape
    return f"{name}/c" + "".join(
        f"/{g * c // s}" for g, c, s in zip(grid, chunk_shape, shard, strict=True)
    )


def present(store: StoreSpec) -> bool:
    """Whether the store holds any chunk checksum table (one listing of their key range)."""
    kv = ts.KvStore.open(read_kvstore(store), context=new_context(store.directory)).result()
    end = TABLE_PREFIX[:-1] + chr(ord(TABLE_PREFIX[-1]) + 1)
    return bool(kv.list(ts.KvStore.KeyRange(TABLE_PREFIX, end)).result())


class _AllKeys:
    def match(self, key: bytes) -> bool:
        return True

    def overlaps(self, low: bytes, high: bytes | None) -> bool:
        return True


def keys_in_data_files(database: Any) -> set[bytes]:
    """The keys of the OCDBT database in folder ``database`` (a local path or an object store
    prefix) whose values lie in data files; the others are inline in its B-tree."""
    where = str(database)
    base = None
    if in_object_store(as_path(where)):
        base = ts.KvStore.open(kvstore(where), context=context_for(where)).result()
    return {key for key, _ in ocdbt_values(where, _AllKeys(), base)}
