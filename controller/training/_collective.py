"""How a Checkpointer's controller processes agree: the primary decides (lists, deletes,
resolves a step), every process gets its answer through the host group's broadcast."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from milepost import _hosts
from milepost.colocated import HostGroup

T = TypeVar("T")


class Collective:
    """The collectives of one Checkpointer (its host group, its root, its timeout)."""

    def __init__(self, group: HostGroup, root: Any, timeout: float) -> None:
        self.group = group
        self.root = root
        self.timeout = timeout
        self.primary = group.is_primary()

    def __call__(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()`` on the primary; its result (or its error) on every process."""
        return _hosts.shared(self.group, f"milepost.training:{what}:{self.root}", fn, self.timeout)
