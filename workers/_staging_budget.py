"""The adaptive host staging budget: an option (here, so that a save plan can carry it to the
hosts) and its rule. The per-process state that applies it is in :mod:`.save._adaptive`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from milepost.workers import _check as check


@dataclass(frozen=True, kw_only=True)
class AdaptiveStagingBudget:
    """A host staging budget that follows the saves (``SaveOptions(adaptive_staging=...)``),
    in the spirit of Orbax's memory regulator (``MemoryOptions.regulator_options``), which sizes
    the device-to-host copies of a save from the host memory the previous save peaked at.

    Each host's first save of a checkpointable stages within ``min_bytes``. After each save,
    the host counts the most bytes that save held in staging at once (its copies in host memory
    whose writes were not yet durable: counted bytes, not the process's RSS), and its next save
    of that checkpointable stages within ``headroom`` times that peak, kept within
    ``[min_bytes, max_bytes]``. So the bound grows by ``headroom`` while saves fill it, up to
    ``max_bytes``, and falls back to ``headroom`` over what a smaller save needed.

    It sees only what saves stage, not what else uses the host's memory: ``max_bytes`` is the
    most a save ever adds. Under the bound a save behaves as under a fixed
    ``host_staging_budget_bytes`` (regions beyond it written from your arrays before
    ``save_async`` returns; on accelerators, the next copy waits for an earlier write).

    >>> budget = mp.AdaptiveStagingBudget(min_bytes=1 << 30, max_bytes=16 << 30)
    >>> with mp.Context(saving=mp.SaveOptions(adaptive_staging=budget)):
    ...     ckpt.save(step, state)
    """

    min_bytes: int
    """The first save's bound, and the least any save gets (at least 1)."""
    max_bytes: int
    """The most any save gets."""
    headroom: float = 1.5
    """The next bound is this many times the last save's peak (more than 1, so that a bound
    that saves fill grows)."""

    def __post_init__(self) -> None:
        check.integer(self.min_bytes, "AdaptiveStagingBudget.min_bytes", minimum=1)
        check.integer(
            self.max_bytes,
            "AdaptiveStagingBudget.max_bytes",
            minimum=self.min_bytes,
            expect=f"an int >= min_bytes ({self.min_bytes})",
        )
        check.number(self.headroom, "AdaptiveStagingBudget.headroom")
        if not self.headroom > 1:
            raise ValueError(
                f"AdaptiveStagingBudget.headroom must be more than 1 (at most 1, a bound that "
                f"saves fill would never grow), got {self.headroom!r}; e.g. headroom=1.5"
            )

    def next_bound(self, peak_bytes: int) -> int:
        """The bound of the save after one that held ``peak_bytes`` in staging at most."""
        return min(self.max_bytes, max(self.min_bytes, math.ceil(peak_bytes * self.headroom)))
