"""Orbax v0 checkpoints, written by the real orbax-checkpoint package, load exactly: zarr2 and
zarr3, OCDBT and plain folders, single checkpointers and CheckpointManager steps (with and
without Composite), resharded and cast; a training Checkpointer reads a v0 root."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost.training import Checkpointer

ocp = pytest.importorskip("orbax.checkpoint")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


def make_tree() -> dict[str, Any]:
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    return {
        "params": {
            "w": jax.device_put(
                jnp.arange(128.0).reshape(16, 8), NamedSharding(mesh, P("data", "model"))
            ),
            "b": jnp.arange(8, dtype=jnp.bfloat16),
        },
        "n": np.arange(6, dtype=np.int32).reshape(2, 3),
        "step": 3,
        "rng": jax.random.key(5),
    }


def check(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert np.array_equal(np.asarray(got["params"]["w"]), np.asarray(want["params"]["w"]))
    assert got["params"]["b"].dtype == jnp.bfloat16 and np.array_equal(
        np.asarray(got["params"]["b"]), np.asarray(want["params"]["b"])
    )
    assert np.array_equal(np.asarray(got["n"]), want["n"]) and int(got["step"]) == 3
    assert np.array_equal(jax.random.key_data(got["rng"]), jax.random.key_data(want["rng"]))


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("v0")
    tree = make_tree()
    with ocp.StandardCheckpointer() as c:
        c.save(root / "standard", tree)
    with ocp.StandardCheckpointer(use_ocdbt=False) as c:
        c.save(root / "standard-plain", tree)
    ocp.PyTreeCheckpointer().save(root / "pytree", {**tree, "note": "hi"})
    ocp.PyTreeCheckpointer(use_zarr3=True, use_ocdbt=False).save(root / "pytree-zarr3-plain", tree)
    ocp.PyTreeCheckpointer(use_zarr3=True).save(root / "pytree-zarr3", tree)
    with ocp.CheckpointManager(root / "manager") as manager:
        for step in (0, 5, 10):
            manager.save(step, args=ocp.args.StandardSave(tree))
        manager.wait_until_finished()
    with ocp.CheckpointManager(root / "composite", item_names=("state", "extra")) as manager:
        manager.save(
            7,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(tree), extra=ocp.args.JsonSave({"epoch": 2})
            ),
        )
        manager.wait_until_finished()
    return root, tree


LAYOUTS = [
    "standard",
    "standard-plain",
    "pytree",
    "pytree-zarr3-plain",
    "pytree-zarr3",
    "manager/10",
    "composite/7",
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_v0_layouts_load_exactly(written: tuple[Path, dict[str, Any]], layout: str) -> None:
    root, tree = written
    check(mp.load(root / layout), tree)
    meta = mp.metadata(root / layout)
    assert meta.tree["params"]["w"].shape == (16, 8) and meta.tree["rng"].dtype == tree["rng"].dtype
    assert mp.verify(root / layout).ok


@pytest.mark.parametrize("layout", ["standard", "pytree-zarr3", "composite/7"])
def test_v0_loads_resharded_and_cast(written: tuple[Path, dict[str, Any]], layout: str) -> None:
    root, tree = written
    other = jax.make_mesh((2, 4), ("x", "y"))
    abstract = {
        "params": {
            "w": jax.ShapeDtypeStruct(
                (16, 8), jnp.bfloat16, sharding=NamedSharding(other, P(None, "y"))
            ),
            "b": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(other, P("y"))),
        },
    }
    got = mp.load(root / layout, abstract, partial=True)["params"]
    assert got["w"].dtype == jnp.bfloat16 and got["w"].sharding.spec == P(None, "y")
    assert np.array_equal(
        np.asarray(got["w"]), np.asarray(tree["params"]["w"]).astype(jnp.bfloat16)
    )
    assert np.array_equal(np.asarray(got["b"]), np.asarray(tree["params"]["b"]).astype(np.float32))


def test_v0_checkpointables(written: tuple[Path, dict[str, Any]]) -> None:
    root, tree = written
    parts = mp.load_checkpointables(root / "composite" / "7")
    assert parts["extra"] == {"epoch": 2}
    check(parts["state"], tree)
    assert set(mp.load_checkpointables(root / "standard")) == {
        "default"
    }  # a single checkpointer's item
    assert mp.load_checkpointables(root / "pytree", {"default": None})["default"]["note"] == "hi"


def test_a_checkpointer_reads_a_v0_manager_root(written: tuple[Path, dict[str, Any]]) -> None:
    root, tree = written
    with Checkpointer(root / "manager", read_only=True) as ckpt:
        assert ckpt.steps == [0, 5, 10] and ckpt.latest == 10
        check(ckpt.load(), tree)
        check(ckpt.load(5), tree)
        assert ckpt.metadata(0).tree["n"].shape == (2, 3)


def test_older_v0_without_commit_marker_or_checkpoint_metadata(
    written: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    root, tree = written
    no_marker = shutil.copytree(root / "standard", tmp_path / "no-marker")
    (no_marker / "commit_success.txt").unlink()  # older Orbax wrote none on local disks
    check(mp.load(no_marker), tree)
    bare = shutil.copytree(root / "standard", tmp_path / "bare")
    (bare / "commit_success.txt").unlink()
    (bare / "_CHECKPOINT_METADATA").unlink()  # older still: no checkpoint metadata at all
    check(mp.load(bare), tree)


def test_an_unknown_layout_says_what_it_found(tmp_path: Path) -> None:
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "weights.npz").write_bytes(b"x")
    with pytest.raises(
        mp.CheckpointNotFoundError, match=r"(?s)weights\.npz.*Orbax v0.*safetensors"
    ):
        mp.load(odd)


def test_a_handler_milepost_does_not_read_is_named(
    written: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    root, _ = written
    ckpt = shutil.copytree(root / "composite" / "7", tmp_path / "c")
    meta = (
        (ckpt / "_CHECKPOINT_METADATA")
        .read_text()
        .replace(
            "json_checkpoint_handler.JsonCheckpointHandler",
            "proto_checkpoint_handler.ProtoCheckpointHandler",
        )
    )
    (ckpt / "_CHECKPOINT_METADATA").write_text(meta)
    with pytest.raises(TypeError, match=r"(?s)'extra'.*ProtoCheckpointHandler.*does not read"):
        mp.load_checkpointables(ckpt)
    assert set(mp.load_checkpointables(ckpt, {"state": None})) == {"state"}  # the rest still loads
    meta = mp.metadata(ckpt)  # every part it can describe; the other one says why not
    assert meta.tree["params"]["w"].shape == (16, 8)
    assert meta.checkpointables["extra"] is None
    assert "ProtoCheckpointHandler" in meta.unreadable["extra"]
    assert "not described: extra" in repr(meta)


def test_a_listed_part_whose_folder_is_gone(
    written: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    root, tree = written
    ckpt = shutil.copytree(root / "composite" / "7", tmp_path / "c")
    shutil.rmtree(ckpt / "extra")
    check(mp.load(ckpt), tree)  # the tree never needs its sibling
    meta = mp.metadata(ckpt)
    assert set(meta.checkpointables) == {"state"} and "missing" in meta.unreadable["extra"]
    with pytest.raises(mp.CheckpointNotFoundError, match=r"(?s)\['extra'\].*folders are missing"):
        mp.load_checkpointables(ckpt, {"extra": None})


def test_a_damaged_part_is_named_and_the_rest_described(
    written: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    root, tree = written
    ckpt = shutil.copytree(root / "composite" / "7", tmp_path / "c")
    json_file = ckpt / "extra" / "metadata"  # Orbax v0's JSON item file
    json_file.write_text('{"epoch": ')  # truncated
    meta = mp.metadata(ckpt)
    assert meta.tree["params"]["w"].shape == (16, 8) and meta.checkpointables["extra"] is None
    assert json_file.name in meta.unreadable["extra"]
    check(mp.load(ckpt), tree)
    with pytest.raises(ValueError, match=json_file.name):
        mp.load_checkpointables(ckpt, {"extra": None})


def test_older_steps_without_markers_are_finished_and_kept(
    written: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """Orbax before 0.12.3 wrote no commit marker on local disks (the rename was the commit):
    a writable Checkpointer must list those steps, load them, and never remove them."""
    root, tree = written
    manager = shutil.copytree(root / "manager", tmp_path / "manager")
    for step in (0, 5, 10):
        (manager / str(step) / "commit_success.txt").unlink()
    with Checkpointer(manager) as ckpt:
        assert ckpt.steps == [0, 5, 10]
        check(ckpt.load(10), tree)
    assert sorted(p.name for p in manager.iterdir()) == ["0", "10", "5"]
    assert mp.training.list_steps(manager)[0]["state"] == "committed"


def test_what_an_unfinished_orbax_save_leaves_is_never_a_checkpoint(
    written: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """Orbax's temporary names (with a timestamp before 0.12) are unfinished, whatever they
    hold; so is a step folder that holds only checkpoint metadata."""
    root, _ = written
    manager = shutil.copytree(root / "manager", tmp_path / "manager")
    for name in ("15.orbax-checkpoint-tmp-1716000000000000", "20.orbax-checkpoint-tmp"):
        shutil.copytree(manager / "10", manager / name)
        with pytest.raises(mp.CheckpointNotFoundError, match="unfinished save"):
            mp.load(manager / name)
    single = shutil.copytree(root / "standard", tmp_path / "x.orbax-checkpoint-tmp-1716000000")
    (single / "commit_success.txt").unlink()
    with pytest.raises(mp.CheckpointNotFoundError, match="unfinished save"):
        mp.load(single)
    with Checkpointer(manager, read_only=True) as ckpt:
        assert ckpt.steps == [0, 5, 10]
    rows = {r["step"]: r["state"] for r in mp.training.list_steps(manager)}
    assert rows == {
        0: "committed",
        5: "committed",
        10: "committed",
        15: "unfinished save",
        20: "unfinished save",
    }
    with pytest.raises(ValueError, match="temporary"):
        mp.save(tmp_path / "y.orbax-checkpoint-tmp-5", {"x": 1})


def test_a_folder_that_only_shares_a_file_name_is_never_replaced(tmp_path: Path) -> None:
    """TensorFlow names its checkpoint index ``checkpoint``, as Orbax names its msgpack file: a
    folder holding one is not a checkpoint to load or to replace."""
    tf_run = tmp_path / "tf_run"
    tf_run.mkdir()
    files = {
        "checkpoint": 'model_checkpoint_path: "ckpt-1"\n',
        "ckpt-1.index": "x",
        "train.py": "print('hi')\n",
    }
    for name, text in files.items():
        (tf_run / name).write_text(text)
    with pytest.raises(mp.CheckpointExistsError, match="not a committed checkpoint"):
        mp.save(tf_run, {"x": np.arange(3)}, overwrite=True)
    with pytest.raises(mp.CheckpointNotFoundError, match="not a checkpoint"):
        mp.load(tf_run)
    mp.save(tf_run / "milepost", {"x": np.arange(3)})  # beside them is fine
    assert {p.name: p.read_text() for p in tf_run.iterdir() if p.is_file()} == files


def test_an_orbax_save_killed_in_commit_file_mode_is_unfinished(tmp_path: Path) -> None:
    """Orbax's commit-file mode saves at the final name and commits by its marker: a save
    killed before that is not a step, and a writable Checkpointer leaves it to its writer."""
    import os
    import subprocess
    import sys

    root = tmp_path / "root"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    done = subprocess.run(
        [sys.executable, "-m", "tests._orbax_commit_file", str(root)],
        cwd=Path(__file__).resolve().parents[1],
        env=env,
        timeout=120,
    )
    assert done.returncode == 9 and (root / "2" / "state").is_dir()
    assert not (root / "2" / "commit_success.txt").exists()
    with Checkpointer(root) as ckpt:
        assert ckpt.steps == [1]
        assert ckpt.load_checkpointables(1, {"extra": None})["extra"] == {"step": 1}
    assert sorted(p.name for p in root.iterdir()) == ["1", "2"]  # not ours to remove
    with pytest.raises(mp.CheckpointNotFoundError, match="did not finish"):
        mp.load(root / "2")


def test_an_aggregate_file_that_contradicts_the_tree_metadata_is_damage(tmp_path: Path) -> None:
    """Orbax 0.5.3 kept aggregated leaves in its msgpack file: one whose kind is not what
    _METADATA records (a string for a scalar) is damage, not a value to return."""
    msgpack = pytest.importorskip("msgpack")
    fixture = Path(__file__).parent / "fixtures" / "orbax" / "0.5.3" / "pytree_save_args"
    path = shutil.copytree(fixture, tmp_path / "c")
    held = msgpack.unpackb((path / "checkpoint").read_bytes())
    assert held["lr"] == 0.5  # aggregated there, as the fixture says
    held["lr"] = "not a number"
    (path / "checkpoint").write_bytes(msgpack.packb(held))
    for call in (mp.load, mp.metadata):
        with pytest.raises(mp.CorruptCheckpointError, match=r"(?s)'lr'.*records as 'scalar'"):
            call(path)


def test_metadata_of_a_checkpoint_with_no_part_it_can_describe_raises(tmp_path: Path) -> None:
    """Two trees and no 'state': each is a part; when neither can be described the call says
    why instead of returning nothing."""
    path = mp.save_checkpointables(
        tmp_path / "c", {"params": {"w": np.arange(4.0)}, "opt": {"m": np.zeros(2)}}
    )
    assert mp.metadata(path).tree is None  # no main tree, both described
    for part in ("params", "opt"):
        (path / part / "_METADATA").write_text("{")
    with pytest.raises(mp.CorruptCheckpointError):
        mp.metadata(path)
