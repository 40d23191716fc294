"""Embedded mode: exact round trips of every supported leaf, container and dtype."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import milepost as mp


def assert_tree_equal(a: object, b: object) -> None:
    la, ta = jax.tree_util.tree_flatten(a, is_leaf=lambda x: x is None)
    lb, tb = jax.tree_util.tree_flatten(b, is_leaf=lambda x: x is None)
    assert ta == tb, f"structures differ: {ta} vs {tb}"
    for x, y in zip(la, lb, strict=True):
        assert type(x) is type(y) or (isinstance(x, jax.Array) and isinstance(y, jax.Array)), (type(x), type(y))
        if isinstance(x, jax.Array | np.ndarray | np.generic):
            assert np.asarray(x).dtype == np.asarray(y).dtype
            assert np.asarray(x).shape == np.asarray(y).shape
            assert np.array_equal(np.asarray(x), np.asarray(y), equal_nan=np.asarray(x).dtype.kind in "fc")
            if isinstance(x, jax.Array):
                assert x.sharding.is_equivalent_to(y.sharding, x.ndim), (x.sharding, y.sharding)
        else:
            assert x == y


def put(x: np.ndarray, mesh: jax.sharding.Mesh, spec: P) -> jax.Array:
    return jax.device_put(x, NamedSharding(mesh, spec))


class Point(NamedTuple):
    x: jax.Array
    label: str


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Layer:
    w: jax.Array
    b: jax.Array


class Box:
    """A custom pytree node (flattened with indices, not names)."""

    def __init__(self, a: object, b: object) -> None:
        self.a, self.b = a, b

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Box)


jax.tree_util.register_pytree_node(Box, lambda n: ((n.a, n.b), None), lambda _, c: Box(*c))


def test_mixed_tree_round_trip_without_abstract(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    rng = np.random.default_rng(0)
    state = {
        "sharded": put(rng.standard_normal((8, 16), dtype=np.float32), mesh24, P("data", "model")),
        "replicated": put(rng.standard_normal((3, 5), dtype=np.float32), mesh24, P()),
        "partial": put(np.arange(24, dtype=np.int32).reshape(4, 6), mesh24, P("data")),
        "odd": put(np.arange(7, dtype=np.float32), mesh24, P()),
        "single": jax.device_put(np.arange(5.0, dtype=np.float32), jax.devices()[3]),
        "numpy": np.arange(12, dtype=np.int16).reshape(3, 4),
        "py": {"int": 7, "float": 2.5, "bool": True, "complex": 1 + 2j},
        "np_scalars": [np.int32(-3), np.float16(1.5), np.uint8(255), np.bool_(False)],
        "text": "hello / world",
        "none": None,
        "empty_dict": {},
        "empty_list": [],
        "list": [put(np.ones((4, 4), np.float32), mesh24, P(None, "model")), 3],
    }
    mp.save(tmp_path / "ckpt", state)
    restored = mp.load(tmp_path / "ckpt")
    expected = dict(state)
    assert_tree_equal(restored, expected)
    assert restored["single"].sharding == state["single"].sharding


@pytest.mark.parametrize(
    "dtype",
    [
        np.float64, np.float32, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2,
        ml_dtypes.float8_e4m3b11fnuz, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
        np.uint64, np.bool_, np.complex64,
    ],
)
def test_dtypes_round_trip(tmp_path: Path, mesh24: jax.sharding.Mesh, dtype: type) -> None:
    rng = np.random.default_rng(1)
    raw = rng.standard_normal((8, 4)) * 10
    host = (raw > 0) if dtype is np.bool_ else (raw + 1j * raw if dtype is np.complex64 else raw).astype(dtype)
    with jax.enable_x64(np.dtype(dtype).itemsize == 8 and np.dtype(dtype).kind != "c"):
        state = {"d": put(host, mesh24, P("model")), "n": host}
        mp.save(tmp_path / "c", state)
        restored = mp.load(tmp_path / "c")
        assert restored["d"].dtype == np.dtype(dtype)
        assert np.array_equal(np.asarray(restored["d"]).view(np.uint8), host.view(np.uint8))
        assert restored["n"].dtype == np.dtype(dtype)
        assert np.array_equal(restored["n"].view(np.uint8), host.view(np.uint8))


def test_containers_with_abstract_tree(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    s = NamedSharding(mesh24, P("data"))
    state = {
        "point": Point(jax.device_put(np.arange(8.0, dtype=np.float32), s), "p0"),
        "layer": Layer(w=jax.device_put(np.ones((4, 4), np.float32), s), b=jax.device_put(np.zeros(4, np.float32), s)),
        "box": Box(jax.device_put(np.arange(4, dtype=np.int32), s), 5),
        "tuple": (1, 2.0, "three"),
    }
    mp.save(tmp_path / "c", state)
    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x, state
    )
    restored = mp.load(tmp_path / "c", abstract)
    assert isinstance(restored["point"], Point) and isinstance(restored["layer"], Layer) and isinstance(restored["box"], Box)
    assert isinstance(restored["tuple"], tuple)
    assert_tree_equal(restored, state)


def test_reshard_cast_partial_placeholder(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    rng = np.random.default_rng(2)
    w = rng.standard_normal((16, 8), dtype=np.float32)
    state = {"w": put(w, mesh24, P("data", "model")), "b": put(np.arange(8, dtype=np.float32), mesh24, P("model")), "step": 3}
    mp.save(tmp_path / "c", state)
    other = jax.make_mesh((4, 2), ("x", "y"))
    target = NamedSharding(other, P(None, "x"))

    restored = mp.load(tmp_path / "c", {"w": jax.ShapeDtypeStruct((16, 8), np.float32, sharding=target),
                                         "b": jax.ShapeDtypeStruct((8,), np.float32, sharding=NamedSharding(other, P())),
                                         "step": 0})
    assert restored["w"].sharding == target
    assert np.array_equal(np.asarray(restored["w"]), w)
    assert restored["w"].addressable_shards[0].data.shape == (16, 2)

    single = jax.sharding.SingleDeviceSharding(jax.devices()[5])
    cast = mp.load(tmp_path / "c", {"w": jax.ShapeDtypeStruct((16, 8), jnp.bfloat16, sharding=single)}, partial=True)
    assert set(cast) == {"w"}
    assert cast["w"].dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(cast["w"]).view(np.uint16), w.astype(ml_dtypes.bfloat16).view(np.uint16))

    skipped = mp.load(tmp_path / "c", {"w": mp.PLACEHOLDER, "b": mp.PLACEHOLDER, "step": 0})
    assert skipped["w"] is mp.PLACEHOLDER and skipped["b"] is mp.PLACEHOLDER and skipped["step"] == 3

    as_numpy = mp.load(tmp_path / "c", {"w": np.zeros((16, 8), np.float32)}, partial=True)
    assert isinstance(as_numpy["w"], np.ndarray) and np.array_equal(as_numpy["w"], w)


@pytest.mark.parametrize(
    "saving",
    [
        mp.SaveOptions(use_ocdbt=False),
        mp.SaveOptions(compression="zstd"),
        mp.SaveOptions(chunk_byte_size=256),
        mp.SaveOptions(replica_parallel=False),
    ],
    ids=["plain-zarr3", "zstd", "subchunked", "no-replica-parallel"],
)
def test_save_options_round_trip(tmp_path: Path, mesh24: jax.sharding.Mesh, saving: mp.SaveOptions) -> None:
    rng = np.random.default_rng(3)
    state = {
        "w": put(rng.standard_normal((32, 16), dtype=np.float32), mesh24, P("data", "model")),
        "r": put(rng.standard_normal((16, 8), dtype=np.float32), mesh24, P()),
        "n": np.arange(10),
        "s": 1.25,
    }
    with mp.Context(saving=saving):
        mp.save(tmp_path / "c", state)
    assert_tree_equal(mp.load(tmp_path / "c"), state)
    meta = mp.metadata(tmp_path / "c").tree
    if saving.chunk_byte_size:
        assert meta["w"].write_shape == (16, 4)
        assert np.prod(meta["w"].chunk_shape) * 4 <= 256
        # a resharded read of a subchunked array gives the same values
        other = jax.make_mesh((8,), ("z",))
        part = mp.load(tmp_path / "c", {"w": jax.ShapeDtypeStruct((32, 16), np.float32, sharding=NamedSharding(other, P("z")))}, partial=True)
        assert np.array_equal(np.asarray(part["w"]), np.asarray(state["w"]))
    if not saving.use_ocdbt:
        assert (tmp_path / "c" / "state" / "w" / "zarr.json").exists()
    if saving.replica_parallel:
        assert meta["r"].write_shape == (2, 8)  # 8 replicas share the writing
    else:
        assert meta["r"].write_shape == (16, 8)


def test_zero_size_and_scalar_arrays(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    state = {
        "empty": put(np.zeros((0, 4), np.float32), mesh24, P()),
        "scalar": jax.device_put(np.float32(3.5), NamedSharding(mesh24, P())),
        "np_empty": np.zeros((2, 0), np.int8),
    }
    mp.save(tmp_path / "c", state)
    assert_tree_equal(mp.load(tmp_path / "c"), state)


def test_checkpointables_subset_reads_only_what_is_asked(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    params = {"w": put(np.ones((8, 8), np.float32), mesh24, P("data"))}
    opt = {"mu": put(np.full((8, 8), 2.0, np.float32), mesh24, P("data"))}
    mp.save_checkpointables(tmp_path / "c", {"params": params, "opt": opt, "data": {"position": 17}})
    everything = mp.load_checkpointables(tmp_path / "c")
    assert set(everything) == {"params", "opt", "data"}
    assert_tree_equal(everything["opt"], opt)
    # Destroy the optimizer's folder: loading params alone must not touch it.
    import shutil

    shutil.rmtree(tmp_path / "c" / "opt")
    (tmp_path / "c" / "opt").mkdir()
    only = mp.load_checkpointables(tmp_path / "c", {"params": None, "data": None})
    assert_tree_equal(only["params"], params)
    assert only["data"] == {"position": 17}
    with pytest.raises(KeyError, match="no checkpointable"):
        mp.load_checkpointables(tmp_path / "c", {"dataset": None})
