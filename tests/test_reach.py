"""The states JAX users hold: typed PRNG keys, Flax NNX and Linen, Optax; abstract trees from
``jax.eval_shape``/``nnx.eval_shape`` (shardings on an AbstractMesh). Round trips are exact and
keep every type; Orbax reads milepost's keys and milepost reads Orbax's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import milepost as mp
from tests._helpers import put

ocp = pytest.importorskip("orbax.checkpoint.experimental.v1")


def is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def assert_same(got: Any, want: Any, *, shardings: Any = None) -> None:
    """Same structure and node types, bit-identical leaves of the same dtype, keys of the same
    implementation; each leaf sharded like ``shardings``' (default: like ``want``'s)."""
    assert jax.tree.structure(got) == jax.tree.structure(want), (
        jax.tree.structure(got),
        jax.tree.structure(want),
    )
    targets = jax.tree.leaves(shardings if shardings is not None else want)
    for (path, g), w, t in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), targets, strict=True
    ):
        where = jax.tree_util.keystr(path)
        assert type(g) is type(w) or (isinstance(g, jax.Array) and isinstance(w, jax.Array)), (
            where,
            type(g),
            type(w),
        )
        if isinstance(w, jax.Array):
            assert g.dtype == w.dtype, (where, g.dtype, w.dtype)
            assert g.sharding.is_equivalent_to(_concrete(t.sharding), w.ndim), (
                where,
                g.sharding,
                t.sharding,
            )
            if is_key(w):
                assert jax.random.key_impl(g) == jax.random.key_impl(w), where
                g, w = jax.random.key_data(g), jax.random.key_data(w)
            assert g.shape == w.shape and np.array_equal(
                np.asarray(g).reshape(-1).view(np.uint8), np.asarray(w).reshape(-1).view(np.uint8)
            ), where
        else:
            assert g == w, (where, g, w)


def _concrete(sharding: Any) -> Any:
    """An AbstractMesh sharding made concrete the way a load resolves it."""
    mesh = getattr(sharding, "mesh", None)
    if isinstance(mesh, jax.sharding.AbstractMesh):
        return NamedSharding(
            jax.make_mesh(tuple(mesh.axis_sizes), tuple(mesh.axis_names)), sharding.spec
        )
    return sharding


def abstract_of(tree: Any) -> Any:
    return jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            if isinstance(x, jax.Array)
            else x
        ),
        tree,
    )


# ------------------------------------------------------------------------------------------
# Typed PRNG keys
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keys() -> dict[str, Any]:
    mesh = jax.make_mesh((8,), ("x",))
    k = jax.random.key(7)
    return {
        "threefry": k,
        "rbg": jax.random.key(3, impl="rbg"),
        "unsafe_rbg": jax.random.key(5, impl="unsafe_rbg"),
        "batch": jax.device_put(jax.random.split(k, 16), NamedSharding(mesh, P("x"))),
        "grid": jax.device_put(
            jax.random.split(jax.random.key(1, impl="rbg"), (4, 6)),
            NamedSharding(jax.make_mesh((2, 4), ("a", "b")), P("a")),
        ),
        "w": put(np.arange(16.0, dtype=np.float32), mesh, P("x")),
    }


def test_typed_keys_round_trip_with_and_without_an_abstract_tree(
    tmp_path: Path, keys: dict[str, Any]
) -> None:
    ckpt = mp.save(tmp_path / "c", keys)
    assert_same(mp.load(ckpt), keys)
    assert_same(mp.load(ckpt, abstract_of(keys)), keys)
    meta = mp.metadata(ckpt).tree
    assert meta["batch"].shape == (16,) and meta["batch"].dtype == keys["batch"].dtype
    assert meta["grid"].shape == (4, 6) and meta["rbg"].dtype == keys["rbg"].dtype
    assert mp.verify(ckpt).ok


def test_typed_keys_reshard_on_load(tmp_path: Path, keys: dict[str, Any]) -> None:
    ckpt = mp.save(tmp_path / "c", keys)
    other = jax.make_mesh((2, 4), ("p", "q"))
    abstract = {
        "batch": jax.ShapeDtypeStruct(
            (16,), keys["batch"].dtype, sharding=NamedSharding(other, P(("p", "q")))
        )
    }
    got = mp.load(ckpt, abstract, partial=True)["batch"]
    assert got.sharding.spec == P(("p", "q")) and np.array_equal(
        jax.random.key_data(got), jax.random.key_data(keys["batch"])
    )


def test_typed_keys_interoperate_with_orbax(tmp_path: Path, keys: dict[str, Any]) -> None:
    ours = mp.save(tmp_path / "ours", keys)
    assert_same(ocp.load(ours, abstract_of(keys)), keys)
    theirs = tmp_path / "theirs"
    ocp.save(theirs, keys)
    assert_same(mp.load(theirs), keys)
    assert_same(mp.load(theirs, abstract_of(keys)), keys)


def test_asking_for_other_keys_is_a_clear_error(tmp_path: Path, keys: dict[str, Any]) -> None:
    ckpt = mp.save(tmp_path / "c", keys)
    wrong_impl = {
        "threefry": jax.ShapeDtypeStruct(
            (), jax.random.key(0, impl="rbg").dtype, sharding=keys["threefry"].sharding
        )
    }
    with pytest.raises(mp.StructureMismatchError, match=r"(?s)'threefry'.*rbg.*threefry2x32"):
        mp.load(ckpt, wrong_impl, partial=True)
    wrong_shape = {
        "batch": jax.ShapeDtypeStruct((8,), keys["batch"].dtype, sharding=keys["batch"].sharding)
    }
    with pytest.raises(mp.StructureMismatchError, match=r"'batch'.*\(8,\).*\(16,\)"):
        mp.load(ckpt, wrong_shape, partial=True)
    keys_for_data = {
        "w": jax.ShapeDtypeStruct((16,), keys["threefry"].dtype, sharding=keys["w"].sharding)
    }
    with pytest.raises(mp.StructureMismatchError, match="'w'.*PRNG keys"):
        mp.load(ckpt, keys_for_data, partial=True)


def test_a_leaf_that_cannot_be_saved_names_its_path(tmp_path: Path) -> None:
    class Opaque:
        pass

    with pytest.raises(mp.UnsupportedLeafError, match=r"'model\.layers\.1\.cache'"):
        mp.save(tmp_path / "c", {"model": {"layers": [{"w": np.ones(2)}, {"cache": Opaque()}]}})
    assert not (tmp_path / "c").exists()


# ------------------------------------------------------------------------------------------
# Abstract trees on an AbstractMesh
# ------------------------------------------------------------------------------------------


def test_abstract_trees_from_eval_shape_on_an_abstract_mesh(tmp_path: Path) -> None:
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    with jax.set_mesh(mesh):
        state = {"w": jnp.arange(64.0).reshape(8, 8), "b": jnp.ones((8,), jnp.bfloat16)}
        state = {
            "w": jax.device_put(state["w"], NamedSharding(mesh, P("data", "model"))),
            "b": state["b"],
        }
        abstract = jax.eval_shape(
            lambda: {
                "w": jnp.zeros((8, 8), out_sharding=P(None, "model")),
                "b": jnp.zeros((8,), jnp.bfloat16),
            }
        )
    assert isinstance(abstract["w"].sharding.mesh, jax.sharding.AbstractMesh)
    ckpt = mp.save(tmp_path / "c", state)
    got = mp.load(ckpt, abstract)  # outside the mesh context: the devices of the same axes
    assert got["w"].sharding.spec == P(None, "model") and isinstance(
        got["w"].sharding.mesh, jax.sharding.Mesh
    )
    assert np.array_equal(got["w"], state["w"]) and np.array_equal(got["b"], state["b"])
    with jax.set_mesh(mesh):  # and inside it: that mesh
        assert np.array_equal(mp.load(ckpt, abstract)["w"], state["w"])
    odd = jax.ShapeDtypeStruct(
        (8, 8),
        jnp.float32,
        sharding=NamedSharding(jax.sharding.AbstractMesh((3, 2), ("data", "model")), P("data")),
    )
    with pytest.raises(mp.StructureMismatchError, match=r"(?s)'w'.*AbstractMesh.*jax.set_mesh"):
        mp.load(ckpt, {"w": odd, "b": abstract["b"]})


# ------------------------------------------------------------------------------------------
# Flax NNX, Linen, Optax
# ------------------------------------------------------------------------------------------


class Counter(nnx.Variable):  # a custom Variable type
    pass


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
        self.linear = nnx.Linear(4, 16, kernel_init=init, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.dropout = nnx.Dropout(0.3, rngs=rngs)
        self.out = nnx.Linear(16, 2, rngs=rngs)
        self.calls = Counter(jnp.zeros((), jnp.int32))

    def __call__(self, x: jax.Array) -> jax.Array:
        self.calls[...] += 1
        return self.out(self.dropout(nnx.relu(self.bn(self.linear(x)))))


MESH_AXES = ((4, 2), ("data", "model"))


def make(seed: int) -> tuple[Model, nnx.Optimizer]:
    model = Model(nnx.Rngs(seed, dropout=seed + 1))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


@nnx.jit
def train_step(model: Model, opt: nnx.Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
    def loss_fn(m: Model) -> jax.Array:
        return jnp.mean((m(x) - y) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss


@nnx.jit
def forward(model: Model, x: jax.Array) -> jax.Array:
    return model(x)


def batch(i: int) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(i)
    return jnp.asarray(rng.standard_normal((8, 4), dtype=np.float32)), jnp.asarray(
        rng.standard_normal((8, 2), dtype=np.float32)
    )


def test_nnx_state_round_trips_with_every_variable_type(tmp_path: Path) -> None:
    mesh = jax.make_mesh(*MESH_AXES)
    with jax.set_mesh(mesh):
        model, opt = make(0)
        train_step(model, opt, *batch(0))
        state = nnx.state((model, opt))
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: make(0)))
    leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    assert {type(v).__name__ for v in leaves} >= {
        "Param",
        "BatchStat",
        "RngKey",
        "RngCount",
        "Counter",
        "OptState",
    }
    ckpt = mp.save(tmp_path / "c", state)
    got = mp.load(ckpt, abstract)
    assert isinstance(got, nnx.State)
    assert_same(got, state, shardings=abstract)  # placed as the abstract tree says
    got_leaves = jax.tree.leaves(got, is_leaf=lambda x: isinstance(x, nnx.Variable))
    assert [type(v) for v in got_leaves] == [type(v) for v in leaves]
    # split/merge: the graph definition stays in code, the state comes from the checkpoint
    merged_model, merged_opt = nnx.merge(graphdef, got)
    assert_same(nnx.state(merged_model), nnx.state(model), shardings=nnx.state(merged_model))
    assert_same(nnx.state(merged_opt), nnx.state(opt), shardings=nnx.state(merged_opt))
    with jax.set_mesh(mesh):  # same weights, same statistics, same dropout stream: the same output
        assert np.array_equal(forward(merged_model, batch(1)[0]), forward(model, batch(1)[0]))


def test_a_resumed_nnx_training_loop_ends_bit_identical(tmp_path: Path) -> None:
    """Dropout keys, batch statistics, Adam moments and step counts all resume exactly."""
    mesh = jax.make_mesh(*MESH_AXES)
    with jax.set_mesh(mesh):
        model, opt = make(0)
        for i in range(6):
            train_step(model, opt, *batch(i))
        uninterrupted = nnx.state((model, opt))

        model, opt = make(0)
        for i in range(3):
            train_step(model, opt, *batch(i))
        mp.save(tmp_path / "3", nnx.state((model, opt)))
        del model, opt

        fresh_model, fresh_opt = make(42)  # another seed: everything must come from the checkpoint
        restored = mp.load(tmp_path / "3", nnx.state(nnx.eval_shape(lambda: make(0))))
        nnx.update((fresh_model, fresh_opt), restored)
        for i in range(3, 6):
            train_step(fresh_model, fresh_opt, *batch(i))
        resumed = nnx.state((fresh_model, fresh_opt))
    assert_same(resumed, uninterrupted, shardings=resumed)


def test_linen_train_state_with_partitioned_boxes(tmp_path: Path) -> None:
    import flax.linen as nn
    from flax.training import train_state

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            x = nn.Dense(
                8, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
            )(x)
            return nn.Dense(2)(nn.relu(x))

    block = Block()
    params = block.init(jax.random.key(0), jnp.ones((1, 4)))["params"]
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    state = train_state.TrainState.create(apply_fn=block.apply, params=params, tx=tx)
    state = state.apply_gradients(grads=jax.tree.map(jnp.ones_like, state.params))
    boxed = [
        x
        for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nn.Partitioned))
        if isinstance(x, nn.Partitioned)
    ]
    assert boxed, "the test needs nn.Partitioned boxes"
    ckpt = mp.save(tmp_path / "c", state)
    empty = train_state.TrainState.create(
        apply_fn=block.apply, params=jax.tree.map(jnp.zeros_like, params), tx=tx
    )
    got = mp.load(ckpt, abstract_of(empty))
    assert type(got) is train_state.TrainState and got.step == 1
    assert isinstance(got.params["Dense_0"]["kernel"], nn.Partitioned) and got.params["Dense_0"][
        "kernel"
    ].names == (None, "model")
    assert type(got.opt_state[1][0]).__name__ == "ScaleByAdamState"
    assert_same(got, state)


def test_optax_states_keep_their_namedtuples(tmp_path: Path) -> None:
    params = {"dense": {"kernel": jnp.arange(6.0).reshape(2, 3), "bias": jnp.zeros(3)}}
    for name, tx in {
        "adam": optax.adam(1e-3),
        "sgd": optax.sgd(0.1),
        "chain": optax.chain(
            optax.clip_by_global_norm(1.0), optax.adamw(optax.linear_schedule(1e-3, 0.0, 100))
        ),
        "inject": optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
    }.items():
        opt_state = tx.init(params)
        _, opt_state = tx.update(jax.tree.map(jnp.ones_like, params), opt_state, params), opt_state
        ckpt = mp.save(tmp_path / name, {"params": params, "opt": opt_state})
        got = mp.load(ckpt, abstract_of({"params": params, "opt": tx.init(params)}))
        assert_same(got["opt"], opt_state)
        assert jax.tree.structure(got) == jax.tree.structure(
            {"params": params, "opt": opt_state}
        ), name
