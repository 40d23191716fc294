"""Bad input: a typed error that names the problem and the fix, and nothing written or lost."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import milepost as mp


def listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture
def saved(tmp_path: Path, mesh24: jax.sharding.Mesh) -> Path:
    state = {"w": jax.device_put(np.arange(32, dtype=np.float32).reshape(4, 8), NamedSharding(mesh24, P("data", "model"))), "step": 1}
    return mp.save(tmp_path / "ckpt", state)


def test_not_a_checkpoint(tmp_path: Path, saved: Path) -> None:
    with pytest.raises(mp.CheckpointNotFoundError, match="does not exist"):
        mp.load(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileNotFoundError, match="is a file"):
        mp.load(tmp_path / "file")
    (tmp_path / "plain").mkdir()
    with pytest.raises(FileNotFoundError, match="not a checkpoint"):
        mp.metadata(tmp_path / "plain")
    with pytest.raises(FileNotFoundError, match="not its parent"):
        mp.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="checkpointable folder|not a checkpoint"):
        mp.load(saved / "state")
    tmpdir = tmp_path / "x.orbax-checkpoint-tmp"
    tmpdir.mkdir()
    with pytest.raises(FileNotFoundError, match="unfinished save"):
        mp.load(tmpdir)


def test_missing_or_truncated_metadata(saved: Path) -> None:
    text = (saved / "_CHECKPOINT_METADATA").read_text()
    (saved / "_CHECKPOINT_METADATA").write_text(text[: len(text) // 2])
    with pytest.raises(mp.CorruptCheckpointError, match="truncated"):
        mp.load(saved)
    (saved / "_CHECKPOINT_METADATA").write_text(text)
    tree_meta = saved / "state" / "_METADATA"
    body = tree_meta.read_text()
    tree_meta.write_text(body[:10])
    with pytest.raises(ValueError, match="truncated"):
        mp.load(saved)
    tree_meta.unlink()
    with pytest.raises(FileNotFoundError, match="_METADATA is missing"):
        mp.load(saved)
    tree_meta.write_text(body)
    os.unlink(saved / "commit_success.txt")
    (saved / "orbax.checkpoint").unlink()
    with pytest.raises(FileNotFoundError, match="commit marker"):
        mp.load(saved)


def test_abstract_tree_mismatch(saved: Path, mesh24: jax.sharding.Mesh) -> None:
    s = NamedSharding(mesh24, P())
    with pytest.raises(mp.StructureMismatchError, match="partial=True"):
        mp.load(saved, {"w": jax.ShapeDtypeStruct((4, 8), np.float32, sharding=s)})
    with pytest.raises(mp.StructureMismatchError, match="does\\s+not have"):
        mp.load(saved, {"w": jax.ShapeDtypeStruct((4, 8), np.float32, sharding=s), "step": 0, "extra": 1})
    with pytest.raises(mp.StructureMismatchError, match="shape"):
        mp.load(saved, {"w": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=s), "step": 0})
    # A dtype difference is a cast, not an error.
    out = mp.load(saved, {"w": jax.ShapeDtypeStruct((4, 8), np.int32, sharding=s), "step": 0})
    assert out["w"].dtype == np.int32 and np.array_equal(np.asarray(out["w"]), np.arange(32).reshape(4, 8))


@pytest.mark.parametrize(
    ("leaf", "exc"),
    [(object(), mp.UnsupportedLeafError), (b"bytes", mp.UnsupportedLeafError), (lambda: 1, mp.UnsupportedLeafError),
     (np.array([object()]), mp.UnsupportedLeafError), (np.array(["a", "b"]), mp.UnsupportedLeafError), (2**80, mp.UnsupportedLeafError)],
    ids=["object", "bytes", "lambda", "object-array", "str-array", "huge-int"],
)
def test_unsupported_leaves_write_nothing(tmp_path: Path, leaf: object, exc: type) -> None:
    with pytest.raises(exc, match="cannot save|no on-disk form|does not fit"):
        mp.save(tmp_path / "c", {"ok": np.ones(3), "bad": leaf})
    assert listing(tmp_path) == []
    assert issubclass(exc, TypeError)


@pytest.mark.parametrize(
    "tree",
    [{"a/b": 1}, {"..": 1}, {"": 1}, {"a.b": 1, "a": {"b": 2}}, {"x": {"\\": 1}}],
    ids=["slash", "dotdot", "empty", "collision", "backslash"],
)
def test_unsafe_keys(tmp_path: Path, tree: dict) -> None:
    with pytest.raises(mp.InvalidKeyError, match="(?i)rename"):
        mp.save(tmp_path / "c", tree)
    assert listing(tmp_path) == []
    assert issubclass(mp.InvalidKeyError, ValueError)


def test_saved_sharding_on_missing_devices(saved: Path, mesh24: jax.sharding.Mesh) -> None:
    sharding_file = saved / "state" / "_sharding"
    data = json.loads(sharding_file.read_text())
    (key,) = data
    spec = json.loads(data[key])
    spec["device_mesh"]["mesh"][0][0]["id"] = 99
    data[key] = json.dumps(spec)
    sharding_file.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"devices \[99\].*abstract tree"):
        mp.load(saved)
    # With an abstract tree it loads fine.
    out = mp.load(saved, {"w": jax.ShapeDtypeStruct((4, 8), np.float32, sharding=NamedSharding(mesh24, P())), "step": 0})
    assert np.array_equal(np.asarray(out["w"]), np.arange(32, dtype=np.float32).reshape(4, 8))


def test_overwrite_rules(tmp_path: Path, saved: Path) -> None:
    before = listing(saved)
    with pytest.raises(mp.CheckpointExistsError, match="overwrite=True"):
        mp.save(saved, {"x": 1})
    assert listing(saved) == before and isinstance(mp.CheckpointExistsError("x"), FileExistsError)
    mp.save(saved, {"x": 2}, overwrite=True)
    assert mp.load(saved) == {"x": 2}
    assert [p.name for p in saved.parent.iterdir()] == ["ckpt"]
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "data.txt").write_text("keep me")
    with pytest.raises(mp.CheckpointExistsError, match="not a committed checkpoint"):
        mp.save(tmp_path / "precious", {"x": 1}, overwrite=True)
    assert (tmp_path / "precious" / "data.txt").read_text() == "keep me"


def test_bad_options_and_names(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="compression"):
        mp.SaveOptions(compression="lz4")
    with pytest.raises(ValueError, match="positive"):
        mp.LoadOptions(memory_budget_bytes=0)
    with pytest.raises(TypeError, match="SaveOptions"):
        mp.Context(saving=mp.LoadOptions())  # type: ignore[arg-type]
    with pytest.raises(mp.InvalidKeyError, match="checkpointable name"):
        mp.save_checkpointables(tmp_path / "c", {"a/b": {"x": 1}})
    with pytest.raises(TypeError, match="JSON-serializable"):
        mp.save(tmp_path / "c", {"x": 1}, custom_metadata={"f": object()})
    assert listing(tmp_path) == []
