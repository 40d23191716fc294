"""Hostile files: what a safetensors header, a msgpack file or a checkpoint's metadata declares
is checked before anything is built from it (``milepost.workers.declared``). Every violation is
a ``CorruptCheckpointError`` naming the file and the field; ``milepost inspect`` says
"damaged" (exit 1); ``verify`` never calls sound what ``load`` refuses."""

from __future__ import annotations

import base64
import json
import shutil
import struct
import tracemalloc
from pathlib import Path
from typing import Any

import jax
import msgpack
import numpy as np
import pytest
import safetensors
import tensorstore as ts
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost import _cli
from tests._helpers import put, reseal

DAMAGED = 1


def safetensors_file(path: Path, header: str | bytes, data: bytes = b"") -> Path:
    raw = header.encode() if isinstance(header, str) else header
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def entry(dtype: str = "F32", shape: Any = (1,), offsets: Any = (0, 4)) -> str:
    return json.dumps({"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)})


# ------------------------------------------------------------------------------------------
# safetensors headers
# ------------------------------------------------------------------------------------------

# name -> (header text, data bytes, the reference library refuses it too)
HOSTILE_SAFETENSORS = {
    "infinity in a shape": (
        '{"a":{"dtype":"F32","shape":[Infinity],"data_offsets":[0,4]}}',
        b"\0" * 4,
        True,
    ),
    "NaN in the offsets": (
        '{"a":{"dtype":"F32","shape":[1],"data_offsets":[NaN,4]}}',
        b"\0" * 4,
        True,
    ),
    "a 5000-digit offset": (
        '{"a":{"dtype":"F32","shape":[1],"data_offsets":[' + "1" * 5000 + ",4]}}",
        b"\0" * 4,
        True,
    ),
    "1e400 in a shape": ('{"a":{"dtype":"U8","shape":[1e400],"data_offsets":[0,1]}}', b"\0", True),
    "nested 100,000 deep": ('{"a":' + "[" * 100_000 + "]" * 100_000 + "}", b"", True),
    "a name of 3,000 dots": ("{" + json.dumps("." * 3000) + ":" + entry() + "}", b"\0" * 4, False),
    "a name of 5,000 bytes": ("{" + json.dumps("x" * 5000) + ":" + entry() + "}", b"\0" * 4, False),
    "shape [2.9]": ('{"a":' + entry("U8", [2.9], [0, 2]) + "}", b"\0" * 2, True),
    "shape [true, true]": ('{"a":' + entry("U8", [True, True], [0, 1]) + "}", b"\0", True),
    "a negative dimension": ('{"a":' + entry("U8", [-1], [0, 0]) + "}", b"", True),
    "a shape of 2**64 elements": ('{"a":' + entry("U8", [2**32, 2**32], [0, 1]) + "}", b"\0", True),
    "a key twice": (
        '{"a":' + entry("U8", [1], [0, 1]) + ',"a":' + entry("U8", [2], [0, 2]) + "}",
        b"\0" * 2,
        False,
    ),
    "trailing bytes": ('{"a":' + entry("U8", [1], [0, 1]) + "}", b"\0" * 5, True),
    "a gap between tensors": (
        '{"a":' + entry("U8", [1], [0, 1]) + ',"b":' + entry("U8", [1], [2, 3]) + "}",
        b"\0" * 3,
        True,
    ),
    "overlapping tensors": (
        '{"a":' + entry("U8", [2], [0, 2]) + ',"b":' + entry("U8", [2], [1, 3]) + "}",
        b"\0" * 3,
        True,
    ),
    "an unknown dtype": ('{"a":' + entry("X32", [1], [0, 4]) + "}", b"\0" * 4, True),
    "offsets of three numbers": ('{"a":' + entry("U8", [1], [0, 1, 1]) + "}", b"\0", True),
    "a metadata value that is not a string": (
        '{"__metadata__":{"format":1},"a":' + entry("U8", [1], [0, 1]) + "}",
        b"\0",
        True,
    ),
    "a header that is a list": ("[]", b"", True),
}


@pytest.mark.parametrize("case", list(HOSTILE_SAFETENSORS))
def test_a_hostile_safetensors_header_is_a_corrupt_file(tmp_path: Path, case: str) -> None:
    header, data, _ = HOSTILE_SAFETENSORS[case]
    path = safetensors_file(tmp_path / "m.safetensors", header, data)
    with pytest.raises(mp.CorruptCheckpointError) as info:
        mp.load(path)
    assert info.value.path == str(path) and info.value.field, info.value
    assert str(path) in str(info.value)
    assert _cli.main(["inspect", str(path)]) == DAMAGED


@pytest.mark.parametrize(
    "case", [c for c, (_, _, refused) in HOSTILE_SAFETENSORS.items() if refused]
)
def test_what_the_reference_refuses_is_refused(tmp_path: Path, case: str) -> None:
    """Each of these the reference implementation refuses too (so milepost refuses no file the
    reference reads, but for names it cannot nest and keys given twice)."""
    header, data, _ = HOSTILE_SAFETENSORS[case]
    path = safetensors_file(tmp_path / "m.safetensors", header, data)
    with pytest.raises(Exception), safetensors.safe_open(str(path), framework="numpy") as f:  # noqa: B017
        for name in f.keys():
            f.get_tensor(name)


def test_a_header_too_large_is_refused_before_it_is_read(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", 100_000_001) + b"{}" + b" " * 64)
    with pytest.raises(mp.CorruptCheckpointError, match="header length"):
        mp.load(path)


def test_tensors_a_and_a_b_need_an_abstract_tree(tmp_path: Path) -> None:
    header = '{"a":' + entry("U8", [1], [0, 1]) + ',"a.b":' + entry("U8", [2], [1, 3]) + "}"
    path = safetensors_file(tmp_path / "m.safetensors", header, b"\x07\x08\x09")
    with pytest.raises(mp.StructureMismatchError, match="'a' and 'a.b'"):
        mp.load(path)
    got = mp.load(path, {"a": np.zeros(1, np.uint8)}, partial=True)
    assert got["a"].tolist() == [7]
    got = mp.load(path, {"a": {"b": np.zeros(2, np.uint8)}}, partial=True)
    assert got["a"]["b"].tolist() == [8, 9]


def test_a_file_the_reference_writes_loads_exactly(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    state = {
        "w": np.arange(12, dtype=np.float32).reshape(3, 4),
        "b": np.arange(3, dtype=np.int64),
        "empty": np.zeros((0, 5), np.float16),
    }
    save_file(state, str(tmp_path / "m.safetensors"), metadata={"format": "np"})
    got = mp.load(tmp_path / "m.safetensors")
    for name, value in state.items():
        assert got[name].dtype == value.dtype and np.array_equal(got[name], value)


# ------------------------------------------------------------------------------------------
# Flax msgpack files
# ------------------------------------------------------------------------------------------


def test_a_msgpack_file_of_long_nested_keys_is_refused_at_once(tmp_path: Path) -> None:
    """100 nested maps with 10 KB keys over 1,000 leaves: a 1 MB file whose every leaf's name
    is 1 MB (20 s and 1.9 GB before)."""
    node: Any = {str(i): i for i in range(1000)}
    for depth in range(100):
        node = {chr(65 + depth % 26) * 10_000 + str(depth): node}
    path = tmp_path / "flax_model.msgpack"
    path.write_bytes(msgpack.packb(node))
    tracemalloc.start()
    try:
        with pytest.raises(mp.CorruptCheckpointError, match="longer than 4096 bytes"):
            mp.load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * path.stat().st_size, peak


def test_a_msgpack_file_whose_names_outgrow_it_is_refused(tmp_path: Path) -> None:
    """One 4,000-byte key over 20,000 leaves: each name is short enough, but together they are
    80 MB from a file of 100 KB. Refused once the names made pass the budget (64 MiB here)."""
    leaves = {format(i, "x"): 1 for i in range(20_000)}
    path = tmp_path / "flax_model.msgpack"
    path.write_bytes(msgpack.packb({"k" * 4000: leaves}))
    tracemalloc.start()
    try:
        with pytest.raises(mp.CorruptCheckpointError, match="times the file's size"):
            mp.load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 80 << 20, peak


def test_msgpack_leaves_that_nest_into_each_other_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "flax_model.msgpack"
    path.write_bytes(msgpack.packb({"a": 1, "a.b": {"c": 2}}))
    with pytest.raises(mp.CorruptCheckpointError, match="'a' is also the start of the leaf"):
        mp.load(path)


@pytest.mark.parametrize(
    ("shape", "words"),
    [([2.9], "2.9"), ([True], "true"), ([-1], "-1"), ([2**32, 2**32], "2\\*\\*63")],
)
def test_a_msgpack_array_shape_must_be_whole_sizes(
    tmp_path: Path, shape: list[Any], words: str
) -> None:
    array = msgpack.ExtType(1, msgpack.packb([shape, "uint8", b"\0"]))
    path = tmp_path / "flax_model.msgpack"
    path.write_bytes(msgpack.packb({"w": array}))
    with pytest.raises(mp.CorruptCheckpointError, match=words) as info:
        mp.load(path)
    assert info.value.field and "shape" in info.value.field


# ------------------------------------------------------------------------------------------
# A checkpoint's metadata
# ------------------------------------------------------------------------------------------


@pytest.fixture
def plain(tmp_path: Path) -> Path:
    with mp.Context(saving=mp.SaveOptions(use_ocdbt=False)):
        return mp.save(tmp_path / "plain", {"w": np.arange(16, dtype=np.uint8).reshape(4, 4)})


@pytest.fixture
def packed(tmp_path: Path) -> Path:
    return mp.save(tmp_path / "packed", {"w": np.arange(16, dtype=np.uint8).reshape(4, 4)})


def edit_header(ckpt: Path, edit: Any) -> None:
    """Change the array 'w''s zarr.json (a file, or a value of the root view) and reseal."""
    plain_file = ckpt / "state" / "w" / "zarr.json"
    if plain_file.exists():
        header = json.loads(plain_file.read_text())
        edit(header)
        plain_file.write_text(json.dumps(header))
    else:
        kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{ckpt}/state/"}).result()
        header = json.loads(kv.read("w/zarr.json").result().value)
        edit(header)
        kv.write("w/zarr.json", json.dumps(header).encode()).result()
    reseal(ckpt)


def grid(header: dict[str, Any], shape: list[int], chunk: list[int]) -> None:
    header["shape"] = shape
    header["chunk_grid"]["configuration"]["chunk_shape"] = chunk
    header["codecs"][0]["configuration"]["chunk_shape"] = chunk


@pytest.mark.parametrize("layout", ["plain", "packed"])
def test_a_header_of_2_80_bytes_is_damage_for_load_stats_and_verify(
    request: pytest.FixtureRequest, layout: str
) -> None:
    """shape [2**40, 2**40] in chunks [4, 4]: verify built the chunk grid as a list
    (MemoryError), stats and load overflowed."""
    ckpt = request.getfixturevalue(layout)
    edit_header(ckpt, lambda h: grid(h, [2**40, 2**40], [4, 4]))
    for call in (mp.load, mp.metadata):
        with pytest.raises(mp.CorruptCheckpointError, match="2\\*\\*63 bytes") as info:
            call(ckpt)
        assert info.value.array == "w" and info.value.field == "shape"
    report = mp.verify(ckpt)
    assert not report.ok and "2**63 bytes" in "\n".join(report.problems), report
    for command in ("inspect", "stats", "verify"):
        assert _cli.main([command, str(ckpt)]) == DAMAGED, command


@pytest.mark.parametrize("layout", ["plain", "packed"])
@pytest.mark.parametrize(
    "edit",
    [
        lambda h: h.update(shape=[-5, 4]),
        lambda h: h.update(shape=[4.0, 4]),
        lambda h: h.update(shape=[True, 4]),
        lambda h: h.update(shape=[4] * 33),
        lambda h: h.update(data_type="object"),
        lambda h: grid(h, [4, 4], [0, 4]),
        lambda h: h["codecs"][0]["configuration"].update(chunk_shape=[3, 4]),
    ],
    ids=["negative", "float", "bool", "rank 33", "dtype", "chunk 0", "inner not dividing"],
)
def test_verify_never_calls_sound_what_load_refuses(
    request: pytest.FixtureRequest, layout: str, edit: Any
) -> None:
    ckpt = request.getfixturevalue(layout)
    edit_header(ckpt, edit)
    with pytest.raises(mp.CorruptCheckpointError):
        mp.load(ckpt)
    report = mp.verify(ckpt)
    assert not report.ok and "zarr.json" in "\n".join(report.problems), report


def test_verify_walks_the_chunks_storage_holds_not_the_grid_declared(packed: Path) -> None:
    """A header declaring 2**60 one-byte chunks (within the bounds): verify counts the shards
    missing from storage, walks the one there is, and ends."""
    edit_header(packed, lambda h: grid(h, [2**30, 2**30], [1, 1]))
    report = mp.verify(packed)
    text = "\n".join(report.problems)
    assert not report.ok and f"{2**60 - 1} of its {2**60} stored chunks" in text, report


def test_200000_key_parts_are_damage_not_a_long_path(packed: Path) -> None:
    meta_file = packed / "state" / "_METADATA"
    meta = json.loads(meta_file.read_text())
    keys = [{"key": "k", "key_type": 2}] * 200_000
    meta["tree_metadata"] = {
        "('k',)": {"key_metadata": keys, "value_metadata": {"value_type": "jax.Array"}}
    }
    meta_file.write_text(json.dumps(meta))
    reseal(packed)
    with pytest.raises(mp.CorruptCheckpointError, match="key_metadata"):
        mp.load(packed)
    assert _cli.main(["inspect", str(packed)]) == DAMAGED
    assert not mp.verify(packed).ok


def test_a_plain_array_name_longer_than_a_folder_name_is_damage(plain: Path) -> None:
    meta_file = plain / "state" / "_METADATA"
    meta = json.loads(meta_file.read_text())
    ((_, item),) = meta["tree_metadata"].items()
    item["key_metadata"] = [{"key": "w" * 300, "key_type": 2}]
    meta["tree_metadata"] = {str(("w" * 300,)): item}
    meta_file.write_text(json.dumps(meta))
    reseal(plain)
    with pytest.raises(mp.CorruptCheckpointError, match="folder name"):
        mp.load(plain)
    assert _cli.main(["inspect", str(plain)]) == DAMAGED


@pytest.mark.parametrize(
    ("file", "text"),
    [
        ("_METADATA", '{"tree_metadata": {}, "tree_metadata": {}}'),
        ("_milepost.json", '{"python_types": {"a": "int"}, "python_types": {}}'),
        ("_milepost.json", '{"chunk_crc32c": {"w": {"0.0": NaN}}}'),
        ("_milepost.json", '{"chunk_crc32c": {"w": {"0.0": 1e400}}}'),
        ("_milepost.json", '{"chunk_crc32c": {"w": {"0.x": 5}}}'),
        ("_milepost.json", '{"chunk_crc32c": {"w": {"0.0": 4294967296}}}'),
        ("_milepost.json", '{"python_types": {"a": 5}}'),
    ],
)
def test_metadata_json_is_read_strictly(packed: Path, file: str, text: str) -> None:
    (packed / "state" / file).write_text(text)
    reseal(packed)
    with pytest.raises(mp.CorruptCheckpointError, match=file) as info:
        mp.load(packed)
    assert info.value.path is not None and file in info.value.path


def test_a_recorded_mesh_of_2_40_devices_is_refused_before_it_is_built(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    packed = mp.save(tmp_path / "c", {"w": put(np.ones((8, 4), np.float32), mesh24, P("data"))})
    path = packed / "state" / "_milepost.json"
    info = json.loads(path.read_text())
    mesh = info["shardings"]["meshes"][0]
    mesh["shape"] = [2**20, 2**20]
    mesh["device_ids"] = {"start": 0, "count": 2**40}
    path.write_text(json.dumps(info))
    reseal(packed)
    with pytest.raises(mp.CorruptCheckpointError, match="devices"):
        mp.load(packed)


def test_an_orbax_sharding_of_2_40_devices_is_refused(tmp_path: Path, packed: Path) -> None:
    """Orbax before 0.6 recorded a mesh's shape only (its devices are jax.devices() in order)."""
    from tests._helpers import without_compact_shardings

    without_compact_shardings(packed)
    text = json.dumps(
        {
            "sharding_type": "NamedSharding",
            "shape": [2**20, 2**20],
            "axis_names": ["a", "b"],
            "partition_spec": [None],
        }
    )
    (packed / "state" / "_sharding").write_text(json.dumps({base64.b64encode(b"w").decode(): text}))
    reseal(packed)
    with pytest.raises(mp.CorruptCheckpointError, match="devices"):
        mp.load(packed)


def test_user_metrics_with_nan_still_load(tmp_path: Path) -> None:
    """Only what milepost declares is strict: the values a user saves (metrics, custom
    metadata) keep Python's NaN and Infinity."""
    path = mp.save_checkpointables(
        tmp_path / "c",
        {"state": {"w": np.ones(3, np.float32)}},
        metrics={"loss": float("nan"), "best": float("inf")},
        custom_metadata={"note": float("-inf")},
    )
    meta = mp.metadata(path)
    assert np.isnan(meta.metrics["loss"]) and meta.metrics["best"] == float("inf")
    assert meta.custom_metadata["note"] == float("-inf")
    assert mp.verify(path).ok


def test_a_tree_whose_names_milepost_would_not_read_back_is_not_saved(tmp_path: Path) -> None:
    node: Any = np.ones(2)
    for i in range(300):
        node = {f"k{i}": node}
    with pytest.raises(mp.InvalidKeyError, match="parts"):
        mp.save(tmp_path / "deep", node)
    with pytest.raises(mp.InvalidKeyError, match="4096 bytes"):
        mp.save(tmp_path / "long", {"x" * 5000: np.ones(2)})
    assert not (tmp_path / "deep").exists() and not (tmp_path / "long").exists()
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_a_header_declaring_more_than_the_host_holds_is_a_typed_error(plain: Path) -> None:
    """shape [2**40, 4] (4 TiB of uint8, within the bounds) over 4 x 4 written values: the load's
    buffer cannot be had, and that is a HostMemoryError naming the box, not NumPy's bare
    MemoryError; verify says what is missing."""
    edit_header(plain, lambda h: h.update(shape=[2**40, 4]))
    with pytest.raises(mp.HostMemoryError) as info:
        mp.load(plain)
    assert info.value.shape == (2**40, 4) and info.value.nbytes == 2**42
    assert not mp.verify(plain).ok
