"""KeepRecent: age-based retention by each step's commit time (Orbax's LatestDuration), with an
injected clock (no sleeps)."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from milepost.training import (
    Checkpointer,
    KeepEvery,
    KeepLatest,
    KeepRecent,
    KeepUnion,
    RetentionPolicy,
    StepInfo,
)

UTC = datetime.UTC
T0 = datetime.datetime(2026, 1, 1, tzinfo=UTC)
HOUR = datetime.timedelta(hours=1)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, now: datetime.datetime) -> None:
        self.now = now

    def __call__(self) -> datetime.datetime:
        return self.now


def info(step: int, hours_ago: float | None, now: datetime.datetime = T0) -> StepInfo:
    time = None if hours_ago is None else now - datetime.timedelta(hours=hours_ago)
    return StepInfo(step=step, time=time)


def test_keeps_the_steps_committed_within_the_duration() -> None:
    clock = Clock(T0)
    recent = KeepRecent(duration=HOUR, clock=clock)
    steps = [info(0, 5), info(1, 2), info(2, 1), info(3, 0.5), info(4, 0)]
    assert isinstance(recent, RetentionPolicy)
    assert recent.keep(steps) == {2, 3, 4}  # exactly one hour old is within it (Orbax: <=)
    clock.now = T0 + datetime.timedelta(microseconds=1)
    assert recent.keep(steps) == {3, 4}
    clock.now = T0 + 2 * HOUR
    assert recent.keep(steps) == set()
    assert recent.keep([]) == set()
    # as Orbax: from the oldest recent step on, newer ones too (without a time, or older clocks)
    odd = [info(0, None), info(1, 0.5), info(2, None), info(3, 3)]
    assert KeepRecent(duration=HOUR, clock=Clock(T0)).keep(odd) == {1, 2, 3}
    assert KeepRecent(duration=HOUR, clock=Clock(T0)).keep([info(0, None)]) == set()
    both = KeepUnion(KeepRecent(duration=HOUR, clock=Clock(T0)), KeepEvery(n=2))
    assert both.keep(steps) == {0, 2, 3, 4}


def test_duration_in_seconds_or_timedelta_and_validated() -> None:
    assert KeepRecent(duration=3600) == KeepRecent(duration=HOUR)
    assert KeepRecent(duration=0.5).duration == datetime.timedelta(milliseconds=500)
    assert repr(KeepRecent(duration=60)) == "KeepRecent(duration=datetime.timedelta(seconds=60))"
    for bad in (0, -1.0, float("nan"), float("inf"), True, "1h", None, datetime.timedelta(0)):
        with pytest.raises(ValueError, match="KeepRecent.duration"):
            KeepRecent(duration=bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        KeepRecent(HOUR)  # type: ignore[misc]  # keyword-only, as every policy
    with pytest.raises(AttributeError):
        KeepRecent(duration=HOUR).duration = HOUR  # type: ignore[misc]  # frozen


def tree(mesh: jax.sharding.Mesh, value: int) -> dict[str, Any]:
    w = jax.device_put(np.full((16, 8), value, np.float32), NamedSharding(mesh, P("data", "model")))
    return {"w": w}


def committed_at(ckpt: Checkpointer, step: int) -> datetime.datetime:
    """The step's commit time as its metadata records it (to the microsecond)."""
    nsecs = ckpt.metadata(step).commit_timestamp_nsecs
    assert nsecs is not None
    return datetime.datetime(1970, 1, 1, tzinfo=UTC) + datetime.timedelta(
        microseconds=nsecs // 1000
    )


def test_a_checkpointer_drops_steps_by_their_metadata_commit_time(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    root = tmp_path / "run"
    clock = Clock(datetime.datetime(1970, 1, 1, tzinfo=UTC))  # every step is recent
    with Checkpointer(root, keep=KeepRecent(duration=HOUR, clock=clock)) as ckpt:
        for s in range(3):
            ckpt.save(s, tree(mesh24, s))
        ckpt.wait()
        assert ckpt.steps == [0, 1, 2]
        t1 = committed_at(ckpt, 1)
        # step 1 is one hour and a microsecond old by its metadata: it goes, 2 stays
        clock.now = t1 + HOUR + datetime.timedelta(microseconds=1)
        ckpt.save(3, tree(mesh24, 3))
        ckpt.wait()
        assert ckpt.steps == [2, 3]
        t2 = committed_at(ckpt, 2)
    assert sorted(p.name for p in root.iterdir()) == ["2", "3"]
    # a new Checkpointer reads the times back from the steps' _CHECKPOINT_METADATA
    clock.now = t2 + HOUR
    with Checkpointer(root, keep=KeepRecent(duration=HOUR, clock=clock)) as again:
        again.save(4, tree(mesh24, 4))
        again.wait()
        assert again.steps == [2, 3, 4]  # exactly an hour old: kept
        clock.now = t2 + HOUR + datetime.timedelta(microseconds=1)
        again.save(5, tree(mesh24, 5))
        again.wait()
        assert again.steps == [3, 4, 5]


def test_a_step_without_a_commit_time_is_never_recent_by_itself(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    root = tmp_path / "run"
    with Checkpointer(root) as ckpt:
        for s in range(2):
            ckpt.save(s, tree(mesh24, s))
    meta_path = root / "1" / "_CHECKPOINT_METADATA"
    meta = json.loads(meta_path.read_text())
    del meta["commit_timestamp_nsecs"]  # as a writer that records none
    meta_path.write_text(json.dumps(meta))
    clock = Clock(datetime.datetime(1970, 1, 1, tzinfo=UTC))
    keep = KeepUnion(KeepRecent(duration=HOUR, clock=clock), KeepLatest(n=1))
    with Checkpointer(root, keep=keep) as ckpt:
        clock.now = datetime.datetime.now(UTC) + 3 * HOUR  # step 0 is old; 1 has no time
        ckpt.save(2, tree(mesh24, 2))
        ckpt.wait()
        assert ckpt.steps == [2]


def test_without_a_clock_ages_count_from_the_newest_commit() -> None:
    """No clock given: now is the newest step's commit time, whatever this machine's clock says,
    so every process of a job forgets the same steps."""
    steps = [info(0, 5), info(1, 2), info(2, 1), info(3, 0.5), info(4, 0)]
    assert KeepRecent(duration=HOUR).keep(steps) == {2, 3, 4}  # T0 is in 2026: long ago or not
    later = [info(0, 5, T0 + HOUR), info(1, 0, T0 + HOUR)]
    assert KeepRecent(duration=HOUR).keep(later) == {1}
    assert KeepRecent(duration=HOUR).keep([info(0, None), info(1, None)]) == set()
