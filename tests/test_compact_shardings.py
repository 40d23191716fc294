"""Shardings recorded once per mesh in ``_milepost.json``; Orbax's ``_sharding`` (every device
id per array) only while it stays under ``SaveOptions.orbax_sharding_max_bytes``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost.workers import ShardingSpec
from milepost.workers import format as fmt
from tests._helpers import assert_tree_equal, put, reseal, same_bits, without_compact_shardings

pytestmark = pytest.mark.filterwarnings("ignore:Sharding info not provided when restoring")


def make_state(mesh: jax.sharding.Mesh) -> dict[str, Any]:
    rng = np.random.default_rng(3)
    other = jax.make_mesh((4, 2), ("x", "y"))
    w = rng.standard_normal((16, 8), dtype=np.float32)
    return {
        "layers": {  # ten arrays on one mesh
            f"l{i}": put(w + i, mesh, P("data", "model") if i % 2 else P(None, ("data", "model")))
            for i in range(10)
        },
        "other": put(w, other, P("x")),  # a second mesh
        "host": jax.device_put(w, NamedSharding(mesh, P("data"), memory_kind="pinned_host")),
        "single": jax.device_put(w, jax.devices()[5]),
        "counts": np.arange(6, dtype=np.int32),
        "step": 7,
        "name": "run",
    }


def info(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / "state" / fmt.MILEPOST_INFO).read_text())


def shardings_of(ckpt: Path) -> dict[str, ShardingSpec | None]:
    return {
        leaf.name: leaf.sharding
        for leaf in mp.metadata(ckpt).leaves()
        if isinstance(leaf, mp.LeafMetadata)
    }


def orbax_shardings(ckpt: Path) -> dict[str, ShardingSpec]:
    """What ``_sharding`` says, read as milepost reads Orbax's checkpoints."""
    return without_compact_shardings_files(ckpt).shardings


def without_compact_shardings_files(ckpt: Path) -> Any:
    state = ckpt / "state"
    data = info(ckpt)
    data.pop("shardings")
    saved = (state / fmt.MILEPOST_INFO).read_text()
    try:
        (state / fmt.MILEPOST_INFO).write_text(json.dumps(data))
        return fmt.read_tree(state)
    finally:
        (state / fmt.MILEPOST_INFO).write_text(saved)


def test_both_forms_are_written_and_say_the_same(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    state = make_state(mesh24)
    ckpt = mp.save(tmp_path / "c", state)
    assert (ckpt / "state" / fmt.SHARDING).exists()
    compact = info(ckpt)["shardings"]
    assert compact["version"] == 1 and compact["orbax_file"] is True
    # the 11 arrays on (2, 4) share one mesh; one more for the (4, 2) mesh; none for 'single'
    assert len(compact["meshes"]) == 2
    assert compact["meshes"][0] == {
        "shape": [2, 4],
        "axis_names": ["data", "model"],
        "axis_types": [str(t).rsplit(".", 1)[-1] for t in mesh24.axis_types],
        "device_ids": {"start": 0, "count": 8},
    }
    arrays = compact["arrays"]
    assert arrays["layers.l0"] == {"mesh": 0, "spec": [None, ["data", "model"]]}
    assert arrays["layers.l1"] == {"mesh": 0, "spec": ["data", "model"]}
    assert arrays["other"]["mesh"] == 1
    assert arrays["host"] == {"mesh": 0, "spec": ["data"], "memory_kind": "pinned_host"}
    assert arrays["single"] == {"device": 5}
    assert set(arrays) == {f"layers.l{i}" for i in range(10)} | {"other", "host", "single"}

    # the compact form and Orbax's give identical ShardingSpecs, and metadata() reports them
    from_compact = fmt.read_tree(ckpt / "state").shardings
    assert from_compact == orbax_shardings(ckpt)
    assert from_compact == {n: ShardingSpec.from_jax(state_leaf(state, n).sharding) for n in arrays}
    reported = shardings_of(ckpt)
    assert {n: reported[n] for n in arrays} == from_compact
    assert_tree_equal(mp.load(ckpt), state)


def state_leaf(state: dict[str, Any], name: str) -> Any:
    node: Any = state
    for part in name.split("."):
        node = node[part]
    return node


def test_a_mesh_shared_by_many_arrays_is_recorded_once(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    tree = {f"w{i}": put(np.full((8, 4), i, np.float32), mesh24, P("data")) for i in range(40)}
    ckpt = mp.save(tmp_path / "c", tree)
    compact = info(ckpt)["shardings"]
    assert len(compact["meshes"]) == 1 and len(compact["arrays"]) == 40
    assert {e["mesh"] for e in compact["arrays"].values()} == {0}
    # a permuted mesh: its ids are listed, exactly
    devices = np.array(jax.devices())[[3, 1, 0, 2, 7, 6, 5, 4]].reshape(2, 4)
    shuffled = jax.sharding.Mesh(devices, ("data", "model"))
    ckpt = mp.save(tmp_path / "d", {"w": put(np.arange(32.0).reshape(8, 4), shuffled, P("data"))})
    (mesh,) = info(ckpt)["shardings"]["meshes"]
    assert mesh["device_ids"] == [3, 1, 0, 2, 7, 6, 5, 4]
    out = mp.load(ckpt)["w"]
    assert out.sharding.mesh.devices.tolist() == devices.tolist()


def test_orbax_sharding_may_be_missing(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    """Over the bound, ``_sharding`` is left out: milepost loads exactly as before, metadata()
    reports every sharding, verify is content, and a copy keeps it loadable."""
    state = make_state(mesh24)
    with mp.Context(saving=mp.SaveOptions(orbax_sharding_max_bytes=1000)):
        ckpt = mp.save(tmp_path / "c", state)
    assert not (ckpt / "state" / fmt.SHARDING).exists()
    assert info(ckpt)["shardings"]["orbax_file"] is False
    restored = mp.load(ckpt)
    assert_tree_equal(restored, state)  # values bit-identical, shardings the saved ones
    reported = shardings_of(ckpt)
    for name in info(ckpt)["shardings"]["arrays"]:
        want = ShardingSpec.from_jax(state_leaf(state, name).sharding)
        assert reported[name] == want, name
    assert mp.verify(ckpt).ok
    copied = mp.copy(ckpt, tmp_path / "copy").path
    assert_tree_equal(mp.load(copied), state)
    assert not (Path(copied) / "state" / fmt.SHARDING).exists()


def test_the_bound(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    tree = {f"w{i}": put(np.full((8, 4), i, np.float32), mesh24, P("data")) for i in range(4)}
    with mp.Context(saving=mp.SaveOptions(orbax_sharding_max_bytes=10**9)):
        big = mp.save(tmp_path / "big", tree)
    size = (big / "state" / fmt.SHARDING).stat().st_size
    # the file written is json.dumps's own output, and the bound is inclusive
    text = (big / "state" / fmt.SHARDING).read_text()
    assert text == json.dumps(json.loads(text))
    for bound, written in [(size, True), (size - 1, False), (0, False)]:
        with mp.Context(saving=mp.SaveOptions(orbax_sharding_max_bytes=bound)):
            ckpt = mp.save(tmp_path / f"b{bound}", tree)
        assert (ckpt / "state" / fmt.SHARDING).exists() is written, bound
        assert mp.metadata(ckpt).tree["w3"].sharding == ShardingSpec.from_jax(tree["w3"].sharding)
    assert mp.SaveOptions().orbax_sharding_max_bytes == 256 * 1024
    with pytest.raises(ValueError, match="orbax_sharding_max_bytes"):
        mp.SaveOptions(orbax_sharding_max_bytes=-1)
    with pytest.raises(TypeError, match="orbax_sharding_max_bytes"):
        mp.SaveOptions(orbax_sharding_max_bytes=1.5)  # type: ignore[arg-type]


def test_checkpoints_without_the_compact_form_load_as_before(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    """Orbax's checkpoints and older milepost ones: the shardings come from ``_sharding``."""
    state = make_state(mesh24)
    ckpt = without_compact_shardings(mp.save(tmp_path / "c", state))
    assert "shardings" not in info(ckpt)
    assert_tree_equal(mp.load(ckpt), state)
    assert fmt.read_tree(ckpt / "state").sharding_files == (fmt.SHARDING,)


# ------------------------------------------------------------------------------------------
# Crafted compact metadata
# ------------------------------------------------------------------------------------------


def _mesh(**changes: Any) -> dict[str, Any]:
    mesh = {
        "shape": [2, 4],
        "axis_names": ["data", "model"],
        "axis_types": ["Auto", "Auto"],
        "device_ids": {"start": 0, "count": 8},
    }
    return {**mesh, **changes}


CRAFTED: list[tuple[str, Any, str]] = [
    ("not an object", [], "not an object"),
    ("newer version", {"version": 2, "meshes": [], "arrays": {}}, "version is 2"),
    ("meshes not a list", {"version": 1, "meshes": {}, "arrays": {}}, "'meshes'"),
    (
        "mesh index out of range",
        {"version": 1, "meshes": [_mesh()], "arrays": {"w": {"mesh": 1, "spec": []}}},
        "refers to mesh 1",
    ),
    (
        "mesh index not an int",
        {"version": 1, "meshes": [_mesh()], "arrays": {"w": {"mesh": "0", "spec": []}}},
        "refers to mesh '0'",
    ),
    (
        "mesh index a bool",
        {"version": 1, "meshes": [_mesh()], "arrays": {"w": {"mesh": True, "spec": []}}},
        "refers to mesh True",
    ),
    (
        "too few device ids",
        {"version": 1, "meshes": [_mesh(device_ids=[0, 1, 2])], "arrays": {}},
        "lists 3 device ids, not 8",
    ),
    (
        "range of the wrong size",
        {"version": 1, "meshes": [_mesh(device_ids={"start": 0, "count": 9})], "arrays": {}},
        "lists 9 device ids, not 8",
    ),
    (
        "duplicate device ids",
        {"version": 1, "meshes": [_mesh(device_ids=[0, 1, 2, 3, 4, 5, 6, 6])], "arrays": {}},
        "device ids of mesh 0 repeat",
    ),
    (
        "negative device id",
        {"version": 1, "meshes": [_mesh(device_ids=[0, 1, 2, 3, 4, 5, 6, -7])], "arrays": {}},
        "device id of mesh 0 is -7",
    ),
    (
        "device ids neither",
        {"version": 1, "meshes": [_mesh(device_ids="0-7")], "arrays": {}},
        "device ids of mesh 0",
    ),
    (
        "shape not ints",
        {"version": 1, "meshes": [_mesh(shape=[2, "4"])], "arrays": {}},
        "a dimension of mesh 0 is '4'",
    ),
    (
        "axis names and shape disagree",
        {"version": 1, "meshes": [_mesh(axis_names=["data"])], "arrays": {}},
        "1 axis names",
    ),
    (
        "unknown axis type",
        {"version": 1, "meshes": [_mesh(axis_types=["Auto", "Sideways"])], "arrays": {}},
        "Sideways",
    ),
    (
        "spec names an axis the mesh lacks",
        {"version": 1, "meshes": [_mesh()], "arrays": {"w": {"mesh": 0, "spec": ["rows"]}}},
        "'rows'",
    ),
    (
        "spec entry of a wrong type",
        {"version": 1, "meshes": [_mesh()], "arrays": {"w": {"mesh": 0, "spec": [{"a": 1}]}}},
        "PartitionSpec",
    ),
    (
        "neither mesh nor device",
        {"version": 1, "meshes": [_mesh()], "arrays": {"w": {"spec": []}}},
        "neither a mesh nor a device",
    ),
    (
        "memory kind not a string",
        {"version": 1, "meshes": [_mesh()], "arrays": {"w": {"device": 0, "memory_kind": 3}}},
        "memory_kind 3",
    ),
    (
        "orbax_file not a bool",
        {"version": 1, "meshes": [], "arrays": {}, "orbax_file": "yes"},
        "'orbax_file'",
    ),
]


@pytest.mark.parametrize(
    ("content", "words"), [c[1:] for c in CRAFTED], ids=[c[0] for c in CRAFTED]
)
def test_crafted_compact_shardings_are_corrupt_checkpoint_errors(
    tmp_path: Path, mesh24: jax.sharding.Mesh, content: Any, words: str
) -> None:
    ckpt = mp.save(tmp_path / "c", {"w": put(np.arange(32.0).reshape(8, 4), mesh24, P("data"))})
    data = info(ckpt)
    data["shardings"] = content
    (ckpt / "state" / fmt.MILEPOST_INFO).write_text(json.dumps(data))
    reseal(ckpt)
    for call in (mp.load, mp.metadata):
        with pytest.raises(mp.CorruptCheckpointError) as caught:
            call(ckpt)
        message = str(caught.value)
        assert str(ckpt / "state" / fmt.MILEPOST_INFO) in message and words in message, message
        assert "crafted" in message, message


def test_compact_sharding_on_missing_devices(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    """Well-formed, but over devices this runtime lacks: the saved mesh is laid over the
    devices here (tests/test_load_anywhere.py), and an abstract tree's shardings are used."""
    w = np.arange(32, dtype=np.float32).reshape(4, 8)
    ckpt = mp.save(tmp_path / "c", {"w": put(w, mesh24, P("data", "model"))})
    data = info(ckpt)
    data["shardings"]["meshes"][0]["device_ids"] = {"start": 100, "count": 8}
    (ckpt / "state" / fmt.MILEPOST_INFO).write_text(json.dumps(data))
    reseal(ckpt)
    out = mp.load(ckpt)["w"]
    assert same_bits(out, w) and out.sharding == NamedSharding(mesh24, P("data", "model"))
    target = NamedSharding(mesh24, P("model"))
    out = mp.load(ckpt, {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=target)})["w"]
    assert same_bits(out, w) and out.sharding == target


def test_a_sharding_hashes_in_bounded_time_and_as_equal_ones_do() -> None:
    """A load looks every array's sharding up: the hash of a mesh of thousands of devices
    reads a bounded part of it; specs that differ only past that part are unequal keys."""
    ids = tuple(range(32768))
    a = ShardingSpec.named((4096, 8), ("data", "model"), ids, ("data", None))
    b = ShardingSpec.named((4096, 8), ("data", "model"), tuple(ids), ("data", None))
    swapped = (*ids[:100], ids[101], ids[100], *ids[102:])  # (the same devices, placed otherwise)
    c = ShardingSpec.named((4096, 8), ("data", "model"), swapped, ("data", None))
    assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1
    assert a != c and {a: 1, c: 2} == {b: 1, c: 2} and len({a, b, c}) == 2
