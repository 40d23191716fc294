"""milepost.surgery on a Ray slice: the hosts read, compute and write; the controller plans and
its traffic stays O(leaves), whatever the arrays' size."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import psutil
import pytest
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost import surgery as ms
from tests._helpers import same_bits

pytestmark = pytest.mark.usefixtures("ray_runtime")


@pytest.fixture(scope="module")
def slice42() -> Iterator[mp.Slice]:
    with mp.Slice.start(hosts=4, devices_per_host=2) as s:
        yield s


def layers(rows: int, k: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(rows)
    return {
        f"layer{i}": np.round(rng.standard_normal((rows, 256), dtype=np.float32) * 8) + k
        for i in range(3)
    }


def save_on(s: mp.Slice, path: Path, values: dict[str, np.ndarray]) -> None:
    mesh = s.mesh({"data": 2, "model": 4})
    tree = s.put(values, {k: mesh.sharding(P("data", "model")) for k in values})
    mp.save(path, {"params": tree, "opt": {"mu": tree["layer0"]}, "step": 4})


def test_surgery_on_the_hosts(slice42: mp.Slice, tmp_path: Path) -> None:
    want = layers(64)
    save_on(slice42, tmp_path / "src", want)
    ck = ms.open(tmp_path / "src", slice=slice42)
    assert same_bits(
        np.asarray(ck.tree["params"]["layer1"][3:5, 10:20]), want["layer1"][3:5, 10:20]
    )  # read by a host
    t = ms.rename(ck.tree, {r"^params\.(.*)": r"model.\1", r"^opt\..*": None})
    t = ms.stack(ms.cast(t, jnp.bfloat16), r"^model\.layer(\d+)$", "model.layers")
    out = ms.write(tmp_path / "out", t)
    mesh = slice42.mesh({"x": 8})
    got = mp.load(
        out,
        {
            "model": {
                "layers": mp.AbstractArray(
                    (3, 64, 256), ml_dtypes.bfloat16, mesh.sharding(P(None, "x"))
                )
            },
            "step": 0,
        },
    )
    assert isinstance(got["model"]["layers"], mp.RemoteArray) and got["step"] == 4
    ref = np.stack([want[f"layer{i}"] for i in range(3)]).astype(ml_dtypes.bfloat16)
    assert same_bits(slice42.fetch(got["model"]["layers"]), ref)
    stats = ms.stats(ms.open(out, slice=slice42).tree)
    assert stats["model.layers"]["max"] == float(ref.astype(np.float32).max())


def test_merge_and_soup_on_the_hosts(slice42: mp.Slice, tmp_path: Path) -> None:
    trees = [layers(32, k) for k in range(3)]
    for k, values in enumerate(trees):
        save_on(slice42, tmp_path / f"s{k}", values)
    opened = [ms.open(tmp_path / f"s{k}", slice=slice42).tree for k in range(3)]
    weights = (0.5, 0.25, 0.25)  # exact in float32 for these integer values
    soup = ms.average(*opened, weights=weights, where=r"^params\.")
    merged = ms.map(lambda w, a: w + 2 * a, soup, opened[1], where=r"^params\.layer0$")
    mesh = slice42.mesh({"data": 2, "model": 4})
    abstract = {
        "params": {
            f"layer{i}": mp.AbstractArray((32, 256), np.float32, mesh.sharding(P("data", "model")))
            for i in range(3)
        }
    }
    out = mp.load(ms.write(tmp_path / "soup", merged), abstract, partial=True)
    for i in range(3):
        ref = sum(
            np.float32(w) * t[f"layer{i}"] for w, t in zip(weights, trees, strict=True)
        ).astype(np.float32)
        if i == 0:
            ref = ref + 2 * trees[1]["layer0"]
        assert same_bits(slice42.fetch(out["params"][f"layer{i}"]), ref), i
    assert ms.diff(ms.open(tmp_path / "s0", slice=slice42).tree, opened[0]).equal


def test_the_controller_only_plans(slice42: mp.Slice, tmp_path: Path) -> None:
    """Traffic per leaf does not grow with the leaves' size, nor does the controller's memory."""
    per_leaf, rss = {}, {}
    process = psutil.Process()
    for rows in (64, 8192):  # 64 KiB and 8 MiB per leaf
        save_on(slice42, tmp_path / f"src{rows}", layers(rows))
        before, rss_before = slice42.traffic(), process.memory_info().rss
        t = ms.cast(ms.open(tmp_path / f"src{rows}", slice=slice42).tree, jnp.bfloat16)
        ms.write(tmp_path / f"out{rows}", ms.stack(t, r"^params\.layer(\d+)$", "params.all"))
        moved = slice42.traffic() - before
        rss[rows] = process.memory_info().rss - rss_before
        per_leaf[rows] = moved.total_bytes / 5  # 3 layers + mu + step
    assert per_leaf[8192] <= per_leaf[64] * 1.2 + 256, per_leaf
    assert rss[8192] < 24 << 20, (
        f"the controller grew by {rss[8192] >> 20} MiB for 24 MiB of leaves"
    )
