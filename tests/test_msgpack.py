"""Flax msgpack checkpoints: files that flax.serialization wrote load exactly, as nested dicts or
onto a mesh (each shard read by its range: the structure walk reads no array bytes), and
damaged or crafted files are clear errors that execute nothing."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost import workers
from tests._helpers import same_bits

serialization = pytest.importorskip("flax.serialization")


def model() -> dict[str, Any]:
    rng = np.random.default_rng(3)
    return {
        "params": {
            "Dense_0": {
                "kernel": rng.standard_normal((16, 8), dtype=np.float32),
                "bias": np.arange(8).astype(ml_dtypes.bfloat16),
            },
            "embed": rng.integers(-100, 100, (32, 4), dtype=np.int32),
        },
        "step": 7,
        "lr": 0.25,
        "beta": np.float32(0.9),
        "name": "tiny",
        "shift": 1 + 2j,
        "layers": [np.ones((2, 2), np.float16), np.int64(5)],
    }


def write(tmp_path: Path, tree: Any, name: str = "flax_model.msgpack") -> Path:
    path = tmp_path / name
    path.write_bytes(serialization.to_bytes(tree))
    return path


def test_a_flax_file_loads_as_flax_restores_it(tmp_path: Path) -> None:
    tree = model()
    path = write(tmp_path, tree)
    got = mp.load(path)
    want = serialization.msgpack_restore(path.read_bytes())
    flat_got = jax.tree_util.tree_leaves_with_path(got)
    flat_want = jax.tree_util.tree_leaves_with_path(want)
    assert [k for k, _ in flat_got] == [k for k, _ in flat_want]
    for (key, a), (_, b) in zip(flat_got, flat_want, strict=True):
        assert type(a) is type(b) and same_bits(np.asarray(a), np.asarray(b)), key


def test_onto_a_mesh_each_host_reads_its_rows(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    tree = model()
    path = write(tmp_path, tree, "checkpoint_7")
    kernel = NamedSharding(mesh24, P("data", "model"))
    abstract = {
        "params": {
            "Dense_0": {
                "kernel": jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=kernel),
                "bias": np.zeros(8, ml_dtypes.bfloat16),
            },
            "embed": jax.ShapeDtypeStruct(
                (32, 4), jnp.int32, sharding=NamedSharding(mesh24, P("data"))
            ),
        },
        "step": 0,
        "lr": 0.0,
        "beta": np.float32(0),
        "name": "",
        "shift": 0j,
        "layers": [np.zeros((2, 2), np.float16), 0],
    }
    before = mp.io_stats()
    got = mp.load(path, abstract)
    read = (mp.io_stats() - before).bytes_read
    assert got["params"]["Dense_0"]["kernel"].sharding == kernel
    assert same_bits(
        np.asarray(got["params"]["Dense_0"]["kernel"]), tree["params"]["Dense_0"]["kernel"]
    )
    assert same_bits(np.asarray(got["params"]["embed"]), tree["params"]["embed"])
    assert same_bits(got["params"]["Dense_0"]["bias"], tree["params"]["Dense_0"]["bias"])
    assert got["step"] == 7 and got["lr"] == 0.25 and got["name"] == "tiny"
    assert got["shift"] == 1 + 2j and type(got["beta"]) is np.float32 and got["beta"] == 0.9
    assert same_bits(got["layers"][0], tree["layers"][0]) and got["layers"][1] == 5
    arrays = sum(a.nbytes for a in jax.tree_util.tree_leaves(tree) if isinstance(a, np.ndarray))
    # the arrays once, plus the walk over the structure (names, headers, scalars): not twice
    assert arrays <= read < arrays + 1024, (read, arrays, path.stat().st_size)

    partial = mp.load(path, {"params": {"embed": abstract["params"]["embed"]}}, partial=True)
    assert same_bits(np.asarray(partial["params"]["embed"]), tree["params"]["embed"])
    with pytest.raises(mp.StructureMismatchError, match="partial=True"):
        mp.load(path, {"params": {"embed": abstract["params"]["embed"]}})
    with pytest.raises(mp.StructureMismatchError, match=r"params\.nope"):
        mp.load(path, {"params": {"nope": abstract["params"]["embed"]}}, partial=True)


def ext_array(shape: list[int], dtype: bytes, data: bytes) -> bytes:
    inner = bytes([0x93, 0x90 | len(shape), *shape, 0xA0 | len(dtype), *dtype])
    inner += bytes([0xC4, len(data)]) + data
    return bytes([0xC7, len(inner), 1]) + inner


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"", "empty"),
        (b"\x81\xa1a", "file ends"),
        (b"\x81\xa1a\x01\x00", "bytes follow"),
        (b"\x81\xa1a" + ext_array([2], b"|O", b"\0" * 16), "dtype"),
        (b"\x81\xa1a" + ext_array([2], b"float32", b"\0" * 4), "has 4 bytes, not 8"),
        (b"\x81\xa1a" + bytes([0xC7, 1, 9, 0]), "extension type 9"),
        (b"\xdf" + struct.pack(">I", 1 << 30), "larger than the rest"),
        (b"\x81\xa1a" + b"\x91" * 300 + b"\x00", "deeper"),
        (b"\x82\xa1a\x01\xa1a\x02", "twice"),
        (b"\x81\x90\x01", "map key is a list"),
        (b"\x83\xb9__msgpack_chunked_array__\xc3\xa5shape\x90\xa6chunks\x80", "chunks"),
        (b"\x82\xa3a.b\x01\xa1a\x81\xa1b\x02", "both name the leaf 'a.b'"),
        (b"\x82\xa1a\x80\xa3a.x\x01", "also the start of the leaf 'a.x'"),
        (b"\x82\xa3a.b\x01\xa1a\x81\xa1b\x81\xa1c\x02", "also the start of the leaf 'a.b.c'"),
        (
            b"\x81\xa1a"
            + ext_array([3], b"float32", b"\0" * 12)[:2]
            + b"\x03"
            + ext_array([3], b"float32", b"\0" * 12)[3:],
            "array scalar's shape",
        ),
        (b"\x81\xa1a" + bytes([0xD7, 2, 0x92, 0xC3, 0xC2]), "complex number"),
    ],
)
def test_damaged_or_crafted_files_are_clear_errors(tmp_path: Path, body: bytes, words: str) -> None:
    path = tmp_path / "flax_model.msgpack"
    path.write_bytes(body)
    if not body:
        # not a msgpack map at all: not taken for one
        with pytest.raises(mp.CheckpointNotFoundError):
            mp.load(path)
        with pytest.raises(mp.CorruptCheckpointError, match=words):
            workers.format.read_msgpack(str(path))
        return
    with pytest.raises(mp.CorruptCheckpointError, match=words):
        mp.load(path)


def test_a_truncated_flax_file_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, model())
    data = path.read_bytes()
    for cut in (len(data) - 1, len(data) // 2, 5):
        path.write_bytes(data[:cut])
        with pytest.raises(mp.CorruptCheckpointError, match="flax_model.msgpack"):
            mp.load(path)


def test_a_file_cut_short_while_it_is_walked_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The walk reads through pread (a mapping would fault the process): a file that shrinks
    under it ends the walk with an error naming the file."""
    path = write(tmp_path, model())
    from milepost.workers.format import _msgpack

    fstat = _msgpack.os.fstat

    def size_then_shrink(fd: int) -> Any:
        st = fstat(fd)
        os.truncate(path, 40)  # cut short once its size is known
        return st

    monkeypatch.setattr(_msgpack.os, "fstat", size_then_shrink)
    with pytest.raises(mp.CorruptCheckpointError, match="ended at byte 40"):
        workers.format.read_msgpack(str(path))


def test_a_file_replaced_while_it_loads_is_refused(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The controller walked one file and the hosts would read another: refused, not mixed."""
    import milepost._msgpack as controller_msgpack

    first = {"w": np.full((8, 4), 1.0, np.float32), "step": 1}
    second = {"w": np.full((8, 4), 2.0, np.float32), "step": 2}  # the same layout
    path = write(tmp_path, first)
    walk = controller_msgpack.flat

    def walk_then_replace(p: Path) -> Any:
        found = walk(p)
        replacement = tmp_path / "next.msgpack"
        replacement.write_bytes(serialization.to_bytes(second))
        replacement.replace(p)
        return found

    monkeypatch.setattr(controller_msgpack, "flat", walk_then_replace)
    abstract = {
        "w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=NamedSharding(mesh24, P("data"))),
        "step": 0,
    }
    with pytest.raises(mp.CheckpointReplacedError, match="replaced or changed"):
        mp.load(path, abstract)
