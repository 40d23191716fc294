"""Save policies (when to save) and retention policies (what to keep), both composable."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True, kw_only=True)
class SaveContext:
    """What a save policy may look at."""

    step: int
    latest_step: int | None
    """The newest committed or in-flight step, if any."""
    last_save_start: float | None
    """``time.monotonic()`` when the previous save started."""
    save_in_flight: bool
    now: float


@runtime_checkable
class SavePolicy(Protocol):
    def should_save(self, ctx: SaveContext) -> bool: ...


@dataclass(frozen=True, kw_only=True)
class FixedInterval:
    """Every ``interval`` steps (steps divisible by it)."""

    interval: int

    def __post_init__(self) -> None:
        if not isinstance(self.interval, int) or self.interval <= 0:
            raise ValueError(f"FixedInterval(interval=...) must be a positive int, got {self.interval!r}")

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.step % self.interval == 0


@dataclass(frozen=True, kw_only=True)
class SpecificSteps:
    steps: frozenset[int]

    def __init__(self, *, steps: Sequence[int] | frozenset[int]) -> None:
        object.__setattr__(self, "steps", frozenset(int(s) for s in steps))

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.step in self.steps


@dataclass(frozen=True, kw_only=True)
class InitialStep:
    """The first step seen when the root has no checkpoint yet."""

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.latest_step is None


@dataclass(frozen=True, kw_only=True)
class Continuous:
    """As soon as the previous save finished, at most once every ``min_interval_secs``."""

    min_interval_secs: float = 0.0

    def __post_init__(self) -> None:
        if self.min_interval_secs < 0:
            raise ValueError(f"Continuous(min_interval_secs=...) must be >= 0, got {self.min_interval_secs}")

    def should_save(self, ctx: SaveContext) -> bool:
        if ctx.save_in_flight:
            return False
        return ctx.last_save_start is None or ctx.now - ctx.last_save_start >= self.min_interval_secs


@dataclass(frozen=True)
class AnyOf:
    """Save when any of the policies says so."""

    policies: tuple[SavePolicy, ...]

    def __init__(self, *policies: SavePolicy) -> None:
        for p in policies:
            if not isinstance(p, SavePolicy):
                raise TypeError(f"{p!r} is not a save policy (it needs should_save(ctx))")
        object.__setattr__(self, "policies", tuple(policies))

    def should_save(self, ctx: SaveContext) -> bool:
        return any(p.should_save(ctx) for p in self.policies)


# ------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class StepInfo:
    step: int
    metrics: Mapping[str, Any] = field(default_factory=dict)


@runtime_checkable
class RetentionPolicy(Protocol):
    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        """The steps to keep among the committed ``steps`` (sorted, oldest first)."""
        ...


@dataclass(frozen=True, kw_only=True)
class KeepAll:
    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        return {s.step for s in steps}


@dataclass(frozen=True, kw_only=True)
class KeepLatest:
    n: int

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n <= 0:
            raise ValueError(f"KeepLatest(n={self.n!r}) would keep nothing; n must be a positive int")

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        return {s.step for s in steps[-self.n :]}


@dataclass(frozen=True, kw_only=True)
class KeepEvery:
    """Steps divisible by ``n`` (e.g. a permanent checkpoint every 10,000 steps)."""

    n: int

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n <= 0:
            raise ValueError(f"KeepEvery(n={self.n!r}) must be a positive int")

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        return {s.step for s in steps if s.step % self.n == 0}


@dataclass(frozen=True, kw_only=True)
class KeepBest:
    """The ``n`` best steps by ``metric`` (saved with ``save(..., metrics={metric: value})``).
    Steps without the metric are never counted among the best."""

    n: int
    metric: str
    mode: str = "min"

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n <= 0:
            raise ValueError(f"KeepBest(n={self.n!r}) would keep nothing; n must be a positive int")
        if self.mode not in ("min", "max"):
            raise ValueError(f"KeepBest(mode={self.mode!r}) must be 'min' or 'max'")

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        scored = [s for s in steps if isinstance(s.metrics.get(self.metric), int | float)]
        scored.sort(key=lambda s: s.metrics[self.metric], reverse=self.mode == "max")
        return {s.step for s in scored[: self.n]}


@dataclass(frozen=True)
class KeepUnion:
    """Keep what any of the policies keeps."""

    policies: tuple[RetentionPolicy, ...]

    def __init__(self, *policies: RetentionPolicy) -> None:
        if not policies:
            raise ValueError("KeepUnion() of no policies would keep nothing; pass at least one policy")
        for p in policies:
            if not isinstance(p, RetentionPolicy):
                raise TypeError(f"{p!r} is not a retention policy (it needs keep(steps))")
        object.__setattr__(self, "policies", tuple(policies))

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        out: set[int] = set()
        for p in self.policies:
            out |= p.keep(steps)
        return out
