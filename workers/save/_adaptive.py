"""The bounds an :class:`~milepost.workers.AdaptiveStagingBudget` gives this host process's
saves: one per (budget, checkpointable name, writing process), the first its ``min_bytes``,
each next one its rule applied to the peak the last save of that checkpointable held in
staging (counted by :func:`~milepost.workers.save.start_save`)."""

from __future__ import annotations

import logging
import threading

from milepost.workers._staging_budget import AdaptiveStagingBudget

log = logging.getLogger("milepost")

_Key = tuple[AdaptiveStagingBudget, str, int | str]
"""(the budget, the checkpointable's folder name, the writing process)."""


class Regulator:
    def __init__(self) -> None:
        self._bounds: dict[_Key, int] = {}
        self._lock = threading.Lock()

    def bound(self, budget: AdaptiveStagingBudget, name: str, process: int | str) -> int:
        """The bound of the next save of ``name`` by ``process`` (logged)."""
        with self._lock:
            bound = self._bounds.get((budget, name, process), budget.min_bytes)
        log.debug(
            "staging bound for %r (process %s): %d bytes (adaptive, within [%d, %d])",
            name,
            process,
            bound,
            budget.min_bytes,
            budget.max_bytes,
        )
        return bound

    def record(
        self, budget: AdaptiveStagingBudget, name: str, process: int | str, peak_bytes: int
    ) -> int:
        """A save of ``name`` held ``peak_bytes`` in staging at most: the next one's bound."""
        bound = budget.next_bound(peak_bytes)
        with self._lock:
            self._bounds[(budget, name, process)] = bound
        return bound

    def clear(self) -> None:
        """Forget every bound (the next saves start at ``min_bytes`` again)."""
        with self._lock:
            self._bounds.clear()


REGULATOR = Regulator()
