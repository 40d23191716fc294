"""Direct reads: uncompressed shards (one chunk, or several inner chunks such as the default row
bands) are read from their files straight into the destination buffers. They must give exactly
what TensorStore gives, be used only where they apply, and fail as loudly as TensorStore on
damaged data."""

from __future__ import annotations

import math
import os
import struct
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost.workers.load import _direct, _locator, _pieces
from tests._helpers import abstract_of, assert_tree_equal, put


@pytest.fixture
def direct_spy(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records the chunk key of every direct read."""
    keys: list[str] = []
    real = _direct.DirectReader.read_box

    def read_box(self: Any, values: Any, reads: Any, out: np.ndarray, *args: Any) -> Any:
        keys.extend(read.key for read in reads)
        return real(self, values, reads, out, *args)

    monkeypatch.setattr(_direct.DirectReader, "read_box", read_box)
    return keys


def _state(mesh: jax.sharding.Mesh) -> dict[str, Any]:
    # Every shard is over 1 KiB: smaller values live inline in the OCDBT B-tree and are read
    # through TensorStore.
    rng = np.random.default_rng(7)
    return {
        "w": put(rng.standard_normal((64, 96), dtype=np.float32), mesh, P("data", "model")),
        "b": put(rng.integers(-9, 9, (16, 256), dtype=np.int16), mesh, P(None, "model")),
        "r": put(rng.standard_normal((64, 64), dtype=np.float32), mesh, P()),
        "v": put(np.arange(8 * 2048, dtype=np.uint8), mesh, P(("data", "model"))),
        "host": np.arange(1000, dtype=np.float64),
    }


def _load(path: Path, abstract: Any, *, direct: bool) -> Any:
    with mp.Context(loading=mp.LoadOptions(direct_reads=direct)):
        return mp.load(path, abstract)


@pytest.mark.parametrize("use_ocdbt", [True, False], ids=["ocdbt", "zarr3"])
def test_saved_layout_is_read_directly_and_exactly(
    tmp_path: Path, mesh24: jax.sharding.Mesh, direct_spy: list[str], use_ocdbt: bool
) -> None:
    state = _state(mesh24)
    # (replicated shards split among their replicas, however small: the layouts read here)
    with mp.Context(saving=mp.SaveOptions(use_ocdbt=use_ocdbt, min_write_bytes=0)):
        mp.save(tmp_path / "c", state)
    direct = _load(tmp_path / "c", abstract_of(state), direct=True)
    assert_tree_equal(direct, state)
    # One piece per saved shard inside each distinct device box (replica-parallel saving cuts
    # the replicated boxes of 'b' and 'r' into several shards), plus the host array.
    info = mp.metadata(tmp_path / "c")
    expected = 1
    for name in ("w", "b", "r", "v"):
        write_shape = info.tree[name].write_shape
        shape = state[name].shape
        boxes = {
            tuple((s.start or 0, s.stop or n) for s, n in zip(sh.index, shape, strict=True))
            for sh in state[name].addressable_shards
        }
        expected += sum(
            math.prod((b - a) // w for (a, b), w in zip(box, write_shape, strict=True))
            for box in boxes
        )
    assert expected > 1 + 8 + 4 + 1 + 8  # the replicated boxes really span several shards
    assert len(direct_spy) == expected
    direct_spy.clear()
    through_tensorstore = _load(tmp_path / "c", abstract_of(state), direct=False)
    assert direct_spy == []
    assert_tree_equal(through_tensorstore, state)


def test_resharded_boxes_read_the_chunks_they_touch_directly(
    tmp_path: Path, mesh24: jax.sharding.Mesh, direct_spy: list[str]
) -> None:
    x = np.arange(64 * 48, dtype=np.float32).reshape(64, 48)
    with mp.Context(saving=mp.SaveOptions(min_write_bytes=0)):
        mp.save(
            tmp_path / "c", {"x": put(x, mesh24, P("data", None))}
        )  # replica-parallel: shards of 8 full rows
    mesh81 = jax.make_mesh((8, 1), ("rows", "cols"))
    mesh18 = jax.make_mesh((1, 8), ("rows", "cols"))
    # 8 rows x 48 columns: one shard each -> one range each
    rows = mp.load(
        tmp_path / "c",
        {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh81, P("rows")))},
    )
    assert len(direct_spy) == 8
    np.testing.assert_array_equal(np.asarray(rows["x"]), x)
    direct_spy.clear()
    # 64 rows x 6 columns: each box keeps 6 columns of all 8 shards, strided in each: every
    # chunk is read whole (checked), beside the box, and its columns copied into place
    cols = mp.load(
        tmp_path / "c",
        {
            "x": jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=NamedSharding(mesh18, P(None, "cols"))
            )
        },
    )
    assert sorted(direct_spy) == sorted(f"x/c/{i}/0" for i in range(8) for _ in range(8))
    np.testing.assert_array_equal(np.asarray(cols["x"]), x)
    # a cast reads the stored dtype directly and casts after
    cast = mp.load(
        tmp_path / "c",
        {"x": jax.ShapeDtypeStruct(x.shape, np.int32, sharding=NamedSharding(mesh81, P("rows")))},
    )
    np.testing.assert_array_equal(np.asarray(cast["x"]), x.astype(np.int32))


def test_compressed_arrays_go_through_tensorstore(
    tmp_path: Path, mesh24: jax.sharding.Mesh, direct_spy: list[str]
) -> None:
    state = {"w": put(np.arange(256 * 8, dtype=np.float32).reshape(256, 8), mesh24, P("data"))}
    with mp.Context(saving=mp.SaveOptions(compression="zstd")):
        mp.save(tmp_path / "c", state)
    assert_tree_equal(mp.load(tmp_path / "c", abstract_of(state)), state)
    assert direct_spy == []


def _shard_file(root: Path) -> Path:
    """The data file of the first shard of array 'w' in a plain zarr3 checkpoint."""
    return root / "state" / "w" / "c" / "0" / "0"


@pytest.mark.parametrize("damage", ["index_checksum", "truncated"])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "tensorstore"])
def test_damaged_shard_is_an_error_on_both_paths(
    tmp_path: Path, mesh24: jax.sharding.Mesh, damage: str, direct: bool
) -> None:
    state = {
        "w": put(np.arange(64 * 96, dtype=np.float32).reshape(64, 96), mesh24, P("data", "model"))
    }
    with mp.Context(saving=mp.SaveOptions(use_ocdbt=False)):
        mp.save(tmp_path / "c", state)
    shard = _shard_file(tmp_path / "c")
    data = bytearray(shard.read_bytes())
    if damage == "index_checksum":
        data[-10] ^= 0xFF  # inside the 16-byte index, so its CRC32C no longer matches
    else:
        data = data[: len(data) // 2]
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="missing or damaged"):
        _load(tmp_path / "c", abstract_of(state), direct=direct)


def test_crc32c_matches_the_standard_check_value() -> None:
    assert _direct.crc32c(b"123456789") == 0xE3069283
    assert _direct.crc32c(b"") == 0


def test_a_missing_chunk_in_the_shard_index_falls_back(tmp_path: Path) -> None:
    payload = bytes(range(16))
    index = struct.pack("<QQ", 2**64 - 1, 2**64 - 1)
    file = tmp_path / "shard"
    file.write_bytes(payload + index + struct.pack("<I", _direct.crc32c(index)))
    reader = _direct.DirectReader()
    try:
        value = _locator.Locator(
            mp.workers.StoreSpec(directory=str(tmp_path), use_ocdbt=False)
        ).locate("shard")
        assert value is not None and value.length == 36
        read = _pieces.BoxRead(key="shard", offset_in_chunk=0, chunk_nbytes=16)
        assert (
            reader.read_box([value], [read], np.empty(16, np.uint8), [None]).result() is True
        )  # fall back
    finally:
        reader.close()


@pytest.mark.parametrize(
    ("box", "expected"),
    [
        (((0, 4), (0, 6)), [("a/c/0/0", 0, 0)]),  # a whole shard
        (((5, 7), (0, 6)), [("a/c/1/0", 4 * 1 * 6, 0)]),  # whole rows inside the second shard row
        (((2, 3), (1, 4)), [("a/c/0/0", 4 * (2 * 6 + 1), 0)]),  # part of a single row
        (
            ((2, 6), (0, 6)),
            [("a/c/0/0", 4 * 2 * 6, 0), ("a/c/1/0", 0, 4 * 2 * 6)],
        ),  # rows across two shards
        # strided columns: the whole chunk is read, and the box's part placed
        (((0, 4), (0, 3)), [("a/c/0/0", 0, ((0, 4), (0, 3)))]),
        # whole shards side by side: each is strided in the box buffer, so it is placed there
        (((0, 4), (0, 12)), [("a/c/0/0", 0, ((0, 4), (0, 6))), ("a/c/0/1", 0, ((0, 4), (6, 12)))]),
        # a column strip of two shards: strided in each chunk
        (((0, 8), (3, 6)), [("a/c/0/0", 0, ((0, 4), (0, 3))), ("a/c/1/0", 0, ((4, 8), (0, 3)))]),
    ],
)
def test_box_reads_find_contiguous_ranges(box: Any, expected: Any) -> None:
    layout = _pieces.ShardLayout(
        name="a", shard_shape=(4, 6), dtype=np.dtype(np.float32), separator="/"
    )
    got = _pieces.box_reads(layout, box)
    assert (
        None
        if got is None
        else [(p.key, p.offset_in_chunk, p.scatter or p.offset_in_box) for p in got]
    ) == expected


def test_locator_walks_a_deep_btree(tmp_path: Path) -> None:
    """With tiny B-tree nodes the tree has interior levels and per-level key prefixes; every
    value of the wanted arrays is found at the right file range, and no other array's."""
    kv = ts.KvStore.open(
        {
            "driver": "ocdbt",
            "base": f"file://{tmp_path}/",
            "config": {"max_decoded_node_bytes": 200, "max_inline_value_bytes": 4},
        }
    ).result()
    txn = ts.Transaction()
    values = {
        f"{name}/c/{i}/{j}": os.urandom(7 + i * 3 + j)
        for name in ("aa", "ab", "b")
        for i in range(6)
        for j in range(3)
    }
    for key, value in values.items():
        kv.with_transaction(txn)[key] = value
    txn.commit_sync()
    manifest = ts.ocdbt.dump(kv.base).result()
    assert manifest["versions"][-1]["root_height"] > 1
    locator = _locator.Locator(mp.workers.StoreSpec(directory=str(tmp_path), use_ocdbt=True))
    locator.index(["aa", "b"])
    for key, value in values.items():
        where = locator.locate(key)
        if key.startswith("ab/"):
            assert where is None
            continue
        assert where is not None, key
        with open(where.path, "rb") as f:
            f.seek(where.offset)
            assert f.read(where.length) == value


def _big_state(mesh: jax.sharding.Mesh) -> dict[str, Any]:
    """Shards of 1 MiB and more (the size from which read buffers are mappings of their own)."""
    rng = np.random.default_rng(11)
    return {
        "w": put(
            rng.standard_normal((1024, 2048), dtype=np.float32), mesh, P("data", "model")
        ),  # 1 MiB shards
        "r": put(
            rng.integers(0, 255, (1024, 1536), dtype=np.uint8), mesh, P()
        ),  # 1.5 MiB, replicated
    }


def test_large_boxes_are_read_into_buffers_the_devices_adopt(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each box of a MiB or more is read into a buffer of its own mapping, and the CPU device
    array owns that very memory (no copy on placement); values are exact."""
    from milepost.workers import _memory as _engine

    state = _big_state(mesh24)
    mp.save(tmp_path / "c", state)
    buffers: list[np.ndarray] = []
    real = _engine.read_buffer

    def spy(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        out = real(shape, dtype)
        buffers.append(out)
        return out

    monkeypatch.setattr(_engine, "read_buffer", spy)
    restored = mp.load(tmp_path / "c", abstract_of(state))
    assert_tree_equal(restored, state)
    mapped = {b.ctypes.data for b in buffers if b.nbytes >= 1 << 20}
    assert len(mapped) == 8 + 1, "one buffer per distinct box of 'w' (8) and of replicated 'r' (1)"
    assert all(b.ctypes.data % 4096 == 0 for b in buffers if b.nbytes >= 1 << 20)
    w_pointers = {s.data.unsafe_buffer_pointer() for s in restored["w"].addressable_shards}
    assert w_pointers <= mapped, "the devices copied the read buffers instead of adopting them"


def test_loads_work_when_no_mapping_can_be_made(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of mappings (vm.max_map_count): read buffers come from NumPy and the load is exact."""
    import mmap

    from milepost.workers import _memory as _engine

    state = _big_state(mesh24)
    mp.save(tmp_path / "c", state)

    def no_mapping(*args: Any, **kwargs: Any) -> Any:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", no_mapping)
    assert _engine.read_buffer((2048, 1024), np.dtype(np.float32)).ctypes.data % 64 == 0
    assert_tree_equal(mp.load(tmp_path / "c", abstract_of(state)), state)


def test_shards_side_by_side_are_read_directly_into_place(
    tmp_path: Path, mesh24: jax.sharding.Mesh, direct_spy: list[str]
) -> None:
    """A replicated array saved replica-parallel along its columns (its rows do not split among
    the replicas) is stored as column strips: loading it whole reads each strip directly and
    places it in the box; values exact, and a flipped byte in a strip is still caught."""
    from tests.test_integrity import chunk_value, flip

    x = np.random.default_rng(3).standard_normal(
        (5, 1024), dtype=np.float32
    )  # 5 rows: cut along columns
    state = {"r": put(x, mesh24, P())}
    with mp.Context(saving=mp.SaveOptions(min_write_bytes=0)):  # 8 parts of 2.5 KiB
        mp.save(tmp_path / "c", state)
    assert mp.metadata(tmp_path / "c").tree["r"].write_shape == (5, 128)
    assert_tree_equal(mp.load(tmp_path / "c", abstract_of(state)), state)
    assert sorted(direct_spy) == [f"r/c/0/{k}" for k in range(8)]
    file, offset, _ = chunk_value(tmp_path / "c", "r/c/0/3")
    flip(file, offset + 7)
    with pytest.raises(mp.CorruptCheckpointError, match=r"array 'r'.*chunk"):
        mp.load(tmp_path / "c", abstract_of(state))


def test_many_small_arrays_are_read_in_batches_and_errors_stay_with_their_array(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small boxes are handed to the read threads in batches, and values lying back to back in
    a data file are read with one preadv: far fewer system calls than shards. A damaged chunk
    fails the load naming its own array, not another of its batch."""
    from tests.test_integrity import chunk_value, flip

    rng = np.random.default_rng(5)
    specs = [P("data", "model"), P(None, ("data", "model")), P()]
    state = {
        f"a{i:02d}": put(rng.standard_normal((16, 256), dtype=np.float32), mesh24, specs[i % 3])
        for i in range(30)
    }
    with mp.Context(saving=mp.SaveOptions(min_write_bytes=0)):  # many small parts
        mp.save(tmp_path / "c", state)
    calls: list[int] = []
    real = os.preadv

    def preadv(fd: int, buffers: Any, offset: int) -> int:
        calls.append(len(buffers))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    batches: list[int] = []
    real_batch = _direct.DirectReader._read_batch

    def read_batch(self: Any, boxes: Any) -> Any:
        batches.append(len(boxes))
        return real_batch(self, boxes)

    monkeypatch.setattr(_direct.DirectReader, "_read_batch", read_batch)
    assert_tree_equal(mp.load(tmp_path / "c", abstract_of(state)), state)
    shards = (
        10 * 8 + 10 * 8 + 10 * 8
    )  # the replicated arrays' boxes span 8 replica-parallel shards each
    assert sum(batches) == 10 * 8 + 10 * 8 + 10 and len(batches) < 10
    assert sum(n // 2 for n in calls) == shards  # every value read once, with its index
    assert len(calls) < shards // 4, calls
    monkeypatch.setattr(os, "preadv", real)
    file, offset, length = chunk_value(tmp_path / "c", "a12/c/1/2")
    flip(file, offset + length // 2)
    with pytest.raises(mp.CorruptCheckpointError) as info:
        mp.load(tmp_path / "c", abstract_of(state))
    assert str(info.value).startswith("array 'a12'"), info.value


# ------------------------------------------------------------------------------------------
# Subchunked shards (SaveOptions.chunk_byte_size): several inner chunks per shard
# ------------------------------------------------------------------------------------------

BAND_BYTES = 32 << 10
"""(64, 4096) float32 saved P('data', 'model') on (2, 4): shards of (32, 1024) (128 KiB), cut
into four row bands of (8, 1024) (32 KiB; each row 4 KiB)."""


def _banded(mesh: jax.sharding.Mesh, seed: int = 21) -> dict[str, Any]:
    x = np.random.default_rng(seed).standard_normal((64, 4096), dtype=np.float32)
    return {"w": put(x, mesh, P("data", "model"))}


def _save_banded(
    path: Path, state: dict[str, Any], *, use_ocdbt: bool = True, band: int = BAND_BYTES
) -> Path:
    with mp.Context(saving=mp.SaveOptions(chunk_byte_size=band, use_ocdbt=use_ocdbt)):
        mp.save(path, state)
    return path


@pytest.fixture
def piece_spy(monkeypatch: pytest.MonkeyPatch) -> list[_pieces.BoxRead]:
    """Records every piece read directly (a box's part of one inner chunk)."""
    pieces: list[_pieces.BoxRead] = []
    real = _direct.DirectReader.read_box

    def read_box(self: Any, values: Any, reads: Any, out: np.ndarray, *args: Any) -> Any:
        pieces.extend(reads)
        return real(self, values, reads, out, *args)

    monkeypatch.setattr(_direct.DirectReader, "read_box", read_box)
    return pieces


def _preadv_calls(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Every os.preadv call's buffer lengths."""
    calls: list[list[int]] = []
    real = os.preadv

    def preadv(fd: int, buffers: Any, offset: int) -> int:
        calls.append([len(b) for b in buffers])
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    return calls


def _target(state: dict[str, Any], mesh_shape: tuple[int, int], spec: P) -> tuple[Any, Any]:
    sharding = NamedSharding(jax.make_mesh(mesh_shape, ("a", "b")), spec)
    x = np.asarray(state["w"])
    return {"w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)}, {
        "w": jax.device_put(x, sharding)
    }


@pytest.mark.parametrize("use_ocdbt", [True, False], ids=["ocdbt", "zarr3"])
def test_subchunked_shards_are_read_directly_each_in_one_preadv(
    tmp_path: Path,
    mesh24: jax.sharding.Mesh,
    piece_spy: list[_pieces.BoxRead],
    monkeypatch: pytest.MonkeyPatch,
    use_ocdbt: bool,
) -> None:
    """A box that is a saved shard of row bands: its bands lie one after another in the shard
    value and in the box, so the value is read whole (bands, then index) with one preadv, and
    every band is checked; values exact."""
    state = _banded(mesh24)
    _save_banded(tmp_path / "c", state, use_ocdbt=use_ocdbt)
    assert mp.metadata(tmp_path / "c").tree["w"].chunk_shape == (8, 1024)
    calls = _preadv_calls(monkeypatch)
    assert_tree_equal(mp.load(tmp_path / "c", abstract_of(state)), state)
    assert len(piece_spy) == 8 * 4 and all(p.whole and p.scatter is None for p in piece_spy)
    assert sorted((p.key, p.chunk) for p in piece_spy) == sorted(
        (f"w/c/{i}/{j}", k) for i in range(2) for j in range(4) for k in range(4)
    )
    index = 4 * 16 + 4
    values = [c for c in calls if c[-1] == index]
    assert sum(len(c) // 2 for c in values) == 8, (
        calls
    )  # each shard value once: its bands and its index
    assert all(c == [4 * BAND_BYTES, index] * (len(c) // 2) for c in values), calls
    assert len(calls) <= 8 + 2, (
        calls
    )  # (+ a couple of small reads of the controller's NumPy leaves, if any)


@pytest.mark.parametrize(
    ("target", "band", "mode"),
    [
        # the paper's (2, 4) -> (8, 1): 8 rows x 4096 per device, one whole band of each of four
        # shards, each strided in the box: read straight into place, a row per iovec
        (((8, 1), P("a", None)), BAND_BYTES, "in place"),
        # the same with 16-row bands: each box keeps half of four bands, read whole for the check
        # (the other half beside the box), its half straight into place
        (((8, 1), P("a", None)), 2 * BAND_BYTES, "in place, half"),
        # 64 rows x 512 columns: half of every row of a band, runs of 2 KiB: read beside the box,
        # checked, copied into place
        (((1, 8), P(None, "b")), BAND_BYTES, "copied"),
        # 64 x 4096 on every device: every band of every shard, strided in the box
        (((8, 1), P()), BAND_BYTES, "in place"),
    ],
    ids=["rows", "half-bands", "columns", "replicated"],
)
def test_subchunked_resharded_loads_read_the_bands_they_touch_directly(
    tmp_path: Path,
    mesh24: jax.sharding.Mesh,
    piece_spy: list[_pieces.BoxRead],
    target: Any,
    band: int,
    mode: str,
) -> None:
    state = _banded(mesh24)
    _save_banded(tmp_path / "c", state, band=band)
    abstract, want = _target(state, *target)
    before = mp.io_stats()
    assert_tree_equal(mp.load(tmp_path / "c", abstract), want)
    read = (mp.io_stats() - before).bytes_read
    assert piece_spy and all(p.whole for p in piece_spy)  # every band read whole (and checked)
    if mode == "in place":
        assert all(p.in_place and p.scratch == 0 for p in piece_spy)
        # each band once per distinct box that keeps it, plus a shard index per piece (and a
        # few KiB of metadata): nothing read twice or beside the boxes
        assert sum(p.nbytes for p in piece_spy) == np.asarray(state["w"]).nbytes
        assert read <= sum(p.nbytes for p in piece_spy) + len(piece_spy) * (4 * 16 + 4) + (
            64 << 10
        ), read
    elif mode == "in place, half":
        assert all(p.in_place and p.scratch == p.nbytes == BAND_BYTES for p in piece_spy)
    else:
        assert all(not p.in_place and p.scratch == p.chunk_nbytes for p in piece_spy)


TARGETS = {
    "same": None,  # each box a saved shard: read whole, the index after the bands
    "rows": ((8, 1), P("a", None)),  # each box a band of four shards: the index first
    "columns": ((1, 8), P(None, "b")),  # half of each row of a band: read beside the box
}


def _load_banded(path: Path, state: dict[str, Any], target: str) -> tuple[Any, Any]:
    """(what the load returned, what it should have)."""
    if TARGETS[target] is None:
        return mp.load(path, abstract_of(state)), state
    abstract, want = _target(state, *TARGETS[target])  # type: ignore[misc]
    return mp.load(path, abstract), want


@pytest.mark.parametrize("target", list(TARGETS))
def test_a_flipped_byte_in_one_inner_chunk_is_caught_on_the_direct_path(
    tmp_path: Path, mesh24: jax.sharding.Mesh, piece_spy: list[_pieces.BoxRead], target: str
) -> None:
    from tests.test_integrity import chunk_value, flip

    state = _banded(mesh24)
    _save_banded(tmp_path / "c", state)
    file, offset, _ = chunk_value(tmp_path / "c", "w/c/1/2")
    flip(
        file, offset + 2 * BAND_BYTES + 4 * 1024 + 3, 0x40
    )  # shard (1, 2), its third band (inner chunk (6, 2))
    with pytest.raises(mp.CorruptCheckpointError) as info:
        _load_banded(tmp_path / "c", state, target)
    message = str(info.value)
    assert message.startswith("array 'w': chunk (6, 2)"), message
    assert f"{file} at byte {offset + 2 * BAND_BYTES}" in message and "'w/c/1/2'" in message, (
        message
    )
    assert piece_spy, "the direct path was not taken"


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("damage", ["index", "truncated", "cut-to-index"])
def test_a_damaged_subchunked_shard_is_an_error_on_the_direct_path(
    tmp_path: Path,
    mesh24: jax.sharding.Mesh,
    piece_spy: list[_pieces.BoxRead],
    target: str,
    damage: str,
) -> None:
    from tests.test_integrity import chunk_value, flip, truncate

    state = _banded(mesh24)
    _save_banded(tmp_path / "c", state, use_ocdbt=False)
    file, offset, length = chunk_value(tmp_path / "c", "w/c/1/2")
    if damage == "index":
        flip(
            file, offset + length - 20
        )  # inside the 4 x 16-byte index: its CRC32C no longer matches
    elif damage == "truncated":
        truncate(file, offset + length // 2)
    else:
        truncate(file, offset + length - 4)  # every chunk there, the index's checksum cut off
    with pytest.raises(mp.CorruptCheckpointError) as info:
        _load_banded(tmp_path / "c", state, target)
    message = str(info.value)
    assert message.startswith("array 'w'"), message
    assert "damaged index" in message if damage == "index" else "missing or damaged" in message, (
        message
    )
    assert piece_spy, "the direct path was not taken"


def _rewrite_shard(file: Path, chunks: int, change: Any) -> None:
    """Rewrite a plain zarr3 shard file: ``change(chunk bytes by position) -> (stored order,
    positions stored as missing)``; the index is rebuilt and resealed with its CRC32C."""
    data = file.read_bytes()
    size = (len(data) - chunks * 16 - 4) // chunks
    parts = [data[k * size : (k + 1) * size] for k in range(chunks)]
    order, missing = change(parts)
    body, entries = b"", [(2**64 - 1, 2**64 - 1)] * chunks
    for k in order:
        if k in missing:
            continue
        entries[k] = (len(body), size)
        body += parts[k]
    index = b"".join(struct.pack("<QQ", *e) for e in entries)
    file.write_bytes(body + index + struct.pack("<I", _direct.crc32c(index)))


@pytest.mark.parametrize("target", list(TARGETS))
def test_inner_chunks_stored_out_of_order_are_found_through_the_index(
    tmp_path: Path, mesh24: jax.sharding.Mesh, piece_spy: list[_pieces.BoxRead], target: str
) -> None:
    """The shard layout is assumed (chunks in C order, then the index) only to read a shard in
    one go: the index is checked after, and chunks stored elsewhere are read from there."""
    state = _banded(mesh24)
    _save_banded(tmp_path / "c", state, use_ocdbt=False)
    _rewrite_shard(
        tmp_path / "c" / "state" / "w" / "c" / "1" / "2", 4, lambda parts: ([2, 0, 3, 1], set())
    )
    got, want = _load_banded(tmp_path / "c", state, target)
    assert_tree_equal(got, want)
    assert piece_spy, "the direct path was not taken"


@pytest.mark.parametrize("target", list(TARGETS))
def test_a_missing_inner_chunk_falls_back_to_tensorstore(
    tmp_path: Path,
    mesh24: jax.sharding.Mesh,
    piece_spy: list[_pieces.BoxRead],
    monkeypatch: pytest.MonkeyPatch,
    target: str,
) -> None:
    """A band written as missing (its values equal the fill value, in a checkpoint that says it
    skips those, as Orbax writes): the boxes that touch it are read through TensorStore, which
    fills it, and are still checked (the recorded checksum is of the zeros); exact."""
    import json

    from tests._helpers import reseal

    x = np.random.default_rng(5).standard_normal((64, 4096), dtype=np.float32)
    x[48:56, 2048:3072] = 0  # shard (1, 2), its third band
    state = {"w": put(x, mesh24, P("data", "model"))}
    _save_banded(tmp_path / "c", state, use_ocdbt=False)
    _rewrite_shard(
        tmp_path / "c" / "state" / "w" / "c" / "1" / "2", 4, lambda parts: ([0, 1, 2, 3], {2})
    )
    tree_file = tmp_path / "c" / "state" / "_METADATA"
    tree = json.loads(tree_file.read_text())
    tree["store_array_data_equal_to_fill_value"] = False
    tree_file.write_text(json.dumps(tree))
    reseal(tmp_path / "c")
    fallbacks: list[bool] = []
    real = _direct.BoxHandle.result

    def result(self: Any) -> bool:
        fallbacks.append(real(self))
        return fallbacks[-1]

    monkeypatch.setattr(_direct.BoxHandle, "result", result)
    got, want = _load_banded(tmp_path / "c", state, target)
    assert_tree_equal(got, want)
    assert piece_spy and any(fallbacks) and not all(fallbacks), fallbacks


@pytest.mark.parametrize(
    ("box", "expected"),
    [
        # a whole shard of four (1, 6) bands: each band one range of the box, in order
        (((0, 4), (0, 6)), [("a/c/0/0", k, 0, 24 * k, True) for k in range(4)]),
        # rows 2-5: the last two bands of shard 0 and the first two of shard 1
        (
            ((2, 6), (0, 6)),
            [
                ("a/c/0/0", 2, 0, 0, True),
                ("a/c/0/0", 3, 0, 24, True),
                ("a/c/1/0", 0, 0, 48, True),
                ("a/c/1/0", 1, 0, 72, True),
            ],
        ),
        # columns 0-2 of rows 0-1: strided in each band, read whole and placed (runs too short:
        # beside the box)
        (
            ((0, 2), (0, 3)),
            [
                ("a/c/0/0", 0, 0, ((0, 1), (0, 3)), False),
                ("a/c/0/0", 1, 0, ((1, 2), (0, 3)), False),
            ],
        ),
    ],
)
def test_box_reads_of_subchunked_shards(box: Any, expected: Any) -> None:
    layout = _pieces.ShardLayout(
        name="a",
        shard_shape=(4, 6),
        dtype=np.dtype(np.float32),
        separator="/",
        chunk_shape=(1, 6),
        shape=(8, 12),
    )
    got = _pieces.box_reads(layout, box, whole_chunks=True)
    assert got is not None
    assert [
        (p.key, p.chunk, p.offset_in_chunk, p.scatter or p.offset_in_box, p.scatter is None)
        for p in got
    ] == expected
    assert all(p.whole and p.chunks == 4 for p in got)
    # without checksums to check, a piece reads only what it keeps when that is one range
    partial = _pieces.box_reads(layout, ((0, 1), (2, 5)), whole_chunks=False)
    assert partial is not None and [(p.offset_in_chunk, p.nbytes, p.whole) for p in partial] == [
        (8, 12, False)
    ]
    # with them, a chunk reaching past the array's edge (stored padding, unchecked) is not read
    # directly
    edge = _pieces.ShardLayout(
        name="a",
        shard_shape=(4, 6),
        dtype=np.dtype(np.float32),
        separator="/",
        chunk_shape=(2, 6),
        shape=(7, 6),
    )
    assert _pieces.box_reads(edge, ((6, 7), (0, 6)), whole_chunks=True) is None


def test_loads_of_large_boxes_read_in_large_batches_exactly_and_catch_damage(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Boxes of 1 MiB and more go to more read threads in batches of several boxes, whose shard
    values lying back to back in a file are read with one preadv: still exact, and a flipped
    byte in one shard of a batch fails the load naming that array."""
    from tests.test_integrity import chunk_value, flip

    rng = np.random.default_rng(11)
    state = {
        f"w{i}": put(
            rng.standard_normal((1024, 2048), dtype=np.float32), mesh24, P("data", "model")
        )
        for i in range(4)
    }
    with mp.Context(
        saving=mp.SaveOptions(ocdbt_writers_per_host=1)
    ):  # one database: values back to back
        mp.save(tmp_path / "c", state)
    readers: list[_direct.DirectReader] = []
    real_init = _direct.DirectReader.__init__

    def init(self: _direct.DirectReader, *args: Any) -> None:
        real_init(self, *args)
        readers.append(self)

    monkeypatch.setattr(_direct.DirectReader, "__init__", init)
    before = mp.io_stats()
    assert_tree_equal(mp.load(tmp_path / "c", abstract_of(state)), state)
    got = mp.io_stats() - before
    (reader,) = readers
    assert (
        reader.batch_bytes > _direct._BATCH_BYTES[0]
        and reader._pool.max_threads > _direct._READ_THREADS
    )
    assert got.read_requests < 32, (
        f"{got.read_requests} reads for 32 shards: none were read together"
    )
    file, offset, length = chunk_value(tmp_path / "c", "w2/c/1/3")
    flip(file, offset + length // 3)
    with pytest.raises(mp.CorruptCheckpointError, match="array 'w2'"):
        mp.load(tmp_path / "c", abstract_of(state))


def test_spread_interleaves_far_apart_parts_each_front_to_back() -> None:
    """The reads are cut into ``lanes`` parts of about equal bytes, each read front to back in
    units of about ``unit`` bytes, the parts taking turns: every read exactly once, and the first
    ``lanes`` units start one part apart."""
    sizes = [3, 5, 2, 8, 1, 4, 4, 6, 2, 7, 3, 5] * 5
    units = _direct.spread(sizes, 3, 10)
    flat = [i for unit in units for i in unit]
    assert sorted(flat) == list(range(len(sizes)))
    total = sum(sizes)
    starts = np.cumsum([0, *sizes])
    part = [min(2, int(starts[i]) * 3 // total) for i in range(len(sizes))]
    for unit in units:
        assert len({part[i] for i in unit}) == 1 and unit == list(range(unit[0], unit[-1] + 1))
        assert sum(sizes[i] for i in unit) - sizes[unit[-1]] < 10  # (a unit ends once >= 10)
    for q in range(3):  # each part front to back
        mine = [i for i in flat if part[i] == q]
        assert mine == sorted(mine)
    assert [part[unit[0]] for unit in units[:6]] == [0, 1, 2, 0, 1, 2]
    # Nothing to spread: one unit, in disk order.
    assert _direct.spread(sizes, 1, 10) == [list(range(len(sizes)))]
    assert _direct.spread([4, 4], 3, 10) == [[0, 1]]


def test_large_box_loads_read_far_apart_parts_at_once(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load of large boxes hands its read threads batches from far-apart parts of the data,
    in turn (one stream per thread), not neighbouring batches of one file; under a memory budget
    that holds fewer batches, as many parts as it holds; exact either way."""
    rng = np.random.default_rng(12)
    state = {
        f"w{i}": put(
            rng.standard_normal((1024, 2048), dtype=np.float32), mesh24, P("data", "model")
        )
        for i in range(6)
    }
    with mp.Context(saving=mp.SaveOptions(ocdbt_writers_per_host=1)):
        mp.save(tmp_path / "c", state)
    batches: list[list[tuple[str, int]]] = []
    real_flush = _direct.DirectReader.flush

    def flush(self: _direct.DirectReader) -> None:
        if self._batch.boxes:
            batches.append([(v.path, v.offset) for values, *_ in self._batch.boxes for v in values])
        real_flush(self)

    monkeypatch.setattr(_direct.DirectReader, "flush", flush)
    # The reads in disk order: a load with nothing spread.
    real_spread = _direct.spread
    monkeypatch.setattr(_direct, "spread", lambda sizes, lanes, unit: [list(range(len(sizes)))])
    mp.load(tmp_path / "c", abstract_of(state))
    rank = {place: i for i, place in enumerate(place for batch in batches for place in batch)}
    assert len(rank) == 48  # every shard value once
    monkeypatch.setattr(_direct, "spread", real_spread)
    for budget, parts in ((None, 3), (16 << 20, 2)):
        batches.clear()
        with mp.Context(loading=mp.LoadOptions(memory_budget_bytes=budget)):
            assert_tree_equal(mp.load(tmp_path / "c", abstract_of(state)), state)
        assert sorted(place for batch in batches for place in batch) == sorted(rank)
        # Each batch lies in one part of the disk order, and the parts take turns.
        part = [{rank[place] * parts // len(rank) for place in batch} for batch in batches]
        assert part == [{j % parts} for j in range(len(batches))], (budget, part)


def test_value_paths_are_percent_decoded_before_the_containment_check(tmp_path: Path) -> None:
    """TensorStore's B-tree dump percent-encodes file names: the direct reader opens the file
    TensorStore would open (``d/a:b``, not ``d/a%3Ab``), and checks the decoded path."""
    value = mp.workers.format.parse_value(str(tmp_path), "value:d/:a%3Ab%25:7:9")
    assert (
        value is not None
        and value.path == os.path.join(str(tmp_path), "d/a:b%")
        and (value.offset, value.length) == (7, 9)
    )
    for crafted in (
        "value:d/:%2E%2E/%2E%2E/etc/passwd:0:1",
        "value:%2Fetc/:passwd:0:1",
        "value:d/:a%00b:0:1",
    ):
        with pytest.raises(mp.CorruptCheckpointError, match="outside the checkpoint"):
            mp.workers.format.parse_value(str(tmp_path), crafted)
