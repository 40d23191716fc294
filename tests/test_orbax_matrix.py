"""The compatibility matrix: checkpoints that released Orbax and Flax versions wrote (0.5.3 to
0.12.8, every public save API, OCDBT on and off, zarr2 and zarr3; tests/fixtures/orbax, made by
its make_fixtures.py) load exactly, are described, reshard onto another mesh, list as training
roots, verify as "no checksums recorded"; and what each version leaves of an unfinished save is
never a checkpoint."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost._cli import main as cli
from milepost.training import Checkpointer, list_steps

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

HERE = Path(__file__).parent / "fixtures" / "orbax"
MANIFEST: list[dict[str, Any]] = json.loads((HERE / "manifest.json").read_text())["fixtures"]


def _load_expected() -> Any:
    spec = importlib.util.spec_from_file_location("orbax_expected", HERE / "_expected.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXPECTED = _load_expected()


def of_kind(*kinds: str) -> list[Any]:
    return [pytest.param(e, id=e["path"]) for e in MANIFEST if e["kind"] in kinds]


def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{'a/b': leaf} of a loaded tree (lists by index, like the fixtures' names)."""
    if isinstance(tree, dict) and tree:
        return {
            k: v for key, child in tree.items() for k, v in flat(child, f"{prefix}{key}/").items()
        }
    if isinstance(tree, list | tuple) and tree:
        return {
            k: v for i, child in enumerate(tree) for k, v in flat(child, f"{prefix}{i}/").items()
        }
    return {prefix[:-1]: tree}


def expected(entry: dict[str, Any], k: int, leaves: list[str] | None) -> dict[str, Any]:
    want = EXPECTED.leaves(k, small=entry["tree"] == "small")
    if "dtype" in entry.get("save_args", []):  # saved with SaveArgs(dtype=bfloat16)
        want["params/w"] = want["params/w"].astype(ml_dtypes.bfloat16)
    names = (
        leaves
        if leaves is not None
        else [n for n in want if n.split("/")[0] not in entry["dropped_leaves"]]
    )
    return {name: want[name] for name in names}


def check_tree(got: Any, want: dict[str, Any], where: str) -> None:
    """Every array, scalar and string exactly (arrays: values and dtype); None and empty
    containers as Orbax restores them (it may drop them: then they are absent)."""
    found = flat(got)
    for name, value in want.items():
        if value is None or (isinstance(value, dict | list) and not value):
            if name in found:
                assert found[name] in (None, {}, []), (where, name, found[name])
            continue
        assert name in found, (where, name, sorted(found))
        g = found[name]
        if isinstance(value, np.ndarray):
            g = np.asarray(g)
            assert g.dtype == value.dtype and g.shape == value.shape, (where, name, g.dtype)
            assert np.array_equal(g.view(np.uint8), value.view(np.uint8)), (where, name)
        elif isinstance(value, np.generic):
            # Orbax records no NumPy scalar type: Orbax itself restores a Python scalar
            assert g == value and (
                np.asarray(g).dtype == value.dtype or type(g) is type(value.item())
            ), (where, name, g)
        else:
            assert g == value and type(g) in (type(value), np.dtype(type(value)).type), (
                where,
                name,
                g,
            )


def other_mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((2, 4), ("a", "b"))


def check_resharded(path: Path, want_w: np.ndarray) -> None:
    """params/w onto a mesh of other axes and another layout, alone (partial)."""
    sharding = NamedSharding(other_mesh(), P("b", "a"))
    abstract = {
        "params": {"w": jax.ShapeDtypeStruct(want_w.shape, want_w.dtype, sharding=sharding)}
    }
    got = mp.load(path, abstract, partial=True)["params"]["w"]
    assert got.sharding == sharding and np.array_equal(np.asarray(got), want_w)


@pytest.mark.parametrize("entry", of_kind("pytree"))
def test_a_tree_loads_exactly_and_is_described(entry: dict[str, Any]) -> None:
    path = HERE / entry["path"]
    want = expected(entry, 0, entry["leaves"])
    check_tree(mp.load(path), want, entry["path"])
    meta = mp.metadata(path)
    described = flat(meta.tree)
    for name, value in want.items():
        if isinstance(value, np.ndarray):
            assert described[name].shape == value.shape, name
            assert described[name].dtype == value.dtype, name
    assert not meta.unreadable
    check_resharded(path, want["params/w"])
    report = mp.verify(path)
    assert report.ok, report
    assert any("no _milepost_checksums.json" in note for note in report.notes), report


@pytest.mark.parametrize("entry", of_kind("flax_msgpack"))
def test_a_flax_msgpack_file_loads_exactly(entry: dict[str, Any]) -> None:
    path = HERE / entry["path"]
    want = expected(entry, 0, entry["leaves"])
    got = mp.load(path)
    # msgpack keeps lists as maps with index keys, as flax.serialization restores them
    check_tree(got, want, entry["path"])
    described = flat(mp.metadata(path).tree)
    assert described["params/w"].shape == want["params/w"].shape
    check_resharded(path, want["params/w"])


def check_item(got: Any, item: dict[str, Any], entry: dict[str, Any], step: int) -> None:
    where = f"{entry['path']} step {step}"
    if item["kind"] == "json":
        value = dict(item["value"])
        if "'step'" in item.get("notes", ""):
            value["step"] = step
        assert got == value, where
    elif item["kind"] == "pytree" and "value" in item:
        assert got == item["value"], where
    else:  # a step holds tree(step), unless its manifest entry says tree(0)
        k = 0 if "tree(0)" in item.get("notes", "") else step
        check_tree(got, expected(entry, k, item.get("leaves")), where)


@pytest.mark.parametrize("entry", of_kind("composite"))
def test_every_part_of_a_composite_loads(entry: dict[str, Any]) -> None:
    path = HERE / entry["path"]
    parts = mp.load_checkpointables(path)
    assert set(parts) == set(entry["items"])
    for name, item in entry["items"].items():
        check_item(parts[name], item, entry, 0)
    meta = mp.metadata(path)
    assert set(meta.checkpointables) == set(entry["items"]) and not meta.unreadable
    check_item(mp.load(path), entry["items"]["state"], entry, 0)  # the main tree alone


def restore_iterator(item: dict[str, Any]) -> Any:
    """A fresh iterator over the dataset the fixture's iterator read (its manifest says which)."""
    grain = pytest.importorskip("grain")
    assert item["dataset"] == "grain.MapDataset.range(20).map(lambda x: x * 3).to_iter_dataset()"
    return iter(grain.MapDataset.range(20).map(lambda x: x * 3).to_iter_dataset())


@pytest.mark.parametrize("entry", of_kind("manager"))
def test_a_manager_root_lists_and_loads_every_step(
    entry: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    root = HERE / entry["path"]
    with Checkpointer(root, read_only=True) as ckpt:
        assert ckpt.steps == entry["steps"]
        for step in entry["steps"]:
            abstracts: dict[str, Any] = {name: None for name in entry["items"]}
            iterators = {
                name: restore_iterator(item)
                for name, item in entry["items"].items()
                if item["kind"] == "grain"
            }
            abstracts.update(iterators)
            parts = ckpt.load_checkpointables(step, abstracts)
            for name, item in entry["items"].items():
                if item["kind"] == "grain":
                    it = iterators[name]
                    assert [int(next(it)) for _ in range(3)] == item["next_after_restore"]
                else:
                    check_item(parts[name], item, entry, step)
        meta = ckpt.metadata(entry["steps"][-1])
        assert not meta.unreadable and meta.tree is not None
    rows = list_steps(root)
    assert [(r["step"], r["state"]) for r in rows] == [(s, "committed") for s in entry["steps"]]
    capsys.readouterr()
    assert cli(["ls", str(root)]) == 0  # `milepost ls`
    printed = capsys.readouterr().out
    assert all(str(s) in printed for s in entry["steps"]) and "committed" in printed, printed


@pytest.mark.parametrize("entry", of_kind("unfinished_pytree"))
def test_an_unfinished_save_of_each_version_is_refused(entry: dict[str, Any]) -> None:
    folder = HERE / entry["path"]
    left = sorted(p.name for p in folder.iterdir())
    assert left == sorted(entry["left_behind"]) and all(".orbax-checkpoint-tmp" in n for n in left)
    for name in left:
        for call in (mp.load, mp.metadata, mp.load_checkpointables):
            with pytest.raises(mp.CheckpointNotFoundError, match="unfinished save"):
                call(folder / name)


@pytest.mark.parametrize("entry", of_kind("unfinished_manager"))
def test_an_unfinished_step_of_each_version_is_never_listed(
    entry: dict[str, Any], tmp_path: Path
) -> None:
    root = HERE / entry["path"]
    with Checkpointer(root, read_only=True) as ckpt:
        assert ckpt.steps == entry["steps"]
    unfinished = [n for n in entry["left_behind"] if ".orbax-checkpoint-tmp" in n]
    assert unfinished
    rows = {r["step"]: r["state"] for r in list_steps(root)}
    assert rows == {**{s: "committed" for s in entry["steps"]}, 1: "unfinished save"}
    with pytest.raises(mp.CheckpointNotFoundError, match="unfinished save"):
        mp.load_checkpointables(root / unfinished[0])
    # a writable Checkpointer removes what the dead writer left and keeps the finished step
    copy = shutil.copytree(root, tmp_path / "root")
    with Checkpointer(copy) as ckpt:
        assert ckpt.steps == entry["steps"]
    assert sorted(p.name for p in copy.iterdir()) == [str(s) for s in entry["steps"]]


def test_a_folder_of_old_checkpoints_is_not_taken_for_one(tmp_path: Path) -> None:
    """Checkpoints from before _CHECKPOINT_METADATA side by side look like the items of one old
    step: each still loads, a save beside them is not "inside a checkpoint", and replacing the
    folder needs files of its own saying it is one."""
    folder = tmp_path / "ckpts"
    for name in ("pytree_default", "standard"):
        shutil.copytree(HERE / "0.5.3" / name, folder / name)
    entry = next(e for e in MANIFEST if e["path"] == "0.5.3/pytree_default")
    check_tree(mp.load(folder / "pytree_default"), expected(entry, 0, entry["leaves"]), "copy")
    mp.save(folder / "new", {"x": np.arange(3)})
    with pytest.raises(mp.CheckpointExistsError, match="not a committed checkpoint"):
        mp.save(folder, {"x": 1}, overwrite=True)
    assert sorted(p.name for p in folder.iterdir()) == ["new", "pytree_default", "standard"]


def test_an_old_step_with_a_part_milepost_does_not_know_is_kept(tmp_path: Path) -> None:
    """A step from before _CHECKPOINT_METADATA whose parts include one milepost has no handler
    for is still a finished step: a writable Checkpointer lists it and never removes it."""
    root = shutil.copytree(HERE / "0.5.3" / "manager", tmp_path / "root")
    (root / "1" / "data_iter").mkdir()
    (root / "1" / "data_iter" / "process_0-of-1.json").write_text('{"next_index": 4}')
    with Checkpointer(root) as ckpt:
        assert ckpt.steps == [0, 1]
        meta = ckpt.metadata(1)
        assert meta.tree is not None and set(meta.checkpointables) == {
            "state",
            "extra",
            "data_iter",
        }
        assert "data_iter" in meta.unreadable  # no handler recorded, and not a tree's files
    assert (root / "1" / "data_iter" / "process_0-of-1.json").is_file()
