"""Small shards packed by milepost (``workers.save._packed``, issue 26): each host's uncompressed
shards of at most ``PACK_LIMIT`` bytes go into one database of its own, in key order, so hosts
that write the same arrays lay them out at the same offsets and the root view stays small."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost import workers
from milepost.workers.format import _ocdbt_index
from milepost.workers.format import _tensorstore as tsu
from milepost.workers.save import _packed
from tests._helpers import assert_tree_equal, put
from tests.test_integrity import chunk_value, flip

CASES = [  # (name, values, write shape, chunk shape)
    ("f32", np.arange(64, dtype=np.float32).reshape(8, 8), (4, 8), (2, 4)),
    ("bf16", np.arange(64).astype(ml_dtypes.bfloat16).reshape(8, 8), (8, 8), (8, 8)),
    ("b", (np.arange(64) % 3 == 0).reshape(8, 8), (4, 4), (2, 2)),
    ("c64", (np.arange(16) * 1j).astype(np.complex64).reshape(4, 4), (2, 4), (1, 4)),
    ("f8", np.arange(64).astype(ml_dtypes.float8_e4m3fn).reshape(8, 8), (4, 8), (4, 8)),
    ("i16", np.arange(-32, 32, dtype=np.int16).reshape(8, 8), (8, 4), (8, 2)),
    ("scalar", np.array(3.5, np.float64), (), ()),
]


def spec_of(name: str, values: np.ndarray, write: Any, chunk: Any) -> workers.ArraySpec:
    dtype = values.dtype.name if values.dtype.kind == "V" else str(values.dtype)
    return workers.ArraySpec(
        name=name, shape=values.shape, dtype=dtype, write_shape=write, chunk_shape=chunk
    )


def pack(packer: _packed.Packer) -> None:
    """What a save does with the packer after adding its regions."""
    buffer = np.empty(packer.layout(), np.uint8)
    for dst, src in packer.copies(buffer):
        np.copyto(dst, src)
    packer.write()


def values_of(directory: Path) -> dict[bytes, tuple[str, int, int]]:
    """Each key of the database in ``directory`` whose value lies in a data file: (data file,
    offset, length)."""
    kv = ts.KvStore.open({"driver": "file", "path": f"{directory}/"}).result()
    found = _ocdbt_index.indirect_values(kv, [b""], str(directory))
    return {k: (found.paths[f], o, n) for k, f, o, n in found.rows()}


def test_packed_shards_are_byte_for_byte_what_tensorstore_writes(tmp_path: Path) -> None:
    store = workers.StoreSpec(directory=str(tmp_path), use_ocdbt=True)
    packer = _packed.Packer(store, "ocdbt.process_7")
    for name, values, write, chunk in CASES:
        spec = spec_of(name, values, write, chunk)
        created = ts.open(
            tsu.create_spec(tsu.write_kvstore(store, 0), spec), create=True, open=True
        ).result()
        created.write(values).result()
        assert packer.add(spec, tuple((0, n) for n in values.shape), values), name
    pack(packer)
    theirs = ts.KvStore.open(tsu.ocdbt_kvstore(tmp_path / "ocdbt.process_0")).result()
    ours = ts.KvStore.open(tsu.ocdbt_kvstore(tmp_path / "ocdbt.process_7.p")).result()
    keys = [k for k in ours.list().result() if not k.startswith(b".milepost/")]
    assert len(keys) == 2 + 1 + 4 + 2 + 2 + 2 + 1  # every shard of every case
    for key in keys:
        assert ours.read(key).result().value == theirs.read(key).result().value, key


@pytest.mark.parametrize(
    ("dtype", "write", "compression", "shape"),
    [
        ("int4", (4, 8), None, (8, 8)),  # stored packed two to a byte
        ("float32", (4, 8), "zstd", (8, 8)),  # compressed
        ("float32", (4, 8), None, (6, 8)),  # the last shard reaches past the array
        ("float32", (512, 1024), None, (512, 1024)),  # 2 MiB: over PACK_LIMIT
    ],
)
def test_shards_milepost_does_not_pack_are_left_to_tensorstore(
    tmp_path: Path, dtype: str, write: tuple[int, ...], compression: str | None, shape: Any
) -> None:
    store = workers.StoreSpec(directory=str(tmp_path), use_ocdbt=True)
    packer = _packed.Packer(store, "ocdbt.process_0")
    np_dtype = np.dtype(getattr(ml_dtypes, dtype, dtype))
    spec = workers.ArraySpec(
        name="a",
        shape=shape,
        dtype=dtype,
        write_shape=write,
        chunk_shape=write,
        compression=compression,
    )
    values = np.zeros(shape, np_dtype)
    assert not packer.add(spec, tuple((0, n) for n in shape), values)
    assert packer.nbytes == 0


def test_a_save_packs_its_small_shards_in_key_order_and_loads_them_exactly(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    import orbax.checkpoint as ocp

    rng = np.random.default_rng(26)
    state = {
        f"layer{i}": put(rng.standard_normal((64, 32), dtype=np.float32), mesh24, P("data"))
        for i in range(5)
    }
    # shards of 2 MiB: over PACK_LIMIT, written by TensorStore
    big = np.arange(1 << 22, dtype=np.float32).reshape(2048, 2048)
    state["big"] = put(big, mesh24, P("data", "model"))
    state["bias"] = put(np.arange(16, dtype=np.int32), mesh24, P("model"))
    ckpt = mp.save(tmp_path / "ckpt", state)
    assert_tree_equal(mp.load(ckpt), state)
    restored = ocp.StandardCheckpointer().restore(
        ckpt / "state", jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    )
    assert_tree_equal(restored, state)

    packed = values_of(ckpt / "state" / "ocdbt.process_0.p")
    chunks = sorted(k for k in packed if not k.startswith(b".milepost/"))
    assert {k.split(b"/")[0] for k in chunks} == {
        *(f"layer{i}".encode() for i in range(5)),
        b"bias",
    }
    files = {packed[k][0] for k in chunks}
    assert len(files) == 1, "one data file"
    at = 0
    for key in chunks:  # one after another in key order from the file's start
        assert packed[key][1] == at, key
        at += packed[key][2]
    (table,) = (k for k in packed if k.startswith(b".milepost/"))
    assert packed[table][0] not in files, "the chunk checksum table in a data file of its own"
    rest = values_of(ckpt / "state" / "ocdbt.process_0")
    assert sorted(k for k in rest if not k.startswith(b".milepost/")) == sorted(
        f"big/c/{i}/{j}".encode() for i in range(2) for j in range(4)
    )


def test_hosts_writing_the_same_arrays_lay_their_shards_out_at_the_same_offsets(
    tmp_path: Path,
) -> None:
    store = workers.StoreSpec(directory=str(tmp_path), use_ocdbt=True)
    rng = np.random.default_rng(7)
    arrays = {f"a{k:03d}": rng.standard_normal((4, 100 + k), dtype=np.float32) for k in range(40)}
    for host in range(4):  # host h writes row h of every array, arrays in another order each
        packer = _packed.Packer(store, tsu.process_dir_name(host))
        names = sorted(arrays, key=lambda n: hash((n, host)))
        for name in names:
            values = arrays[name]
            spec = spec_of(name, values, (1, values.shape[1]), (1, values.shape[1]))
            assert packer.add(
                spec, ((host, host + 1), (0, values.shape[1])), values[host : host + 1]
            )
        pack(packer)
    where = {host: values_of(tmp_path / f"ocdbt.process_{host}.p") for host in range(4)}
    for name in arrays:
        offsets = {where[h][f"{name}/c/{h}/0".encode()][1:] for h in range(4)}
        assert len(offsets) == 1, (name, offsets)
    values = arrays["a005"]
    spec = spec_of("a005", values, (1, values.shape[1]), (1, values.shape[1]))
    ts.open(tsu.create_spec(tsu.write_kvstore(store, 0), spec), create=True).result()  # header
    workers.format.merge_ocdbt(str(tmp_path))
    root = ts.open(tsu.open_spec(tsu.ocdbt_kvstore(tmp_path), "a005")).result()
    assert np.array_equal(root.read().result(), values)


def test_a_saves_hosts_name_their_files_with_its_token_and_a_second_writer_is_refused(
    tmp_path: Path,
) -> None:
    """Every host of a save names its packed database's data files with the save's one token
    (a root leaf names every host's files: alike, they compress to almost nothing); a second
    write of a database folder, which with a shared token would overwrite the first one's
    files, is refused before it writes anything."""
    store = workers.StoreSpec(directory=str(tmp_path), use_ocdbt=True, file_token="0a1b2c3d")
    values = np.arange(64, dtype=np.float32).reshape(8, 8)
    spec = spec_of("w", values, (1, 8), (1, 8))

    def write(host: int, scale: float) -> None:
        packer = _packed.Packer(store, tsu.process_dir_name(host))
        assert packer.add(spec, ((host, host + 1), (0, 8)), values[host : host + 1] * scale)
        pack(packer)

    for host in range(3):
        write(host, 1.0)
    for host in range(3):
        names = sorted(p.name for p in (tmp_path / f"ocdbt.process_{host}.p" / "d").iterdir())
        assert names == ["0a1b2c3d.0000", "0a1b2c3d.0001", "0a1b2c3d.n"]
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(FileExistsError, match="already holds an OCDBT database"):
        write(1, 2.0)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    for bad in ("../../x", "0A1B2C3D", "0a1b2c3", 12345678):
        with pytest.raises(ValueError, match="8 lowercase hex digits"):
            workers.StoreSpec(directory=str(tmp_path), file_token=bad)  # type: ignore[arg-type]


def test_a_flipped_or_truncated_packed_value_fails_its_checksum(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    state = {"w": put(np.arange(64 * 32, dtype=np.float32).reshape(64, 32), mesh24, P("data"))}
    ckpt = mp.save(tmp_path / "ckpt", state)
    file, offset, length = chunk_value(ckpt, "w/c/1/0")
    assert file.parent.parent.name == "ocdbt.process_0.p"
    flip(file, offset + 5)
    with pytest.raises(mp.CorruptCheckpointError, match="'w'"):
        mp.load(ckpt)
    flip(file, offset + 5)
    assert_tree_equal(mp.load(ckpt), state)
    os.truncate(file, offset + length // 2)
    with pytest.raises((mp.CorruptCheckpointError, mp.CheckpointNotFoundError)):
        mp.load(ckpt)


def test_past_the_budget_shards_go_to_tensorstore_and_load_exactly(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_packed, "PACK_BUDGET", 5 * 1024)
    state = {f"a{k}": put(np.full((8, 256), k, np.float32), mesh24, P("data")) for k in range(4)}
    ckpt = mp.save(tmp_path / "ckpt", state)  # 2 shards of 4 KiB an array
    assert_tree_equal(mp.load(ckpt), state)
    packed = values_of(ckpt / "state" / "ocdbt.process_0.p")
    assert len([k for k in packed if not k.startswith(b".milepost/")]) == 1
    rest = values_of(ckpt / "state" / "ocdbt.process_0")
    assert len([k for k in rest if not k.startswith(b".milepost/")]) == 7
    assert mp.verify(ckpt).ok


def test_a_packed_save_counts_its_bytes_and_records_no_chunk_checksum(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    """Its bytes reach the progress bar's total once durable; its chunks' CRC32Cs are in its
    table, none in ``_milepost.json`` (before packing, small shards inline in the B-tree were
    recorded there), and the table holds each chunk's values' CRC32C."""
    import io
    import json
    import re

    from milepost.workers.format import _checksum

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    w = np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024)  # 2 MiB, shards of 256 KiB
    state = {"w": put(w, mesh24, P("data", "model")), "tiny": put(np.arange(4.0), mesh24, P())}
    stream = Terminal()
    with mp.Context(progress=mp.ProgressOptions(file=stream, delay_secs=0, refresh_secs=0)):
        mp.save_async(tmp_path / "c", state).result()
    done = [float(a) for a, _ in re.findall(r"([\d.]+)/([\d.]+) MiB", stream.getvalue())]
    assert done and done == sorted(done) and done[-1] == 2.0, done
    info = json.loads((tmp_path / "c" / "state" / "_milepost.json").read_text())
    assert info["chunk_crc32c_tables"] == 1 and "chunk_crc32c" not in info, info
    root = ts.KvStore.open(tsu.ocdbt_kvstore(tmp_path / "c" / "state")).result()
    key = workers.format.CHUNK_TABLE_PREFIX + "ocdbt.process_0.p"
    table = workers.format.decode_chunk_table("ocdbt.process_0.p", root[key], key)
    assert table["w"] == {
        (i, j): _checksum.crc32c(
            np.ascontiguousarray(w[256 * i : 256 * (i + 1), 256 * j : 256 * (j + 1)])
        )
        for i in range(2)
        for j in range(4)
    }
    assert table["tiny"] == {(0,): _checksum.crc32c(np.arange(4.0, dtype=np.float32))}


# ------------------------------------------------------------------------------------------
# Attacks on packed databases: each load raises a milepost error or returns what was saved
# ------------------------------------------------------------------------------------------


def _state(mesh: jax.sharding.Mesh, offset: float = 0.0) -> dict[str, Any]:
    rng = np.random.default_rng(11)
    return {
        "w": put(
            rng.standard_normal((64, 128), dtype=np.float32) + offset, mesh, P("data", "model")
        ),
        "n": np.arange(300, dtype=np.int64) + int(offset),  # the controller's own, packed too
    }


@pytest.fixture
def packed_ckpt(tmp_path: Path, mesh24: jax.sharding.Mesh) -> tuple[Path, Any]:
    state = _state(mesh24)
    ckpt = mp.save(tmp_path / "c", state)
    assert (ckpt / "state" / "ocdbt.process_0.p").is_dir()
    assert (ckpt / "state" / "ocdbt.process_controller.p").is_dir()
    assert_tree_equal(mp.load(ckpt), state)
    return ckpt, state


def _refused(ckpt: Path, match: str | None = None) -> None:
    from tests.test_integrity import reading

    for direct in (True, False):
        with reading(direct), pytest.raises(mp.CorruptCheckpointError, match=match):
            mp.load(ckpt)
    assert not mp.verify(ckpt).ok


def test_a_packed_chunk_copied_into_another_chunks_place_is_refused(
    packed_ckpt: tuple[Path, Any],
) -> None:
    ckpt, _ = packed_ckpt
    src, dst = chunk_value(ckpt, "w/c/0/0"), chunk_value(ckpt, "w/c/1/3")
    assert src[0] == dst[0] and src[2] == dst[2]  # one data file, shards of one size
    data = bytearray(src[0].read_bytes())
    data[dst[1] : dst[1] + dst[2]] = data[src[1] : src[1] + src[2]]
    src[0].write_bytes(bytes(data))
    _refused(ckpt, "'w'")


def test_a_packed_data_file_from_another_checkpoint_is_refused(
    packed_ckpt: tuple[Path, Any], tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    """The same layout with other values: every value and offset is valid, none is this
    checkpoint's."""
    ckpt, _ = packed_ckpt
    decoy = mp.save(tmp_path / "decoy", _state(mesh24, offset=5.0))
    ours, theirs = chunk_value(ckpt, "w/c/0/0")[0], chunk_value(decoy, "w/c/0/0")[0]
    assert ours.stat().st_size == theirs.stat().st_size
    ours.write_bytes(theirs.read_bytes())
    _refused(ckpt, "'w'")


def test_the_hosts_and_the_controllers_packed_databases_swapped_are_refused(
    packed_ckpt: tuple[Path, Any],
) -> None:
    ckpt, _ = packed_ckpt
    a = ckpt / "state" / "ocdbt.process_0.p"
    b = ckpt / "state" / "ocdbt.process_controller.p"
    a.rename(ckpt / "state" / "tmp")
    b.rename(a)
    (ckpt / "state" / "tmp").rename(b)
    for direct in (True, False):
        from tests.test_integrity import reading

        with (
            reading(direct),
            pytest.raises((mp.CorruptCheckpointError, mp.CheckpointNotFoundError)),
        ):
            mp.load(ckpt)
    assert not mp.verify(ckpt).ok


def test_a_damaged_or_forged_packed_table_is_refused(packed_ckpt: tuple[Path, Any]) -> None:
    ckpt, _ = packed_ckpt
    key = workers.format.CHUNK_TABLE_PREFIX + "ocdbt.process_0.p"
    file, offset, length = chunk_value(ckpt, key)
    assert file != chunk_value(ckpt, "w/c/0/0")[0], "the table in a data file of its own"
    original = file.read_bytes()
    flip(file, offset + length // 2)
    _refused(ckpt, "checksum table")
    file.write_bytes(original)
    assert_tree_equal(mp.load(ckpt), packed_ckpt[1])
    # the controller's table, under the host's key: a table that names another database
    root = ts.KvStore.open(tsu.ocdbt_kvstore(ckpt / "state")).result()
    other = workers.format.CHUNK_TABLE_PREFIX + "ocdbt.process_controller.p"
    root[key] = root[other]
    _refused(ckpt, "is the table of 'ocdbt.process_controller.p'")
