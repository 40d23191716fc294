"""Multi-controller JAX: every process runs the script; real multi-process jobs on localhost."""

from __future__ import annotations

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
        assert r.returncode == 0 and "exception" not in r.out, f"process failed:\n{r.out.get('exception')}\n{r.stderr}"
    return [r.out for r in results]


def check_embedded(path: Path) -> None:
    mesh = jax.make_mesh((8,), ("z",))
    abstract = {k: jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=NamedSharding(mesh, P("z")))
                for k, (shape, dtype) in _mc.SHAPES.items()}
    abstract.update(step=0, note="", host=np.zeros(5, np.int64))
    out = mp.load(path, abstract)
    for k, (shape, dtype) in _mc.SHAPES.items():
        assert np.array_equal(np.asarray(out[k]), _mc.global_value(k, shape, dtype)), k
    assert out["step"] == 7 and out["note"] == "mc"


@pytest.fixture(scope="module")
def four_process_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mc4")
    outs = ok(_mc.launch("save_and_reshard", 4, 2, str(root)))
    assert [o["process"] for o in outs] == [0, 1, 2, 3]
    assert all(o["global_devices"] == 8 for o in outs)
    assert outs[1]["device_ids"][0] != 2  # device ids are not contiguous across processes
    for o in outs:
        assert o["meta_procs"] == 4 and o["checked_same"] == 6 and o["checked_resharded"] == 6
        assert o["ckpt_steps"] == [0, 1, 2] and o["exists_error"] == "CheckpointExistsError"
    state = root / "a" / "state"
    assert sorted(p.name for p in state.glob("ocdbt.process_*")) == [
        "ocdbt.process_0", "ocdbt.process_1", "ocdbt.process_2", "ocdbt.process_3", "ocdbt.process_controller"
    ]
    assert sorted(p.name for p in (state / "array_metadatas").iterdir()) == [f"process_{i}" for i in range(4)]
    return root


def test_four_processes_save_and_load_resharded(four_process_checkpoints: Path) -> None:
    check_embedded(four_process_checkpoints / "a")  # and the embedded mode reads it too


def test_two_processes_load_what_four_saved_and_what_embedded_saved(four_process_checkpoints: Path, tmp_path: Path) -> None:
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    specs = {"w": P("data", "model"), "b": P("model"), "r": P()}
    tree: dict = {k: jax.device_put(_mc.global_value(k, shape, dtype), NamedSharding(mesh, specs[k]))
                  for k, (shape, dtype) in _mc.SHAPES.items()}
    tree.update(step=7, note="mc", host=np.arange(5))
    mp.save(tmp_path / "embedded", tree)
    outs = ok(_mc.launch("load_elsewhere", 2, 4, str(tmp_path), str(four_process_checkpoints / "a"),
                         str(four_process_checkpoints / "b"), str(tmp_path / "embedded")))
    for o in outs:
        assert o["checked_a"] == o["checked_b"] == o["checked_embedded"] == 12


def test_orbax_two_process_checkpoint_loads(tmp_path: Path) -> None:
    outs = ok(_mc.launch("orbax_save", 2, 4, str(tmp_path)))
    assert all(o["checked_orbax"] == 12 for o in outs)
    check_embedded(tmp_path / "orbax")


def test_a_process_dying_mid_save_fails_the_others_cleanly(tmp_path: Path) -> None:
    results = _mc.launch("die_mid_save", 2, 4, str(tmp_path), "6")
    survivor, dead = results[0].out, results[1]
    assert dead.returncode == 17 and dead.out.get("died")
    assert survivor["error"] and survivor["error"].startswith("HostError: processes [1] did not reach")
    assert survivor["seconds"] < 60
    assert survivor["committed"] is False
    assert not (tmp_path / "dead").exists()
