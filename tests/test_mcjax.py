"""Multi-controller JAX: every process runs the script; real multi-process jobs on localhost.

Three jobs share one module fixture (starting a jax.distributed job is the slow part):
2 processes x 4 devices save, 4 processes x 2 devices save and load what the 2-process job and
the embedded mode saved, then 2 processes load what the 4 saved. Checkpoints therefore cross
2 <-> 4 processes <-> the embedded mode (8 local devices) in every direction.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import milepost as mp
from tests import _mc


def ok(results: list[_mc.Result]) -> list[dict]:
    for r in results:
        assert r.returncode == 0 and "exception" not in r.out, (
            f"process failed:\n{r.out.get('exception')}\n{r.stderr}"
        )
    assert [r.out["process"] for r in results] == list(range(len(results)))
    return [r.out for r in results]


def embedded_tree() -> dict:
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    specs = {"w": P("data", "model"), "b": P("model"), "r": P()}
    tree: dict = {
        k: jax.device_put(_mc.global_value(k, shape, dtype), NamedSharding(mesh, specs[k]))
        for k, (shape, dtype) in _mc.SHAPES.items()
    }
    tree.update(step=7, note="mc", host=np.arange(5))
    return tree


def check_embedded(path: Path) -> None:
    mesh = jax.make_mesh((8,), ("z",))
    abstract = {
        k: jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=NamedSharding(mesh, P("z")))
        for k, (shape, dtype) in _mc.SHAPES.items()
    }
    abstract.update(step=0, note="", host=np.zeros(5, np.int64))
    out = mp.load(path, abstract)
    for k, (shape, dtype) in _mc.SHAPES.items():
        assert out[k].sharding == abstract[k].sharding
        assert np.array_equal(np.asarray(out[k]), _mc.global_value(k, shape, dtype)), k
    assert out["step"] == 7 and out["note"] == "mc" and np.array_equal(out["host"], np.arange(5))


@dataclass
class Runs:
    root: Path
    two: list[dict]
    four: list[dict]
    back: list[dict]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    root = tmp_path_factory.mktemp("mc")
    mp.save(root / "embedded", embedded_tree())
    two = ok(_mc.launch("two_save", 2, 4, str(root / "two"), str(root / "embedded")))
    four = ok(
        _mc.launch(
            "four",
            4,
            2,
            str(root / "four"),
            str(root / "embedded"),
            *(str(root / "two" / n) for n in ("c", "orbax", "plain")),
        )
    )
    damaged_checkpoint(root / "damaged")
    back = ok(
        _mc.launch(
            "load_and_damaged",
            2,
            4,
            str(root),
            str(root / "damaged"),
            str(root / "four" / "a"),
            str(root / "four" / "b"),
        )
    )
    return Runs(root, two, four, back)


def damaged_checkpoint(path: Path) -> None:
    """An embedded-mode checkpoint of w (64 x 128 float32, 8 shards of 4 KiB: in data files)
    with a byte of shard w/c/1/2 flipped."""
    from tests.test_integrity import chunk_value, flip

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    w = np.random.default_rng(5).standard_normal((64, 128), dtype=np.float32)
    mp.save(path, {"w": jax.device_put(w, NamedSharding(mesh, P("data", "model")))})
    file, offset, length = chunk_value(path, "w/c/1/2")
    flip(file, offset + length // 2)


def _writers(state: Path) -> set[str]:
    """Which processes wrote OCDBT databases (``ocdbt.process_<i>`` and
    ``ocdbt.process_<i>.<k>``)."""
    return {p.name.split(".")[1] for p in state.glob("ocdbt.process_*")}


# 2 processes x 4 devices: 4 addressable shards of each of the 3 arrays; 4 x 2: 2 of each.
TWO, FOUR = 12, 6


def test_two_processes_save_and_load_resharded(runs: Runs) -> None:
    for o in runs.two:
        assert o["global_devices"] == 8
        assert o["checked_c"] == o["checked_plain"] == TWO
        assert o["leftover_keys"] == []  # barriers and broadcasts clean up after themselves
    state = runs.root / "two" / "c" / "state"
    assert _writers(state) == {"process_0", "process_1", "process_controller"}
    # both processes name their packed data files with the save's one token (the primary's)
    packed = {p.name: {f.name.split(".")[0] for f in p.glob("d/*")} for p in state.glob("*.p")}
    assert {"ocdbt.process_0.p", "ocdbt.process_1.p"} <= set(packed), packed
    assert len(set().union(*packed.values())) == 1, packed


def test_four_processes_save_and_load_resharded(runs: Runs) -> None:
    assert runs.four[1]["device_ids"][0] != 2  # device ids are not contiguous across processes
    for o in runs.four:
        assert o["global_devices"] == 8
        assert o["meta_procs"] == 4 and o["meta_shape"] == [16, 32]
        assert o["verify"][0] is True and o["verify"][1] > 0 and o["verify"][2] == [], o["verify"]
        assert o["keys"] == ["key<fry>", True]
        assert o["checked_same"] == o["checked_resharded"] == o["checked_again"] == FOUR
        assert o["concurrent"] == [True, True]
        assert (
            o["json"] == {"lr": 0.5, "name": "mc"}
            and o["empty_shape"] == [0, 4]
            and o["checked_multi"] == FOUR
        )
        assert o["ckpt_steps"] == [0, 1, 2]
    state = runs.root / "four" / "a" / "state"
    assert _writers(state) == {
        "process_0",
        "process_1",
        "process_2",
        "process_3",
        "process_controller",
    }
    # Every array once, in one file (not one file per process listing every array)
    assert sorted(p.name for p in (state / "array_metadatas").iterdir()) == ["process_0"]
    listed = [
        e["array_metadata"]["param_name"]
        for e in json.loads((state / "array_metadatas" / "process_0").read_text())[
            "array_metadatas"
        ]
    ]
    assert listed and len(listed) == len(set(listed)), listed


def test_checkpoints_cross_two_four_processes_and_embedded(runs: Runs) -> None:
    for o in runs.two:
        assert o["checked_embedded"] == TWO  # embedded -> 2
    for o in runs.four:
        assert (
            o["checked_embedded"] == o["checked_c"] == o["checked_plain"] == FOUR
        )  # embedded, 2 -> 4
    for o in runs.back:
        assert o["checked_a"] == o["checked_b"] == TWO  # 4 -> 2
    for path in ("four/a", "four/b", "two/c", "two/plain"):  # 4, 2 -> embedded
        check_embedded(runs.root / path)


def test_orbax_two_process_checkpoint_loads(runs: Runs) -> None:
    assert all(o["checked_orbax"] == TWO for o in runs.two)
    assert all(o["checked_orbax"] == FOUR for o in runs.four)
    check_embedded(runs.root / "two" / "orbax")


def test_every_process_gets_the_same_error_and_nothing_is_committed(runs: Runs) -> None:
    expected = {
        "exists": "CheckpointExistsError: a checkpoint already exists",
        "not_a_ckpt": "CheckpointExistsError:",
        "missing": "CheckpointNotFoundError:",
        "missing_meta": "CheckpointNotFoundError:",
        "mismatch": "StructureMismatchError:",
        "stage_fails": (
            "HostError: process 2 failed staging its shards (device-to-host copy): "
            "RuntimeError: injected staging failure"
        ),
        "commit_fails": "OSError: injected commit failure",
        "load_fails": (
            "HostError: process 3 failed reading its shards: ValueError: injected read failure"
        ),
        "controller_stage_fails": "RuntimeError: injected controller staging failure",
        "controller_write_fails": "OSError: injected controller write failure",
        "stateful_fails": "ValueError: injected stateful failure",
    }
    for key, start in expected.items():
        errors = {o[key]["error"] for o in runs.four}
        assert len(errors) == 1, (key, errors)
        (error,) = errors
        assert error is not None and error.startswith(start), (key, error)
        assert all(o[key]["seconds"] < 30 for o in runs.four), key  # reported, not timed out
    assert "Nothing was committed" in runs.four[0]["stage_fails"]["error"]
    committed = runs.four[0]["committed"]
    assert not {
        "stage_fails",
        "commit_fails",
        "controller_stage_fails",
        "controller_write_fails",
        "stateful_fails",
    } & set(committed)
    assert not any(".orbax-checkpoint-tmp" in name for name in committed)
    assert all(o["after_failures"] == FOUR for o in runs.four)


def test_a_flipped_byte_in_a_chunk_is_the_same_corrupt_checkpoint_error_everywhere(
    runs: Runs,
) -> None:
    """The process whose device needs chunk w/c/1/2 finds it damaged; every process of the job
    raises the CorruptCheckpointError naming the array, the chunk and the file, never values."""
    for o in runs.back:
        error = o["damaged"]
        assert error is not None, f"process {o['process']} loaded the damaged chunk"
        assert error["corrupt"] and error["type"] == "CorruptCheckpointError", error
        assert error["array"] == "w" and error["chunk"] == [1, 2], error
        assert str(runs.root / "damaged" / "state") in error["path"], error
        assert "fails its checksum" in error["message"], error
    assert runs.back[0]["damaged"] == runs.back[1]["damaged"]


def test_the_primary_is_configurable(runs: Runs) -> None:
    assert [o["is_primary"] for o in runs.four] == [False, False, False, True]
    assert all(o["checked_last_primary"] == FOUR for o in runs.four)
    check_embedded(runs.root / "four" / "last_primary")


@pytest.mark.parametrize(
    ("processes", "victim", "primary"),
    [(2, 1, 0), (2, 1, 1), pytest.param(4, 2, 0, marks=pytest.mark.slow)],
    ids=["non-primary-dies", "primary-dies", "one-of-four-dies"],
)
def test_a_process_killed_mid_save_fails_the_others_cleanly(
    tmp_path: Path, processes: int, victim: int, primary: int
) -> None:
    timeout = 6
    results = _mc.launch(
        "die", processes, 8 // processes, str(tmp_path), str(victim), str(primary), str(timeout)
    )
    dead = results[victim]
    assert dead.returncode == -9 and dead.out.get("died")
    for i, r in enumerate(results):
        if i == victim:
            continue
        survivor = r.out
        assert survivor["error"] is not None, survivor
        assert survivor["error"].startswith(
            f"HostError: process {victim} did not reach 'written:"
        ), survivor
        assert survivor["hosts"] == [victim], survivor
        assert "Nothing was committed" in survivor["error"]
        assert timeout <= survivor["seconds"] < timeout + 30
        assert survivor["committed"] is False
    assert sorted(p.name for p in tmp_path.iterdir()) in ([], ["dead.orbax-checkpoint-tmp"])


def test_a_process_that_never_arrives_is_named(tmp_path: Path) -> None:
    timeout = 4
    first, second = ok(_mc.launch("absent", 2, 4, str(tmp_path), str(timeout)))
    assert first["error"].startswith("HostError: process 1 did not reach 'staged:"), first
    assert first["hosts"] == [1], first
    assert (
        "did not make this milepost call" in first["error"]
        and "Nothing was committed" in first["error"]
    )
    assert timeout <= first["seconds"] < timeout + 30
    assert first["committed"] is False and not (tmp_path / "lonely").exists()
    assert "error" not in second


@pytest.mark.slow
def test_four_process_checkpoint_loads_on_a_ray_slice_and_back(
    runs: Runs, ray_runtime: object, tmp_path: Path
) -> None:
    def abstract(mesh: mp.colocated.SliceMesh) -> dict:
        out: dict = {
            k: mp.AbstractArray(
                shape, np.dtype(dtype), mesh.sharding(P("x") if len(shape) == 1 else P(None, "x"))
            )
            for k, (shape, dtype) in _mc.SHAPES.items()
        }
        out.update(step=0, note="", host=np.zeros(5, np.int64))
        return out

    with mp.Slice.start(hosts=2, devices_per_host=4) as s:
        mesh = s.mesh({"x": 4, "y": 2})
        loaded = mp.load(runs.root / "four" / "a", abstract(mesh))  # 4 processes -> slice
        for k, (shape, dtype) in _mc.SHAPES.items():
            assert isinstance(loaded[k], mp.RemoteArray)
            assert np.array_equal(s.fetch(loaded[k]), _mc.global_value(k, shape, dtype)), k
        assert loaded["step"] == 7 and loaded["note"] == "mc"
        mp.save(tmp_path / "from_slice", loaded)  # slice -> 4 processes
    outs = ok(_mc.launch("load", 4, 2, str(tmp_path), str(tmp_path / "from_slice")))
    assert all(o["checked_from_slice"] == FOUR for o in outs)
