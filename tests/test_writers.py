"""Several OCDBT writers per host: arrays are spread over parallel databases, every region is
written exactly once, and the merged checkpoint reads back exactly (also with one writer)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost.workers._messages import ArraySpec, Region, SaveTask
from milepost.workers.save import _stage
from tests._helpers import abstract_of, assert_tree_equal, put, tensorstore_writes_only


@pytest.fixture(scope="module", autouse=True)
def _tensorstore_writes() -> Iterator[None]:
    """This module tests the databases TensorStore writes: no shard is packed by milepost."""
    with tensorstore_writes_only():
        yield


def _task(name: str, rows: int, regions: int) -> SaveTask:
    step = rows // regions
    spec = ArraySpec(
        name=name, shape=(rows, 4), dtype="float32", write_shape=(step, 4), chunk_shape=(step, 4)
    )
    return SaveTask(
        source=0,
        spec=spec,
        regions=tuple(
            Region(device_id=i, index=((i * step, (i + 1) * step), (0, 4))) for i in range(regions)
        ),
    )


def test_split_gives_every_region_to_one_writer_and_balances_bytes() -> None:
    tasks = [
        _task("big", 800, 8),
        _task("a", 100, 1),
        _task("b", 100, 2),
        _task("c", 50, 1),
        _task("d", 50, 1),
    ]
    parts = _stage._split_among_writers(tasks, 4)
    seen = Counter((task.spec.name, r.index) for _, task, regions in parts for r in regions)
    assert seen == Counter(
        (t.spec.name, r.index) for t in tasks for r in t.regions
    )  # each exactly once
    load: Counter[int] = Counter()
    for writer, _, regions in parts:
        load[writer] += sum((b - a) for (a, b), _ in (r.index for r in regions)) * 16
    assert set(load) == {0, 1, 2, 3}
    assert max(load.values()) <= 1.5 * min(load.values())
    # the big array is split by region, small ones stay whole
    assert len({w for w, t, _ in parts if t.spec.name == "big"}) == 4
    assert all(len([p for p in parts if p[1].spec.name == n]) == 1 for n in "acd")


def test_one_writer_keeps_everything_in_one_database() -> None:
    tasks = [_task("a", 100, 2), _task("b", 100, 1)]
    assert _stage._split_among_writers(tasks, 1) == [(0, t, t.regions) for t in tasks]


@pytest.mark.parametrize("writers", [1, 3])
def test_writers_round_trip_and_layout(
    tmp_path: Path, mesh24: jax.sharding.Mesh, writers: int
) -> None:
    rng = np.random.default_rng(3)
    state = {
        f"layer{i}": put(
            rng.standard_normal((16, 32), dtype=np.float32), mesh24, P("data", "model")
        )
        for i in range(6)
    }
    state["host"] = np.arange(12, dtype=np.int32)
    with mp.Context(saving=mp.SaveOptions(ocdbt_writers_per_host=writers)):
        mp.save(tmp_path / "c", state)
    databases = sorted(p.name for p in (tmp_path / "c" / "state").glob("ocdbt.process_0*"))
    assert databases == ["ocdbt.process_0"] + [f"ocdbt.process_0.{k}" for k in range(1, writers)]
    assert_tree_equal(mp.load(tmp_path / "c", abstract_of(state)), state)


def test_writers_option_is_checked() -> None:
    with pytest.raises(ValueError, match="ocdbt_writers_per_host"):
        mp.SaveOptions(ocdbt_writers_per_host=0)


def test_auto_writers_follow_the_bytes_a_host_writes(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    """The default, 'auto': one database per 32 MiB a host writes, at most 4 (a small save does
    not pay for databases it cannot fill)."""
    from milepost._options import writers_for

    options = mp.SaveOptions()
    assert options.ocdbt_writers_per_host == "auto"
    mib = 1 << 20
    assert [
        writers_for(options, n) for n in (0, 1, 32 * mib, 32 * mib + 1, 96 * mib + 1, 10 << 30)
    ] == [1, 1, 1, 2, 4, 4]
    assert writers_for(mp.SaveOptions(ocdbt_writers_per_host=3), 0) == 3, "an int is used as given"
    rng = np.random.default_rng(5)
    small = {"w": put(rng.standard_normal((16, 32), dtype=np.float32), mesh24, P("data", "model"))}
    mp.save(tmp_path / "small", small)
    assert sorted(p.name for p in (tmp_path / "small" / "state").glob("ocdbt.process_0*")) == [
        "ocdbt.process_0"
    ]
    big = {
        f"w{i}": put(
            rng.standard_normal((1024, 2048), dtype=np.float32), mesh24, P("data", "model")
        )
        for i in range(5)
    }  # 40 MiB
    mp.save(tmp_path / "big", big)
    assert sorted(p.name for p in (tmp_path / "big" / "state").glob("ocdbt.process_0*")) == [
        "ocdbt.process_0",
        "ocdbt.process_0.1",
    ]
    assert_tree_equal(mp.load(tmp_path / "big", abstract_of(big)), big)
    with pytest.raises(
        TypeError, match=r"ocdbt_writers_per_host \(or 'auto'\) must be an int, got 'many'"
    ):
        mp.SaveOptions(ocdbt_writers_per_host="many")  # type: ignore[arg-type]
