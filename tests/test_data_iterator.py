"""Data iterators (Grain's, or any object with get_state/set_state) as checkpointables: a
restored iterator yields exactly what the uninterrupted one would have, in every mode, in the
layout Orbax writes (``process_<i>-of-<n>.json``), both ways with Orbax."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost.training import Checkpointer
from tests import _training_mc

STATEFUL = (
    "orbax.checkpoint.experimental.v1._src.handlers.stateful_checkpointable_handler."
    "StatefulCheckpointableHandler"
)


class Counter:
    """A minimal data iterator: the next batch is a function of its position (a JSON state)."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.position = 0

    def __iter__(self) -> Iterator[list[int]]:
        return self

    def __next__(self) -> list[int]:
        self.position += 1
        rng = np.random.default_rng([self.seed, self.position])
        return rng.integers(0, 1000, 4).tolist()

    def get_state(self) -> dict[str, Any]:
        return {"seed": self.seed, "position": self.position}

    def set_state(self, state: dict[str, Any]) -> None:
        self.seed, self.position = state["seed"], state["position"]


class BytesCounter(Counter):
    """Like Grain's DataLoader iterator: get_state gives bytes of JSON text."""

    def get_state(self) -> bytes:  # type: ignore[override]
        return json.dumps({"p": self.position, "s": self.seed}).encode()

    def set_state(self, state: bytes) -> None:  # type: ignore[override]
        assert isinstance(state, bytes)
        d = json.loads(state)
        self.seed, self.position = d["s"], d["p"]


def grain_iter(seed: int = 1) -> Any:
    grain = pytest.importorskip("grain")
    data = grain.MapDataset.range(40).shuffle(seed=seed).map(lambda x: x * 3).batch(2)
    return iter(data.to_iter_dataset(grain.ReadOptions(num_threads=0)))


def grain_loader_iter(seed: int = 3) -> Any:
    grain = pytest.importorskip("grain")
    loader = grain.DataLoader(
        data_source=grain.sources.RangeDataSource(0, 40, 1),
        sampler=grain.samplers.IndexSampler(
            40, shuffle=True, seed=seed, num_epochs=1, shard_options=grain.sharding.NoSharding()
        ),
        worker_count=0,
    )
    return iter(loader)


def take(it: Any, n: int) -> list[Any]:
    return [np.asarray(next(it)).tolist() for _ in range(n)]


MAKERS = {
    "counter": Counter,
    "bytes": BytesCounter,
    "grain_dataset": grain_iter,
    "grain_loader": grain_loader_iter,
}


@pytest.mark.parametrize("kind", list(MAKERS))
def test_restored_iterator_yields_what_the_uninterrupted_one_would(
    tmp_path: Path, kind: str
) -> None:
    make = MAKERS[kind]
    it = make()
    take(it, 3)
    state = {"w": np.arange(6, dtype=np.float32), "step": 3}
    mp.save_checkpointables(tmp_path / "c", {"state": state, "data_iter": it})
    expected = take(it, 5)  # the uninterrupted run goes on

    folder = tmp_path / "c" / "data_iter"
    assert sorted(p.name for p in folder.iterdir()) == ["process_0-of-1.json"]
    meta = json.loads((tmp_path / "c" / "_CHECKPOINT_METADATA").read_text())
    assert meta["item_handlers"]["data_iter"] == STATEFUL

    fresh = make()
    out = mp.load_checkpointables(tmp_path / "c", {"state": None, "data_iter": fresh})
    assert out["data_iter"] is fresh and out["state"]["step"] == 3
    assert np.array_equal(out["state"]["w"], state["w"])
    assert take(fresh, 5) == expected


def test_the_file_holds_what_grain_writes(tmp_path: Path) -> None:
    """A JSON value is written as json.dumps(state, indent=4); bytes as they are."""
    it, b = Counter(5), BytesCounter(6)
    take(it, 2)
    take(b, 3)
    mp.save_checkpointables(tmp_path / "c", {"a": it, "b": b})
    text = (tmp_path / "c" / "a" / "process_0-of-1.json").read_text()
    assert text == json.dumps({"seed": 5, "position": 2}, indent=4)
    raw = (tmp_path / "c" / "b" / "process_0-of-1.json").read_bytes()
    assert raw == b.get_state()


def test_the_state_is_a_snapshot_taken_when_save_returns(tmp_path: Path) -> None:
    it = Counter()
    take(it, 2)
    handle = mp.save_checkpointables_async(tmp_path / "c", {"data_iter": it})
    expected = take(it, 4)  # advance before the background part writes
    handle.result()
    fresh = Counter()
    mp.load_checkpointables(tmp_path / "c", {"data_iter": fresh})
    assert fresh.position == 2 and take(fresh, 4) == expected


def test_checkpointer_saves_and_restores_the_iterator_in_place(tmp_path: Path) -> None:
    it = grain_iter()
    with Checkpointer(tmp_path / "run") as ckpt:
        for step in range(4):
            next(it)
            ckpt.save(step, {"w": np.full(4, step, np.float32), "step": step}, data_iter=it)
        ckpt.wait()
    expected = take(it, 6)
    with Checkpointer(tmp_path / "run") as again:
        fresh = grain_iter()
        state = again.load(None, {"w": np.zeros(4, np.float32), "step": 0}, data_iter=fresh)
        assert state["step"] == 3 and np.array_equal(state["w"], np.full(4, 3, np.float32))
        assert take(fresh, 6) == expected
        # an earlier step restores the earlier position
        older = grain_iter()
        again.load(1, None, data_iter=older)
        reference = grain_iter()
        take(reference, 2)
        assert take(older, 3) == take(reference, 3)
        # without data_iter the tree alone loads
        assert again.load(None)["step"] == 3


def test_on_a_ray_slice_the_iterator_lives_on_the_controller(
    tmp_path: Path, ray_runtime: Any
) -> None:
    it = grain_iter()
    take(it, 3)
    values = np.arange(32 * 16, dtype=np.float32).reshape(32, 16)
    with mp.Slice.start(hosts=2, devices_per_host=2) as s:
        mesh = s.mesh({"data": 2, "model": 2})
        sharding = mesh.sharding(P("data", "model"))
        with Checkpointer(tmp_path / "run") as ckpt:
            ckpt.save(7, {"w": s.put(values, sharding), "step": 7}, data_iter=it)
            ckpt.wait()
        expected = take(it, 5)
        with Checkpointer(tmp_path / "run") as again:
            fresh = grain_iter()
            abstract = {"w": mp.AbstractArray((32, 16), np.float32, sharding), "step": 0}
            state = again.load(7, abstract, data_iter=fresh)
            assert isinstance(state["w"], mp.RemoteArray)
            assert np.array_equal(s.fetch(state["w"]), values) and state["step"] == 7
        assert take(fresh, 5) == expected
    files = sorted(p.name for p in (tmp_path / "run" / "7" / "data_iter").iterdir())
    assert files == ["process_0-of-1.json"]


def test_multi_controller_each_process_restores_its_own_iterator(tmp_path: Path) -> None:
    pytest.importorskip("grain")
    root = tmp_path / "run"
    outs = _training_mc.launch("data_iter", root)
    for o in outs:
        assert o["exact"] == 4 and o["resumed"] == o["expected"], o
        assert o["files"] == ["process_0-of-2.json", "process_1-of-2.json"], o
    assert outs[0]["expected"] != outs[1]["expected"]  # each process had its own data
    # A job of another size has no file of its own: a clear error naming the fix.
    with pytest.raises(mp.StructureMismatchError, match=r"job of 2 processes.*Resume with 2"):
        mp.load_checkpointables(root / "2", {"data_iter": grain_iter()})


# -- Orbax, both ways ----------------------------------------------------------------------


def test_orbax_v1_reads_what_milepost_saved(tmp_path: Path) -> None:
    ocp = pytest.importorskip("orbax.checkpoint.experimental.v1")
    it = grain_iter()
    take(it, 4)
    mp.save_checkpointables(tmp_path / "c", {"state": {"a": np.arange(3)}, "data_iter": it})
    expected = take(it, 5)
    fresh = grain_iter()
    ocp.load_checkpointables(tmp_path / "c", {"data_iter": fresh})
    assert take(fresh, 5) == expected


def test_milepost_reads_what_orbax_v1_saved(tmp_path: Path) -> None:
    ocp = pytest.importorskip("orbax.checkpoint.experimental.v1")
    it = grain_iter()
    take(it, 4)
    ocp.save_checkpointables(tmp_path / "c", {"state": {"a": np.arange(3)}, "data_iter": it})
    expected = take(it, 5)
    fresh = grain_iter()
    out = mp.load_checkpointables(tmp_path / "c", {"state": None, "data_iter": fresh})
    assert out["data_iter"] is fresh and take(fresh, 5) == expected


def test_orbax_checkpoint_manager_with_grains_handler_both_ways(tmp_path: Path) -> None:
    grain = pytest.importorskip("grain")
    ocp = pytest.importorskip("orbax.checkpoint")
    # Orbax writes (Grain's handler, as Grain's docs show), milepost reads
    it = grain_loader_iter()
    take(it, 3)
    with ocp.CheckpointManager(tmp_path / "orbax") as mngr:
        mngr.save(
            5,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave({"a": np.arange(3)}),
                data_iter=grain.checkpoint.CheckpointSave(it),
            ),
        )
        mngr.wait_until_finished()
    meta = json.loads((tmp_path / "orbax" / "5" / "_CHECKPOINT_METADATA").read_text())
    assert meta["item_handlers"]["data_iter"] == (
        "grain._src.python.checkpoint.handler.CheckpointHandler"
    )
    expected = take(it, 5)
    with Checkpointer(tmp_path / "orbax", read_only=True) as ckpt:
        fresh = grain_loader_iter()
        ckpt.load_checkpointables(5, {"data_iter": fresh})
        assert take(fresh, 5) == expected

    # milepost writes, Orbax restores with Grain's handler
    it = grain_loader_iter()
    take(it, 2)
    with Checkpointer(tmp_path / "mp") as ckpt:
        ckpt.save(9, {"a": np.arange(3)}, data_iter=it)
    expected = take(it, 5)
    fresh = grain_loader_iter()
    with ocp.CheckpointManager(tmp_path / "mp") as mngr:
        restore = grain.checkpoint.CheckpointRestore(fresh)
        mngr.restore(9, args=ocp.args.Composite(data_iter=restore))
    assert take(fresh, 5) == expected


# -- bad input ---------------------------------------------------------------------------


class Unserializable(Counter):
    def get_state(self) -> Any:
        return {"position": self.position, "rng": object()}


class NotJsonBytes(Counter):
    def get_state(self) -> Any:
        return b"\x80position=3"


def test_a_state_that_is_not_json_is_refused_and_nothing_is_committed(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"'data_iter'.*not JSON-serializable.*register"):
        mp.save_checkpointables(tmp_path / "c", {"state": {"a": 1}, "data_iter": Unserializable()})
    with pytest.raises(ValueError, match=r"'data_iter'.*not UTF-8 JSON text"):
        mp.save_checkpointables(tmp_path / "d", {"state": {"a": 1}, "data_iter": NotJsonBytes()})
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()


def test_loading_without_the_iterator_says_to_pass_it(tmp_path: Path) -> None:
    it = Counter()
    mp.save_checkpointables(tmp_path / "c", {"state": {"a": 1}, "data_iter": it})
    with pytest.raises(TypeError, match=r"pass the iterator to restore into.*'data_iter'"):
        mp.load_checkpointables(tmp_path / "c")
    with pytest.raises(TypeError, match=r"pass the iterator"):
        mp.load_checkpointables(tmp_path / "c", {"data_iter": {"position": 0}})
    # the tree alone loads without it
    assert mp.load(tmp_path / "c") == {"a": 1}
    assert mp.metadata(tmp_path / "c").checkpointables["data_iter"] == {"processes": 1}


def _orbax_like(tmp_path: Path) -> Path:
    """A checkpoint as Orbax writes it: no milepost checksums."""
    it = Counter(2)
    take(it, 3)
    mp.save_checkpointables(tmp_path / "c", {"state": {"a": 1}, "data_iter": it})
    (tmp_path / "c" / "_milepost_checksums.json").unlink()
    return tmp_path / "c"


def test_process_count_mismatch_in_an_orbax_checkpoint(tmp_path: Path) -> None:
    root = _orbax_like(tmp_path)
    folder = root / "data_iter"
    shutil.copy(folder / "process_0-of-1.json", folder / "process_1-of-4.json")
    (folder / "process_0-of-1.json").rename(folder / "process_0-of-4.json")
    with pytest.raises(mp.StructureMismatchError, match=r"job of 4 processes.*this job has 1"):
        mp.load_checkpointables(root, {"data_iter": Counter()})


def test_a_damaged_or_missing_file_is_a_typed_error_naming_it(tmp_path: Path) -> None:
    it = Counter(2)
    take(it, 3)
    mp.save_checkpointables(tmp_path / "c", {"state": {"a": 1}, "data_iter": it})
    f = tmp_path / "c" / "data_iter" / "process_0-of-1.json"
    good = f.read_bytes()
    f.write_bytes(good.replace(b"3", b"4"))  # same size, other content: the checksum tells
    with pytest.raises(mp.CorruptCheckpointError, match="process_0-of-1.json"):
        mp.load_checkpointables(tmp_path / "c", {"data_iter": Counter()})
    f.unlink()
    with pytest.raises(mp.CheckpointNotFoundError, match="process_0-of-1.json"):
        mp.load_checkpointables(tmp_path / "c", {"data_iter": Counter()})


def test_damage_in_a_checkpoint_without_checksums(tmp_path: Path) -> None:
    root = _orbax_like(tmp_path)
    f = root / "data_iter" / "process_0-of-1.json"
    f.write_bytes(f.read_bytes()[:-3])
    with pytest.raises(mp.CorruptCheckpointError, match=r"process_0-of-1.json.*not JSON"):
        mp.load_checkpointables(root, {"data_iter": Counter()})
    f.unlink()
    with pytest.raises(mp.CheckpointNotFoundError, match="process_0-of-1.json is missing"):
        mp.load_checkpointables(root, {"data_iter": Counter()})


def test_a_failed_load_leaves_the_iterator_where_it_was(tmp_path: Path) -> None:
    """Iterators are restored in place after every other part loaded: a damaged sibling fails
    the load and the iterator has not moved, whatever the order it was asked in."""
    it = Counter(seed=7)
    for _ in range(5):
        next(it)
    path = mp.save_checkpointables(tmp_path / "c", {"state": {"x": np.arange(4)}, "data_iter": it})
    (path / "state" / "_METADATA").write_text("{")  # damaged
    fresh = Counter(seed=0)
    for _ in range(2):
        next(fresh)
    with pytest.raises(mp.CorruptCheckpointError):
        mp.load_checkpointables(path, {"data_iter": fresh, "state": None})
    assert fresh.get_state() == {"seed": 0, "position": 2}


class _ReplaceWhileLoading:
    """A handler for the JSON checkpointable ``meta`` whose load replaces the whole checkpoint
    folder (a copy under the same path: another folder, as an overwrite leaves), as another
    process's overwrite would while this load runs."""

    def __init__(self, path: Path, typestr: str) -> None:
        self.path, self.typestr = path, typestr

    def is_handleable(self, obj: Any) -> bool:
        return False

    def save(self, directory: Any, obj: Any, call: Any) -> None:
        raise AssertionError("only loads")

    def load(self, directory: Any, abstract: Any, call: Any) -> Any:
        shutil.move(self.path, self.path.with_name("moved"))
        shutil.copytree(self.path.with_name("moved"), self.path)
        return {}

    def metadata(self, directory: Any) -> Any:
        return None


@pytest.mark.parametrize("order", ["iterator last", "iterator first"])
def test_a_load_that_ends_in_checkpoint_replaced_leaves_the_iterator_where_it_was(
    tmp_path: Path, order: str
) -> None:
    """The checkpoint is replaced while its parts load: the load raises CheckpointReplacedError
    and the iterator passed to it has not moved (it is restored only once the checkpoint is
    known not to have been replaced)."""
    it = Counter(seed=7)
    for _ in range(5):
        next(it)
    path = mp.save_checkpointables(
        tmp_path / "c", {"state": {"x": np.arange(4)}, "meta": {"k": 1}, "data_iter": it}
    )
    typestr = mp.metadata(path).item_handlers["meta"]
    fresh = Counter(seed=0)
    next(fresh)
    wanted: dict[str, Any] = {"state": None, "meta": None, "data_iter": fresh}
    if order == "iterator first":
        wanted = {"data_iter": fresh, "state": None, "meta": None}
    with mp.Context(handlers=[(_ReplaceWhileLoading(path, typestr), "meta")]):
        with pytest.raises(mp.CheckpointReplacedError, match="replaced or deleted"):
            mp.load_checkpointables(path, wanted)
    assert fresh.get_state() == {"seed": 0, "position": 1}
    got = mp.load_checkpointables(path, {"data_iter": fresh, "meta": None})
    assert got["data_iter"] is fresh and fresh.get_state() == {"seed": 7, "position": 5}


def test_an_iterator_that_cannot_take_the_state_is_named(tmp_path: Path) -> None:
    it = Counter(seed=7)
    path = mp.save_checkpointables(tmp_path / "c", {"state": {"x": 1}, "data_iter": it})

    class Other(Counter):
        def set_state(self, state: dict[str, Any]) -> None:
            raise KeyError("shard_index")

    with pytest.raises(mp.StructureMismatchError, match=r"(?s)'data_iter'.*KeyError.*kind"):
        mp.load_checkpointables(path, {"data_iter": Other()})


def test_state_files_nested_beyond_reading_are_damage(tmp_path: Path) -> None:
    """A state file (as Orbax or Grain write them: no checksums) nested deeper than JSON can be
    read is a CorruptCheckpointError, not a RecursionError; so is a folder in its place."""
    path = mp.save_checkpointables(tmp_path / "c", {"data_iter": Counter()})
    (path / "_milepost_checksums.json").unlink()
    state = path / "data_iter" / "process_0-of-1.json"
    state.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(mp.CorruptCheckpointError, match="nests deeper"):
        mp.load_checkpointables(path, {"data_iter": Counter()})
    state.unlink()
    state.mkdir()
    with pytest.raises(mp.CorruptCheckpointError, match="is a folder"):
        mp.load_checkpointables(path, {"data_iter": Counter()})

    class Deep(Counter):
        def get_state(self) -> Any:
            value: Any = []
            for _ in range(100_000):
                value = [value]
            return value

    with pytest.raises(TypeError, match="get_state"):
        mp.save_checkpointables(tmp_path / "d", {"data_iter": Deep()})
    assert not (tmp_path / "d").exists()
