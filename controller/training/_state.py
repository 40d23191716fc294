"""What a Checkpointer knows of its steps, under one condition variable.

The save path, the mirror and retention all read and change it; each change is made with the
condition held and notifies the waiters (a save waiting for room, ``wait()``, a load waiting for
a commit another process saw first)."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from milepost.training._errors import BackgroundSaveError
from milepost.workers import check

Metrics = dict[str, Any]


def check_step(step: Any) -> int:
    """``step`` as an int: a non-negative integer (of any integer type, not a bool)."""
    return check.index(step, "step")


def plain_metrics(metrics: Mapping[str, Any] | None) -> Metrics:
    """Metrics with NumPy/JAX scalars turned into Python numbers (they are stored as JSON)."""
    out: Metrics = {}
    for key, value in dict(metrics or {}).items():
        if not isinstance(key, str):
            raise TypeError(f"metric names must be str, got {key!r}")
        if isinstance(value, np.generic) or (
            isinstance(value, np.ndarray | jax.Array) and value.shape == ()
        ):
            value = np.asarray(value).item()
        out[key] = value
    return out


class StepState:
    """The steps of a Checkpointer's tiers and what is happening to them."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.cond = threading.Condition(threading.RLock())
        self.durable: dict[int, Metrics] = {}
        """Committed steps in root (durable), with their metrics."""
        self.local: dict[int, Metrics] = {}
        """Committed steps in the local tier."""
        self.times: dict[int, int] = {}
        """Committed step -> its commit time (its metadata's ``commit_timestamp_nsecs``; one
        step's copies in both tiers share it). A step without one is not there."""
        self.in_flight: dict[int, Any] = {}
        """Steps being saved: their handles (None while the save is starting)."""
        self.mirrors: dict[int, Any] = {}
        """Local steps waiting for their mirror or being mirrored (in order), with the hosts
        that copy."""
        self.unmirrored: set[int] = set()
        """Local steps whose mirror failed: kept until a later Checkpointer mirrors them."""
        self.loading: collections.Counter[int] = collections.Counter()
        self.changing: set[int] = set()
        """Committed steps a checkpointable of which is being deleted: a load waits for it."""
        self.gc_active = 0
        """Retention runs requested and not finished (``wait`` waits for them)."""
        self.gc_deferred = False
        """Retention spared a step for a load: run it again once no load is in progress."""
        self.failure: BackgroundSaveError | None = None
        """The first background failure not raised yet."""

    def committed(self) -> set[int]:
        """Committed steps of both tiers (hold ``cond``)."""
        return self.durable.keys() | self.local.keys()

    def fail(self, failure: BackgroundSaveError) -> None:
        """Keep ``failure`` for the next call to raise, unless one is kept already."""
        with self.cond:
            if self.failure is None:
                self.failure = failure
            self.cond.notify_all()

    def raise_failure(self) -> None:
        """Raise the background failure kept, once."""
        with self.cond:
            failure, self.failure = self.failure, None
        if failure is not None:
            raise failure

    def wait_while(
        self, busy: Callable[[], bool], message: Callable[[], str], timeout: float | None = None
    ) -> None:
        """With ``cond`` held: wait while ``busy()``, at most ``timeout`` (default: the
        Checkpointer's); TimeoutError with ``message()`` after that."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while busy():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(message())
            self.cond.wait(left)

    def rows(self) -> list[dict[str, Any]]:
        """One row per step known (committed, being saved or mirrored), oldest first:
        ``step``, ``tier`` (``durable``, ``local`` or both), ``state`` and ``metrics``. What a
        Checkpointer's steps table in a notebook shows; ``milepost ls ROOT`` lists the
        folders."""
        with self.cond:
            rows = []
            for s in sorted(
                self.committed() | set(self.in_flight) | self.mirrors.keys() | self.unmirrored
            ):
                tiers = [
                    name
                    for name, steps in (("local", self.local), ("durable", self.durable))
                    if s in steps
                ]
                if s in self.in_flight:
                    what = "saving"
                elif s in self.mirrors:
                    what = "committed, mirroring"
                elif s in self.unmirrored:
                    what = "committed, mirror failed"
                else:
                    what = "committed"
                metrics = self.durable.get(s) or self.local.get(s) or {}
                rows.append(
                    {
                        "step": s,
                        "tier": " + ".join(tiers) or "-",
                        "state": what,
                        "metrics": dict(metrics),
                    }
                )
            return rows
