"""SaveOptions(adaptive_staging=AdaptiveStagingBudget(...)): each host's staging bound follows
the peak its last save of the checkpointable held in staging (counted bytes), within
[min_bytes, max_bytes]; no save stages more than its bound. Counts only, no timings."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import milepost as mp
from tests._helpers import put, same_bits

MIB = 1 << 20


def test_the_rule_and_its_checks() -> None:
    budget = mp.AdaptiveStagingBudget(min_bytes=4 * MIB, max_bytes=64 * MIB, headroom=2.0)
    assert budget.next_bound(0) == 4 * MIB  # never below min_bytes
    assert budget.next_bound(3 * MIB) == 6 * MIB
    assert budget.next_bound(40 * MIB) == 64 * MIB  # never above max_bytes
    assert mp.AdaptiveStagingBudget(min_bytes=1, max_bytes=100).next_bound(10) == 15  # 1.5
    for bad, error in (
        ({"min_bytes": 0, "max_bytes": 10}, ValueError),
        ({"min_bytes": 1.5, "max_bytes": 10}, TypeError),
        ({"min_bytes": 10, "max_bytes": 9}, ValueError),
        ({"min_bytes": 1, "max_bytes": 9, "headroom": 1.0}, ValueError),
        ({"min_bytes": 1, "max_bytes": 9, "headroom": float("nan")}, ValueError),
        ({"min_bytes": 1, "max_bytes": 9, "headroom": "2"}, TypeError),
    ):
        with pytest.raises(error, match="AdaptiveStagingBudget"):
            mp.AdaptiveStagingBudget(**bad)
    with pytest.raises(ValueError, match="give one of the two"):
        mp.SaveOptions(host_staging_budget_bytes=MIB, adaptive_staging=budget)
    with pytest.raises(TypeError, match="AdaptiveStagingBudget"):
        mp.SaveOptions(adaptive_staging=8 * MIB)  # type: ignore[arg-type]


def tree(mesh: jax.sharding.Mesh, arrays: int, seed: int) -> dict[str, Any]:
    """``arrays`` arrays of 16 MiB, in shards of 2 MiB (above the packing limit: each one a
    staging copy of its own)."""
    rng = np.random.default_rng(seed)
    return {
        f"w{i}": put(rng.standard_normal((4096, 1024), dtype=np.float32), mesh, P("data", "model"))
        for i in range(arrays)
    }


def test_each_save_stages_within_the_bound_its_predecessor_set(
    tmp_path: Path,
    mesh24: jax.sharding.Mesh,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from milepost.workers.save import _adaptive, _staging

    _adaptive.REGULATOR.clear()
    _staging.POOL.clear()
    taken: list[int] = []
    real_take = _staging.POOL.take

    def take(shape: Any, dtype: Any) -> Any:
        view, raw = real_take(shape, dtype)
        taken.append(view.nbytes)
        return view, raw

    monkeypatch.setattr(_staging.POOL, "take", take)
    budget = mp.AdaptiveStagingBudget(min_bytes=4 * MIB, max_bytes=64 * MIB, headroom=2.0)
    bounds: list[int] = []
    staged: list[int] = []
    caplog.set_level(logging.DEBUG, logger="milepost")
    # 32 MiB a save: the bound doubles while saves fill it, then follows what a smaller one needs
    for i, arrays in enumerate([2, 2, 2, 2, 1]):
        bounds.append(_adaptive.REGULATOR.bound(budget, "state", 0))
        s = tree(mesh24, arrays, seed=i)
        want = {k: np.array(v) for k, v in s.items()}
        taken.clear()
        with mp.Context(saving=mp.SaveOptions(adaptive_staging=budget)):
            handle = mp.save_async(tmp_path / f"c{i}", s)
        for k in s:  # the caller donates its arrays at once
            s[k] = jax.jit(lambda x: x * 0 - 1, donate_argnums=0)(s[k])
        handle.result(timeout=120)
        staged.append(sum(taken))
        if i in (0, 4):  # (what a budget leaves unstaged is written from the caller's arrays)
            got = mp.load(tmp_path / f"c{i}")
            assert all(same_bits(got[k], v) for k, v in want.items())
    after = _adaptive.REGULATOR.bound(budget, "state", 0)
    assert all(n == 2 * MIB for n in taken)
    assert all(s <= b for s, b in zip(staged, bounds, strict=True)), (staged, bounds)
    assert bounds == [4 * MIB, 8 * MIB, 16 * MIB, 32 * MIB, 64 * MIB]
    assert staged == [4 * MIB, 8 * MIB, 16 * MIB, 32 * MIB, 16 * MIB]
    assert after == 32 * MIB  # a smaller save: twice what it held
    # the bound after each save is the rule applied to the bytes it held
    assert [*bounds[1:], after] == [budget.next_bound(s) for s in staged]
    chosen = [r for r in caplog.records if "staging bound for 'state'" in r.getMessage()]
    assert len(chosen) == 5 + 6  # one a save (and one a look of this test's)


def test_device_copies_stay_within_the_adaptive_bound(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The accelerator path (pinned_host, run on CPU devices): the copies in host memory whose
    writes are not yet durable never exceed the bound, and their peak sets the next one."""
    from milepost.workers.save import _adaptive, _device

    _adaptive.REGULATOR.clear()
    peaks: list[int] = []
    real_start = _device.Window._start_more

    def start_more(self: Any, *args: Any, **kwargs: Any) -> None:
        real_start(self, *args, **kwargs)
        peaks.append(self.transfers.peak_bytes)

    monkeypatch.setattr(_device.Window, "_start_more", start_more)
    budget = mp.AdaptiveStagingBudget(min_bytes=4 * MIB, max_bytes=12 * MIB, headroom=2.0)
    bounds = []
    for i in range(3):
        bounds.append(_adaptive.REGULATOR.bound(budget, "state", 0))
        peaks.clear()
        s = tree(mesh24, 2, seed=i)
        want = {k: np.array(v) for k, v in s.items()}
        options = mp.SaveOptions(adaptive_staging=budget, device_staging="pinned_host")
        with mp.Context(saving=options):
            mp.save_async(tmp_path / f"d{i}", s).result(timeout=120)
        assert max(peaks) <= bounds[-1]
        assert _adaptive.REGULATOR.bound(budget, "state", 0) == budget.next_bound(max(peaks))
        got = mp.load(tmp_path / f"d{i}")
        assert all(same_bits(got[k], v) for k, v in want.items())
    assert bounds == [4 * MIB, 8 * MIB, 12 * MIB]
