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

ocp = pytest.importorskip("orbax.checkpoint.experimental.v1")


def make_state(mesh: jax.sharding.Mesh) -> dict:
    rng = np.random.default_rng(7)
    return {
        "params": {
            "w": jax.device_put(rng.standard_normal((16, 8), dtype=np.float32), NamedSharding(mesh, P("data", "model"))),
            "b": jax.device_put(jnp.arange(8, dtype=jnp.bfloat16), NamedSharding(mesh, P("model"))),
            "r": jax.device_put(rng.standard_normal((4, 4), dtype=np.float32), NamedSharding(mesh, P())),
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
            "w": jax.ShapeDtypeStruct((16, 8), np.float32, sharding=NamedSharding(other, P(None, "x"))),
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
        assert got.dtype == want.dtype and np.array_equal(got.view(np.uint8), want.view(np.uint8)), k
    assert np.array_equal(np.asarray(restored["counts"]), state["counts"])
    assert int(restored["step"]) == 42 and float(restored["lr"]) == 0.125 and restored["name"] == "run-7"


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
