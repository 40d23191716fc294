"""Orbax v1 reads milepost checkpoints, and milepost reads Orbax's (default settings)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import milepost as mp
from tests._helpers import same_bits

ocp = pytest.importorskip("orbax.checkpoint.experimental.v1")
pytestmark = pytest.mark.filterwarnings("ignore:Sharding info not provided when restoring")


def make_state(mesh: jax.sharding.Mesh) -> dict:
    rng = np.random.default_rng(7)
    return {
        "params": {
            "w": jax.device_put(
                rng.standard_normal((16, 8), dtype=np.float32),
                NamedSharding(mesh, P("data", "model")),
            ),
            "b": jax.device_put(jnp.arange(8, dtype=jnp.bfloat16), NamedSharding(mesh, P("model"))),
            "r": jax.device_put(
                rng.standard_normal((4, 4), dtype=np.float32), NamedSharding(mesh, P())
            ),
        },
        "counts": np.arange(6, dtype=np.int32),
        "step": 42,
        "lr": 0.125,
        "name": "run-7",
    }


def resharded_abstract(state: dict) -> tuple[dict, jax.sharding.Mesh]:
    other = jax.make_mesh((4, 2), ("x", "y"))
    return {
        "params": {
            "w": jax.ShapeDtypeStruct(
                (16, 8), np.float32, sharding=NamedSharding(other, P(None, "x"))
            ),
            "b": jax.ShapeDtypeStruct((8,), jnp.bfloat16, sharding=NamedSharding(other, P("x"))),
            "r": jax.ShapeDtypeStruct((4, 4), np.float32, sharding=NamedSharding(other, P("y"))),
        },
        "counts": np.zeros(6, np.int32),
        "step": 0,
        "lr": 0.0,
        "name": "",
    }, other


def check(restored: dict, state: dict) -> None:
    for k in ("w", "b", "r"):
        got, want = np.asarray(restored["params"][k]), np.asarray(state["params"][k])
        assert got.dtype == want.dtype and np.array_equal(
            got.view(np.uint8), want.view(np.uint8)
        ), k
    assert np.array_equal(np.asarray(restored["counts"]), state["counts"])
    assert (
        int(restored["step"]) == 42
        and float(restored["lr"]) == 0.125
        and restored["name"] == "run-7"
    )


@pytest.mark.parametrize("use_ocdbt", [True, False], ids=["ocdbt", "zarr3"])
def test_orbax_reads_milepost(tmp_path: Path, mesh24: jax.sharding.Mesh, use_ocdbt: bool) -> None:
    state = make_state(mesh24)
    with mp.Context(saving=mp.SaveOptions(use_ocdbt=use_ocdbt)):
        mp.save(tmp_path / "c", state)
    check(ocp.load(tmp_path / "c"), state)
    abstract, _ = resharded_abstract(state)
    restored = ocp.load(tmp_path / "c", abstract)
    check(restored, state)
    assert restored["params"]["w"].sharding == abstract["params"]["w"].sharding


def test_orbax_reads_milepost_without_its_sharding_file(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    """Over ``SaveOptions.orbax_sharding_max_bytes`` milepost leaves out ``_sharding``: Orbax
    then restores with an abstract tree that gives every array's sharding (exact values),
    reports no sharding in its metadata, and without an abstract tree refuses (no sharding for
    the jax.Arrays)."""
    state = make_state(mesh24)
    with mp.Context(saving=mp.SaveOptions(orbax_sharding_max_bytes=0)):
        mp.save(tmp_path / "c", state)
    assert not (tmp_path / "c" / "state" / "_sharding").exists()
    abstract, _ = resharded_abstract(state)
    restored = ocp.load(tmp_path / "c", abstract)
    check(restored, state)
    assert restored["params"]["w"].sharding == abstract["params"]["w"].sharding
    same = jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            if isinstance(x, jax.Array)
            else x
        ),
        state,
    )
    restored = ocp.load(tmp_path / "c", same)
    check(restored, state)
    assert restored["params"]["w"].sharding == state["params"]["w"].sharding
    meta = ocp.metadata(tmp_path / "c").metadata
    assert meta["params"]["w"].shape == (16, 8) and meta["params"]["w"].sharding_metadata is None
    with pytest.raises(ValueError, match="Sharding of jax.Array cannot be None"):
        ocp.load(tmp_path / "c")


def test_orbax_reads_host_offloaded_arrays(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    """The 'memory_kind' milepost records for pinned_host arrays does not disturb Orbax's reader."""
    state = make_state(mesh24)
    w = state["params"]["w"]
    state["params"]["w"] = jax.device_put(w, w.sharding.with_memory_kind("pinned_host"))
    mp.save(tmp_path / "c", state)
    check(ocp.load(tmp_path / "c"), state)
    abstract, _ = resharded_abstract(state)
    check(ocp.load(tmp_path / "c", abstract), state)


def test_milepost_reads_orbax(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    state = make_state(mesh24)
    ocp.save(tmp_path / "c", state)
    restored = mp.load(tmp_path / "c")
    check(restored, state)
    assert restored["params"]["w"].sharding == state["params"]["w"].sharding
    assert isinstance(restored["step"], int) and isinstance(restored["name"], str)
    abstract, _ = resharded_abstract(state)
    resharded = mp.load(tmp_path / "c", abstract)
    check(resharded, state)
    assert resharded["params"]["w"].sharding == abstract["params"]["w"].sharding
    meta = mp.metadata(tmp_path / "c").tree
    assert meta["params"]["w"].shape == (16, 8) and meta["params"]["b"].dtype == jnp.bfloat16


# ------------------------------------------------------------------------------------------
# Wider coverage: every dtype, leaf kind and save option, both directions
# ------------------------------------------------------------------------------------------

INTEROP_DTYPES = [
    np.float32,
    np.float16,
    jnp.bfloat16,
    jnp.float8_e4m3fn,
    jnp.float8_e5m2,
    jnp.int4,
    np.int8,
    np.int16,
    np.int32,
    np.uint8,
    np.uint16,
    np.uint32,
    np.bool_,
    np.complex64,
]


def wide_state(mesh: jax.sharding.Mesh) -> dict:
    rng = np.random.default_rng(11)
    arrays = {}
    for dt in INTEROP_DTYPES:
        name = np.dtype(dt).name
        if np.dtype(dt) == np.bool_:
            host = rng.integers(0, 2, (8, 4)).astype(bool)
        elif np.dtype(dt).kind == "c":
            host = (rng.standard_normal((8, 4)) + 1j * rng.standard_normal((8, 4))).astype(dt)
        else:
            host = rng.integers(-8 if np.dtype(dt).kind != "u" else 0, 8, (8, 4)).astype(dt)
        arrays[name] = jax.device_put(host, NamedSharding(mesh, P("data", "model")))
    return {
        "arrays": arrays,
        "replicated": jax.device_put(
            rng.standard_normal((3, 5), dtype=np.float32), NamedSharding(mesh, P())
        ),
        "partial": jax.device_put(
            rng.standard_normal((8, 6), dtype=np.float32), NamedSharding(mesh, P("data"))
        ),
        "scalar_array": jax.device_put(np.float32(-1.5), NamedSharding(mesh, P())),
        "single": jax.device_put(rng.standard_normal((6,), dtype=np.float32), jax.devices()[6]),
        "numpy": {
            "f64": rng.standard_normal((4, 3)),
            "i16": np.arange(5, dtype=np.int16),
            "bf16": np.arange(3).astype(jnp.bfloat16),
        },
        "py": {"int": -5, "float": 1.5, "bool": True, "string": "héllo", "empty_string": ""},
        "nested": [1, [2.5, "y"], {"deep": np.arange(2, dtype=np.int32)}],
        "none": None,
        "empty_dict": {},
        "empty_list": [],
    }


def assert_same_values(got: object, want: object) -> None:
    """Same structure (tuples may come back as lists), exact values and dtypes."""
    empty = lambda x: x is None or (isinstance(x, dict | list) and not x)  # noqa: E731
    lg, tg = jax.tree_util.tree_flatten(got, is_leaf=empty)
    lw, tw = jax.tree_util.tree_flatten(want, is_leaf=empty)
    assert tg == tw, (tg, tw)
    for g, w in zip(lg, lw, strict=True):
        if isinstance(w, jax.Array | np.ndarray | np.generic):
            assert same_bits(g, w), (g, w)
        else:
            assert type(g) is type(w) and g == w, (g, w)


@pytest.mark.parametrize(
    "saving",
    [
        mp.SaveOptions(),
        mp.SaveOptions(use_ocdbt=False),
        mp.SaveOptions(compression="zstd", chunk_byte_size=16),
        mp.SaveOptions(replica_parallel=False),
    ],
    ids=["default", "zarr3", "zstd-subchunked", "no-replica-parallel"],
)
def test_orbax_reads_every_leaf_kind(
    tmp_path: Path, mesh24: jax.sharding.Mesh, saving: mp.SaveOptions
) -> None:
    state = wide_state(mesh24)
    with mp.Context(saving=saving):
        mp.save(tmp_path / "c", state, custom_metadata={"run": "r", "n": [1, 2]})
    restored = ocp.load(tmp_path / "c")
    assert_same_values(restored, state)
    for name, x in state["arrays"].items():
        assert restored["arrays"][name].sharding == x.sharding, name
    assert restored["single"].sharding == state["single"].sharding
    assert ocp.metadata(tmp_path / "c").custom_metadata == {"run": "r", "n": [1, 2]}


def test_orbax_reads_the_default_banded_chunks(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    """Shards of 2 MiB and more are written as bands of about 1 MiB by default: Orbax reads them
    exactly, onto the saved sharding and resharded."""
    x = np.random.default_rng(4).standard_normal(
        (1024, 4096), dtype=np.float32
    )  # shards of (512, 1024): 2 MiB
    state = {"w": jax.device_put(x, NamedSharding(mesh24, P("data", "model")))}
    mp.save(tmp_path / "c", state)
    assert mp.metadata(tmp_path / "c").tree["w"].chunk_shape == (256, 1024)  # two bands of 1 MiB
    assert same_bits(ocp.load(tmp_path / "c")["w"], x)
    rows = NamedSharding(jax.make_mesh((8,), ("x",)), P("x", None))
    restored = ocp.load(
        tmp_path / "c", {"w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rows)}
    )
    assert same_bits(restored["w"], x) and restored["w"].sharding == rows


def test_orbax_metadata_of_a_milepost_checkpoint_matches_its_own(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    """Same tree saved by each: Orbax describes both the same way (shapes, dtypes, shardings,
    write and chunk shapes)."""
    state = wide_state(mesh24)
    state["py"].pop("bool")  # Orbax's own metadata cannot describe bool scalars
    # Orbax splits every replicated shard among its replicas; milepost does below its write
    # floor only when asked (the floor is the one difference in layout)
    with mp.Context(saving=mp.SaveOptions(min_write_bytes=0)):
        mp.save(tmp_path / "milepost", state)
    ocp.save(tmp_path / "orbax", state)
    ours = ocp.metadata(tmp_path / "milepost").metadata
    theirs = ocp.metadata(tmp_path / "orbax").metadata
    flat_ours = jax.tree_util.tree_flatten_with_path(ours)[0]
    flat_theirs = jax.tree_util.tree_flatten_with_path(theirs)[0]
    assert [p for p, _ in flat_ours] == [p for p, _ in flat_theirs]
    for (path, a), (_, b) in zip(flat_ours, flat_theirs, strict=True):
        where = jax.tree_util.keystr(path)
        assert type(a) is type(b), where
        for attr in ("shape", "dtype", "sharding_metadata"):
            if hasattr(b, attr):
                assert getattr(a, attr) == getattr(b, attr), (
                    where,
                    attr,
                    getattr(a, attr),
                    getattr(b, attr),
                )
        if getattr(b, "storage_metadata", None) is not None:
            sa, sb = a.storage_metadata, b.storage_metadata
            assert (sa.write_shape, sa.chunk_shape) == (sb.write_shape, sb.chunk_shape), (
                where,
                sa,
                sb,
            )


def test_milepost_reads_every_leaf_kind_from_orbax(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    state = wide_state(mesh24)
    ocp.save(tmp_path / "c", state, custom_metadata={"from": "orbax"})
    restored = mp.load(tmp_path / "c")
    assert_same_values(restored, state)
    for name, x in state["arrays"].items():
        assert restored["arrays"][name].sharding == x.sharding, name
    assert restored["single"].sharding == state["single"].sharding
    # With an abstract tree: resharded, partial, placeholders.
    other = jax.make_mesh((4, 2), ("x", "y"))
    abstract = {
        "arrays": {
            "bfloat16": jax.ShapeDtypeStruct(
                (8, 4), jnp.bfloat16, sharding=NamedSharding(other, P(None, "y"))
            ),
            "int8": mp.PLACEHOLDER,
        },
        "partial": jax.ShapeDtypeStruct(
            (8, 6), np.float32, sharding=NamedSharding(other, P("x", "y"))
        ),
        "py": {"string": "", "int": 0},
    }
    out = mp.load(tmp_path / "c", abstract, partial=True)
    assert same_bits(out["arrays"]["bfloat16"], state["arrays"]["bfloat16"])
    assert out["arrays"]["bfloat16"].sharding == abstract["arrays"]["bfloat16"].sharding
    assert out["arrays"]["int8"] is mp.PLACEHOLDER
    assert (
        same_bits(out["partial"], state["partial"])
        and out["partial"].sharding == abstract["partial"].sharding
    )
    assert out["py"] == {"string": "héllo", "int": -5}
    meta = mp.metadata(tmp_path / "c")
    assert meta.custom_metadata == {"from": "orbax"}
    assert meta.tree["arrays"]["float8_e4m3fn"].dtype == jnp.float8_e4m3fn
    assert meta.tree["partial"].write_shape == (1, 6)  # Orbax splits replicated shards too


def test_checkpointables_both_ways(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    rng = np.random.default_rng(12)
    params = {
        "w": jax.device_put(
            rng.standard_normal((8, 8), dtype=np.float32), NamedSharding(mesh24, P("data", "model"))
        )
    }
    opt = {
        "mu": jax.device_put(np.ones((8, 8), jnp.bfloat16), NamedSharding(mesh24, P("data"))),
        "count": 4,
    }

    ocp.save_checkpointables(tmp_path / "orbax", {"params": params, "opt": opt})
    only = mp.load_checkpointables(tmp_path / "orbax", {"params": None})
    assert set(only) == {"params"} and same_bits(only["params"]["w"], params["w"])
    assert_same_values(mp.load_checkpointables(tmp_path / "orbax")["opt"], opt)

    mp.save_checkpointables(tmp_path / "milepost", {"params": params, "opt": opt})
    both = ocp.load_checkpointables(tmp_path / "milepost")
    assert_same_values(both["params"], params)
    assert_same_values(both["opt"], opt)


def test_orbax_plain_zarr3_layout(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    state = make_state(mesh24)
    with ocp.Context(
        array_options=ocp.options.ArrayOptions(
            saving=ocp.options.ArrayOptions.Saving(use_ocdbt=False)
        )
    ):
        ocp.save(tmp_path / "c", state)
    assert not any((tmp_path / "c" / "state").glob("ocdbt.process_*"))
    check(mp.load(tmp_path / "c"), state)
