"""Save policies (when to save) and retention policies (what to keep), both composable.

Every policy is a small frozen dataclass. A save policy answers ``should_save(ctx)`` from a
:class:`SaveContext`; a retention policy answers ``keep(steps)`` with the steps it wants kept.
Compose save policies with :class:`AnyOf` and retention policies with :class:`KeepUnion`.
"""

from __future__ import annotations

import datetime
import math
import numbers
import signal
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from milepost.workers import check


@dataclass(frozen=True, kw_only=True)
class SaveContext:
    """What a save policy may look at (the primary process's view; every process gets the
    primary's answer)."""

    step: int
    """The step being asked about."""
    latest_step: int | None
    """The newest committed or in-flight step, if any."""
    last_save_start: float | None
    """``time.monotonic()`` when the previous save started (None: no save yet in this run)."""
    save_in_flight: bool
    """Whether a save is still being written."""
    now: float
    """``time.monotonic()`` now."""
    preempted: bool = False
    """A preemption signal (or :meth:`Checkpointer.preempt`) arrived since the last save."""


@runtime_checkable
class SavePolicy(Protocol):
    """When to save: a Checkpointer asks ``should_save(ctx)`` at every step it is given (its
    ``should_save`` or ``save``), on the primary process, and every process gets that answer.

    Implement it for a schedule of your own; it must be cheap and must not block. ``ctx`` holds
    the step, the newest step committed or being saved, when the previous save started, whether
    one is in flight and whether a preemption was requested. Combine policies with
    :class:`AnyOf`.

    >>> @dataclasses.dataclass(frozen=True)
    ... class Warmup:
    ...     until: int
    ...     def should_save(self, ctx): return ctx.step < self.until
    >>> Checkpointer(root, save_policy=AnyOf(Warmup(until=100), FixedInterval(interval=1000)))
    """

    def should_save(self, ctx: SaveContext) -> bool:
        """Whether the step ``ctx.step`` is to be saved."""
        ...


def _keeps_nothing(owner: str, n: Any) -> None:
    check.integer(
        n,
        f"{owner}.n",
        minimum=1,
        error=ValueError,
        expect="a positive int (less would keep nothing)",
    )


@dataclass(frozen=True, kw_only=True)
class FixedInterval:
    """Every ``interval`` steps (the steps divisible by it, step 0 included)."""

    interval: int

    def __post_init__(self) -> None:
        check.integer(
            self.interval,
            "FixedInterval.interval",
            minimum=1,
            error=ValueError,
            expect="a positive int",
        )

    def should_save(self, ctx: SaveContext) -> bool:
        """Save the steps that are multiples of ``interval``."""
        return ctx.step % self.interval == 0


@dataclass(frozen=True)
class SpecificSteps:
    """Exactly these steps: ``SpecificSteps(steps=[100, 5000])``."""

    steps: frozenset[int]
    """The steps to save."""

    def __init__(self, *, steps: Iterable[int]) -> None:
        values = list(steps)
        for s in values:
            check.index(s, "SpecificSteps(steps=...)", error=ValueError, expect="non-negative ints")
        object.__setattr__(self, "steps", frozenset(int(s) for s in values))

    def should_save(self, ctx: SaveContext) -> bool:
        """Save the step if it is one of ``steps``."""
        return ctx.step in self.steps


@dataclass(frozen=True, kw_only=True)
class InitialStep:
    """The first step asked about while the root holds no checkpoint (and none is in flight)."""

    def should_save(self, ctx: SaveContext) -> bool:
        """Save while no step is committed or in flight."""
        return ctx.latest_step is None


@dataclass(frozen=True, kw_only=True)
class Continuous:
    """As soon as the previous save finished, and at most once every ``min_interval_secs``
    (measured between the starts of two saves)."""

    min_interval_secs: float = 0.0

    def __post_init__(self) -> None:
        check.number(
            self.min_interval_secs, "Continuous.min_interval_secs", minimum=0, error=ValueError
        )

    def should_save(self, ctx: SaveContext) -> bool:
        """Save when no save is in flight and ``min_interval_secs`` passed since the last one
        started."""
        if ctx.save_in_flight:
            return False
        return (
            ctx.last_save_start is None or ctx.now - ctx.last_save_start >= self.min_interval_secs
        )


@dataclass(frozen=True, kw_only=True)
class Preemption:
    """Save at the next ``should_save`` after one of ``signals`` arrived (SIGTERM by default).

    The Checkpointer installs the handlers while it is open (from the main thread) and restores
    the previous ones on close; a handled SIGTERM no longer ends the process, so stop training
    when :attr:`Checkpointer.preempted` is true. Call ``should_save`` (or ``save``) every step.

    All processes save at the same step. With several controller processes (mcJAX) the primary's
    answer is shared: a signal counts when the primary gets it, except SIGTERM, which comes from
    JAX's preemption service (``jax.distributed``), which agrees on one step when any process
    is told.
    """

    signals: tuple[int, ...] = (signal.SIGTERM,)

    def __post_init__(self) -> None:
        object.__setattr__(self, "signals", tuple(signal.Signals(s) for s in self.signals))

    def should_save(self, ctx: SaveContext) -> bool:
        """Save once a preemption signal (or ``Checkpointer.preempt``) arrived."""
        return ctx.preempted


@dataclass(frozen=True)
class AnyOf:
    """Save when any of the policies says so:
    ``AnyOf(FixedInterval(interval=1000), Preemption())``."""

    policies: tuple[SavePolicy, ...]
    """The policies asked, in order."""

    def __init__(self, *policies: SavePolicy) -> None:
        if not policies:
            raise ValueError("AnyOf() of no policies would never save; pass at least one policy")
        for p in policies:
            check.instance(p, "AnyOf(...)", SavePolicy, "a save policy (it needs should_save(ctx))")
        object.__setattr__(self, "policies", tuple(policies))

    def should_save(self, ctx: SaveContext) -> bool:
        """Save if any policy says so (every policy sees every step)."""
        # every policy sees every step (no short-circuit), so stateful custom policies stay in step
        return any([p.should_save(ctx) for p in self.policies])


def preemption_signals(policy: Any) -> tuple[signal.Signals, ...]:
    """The signals of every :class:`Preemption` inside ``policy`` (through :class:`AnyOf`)."""
    if isinstance(policy, Preemption):
        return tuple(signal.Signals(s) for s in policy.signals)
    if isinstance(policy, AnyOf):
        out: list[signal.Signals] = []
        for p in policy.policies:
            out.extend(s for s in preemption_signals(p) if s not in out)
        return tuple(out)
    return ()


# ------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class StepInfo:
    """A committed step as a retention policy sees it."""

    step: int
    """The step's number."""
    metrics: Mapping[str, Any] = field(default_factory=dict)
    """The metrics saved with it (empty if none)."""
    time: datetime.datetime | None = None
    """When the step was committed (its ``_CHECKPOINT_METADATA``'s ``commit_timestamp_nsecs``,
    in UTC; Orbax's ``time``); None when its metadata records no commit time."""


@runtime_checkable
class RetentionPolicy(Protocol):
    """Which committed steps to keep: after each commit (and mirror) a Checkpointer asks
    ``keep(steps)`` on a background thread and deletes the others, on the primary process.

    Implement it for a rule of your own; it sees each step's number, the metrics saved with it
    and its commit time. Whatever it answers, the Checkpointer never deletes the latest step, a
    step being saved, loaded or mirrored, or the only copy of a step still to reach the durable
    root. Combine policies with :class:`KeepUnion`.

    >>> @dataclasses.dataclass(frozen=True)
    ... class KeepFirst:
    ...     def keep(self, steps): return {steps[0].step} if steps else set()
    >>> Checkpointer(root, keep=KeepUnion(KeepFirst(), KeepLatest(n=3)))
    """

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        """The steps to keep among the committed ``steps`` (sorted, oldest first). The
        Checkpointer also keeps the latest step and any step being saved or loaded."""
        ...


@dataclass(frozen=True, kw_only=True)
class KeepAll:
    """Keep every committed step (no retention): ``Checkpointer(root, keep=KeepAll())``."""

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        """Every step."""
        return {s.step for s in steps}


@dataclass(frozen=True, kw_only=True)
class KeepLatest:
    """The newest ``n`` committed steps."""

    n: int

    def __post_init__(self) -> None:
        _keeps_nothing("KeepLatest", self.n)

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        """The ``n`` newest steps."""
        return {s.step for s in steps[-self.n :]}


@dataclass(frozen=True, kw_only=True)
class KeepEvery:
    """Steps divisible by ``n`` (e.g. a permanent checkpoint every 10,000 steps)."""

    n: int

    def __post_init__(self) -> None:
        _keeps_nothing("KeepEvery", self.n)

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        """The steps that are multiples of ``n``."""
        return {s.step for s in steps if s.step % self.n == 0}


@dataclass(frozen=True, kw_only=True)
class KeepBest:
    """The ``n`` best steps by ``metric`` (saved with ``save(..., metrics={metric: value})``) or
    by ``fn`` (a step's metrics -> its score, as Orbax's ``best_fn``); give exactly one of the
    two. ``mode='min'`` keeps the smallest values.

    Steps without a score are never among the best: with ``metric``, a step whose value of it is
    missing, not a number, or NaN; with ``fn``, a step for which ``fn`` raises KeyError or
    TypeError (a metric missing or of another kind) or returns anything but a finite number. Of
    equal scores the newer step wins.

    >>> KeepBest(n=3, fn=lambda m: m["accuracy"] - m["loss"], mode="max")
    """

    n: int
    metric: str | None = None
    fn: Callable[[Mapping[str, Any]], float] | None = None
    mode: Literal["min", "max"] = "min"
    """``min``: the lowest scores are the best; ``max``: the highest."""

    def __post_init__(self) -> None:
        _keeps_nothing("KeepBest", self.n)
        if (self.metric is None) == (self.fn is None):
            raise ValueError(
                "KeepBest needs exactly one of metric= (a metric's name, e.g. metric='loss') and "
                "fn= (a step's metrics -> its score, e.g. fn=lambda m: m['loss']); got "
                + ("both" if self.fn is not None else "neither")
            )
        if self.fn is None:
            check.text(self.metric, "KeepBest.metric (the metric's name)", error=ValueError)
        elif not callable(self.fn):
            raise TypeError(
                f"KeepBest.fn is {self.fn!r}, not a function: pass a step's metrics -> its "
                "score, e.g. fn=lambda m: m['loss']"
            )
        check.one_of(self.mode, "KeepBest.mode", ("min", "max"))

    def score(self, metrics: Mapping[str, Any]) -> float | None:
        """The score of a step with these metrics (None: it has none, so it is never best)."""
        if self.fn is None:
            v = metrics.get(self.metric or "")
            if isinstance(v, int | float) and not isinstance(v, bool) and v == v:
                return float(v)
            return None
        try:
            v = self.fn(metrics)
        except (KeyError, TypeError):
            return None
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
            return None
        return float(v)

    def ranked(self, steps: Sequence[StepInfo]) -> list[int]:
        """The steps that have a score, best first (of equal scores, the newer first)."""
        scored = [(v, s.step) for s in steps if (v := self.score(s.metrics)) is not None]
        sign = 1.0 if self.mode == "min" else -1.0
        scored.sort(key=lambda vs: (sign * vs[0], -vs[1]))
        return [step for _, step in scored]

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        """The ``n`` best-scored steps (``ranked``'s first ``n``)."""
        return set(self.ranked(steps)[: self.n])


@dataclass(frozen=True, kw_only=True)
class KeepRecent:
    """The steps committed within the last ``duration`` (a ``datetime.timedelta``, or a number
    of seconds), as Orbax's ``LatestDuration``: the oldest step whose commit time (its
    metadata's ``commit_timestamp_nsecs``: :attr:`StepInfo.time`) is at most ``duration`` ago,
    and every step after it (a newer step without a recorded time too).

    Ages are measured from the newest step's commit time: retention runs right after each
    commit, so that is now, and every controller process of a job, with whatever clock it
    has, decides alike. A step ages out at the first commit after it is older than
    ``duration``; the latest step is always kept. Compose it with
    :class:`KeepUnion` (``KeepUnion(KeepRecent(duration=timedelta(days=1)),
    KeepEvery(n=10_000))``).

    >>> KeepRecent(duration=datetime.timedelta(hours=24))
    """

    duration: datetime.timedelta
    """How far back to keep (seconds given are turned into a timedelta)."""
    clock: Callable[[], datetime.datetime] | None = field(default=None, repr=False, compare=False)
    """What time it is now, as an aware ``datetime`` (None: the newest step's commit time);
    for tests and replays."""

    def __init__(
        self,
        *,
        duration: datetime.timedelta | float,
        clock: Callable[[], datetime.datetime] | None = None,
    ) -> None:
        if isinstance(duration, datetime.timedelta):
            window = duration
        else:
            seconds = check.number(
                duration,
                "KeepRecent.duration",
                positive=True,
                error=ValueError,
                expect="a positive datetime.timedelta or number of seconds",
            )
            window = datetime.timedelta(seconds=seconds)
        if window <= datetime.timedelta(0):
            raise ValueError(
                f"KeepRecent.duration must be positive (less would keep only the latest step), "
                f"got {duration!r}; e.g. duration=datetime.timedelta(hours=24)"
            )
        object.__setattr__(self, "duration", window)
        object.__setattr__(self, "clock", clock)

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        """The oldest step committed at most ``duration`` ago, and every step after it."""
        if self.clock is not None:
            now = self.clock()
        else:
            times = [s.time for s in steps if s.time is not None]
            if not times:
                return set()
            now = max(times)
        for i, s in enumerate(steps):
            if s.time is not None and now - s.time <= self.duration:
                return {t.step for t in steps[i:]}
        return set()


@dataclass(frozen=True)
class KeepUnion:
    """Keep what any of the policies keeps: ``KeepUnion(KeepLatest(n=3), KeepEvery(n=10_000))``."""

    policies: tuple[RetentionPolicy, ...]
    """The policies whose answers are joined."""

    def __init__(self, *policies: RetentionPolicy) -> None:
        if not policies:
            raise ValueError(
                "KeepUnion() of no policies would keep nothing; pass at least one policy"
            )
        for p in policies:
            check.instance(
                p, "KeepUnion(...)", RetentionPolicy, "a retention policy (it needs keep(steps))"
            )
        object.__setattr__(self, "policies", tuple(policies))

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        """Every step any of the policies keeps."""
        out: set[int] = set()
        for p in self.policies:
            out |= set(p.keep(steps))
        return out


def keep_best_in(policy: Any) -> KeepBest | None:
    """The first :class:`KeepBest` inside ``policy`` (through :class:`KeepUnion`), if any."""
    if isinstance(policy, KeepBest):
        return policy
    if isinstance(policy, KeepUnion):
        for p in policy.policies:
            if (found := keep_best_in(p)) is not None:
                return found
    return None
