"""Bad input: each gets a typed error that names the problem (and the fix), and writes nothing."""

from __future__ import annotations

import json
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
from tests._helpers import listing, put, reseal, same_bits, without_compact_shardings


@pytest.fixture
def saved(tmp_path: Path, mesh24: jax.sharding.Mesh) -> Path:
    state = {
        "w": put(np.arange(64 * 64, dtype=np.float32).reshape(64, 64), mesh24, P("data", "model")),
        "n": np.arange(300, dtype=np.int64),
        "step": 1,
        "tag": "t",
    }
    return mp.save(tmp_path / "ckpt", state)


def copy_of(saved: Path, name: str) -> Path:
    dst = saved.parent / name
    shutil.copytree(saved, dst)
    return dst


LOADERS = {
    "load": lambda p: mp.load(p),
    "metadata": lambda p: mp.metadata(p),
    "load_checkpointables": lambda p: mp.load_checkpointables(p),
}


# ------------------------------------------------------------------------------------------
# Paths that are not checkpoints
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("call", list(LOADERS), ids=list(LOADERS))
def test_paths_that_are_not_checkpoints(tmp_path: Path, saved: Path, call: str) -> None:
    fn = LOADERS[call]
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "plain_dir").mkdir()
    (tmp_path / "plain_dir" / "stuff.txt").write_text("y")
    stale = tmp_path / "step.orbax-checkpoint-tmp"
    shutil.copytree(saved, stale)  # looks complete, but a tmp dir is never a checkpoint
    uncommitted = copy_of(saved, "uncommitted")
    (uncommitted / "commit_success.txt").unlink()
    (uncommitted / "orbax.checkpoint").unlink()
    cases = {
        tmp_path / "missing": "does not exist",
        tmp_path / "a_file": "is a file",
        tmp_path / "plain_dir": "not a checkpoint",
        tmp_path: "not its parent",
        saved / "state": "not a checkpoint",
        stale: "unfinished save",
        uncommitted: "commit marker",
    }
    before = listing(tmp_path)
    for path, words in cases.items():
        with pytest.raises(mp.CheckpointNotFoundError, match=words) as info:
            fn(path)
        assert str(path) in str(info.value), info.value
        assert isinstance(info.value, FileNotFoundError)
    assert listing(tmp_path) == before


# ------------------------------------------------------------------------------------------
# Missing, truncated or malformed metadata files
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("call", ["load", "metadata"])
@pytest.mark.parametrize(
    "file", ["_CHECKPOINT_METADATA", "state/_METADATA", "state/_sharding", "state/_strings.json"]
)
def test_truncated_metadata_files(saved: Path, file: str, call: str) -> None:
    if file == "state/_strings.json" and call == "metadata":
        pytest.skip("metadata() does not read string values")
    text = (saved / file).read_text()
    for i, cut in enumerate({0, 1, len(text) // 3, len(text) // 2, len(text) - 1}):
        broken = copy_of(saved, f"cut{i}")
        if file.endswith("_sharding"):  # read only without the compact form
            without_compact_shardings(broken)
        (broken / file).write_text(text[:cut])
        with pytest.raises(mp.CorruptCheckpointError, match="truncated or not JSON") as info:
            LOADERS[call](broken)
        assert file.split("/")[-1] in str(info.value)


@pytest.mark.parametrize("file", ["_CHECKPOINT_METADATA", "state/_METADATA"])
def test_missing_metadata_files(saved: Path, file: str) -> None:
    (saved / file).unlink()
    for call in ("load", "metadata"):
        with pytest.raises(mp.CheckpointNotFoundError, match=Path(file).name):
            LOADERS[call](saved)


@pytest.mark.parametrize(
    ("file", "content"),
    [
        ("_CHECKPOINT_METADATA", "[]"),
        ("_CHECKPOINT_METADATA", '{"item_handlers": ["state"]}'),
        ("_CHECKPOINT_METADATA", '{"item_handlers": 5}'),
        ("state/_METADATA", "[]"),
        ("state/_METADATA", '{"tree_metadata": []}'),
        ("state/_METADATA", '{"tree_metadata": {"(\'w\',)": {}}}'),
        (
            "state/_METADATA",
            '{"tree_metadata": {"(\'w\',)": {"key_metadata": 3, "value_metadata": {}}}}',
        ),
        ("state/_sharding", "[]"),
        ("state/_sharding", '{"dw==": 5}'),
        ("state/_strings.json", "[]"),
    ],
)
def test_malformed_metadata_is_a_corrupt_checkpoint(saved: Path, file: str, content: str) -> None:
    """Valid JSON of the wrong shape: the same clear error as a truncated file, not a KeyError."""
    if file.endswith("_sharding"):  # read only without the compact form
        without_compact_shardings(saved)
    (saved / file).write_text(content)
    reseal(saved)
    calls = ["load"] if file.endswith("_strings.json") else ["load", "metadata"]
    for call in calls:
        with pytest.raises((mp.CorruptCheckpointError, mp.CheckpointNotFoundError)) as info:
            LOADERS[call](saved)
        assert Path(file).name in str(info.value) and "damaged" in str(info.value), info.value


def test_missing_array_data_names_the_array(saved: Path) -> None:
    no_header = copy_of(saved, "no_header")
    (no_header / "state" / "manifest.ocdbt").unlink()
    with pytest.raises(mp.CorruptCheckpointError, match="'(w|n)'.*missing"):
        mp.load(no_header)

    no_chunks = copy_of(saved, "no_chunks")
    for d in (no_chunks / "state").glob("ocdbt.process_*/d"):
        shutil.rmtree(d)
    with pytest.raises(ValueError, match=r"(?s)array '(w|n)'.*missing or damaged") as info:
        mp.load(no_chunks)
    assert "state" in str(info.value)


def test_missing_chunk_is_an_error_not_zeros(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    """Found by these tests: a plain-zarr3 checkpoint with a chunk file deleted loaded that
    shard as zeros. Every chunk is written (store_array_data_equal_to_fill_value), so a missing
    one is lost data, as Orbax also treats it."""
    w = np.arange(1, 33, dtype=np.float32).reshape(4, 8)
    with mp.Context(saving=mp.SaveOptions(use_ocdbt=False)):
        ckpt = mp.save(
            tmp_path / "c", {"w": put(w, mesh24, P("data", "model")), "n": np.arange(1, 5)}
        )
    (ckpt / "state" / "w" / "c" / "1" / "3").unlink()
    with pytest.raises(ValueError, match=r"(?s)array 'w'.*missing or damaged"):
        mp.load(ckpt)
    part = mp.load(ckpt, {"n": np.zeros(4, np.int64)}, partial=True)  # the rest is still readable
    assert same_bits(part["n"], np.arange(1, 5))


# ------------------------------------------------------------------------------------------
# Abstract trees that do not match
# ------------------------------------------------------------------------------------------


def test_abstract_tree_mismatches(saved: Path, mesh24: jax.sharding.Mesh) -> None:
    s = NamedSharding(mesh24, P())
    w = jax.ShapeDtypeStruct((64, 64), np.float32, sharding=s)
    full = {"w": w, "n": np.zeros(300, np.int64), "step": 0, "tag": ""}

    with pytest.raises(mp.StructureMismatchError, match=r"(?s)\['n'\].*partial=True"):
        mp.load(saved, {k: v for k, v in full.items() if k != "n"})
    with pytest.raises(
        mp.StructureMismatchError, match=r"(?s)\['extra'\].*not\s+have.*PLACEHOLDER"
    ):
        mp.load(saved, {**full, "extra": 1})
    with pytest.raises(mp.StructureMismatchError, match="not\\s+have"):
        mp.load(saved, {**full, "extra": 1}, partial=True)  # partial does not invent leaves
    with pytest.raises(mp.StructureMismatchError, match="not\\s+have"):
        mp.load(saved, [w, np.zeros(300, np.int64), 0, ""])  # a list where a dict was saved
    with pytest.raises(mp.StructureMismatchError, match=r"'w'.*\(32, 128\).*\(64, 64\)"):
        mp.load(saved, {**full, "w": jax.ShapeDtypeStruct((32, 128), np.float32, sharding=s)})
    with pytest.raises(mp.StructureMismatchError, match=r"'n'.*shape"):
        mp.load(saved, {**full, "n": np.zeros(299, np.int64)})
    with pytest.raises(mp.StructureMismatchError, match=r"'step'.*shape"):
        mp.load(saved, {**full, "step": jax.ShapeDtypeStruct((1,), np.int64, sharding=s)})

    # A dtype difference is a cast, not an error.
    out = mp.load(
        saved,
        {
            **full,
            "w": jax.ShapeDtypeStruct((64, 64), jnp.bfloat16, sharding=s),
            "n": np.zeros(300, np.int8),
        },
    )
    assert same_bits(
        out["w"], np.arange(64 * 64, dtype=np.float32).reshape(64, 64).astype(jnp.bfloat16)
    )
    assert same_bits(out["n"], np.arange(300).astype(np.int8))
    assert issubclass(mp.StructureMismatchError, ValueError)


# ------------------------------------------------------------------------------------------
# Leaves and keys that cannot be saved
# ------------------------------------------------------------------------------------------

UNSUPPORTED: dict[str, Any] = {
    "object": object(),
    "bytes": b"raw",
    "lambda": lambda: 1,
    "set": {1, 2},
    "object-array": np.array([object(), 1], dtype=object),
    "str-array": np.array(["a", "b"]),
    "bytes-array": np.array([b"a"]),
    "numpy-str": np.str_("x"),
    "abstract-leaf": jax.ShapeDtypeStruct((2,), np.float32),
    "huge-int": 2**80,
    "datetime64": np.datetime64("2020-01-01"),
    "timedelta-array": np.array([1, 2], dtype="timedelta64[s]"),
    "longdouble": np.arange(3, dtype=np.longdouble),
    "void": np.void(b"ab"),
    "uint4-array": np.arange(4).astype(jnp.uint4),
}


@pytest.mark.parametrize("kind", list(UNSUPPORTED), ids=list(UNSUPPORTED))
def test_unsupported_leaves_write_nothing(tmp_path: Path, kind: str) -> None:
    with pytest.raises(mp.UnsupportedLeafError) as info:
        mp.save(tmp_path / "c", {"ok": np.ones(3), "deep": {"bad": UNSUPPORTED[kind]}})
    assert "deep.bad" in str(info.value), info.value
    assert isinstance(info.value, TypeError)
    assert listing(tmp_path) == []


@pytest.mark.parametrize(
    "dtype", [jnp.uint4, jnp.float8_e4m3, jnp.uint2], ids=lambda d: np.dtype(d).name
)
def test_device_array_dtype_without_an_on_disk_form(
    tmp_path: Path, mesh24: jax.sharding.Mesh, dtype: Any
) -> None:
    x = put(np.arange(8).astype(dtype), mesh24, P("model"))
    with pytest.raises(mp.UnsupportedLeafError, match=rf"(?s)'x'.*{np.dtype(dtype).name}"):
        mp.save(tmp_path / "c", {"ok": np.ones(3), "x": x})
    assert listing(tmp_path) == []


@pytest.mark.parametrize(
    "tree",
    [
        {"a/b": 1},
        {"..": 1},
        {".": 1},
        {"": 1},
        {"x": {"back\\slash": 1}},
        {"nul\x00": 1},
        {"a.b": 1, "a": {"b": 2}},
        {"l": [np.ones(2)], "l.0": 3},
        {"deep": {"ok": [{"../escape": 1}]}},
    ],
    ids=[
        "slash",
        "dotdot",
        "dot",
        "empty",
        "backslash",
        "nul",
        "dot-collision",
        "list-collision",
        "nested-dotdot",
    ],
)
def test_unsafe_keys_write_nothing(tmp_path: Path, tree: dict[str, Any]) -> None:
    with pytest.raises(mp.InvalidKeyError, match="(?i)rename") as info:
        mp.save(tmp_path / "c", tree)
    assert isinstance(info.value, ValueError)
    assert listing(tmp_path) == []


@pytest.mark.parametrize("key", ["_METADATA", "_sharding", "_strings.json", "_milepost.json"])
def test_keys_that_shadow_metadata_files_in_plain_zarr3(
    tmp_path: Path, mesh24: jax.sharding.Mesh, key: str
) -> None:
    """Plain zarr3 stores each array in a folder named after it: such a key would collide with a
    metadata file (found by these tests: the save died in finalize, or committed an unloadable
    checkpoint). With OCDBT the names live inside the database and are fine."""
    tree = {key: put(np.arange(8.0, dtype=np.float32), mesh24, P("data")), "s": "text", "i": 3}
    with mp.Context(saving=mp.SaveOptions(use_ocdbt=False)):
        with pytest.raises(mp.InvalidKeyError, match=rf"(?s){key}.*use_ocdbt"):
            mp.save(tmp_path / "plain", tree)
    assert listing(tmp_path) == []
    mp.save(tmp_path / "ocdbt", tree)
    assert same_bits(mp.load(tmp_path / "ocdbt")[key], tree[key])


@pytest.mark.parametrize("name", ["", "a/b", "..", "_private", "x\\y"])
def test_bad_checkpointable_names(tmp_path: Path, name: str) -> None:
    with pytest.raises(mp.InvalidKeyError, match="checkpointable name"):
        mp.save_checkpointables(tmp_path / "c", {"ok": {"x": 1}, name: {"x": 1}})
    assert listing(tmp_path) == []


def test_bad_paths_and_arguments_write_nothing(tmp_path: Path) -> None:
    # Found by this test: such a save committed a checkpoint that could never be loaded.
    with pytest.raises(ValueError, match="orbax-checkpoint-tmp"):
        mp.save(tmp_path / "step.orbax-checkpoint-tmp", {"x": 1})
    (tmp_path / "file").write_text("x")
    with pytest.raises((NotADirectoryError, FileExistsError)):
        mp.save(tmp_path / "file" / "ckpt", {"x": 1})
    with pytest.raises(TypeError, match="JSON-serializable"):
        mp.save(tmp_path / "c", {"x": 1}, custom_metadata={"f": object()})
    with pytest.raises(ValueError, match="nothing to save"):
        mp.save_checkpointables(tmp_path / "c", {})
    assert listing(tmp_path) == ["file"]


# ------------------------------------------------------------------------------------------
# Saved shardings over devices that do not exist
# ------------------------------------------------------------------------------------------


def _edit_sharding(ckpt: Path, edit: Any) -> None:
    without_compact_shardings(ckpt)  # so that _sharding is what is read
    f = ckpt / "state" / "_sharding"
    data = json.loads(f.read_text())
    for key, text in data.items():
        spec = json.loads(text)
        edit(spec)
        data[key] = json.dumps(spec)
    f.write_text(json.dumps(data))
    reseal(ckpt)


@pytest.mark.parametrize("device_str", ["TFRT_CPU_3", "cpu:3"])
def test_a_single_device_sharding_in_any_of_its_saved_spellings_loads(
    tmp_path: Path, device_str: str
) -> None:
    """Orbax records a single device as ``str(device)``: ``TFRT_CPU_3`` under jax before 0.10,
    ``cpu:3`` since. Both name device 3, and the array loads there without an abstract tree."""
    w = np.arange(32, dtype=np.float32).reshape(4, 8)
    ckpt = mp.save(tmp_path / "c", {"w": jax.device_put(w, jax.devices()[0])})
    _edit_sharding(ckpt, lambda s: s.__setitem__("device_str", device_str))
    out = mp.load(ckpt)["w"]
    assert same_bits(out, w) and out.sharding.device_set == {jax.devices()[3]}


def test_saved_sharding_on_missing_devices(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    w = np.arange(32, dtype=np.float32).reshape(4, 8)
    named = mp.save(tmp_path / "named", {"w": put(w, mesh24, P("data", "model"))})
    _edit_sharding(named, lambda s: s["device_mesh"]["mesh"][1].__setitem__(2, {"id": 99}))
    single = mp.save(tmp_path / "single", {"w": jax.device_put(w, jax.devices()[3])})
    _edit_sharding(single, lambda s: s.__setitem__("device_str", "cpu:99"))
    # The saved sharding is placed on the devices here (tests/test_load_anywhere.py), also for
    # an abstract leaf without a sharding.
    here = {named: NamedSharding(mesh24, P("data", "model")), single: jax.devices()[0]}
    for ckpt in (named, single):
        for loaded in (mp.load(ckpt), mp.load(ckpt, {"w": jax.ShapeDtypeStruct(w.shape, w.dtype)})):
            assert same_bits(loaded["w"], w)
            want = here[ckpt]
            if isinstance(want, NamedSharding):
                assert loaded["w"].sharding == want
            else:
                assert loaded["w"].sharding.device_set == {want}
        # With a sharding over devices that exist it loads.
        out = mp.load(
            ckpt,
            {
                "w": jax.ShapeDtypeStruct(
                    w.shape, w.dtype, sharding=NamedSharding(mesh24, P("model"))
                )
            },
        )
        assert same_bits(out["w"], w)
        # metadata() does not need the devices.
        assert 99 in mp.metadata(ckpt).tree["w"].sharding.device_ids


def test_sharding_spec_with_missing_devices_is_a_clear_error() -> None:
    spec = mp.ShardingSpec.named((2, 2), ("a", "b"), (0, 1, 2, 99), ("a", None))
    with pytest.raises(ValueError, match=r"(?s)\[99\].*abstract tree"):
        spec.to_jax()
    with pytest.raises(ValueError, match="needs 4 device ids"):
        mp.ShardingSpec.named((2, 2), ("a", "b"), (0, 1, 2), ("a",))


def test_deleted_array_is_a_clear_error_and_writes_nothing(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    """Found by this test: a deleted (donated) array failed deep in the engine with JAX's
    RuntimeError, and the TensorStore opens already in flight recreated the removed tmp dir."""
    x = put(np.arange(8.0, dtype=np.float32), mesh24, P("data"))
    jax.jit(lambda a: a + 1, donate_argnums=0)(x)
    with pytest.raises(ValueError, match=r"(?s)'params.x'.*deleted.*donat"):
        mp.save(tmp_path / "c", {"ok": np.ones(3), "params": {"x": x}})
    assert listing(tmp_path) == []


def test_engine_failure_after_opens_leaves_nothing_in_flight(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    """The worker engine itself: if staging fails, the array opens it issued have landed before
    it raises, so a caller's cleanup is final."""
    w = mp.workers
    x = put(np.arange(8.0, dtype=np.float32), mesh24, P())
    x.delete()
    tasks = tuple(
        w.SaveTask(
            source=0,
            spec=w.ArraySpec(
                name=f"a{i}", shape=(8,), dtype="float32", write_shape=(8,), chunk_shape=(8,)
            ),
            regions=(w.Region(device_id=0, index=((0, 8),)),),
        )
        for i in range(64)
    )
    plan = w.SavePlan(
        store=w.StoreSpec(directory=str(tmp_path / "store")), process_index=0, tasks=tasks
    )
    with pytest.raises(RuntimeError, match="deleted"):
        w.start_save(plan, [x])
    shutil.rmtree(tmp_path / "store", ignore_errors=True)
    mp.save(tmp_path / "other", {"y": np.arange(1000)})  # some work later: nothing reappeared
    assert not (tmp_path / "store").exists()


def test_nothing_is_written_inside_another_checkpoint(tmp_path: Path) -> None:
    """A checkpoint written into another one's folder would change it (and be deleted with it
    by an overwrite or retention): saves, copies and surgery refuse such a path by name."""
    from milepost import surgery as ms

    src = mp.save(tmp_path / "src", {"a": np.arange(1024, dtype=np.float32), "s": "x"})
    before = sorted(p.relative_to(src) for p in src.rglob("*"))
    for make in (
        lambda p: mp.save(p, {"b": np.arange(4)}),
        lambda p: mp.copy(src, p),
        lambda p: ms.write(p, ms.open(src).tree),
    ):
        for inside in (src / "pruned", src / "state" / "x"):
            with pytest.raises(mp.CheckpointExistsError, match=f"inside the checkpoint {src}"):
                make(inside)
    assert sorted(p.relative_to(src) for p in src.rglob("*")) == before
    assert mp.verify(src).ok
