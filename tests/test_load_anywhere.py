"""Load anywhere: a checkpoint loaded without an abstract tree on a runtime that lacks some of
its saved devices is placed on the devices there are (the saved mesh laid over them when the
count allows, else cut down to fit; one device on a laptop), with one log line per change;
shardings recorded with other device ids or other platforms' device names are no obstacle.
With an abstract tree's shardings nothing changes."""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost._checkpoint._anywhere import SavedShardings, fitted_sizes
from milepost.colocated import RayHostGroup
from milepost.workers import format as fmt
from tests import _subproc
from tests._helpers import put, reseal, without_compact_shardings

pytestmark = pytest.mark.filterwarnings("ignore:Sharding info not provided when restoring")

ORBAX_FIXTURE = Path(__file__).parent / "fixtures" / "orbax" / "0.12.8" / "pytree_default"


def make_state() -> dict[str, Any]:
    """Two meshes (several arrays on the first), typed PRNG keys, one array on device 5, one
    in pinned host memory, and leaves that are not device arrays."""
    rng = np.random.default_rng(11)
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    other = jax.make_mesh((4, 2), ("x", "y"))
    return {
        "w": put(rng.standard_normal((16, 8), dtype=np.float32), mesh, P("data", "model")),
        "b": put(np.arange(8, dtype=np.int32), mesh, P("model")),
        "r": put(rng.standard_normal((4, 4), dtype=np.float32), mesh, P()),
        "wide": put(rng.standard_normal((8, 8), dtype=np.float32), mesh, P(("data", "model"))),
        "keys": jax.device_put(
            jax.random.split(jax.random.key(3), 8), NamedSharding(mesh, P(("data", "model")))
        ),
        "o": put(rng.standard_normal((8, 6), dtype=np.float32), other, P("x", "y")),
        "single": jax.device_put(np.arange(5, dtype=np.float32), jax.devices()[5]),
        "host": jax.device_put(
            np.arange(16, dtype=np.float32),
            NamedSharding(mesh, P("data"), memory_kind="pinned_host"),
        ),
        "counts": np.arange(6, dtype=np.int32),
        "step": 7,
    }


def values_of(x: Any) -> np.ndarray:
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x)


def assert_values(loaded: dict[str, Any], state: dict[str, Any]) -> None:
    for k, v in state.items():
        got, want = values_of(loaded[k]), values_of(v)
        assert got.dtype == want.dtype and np.array_equal(got, want), k
    assert loaded["step"] == 7


def entries(spec: Any) -> list[Any]:
    """A PartitionSpec's entries (tuples as lists, trailing Nones dropped), to compare."""
    out = [list(e) if isinstance(e, tuple) else e for e in spec]
    while out and out[-1] is None:
        out.pop()
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    state = make_state()
    return mp.save(tmp_path_factory.mktemp("anywhere") / "c", state), state


def placements(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("loading ")]


# ---- fewer devices: a process of its own ------------------------------------------------


def start_load(paths: dict[str, Path], devices: int, npz: Path) -> Any:
    """A process with ``devices`` CPU devices loading each of ``paths`` without an abstract
    tree (``tests/_load_anywhere.py``); :func:`finish` gives what it placed where, and the
    values."""
    where = json.dumps({k: str(v) for k, v in paths.items()})
    return _subproc.popen_module("tests._load_anywhere", where, str(npz), devices=devices)


def finish(proc: Any, npz: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    result = next(line for line in stdout.splitlines() if line.startswith("RESULT "))
    with np.load(npz) as arrays:
        return json.loads(result[len("RESULT ") :]), dict(arrays)


def orbax_expected() -> dict[str, Any]:
    """The fixture's values by leaf path (tests/fixtures/orbax/_expected.py)."""
    import importlib.util

    where = ORBAX_FIXTURE.parents[1] / "_expected.py"
    spec = importlib.util.spec_from_file_location("orbax_expected", where)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(module.leaves(0))


def test_a_checkpoint_of_8_devices_loads_on_1_4_and_6(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """Saved over 8 devices, loaded on 1 (a laptop: all axes 1), 4 (each mesh cut to 4 devices,
    axis names and PartitionSpecs kept) and 6 (the largest meshes that fit: 4 of the 6); the
    values exactly; one log line per saved mesh and one for a missing single device, not one
    per array. On 1 device an Orbax-written checkpoint (of 8 devices) opens the same way."""
    path, state = saved
    runs = {}
    for n in (1, 4, 6):  # the three processes run at once
        paths = {"mp": path, **({"orbax": ORBAX_FIXTURE} if n == 1 else {})}
        runs[n] = start_load(paths, n, tmp_path / f"{n}.npz")
    results = {n: finish(proc, tmp_path / f"{n}.npz") for n, proc in runs.items()}
    fitted = {  # (data, model) of (2, 4) and (x, y) of (4, 2), cut to fit
        1: ({"data": 1, "model": 1}, {"x": 1, "y": 1}),
        4: ({"data": 2, "model": 2}, {"x": 4, "y": 1}),
        6: ({"data": 2, "model": 2}, {"x": 4, "y": 1}),
    }
    for n, (out, arrays) in results.items():
        for k, v in state.items():
            if isinstance(v, jax.Array):
                assert np.array_equal(arrays[f"mp/{k}"], values_of(v)), (n, k)
        main, other = fitted[n]
        for k in ("w", "b", "r", "wide", "keys", "host"):
            got = out[f"mp/{k}"]
            assert got["mesh"] == main, (n, k, got)
            assert entries(got["spec"]) == entries(state[k].sharding.spec), (n, k, got)
            assert sorted(got["ids"]) == list(range(min(n, 4))), (n, k, got)
        assert out["mp/host"]["memory"] == "pinned_host"  # a memory kind the CPU offers: kept
        assert out["mp/o"]["mesh"] == other and entries(out["mp/o"]["spec"]) == ["x", "y"]
        lines = out["mp:log"]
        if n == 6:  # device 5 is there: as saved
            assert out["mp/single"] == {"device": 5}
            assert len(lines) == 2, lines
        else:
            assert out["mp/single"] == {"device": 0}
            assert any(
                "saved on device 5, which this runtime lacks: placed on device 0" in line
                for line in lines
            ), lines
            assert len(lines) == 3, lines  # one per mesh, one for the device: not per array
        assert any(
            f"saved over 8 devices {{'data': 2, 'model': 4}} (ids 0..7), this runtime has {n}: "
            f"placed on mesh {main}"
            in line
            and line.endswith("pass an abstract tree to choose the placement")
            for line in lines
        ), lines
        assert any(f"placed on mesh {other}" in line for line in lines), lines
    out, arrays = results[1]  # Orbax's checkpoint, written over 8 devices, on 1
    want = orbax_expected()
    for k in ("params/w", "params/b", "nested_list/0"):
        got = arrays[f"orbax/{k}"]
        assert np.array_equal(got, np.asarray(want[k]).astype(got.dtype)), k
        assert out[f"orbax/{k}"]["ids"] == [0], out[f"orbax/{k}"]
    assert len(out["orbax:log"]) == 1, out["orbax:log"]
    assert "{'x': 4, 'y': 2} (ids 0..7), this runtime has 1" in out["orbax:log"][0]


# ---- other device ids, other platforms' names: in this process ---------------------------


def copy_of(saved: tuple[Path, dict[str, Any]], where: Path) -> Path:
    import shutil

    return Path(shutil.copytree(saved[0], where))


def foreign_ids(ckpt: Path) -> Path:
    """Milepost's recorded shardings moved to device ids 100 on (as a save on other hosts
    records them), the array on device 5 to device 13, and the pinned host array to a memory
    kind these devices lack; resealed."""
    info_path = ckpt / "state" / fmt.MILEPOST_INFO
    info = json.loads(info_path.read_text())
    for mesh in info["shardings"]["meshes"]:
        ids = mesh["device_ids"]
        mesh["device_ids"] = (
            {"start": ids["start"] + 100, "count": ids["count"]}
            if isinstance(ids, dict)
            else [i + 100 for i in ids]
        )
    arrays = info["shardings"]["arrays"]
    assert arrays["single"] == {"device": 5} and arrays["host"]["memory_kind"] == "pinned_host"
    arrays["single"]["device"] = 13
    arrays["host"]["memory_kind"] = "hbm_of_elsewhere"
    info_path.write_text(json.dumps(info))
    reseal(ckpt)
    return ckpt


def assert_on_saved_meshes_here(loaded: dict[str, Any], state: dict[str, Any]) -> None:
    """Each array on its saved mesh (shape, axis names, PartitionSpec), laid over this
    process's 8 devices as ``jax.make_mesh`` lays them."""
    for k in ("w", "b", "r", "wide", "keys", "o"):
        got, want = loaded[k].sharding, state[k].sharding
        assert isinstance(got, NamedSharding), k
        assert dict(got.mesh.shape) == dict(want.mesh.shape), k
        assert entries(got.spec) == entries(want.spec), k
        made = jax.make_mesh(tuple(want.mesh.devices.shape), tuple(want.mesh.axis_names))
        assert [d.id for d in got.mesh.devices.flat] == [d.id for d in made.devices.flat], k


def test_shardings_recorded_with_other_device_ids_load_on_the_saved_meshes(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Device ids 100..107 (a multi-host or other-platform save) on these 8 devices: the saved
    meshes laid over them; device 13 -> device 0; an unknown memory kind -> the default
    memory; each said once."""
    state = saved[1]
    ckpt = foreign_ids(copy_of(saved, tmp_path / "c"))
    with caplog.at_level(logging.INFO, logger="milepost"):
        loaded = mp.load(ckpt)
    assert_values(loaded, state)
    assert_on_saved_meshes_here(loaded, state)
    assert loaded["single"].sharding == jax.sharding.SingleDeviceSharding(jax.devices()[0])
    host = loaded["host"].sharding
    assert host.memory_kind == "device" and entries(host.spec) == ["data"]
    lines = placements([r.getMessage() for r in caplog.records if r.name == "milepost"])
    assert len(lines) == 4, lines  # two meshes, one device, one memory kind: once each
    assert any(
        "saved over 8 devices {'data': 2, 'model': 4} (ids 100..107), which this runtime lacks "
        "(8 devices here): placed the saved mesh (devices " in line
        for line in lines
    ), lines
    assert any(
        "saved on device 13, which this runtime lacks: placed on device 0" in line for line in lines
    ), lines
    assert any(
        "saved in memory kind 'hbm_of_elsewhere', which the devices of this runtime do not offer"
        in line
        and "placed in their default memory" in line
        for line in lines
    ), lines


def orbax_sharding_moved(ckpt: Path, single_device: str) -> Path:
    """Only Orbax's ``_sharding`` kept (as Orbax writes it), its meshes moved to device ids
    100 on and the single device recorded as ``single_device``; resealed."""
    without_compact_shardings(ckpt)
    path = ckpt / "state" / fmt.SHARDING
    recorded = json.loads(path.read_text())

    def moved(node: Any) -> Any:
        if isinstance(node, dict):
            return {"id": node["id"] + 100}
        return [moved(child) for child in node]

    for key, text in recorded.items():
        d = json.loads(text)
        if d["sharding_type"] == "NamedSharding":
            d["device_mesh"]["mesh"] = moved(d["device_mesh"]["mesh"])
        else:
            assert base64.b64decode(key).decode() == "single" and d["device_str"] == "cpu:5"
            d["device_str"] = single_device
        recorded[key] = json.dumps(d)
    path.write_text(json.dumps(recorded))
    reseal(ckpt)
    return ckpt


@pytest.mark.parametrize(
    ("device_str", "placed_on", "said"),
    [("cuda:0", 0, False), ("TPU_13(process=0,(1,1,0,0))", 0, True)],
)
def test_an_orbax_sharding_of_another_platform_loads(
    saved: tuple[Path, dict[str, Any]],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    device_str: str,
    placed_on: int,
    said: bool,
) -> None:
    """Orbax's ``_sharding`` as a GPU or TPU job writes it (other device ids; ``cuda:0``,
    ``TPU_13(...)`` device names) loads on these CPU devices."""
    state = saved[1]
    ckpt = orbax_sharding_moved(copy_of(saved, tmp_path / "c"), device_str)
    with caplog.at_level(logging.INFO, logger="milepost"):
        loaded = mp.load(ckpt)
    assert_values(loaded, state)
    assert_on_saved_meshes_here(loaded, state)
    assert loaded["single"].sharding.device_set == {jax.devices()[placed_on]}
    assert loaded["host"].sharding.memory_kind == "pinned_host"
    lines = placements([r.getMessage() for r in caplog.records if r.name == "milepost"])
    assert len(lines) == 2 + said, lines  # the two meshes (one line each), and device 13
    assert said == any("saved on device 13" in line for line in lines), lines


def test_an_abstract_trees_shardings_are_used_as_given(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With an abstract tree nothing changes: its shardings are used (the saved devices may be
    missing); a leaf with none takes the saved one, placed here as without a tree."""
    state = saved[1]
    ckpt = foreign_ids(copy_of(saved, tmp_path / "c"))
    mesh = jax.make_mesh((8,), ("all",))
    abstract = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, P()))
        if isinstance(v, jax.Array) and k != "w"
        else v
        for k, v in state.items()
    }
    abstract["w"] = jax.ShapeDtypeStruct((16, 8), np.float32)  # no sharding: the saved one
    with caplog.at_level(logging.INFO, logger="milepost"):
        loaded = mp.load(ckpt, abstract)
    assert_values(loaded, state)
    for k, v in abstract.items():
        if k != "w" and isinstance(v, jax.ShapeDtypeStruct):
            got = loaded[k].sharding
            assert got.mesh == mesh and entries(got.spec) == [], k
            assert got.memory_kind == "device", k
    assert dict(loaded["w"].sharding.mesh.shape) == {"data": 2, "model": 4}
    lines = placements([r.getMessage() for r in caplog.records if r.name == "milepost"])
    assert len(lines) == 1 and "{'data': 2, 'model': 4} (ids 100..107)" in lines[0], lines


# ---- the rule, and a slice's devices -------------------------------------------------


@pytest.mark.parametrize(
    ("saved_sizes", "devices", "fitted"),
    [
        ((2, 4), 8, (2, 4)),
        ((2, 4), 16, (2, 4)),  # fewer than there are: the whole saved mesh
        ((2, 4), 1, (1, 1)),
        ((2, 4), 4, (2, 2)),
        ((2, 4), 6, (2, 2)),  # 4 of 6 (an axis at a time would give 2)
        ((2, 4), 3, (2, 1)),  # equal products: the earlier axis kept larger
        ((4, 2), 4, (4, 1)),
        ((3, 4), 8, (3, 2)),
        ((16,), 12, (8,)),
        ((6, 10), 7, (6, 1)),
        ((), 4, ()),
    ],
)
def test_fitted_sizes(saved_sizes: tuple[int, ...], devices: int, fitted: tuple[int, ...]) -> None:
    got = fitted_sizes(saved_sizes, devices)
    assert got == fitted
    assert all(n % f == 0 for n, f in zip(saved_sizes, got, strict=True))


def test_a_slice_places_saved_shardings_on_its_devices(caplog: pytest.LogCaptureFixture) -> None:
    """The same rule on a slice's devices (host by host); their memory kinds are the hosts' to
    know, so a saved one is kept."""
    idents = [{"node": f"n{i}" * 8, "ip": "127.0.0.1", "pid": 100 + i} for i in range(2)]
    group = RayHostGroup([object()] * 2, idents, [[10, 11], [12, 13]], timeout_secs=5)
    assert group.devices_here() == ((10, 11, 12, 13), None, "this slice")
    mesh = mp.ShardingSpec.named((2, 4), ("data", "model"), tuple(range(8)), ())
    files = SimpleNamespace(
        shardings={
            "w": mesh.with_spec(("data", "model")),
            "b": mesh.with_spec(("model",)),
            "h": dataclasses.replace(mesh.with_spec(("data",)), memory_kind="pinned_host"),
            "s": mp.ShardingSpec.single(12),
        }
    )
    with caplog.at_level(logging.INFO, logger="milepost"):
        saved = SavedShardings(files, group, Path("/ckpt"))  # type: ignore[arg-type]
        w, b, h, s = (saved.sharding(k, "none") for k in ("w", "b", "h", "s"))
    assert (w.mesh_shape, w.axis_names, w.device_ids, w.spec) == (
        (2, 2),
        ("data", "model"),
        (10, 11, 12, 13),
        ("data", "model"),
    )
    assert b.device_ids is w.device_ids and b.spec == ("model",)
    assert h.memory_kind == "pinned_host" and h.mesh_shape == (2, 2)
    assert s == files.shardings["s"]  # device 12 is there
    lines = placements([r.getMessage() for r in caplog.records if r.name == "milepost"])
    assert lines == [
        "loading /ckpt: saved over 8 devices {'data': 2, 'model': 4} (ids 0..7), this slice "
        "has 4: placed on mesh {'data': 2, 'model': 2} (devices 10..13); pass an abstract tree "
        "to choose the placement"
    ]
    with pytest.raises(mp.StructureMismatchError, match="none"):
        saved.sharding("missing", "none")


def test_shardings_over_devices_not_here_are_a_typed_error(tmp_path: Path) -> None:
    """mp.metadata's saved shardings given as the abstract tree, saved over devices this
    runtime lacks (ids 8-15; it has 0-7): MissingDevicesError, a ValueError naming the
    devices and what to do; without an abstract tree the same checkpoint loads."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    w = put(np.arange(64.0, dtype=np.float32).reshape(8, 8), mesh, P("data"))
    mp.save(tmp_path / "c", {"w": w})
    leaf = mp.metadata(tmp_path / "c").tree["w"]
    assert leaf.sharding is not None
    elsewhere = dataclasses.replace(
        leaf.sharding, device_ids=tuple(i + 8 for i in leaf.sharding.device_ids)
    )
    with pytest.raises(mp.MissingDevicesError) as caught:
        mp.load(tmp_path / "c", {"w": dataclasses.replace(leaf, sharding=elsewhere)})
    e = caught.value
    assert isinstance(e, ValueError) and e.sharding == elsewhere
    assert e.missing == tuple(range(8, 16)) and e.available == tuple(range(8))
    assert "load without an abstract tree" in str(e)
    assert np.array_equal(np.asarray(mp.load(tmp_path / "c")["w"]), np.asarray(w))
