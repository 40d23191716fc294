"""Chunk checksums where the reader is (issue 26): each OCDBT database a host writes carries the
CRC32Cs of its chunks in a table of its own, which the hosts that read those chunks read; the
controller records only that the tables exist, and never reads one.

Attacked here: a table damaged, missing, or another database's; the controller's metadata and
the load plans with no per-chunk entry; checkpoints whose checksums ``_milepost.json`` records
(written before the tables) still checked; several databases per host.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost import workers
from milepost.workers.format import _checksum, _chunk_tables
from milepost.workers.load import _locator
from tests._helpers import abstract_of, assert_tree_equal, put, reseal, tensorstore_writes_only
from tests.test_integrity import chunk_value, copy_of, flip, reading, save


@pytest.fixture(scope="module", autouse=True)
def _tensorstore_writes() -> Iterator[None]:
    """This module tests the databases TensorStore writes: no shard is packed by milepost."""
    with tensorstore_writes_only():
        yield


def state_of(mesh: jax.sharding.Mesh) -> dict[str, Any]:
    rng = np.random.default_rng(26)
    return {
        # 8 shards of 128 x 32 float32: 16 KiB each, in data files
        "w": put(rng.standard_normal((256, 128), dtype=np.float32), mesh, P("data", "model")),
        "v": put(rng.standard_normal((64, 64), dtype=np.float32), mesh, P("data", None)),
        "tiny": put(np.arange(16, dtype=np.float32), mesh, P()),  # inline in the B-tree
        "step": 3,
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, mesh24: jax.sharding.Mesh) -> Any:
    """Chunks of 1 KiB (bands of 8 rows): a table of a few hundred entries, in a data file like
    the chunks (a table under 1 KiB lives inline in the B-tree, as small chunks do)."""
    state = state_of(mesh24)
    path = tmp_path_factory.mktemp("tables") / "c"
    return save(path, state, mp.SaveOptions(chunk_byte_size=1024)), state


def table_key(database: str = "ocdbt.process_0") -> str:
    return workers.format.CHUNK_TABLE_PREFIX + database


def info(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / "state" / "_milepost.json").read_text())


def test_the_controller_records_no_chunk_checksum(
    saved: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``_milepost.json`` says that the tables exist and lists only the chunks stored inline in
    the B-tree (the tiny array, the scalar); the load plans of the others carry no checksum;
    every chunk in a data file is still checked, against its writer's table."""
    ckpt, state = saved
    meta = info(ckpt)
    assert meta["chunk_crc32c_tables"] == 1, meta
    assert {n: len(c) for n, c in meta["chunk_crc32c"].items()} == {"tiny": 1, "step": 1}, meta
    from milepost.workers.load import _load

    plans: list[Any] = []
    real_load = _load._load
    monkeypatch.setattr(_load, "_load", lambda plan, *a: plans.append(plan) or real_load(plan, *a))
    looked_up: list[tuple[str, tuple[int, ...], int | None]] = []
    real = _chunk_tables.ChunkTables.expected

    def spy(self: Any, name: str, grid: Any, value: Any) -> Any:
        found = real(self, name, grid, value)
        looked_up.append((name, grid, found))
        return found

    monkeypatch.setattr(_chunk_tables.ChunkTables, "expected", spy)
    for direct in (True, False):
        looked_up.clear()
        with reading(direct):
            assert_tree_equal(mp.load(ckpt, abstract_of(state)), state)
        tasks = [t for plan in plans for t in plan.tasks]
        assert tasks and all(t.checksums is None for t in tasks if t.name in ("w", "v"))
        assert {t.name for t in tasks if t.chunk_tables} >= {"w", "v", "tiny"}
        w = [found for name, _, found in looked_up if name == "w"]
        assert len(w) == 128 and all(isinstance(c, int) and c >= 0 for c in w), looked_up
        # the tiny array lives inline in the B-tree: checked against what the commit recorded
        assert not [name for name, _, _ in looked_up if name == "tiny"]


def test_the_tables_hold_the_values_checksums(saved: tuple[Path, Any]) -> None:
    """What a table records is the CRC32C of each chunk's values, by array and grid index."""
    ckpt, state = saved
    kv = ts.KvStore.open(workers.format.ocdbt_kvstore(str(ckpt / "state"))).result()
    tables = [k.decode() for k in kv.list().result() if k.startswith(b".milepost/")]
    assert tables and all(t.startswith(workers.format.CHUNK_TABLE_PREFIX) for t in tables), tables
    recorded: dict[str, dict[tuple[int, ...], int]] = {}
    for key in tables:
        database = key[len(workers.format.CHUNK_TABLE_PREFIX) :]
        table = workers.format.decode_chunk_table(database, kv[key], key)
        for name, chunks in table.items():
            assert not set(chunks) & set(recorded.get(name, {})), "a chunk in two tables"
            recorded.setdefault(name, {}).update(chunks)
    w = np.asarray(state["w"])  # 1 KiB chunks: bands of 8 rows of each 128 x 32 shard
    assert recorded["w"] == {
        (i, j): _checksum.crc32c(np.ascontiguousarray(w[8 * i : 8 * i + 8, 32 * j : 32 * j + 32]))
        for i in range(32)
        for j in range(4)
    }


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "tensorstore"])
def test_a_damaged_table_is_refused(saved: tuple[Path, Any], tmp_path: Path, direct: bool) -> None:
    base, state = saved
    ckpt = copy_of(base, tmp_path / "c")
    file, offset, length = chunk_value(ckpt, table_key())
    flip(file, offset + length // 2)
    with reading(direct), pytest.raises(mp.CorruptCheckpointError, match="checksum table"):
        mp.load(ckpt, abstract_of(state))
    report = mp.verify(ckpt)
    assert not report.ok and "checksum table" in "\n".join(report.problems), report


def test_a_missing_table_is_refused(saved: tuple[Path, Any], tmp_path: Path) -> None:
    """A database whose chunks are read but whose table is gone: nothing is read unchecked."""
    base, state = saved
    ckpt = copy_of(base, tmp_path / "c")
    root = ts.KvStore.open(workers.format.ocdbt_kvstore(str(ckpt / "state"))).result()
    root.delete_range(ts.KvStore.KeyRange(workers.format.CHUNK_TABLE_PREFIX, ".milepost0")).result()
    for direct in (True, False):
        with reading(direct), pytest.raises(mp.CorruptCheckpointError, match="no checksum table"):
            mp.load(ckpt, abstract_of(state))


def test_another_databases_table_in_its_place_is_refused(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    """Two databases of one host (``ocdbt_writers_per_host=2``) each have a table; the table
    read for one that names the other (its files put in the first one's place) is refused."""
    state = state_of(mesh24)
    ckpt = save(tmp_path / "c", state, mp.SaveOptions(ocdbt_writers_per_host=2))
    kv = ts.KvStore.open(workers.format.ocdbt_kvstore(str(ckpt / "state"))).result()
    databases = sorted(
        k.decode()[len(workers.format.CHUNK_TABLE_PREFIX) :]
        for k in kv.list().result()
        if k.startswith(workers.format.CHUNK_TABLE_PREFIX.encode())
    )
    # (and the controller's own database, for the NumPy leaf it wrote)
    assert databases == ["ocdbt.process_0", "ocdbt.process_0.1", "ocdbt.process_controller"]
    other = workers.format.decode_chunk_table(databases[1], kv[table_key(databases[1])], "")
    forged = workers.format.encode_chunk_table(
        databases[1], {n: sorted(c.items()) for n, c in other.items()}
    )
    root = ts.KvStore.open(workers.format.ocdbt_kvstore(str(ckpt / "state"))).result()
    root[table_key(databases[0])] = forged
    with pytest.raises(mp.CorruptCheckpointError, match="is the table of 'ocdbt.process_0.1'"):
        mp.load(ckpt, abstract_of(state))


def test_checkpoints_recording_chunk_checksums_are_still_checked(
    saved: tuple[Path, Any], tmp_path: Path
) -> None:
    """What milepost wrote before the tables: every chunk's CRC32C in ``_milepost.json``. Those
    are what a load checks (the tables, present or not, are not read), damage included."""
    base, state = saved
    ckpt = copy_of(base, tmp_path / "c")
    kv = ts.KvStore.open(workers.format.ocdbt_kvstore(str(ckpt / "state"))).result()
    recorded: dict[str, dict[str, int]] = {}
    for key in (k.decode() for k in kv.list().result()):
        if key.startswith(workers.format.CHUNK_TABLE_PREFIX):
            table = workers.format.decode_chunk_table(
                key[len(workers.format.CHUNK_TABLE_PREFIX) :], kv[key], key
            )
            for name, chunks in table.items():
                recorded.setdefault(name, {}).update(
                    {workers.format.grid_key(g): c for g, c in chunks.items()}
                )
    meta = info(ckpt)
    del meta["chunk_crc32c_tables"]
    meta["chunk_crc32c"] = recorded
    (ckpt / "state" / "_milepost.json").write_text(json.dumps(meta))
    reseal(ckpt)
    calls: list[str] = []
    real = _chunk_tables.ChunkTables.table

    def spy(self: Any, database: str) -> Any:
        calls.append(database)
        return real(self, database)

    with pytest.MonkeyPatch.context() as mpatch:
        mpatch.setattr(_chunk_tables.ChunkTables, "table", spy)
        assert_tree_equal(mp.load(ckpt, abstract_of(state)), state)
    assert calls == []
    file, offset, _ = chunk_value(ckpt, "w/c/1/2")
    flip(file, offset + 1024 + 5)  # the second band of shard (1, 2): chunk (17, 2)
    for direct in (True, False):
        with (
            reading(direct),
            pytest.raises(mp.CorruptCheckpointError, match=r"array 'w': chunk \(17, 2\)"),
        ):
            mp.load(ckpt, abstract_of(state))


@pytest.mark.parametrize("index", ["dict", "columns"])
def test_a_load_asks_for_each_table_before_it_needs_it_and_only_those(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch, index: str
) -> None:
    """The tables of the databases holding a box's chunks are asked for together before the
    box's checks need one (so they are not waited for one after another); each is read once,
    only databases of the checkpoint are named, and no table is read that no check needs (at
    thousands of hosts every database holds a chunk of every array)."""
    if index == "columns":  # (the chunk index a load of many chunks keeps)
        monkeypatch.setattr(_locator, "_DICT_KEYS", 0)
    state = state_of(mesh24)
    ckpt = save(tmp_path / "c", state, mp.SaveOptions(ocdbt_writers_per_host=3))
    events: list[tuple[str, str]] = []
    reads: list[str] = []
    real_prefetch = _chunk_tables.ChunkTables.prefetch
    real_table = _chunk_tables.ChunkTables.table
    real_open = _chunk_tables.ChunkTables._open

    def prefetch(self: Any, files: Any) -> None:
        files = list(files)
        for f in files:
            database = _chunk_tables.database_of(self._directory, f)
            if database is not None:
                events.append(("prefetch", database))
        real_prefetch(self, files)

    def table(self: Any, database: str) -> Any:
        events.append(("table", database))
        return real_table(self, database)

    def counting_open(self: Any) -> Any:
        kv = real_open(self)

        class Counting:
            def read(self, key: str) -> Any:
                reads.append(key)
                return kv.read(key)

        return Counting()

    monkeypatch.setattr(_chunk_tables.ChunkTables, "prefetch", prefetch)
    monkeypatch.setattr(_chunk_tables.ChunkTables, "table", table)
    monkeypatch.setattr(_chunk_tables.ChunkTables, "_open", counting_open)
    for direct in (True, False):
        events.clear()
        reads.clear()
        with reading(direct):
            assert_tree_equal(mp.load(ckpt, abstract_of(state)), state)
        asked = {d for kind, d in events if kind == "table"}
        assert len(asked) > 1, events  # several databases' chunks were checked
        for i, (kind, database) in enumerate(events):
            if kind == "table":
                assert ("prefetch", database) in events[:i], (database, events[:i])
        prefetched = {d for kind, d in events if kind == "prefetch"}
        assert all(d.startswith("ocdbt.process_") for d in prefetched), prefetched
        assert sorted(reads) == sorted({table_key(d) for d in asked}), reads
