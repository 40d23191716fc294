"""safetensors in and out: files written by the safetensors library load onto any mesh exactly
(every dtype milepost reads), HF-style shard folders with their index, bad headers are clear
errors; exports load exactly with the safetensors library."""

from __future__ import annotations

import json
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
import milepost.safetensors
from milepost.workers.format import _safetensors
from tests._helpers import listing, put, same_bits

safetensors_numpy = pytest.importorskip("safetensors.numpy")
from safetensors import safe_open  # noqa: E402

ALL_DTYPES = [
    np.bool_,
    np.uint8,
    np.int8,
    np.uint16,
    np.int16,
    np.float16,
    ml_dtypes.bfloat16,
    np.uint32,
    np.int32,
    np.float32,
    np.uint64,
    np.int64,
    np.float64,
    np.complex64,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
    ml_dtypes.float8_e4m3fnuz,
    ml_dtypes.float8_e5m2fnuz,
    ml_dtypes.float8_e8m0fnu,
]


def values(dtype: Any, shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 255, size=int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
    out = raw.view(np.dtype(dtype)).reshape(shape).copy()
    if np.dtype(dtype) == np.bool_:
        out = (raw[: out.size] % 2).astype(np.bool_).reshape(shape)
    return out


def leaf(shape: tuple[int, ...], dtype: Any, sharding: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def test_every_dtype_loads_exactly_onto_a_mesh(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    tensors = {f"t.{np.dtype(d).name}": values(d, (16, 8), k) for k, d in enumerate(ALL_DTYPES)}
    path = tmp_path / "model.safetensors"
    safetensors_numpy.save_file(tensors, str(path))
    abstract = {
        "t": {
            np.dtype(d).name: leaf((16, 8), d, NamedSharding(mesh24, P("data", "model")))
            for d in ALL_DTYPES
        }
    }
    with jax.enable_x64():
        got = mp.load(path, abstract)
        for name, want in tensors.items():
            array = got["t"][name.split(".")[1]]
            assert array.sharding.spec == P("data", "model") and same_bits(array, want), name
    host = mp.load(path)  # no abstract tree: NumPy arrays, nested at the '.'s
    assert all(same_bits(host["t"][n.split(".")[1]], v) for n, v in tensors.items())


@pytest.fixture
def hf_folder(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """An HF-style folder written by the safetensors library: two shards and the index."""
    rng = np.random.default_rng(1)
    tensors = {
        "model.embed.weight": rng.standard_normal((128, 64), dtype=np.float32),
        "model.layers.0.attn.w": rng.standard_normal((64, 64)).astype(ml_dtypes.bfloat16),
        "model.layers.1.attn.w": rng.standard_normal((64, 64)).astype(ml_dtypes.bfloat16),
        "lm_head.weight": rng.standard_normal((64, 128), dtype=np.float32),
    }
    folder = tmp_path / "hf"
    folder.mkdir()
    shards = [
        ["model.embed.weight", "model.layers.0.attn.w"],
        ["model.layers.1.attn.w", "lm_head.weight"],
    ]
    weight_map = {}
    for k, names in enumerate(shards):
        file = f"model-{k + 1:05d}-of-00002.safetensors"
        safetensors_numpy.save_file(
            {n: tensors[n] for n in names}, str(folder / file), metadata={"format": "pt"}
        )
        weight_map.update({n: file for n in names})
    total = sum(v.nbytes for v in tensors.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return folder, tensors


def hf_abstract(mesh: jax.sharding.Mesh, dtype: Any = None) -> dict[str, Any]:
    s = NamedSharding(mesh, P("data", "model"))
    return {
        "model": {
            "embed": {"weight": leaf((128, 64), dtype or np.float32, s)},
            "layers": {
                "0": {"attn": {"w": leaf((64, 64), dtype or ml_dtypes.bfloat16, s)}},
                "1": {
                    "attn": {
                        "w": leaf(
                            (64, 64),
                            dtype or ml_dtypes.bfloat16,
                            NamedSharding(mesh, P(None, "model")),
                        )
                    }
                },
            },
        },
        "lm_head": {"weight": leaf((64, 128), dtype or np.float32, NamedSharding(mesh, P()))},
    }


def test_an_hf_folder_loads_resharded_and_cast(
    hf_folder: tuple[Path, dict[str, np.ndarray]], mesh24: jax.sharding.Mesh
) -> None:
    folder, tensors = hf_folder
    got = mp.load(folder, hf_abstract(mesh24))
    assert same_bits(got["model"]["embed"]["weight"], tensors["model.embed.weight"])
    assert same_bits(got["model"]["layers"]["1"]["attn"]["w"], tensors["model.layers.1.attn.w"])
    assert got["model"]["layers"]["1"]["attn"]["w"].sharding.spec == P(None, "model")
    cast = mp.load(folder, hf_abstract(mesh24, jnp.float32))  # bf16 -> f32 on load
    assert same_bits(
        cast["model"]["layers"]["0"]["attn"]["w"],
        tensors["model.layers.0.attn.w"].astype(np.float32),
    )
    some = mp.load(folder, {"lm_head": hf_abstract(mesh24)["lm_head"]}, partial=True)
    assert same_bits(some["lm_head"]["weight"], tensors["lm_head.weight"])
    with pytest.raises(mp.StructureMismatchError, match="partial=True"):
        mp.load(folder, {"lm_head": hf_abstract(mesh24)["lm_head"]})
    with pytest.raises(mp.StructureMismatchError, match=r"'lm_head\.bias'"):
        mp.load(
            folder,
            {"lm_head": {"bias": leaf((8,), np.float32, NamedSharding(mesh24, P()))}},
            partial=True,
        )
    bad_shape = {"lm_head": {"weight": leaf((64, 64), np.float32, NamedSharding(mesh24, P()))}}
    with pytest.raises(
        mp.StructureMismatchError, match=r"'lm_head\.weight'.*\(64, 64\).*\(64, 128\)"
    ):
        mp.load(folder, bad_shape, partial=True)


def test_a_host_reads_only_the_rows_its_devices_need(tmp_path: Path) -> None:
    """Boxes that are contiguous are read exactly; others from the rows they span, once."""
    array = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    path = tmp_path / "a.safetensors"
    safetensors_numpy.save_file({"a": array}, str(path))
    tensor = _safetensors.read_header(str(path))[0]["a"]
    rows = np.empty((16, 32), np.float32)  # rows 8..24: one contiguous range
    assert (
        sum(f.result() for f in _safetensors.read_boxes(tensor, [(((8, 24), (0, 32)), rows)]))
        == rows.nbytes
    )
    assert np.array_equal(rows, array[8:24])
    blocks = [np.empty((16, 8), np.float32) for _ in range(4)]  # the 4 column blocks of rows 0..16
    boxes = [(((0, 16), (8 * k, 8 * k + 8)), out) for k, out in enumerate(blocks)]
    assert (
        sum(f.result() for f in _safetensors.read_boxes(tensor, boxes)) == 16 * 32 * 4
    )  # those rows, read once
    for k, out in enumerate(blocks):
        assert np.array_equal(out, array[:16, 8 * k : 8 * k + 8])


def corrupt(path: Path, how: str) -> None:
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    if how == "short":
        raw = raw[:5]
    elif how == "huge-header":
        raw[:8] = struct.pack("<Q", len(raw) + 10)
    elif how == "not-json":
        raw[8] = ord("[") ^ 0xFF
    elif how == "unknown-dtype":
        raw[8 : 8 + n] = raw[8 : 8 + n].replace(b'"F32"', b'"X32"')
    elif how == "offsets":
        raw[8 : 8 + n] = raw[8 : 8 + n].replace(b"[0,", b"[4,")
    elif how == "truncated-data":
        raw = raw[:-4]
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "how", ["short", "huge-header", "not-json", "unknown-dtype", "offsets", "truncated-data"]
)
def test_bad_headers_are_clear_errors(tmp_path: Path, how: str) -> None:
    path = tmp_path / "m.safetensors"
    safetensors_numpy.save_file({"w": np.ones((8, 8), np.float32)}, str(path))
    corrupt(path, how)
    with pytest.raises(mp.CorruptCheckpointError, match=r"m\.safetensors: .* damaged or crafted"):
        mp.load(path)


# ------------------------------------------------------------------------------------------
# Export
# ------------------------------------------------------------------------------------------


def test_export_writes_hf_shards_the_library_reads(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    rng = np.random.default_rng(2)
    params = {
        "embed": put(rng.standard_normal((256, 64), dtype=np.float32), mesh24, P("data", "model")),
        "layers": [
            {
                "w": put(
                    rng.standard_normal((64, 64)).astype(ml_dtypes.bfloat16),
                    mesh24,
                    P(None, "model"),
                )
            }
            for _ in range(3)
        ],
        "head": rng.standard_normal((64,)).astype(np.float16),
    }
    ckpt = mp.save(tmp_path / "c", {"params": params, "step": 10, "note": "n"})
    summary = milepost.safetensors.export(
        ckpt, tmp_path / "out", subtree="params", max_shard_bytes=70_000
    )
    want = {
        "embed": params["embed"],
        "head": params["head"],
        **{f"layers.{i}.w": layer["w"] for i, layer in enumerate(params["layers"])},
    }
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(want) and index["metadata"]["total_size"] == sum(
        np.asarray(v).nbytes for v in want.values()
    )
    # embed (64 KiB) fills the first shard; the layers and the head (24 KiB) go to the second
    assert summary.files == ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    assert (
        sorted(summary.files) == sorted(set(index["weight_map"].values()))
        and index["weight_map"]["embed"] == summary.files[0]
    )
    assert all((tmp_path / "out" / f).stat().st_size <= 70_000 + 512 for f in summary.files)
    got: dict[str, np.ndarray] = {}
    for file in summary.files:
        got.update(safetensors_numpy.load_file(str(tmp_path / "out" / file)))
        with safe_open(str(tmp_path / "out" / file), framework="np") as f:
            assert f.metadata() == {"format": "pt"}
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert same_bits(got[name], np.asarray(value)), name
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "c",
        "out",
    ]  # written beside, renamed into place
    back = mp.load(
        tmp_path / "out",
        {"embed": leaf((256, 64), np.float32, NamedSharding(mesh24, P("model")))},
        partial=True,
    )
    assert same_bits(back["embed"], params["embed"])


def test_export_refuses_what_safetensors_cannot_hold_before_writing(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    ckpt = mp.save(tmp_path / "c", {"w": np.ones(4, np.complex128), "ok": np.ones(3)})
    with pytest.raises(mp.StructureMismatchError, match=r"'w'.*complex128"):
        milepost.safetensors.export(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    ckpt2 = mp.save(tmp_path / "k", {"k": jax.random.key(0)})
    with pytest.raises(mp.StructureMismatchError, match="'k'.*PRNG keys"):
        milepost.safetensors.export(ckpt2, tmp_path / "out")
    milepost.safetensors.export(mp.save(tmp_path / "fine", {"x": np.ones(3)}), tmp_path / "out")
    with pytest.raises(mp.CheckpointExistsError, match="overwrite=True"):
        milepost.safetensors.export(tmp_path / "fine", tmp_path / "out")
    assert not any("milepost-export-tmp" in p for p in listing(tmp_path))
