"""Attacks on the chunk checksum tables (issue 26): each OCDBT database's CRC32Cs in a key of its
own (``.milepost/chunk_crc32c/<database>``), found for a chunk through the data file that holds
it. Real checkpoints on disk, damaged or crafted; each load must raise a milepost error or return
exactly what was saved.

Attacks milepost does not withstand are kept, ``xfail(strict=True)``, with what happens.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost import workers
from milepost.workers.format import _checksum, _chunk_tables
from tests._helpers import abstract_of, assert_tree_equal, put, reseal, tensorstore_writes_only
from tests.test_integrity import MILEPOST_ERRORS, chunk_value, copy_of, flip, reading, save

LAYOUTS = {
    "ocdbt": mp.SaveOptions(),
    "zstd": mp.SaveOptions(compression="zstd"),
    "subchunked": mp.SaveOptions(chunk_byte_size=1024),
}


def state_of(mesh: jax.sharding.Mesh, offset: float = 0.0) -> dict[str, Any]:
    rng = np.random.default_rng(2600)
    return {
        # 8 shards of 128 x 32 float32: 16 KiB each, in data files
        "w": put(
            rng.standard_normal((256, 128), dtype=np.float32) + np.float32(offset),
            mesh,
            P("data", "model"),
        ),
        "b": put(rng.standard_normal((64, 64), dtype=np.float32), mesh, P("data", None)),
        "step": 5,
    }


@pytest.fixture(scope="module")
def saved(
    tmp_path_factory: pytest.TempPathFactory, mesh24: jax.sharding.Mesh
) -> dict[str, tuple[Path, Any]]:
    root = tmp_path_factory.mktemp("attacks")
    state = state_of(mesh24)
    out = {}
    for name, options in LAYOUTS.items():
        ckpt = save(root / name, state, options)
        assert_tree_equal(mp.load(ckpt), state)
        out[name] = (ckpt, state)
    return out


def root_kv(ckpt: Path) -> Any:
    return ts.KvStore.open(workers.format.ocdbt_kvstore(str(ckpt / "state"))).result()


def table_key(database: str = "ocdbt.process_0") -> str:
    return workers.format.CHUNK_TABLE_PREFIX + database


def database_of_key(ckpt: Path, key: str) -> str:
    file, _, _ = chunk_value(ckpt, key)
    return file.relative_to(ckpt / "state").parts[0]


def tabled_copy(saved: dict[str, tuple[Path, Any]], tmp_path: Path) -> tuple[Path, Any, str]:
    """A copy of the default layout's checkpoint to attack, its state, and the database that
    holds ``w``'s first chunk (whose table the attacks forge)."""
    base, state = saved["ocdbt"]
    ckpt = copy_of(base, tmp_path / "c")
    return ckpt, state, database_of_key(ckpt, "w/c/0/0")


def read_table(ckpt: Path, database: str) -> dict[str, dict[tuple[int, ...], int]]:
    return workers.format.decode_chunk_table(database, root_kv(ckpt)[table_key(database)], "")


def root_write(ckpt: Path, key: str, value: bytes) -> None:
    """Write ``key`` through the root OCDBT view (a new manifest), and reseal the file
    checksums: what an attacker with TensorStore can do."""
    root_kv(ckpt)[key] = value
    reseal(ckpt)


def write_table(ckpt: Path, database: str, table: dict[str, dict[tuple[int, ...], int]]) -> None:
    root_write(
        ckpt,
        table_key(database),
        workers.format.encode_chunk_table(
            database, {n: sorted(c.items()) for n, c in table.items()}
        ),
    )


def write_raw_table(ckpt: Path, database: str, body: bytes) -> None:
    root_write(ckpt, table_key(database), body + _checksum.crc32c(body).to_bytes(4, "little"))


def info_path(ckpt: Path) -> Path:
    return ckpt / "state" / "_milepost.json"


def edit_info(ckpt: Path, **changes: Any) -> None:
    meta = json.loads(info_path(ckpt).read_text())
    for k, v in changes.items():
        if v is ...:
            meta.pop(k, None)
        else:
            meta[k] = v
    info_path(ckpt).write_text(json.dumps(meta))
    reseal(ckpt)


def resharded(state: dict[str, Any], mesh: jax.sharding.Mesh) -> dict[str, Any]:
    """Another sharding for ``w`` than the saved one (rows over 'model', columns over 'data')."""
    abstract = abstract_of(state)
    abstract["w"] = jax.ShapeDtypeStruct(
        (256, 128), np.float32, sharding=NamedSharding(mesh, P("model", "data"))
    )
    return abstract


def preview(ckpt: Path) -> np.ndarray:
    import milepost.surgery as ms

    return np.asarray(ms.open(ckpt).tree["w"][:4, :8])


# ------------------------------------------------------------------------------------------
# 1. Damage to a chunk is caught on every read path, every layout
# ------------------------------------------------------------------------------------------

MODES = ["direct", "tensorstore", "resharded", "verify", "preview"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_flipped_chunk_byte_is_caught(
    saved: dict[str, tuple[Path, Any]],
    tmp_path: Path,
    mesh24: jax.sharding.Mesh,
    layout: str,
    mode: str,
) -> None:
    base, state = saved[layout]
    ckpt = copy_of(base, tmp_path / "c")
    file, offset, _ = chunk_value(ckpt, "w/c/0/0")
    flip(file, offset + 5)  # in the first inner chunk (the one a preview of [:4, :8] reads)
    if mode == "verify":
        report = mp.verify(ckpt)
        assert not report.ok and "'w'" in "\n".join(report.problems), report
        return
    with pytest.raises(mp.CorruptCheckpointError) as info:
        if mode == "preview":
            preview(ckpt)
        elif mode == "resharded":
            mp.load(ckpt, resharded(state, mesh24))
        else:
            with reading(mode == "direct"):
                mp.load(ckpt, abstract_of(state))
    assert "w" in str(info.value), info.value


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_undamaged_reads_are_exact_on_every_path(
    saved: dict[str, tuple[Path, Any]], mesh24: jax.sharding.Mesh, layout: str
) -> None:
    ckpt, state = saved[layout]
    for direct in (True, False):
        with reading(direct):
            assert_tree_equal(mp.load(ckpt, abstract_of(state)), state)
    got = mp.load(ckpt, resharded(state, mesh24))
    np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(state["w"]))
    assert mp.verify(ckpt).ok
    np.testing.assert_array_equal(preview(ckpt), np.asarray(state["w"])[:4, :8])


# ------------------------------------------------------------------------------------------
# 2. The controller's flag for the tables removed (resealed): the tables are read all the same
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "tensorstore"])
def test_removing_the_tables_flag_does_not_switch_the_checks_off(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path, direct: bool
) -> None:
    base, state = saved["ocdbt"]
    ckpt = copy_of(base, tmp_path / "c")
    edit_info(ckpt, chunk_crc32c_tables=...)
    file, offset, length = chunk_value(ckpt, "w/c/1/2")
    flip(file, offset + length // 2)
    with reading(direct), pytest.raises(mp.CorruptCheckpointError):
        mp.load(ckpt, abstract_of(state))


def test_removing_the_tables_flag_does_not_hide_damage_from_verify(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    base, _ = saved["ocdbt"]
    ckpt = copy_of(base, tmp_path / "c")
    edit_info(ckpt, chunk_crc32c_tables=...)
    file, offset, length = chunk_value(ckpt, "w/c/1/2")
    flip(file, offset + length // 2)
    assert not mp.verify(ckpt).ok


@pytest.mark.parametrize("value", ["1", 0, 2, [1], {"format": 1}])
def test_an_unknown_tables_flag_is_refused(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path, value: Any
) -> None:
    base, state = saved["ocdbt"]
    ckpt = copy_of(base, tmp_path / "c")
    edit_info(ckpt, chunk_crc32c_tables=value)
    with pytest.raises(mp.CorruptCheckpointError, match="chunk_crc32c_tables"):
        mp.load(ckpt, abstract_of(state))


# ------------------------------------------------------------------------------------------
# 3. Forged tables (valid CRC32C, right database name): missing, extra, malformed entries
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "tensorstore"])
def test_a_table_without_an_array_is_refused(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path, direct: bool
) -> None:
    ckpt, state, database = tabled_copy(saved, tmp_path)
    table = read_table(ckpt, database)
    assert "w" in table
    del table["w"]
    write_table(ckpt, database, table)
    with reading(direct), pytest.raises(mp.CorruptCheckpointError, match="'w'"):
        mp.load(ckpt, abstract_of(state))
    assert not mp.verify(ckpt).ok
    with pytest.raises(mp.CorruptCheckpointError):
        preview(ckpt)


def test_a_table_missing_one_chunk_is_refused(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    base, state = saved["ocdbt"]
    ckpt = copy_of(base, tmp_path / "c")
    database = database_of_key(ckpt, "w/c/1/2")
    table = read_table(ckpt, database)
    del table["w"][(1, 2)]
    write_table(ckpt, database, table)
    for direct in (True, False):
        with reading(direct), pytest.raises(mp.CorruptCheckpointError, match=r"\(1, 2\)"):
            mp.load(ckpt, abstract_of(state))


def test_extra_arrays_and_odd_grid_keys_in_a_table_change_nothing(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    """Entries no chunk is looked up by (another array, negative or huge grid indices) are
    harmless: the real chunks are still checked against their own entries."""
    ckpt, state, database = tabled_copy(saved, tmp_path)
    table = read_table(ckpt, database)
    table["zzz"] = {(0, 0): 1}
    table["w"][(-1, 0)] = 7
    table["w"][(10**30, 2)] = 9
    write_table(ckpt, database, table)
    for direct in (True, False):
        with reading(direct):
            assert_tree_equal(mp.load(ckpt, abstract_of(state)), state)
    assert mp.verify(ckpt).ok
    file, offset, length = chunk_value(ckpt, "w/c/0/0")
    flip(file, offset + length // 2)
    with pytest.raises(mp.CorruptCheckpointError, match="'w'"):
        mp.load(ckpt, abstract_of(state))


def test_a_wrong_checksum_in_the_table_is_refused(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    ckpt, state, database = tabled_copy(saved, tmp_path)
    table = read_table(ckpt, database)
    table["w"][(0, 0)] ^= 1
    write_table(ckpt, database, table)
    for direct in (True, False):
        with reading(direct), pytest.raises(mp.CorruptCheckpointError, match=r"\(0, 0\)"):
            mp.load(ckpt, abstract_of(state))


MALFORMED = {
    "letters": '{"w":{"a.b":1}}',
    "empty part": '{"w":{"1..2":1}}',
    "float key": '{"w":{"1.5e3":1}}',
    "crc a word": '{"w":{"0.0":"x"}}',
    "crc a list": '{"w":{"0.0":[1]}}',
    "crc null": '{"w":{"0.0":null}}',
    "chunks a list": '{"w":[1,2]}',
    "chunks a string": '"w"',
    "huge int": '{"w":{"0.0":' + "9" * 5000 + "}}",
}


@pytest.mark.parametrize("chunks", list(MALFORMED.values()), ids=list(MALFORMED))
def test_a_malformed_table_is_refused(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path, chunks: str
) -> None:
    ckpt, state, database = tabled_copy(saved, tmp_path)
    body = f'{{"format":1,"database":"{database}","chunks":{chunks}}}'.encode()
    write_raw_table(ckpt, database, body)
    for direct in (True, False):
        with reading(direct), pytest.raises(mp.CorruptCheckpointError, match="checksum table"):
            mp.load(ckpt, abstract_of(state))
    report = mp.verify(ckpt)
    assert not report.ok and "checksum table" in "\n".join(report.problems), report


@pytest.mark.parametrize(
    "body",
    [
        b"[1,2,3]",
        b"\xff\xfe not utf-8",
        b"",
        b'{"format":1}',
        b'{"format":"1","database":"ocdbt.process_0","chunks":{}}',
        b'{"format":1,"database":["ocdbt.process_0"],"chunks":{}}',
    ],
    ids=["a list", "not utf-8", "empty", "no database", "format a string", "database a list"],
)
def test_a_table_that_is_not_a_table_is_refused(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path, body: bytes
) -> None:
    ckpt, state, database = tabled_copy(saved, tmp_path)
    write_raw_table(ckpt, database, body.replace(b"ocdbt.process_0", database.encode()))
    with pytest.raises(mp.CorruptCheckpointError, match="checksum table"):
        mp.load(ckpt, abstract_of(state))


def test_a_deeply_nested_table_is_refused(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    ckpt, state, database = tabled_copy(saved, tmp_path)
    depth = 200_000
    body = (
        f'{{"format":1,"database":"{database}","chunks":'.encode()
        + b"[" * depth
        + b"]" * depth
        + b"}"
    )
    write_raw_table(ckpt, database, body)
    with pytest.raises(mp.CorruptCheckpointError, match="checksum table"):
        mp.load(ckpt, abstract_of(state))


def test_a_truncated_table_is_refused(saved: dict[str, tuple[Path, Any]], tmp_path: Path) -> None:
    ckpt, state, database = tabled_copy(saved, tmp_path)
    stored = bytes(root_kv(ckpt)[table_key(database)])
    for data in (b"", b"ab", stored[:-1]):
        root_write(ckpt, table_key(database), data)
        with pytest.raises(mp.CorruptCheckpointError, match="checksum table"):
            mp.load(ckpt, abstract_of(state))


# ------------------------------------------------------------------------------------------
# 4. Database names: what the reader derives from a data file's path
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "relative",
    [
        "d/abc",  # the root view's own data file
        "ocdbt.process_0",  # a folder, not a file inside it
        "other/ocdbt.process_0/d/x",
        "../state/ocdbt.process_0/d/x",
        "xocdbt.process_0/d/x",
    ],
)
def test_only_files_inside_a_per_process_database_name_one(relative: str) -> None:
    directory = "/ckpt/state"
    found = _chunk_tables.database_of(directory, f"{directory}/{relative}")
    assert found is None or (found.startswith("ocdbt.process_") and "/" not in found)
    assert found is None, found


def test_a_sibling_folder_sharing_the_prefix_names_no_database() -> None:
    """``/ckpt/state-evil/...`` starts with ``/ckpt/state``: no database of ``/ckpt/state``."""
    found = _chunk_tables.database_of("/ckpt/state", "/ckpt/state-evil/ocdbt.process_0/d/x")
    assert found is None


def test_a_database_name_with_dots_reads_only_a_key(tmp_path: Path) -> None:
    """A table's key is just an OCDBT key: a name like ``../x`` reads no file; it is missing."""
    ckpt = tmp_path / "state"
    kv = ts.KvStore.open(workers.format.ocdbt_kvstore(str(ckpt))).result()
    kv["a"] = b"1"
    tables = _chunk_tables.ChunkTables(workers.StoreSpec(directory=str(ckpt), use_ocdbt=True))
    for name in ("../x", "ocdbt.process_0/../../etc", "/etc/passwd"):
        with pytest.raises(mp.CorruptCheckpointError, match="no checksum table"):
            tables.table(name)


# ------------------------------------------------------------------------------------------
# 5. Files swapped across databases (two databases in one process)
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_writers(tmp_path_factory: pytest.TempPathFactory, mesh24: jax.sharding.Mesh) -> Any:
    state = state_of(mesh24)
    path = tmp_path_factory.mktemp("two") / "c"
    with tensorstore_writes_only():  # (two writer databases, each with its chunks and table)
        ckpt = save(path, state, mp.SaveOptions(ocdbt_writers_per_host=2))
    assert_tree_equal(mp.load(ckpt), state)
    return ckpt, state


def data_files(database: Path) -> list[Path]:
    return sorted(p for p in (database / "d").iterdir() if p.is_file())


def test_the_two_databases_folders_swapped_are_refused(
    two_writers: tuple[Path, Any], tmp_path: Path
) -> None:
    base, state = two_writers
    ckpt = copy_of(base, tmp_path / "c")
    a, b = ckpt / "state" / "ocdbt.process_0", ckpt / "state" / "ocdbt.process_0.1"
    tmp = ckpt / "state" / "tmp"
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)
    for direct in (True, False):
        with reading(direct), pytest.raises(MILEPOST_ERRORS):
            mp.load(ckpt, abstract_of(state))
    assert not mp.verify(ckpt).ok


def test_one_databases_data_copied_over_anothers_is_refused(
    two_writers: tuple[Path, Any], tmp_path: Path
) -> None:
    """Each data file of ``ocdbt.process_0`` overwritten with one of ``ocdbt.process_0.1`` (of
    the same size if there is one, else cut or padded to its size): every chunk the first
    database held is now bytes the other wrote."""
    base, state = two_writers
    ckpt = copy_of(base, tmp_path / "c")
    theirs = {f.stat().st_size: f for f in data_files(ckpt / "state" / "ocdbt.process_0.1")}
    largest = theirs[max(theirs)].read_bytes()
    for fa in data_files(ckpt / "state" / "ocdbt.process_0"):
        size = fa.stat().st_size
        if size in theirs:
            fa.write_bytes(theirs[size].read_bytes())
        else:
            fa.write_bytes((largest * (size // len(largest) + 1))[:size])
    for direct in (True, False):
        with reading(direct), pytest.raises(mp.CorruptCheckpointError):
            mp.load(ckpt, abstract_of(state))
    assert not mp.verify(ckpt).ok


def test_a_chunk_copied_into_another_chunks_place_is_refused(
    two_writers: tuple[Path, Any], tmp_path: Path
) -> None:
    """The bytes of a shard of one database written over a shard of the other (same size):
    valid values, valid in their own table, but not the chunk's."""
    base, state = two_writers
    ckpt = copy_of(base, tmp_path / "c")
    keys = [f"w/c/{i}/{j}" for i in range(2) for j in range(4)]
    where = {k: chunk_value(ckpt, k) for k in keys}
    by_db = {}
    for k, (file, _, _) in where.items():
        by_db.setdefault(file.parent.parent.name, k)
    assert len(by_db) == 2, where
    src, dst = (where[k] for k in by_db.values())
    assert src[2] == dst[2]
    data = bytearray(dst[0].read_bytes())
    data[dst[1] : dst[1] + dst[2]] = src[0].read_bytes()[src[1] : src[1] + src[2]]
    dst[0].write_bytes(bytes(data))
    for direct in (True, False):
        with reading(direct), pytest.raises(mp.CorruptCheckpointError, match="'w'"):
            mp.load(ckpt, abstract_of(state))


# ------------------------------------------------------------------------------------------
# 6. Chunks written through the root view (crafted with TensorStore's own OCDBT writes)
# ------------------------------------------------------------------------------------------


def decoy_shard(tmp_path: Path, mesh: jax.sharding.Mesh, options: mp.SaveOptions) -> bytes:
    """The stored value of ``w/c/0/0`` in a checkpoint of other values, same layout."""
    decoy = save(tmp_path / "decoy", state_of(mesh, offset=100.0), options)
    return bytes(root_kv(decoy)["w/c/0/0"])


@pytest.mark.parametrize("mode", ["direct", "tensorstore", "verify", "preview"])
def test_a_chunk_in_the_root_views_own_data_file_is_refused(
    saved: dict[str, tuple[Path, Any]],
    tmp_path: Path,
    mesh24: jax.sharding.Mesh,
    mode: str,
) -> None:
    base, state = saved["ocdbt"]
    ckpt = copy_of(base, tmp_path / "c")
    value = decoy_shard(tmp_path, mesh24, LAYOUTS["ocdbt"])
    assert len(value) > 1024
    root_write(ckpt, "w/c/0/0", value)
    file, _, _ = chunk_value(ckpt, "w/c/0/0")
    assert file.parent.parent == ckpt / "state", file  # the root view's d/
    if mode == "verify":
        report = mp.verify(ckpt)
        assert not report.ok and "outside every per-process database" in "\n".join(
            report.problems
        ), report
        return
    with pytest.raises(mp.CorruptCheckpointError, match="outside every per-process database"):
        if mode == "preview":
            preview(ckpt)
        else:
            with reading(mode == "direct"):
                mp.load(ckpt, abstract_of(state))


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "tensorstore"])
def test_an_inline_chunk_in_a_tabled_chunks_place_is_refused(
    tmp_path: Path, mesh24: jax.sharding.Mesh, direct: bool
) -> None:
    options = mp.SaveOptions(compression="zstd")
    state = state_of(mesh24)
    ckpt = save(tmp_path / "c", state, options)
    zeros = dict(state, w=put(np.zeros((256, 128), np.float32), mesh24, P("data", "model")))
    decoy = save(tmp_path / "decoy", zeros, options)
    value = bytes(root_kv(decoy)["w/c/0/0"])
    assert len(value) <= 1024, len(value)  # stored inline
    root_write(ckpt, "w/c/0/0", value)
    with reading(direct):
        try:
            got = mp.load(ckpt, abstract_of(state))
        except mp.CorruptCheckpointError:
            return
    # (what is loaded today: the decoy's zeros in shard (0, 0), the rest as saved)
    assert np.asarray(got["w"])[:128, :32].any(), "shard (0, 0) loaded as the decoy's zeros"
    assert_tree_equal(got, state)


def test_an_inline_chunk_in_a_tabled_chunks_place_fails_verify(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    options = mp.SaveOptions(compression="zstd")
    state = state_of(mesh24)
    ckpt = save(tmp_path / "c", state, options)
    zeros = dict(state, w=put(np.zeros((256, 128), np.float32), mesh24, P("data", "model")))
    decoy = save(tmp_path / "decoy", zeros, options)
    root_write(ckpt, "w/c/0/0", bytes(root_kv(decoy)["w/c/0/0"]))
    assert not mp.verify(ckpt).ok


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "tensorstore"])
def test_a_deleted_chunk_is_refused(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path, direct: bool
) -> None:
    """Tables mean every chunk was stored: a chunk deleted through the root view is not read
    as the fill value."""
    base, state = saved["ocdbt"]
    ckpt = copy_of(base, tmp_path / "c")
    root_kv(ckpt).delete_range(ts.KvStore.KeyRange("w/c/0/0", "w/c/0/0\x00")).result()
    reseal(ckpt)
    with reading(direct), pytest.raises(MILEPOST_ERRORS):
        mp.load(ckpt, abstract_of(state))


def test_an_uncompressed_shard_written_through_the_root_view_is_refused_by_verify(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    base, _ = saved["subchunked"]
    ckpt = copy_of(base, tmp_path / "c")
    root_write(ckpt, "w/c/1/1", decoy_shard(tmp_path, mesh24, LAYOUTS["subchunked"]))
    report = mp.verify(ckpt)
    assert not report.ok, report


# ------------------------------------------------------------------------------------------
# 7. Relinking surgery, then damage in the output
# ------------------------------------------------------------------------------------------


def test_a_relinked_checkpoint_is_checked_under_its_new_names(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    import milepost.surgery as ms

    base, state = saved["ocdbt"]
    src = copy_of(base, tmp_path / "src")
    out = tmp_path / "out"
    ms.write(out, ms.rename(ms.open(src).tree, {r"^w$": "v"}))
    want = {"v": state["w"], "b": state["b"], "step": state["step"]}
    for direct in (True, False):
        with reading(direct):
            assert_tree_equal(mp.load(out, abstract_of(want)), want)
    assert mp.verify(out).ok
    file, offset, length = chunk_value(out, "v/c/1/2")
    flip(file, offset + length // 2)
    for direct in (True, False):
        with reading(direct), pytest.raises(mp.CorruptCheckpointError, match="'v'"):
            mp.load(out, abstract_of(want))
    report = mp.verify(out)
    assert not report.ok and "'v'" in "\n".join(report.problems), report


def test_a_relinked_table_under_the_old_name_only_is_refused(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    """After a rename, the output's tables must name 'v': a table still naming 'w' (as if the
    rename missed it) leaves 'v' with no recorded checksums, which is refused."""
    import milepost.surgery as ms

    base, state = saved["ocdbt"]
    src = copy_of(base, tmp_path / "src")
    out = tmp_path / "out"
    ms.write(out, ms.rename(ms.open(src).tree, {r"^w$": "v"}))
    want = {"v": state["w"], "b": state["b"], "step": state["step"]}
    kv = root_kv(out)
    keys = [k.decode() for k in kv.list().result() if k.startswith(b".milepost/")]
    assert keys
    for key in keys:
        database = key[len(workers.format.CHUNK_TABLE_PREFIX) :]
        table = workers.format.decode_chunk_table(database, kv[key], key)
        if "v" in table:
            table["w"] = table.pop("v")
            write_table(out, database, table)
    with pytest.raises(mp.CorruptCheckpointError, match="'v'"):
        mp.load(out, abstract_of(want))


# ------------------------------------------------------------------------------------------
# 8. Concurrency
# ------------------------------------------------------------------------------------------


def test_two_threads_loading_at_once(saved: dict[str, tuple[Path, Any]], tmp_path: Path) -> None:
    base, state = saved["subchunked"]
    damaged = copy_of(base, tmp_path / "c")
    file, offset, length = chunk_value(damaged, "w/c/1/3")
    flip(file, offset + length // 2)
    outcomes: dict[tuple[str, int], Any] = {}

    def run(which: str, i: int) -> None:
        ckpt = base if which == "good" else damaged
        try:
            with reading(i % 2 == 0):
                outcomes[which, i] = mp.load(ckpt, abstract_of(state))
        except Exception as e:
            outcomes[which, i] = e

    threads = [threading.Thread(target=run, args=(w, i)) for i in range(2) for w in ("good", "bad")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(outcomes) == 4
    for (which, _), got in outcomes.items():
        if which == "good":
            assert not isinstance(got, BaseException), got
            assert_tree_equal(got, state)
        else:
            assert isinstance(got, mp.CorruptCheckpointError), got


def test_one_chunk_tables_read_by_many_threads(
    saved: dict[str, tuple[Path, Any]],
) -> None:
    ckpt, _ = saved["ocdbt"]
    directory = str(ckpt / "state")
    tables = _chunk_tables.ChunkTables(workers.StoreSpec(directory=directory, use_ocdbt=True))
    database = database_of_key(ckpt, "w/c/0/0")
    got: list[Any] = []
    barrier = threading.Barrier(8)

    def run() -> None:
        barrier.wait()
        got.append(tables.table(database))

    threads = [threading.Thread(target=run) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(got) == 8 and all(g is got[0] for g in got)
    assert got[0]["w"] and all(isinstance(c, int) for c in got[0]["w"].values())


def test_damaged_table_copy_is_not_cached_across_loads(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    """A load of a good checkpoint, then of a copy with a damaged table at the same path: the
    second load reads the damaged table (no table is cached beyond one load)."""
    base, state = saved["ocdbt"]
    ckpt = copy_of(base, tmp_path / "c")
    assert_tree_equal(mp.load(ckpt, abstract_of(state)), state)
    shutil.rmtree(ckpt)
    copy_of(base, ckpt)
    database = database_of_key(ckpt, "w/c/0/0")
    table = read_table(ckpt, database)
    table["w"][(0, 0)] ^= 1
    write_table(ckpt, database, table)
    with pytest.raises(mp.CorruptCheckpointError):
        mp.load(ckpt, abstract_of(state))
