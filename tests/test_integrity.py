"""Integrity: a load never returns wrong data without an error.

Real checkpoints on disk are damaged with real byte flips, swaps, truncations and deletions (and
crafted the way an attacker could, resealing the file checksums with ``reseal``). Each load must
either raise a clear, typed error or return exactly what was saved; ``milepost.verify`` must
report the damage. Checkpoints written without checksums (Orbax, older milepost) still load.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import milepost as mp
from tests._helpers import (
    abstract_of,
    assert_tree_equal,
    listing,
    put,
    reseal,
    same_bits,
    tensorstore_writes_only,
    without_compact_shardings,
)

PYTREE_TYPESTR = "orbax.checkpoint.experimental.v1._src.handlers.pytree_handler.PyTreeHandler"
MILEPOST_ERRORS = (mp.CorruptCheckpointError, mp.CheckpointNotFoundError)

LAYOUTS = {
    "ocdbt": mp.SaveOptions(),
    "zarr3": mp.SaveOptions(use_ocdbt=False),
    "zstd": mp.SaveOptions(compression="zstd"),
    # 4 KiB shards (32 x 32 float32) cut into 1 KiB inner chunks (bands of 8 x 32)
    "subchunked": mp.SaveOptions(chunk_byte_size=1024),
}


def make_state(mesh: jax.sharding.Mesh, offset: int = 0) -> dict[str, Any]:
    """Every shard and the NumPy leaf are over 1 KiB, so they live in data files (smaller values
    are inline in the OCDBT B-tree). ``offset`` makes a decoy with other values."""
    rng = np.random.default_rng(1234)
    w = rng.standard_normal((64, 128), dtype=np.float32) + np.float32(offset)
    return {
        "w": put(w, mesh, P("data", "model")),  # 8 shards of 32 x 32 float32 (4 KiB each)
        "host": rng.integers(-(2**30), 2**30, size=2048, dtype=np.int32)
        + np.int32(offset),  # the controller's
        "step": 7 + offset,
        "lr": np.float32(0.25),
        "tag": "integrity-check",
    }


def save(path: Path, state: Any, options: mp.SaveOptions | None = None) -> Path:
    with mp.Context(saving=options or mp.SaveOptions()):
        return mp.save(path, state)


@contextmanager
def reading(direct: bool) -> Iterator[None]:
    with mp.Context(loading=mp.LoadOptions(direct_reads=direct)):
        yield


def copy_of(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def flip(path: Path, offset: int, mask: int = 0x01) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


def chunk_value(ckpt: Path, key: str) -> tuple[Path, int, int]:
    """(file, offset, length) of the stored value of ``key`` (e.g. 'w/c/1/2') in the 'state'
    checkpointable: a plain zarr3 chunk file, or the OCDBT B-tree's reference into a data file
    (found here with TensorStore's own dump, not milepost's locator)."""
    state = ckpt / "state"
    if not (state / "manifest.ocdbt").exists():
        file = state / key
        return file, 0, file.stat().st_size
    kv = ts.KvStore.open({"driver": "file", "path": f"{state}/"}).result()
    file, offset, length = ocdbt_value(kv, key)
    return state / file, offset, length


def ocdbt_value(kv: Any, key: str) -> tuple[str, int, int]:
    """(data file relative to the database's folder, offset, length) of the stored value of
    ``key`` in the OCDBT database ``kv`` (any kvstore: a folder, a bucket's prefix)."""
    manifest = ts.ocdbt.dump(kv).result()
    reference = _find_value(kv, manifest["versions"][-1]["root"]["location"], b"", key.encode())
    assert reference is not None, f"{key} is not stored in a data file of {kv.spec()}"
    head, offset, length = reference.rsplit(":", 2)
    _, base, relative = head.split(":", 2)
    return base + relative, int(offset), int(length)


def _find_value(kv: Any, location: str, prefix: bytes, key: bytes) -> str | None:
    node = ts.ocdbt.dump(kv, location).result()
    for entry in node["entries"]:
        if "location" in entry:
            found = _find_value(
                kv, entry["location"], prefix + entry.get("subtree_common_prefix", b""), key
            )
            if found is not None:
                return found
        elif prefix + entry["key"] == key:
            return entry.get("indirect_value")
    return None


def problems(report: mp.VerifyReport) -> str:
    return "\n".join(report.problems)


def assert_refused_or_exact(
    load: Callable[[], Any], want: Any, damaged: str
) -> BaseException | None:
    """The property: ``load()`` raises a clear error naming the damaged file, or returns ``want``
    exactly (same values, types and strings). Returns the error, if any."""
    try:
        got = load()
    except (ValueError, OSError) as e:
        # Damage is a CorruptCheckpointError (a ValueError) or an OSError (a file gone); a
        # plain ValueError would be a failure nobody named (TensorStore's own words).
        assert isinstance(e, mp.CorruptCheckpointError | OSError), (
            f"{type(e).__name__} is not CorruptCheckpointError: {e}"
        )
        assert damaged in str(e), f"the error does not name {damaged}: {type(e).__name__}: {e}"
        return e
    assert_tree_equal(got, want)
    return None


@pytest.fixture(scope="module")
def saved(
    tmp_path_factory: pytest.TempPathFactory, mesh24: jax.sharding.Mesh
) -> dict[str, tuple[Path, Any]]:
    """One pristine checkpoint per layout; tests damage copies."""
    root = tmp_path_factory.mktemp("pristine")
    state = make_state(mesh24)
    out = {}
    for name, options in LAYOUTS.items():
        ckpt = save(root / name, state, options)
        assert_tree_equal(mp.load(ckpt), state)
        assert mp.verify(ckpt).ok
        out[name] = (ckpt, state)
    return out


# ------------------------------------------------------------------------------------------
# 1. A byte flipped in a chunk's data
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "tensorstore"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_flipped_byte_in_a_chunk_is_caught(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path, layout: str, direct: bool
) -> None:
    base, state = saved[layout]
    ckpt = copy_of(base, tmp_path / "c")
    file, offset, length = chunk_value(ckpt, "w/c/1/2")
    flip(
        file, offset + length // 2
    )  # the middle of the shard's encoded values (its index is at the end)
    for budget in (128 << 20, 1):  # many reads in flight, or one at a time
        with mp.Context(loading=mp.LoadOptions(direct_reads=direct, memory_budget_bytes=budget)):
            with pytest.raises(mp.CorruptCheckpointError) as info:
                mp.load(ckpt, abstract_of(state))
        message = str(info.value)
        assert "array 'w'" in message and "chunk" in message, message
        assert str(ckpt / "state") in message, message
        if direct and layout in (
            "ocdbt",
            "zarr3",
        ):  # read straight from the file: named with the offset
            assert f"{file} at byte {offset}" in message, message
        elif (
            layout != "subchunked"
        ):  # (subchunked: see test_subchunked_damage_names_the_damaged_shard)
            assert "'w/c/1/2'" in message, message
    with reading(direct):  # the rest of the checkpoint is still readable, exactly
        rest = mp.load(ckpt, {"host": np.zeros(2048, np.int32), "step": 0, "tag": ""}, partial=True)
    assert_tree_equal(rest, {"host": state["host"], "step": 7, "tag": "integrity-check"})
    report = mp.verify(ckpt)
    assert not report.ok
    assert "'w'" in problems(report) and "chunk" in problems(report), report
    assert "'host'" not in problems(report), report


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "tensorstore"])
def test_the_damage_found_is_data_on_the_error(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path, direct: bool
) -> None:
    """A caller (or milepost itself) decides on the error's fields, never on its words: the
    array, the chunk and where it was read are attributes, and survive pickling (the trip from
    a host to the controller)."""
    import pickle

    base, state = saved["ocdbt"]
    ckpt = copy_of(base, tmp_path / "c")
    file, offset, length = chunk_value(ckpt, "w/c/1/2")
    flip(file, offset + length // 2)
    with reading(direct), pytest.raises(mp.CorruptCheckpointError) as info:
        mp.load(ckpt, abstract_of(state))
    for error in (info.value, pickle.loads(pickle.dumps(info.value))):
        assert error.array == "w" and error.chunk is not None and len(error.chunk) == 2
        assert error.path is not None and str(ckpt / "state") in error.path
    with pytest.raises(mp.UnsupportedLeafError) as bad:
        mp.save(tmp_path / "d", {"params": {"names": np.array(["a", "b"])}})
    assert bad.value.leaf == "params.names"


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "tensorstore"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_flipped_byte_in_a_shard_index_is_caught(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path, layout: str, direct: bool
) -> None:
    """The last 16 bytes per chunk plus a CRC32C of a stored shard are its index."""
    base, state = saved[layout]
    for k, back in enumerate((1, 4, 10)):  # the index's CRC32C, the last entry's length, its offset
        ckpt = copy_of(base, tmp_path / f"c{k}")
        file, offset, length = chunk_value(ckpt, "w/c/0/3")
        flip(file, offset + length - back)
        with reading(direct), pytest.raises(mp.CorruptCheckpointError, match="array 'w'"):
            mp.load(ckpt, abstract_of(state))
        assert not mp.verify(ckpt).ok


def test_deleted_chunk_is_not_zeros_even_if_the_metadata_says_fill_values(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    """Metadata claiming missing chunks are fill values (as older writers' did) does not turn a
    lost chunk into zeros when its checksum was recorded."""
    base, state = saved["zarr3"]
    ckpt = copy_of(base, tmp_path / "c")
    tree_file = ckpt / "state" / "_METADATA"
    tree = json.loads(tree_file.read_text())
    tree["store_array_data_equal_to_fill_value"] = False
    tree_file.write_text(json.dumps(tree))
    (ckpt / "state" / "w" / "c" / "1" / "2").unlink()
    reseal(ckpt)
    for direct in (True, False):
        with (
            reading(direct),
            pytest.raises(mp.CorruptCheckpointError, match=r"array 'w': chunk \(1, 2\)"),
        ):
            mp.load(ckpt, abstract_of(state))
    assert not mp.verify(ckpt).ok


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "tensorstore"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_flipped_byte_in_a_numpy_leaf_is_caught(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path, layout: str, direct: bool
) -> None:
    """The controller reads the leaves it holds (NumPy arrays) itself: checked the same way."""
    base, state = saved[layout]
    ckpt = copy_of(base, tmp_path / "c")
    file, offset, length = chunk_value(ckpt, "host/c/0")
    flip(file, offset + length // 3)
    with reading(direct):
        with pytest.raises(mp.CorruptCheckpointError) as info:
            mp.load(ckpt)
        assert "array 'host'" in str(info.value) and "chunk" in str(info.value), info.value
        with pytest.raises(mp.CorruptCheckpointError, match="array 'host'"):
            mp.load(ckpt, abstract_of(state))
    report = mp.verify(ckpt)
    assert not report.ok and "'host'" in problems(report), report


RESHARDINGS = {
    # 8 rows x 128 columns per device: each box holds a quarter of four saved chunks
    "rows": ((8, 1), P("a", None)),
    # 64 rows x 16 columns: half of two saved chunks, strided
    "columns": ((1, 8), P(None, "b")),
    # every device reads everything
    "replicated": ((8, 1), P()),
}


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "tensorstore"])
@pytest.mark.parametrize("resharding", list(RESHARDINGS))
@pytest.mark.parametrize("layout", ["ocdbt", "zarr3", "subchunked"])
def test_flipped_byte_is_caught_on_a_resharded_load(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path, layout: str, resharding: str, direct: bool
) -> None:
    """A box that covers chunks only partly: the chunks are read whole and checked first."""
    base, state = saved[layout]
    mesh_shape, spec = RESHARDINGS[resharding]
    sharding = NamedSharding(jax.make_mesh(mesh_shape, ("a", "b")), spec)
    abstract = {
        **abstract_of(state),
        "w": jax.ShapeDtypeStruct((64, 128), np.float32, sharding=sharding),
    }
    want = {**state, "w": jax.device_put(np.asarray(state["w"]), sharding)}
    with reading(direct):
        assert_tree_equal(
            mp.load(base, abstract), want
        )  # the undamaged checkpoint reshards exactly
    ckpt = copy_of(base, tmp_path / "c")
    file, offset, _ = chunk_value(ckpt, "w/c/0/1")
    flip(file, offset + 5, 0x40)  # an exponent bit of the chunk's second float
    with reading(direct), pytest.raises(mp.CorruptCheckpointError) as info:
        mp.load(ckpt, abstract)
    assert "array 'w'" in str(info.value) and "chunk" in str(info.value), info.value
    report = mp.verify(ckpt)
    assert not report.ok and "'w'" in problems(report), report


def test_a_cast_does_not_hide_damage(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    """The checksum is of the stored values: checked before the cast to the abstract dtype."""
    base, state = saved["ocdbt"]
    ckpt = copy_of(base, tmp_path / "c")
    file, offset, _ = chunk_value(ckpt, "w/c/0/0")
    flip(file, offset)  # the lowest mantissa bit of w[0, 0]: invisible after a cast to bfloat16
    abstract = {
        **abstract_of(state),
        "w": jax.ShapeDtypeStruct((64, 128), jax.numpy.bfloat16, sharding=state["w"].sharding),
    }
    for direct in (True, False):
        with reading(direct), pytest.raises(mp.CorruptCheckpointError, match="array 'w'"):
            mp.load(ckpt, abstract)


def test_zstd_frame_damage_names_the_array_and_the_chunk(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    """Damage that the decompressor itself rejects (the frame header) fails in TensorStore, before
    any checksum: the error still names the array and the stored chunk's key."""
    base, state = saved["zstd"]
    ckpt = copy_of(base, tmp_path / "c")
    file, offset, _ = chunk_value(ckpt, "w/c/1/2")
    flip(file, offset)  # the zstd magic number
    for direct in (True, False):
        with reading(direct), pytest.raises(mp.CorruptCheckpointError) as info:
            mp.load(ckpt, abstract_of(state))
        assert "array 'w'" in str(info.value) and "w/c/1/2" in str(info.value), info.value
    assert not mp.verify(ckpt).ok


def test_subchunked_damage_names_the_damaged_shard(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    base, state = saved["subchunked"]
    ckpt = copy_of(base, tmp_path / "c")
    file, offset, _ = chunk_value(ckpt, "w/c/1/2")
    flip(file, offset + 10)  # the first inner chunk (8 x 32) of shard (1, 2): inner chunk (4, 2)
    with pytest.raises(mp.CorruptCheckpointError) as info:
        mp.load(ckpt, abstract_of(state))
    assert "chunk (4, 2)" in str(info.value)  # the inner chunk, right
    assert "'w/c/1/2'" in str(info.value), info.value  # the stored key (the shard) that is damaged


# ------------------------------------------------------------------------------------------
# 2. Data in the wrong place: swapped files
# ------------------------------------------------------------------------------------------


def twins(mesh: jax.sharding.Mesh) -> dict[str, Any]:
    """Two arrays of the same shape and sharding with different values."""
    rng = np.random.default_rng(99)
    return {
        "x": put(rng.standard_normal((64, 128), dtype=np.float32), mesh, P("data", "model")),
        "y": put(rng.standard_normal((64, 128), dtype=np.float32), mesh, P("data", "model")),
    }


def single_device_twins() -> dict[str, Any]:
    """Two 8 KiB arrays on one device each: one chunk each, so with two writers each array's
    database has one data file holding its one value at offset 0."""
    rng = np.random.default_rng(98)
    devices = jax.devices()
    return {
        "x": jax.device_put(rng.standard_normal((16, 128), dtype=np.float32), devices[0]),
        "y": jax.device_put(rng.standard_normal((16, 128), dtype=np.float32), devices[1]),
    }


def swap(a: Path, b: Path) -> None:
    tmp = a.with_name(a.name + ".swap")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "tensorstore"])
def test_swapped_ocdbt_data_files_are_refused(tmp_path: Path, direct: bool) -> None:
    state = single_device_twins()
    with tensorstore_writes_only():  # (x and y in two writer databases)
        ckpt = save(tmp_path / "c", state, mp.SaveOptions(ocdbt_writers_per_host=2))
    fx, x_offset, x_length = chunk_value(ckpt, "x/c/0/0")
    fy, y_offset, y_length = chunk_value(ckpt, "y/c/0/0")
    assert fx.parent.parent != fy.parent.parent, "x and y should be in different writer databases"
    assert (
        (x_offset, x_length) == (y_offset, y_length) == (0, 16 * 128 * 4 + 20)
    )  # values, index, CRC
    # After the value, each data file holds its writer's own B-tree node (compressed, not used by
    # the merged root view, a byte or two longer or shorter as its keys compress). Pad the shorter
    # one past its end, where nothing points, so that the swap exchanges two files of the same
    # size and every reference stays in range.
    size = max(fx.stat().st_size, fy.stat().st_size)
    for f in (fx, fy):
        f.write_bytes(f.read_bytes().ljust(size, b"\0"))
    assert_tree_equal(mp.load(ckpt, abstract_of(state)), state)  # the padding is harmless
    swap(fx, fy)
    with reading(direct), pytest.raises(mp.CorruptCheckpointError) as info:
        mp.load(ckpt, abstract_of(state))
    assert "chunk" in str(info.value) and (
        "array 'x'" in str(info.value) or "array 'y'" in str(info.value)
    )
    for name in ("x", "y"):  # each alone is refused too, never returned with the other's values
        with reading(direct), pytest.raises(mp.CorruptCheckpointError, match=f"array '{name}'"):
            mp.load(ckpt, {name: abstract_of(state)[name]}, partial=True)
    report = mp.verify(ckpt)
    assert not report.ok and "'x'" in problems(report) and "'y'" in problems(report), report


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "tensorstore"])
@pytest.mark.parametrize(
    ("a", "b"),
    [("x/c/0/0", "y/c/0/0"), ("x/c/0/0", "x/c/0/1"), ("x/c/0/0", "x/c/1/0")],
    ids=["x-y", "x-row", "x-col"],
)
def test_swapped_zarr3_chunk_files_are_refused(
    tmp_path: Path, mesh24: jax.sharding.Mesh, direct: bool, a: str, b: str
) -> None:
    """Between arrays, and within one array (right array, wrong place)."""
    state = twins(mesh24)
    ckpt = save(tmp_path / "c", state, mp.SaveOptions(use_ocdbt=False))
    fa, fb = ckpt / "state" / a, ckpt / "state" / b
    assert fa.stat().st_size == fb.stat().st_size
    swap(fa, fb)
    with reading(direct), pytest.raises(mp.CorruptCheckpointError) as info:
        mp.load(ckpt, abstract_of(state))
    message = str(info.value)
    assert "chunk" in message and (f"array '{a[0]}'" in message or f"array '{b[0]}'" in message), (
        message
    )
    assert not mp.verify(ckpt).ok


# ------------------------------------------------------------------------------------------
# 3. A byte flipped in a small (metadata) file
# ------------------------------------------------------------------------------------------

# (layout, file, a string inside one of its JSON string values, or None for binary files)
SMALL_FILES = [
    ("ocdbt", "_CHECKPOINT_METADATA", "PyTreeHandler"),
    ("ocdbt", "state/_METADATA", "jax.Array"),
    ("ocdbt", "state/_sharding", "model"),
    ("ocdbt", "state/_strings.json", "integrity-check"),
    ("ocdbt", "state/_milepost.json", "np.float32"),
    ("ocdbt", "state/manifest.ocdbt", None),
    ("ocdbt", "state/ocdbt.process_0/manifest.ocdbt", None),
    ("ocdbt", "state/array_metadatas/process_0", '"w"'),  # a param_name
    ("ocdbt", "_milepost_checksums.json", '"crc32c"'),  # the algorithm
    ("zarr3", "state/w/zarr.json", "float32"),
    ("zarr3", "state/_METADATA", "np.ndarray"),
]

# Files a load never reads: a flip there cannot change what it returns (verify still reports it).
NOT_READ_BY_LOAD = {
    # Orbax's per-process record; milepost reads the headers instead
    "state/array_metadatas/process_0",
    # a writer's database: loads go through the merged root view
    "state/ocdbt.process_0/manifest.ocdbt",
    # Orbax's record of the shardings; milepost reads its compact form in _milepost.json
    "state/_sharding",
}


def flip_positions(data: bytes, needle: str | None) -> list[int]:
    """The start, the middle, the end, and (JSON) the middle of a string value (``needle``)."""
    positions = [0, len(data) // 2, len(data) - 1]
    if needle is not None:
        at = data.find(needle.encode())
        assert at >= 0, f"{needle!r} not found"
        positions.append(
            at + len(needle) // 2
        )  # a letter: mask 0x20 flips its case, the JSON stays valid
    return positions


@pytest.mark.parametrize(
    ("layout", "file", "needle"), SMALL_FILES, ids=[f"{lay}:{f}" for lay, f, _ in SMALL_FILES]
)
def test_flipped_metadata_byte_never_gives_wrong_data(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path, layout: str, file: str, needle: str | None
) -> None:
    base, state = saved[layout]
    meta = mp.metadata(base)
    pristine = (base / file).read_bytes()
    name = Path(file).name
    cases = [(pos, mask) for pos in flip_positions(pristine, needle) for mask in (0x01, 0x20, 0x80)]
    for k, (pos, mask) in enumerate(cases):
        ckpt = copy_of(base, tmp_path / f"c{k}")
        flip(ckpt / file, pos, mask)
        where = f"{file} byte {pos} ^ {mask:#04x}"
        for direct in (True, False):
            with reading(direct):
                error = assert_refused_or_exact(lambda c=ckpt: mp.load(c), state, name)
                if file not in NOT_READ_BY_LOAD:
                    assert error is not None, f"{where}: the load did not notice"
                assert_refused_or_exact(lambda c=ckpt: mp.load(c, abstract_of(state)), state, name)
        try:
            got = mp.metadata(ckpt)
        except (ValueError, FileNotFoundError, OSError) as e:
            assert name in str(e), f"{where}: {type(e).__name__}: {e}"
        else:
            assert got.tree == meta.tree, where
            assert (got.item_handlers, got.custom_metadata, got.metrics) == (
                meta.item_handlers,
                meta.custom_metadata,
                meta.metrics,
            ), where
            assert (got.init_timestamp_nsecs, got.commit_timestamp_nsecs) == (
                meta.init_timestamp_nsecs,
                meta.commit_timestamp_nsecs,
            ), where
        report = mp.verify(ckpt)
        assert not report.ok, f"{where}: verify found nothing"
        assert name in problems(report), f"{where}: {report}"
        shutil.rmtree(ckpt)


JSON_READ_BY_LOAD = [
    c for c in SMALL_FILES if c[1] not in NOT_READ_BY_LOAD and not c[1].endswith(".ocdbt")
]


@pytest.mark.parametrize(
    ("layout", "file", "needle"),
    JSON_READ_BY_LOAD,
    ids=[f"{lay}:{f}" for lay, f, _ in JSON_READ_BY_LOAD],
)
def test_flipped_json_metadata_is_a_corrupt_checkpoint_error(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path, layout: str, file: str, needle: str | None
) -> None:
    """The JSON files are checked against their recorded checksums: the typed error names them."""
    base, _ = saved[layout]
    pristine = (base / file).read_bytes()
    for k, pos in enumerate(flip_positions(pristine, needle)):
        ckpt = copy_of(base, tmp_path / f"c{k}")
        flip(ckpt / file, pos, 0x20)
        with pytest.raises(mp.CorruptCheckpointError) as info:
            mp.load(ckpt)
        assert str(ckpt / file) in str(info.value), info.value
        if file != "state/_strings.json":  # metadata() does not read string values
            with pytest.raises(mp.CorruptCheckpointError, match=Path(file).name):
                mp.metadata(ckpt)


def test_flipped_orbax_sharding_is_a_corrupt_checkpoint_error_where_it_is_read(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    """Without milepost's compact form (Orbax's checkpoints, older milepost ones) ``_sharding`` is
    what the shardings are read from: a flip there is the typed error naming it."""
    base, _ = saved["ocdbt"]
    file = "state/_sharding"
    for k, pos in enumerate(flip_positions((base / file).read_bytes(), "model")):
        ckpt = without_compact_shardings(copy_of(base, tmp_path / f"c{k}"))
        flip(ckpt / file, pos, 0x20)
        for call in (mp.load, mp.metadata):
            with pytest.raises(mp.CorruptCheckpointError) as info:
                call(ckpt)
            assert str(ckpt / file) in str(info.value), info.value


@pytest.mark.parametrize("at", ["zstd-frame", "third", "middle", "end"])
@pytest.mark.parametrize("what", ["manifest", "btree-node"])
def test_damaged_ocdbt_root_is_a_corrupt_checkpoint_error(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path, what: str, at: str
) -> None:
    """Some of these TensorStore reports with a status (DATA_LOSS), some with none (a damaged
    zstd frame: "Error decoding manifest: ZSTD_decompressStream() failed"): the same error."""
    base, _ = saved["ocdbt"]
    ckpt = copy_of(base, tmp_path / "c")
    if what == "manifest":
        file = ckpt / "state" / "manifest.ocdbt"
    else:  # the merged root view's B-tree node (the writers' data files are elsewhere)
        (file,) = (ckpt / "state" / "d").iterdir()
    size = file.stat().st_size
    flip(file, {"zstd-frame": 14, "third": size // 3, "middle": size // 2, "end": size - 5}[at])
    errors = []
    for call in (mp.load, mp.metadata):
        with pytest.raises(ValueError) as info:
            call(ckpt)
        assert str(file) in str(info.value)  # TensorStore's message does name the file
        errors.append(info.value)
    assert not mp.verify(ckpt).ok
    assert all(isinstance(e, mp.CorruptCheckpointError) for e in errors), [
        f"{type(e).__name__}: {e}" for e in errors
    ]


def test_whitespace_in_the_checksums_file_is_damage(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    """The checksums file is written in canonical JSON (sorted keys, no spaces), so even a
    change that leaves what it says intact (a space added) is reported as damage."""
    base, _ = saved["ocdbt"]
    ckpt = copy_of(base, tmp_path / "c")
    file = ckpt / "_milepost_checksums.json"
    file.write_bytes(file.read_bytes().replace(b'{"', b'{ "', 1))
    assert json.loads(file.read_bytes()) == json.loads(
        (base / file.name).read_bytes()
    )  # same content
    with pytest.raises(mp.CorruptCheckpointError, match="_milepost_checksums.json"):
        mp.load(ckpt)
    assert not mp.verify(ckpt).ok


# ------------------------------------------------------------------------------------------
# 4. Truncated and deleted data
# ------------------------------------------------------------------------------------------


def truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


DATA_DAMAGE = ["cut-in-chunk", "cut-to-zero", "deleted"]


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "tensorstore"])
@pytest.mark.parametrize("damage", DATA_DAMAGE)
@pytest.mark.parametrize("key", ["w/c/1/2", "host/c/0"])
@pytest.mark.parametrize("layout", ["ocdbt", "zarr3", "zstd", "subchunked"])
def test_truncated_or_deleted_data_is_an_error_not_zeros(
    saved: dict[str, tuple[Path, Any]],
    tmp_path: Path,
    layout: str,
    key: str,
    damage: str,
    direct: bool,
) -> None:
    base, state = saved[layout]
    ckpt = copy_of(base, tmp_path / "c")
    file, offset, length = chunk_value(ckpt, key)
    if damage == "cut-in-chunk":
        truncate(file, offset + length // 2)
    elif damage == "cut-to-zero":
        truncate(file, 0)
    else:
        file.unlink()
    name = key.split("/")[0]
    with reading(direct), pytest.raises(mp.CorruptCheckpointError) as info:
        mp.load(ckpt, abstract_of(state))
    assert f"array '{name}'" in str(info.value), info.value
    report = mp.verify(ckpt)
    assert not report.ok and f"'{name}'" in problems(report), report


# ------------------------------------------------------------------------------------------
# 5. Checkpoints written without checksums
# ------------------------------------------------------------------------------------------


def strip_checksums(ckpt: Path) -> None:
    """What an older milepost wrote: no file checksums, no chunk checksums (neither recorded
    in ``_milepost.json`` nor said to be in the writers' tables, which are then never read)."""
    (ckpt / "_milepost_checksums.json").unlink()
    info_file = ckpt / "state" / "_milepost.json"
    info = json.loads(info_file.read_text())
    assert "chunk_crc32c" in info or "chunk_crc32c_tables" in info
    info.pop("chunk_crc32c", None)
    if info.pop("chunk_crc32c_tables", None) is not None:  # (and the tables themselves)
        from milepost import workers

        root = ts.KvStore.open(workers.format.ocdbt_kvstore(str(ckpt / "state"))).result()
        prefix = workers.format.CHUNK_TABLE_PREFIX
        root.delete_range(ts.KvStore.KeyRange(prefix, prefix[:-1] + "0")).result()
    info_file.write_text(json.dumps(info))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_checkpoints_without_checksums_still_load(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path, layout: str
) -> None:
    base, state = saved[layout]
    ckpt = copy_of(base, tmp_path / "c")
    strip_checksums(ckpt)
    for direct in (True, False):
        with reading(direct):
            assert_tree_equal(mp.load(ckpt), state)
            assert_tree_equal(mp.load(ckpt, abstract_of(state)), state)
    assert mp.metadata(ckpt).tree == mp.metadata(base).tree
    report = mp.verify(ckpt)
    assert report.ok, report
    notes = "\n".join(report.notes)
    assert "_milepost_checksums.json" in notes and "no recorded chunk checksums" in notes, report
    assert report.chunks_checked > 0


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore:Sharding info not provided when restoring")
def test_orbax_written_checkpoints_load_exactly(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    ocp = pytest.importorskip("orbax.checkpoint.experimental.v1")
    state = {k: v for k, v in make_state(mesh24).items() if k != "lr"}  # Orbax has no NumPy scalars
    ocp.save_pytree(tmp_path / "orbax", state)
    assert not (tmp_path / "orbax" / "_milepost_checksums.json").exists()
    for direct in (True, False):
        with reading(direct):
            assert_tree_equal(mp.load(tmp_path / "orbax", abstract_of(state)), state)
    report = mp.verify(tmp_path / "orbax")
    assert report.ok, report
    assert any("checksums" in n for n in report.notes) and any(
        "no recorded chunk checksums" in n for n in report.notes
    ), report


# ------------------------------------------------------------------------------------------
# 6. Hostile checkpoints (resealed, so the file checksums match)
# ------------------------------------------------------------------------------------------


@pytest.fixture
def decoy(tmp_path: Path, mesh24: jax.sharding.Mesh) -> tuple[Path, Any]:
    """A valid checkpoint with other values, whose folders get planted outside the target."""
    state = make_state(mesh24, offset=1000)
    ckpt = save(tmp_path / "decoy", state)
    assert_tree_equal(mp.load(ckpt), state)
    return ckpt, state


@pytest.mark.parametrize("key", ["../outside", "/abs/path", "ABSOLUTE", "a/b", "", ".", "_hidden"])
def test_hostile_checkpointable_names(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path, decoy: tuple[Path, Any], key: str
) -> None:
    base, _ = saved["ocdbt"]
    ckpt = copy_of(base, tmp_path / "ck" / "ckpt")
    if key == "ABSOLUTE":  # an absolute path where a valid decoy really is
        key = str(tmp_path / "planted")
    target = (ckpt / key).resolve()
    if target.is_relative_to(tmp_path) and not target.exists():  # (never '/abs/path' itself)
        copy_of(decoy[0] / "state", target)  # the decoy's state folder where the name leads
    meta_file = ckpt / "_CHECKPOINT_METADATA"
    meta = json.loads(meta_file.read_text())
    meta["item_handlers"] = {key: PYTREE_TYPESTR}  # the only pytree: it would be the default one
    meta_file.write_text(json.dumps(meta))
    reseal(ckpt)
    calls = {
        "load": lambda: mp.load(ckpt),
        "load_checkpointables": lambda: mp.load_checkpointables(ckpt),
        "load_checkpointables(key)": lambda: mp.load_checkpointables(ckpt, {key: None}),
        "metadata": lambda: mp.metadata(ckpt),
    }
    for what, call in calls.items():
        with pytest.raises(mp.CorruptCheckpointError) as info:
            call()  # never the decoy's values
        message = str(info.value)
        assert "_CHECKPOINT_METADATA" in message and repr(key) in message, f"{what}: {message}"
    report = mp.verify(ckpt)
    assert not report.ok and repr(key) in problems(report), report


@pytest.mark.parametrize("layout", ["zarr3", "ocdbt"])
@pytest.mark.parametrize("key", ["../x", "..", "a/../../x", "/tmp/x", "x\\..\\y"])
def test_hostile_tree_keys(
    tmp_path: Path, mesh24: jax.sharding.Mesh, layout: str, key: str
) -> None:
    """A leaf key that would be a path outside the checkpointable (plain zarr3 stores each array
    in a folder named after it): refused before any path is built, even with a valid-looking
    decoy array (and its checksums) where the name leads."""
    state = make_state(mesh24)
    other = make_state(mesh24, offset=1000)
    options = LAYOUTS[layout]
    ckpt = save(tmp_path / "ck" / "ckpt", state, options)
    decoy = save(tmp_path / "decoy", other, options)
    if layout == "zarr3" and key == "../x":
        copy_of(
            decoy / "state" / "host", ckpt / "x"
        )  # state/../x: a valid zarr3 array of other values
    tree_file = ckpt / "state" / "_METADATA"
    tree = json.loads(tree_file.read_text())
    entry = tree["tree_metadata"].pop("('host',)")
    entry["key_metadata"][0]["key"] = key
    tree["tree_metadata"][str((key,))] = entry
    tree_file.write_text(json.dumps(tree))
    info_file = ckpt / "state" / "_milepost.json"
    info = json.loads(info_file.read_text())
    decoy_info = json.loads((decoy / "state" / "_milepost.json").read_text())
    if "host" in decoy_info.get("chunk_crc32c", {}):  # (OCDBT: in the writers' tables)
        info["chunk_crc32c"][key] = decoy_info["chunk_crc32c"]["host"]  # the decoy's own
    info_file.write_text(json.dumps(info))
    reseal(ckpt)
    for call in (
        lambda: mp.load(ckpt),
        lambda: mp.metadata(ckpt),
        lambda: mp.load(ckpt, {"w": mp.PLACEHOLDER}, partial=True),
    ):
        with pytest.raises(mp.CorruptCheckpointError) as caught:
            call()
        assert "_METADATA" in str(caught.value) and repr(key) in str(caught.value), caught.value
    report = mp.verify(ckpt)
    assert not report.ok and repr(key) in problems(report), report


NOT_UTF8 = b"\xff\xfe{\x00}\x00"


@pytest.mark.parametrize(
    ("layout", "file"),
    [
        ("ocdbt", "_CHECKPOINT_METADATA"),
        ("ocdbt", "state/_METADATA"),
        ("ocdbt", "state/_sharding"),
        ("ocdbt", "state/_strings.json"),
        ("ocdbt", "state/_milepost.json"),
        ("zarr3", "state/w/zarr.json"),
    ],
)
def test_metadata_that_is_not_utf8(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path, layout: str, file: str
) -> None:
    base, _ = saved[layout]
    ckpt = copy_of(base, tmp_path / "c")
    if file.endswith("_sharding"):  # read only without the compact form
        without_compact_shardings(ckpt)
    (ckpt / file).write_bytes(NOT_UTF8 + (ckpt / file).read_bytes())
    reseal(ckpt)
    calls = [mp.load] if file.endswith("_strings.json") else [mp.load, mp.metadata]
    for call in calls:
        with pytest.raises(mp.CorruptCheckpointError, match="UTF-8") as info:
            call(ckpt)
        assert str(ckpt / file) in str(info.value), info.value
    report = mp.verify(ckpt)
    assert not report.ok and Path(file).name in problems(report), report


def test_checksums_file_that_is_not_utf8(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    base, _ = saved["ocdbt"]
    ckpt = copy_of(base, tmp_path / "c")
    file = ckpt / "_milepost_checksums.json"
    file.write_bytes(NOT_UTF8 + file.read_bytes())
    for call in (mp.load, mp.metadata):
        with pytest.raises(mp.CorruptCheckpointError, match="_milepost_checksums.json"):
            call(ckpt)
    assert not mp.verify(ckpt).ok


def test_symlinked_checkpointable_is_not_followed_outside(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path, decoy: tuple[Path, Any]
) -> None:
    base, _ = saved["ocdbt"]
    ckpt = copy_of(base, tmp_path / "ck" / "ckpt")
    shutil.rmtree(ckpt / "state")
    (ckpt / "state").symlink_to(decoy[0] / "state", target_is_directory=True)
    reseal(ckpt)
    report = mp.verify(ckpt)
    try:
        got = mp.load(ckpt)
    except MILEPOST_ERRORS:
        loaded_decoy = False
    else:
        loaded_decoy = same_bits(got["host"], decoy[1]["host"])
    assert not loaded_decoy, (
        "the load returned the values of a checkpoint outside the one asked for"
    )
    assert not report.ok, report


@pytest.mark.timeout(120)
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "tensorstore"])
def test_a_fifo_in_place_of_a_data_file_is_refused_not_waited_on(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path, direct: bool
) -> None:
    """Opening a FIFO blocks until a writer comes: a load, metadata or verify that opened one
    would hang forever. It is refused by name before anything is read."""
    base, state = saved["ocdbt"]
    ckpt = copy_of(base, tmp_path / "c")
    file, _, _ = chunk_value(ckpt, "w/c/1/2")
    file.unlink()
    os.mkfifo(file)
    with (
        reading(direct),
        pytest.raises(mp.CorruptCheckpointError, match="not a regular file") as info,
    ):
        mp.load(ckpt, abstract_of(state))
    assert str(file) in str(info.value)
    report = mp.verify(ckpt)
    assert not report.ok and file.name in problems(report), report


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "file",
    ["_CHECKPOINT_METADATA", "commit_success.txt", "state/_milepost.json", "state/manifest.ocdbt"],
)
def test_a_fifo_in_place_of_a_metadata_file_is_refused_not_waited_on(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path, file: str
) -> None:
    base, _ = saved["ocdbt"]
    ckpt = copy_of(base, tmp_path / "c")
    (ckpt / file).unlink()
    os.mkfifo(ckpt / file)
    for call in (mp.load, mp.metadata):
        with pytest.raises((mp.CorruptCheckpointError, mp.CheckpointNotFoundError)):
            call(ckpt)
    try:
        report = mp.verify(ckpt)
    except mp.CheckpointNotFoundError:
        pass  # no commit marker: not a checkpoint at all
    else:
        assert not report.ok and "not a regular file" in problems(report), report


def test_the_direct_reader_opens_regular_files_only(tmp_path: Path) -> None:
    """Also when one became a FIFO after the checkpoint's walk: the open does not block."""
    from milepost.workers.load import _direct

    fifo = tmp_path / "d" / "data"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    reader = _direct.DirectReader()
    try:
        with pytest.raises(mp.CorruptCheckpointError, match="not a regular file"):
            reader._fd(str(fifo))
        assert not reader._fds
    finally:
        reader.close()


def test_a_different_ocdbt_file_of_the_same_size_fails_the_file_checksums(tmp_path: Path) -> None:
    """OCDBT files end with their own CRC32C, so the CRC32C of any whole such file is one
    constant: the file checksums carry a second digest (CRC-32) that tells them apart. The
    other manifest is this one with a byte changed and its trailing CRC32C redone (what another
    commit of the same size, or damage that rewrote the checksum, looks like): always the same
    size, unlike a second save's manifest (compressed, its size varies)."""
    from milepost.workers import format as _format

    a = save(tmp_path / "a", {"w": np.arange(4096, dtype=np.float32)})
    key = "state/manifest.ocdbt"
    mine = (a / key).read_bytes()
    assert int.from_bytes(mine[-4:], "little") == mp.workers.format.crc32c(mine[:-4]), (
        "an OCDBT file ends with the CRC32C of what precedes it"
    )
    body = bytearray(mine[:-4])
    body[len(body) // 2] ^= 0x01
    other = bytes(body) + mp.workers.format.crc32c(bytes(body)).to_bytes(4, "little")
    assert len(mine) == len(other) and mine != other
    assert mp.workers.format.crc32c(mine) == mp.workers.format.crc32c(other) == 0x48674BC7
    sums = _format.Checksums.read(a)
    assert sums is not None and sums.matches(key, mine) and not sums.matches(key, other)
    (a / key).write_bytes(other)
    report = mp.verify(a)
    assert not report.ok and f"{a / key} is damaged or changed" in problems(report), report


def test_checksums_written_before_the_second_digest_still_check(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    """A checkpoint of an earlier milepost has CRC32C only: it loads and verifies as before."""
    from milepost.workers import format as _format

    base, state = saved["ocdbt"]
    ckpt = copy_of(base, tmp_path / "c")
    sums = _format.Checksums.read(ckpt)
    assert sums is not None and sums.crc32 is not None
    (ckpt / _format.CHECKSUMS).unlink()
    _format.Checksums(ckpt, sums.files).write()
    assert "files_crc32" not in json.loads((ckpt / _format.CHECKSUMS).read_text())
    assert_tree_equal(mp.load(ckpt), state)
    assert mp.verify(ckpt).ok


# ------------------------------------------------------------------------------------------
# Files the checksums know about but a load does not check
# ------------------------------------------------------------------------------------------


def test_deleted_milepost_info_is_noticed(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    base, state = saved["ocdbt"]
    ckpt = copy_of(base, tmp_path / "c")
    (ckpt / "state" / "_milepost.json").unlink()
    assert not mp.verify(ckpt).ok  # verify sees it
    assert_refused_or_exact(lambda: mp.load(ckpt), state, "_milepost.json")


def test_deleted_milepost_info_does_not_disable_chunk_checks(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``_milepost.json`` holds the chunk checksums, so deleting it must not let a damaged chunk
    load unchecked: the file checksums list it, so the load refuses, naming it, before any host
    reads a chunk. Put back, the same damage is caught by the chunk checks, naming the chunk
    (the flipped byte is in data they read)."""
    base, state = saved["ocdbt"]
    ckpt = copy_of(base, tmp_path / "c")
    info = ckpt / "state" / "_milepost.json"
    info.unlink()
    file, offset, length = chunk_value(ckpt, "host/c/0")
    flip(file, offset + length // 3)
    reads: list[Any] = []
    real_load = mp.workers.load

    def load(plan: Any, *args: Any, **kwargs: Any) -> Any:
        reads.append(plan)
        return real_load(plan, *args, **kwargs)

    monkeypatch.setattr(mp.workers, "load", load)
    with pytest.raises(mp.CheckpointNotFoundError) as missing:
        mp.load(ckpt, abstract_of(state))
    assert f"milepost info {info} was committed" in str(missing.value), missing.value
    assert "but is missing now" in str(missing.value), missing.value
    assert reads == [], "chunks were read although the chunk checksums are gone"

    shutil.copyfile(base / "state" / "_milepost.json", info)
    with pytest.raises(mp.CorruptCheckpointError) as damaged:
        mp.load(ckpt, abstract_of(state))
    error = damaged.value
    assert reads, "the chunks were read"
    assert error.array == "host" and error.chunk == (0,), error
    assert error.path is not None and str(ckpt / "state") in error.path, error
    assert "array 'host'" in str(error) and "chunk" in str(error), error


@pytest.mark.parametrize(
    "file", ["state/_METADATA", "state/_strings.json", "state/_sharding", "state/manifest.ocdbt"]
)
def test_deleted_metadata_files_are_errors(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path, file: str
) -> None:
    base, _ = saved["ocdbt"]
    ckpt = copy_of(base, tmp_path / "c")
    if file.endswith("_sharding"):
        # with the compact form it is not read (test_orbax_sharding_may_be_missing); without
        # it, it is what the shardings come from
        without_compact_shardings(ckpt)
    (ckpt / file).unlink()
    with pytest.raises(
        (mp.CorruptCheckpointError, mp.CheckpointNotFoundError, mp.StructureMismatchError)
    ):
        mp.load(ckpt)
    report = mp.verify(ckpt)
    assert not report.ok and Path(file).name in problems(report), report


class Counter:
    """A StatefulCheckpointable that keeps its state in a JSON file of its own."""

    def __init__(self, n: int = 0) -> None:
        self.n = n

    def save(self, directory: Path) -> None:
        (Path(directory) / "count.json").write_text(json.dumps({"n": self.n}))

    def load(self, directory: Path) -> None:
        self.n = json.loads((Path(directory) / "count.json").read_text())["n"]


def test_flipped_json_checkpointable_is_caught(tmp_path: Path) -> None:
    with mp.Context(handlers=[(mp.JsonHandler(), "config")]):
        ckpt = mp.save_checkpointables(
            tmp_path / "c", {"state": {"x": 1}, "config": {"depth": 12345}}
        )
    flip(
        ckpt / "config" / "data.json", (ckpt / "config" / "data.json").read_bytes().index(b"2")
    )  # 12345 -> 13345
    with pytest.raises(mp.CorruptCheckpointError, match="data.json"):
        mp.load_checkpointables(ckpt, {"config": None})
    assert not mp.verify(ckpt).ok


def test_flipped_stateful_checkpointable_is_caught(tmp_path: Path) -> None:
    ckpt = mp.save_checkpointables(tmp_path / "c", {"state": {"x": 1}, "counter": Counter(12345)})
    file = ckpt / "counter" / "count.json"
    flip(file, file.read_bytes().index(b"2"))  # 12345 -> 13345
    assert not mp.verify(ckpt).ok
    restored = Counter()
    try:
        mp.load_checkpointables(ckpt, {"counter": restored})
    except MILEPOST_ERRORS:
        return
    assert restored.n == 12345, f"wrong state loaded without an error: {restored.n}"


# ------------------------------------------------------------------------------------------
# 7. Options of the wrong type
# ------------------------------------------------------------------------------------------

BAD_OPTIONS: dict[str, tuple[Callable[[], Any], type[Exception], str]] = {
    "writers-float": (
        lambda: mp.SaveOptions(ocdbt_writers_per_host=2.5),
        TypeError,
        "ocdbt_writers_per_host",
    ),
    "writers-bool": (
        lambda: mp.SaveOptions(ocdbt_writers_per_host=True),
        TypeError,
        "ocdbt_writers_per_host",
    ),
    "writers-zero": (
        lambda: mp.SaveOptions(ocdbt_writers_per_host=0),
        ValueError,
        "ocdbt_writers_per_host",
    ),
    "chunk-str": (lambda: mp.SaveOptions(chunk_byte_size="x"), TypeError, "chunk_byte_size"),
    "chunk-float": (lambda: mp.SaveOptions(chunk_byte_size=1024.0), TypeError, "chunk_byte_size"),
    "chunk-zero": (lambda: mp.SaveOptions(chunk_byte_size=0), ValueError, "chunk_byte_size"),
    "use-ocdbt-int": (lambda: mp.SaveOptions(use_ocdbt=1), TypeError, "use_ocdbt"),
    "replica-str": (lambda: mp.SaveOptions(replica_parallel="yes"), TypeError, "replica_parallel"),
    "compression": (lambda: mp.SaveOptions(compression="gzip"), ValueError, "compression"),
    "wait-str": (
        lambda: mp.SaveOptions(wait_for_writer_secs="x"),
        TypeError,
        "wait_for_writer_secs",
    ),
    "wait-nan": (
        lambda: mp.SaveOptions(wait_for_writer_secs=float("nan")),
        ValueError,
        "wait_for_writer_secs",
    ),
    "budget-str": (
        lambda: mp.LoadOptions(memory_budget_bytes="x"),
        TypeError,
        "memory_budget_bytes",
    ),
    "budget-negative": (
        lambda: mp.LoadOptions(memory_budget_bytes=-1),
        ValueError,
        "memory_budget_bytes",
    ),
    "direct-int": (lambda: mp.LoadOptions(direct_reads=0), TypeError, "direct_reads"),
    "timeout-str": (lambda: mp.AsyncOptions(timeout_secs="x"), TypeError, "timeout_secs"),
    "timeout-nan": (lambda: mp.AsyncOptions(timeout_secs=float("nan")), ValueError, "timeout_secs"),
    "timeout-inf": (lambda: mp.AsyncOptions(timeout_secs=float("inf")), ValueError, "timeout_secs"),
    "timeout-zero": (lambda: mp.AsyncOptions(timeout_secs=0), ValueError, "timeout_secs"),
    "timeout-bool": (lambda: mp.AsyncOptions(timeout_secs=True), TypeError, "timeout_secs"),
}


def _context_argument(options: Any) -> str:
    return {mp.SaveOptions: "saving", mp.LoadOptions: "loading", mp.AsyncOptions: "async_"}[
        type(options)
    ]


@pytest.mark.parametrize("case", list(BAD_OPTIONS))
def test_options_of_the_wrong_type_fail_at_construction(tmp_path: Path, case: str) -> None:
    make, error, option = BAD_OPTIONS[case]
    with pytest.raises(error, match=option):
        make()
    target = tmp_path / "c"

    def save_with_them() -> None:
        options = make()  # raises: the save never starts
        with mp.Context(**{_context_argument(options): options}):
            mp.save(target, {"x": np.arange(300)})

    with pytest.raises(error, match=option):
        save_with_them()
    assert listing(tmp_path) == []
    # The context in force is untouched: a save with the defaults works.
    ckpt = mp.save(target, {"x": np.arange(300)})
    assert same_bits(mp.load(ckpt)["x"], np.arange(300))


# ------------------------------------------------------------------------------------------
# Each host is sent the checksums of the chunks it reads, and a chunk read without one fails
# ------------------------------------------------------------------------------------------


class _FourHosts:
    """A group of 4 hosts of 2 devices each (devices 2h, 2h+1 on host h)."""

    def processes(self) -> range:
        return range(4)

    def process_of_device(self, device: int) -> int:
        return device // 2


def test_each_host_is_sent_only_the_checksums_of_the_chunks_its_boxes_touch() -> None:
    import dataclasses

    from milepost._checkpoint import _pytree_load
    from milepost.workers import LoadTask, ShardingSpec

    header = {
        "zarr_format": 3,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [8, 16]}},
        "codecs": [{"name": "bytes"}],
    }
    # (60, 16) in row chunks of 8 (8 chunks); P("model") on a (data 2, model 4) mesh: boxes of 15
    # rows, devices 4-7 repeat 0-3
    spec = ShardingSpec.named((2, 4), ("data", "model"), tuple(range(8)), ("model",))
    recorded = tuple(((g, 0), 1000 + g) for g in range(8))
    task = LoadTask(name="w", shape=(60, 16), dtype="float32", sharding=spec, checksums=recorded)
    plain = LoadTask(name="v", shape=(60, 16), dtype="float32", sharding=spec, checksums=None)
    plans = _pytree_load._checksums_per_process(
        [task, plain], {"w": header, "v": header}, _FourHosts()
    )
    # host 0: devices 0, 1 = rows 0-30 (chunks 0-3); host 1: rows 30-60 (chunks 3-7, chunk 3
    # shared); hosts 2, 3 the same
    want = {0: range(0, 4), 1: range(3, 8), 2: range(0, 4), 3: range(3, 8)}
    for host, chunks in want.items():
        got, unchecked = plans[host]
        assert got.checksums == tuple(((g, 0), 1000 + g) for g in chunks), host
        assert dataclasses.replace(got, checksums=recorded) == task, "only the checksums differ"
        assert unchecked is plain, "an array without checksums is sent as it is"


def test_without_chunk_checksums_every_host_gets_one_plan_built_once() -> None:
    """Nothing to trim per host: the controller builds one plan (O(arrays)) and hands every
    host the same object, not a copy per host of every array."""
    from milepost._checkpoint import _pytree_load
    from milepost.workers import LoadTask, ShardingSpec

    spec = ShardingSpec.named((2, 4), ("data", "model"), tuple(range(8)), ("model",))
    tasks = [
        LoadTask(name=f"v{i}", shape=(60, 16), dtype="float32", sharding=spec) for i in range(3)
    ]
    built = []

    def plan_of(mine: list[LoadTask]) -> tuple[LoadTask, ...]:
        built.append(mine)
        return tuple(mine)

    plans = _pytree_load._plans_per_process(tasks, {}, _FourHosts(), plan_of)
    assert list(plans) == [0, 1, 2, 3] and len(built) == 1
    assert all(plan is plans[0] for plan in plans.values()) and plans[0] == tuple(tasks)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "tensorstore"])
@pytest.mark.parametrize("layout", ["ocdbt", "subchunked"])
def test_a_chunk_read_without_its_recorded_checksum_fails(
    saved: dict[str, tuple[Path, Any]], monkeypatch: pytest.MonkeyPatch, layout: str, direct: bool
) -> None:
    """If a writer's checksum table lacked a chunk it holds (a writer's mistake, or a table
    trimmed by hand), the load fails loudly: it never reads the chunk unchecked."""
    from milepost.workers.format import _chunk_tables

    ckpt, _ = saved[layout]
    real = _chunk_tables.ChunkTables.table

    def drop_one(self: Any, database: str) -> Any:
        return {
            name: dict(list(chunks.items())[1:]) for name, chunks in real(self, database).items()
        }

    monkeypatch.setattr(_chunk_tables.ChunkTables, "table", drop_one)
    with (
        reading(direct),
        pytest.raises(
            mp.CorruptCheckpointError,
            match="has no recorded checksum although the array's others do",
        ),
    ):
        mp.load(ckpt)
