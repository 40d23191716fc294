"""metadata() without reading array data; handlers: JSON, stateful objects, custom, registry."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import milepost as mp


def test_metadata_reads_no_array_data(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    state = {
        "w": jax.device_put(np.ones((64, 64), np.float32), NamedSharding(mesh24, P("data", "model"))),
        "n": np.arange(5, dtype=np.int16),
        "step": 9,
        "tag": "x",
    }
    before = time.time_ns()
    with mp.Context(saving=mp.SaveOptions(chunk_byte_size=1024)):
        mp.save(tmp_path / "c", state, custom_metadata={"run": "r1", "lr": 0.1})
    # Remove every per-host data file (the chunks): metadata must still work, so it read none.
    data_dirs = list((tmp_path / "c" / "state").glob("ocdbt.process_*/d"))
    assert data_dirs
    for d in data_dirs:
        shutil.rmtree(d)
    meta = mp.metadata(tmp_path / "c")
    w = meta.tree["w"]
    assert (w.shape, w.dtype, w.value_type) == ((64, 64), np.dtype(np.float32), "jax.Array")
    assert w.write_shape == (32, 16) and w.chunk_shape == (16, 16)
    assert w.sharding == mp.ShardingSpec.from_jax(state["w"].sharding)
    assert meta.tree["n"].shape == (5,) and meta.tree["n"].dtype == np.int16 and meta.tree["n"].value_type == "np.ndarray"
    assert meta.tree["step"].value_type == "scalar" and meta.tree["tag"].value_type == "string"
    assert meta.custom_metadata == {"run": "r1", "lr": 0.1}
    assert before <= meta.init_timestamp_nsecs <= meta.commit_timestamp_nsecs <= time.time_ns()
    assert set(meta.checkpointables) == {"state"}
    with pytest.raises(ValueError):  # and the arrays really are gone
        mp.load(tmp_path / "c")


class Position:
    """A data iterator position that saves and restores itself."""

    def __init__(self, index: int = 0) -> None:
        self.index = index

    def save(self, directory: Path) -> Callable[[], None]:
        snapshot = self.index

        def write() -> None:
            (directory / "position.json").write_text(json.dumps({"index": snapshot}))

        return write

    def load(self, directory: Path) -> None:
        self.index = json.loads((directory / "position.json").read_text())["index"]


def test_stateful_and_json_checkpointables(tmp_path: Path) -> None:
    it = Position(41)
    assert isinstance(it, mp.StatefulCheckpointable)
    with mp.Context(handlers=[(mp.JsonHandler(), "config")]):
        h = mp.save_checkpointables_async(tmp_path / "c", {"state": {"x": np.arange(3)}, "data": it, "config": {"lr": 0.5, "layers": [1, 2]}})
        it.index = 99  # after the call: must not leak into the checkpoint
        h.result(60)
    assert (tmp_path / "c" / "config" / "data.json").exists()
    fresh = Position()
    out = mp.load_checkpointables(tmp_path / "c", {"data": fresh, "config": None})
    assert out["data"] is fresh and fresh.index == 41
    assert out["config"] == {"lr": 0.5, "layers": [1, 2]}
    with pytest.raises(TypeError, match="pass the object to restore into"):
        mp.load_checkpointables(tmp_path / "c", {"data": None})


class NpzHandler:
    """A custom handler: one .npz file per checkpointable."""

    typestr = "tests.NpzHandler"

    def is_handleable(self, obj: Any) -> bool:
        return isinstance(obj, dict) and all(isinstance(v, np.ndarray) for v in obj.values())

    def save(self, directory: Path, obj: Any, call: Any) -> Callable[[], None]:
        arrays = {k: v.copy() for k, v in obj.items()}
        return lambda: np.savez(directory / "arrays.npz", **arrays)

    def load(self, directory: Path, abstract: Any, call: Any) -> Any:
        with np.load(directory / "arrays.npz") as f:
            return {k: f[k] for k in f.files}

    def metadata(self, directory: Path) -> Any:
        with np.load(directory / "arrays.npz") as f:
            return {k: f[k].shape for k in f.files}


def test_custom_handler_per_context_and_global(tmp_path: Path) -> None:
    handler = NpzHandler()
    assert isinstance(handler, mp.CheckpointableHandler)
    with mp.Context(handlers=[handler]):
        mp.save_checkpointables(tmp_path / "a", {"stats": {"m": np.arange(4.0)}})
        assert mp.metadata(tmp_path / "a").checkpointables["stats"] == {"m": (4,)}
        assert np.array_equal(mp.load_checkpointables(tmp_path / "a")["stats"]["m"], np.arange(4.0))
    assert (tmp_path / "a" / "stats" / "arrays.npz").exists()
    # Outside the context the handler is unknown: a clear error says how to register it.
    with pytest.raises(TypeError, match="register_handler"):
        mp.load_checkpointables(tmp_path / "a")
    mp.register_handler(handler, name="stats")
    try:
        assert np.array_equal(mp.load_checkpointables(tmp_path / "a")["stats"]["m"], np.arange(4.0))
        # name-scoped: another checkpointable of the same shape still goes to the PyTree handler
        mp.save_checkpointables(tmp_path / "b", {"state": {"m": np.arange(2.0)}})
        assert not (tmp_path / "b" / "state" / "arrays.npz").exists()
    finally:
        from milepost import _handlers

        _handlers._registry.clear()
    with pytest.raises(TypeError, match="not a CheckpointableHandler"):
        mp.register_handler(object())  # type: ignore[arg-type]


def test_options_are_snapshotted_when_the_call_starts(tmp_path: Path) -> None:
    with mp.Context(saving=mp.SaveOptions(compression="zstd")):
        h = mp.save_async(tmp_path / "c", {"x": np.zeros(1000)})
    h.result(60)
    header = json.loads(
        __import__("tensorstore").KvStore.open({"driver": "ocdbt", "base": f"file://{tmp_path / 'c' / 'state'}/"})
        .result().read("x/zarr.json").result().value
    )
    assert any(c["name"] == "zstd" for c in header["codecs"][0]["configuration"]["codecs"])
    with mp.Context(loading=mp.LoadOptions(memory_budget_bytes=1024)) as opts:
        assert opts.loading.memory_budget_bytes == 1024
        assert opts.saving.compression is None
        assert np.array_equal(mp.load(tmp_path / "c")["x"], np.zeros(1000))
