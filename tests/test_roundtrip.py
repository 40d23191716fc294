"""Embedded mode: exact round trips of leaves, containers and dtypes; resharding, casts, partial
loads, placeholders, save options and separable checkpointables."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost.workers import format as _pytree_format
from tests._helpers import abstract_of, assert_tree_equal, put, same_bits


@pytest.fixture
def spy_reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """Records every tree-metadata read (by folder) and every array the worker engine reads."""
    seen: dict[str, list[Any]] = {"folders": [], "arrays": []}
    real_read_saved = _pytree_format.read_tree
    real_load = mp.workers.load

    def read_saved(directory: Path) -> Any:
        seen["folders"].append(Path(directory).name)
        return real_read_saved(directory)

    def load(plan: Any, *args: Any) -> Any:
        seen["arrays"].extend(t.name for t in plan.tasks)
        seen["folders"].append(Path(plan.store.directory).name)
        return real_load(plan, *args)

    monkeypatch.setattr(_pytree_format, "read_tree", read_saved)
    monkeypatch.setattr(mp.workers, "load", load)
    return seen


# ------------------------------------------------------------------------------------------
# Leaves
# ------------------------------------------------------------------------------------------


def leaf_zoo(mesh: jax.sharding.Mesh) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    f32 = lambda *s: rng.standard_normal(s, dtype=np.float32)  # noqa: E731
    return {
        "arrays": {
            "fully_sharded": put(f32(8, 16), mesh, P("data", "model")),
            "transposed_axes": put(f32(8, 8), mesh, P("model", "data")),
            "two_axes_one_dim": put(f32(16, 3), mesh, P(("data", "model"))),
            "replicated": put(f32(4, 8), mesh, P()),
            "partially_replicated": put(f32(6, 8), mesh, P(None, "model")),
            "rows_only": put(np.arange(8 * 12, dtype=np.int32).reshape(8, 12), mesh, P("data")),
            "odd_replicated": put(f32(3, 5), mesh, P()),
            "odd_1d": put(f32(7), mesh, P()),
            "odd_on_divisible_axis": put(f32(3, 8), mesh, P(None, "model")),
            "scalar_array": put(np.float32(-2.5), mesh, P()),
            "zero_size": put(np.zeros((0, 4), np.float32), mesh, P()),
            "single_device": jax.device_put(f32(5, 3), jax.devices()[6]),
            "single_device_scalar": jax.device_put(np.int32(9), jax.devices()[1]),
        },
        "numpy": {
            "matrix": np.arange(12, dtype=np.int16).reshape(3, 4),
            "zero_d": np.array(5, dtype=np.int64),
            "empty": np.zeros((2, 0), np.uint8),
            "nan_inf": np.array([np.nan, np.inf, -np.inf, -0.0, 0.0], np.float32),
        },
        "python": {
            "int": 7,
            "neg_int": -(2**63),
            "float": 2.5,
            "bool": True,
            "false": False,
            "complex": 1 - 2j,
        },
        "numpy_scalars": {
            "i32": np.int32(-3),
            "f16": np.float16(1.5),
            "bf16": ml_dtypes.bfloat16(-0.375),
            "u64": np.uint64(2**64 - 1),
            "i8": np.int8(-128),
            "b": np.bool_(True),
            "c64": np.complex64(1 + 1j),
            "f64": np.float64(1e-300),
        },
        "strings": {
            "plain": "hello",
            "empty": "",
            "unicode": "π ≈ 3.14159 ✓",
            "slashy": "a/b/../c",
            "newline": "x\ny",
        },
        "none": None,
        "empty_dict": {},
        "empty_list": [],
        "nested_empties": {"a": {"b": {}}, "c": [None, [], {}]},
    }


def test_every_leaf_kind_without_abstract_tree(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    state = leaf_zoo(mesh24)
    mp.save(tmp_path / "c", state)
    restored = mp.load(tmp_path / "c")
    assert_tree_equal(restored, state)
    # Saved shardings are reused exactly: same mesh (device order too), same spec, same device.
    for name, want in state["arrays"].items():
        assert restored["arrays"][name].sharding == want.sharding, name


def test_every_leaf_kind_with_abstract_tree(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    state = leaf_zoo(mesh24)
    mp.save(tmp_path / "c", state)
    assert_tree_equal(mp.load(tmp_path / "c", abstract_of(state)), state)


def test_root_leaves(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    roots = [
        put(np.arange(8.0, dtype=np.float32), mesh24, P("model")),
        np.arange(3),
        4,
        "text",
        None,
        {},
        [],
        (),
    ]
    for i, root in enumerate(roots):
        mp.save(tmp_path / str(i), root)
        assert_tree_equal(mp.load(tmp_path / str(i)), root)
        assert_tree_equal(mp.load(tmp_path / str(i), abstract_of(root)), root)


# ------------------------------------------------------------------------------------------
# Containers
# ------------------------------------------------------------------------------------------


class Point(NamedTuple):
    x: jax.Array
    label: str
    weight: float


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Layer:
    w: jax.Array
    b: jax.Array
    name: str = dataclasses.field(metadata={"static": True}, default="dense")


@jax.tree_util.register_pytree_node_class
class Pair:
    """A custom pytree node without key names (flattened by position)."""

    def __init__(self, left: Any, right: Any) -> None:
        self.left, self.right = left, right

    def tree_flatten(self) -> tuple[tuple[Any, Any], None]:
        return (self.left, self.right), None

    @classmethod
    def tree_unflatten(cls, aux: None, children: tuple[Any, Any]) -> Pair:
        return cls(*children)


class Named:
    """A custom pytree node flattened with keys."""

    def __init__(self, **fields: Any) -> None:
        self.fields = fields


jax.tree_util.register_pytree_with_keys(
    Named,
    lambda n: (
        [(jax.tree_util.GetAttrKey(k), v) for k, v in sorted(n.fields.items())],
        tuple(sorted(n.fields)),
    ),
    lambda keys, children: Named(**dict(zip(keys, children, strict=True))),
)


def test_containers_round_trip_with_abstract_tree(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    s = lambda spec: NamedSharding(mesh24, spec)  # noqa: E731
    rng = np.random.default_rng(1)
    state = {
        "list": [
            jax.device_put(np.arange(8.0, dtype=np.float32), s(P("model"))),
            2,
            "two",
            [3, [4.0]],
        ],
        "tuple": (np.arange(3), (True, None), ()),
        "point": Point(
            jax.device_put(rng.standard_normal((4, 4), dtype=np.float32), s(P("data"))), "p", 0.5
        ),
        "layers": [
            Layer(
                w=jax.device_put(
                    rng.standard_normal((8, 4), dtype=np.float32), s(P("data", "model"))
                ),
                b=jax.device_put(np.zeros(4, np.float32), s(P())),
                name=f"layer{i}",
            )
            for i in range(2)
        ],
        "pair": Pair(
            np.arange(4, dtype=np.uint16), Pair("inner", jax.device_put(np.int8(3), s(P())))
        ),
        "named": Named(
            alpha=np.float32(1.25),
            beta={"deep": jax.device_put(np.ones((2, 8), np.int32), s(P(None, "model")))},
        ),
        "many": [
            np.int32(i) for i in range(12)
        ],  # more than 10: order must be numeric, not lexical
    }
    mp.save(tmp_path / "c", state)
    restored = mp.load(tmp_path / "c", abstract_of(state))
    assert_tree_equal(restored, state)
    assert isinstance(restored["point"], Point) and isinstance(restored["tuple"], tuple)
    assert [layer.name for layer in restored["layers"]] == ["layer0", "layer1"]
    assert isinstance(restored["pair"].right, Pair) and restored["pair"].right.left == "inner"
    assert isinstance(restored["named"], Named) and restored["named"].fields["alpha"] == np.float32(
        1.25
    )
    # Storage names follow the key paths (what Orbax reads too).
    names = set(mp.metadata(tmp_path / "c").tree)
    assert {"list", "tuple", "point", "layers", "pair", "named", "many"} == names
    meta = mp.metadata(tmp_path / "c").tree
    assert (
        meta["layers"][1]["w"].name == "layers.1.w"
        and meta["named"]["beta"]["deep"].name == "named.beta.deep"
    )
    assert meta["pair"][1][1].name == "pair.1.1"  # positional children: a sequence

    # Without an abstract tree: plain dicts and lists with the same values.
    plain = mp.load(tmp_path / "c")
    assert same_bits(plain["point"]["x"], state["point"].x) and plain["point"]["label"] == "p"
    assert same_bits(plain["layers"][1]["w"], state["layers"][1].w)
    assert [int(v) for v in plain["many"]] == list(range(12))


# ------------------------------------------------------------------------------------------
# Dtypes
# ------------------------------------------------------------------------------------------

DTYPES = [
    np.float64,
    np.float32,
    np.float16,
    jnp.bfloat16,
    jnp.float8_e4m3fn,
    jnp.float8_e5m2,
    jnp.float8_e4m3fnuz,
    jnp.float8_e5m2fnuz,
    jnp.float8_e4m3b11fnuz,
    jnp.float8_e3m4,
    jnp.float8_e8m0fnu,
    jnp.float4_e2m1fn,
    jnp.int4,
    jnp.int2,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.bool_,
    np.complex64,
    np.complex128,
]


def sample(dtype: Any, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Values covering the dtype's range; for floats every bit pattern (NaNs, infs, -0 too)."""
    dt = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    if dt == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    if dt.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
    if dt.name in ("int4", "int2", "float4_e2m1fn"):  # sub-byte: no raw bit patterns
        info = ml_dtypes.iinfo(dt) if dt.kind == "i" else None
        lo, hi = (info.min, info.max) if info else (-6, 6)
        return rng.integers(lo, hi + 1, shape).astype(dt)
    width = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[dt.itemsize]
    return rng.integers(0, np.iinfo(width).max, shape, dtype=width, endpoint=True).view(dt)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_dtype_round_trip(tmp_path: Path, mesh24: jax.sharding.Mesh, dtype: Any) -> None:
    dt = np.dtype(dtype)
    host = sample(dt, (8, 4), seed=dt.num)
    x64 = dt.itemsize == 8 or dt == np.complex128
    with jax.enable_x64(x64):  # 64-bit device arrays need x64; enabled for this test only
        state = {
            "sharded": put(host, mesh24, P("data", "model")),
            "replicated": put(host[:3], mesh24, P()),
            "numpy": host,
            "scalar": host[1, 2],
        }
        assert state["sharded"].dtype == dt
        mp.save(tmp_path / "c", state)
        restored = mp.load(tmp_path / "c")
        assert_tree_equal(restored, state)
        assert type(restored["scalar"]) is type(host[1, 2])
        meta = mp.metadata(tmp_path / "c").tree
        assert (
            meta["sharded"].dtype == dt and meta["numpy"].dtype == dt and meta["scalar"].dtype == dt
        )


# ------------------------------------------------------------------------------------------
# Resharding, casts, partial loads, placeholders
# ------------------------------------------------------------------------------------------


def assert_shards_exact(x: jax.Array, full: np.ndarray) -> None:
    for shard in x.addressable_shards:
        assert same_bits(shard.data, full[shard.index]), (shard.device, shard.index)


def test_memory_kinds_are_saved_and_loaded(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    """Host-offloaded arrays ('pinned_host') come back where they were saved; an abstract tree
    moves any array into the memory its sharding names; default-memory arrays record nothing."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((16, 8), dtype=np.float32)
    v = rng.integers(0, 9, (6,), dtype=np.int32)
    state = {
        "opt": jax.device_put(
            w, NamedSharding(mesh24, P("data", "model"), memory_kind="pinned_host")
        ),
        "one": jax.device_put(v, SingleDeviceSharding(jax.devices()[3], memory_kind="pinned_host")),
        "w": put(w, mesh24, P("model")),
    }
    mp.save(tmp_path / "c", state)
    restored = mp.load(tmp_path / "c")
    assert_tree_equal(restored, state)
    assert [restored[k].sharding.memory_kind for k in ("opt", "one", "w")] == [
        "pinned_host",
        "pinned_host",
        "device",
    ]
    meta = mp.metadata(tmp_path / "c").tree
    assert (
        meta["opt"].sharding.memory_kind == "pinned_host" and meta["w"].sharding.memory_kind is None
    )
    saved = json.loads((tmp_path / "c" / "state" / "_sharding").read_text())
    assert ["memory_kind" in json.loads(text) for text in saved.values()].count(True) == 2

    mesh42 = jax.make_mesh((4, 2), ("x", "y"))
    for source in ("opt", "w"):
        for kind in ("pinned_host", "unpinned_host", "device"):
            target = NamedSharding(mesh42, P(None, "x"), memory_kind=kind)
            out = mp.load(
                tmp_path / "c",
                {source: jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=target)},
                partial=True,
            )
            assert out[source].sharding == target, (source, kind)
            assert_shards_exact(out[source], w)


@pytest.mark.parametrize("subchunked", [False, True], ids=["one-chunk-per-shard", "subchunked"])
def test_resharded_loads(tmp_path: Path, mesh24: jax.sharding.Mesh, subchunked: bool) -> None:
    rng = np.random.default_rng(2)
    w = rng.standard_normal((16, 8), dtype=np.float32)
    r = rng.standard_normal((5, 3), dtype=np.float32)
    state = {"w": put(w, mesh24, P("data", "model")), "r": put(r, mesh24, P())}
    with mp.Context(saving=mp.SaveOptions(chunk_byte_size=64 if subchunked else None)):
        mp.save(tmp_path / "c", state)
    mesh42 = jax.make_mesh((4, 2), ("x", "y"))
    shuffled = jax.sharding.Mesh(
        np.array(jax.devices())[[5, 2, 7, 0, 3, 6, 1, 4]].reshape(2, 4), ("a", "b")
    )
    targets = {
        "(4,2) P(None,'x')": NamedSharding(mesh42, P(None, "x")),
        "(4,2) P('y','x')": NamedSharding(mesh42, P("y", "x")),
        "(4,2) P(('x','y'))": NamedSharding(mesh42, P(("x", "y"))),
        "replicated": NamedSharding(mesh42, P()),
        "shuffled devices": NamedSharding(shuffled, P("b", "a")),
        "single device": SingleDeviceSharding(jax.devices()[7]),
    }
    for label, target in targets.items():
        out = mp.load(
            tmp_path / "c",
            {
                "w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=target),
                # (5, 3) divides no axis: replicated, or on the single device
                "r": jax.ShapeDtypeStruct(
                    r.shape,
                    r.dtype,
                    sharding=target if label == "single device" else NamedSharding(mesh42, P()),
                ),
            },
        )
        assert out["w"].sharding == target, label
        assert_shards_exact(out["w"], w)
        assert same_bits(out["w"], w) and same_bits(out["r"], r), label
    # Saved replicated, loaded sharded (and onto an 8-way 1-D mesh).
    mesh8 = jax.make_mesh((8,), ("z",))
    out = mp.load(
        tmp_path / "c",
        {
            "w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=NamedSharding(mesh8, P("z"))),
            "r": jax.ShapeDtypeStruct(r.shape, r.dtype, sharding=NamedSharding(mesh8, P(None))),
        },
    )
    assert_shards_exact(out["w"], w)
    assert_shards_exact(out["r"], r)
    # A concrete array works as the abstract leaf too (its sharding is used; it is not modified).
    template = put(np.zeros_like(w), mesh42, P("x"))
    out = mp.load(tmp_path / "c", {"w": template}, partial=True)
    assert out["w"].sharding == template.sharding and same_bits(out["w"], w)
    assert not np.asarray(template).any()


def test_cast_on_load(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    rng = np.random.default_rng(3)
    w = rng.standard_normal((8, 8), dtype=np.float32) * 1000
    b = jnp.asarray(rng.standard_normal(8, dtype=np.float32), dtype=jnp.bfloat16)
    n = np.arange(10, dtype=np.int32) - 5
    state = {
        "w": put(w, mesh24, P("data", "model")),
        "b": put(b, mesh24, P("model")),
        "n": n,
        "i": np.int16(-7),
    }
    mp.save(tmp_path / "c", state)
    s = NamedSharding(jax.make_mesh((4, 2), ("x", "y")), P("x"))
    out = mp.load(
        tmp_path / "c",
        {
            "w": jax.ShapeDtypeStruct(w.shape, jnp.bfloat16, sharding=s),
            "b": jax.ShapeDtypeStruct(b.shape, jnp.float32, sharding=s),
            "n": np.zeros(10, np.float16),
            "i": np.int64(0),
        },
    )
    assert same_bits(out["w"], w.astype(jnp.bfloat16))  # exactly what x.astype gives
    assert same_bits(out["b"], np.asarray(b).astype(np.float32))
    assert same_bits(out["n"], n.astype(np.float16))
    assert type(out["i"]) is np.int64 and out["i"] == -7
    out16 = mp.load(
        tmp_path / "c", {"w": jax.ShapeDtypeStruct(w.shape, jnp.float16, sharding=s)}, partial=True
    )
    assert same_bits(out16["w"], w.astype(np.float16))  # includes overflow to inf, as astype does


def test_partial_and_placeholder_read_only_what_is_asked(
    tmp_path: Path, mesh24: jax.sharding.Mesh, spy_reads: dict[str, list[Any]]
) -> None:
    rng = np.random.default_rng(4)
    state = {
        "params": {
            "w": put(rng.standard_normal((8, 8), dtype=np.float32), mesh24, P("data")),
            "b": put(np.arange(8.0, dtype=np.float32), mesh24, P()),
        },
        "opt": {"mu": put(np.ones((8, 8), np.float32), mesh24, P("data")), "count": np.int32(3)},
        "step": 12,
        "name": "run",
    }
    mp.save(tmp_path / "c", state)
    spy_reads["arrays"].clear()

    sub = mp.load(
        tmp_path / "c",
        {"params": {"w": abstract_of(state["params"]["w"])}, "step": 0},
        partial=True,
    )
    assert set(sub) == {"params", "step"} and set(sub["params"]) == {"w"}
    assert_tree_equal(sub, {"params": {"w": state["params"]["w"]}, "step": 12})
    assert sorted(spy_reads["arrays"]) == ["params.w", "step"]

    spy_reads["arrays"].clear()
    abstract = abstract_of(state)
    abstract["opt"] = {"mu": mp.PLACEHOLDER, "count": mp.PLACEHOLDER}
    abstract["params"]["b"] = mp.PLACEHOLDER
    out = mp.load(tmp_path / "c", abstract)
    assert out["opt"] == {"mu": ..., "count": ...} and out["params"]["b"] is ...
    assert_tree_equal(out["params"]["w"], state["params"]["w"])
    assert out["step"] == 12 and out["name"] == "run"
    assert sorted(spy_reads["arrays"]) == ["params.w", "step"]

    # partial=True with PLACEHOLDER in a partial tree: both at once
    both = mp.load(
        tmp_path / "c", {"opt": {"mu": mp.PLACEHOLDER, "count": np.int32(0)}}, partial=True
    )
    assert both == {"opt": {"mu": ..., "count": np.int32(3)}}


def test_abstract_without_sharding_uses_the_saved_one(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    x = put(np.arange(32, dtype=np.float32).reshape(4, 8), mesh24, P("data", "model"))
    mp.save(tmp_path / "c", {"x": x})
    out = mp.load(tmp_path / "c", {"x": jax.ShapeDtypeStruct((4, 8), jnp.bfloat16)})
    assert out["x"].sharding == x.sharding
    assert same_bits(out["x"], np.asarray(x).astype(jnp.bfloat16))
    # A NumPy abstract leaf loads a device array into host memory.
    host = mp.load(tmp_path / "c", {"x": np.zeros((4, 8), np.float32)})["x"]
    assert type(host) is np.ndarray and same_bits(host, x)


# ------------------------------------------------------------------------------------------
# Save options
# ------------------------------------------------------------------------------------------


def _zarr_header(ckpt: Path, name: str) -> dict[str, Any]:
    import tensorstore as ts

    if (ckpt / "state" / name / "zarr.json").exists():
        return json.loads((ckpt / "state" / name / "zarr.json").read_text())
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{ckpt / 'state'}/"}).result()
    return json.loads(kv.read(f"{name}/zarr.json").result().value)


@pytest.mark.parametrize(
    "saving",
    [
        mp.SaveOptions(),
        mp.SaveOptions(use_ocdbt=False),
        mp.SaveOptions(compression="zstd"),
        mp.SaveOptions(use_ocdbt=False, compression="zstd", chunk_byte_size=100),
        mp.SaveOptions(chunk_byte_size=100),
        mp.SaveOptions(replica_parallel=False),
    ],
    ids=[
        "default",
        "plain-zarr3",
        "zstd",
        "zarr3-zstd-subchunked",
        "subchunked",
        "no-replica-parallel",
    ],
)
def test_save_options(tmp_path: Path, mesh24: jax.sharding.Mesh, saving: mp.SaveOptions) -> None:
    rng = np.random.default_rng(5)
    state = {
        "w": put(rng.standard_normal((32, 16), dtype=np.float32), mesh24, P("data", "model")),
        "rep": put(rng.standard_normal((16, 6), dtype=np.float32), mesh24, P()),
        "half": put(np.arange(8 * 12, dtype=np.int32).reshape(8, 12), mesh24, P("data")),
        "odd": put(rng.standard_normal((3, 5), dtype=np.float32), mesh24, P()),
        "n": np.arange(40, dtype=np.float64),
        "s": 1.25,
        "t": "text",
    }
    ckpt = tmp_path / "c"
    # (replicated shards split among their replicas however small: the layouts checked here)
    with mp.Context(saving=dataclasses.replace(saving, min_write_bytes=0)):
        mp.save(ckpt, state)
    assert_tree_equal(mp.load(ckpt), state)
    meta = mp.metadata(ckpt).tree

    # Layout: one OCDBT database per writer plus the merged root, or one zarr3 folder per array.
    has_process_dbs = any((ckpt / "state").glob("ocdbt.process_*"))
    assert has_process_dbs == saving.use_ocdbt
    assert (ckpt / "state" / "w" / "zarr.json").exists() == (not saving.use_ocdbt)
    tree_meta = json.loads((ckpt / "state" / "_METADATA").read_text())
    assert tree_meta["use_ocdbt"] == saving.use_ocdbt

    # Compression is recorded in every array's codecs.
    for name in ("w", "n"):
        inner = _zarr_header(ckpt, name)["codecs"][0]["configuration"]["codecs"]
        assert any(c["name"] == "zstd" for c in inner) == (saving.compression == "zstd"), name

    # Write shape: a shard, or a replica's slice of it when replicas share the writing.
    if saving.replica_parallel:
        assert meta["rep"].write_shape == (2, 6)  # 8 replicas, 16 rows: 2 rows each
        assert meta["half"].write_shape == (1, 12)  # 4 replicas of a (4, 12) shard
    else:
        assert meta["rep"].write_shape == (16, 6)
        assert meta["half"].write_shape == (4, 12)
    assert meta["w"].write_shape == (16, 4)
    assert meta["odd"].write_shape == (3, 5)  # no axis divisible by 8: one writer
    array_meta = json.loads((ckpt / "state" / "array_metadatas" / "process_0").read_text())
    recorded = {
        e["array_metadata"]["param_name"]: e["array_metadata"]
        for e in array_meta["array_metadatas"]
    }
    assert tuple(recorded["w"]["write_shape"]) == meta["w"].write_shape

    # Chunk shape: divides the write shape and fits chunk_byte_size (host NumPy leaves too).
    for name in ("w", "rep", "half", "odd", "n"):
        ws, cs = meta[name].write_shape, meta[name].chunk_shape
        assert all(w % c == 0 for w, c in zip(ws, cs, strict=True)), (name, ws, cs)
        if isinstance(saving.chunk_byte_size, int):
            assert int(np.prod(cs)) * meta[name].dtype.itemsize <= saving.chunk_byte_size, (
                name,
                cs,
            )
        else:
            assert cs == ws  # (the default, "auto", keeps shards under 2 MiB whole)
    if isinstance(saving.chunk_byte_size, int):
        assert meta["w"].chunk_shape != meta["w"].write_shape
        # A resharded read of subchunked data gives the same values.
        s = NamedSharding(jax.make_mesh((8,), ("z",)), P(None, "z"))
        out = mp.load(
            ckpt, {"w": jax.ShapeDtypeStruct((32, 16), np.float32, sharding=s)}, partial=True
        )
        assert_shards_exact(out["w"], np.asarray(state["w"]))


# ------------------------------------------------------------------------------------------
# Separable checkpointables
# ------------------------------------------------------------------------------------------


def test_checkpointables_load_a_subset_without_reading_the_others(
    tmp_path: Path, mesh24: jax.sharding.Mesh, spy_reads: dict[str, list[Any]]
) -> None:
    rng = np.random.default_rng(6)
    params = {
        "w": put(rng.standard_normal((8, 8), dtype=np.float32), mesh24, P("data", "model")),
        "step": 5,
    }
    opt = {"mu": put(np.full((8, 8), 2.0, np.float32), mesh24, P("data")), "nu": np.ones(3)}
    dataset = {"position": 17, "shard": "train-00003"}
    ckpt = mp.save_checkpointables(
        tmp_path / "c", {"params": params, "opt": opt, "dataset": dataset}
    )
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["dataset", "opt", "params"]

    everything = mp.load_checkpointables(ckpt)
    assert_tree_equal(everything, {"params": params, "opt": opt, "dataset": dataset})

    # Destroy every file of the other checkpointables: a subset load must not need them.
    for other in ("opt", "dataset"):
        shutil.rmtree(ckpt / other)
    spy_reads["folders"].clear()
    only = mp.load_checkpointables(ckpt, {"params": abstract_of(params)})
    assert set(only) == {"params"}
    assert_tree_equal(only["params"], params)
    assert set(spy_reads["folders"]) == {"params"}
    with pytest.raises(KeyError, match="no checkpointable"):
        mp.load_checkpointables(ckpt, {"optimizer": None})
    with pytest.raises(FileNotFoundError):  # asking for a destroyed one does fail
        mp.load_checkpointables(ckpt, {"opt": None})


def test_load_reads_only_the_state_checkpointable(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    state = {"x": put(np.arange(8.0, dtype=np.float32), mesh24, P("model"))}
    ckpt = mp.save_checkpointables(tmp_path / "c", {"state": state, "extra": {"y": np.arange(3)}})
    shutil.rmtree(ckpt / "extra")
    assert_tree_equal(mp.load(ckpt), state)


def test_64_bit_arrays_need_x64_on_load(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    """Found by this test: without x64, int64/float64 device arrays loaded silently truncated to
    32 bits (2**40 + 1 came back as 1). Now: a clear error, or an explicit cast."""
    big = np.arange(8, dtype=np.int64) + 2**40
    with jax.enable_x64(True):
        mp.save(
            tmp_path / "c",
            {
                "i": put(big, mesh24, P("data")),
                "f": put(np.full(8, 1 + 2**-40), mesh24, P()),
                "n": big,
            },
        )
    with pytest.raises(ValueError, match=r"(?s)array '(i|f)'.*(int64|float64).*x64"):
        mp.load(tmp_path / "c")
    # Host NumPy leaves are not affected; an explicit 32-bit dtype is a cast; x64 loads exactly.
    s = NamedSharding(mesh24, P())
    out = mp.load(
        tmp_path / "c",
        {"i": jax.ShapeDtypeStruct((8,), np.int32, sharding=s), "f": mp.PLACEHOLDER, "n": big},
    )
    assert same_bits(out["i"], big.astype(np.int32)) and same_bits(out["n"], big)
    with jax.enable_x64(True):
        exact = mp.load(tmp_path / "c")
        assert same_bits(exact["i"], big) and same_bits(exact["f"], np.full(8, 1 + 2**-40))


def test_default_chunking_cuts_large_shards_into_bands(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    """SaveOptions' default chunking ("auto"): a shard of 2 MiB or more becomes bands of whole
    rows of about 1 MiB, a smaller one stays one chunk. The bands are read directly (same
    topology: a shard at a time; resharded along the rows: only the bands each device keeps)."""
    from milepost.workers.load import _direct

    rng = np.random.default_rng(8)
    big = rng.integers(0, 255, (4096, 8192), dtype=np.uint8)  # shards of (2048, 2048): 4 MiB
    state = {
        "big": put(big, mesh24, P("data", "model")),
        "small": put(rng.standard_normal((64, 256), dtype=np.float32), mesh24, P("data", "model")),
    }
    assert mp.SaveOptions().chunk_byte_size == "auto"
    mp.save(tmp_path / "c", state)
    meta = mp.metadata(tmp_path / "c").tree
    assert meta["big"].write_shape == (2048, 2048) and meta["big"].chunk_shape == (
        512,
        2048,
    )  # 4 bands of 1 MiB
    assert meta["small"].chunk_shape == meta["small"].write_shape
    pieces: list[Any] = []
    real = _direct.DirectReader.read_box

    def read_box(self: Any, values: Any, reads: Any, *args: Any) -> Any:
        pieces.extend(r for r in reads if r.key.startswith("big/"))
        return real(self, values, reads, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_direct.DirectReader, "read_box", read_box)
        assert_tree_equal(mp.load(tmp_path / "c", abstract_of(state)), state)
        assert len(pieces) == 8 * 4 and all(p.scatter is None and p.whole for p in pieces)
        pieces.clear()
        rows = NamedSharding(jax.make_mesh((8,), ("x",)), P("x", None))
        before = mp.io_stats()
        out = mp.load(
            tmp_path / "c",
            {"big": jax.ShapeDtypeStruct(big.shape, big.dtype, sharding=rows)},
            partial=True,
        )
        read = (mp.io_stats() - before).bytes_read
    assert_shards_exact(out["big"], big)
    # (the paper's (2, 4) -> (8, 1): a device keeps a quarter of the rows of four shards, one band
    # of each)
    assert (
        len(pieces) == 8 * 4 and sum(p.nbytes for p in pieces) == big.nbytes
    )  # each band once, all of it kept
    assert read < 1.01 * big.nbytes, read


@pytest.mark.parametrize(
    ("write_shape", "itemsize", "chunk_shape"),
    [
        ((1024, 2048), 4, (128, 2048)),  # 8 MiB: eight 1 MiB bands
        ((512, 512), 4, (512, 512)),  # 1 MiB: kept whole
        ((1000,), 4, (1000,)),
        ((8192, 8192), 2, (64, 8192)),
        (
            (50257, 512),
            4,
            (1733, 512),
        ),  # 29 x 1733 rows: 29 bands of 3.4 MiB, not 50,257 rows of 2 KiB
        ((64, 768, 512), 4, (1, 768, 512)),  # a layer (1.5 MiB) per band
        ((3, 1000000), 4, (1, 250000)),  # one index of the first axis is 4 MB: bands of the second
        ((4, 3, 1000003), 4, (1, 1, 1000003)),  # a prime length: its whole row (3.8 MiB)
    ],
)
def test_auto_chunk_shape(
    write_shape: tuple[int, ...], itemsize: int, chunk_shape: tuple[int, ...]
) -> None:
    from milepost._checkpoint import _planning

    got = _planning.inner_chunk_shape(write_shape, itemsize, "auto")
    assert got == chunk_shape
    assert all(w % c == 0 for w, c in zip(write_shape, got, strict=True))


def test_replica_parallel_writes_are_never_cut_below_the_floor(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    """A replicated shard is cut into parts of at least ``min_write_bytes`` (1 MiB): a small one
    is one write (before: a 384-byte array on 8 devices was 8 writes of 48 bytes, 8 chunks and 8
    checksums), 3 MiB is 3 parts, 8 MiB one part per replica."""
    rng = np.random.default_rng(11)
    values = {
        "small": rng.standard_normal((16, 6), dtype=np.float32),
        "three": rng.standard_normal((768, 1024), dtype=np.float32),
        "eight": rng.standard_normal((2048, 1024), dtype=np.float32),
    }
    state = {k: put(v, mesh24, P()) for k, v in values.items()}
    mp.save(tmp_path / "c", state)
    meta = mp.metadata(tmp_path / "c").tree
    assert meta["small"].write_shape == (16, 6)
    assert meta["three"].write_shape == (256, 1024)
    assert meta["eight"].write_shape == (256, 1024)
    assert_tree_equal(mp.load(tmp_path / "c"), state)
    with mp.Context(saving=mp.SaveOptions(min_write_bytes=0)):  # a part per replica
        mp.save(tmp_path / "d", state)
    assert mp.metadata(tmp_path / "d").tree["small"].write_shape == (2, 6)
    with pytest.raises(ValueError, match="min_write_bytes"):
        mp.SaveOptions(min_write_bytes=-1)
