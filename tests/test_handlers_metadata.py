"""metadata() (everything but the array data, without reading it) and checkpointable handlers:
JSON, StatefulCheckpointable objects, custom handlers per context and in the global registry."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost._checkpoint import _handlers
from tests._helpers import assert_tree_equal, listing, put, same_bits

# ------------------------------------------------------------------------------------------
# metadata()
# ------------------------------------------------------------------------------------------


def metadata_state(mesh: jax.sharding.Mesh) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {
        "params": {
            "w": put(rng.standard_normal((64, 128), dtype=np.float32), mesh, P("data", "model")),
            "emb": put(
                jnp.asarray(rng.standard_normal((32, 64)), dtype=jnp.bfloat16),
                mesh,
                P(None, "model"),
            ),
            "b": put(rng.standard_normal((128,), dtype=np.float32), mesh, P()),
            "odd": put(rng.standard_normal((3, 5), dtype=np.float32), mesh, P()),
            "dev": jax.device_put(
                rng.standard_normal((40, 40), dtype=np.float32), jax.devices()[4]
            ),
        },
        "host": rng.standard_normal((50, 20)).astype(np.float16),
        "step": 1234,
        "lr": np.float32(3e-4),
        "run": "exp-9",
        "none": None,
        "empty": {},
        "layers": [put(np.ones((16, 8), np.int32), mesh, P("data"))],
    }


@pytest.mark.parametrize("use_ocdbt", [True, False], ids=["ocdbt", "zarr3"])
def test_metadata_reports_everything_without_reading_array_data(
    tmp_path: Path, mesh24: jax.sharding.Mesh, use_ocdbt: bool
) -> None:
    state = metadata_state(mesh24)
    custom = {
        "run": {"name": "r1", "seed": 3},
        "tags": ["a", "b"],
        "lr": 0.1,
        "ok": True,
        "none": None,
    }
    before = time.time_ns()
    with mp.Context(
        saving=mp.SaveOptions(use_ocdbt=use_ocdbt, chunk_byte_size=2048, min_write_bytes=0)
    ):
        ckpt = mp.save(tmp_path / "c", state, custom_metadata=custom)
    after = time.time_ns()

    # Remove every array chunk: what metadata() returns must come from the small files only.
    if use_ocdbt:
        chunk_dirs = list((ckpt / "state").glob("ocdbt.process_*/d"))
    else:
        chunk_dirs = list((ckpt / "state").glob("*/c"))  # a folder, or a file for 0-d arrays
    assert chunk_dirs
    for d in chunk_dirs:
        shutil.rmtree(d) if d.is_dir() else d.unlink()

    meta = mp.metadata(ckpt)
    tree = meta.tree
    w = tree["params"]["w"]
    assert isinstance(w, mp.LeafMetadata)
    assert (w.name, w.value_type, w.shape, w.dtype) == (
        "params.w",
        "jax.Array",
        (64, 128),
        np.dtype(np.float32),
    )
    assert w.sharding == mp.ShardingSpec.from_jax(state["params"]["w"].sharding)
    assert w.sharding.to_jax() == state["params"]["w"].sharding
    assert w.write_shape == (32, 32)  # the shard shape
    assert (
        w.chunk_shape == (16, 32) and 16 * 32 * 4 <= 2048
    )  # cut to chunk_byte_size: bands of whole rows

    emb = tree["params"]["emb"]
    assert emb.dtype == jnp.bfloat16 and emb.shape == (32, 64)
    assert emb.write_shape == (16, 16)  # (32, 16) shard, 2 replicas share the writing
    assert tree["params"]["b"].write_shape == (16,)  # 8 replicas of 128
    assert tree["params"]["odd"].write_shape == (3, 5)
    dev = tree["params"]["dev"]
    assert dev.sharding == mp.ShardingSpec.single(4) and dev.write_shape == (40, 40)
    assert dev.chunk_shape is not None and int(np.prod(dev.chunk_shape)) * 4 <= 2048

    host = tree["host"]
    assert (host.value_type, host.shape, host.dtype, host.sharding) == (
        "np.ndarray",
        (50, 20),
        np.dtype(np.float16),
        None,
    )
    assert (tree["step"].value_type, tree["step"].shape, tree["step"].dtype) == (
        "scalar",
        (),
        np.dtype(np.int64),
    )
    assert tree["lr"].dtype == np.float32
    assert tree["run"].value_type == "string" and tree["run"].shape is None
    assert tree["none"] is None and tree["empty"] == {}
    assert isinstance(tree["layers"], list) and tree["layers"][0].name == "layers.0"

    assert meta.custom_metadata == custom
    assert before <= meta.init_timestamp_nsecs <= meta.commit_timestamp_nsecs <= after
    assert set(meta.checkpointables) == {"state"} and meta.checkpointables["state"] is tree
    assert meta.item_handlers["state"].endswith("PyTreeHandler")
    assert "custom_metadata" in repr(meta)

    # The array data really is gone: a load fails, clearly.
    with pytest.raises((ValueError, FileNotFoundError), match="params.w|host|missing|damaged"):
        mp.load(ckpt)


def test_metadata_of_several_checkpointables(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    params = {"w": put(np.ones((8, 8), np.float32), mesh24, P("data"))}
    with mp.Context(handlers=[(mp.JsonHandler(), "config")]):
        ckpt = mp.save_checkpointables(
            tmp_path / "c",
            {"params": params, "config": {"lr": 0.5}, "data": Position(3)},
            metrics={"loss": 1.5},
        )
    meta = mp.metadata(ckpt)
    assert set(meta.checkpointables) == {"params", "config", "data"}
    assert meta.checkpointables["params"]["w"].shape == (8, 8)
    assert meta.checkpointables["config"] == {"lr": 0.5}
    assert meta.checkpointables["data"] is None
    assert meta.tree is meta.checkpointables["params"]  # the one PyTree
    assert meta.metrics == {"loss": 1.5} and meta.custom_metadata == {}


# ------------------------------------------------------------------------------------------
# StatefulCheckpointable
# ------------------------------------------------------------------------------------------


class Position:
    """A data iterator that saves and restores its position (and its shuffling RNG)."""

    def __init__(self, index: int = 0, seed: int = 0) -> None:
        self.index = index
        self.rng = np.random.default_rng(seed)

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        self.index += 1
        return int(self.rng.integers(1 << 30))

    def save(self, directory: Path) -> Callable[[], None]:
        snapshot = {"index": self.index, "rng": self.rng.bit_generator.state}  # at call time

        def write() -> None:  # in the background
            (directory / "position.json").write_text(json.dumps(snapshot))

        return write

    def load(self, directory: Path) -> None:
        saved = json.loads((directory / "position.json").read_text())
        self.index = saved["index"]
        self.rng.bit_generator.state = saved["rng"]


def test_stateful_checkpointable_round_trip(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    it = Position(seed=42)
    for _ in range(5):
        next(it)
    assert isinstance(it, mp.StatefulCheckpointable)
    state = {"w": put(np.arange(64, dtype=np.float32).reshape(8, 8), mesh24, P("data"))}
    handle = mp.save_checkpointables_async(tmp_path / "c", {"state": state, "dataset": it})
    expected_next = [
        next(it) for _ in range(3)
    ]  # the caller goes on; the checkpoint must not see it
    handle.result(timeout=60)
    assert (tmp_path / "c" / "dataset" / "position.json").exists()

    fresh = Position(seed=0)
    out = mp.load_checkpointables(tmp_path / "c", {"dataset": fresh})
    assert out == {"dataset": fresh} and fresh.index == 5
    assert [next(fresh) for _ in range(3)] == expected_next  # resumes exactly where it was saved
    # The PyTree alongside is loaded on its own, and load() picks it by name.
    assert_tree_equal(mp.load(tmp_path / "c"), state)
    with pytest.raises(TypeError, match="pass the object to restore into"):
        mp.load_checkpointables(tmp_path / "c", {"dataset": None})


def test_stateful_save_may_write_synchronously(tmp_path: Path) -> None:
    class Counter:
        def __init__(self, n: int = 0) -> None:
            self.n = n

        def save(self, directory: Path) -> None:
            (directory / "n.txt").write_text(str(self.n))

        def load(self, directory: Path) -> None:
            self.n = int((directory / "n.txt").read_text())

    mp.save_checkpointables(tmp_path / "c", {"counter": Counter(11)})
    c = Counter()
    mp.load_checkpointables(tmp_path / "c", {"counter": c})
    assert c.n == 11


# ------------------------------------------------------------------------------------------
# JSON handler
# ------------------------------------------------------------------------------------------

CONFIG = {
    "lr": 0.001,
    "layers": [64, 64, 10],
    "name": "mlp ✓",
    "dropout": None,
    "flags": {"bf16": True},
    "eps": 1e-8,
}


def test_json_handler_per_context(tmp_path: Path) -> None:
    config = json.loads(json.dumps(CONFIG))
    with mp.Context(handlers=[(mp.JsonHandler(), "config")]):
        handle = mp.save_checkpointables_async(
            tmp_path / "c", {"config": config, "state": {"step": 3}}
        )
        config["lr"] = 1.0  # mutated after the call: not in the checkpoint
        config["layers"].append(1)
        handle.result(timeout=60)
    ckpt = tmp_path / "c"
    assert json.loads((ckpt / "config" / "data.json").read_text()) == CONFIG
    meta = json.loads((ckpt / "_CHECKPOINT_METADATA").read_text())
    assert meta["item_handlers"]["config"].endswith("JsonHandler")
    assert meta["item_handlers"]["state"].endswith(
        "PyTreeHandler"
    )  # name-scoped: 'state' is a PyTree
    assert (ckpt / "state" / "_METADATA").exists()
    # Loading needs no registration: the recorded handler is a built-in.
    out = mp.load_checkpointables(ckpt)
    assert out["config"] == CONFIG and out["state"] == {"step": 3}
    assert mp.metadata(ckpt).checkpointables["config"] == CONFIG


def test_json_handler_registered_globally_by_name(tmp_path: Path) -> None:
    handler = mp.JsonHandler()
    mp.register_handler(handler, name="config")
    try:
        mp.save_checkpointables(tmp_path / "c", {"config": CONFIG, "other": {"a": 1}})
    finally:
        _handlers._registry.remove((handler, "config"))
    assert (tmp_path / "c" / "config" / "data.json").exists()
    assert (tmp_path / "c" / "other" / "_METADATA").exists()  # only the named one is JSON
    assert mp.load_checkpointables(tmp_path / "c", {"config": None})["config"] == CONFIG


def test_json_handler_rejects_what_json_cannot_hold(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="not JSON-serializable"):
        mp.JsonHandler().save(tmp_path, {"x": object()}, None)  # type: ignore[arg-type]
    assert not mp.JsonHandler().is_handleable({"x": np.ones(2)})
    assert listing(tmp_path) == []


# ------------------------------------------------------------------------------------------
# Custom handlers
# ------------------------------------------------------------------------------------------


class Vocab:
    def __init__(self, words: list[str]) -> None:
        self.words = list(words)


class VocabHandler:
    """A custom CheckpointableHandler: one word per line."""

    typestr = "tests.VocabHandler"

    def __init__(self) -> None:
        self.saved: list[str] = []

    def is_handleable(self, obj: Any) -> bool:
        return isinstance(obj, Vocab)

    def save(self, directory: Path, obj: Any, call: Any) -> Callable[[], None]:
        words = list(obj.words)  # snapshot now
        self.saved.append(directory.name)

        def write() -> None:
            (directory / "vocab.txt").write_text("\n".join(words))

        return write

    def load(self, directory: Path, abstract: Any, call: Any) -> Vocab:
        return Vocab((directory / "vocab.txt").read_text().split("\n"))

    def metadata(self, directory: Path) -> dict[str, int]:
        return {"size": len((directory / "vocab.txt").read_text().split("\n"))}


def test_custom_handler_per_context(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    handler = VocabHandler()
    assert isinstance(handler, mp.CheckpointableHandler)
    vocab = Vocab(["<pad>", "the", "cat"])
    state = {"w": put(np.ones((8, 4), np.float32), mesh24, P("data"))}
    with mp.Context(handlers=[handler]):
        mp.save_checkpointables(tmp_path / "c", {"vocab": vocab, "state": state})
        assert handler.saved == ["vocab"]
        out = mp.load_checkpointables(tmp_path / "c")
        assert isinstance(out["vocab"], Vocab) and out["vocab"].words == vocab.words
        assert_tree_equal(out["state"], state)
        assert mp.metadata(tmp_path / "c").checkpointables["vocab"] == {"size": 3}
    # Outside the context nobody knows the handler: a clear error on load, the rest still loads.
    with pytest.raises(TypeError, match=r"(?s)'vocab'.*tests.VocabHandler.*register_handler"):
        mp.load_checkpointables(tmp_path / "c")
    assert_tree_equal(mp.load_checkpointables(tmp_path / "c", {"state": None})["state"], state)
    assert same_bits(mp.load(tmp_path / "c")["w"], state["w"])
    # And saving an object no handler takes is a clear error that writes nothing.
    with pytest.raises(mp.UnsupportedLeafError):
        mp.save_checkpointables(tmp_path / "d", {"vocab": vocab})
    assert not (tmp_path / "d").exists() and not (tmp_path / "d.orbax-checkpoint-tmp").exists()


def test_handler_resolution_order(tmp_path: Path) -> None:
    """Context handlers first, then the global registry (newest first), then the built-ins."""

    class Tagged(VocabHandler):
        def __init__(self, tag: str) -> None:
            super().__init__()
            self.typestr = f"tests.Tagged.{tag}"

    global_handler, context_handler = Tagged("global"), Tagged("context")
    mp.register_handler(global_handler)
    try:
        mp.save_checkpointables(tmp_path / "g", {"v": Vocab(["a"])})
        with mp.Context(handlers=[context_handler]):
            mp.save_checkpointables(tmp_path / "c", {"v": Vocab(["b"])})
            with mp.Context():  # nested contexts inherit the handlers
                mp.save_checkpointables(tmp_path / "n", {"v": Vocab(["c"])})
    finally:
        _handlers._registry.remove((global_handler, None))
    assert global_handler.saved == ["v"] and context_handler.saved == ["v", "v"]
    for name, tag in (("g", "global"), ("c", "context"), ("n", "context")):
        item = json.loads((tmp_path / name / "_CHECKPOINT_METADATA").read_text())["item_handlers"][
            "v"
        ]
        assert item == f"tests.Tagged.{tag}"
    with pytest.raises(TypeError, match="not a CheckpointableHandler"):
        mp.register_handler(object())  # type: ignore[arg-type]


class Tagged:
    def __init__(self, tree: Any) -> None:
        self.tree = tree


class WrappingHandler:
    """A handler of its own around the built-in PyTree one: its background part waits for the
    wrapped one's and does more, ignoring what that wait returns."""

    typestr = mp.PyTreeHandler.typestr

    def __init__(self) -> None:
        self.inner = mp.PyTreeHandler()

    def is_handleable(self, obj: Any) -> bool:
        return isinstance(obj, Tagged)

    def save(self, directory: Any, obj: Any, call: Any) -> Callable[[], None]:
        pending = self.inner.save(directory, obj.tree, call)

        def background() -> None:
            pending.wait()  # (what it returns is not passed on)

        return background

    def load(self, directory: Any, abstract: Any, call: Any) -> Any:
        return self.inner.load(directory, abstract, call)

    def metadata(self, directory: Any) -> Any:
        return self.inner.metadata(directory)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_handler_wrapping_the_pytree_one_commits_a_whole_tree(
    tmp_path: Path, asynchronous: bool
) -> None:
    """The pytree's format files and merged view are the commit's: the tree is handed to it
    by the pytree's pending write itself, whatever a wrapping handler does with its wait
    (before: a committed folder without _METADATA, which no load could read)."""
    tree = {"a": np.arange(4, dtype=np.int32), "b": {"c": np.ones((2, 3), np.float32)}}
    with mp.Context(handlers=[WrappingHandler()]):
        if asynchronous:
            mp.save_checkpointables_async(tmp_path / "c", {"m": Tagged(tree)}).result(60)
        else:
            mp.save_checkpointables(tmp_path / "c", {"m": Tagged(tree)})
    assert (tmp_path / "c" / "m" / "_METADATA").is_file()
    got = mp.load_checkpointables(tmp_path / "c", {"m": None})["m"]
    assert same_bits(got["a"], tree["a"]) and same_bits(got["b"]["c"], tree["b"]["c"])
    assert mp.verify(tmp_path / "c").ok
