"""A Checkpointer's tiers together: the durable root and, with ``local=``, the local tier.

The primary lists them (and, when writing, opens them: what an unfinished save left is
removed) and decides the naming of new steps; every process adopts that listing. A step is read
from its local copy when there is one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from milepost.training._errors import StepNamingError
from milepost.training._naming import PLAIN, StepNaming, naming_of
from milepost.training._options import CheckpointerOptions
from milepost.training._state import StepState
from milepost.training._tier import Tier
from milepost.workers import StoragePath, is_local

Listing = tuple[
    dict[int, dict[str, Any]],
    dict[int, dict[str, Any]],
    dict[int, str],
    dict[int, str],
    Any,
    dict[int, int],
]
"""What the primary lists: each tier's steps (metrics), their folders' names, the naming, and
the steps' commit times."""


def check_apart(local: Path | None, root: StoragePath) -> None:
    """The local tier and the root are different folders, neither inside the other; checked
    before any tier, thread or listing is made, so a refused Checkpointer leaves nothing."""
    if local is not None and is_local(root):
        if local == root or root in local.parents or local in root.parents:
            raise ValueError(
                f"local={str(local)!r} and root={str(root)!r} overlap; give the "
                "local tier its own folder"
            )


def given_naming(options: CheckpointerOptions) -> StepNaming | None:
    """The naming ``step_prefix`` and ``step_format_fixed_length`` give (None: neither given)."""
    o = options
    if o.step_prefix is None and o.step_format_fixed_length is None:
        return None
    return StepNaming(o.step_prefix, o.step_format_fixed_length)


class Tiers:
    """The durable tier and the local one (``fast``, None without ``local=``), and the steps
    the Checkpointer knows in them (``state``)."""

    def __init__(
        self,
        durable: Tier,
        fast: Tier | None,
        state: StepState,
        given: StepNaming | None,
        read_only: bool,
    ) -> None:
        self.durable = durable
        self.fast = fast
        self.state = state
        self.given = given
        """The naming of new steps the options give (None: the committed steps' naming)."""
        self.read_only = read_only
        for tier in self.all():
            tier.naming = given or PLAIN

    def all(self) -> list[Tier]:
        return [self.durable] if self.fast is None else [self.durable, self.fast]

    def open(self) -> Listing:
        """Open both tiers and list them (on the primary)."""
        fast = self.fast.open(self.read_only) if self.fast is not None else {}
        return self.listed(self.durable.open(self.read_only), fast)

    def scan(self) -> Listing:
        """List both tiers again (on the primary)."""
        fast = self.fast.scan() if self.fast is not None else {}
        return self.listed(self.durable.scan(), fast)

    def listed(self, durable: dict[int, Any], fast: dict[int, Any]) -> Listing:
        """The tiers' listing, with the naming of new steps: the one given, else the one of
        the committed steps (StepNamingError, when writing, if they have several)."""
        root = self.durable.path
        local_names = self.fast.names if self.fast is not None else {}
        naming = self.given or naming_of({*self.durable.names.values(), *local_names.values()})
        if naming is None and self.read_only:
            naming = PLAIN  # names no step
        if naming is None:
            names = {**self.durable.names, **local_names}
            newest = {naming_of([names[s]]): names[s] for s in sorted(names)}
            latest = naming_of([names[max(names)]])
            raise StepNamingError(
                root,
                tuple(newest.values()),
                f"the steps of {root} are named more than one way "
                f"({', '.join(repr(n) for n in newest.values())}), so new steps' names are not "
                f"known: pass step_prefix= and step_format_fixed_length= (the latest step's "
                f"naming: {latest}), or open it with read_only=True",
            )
        times = {**(self.fast.times if self.fast is not None else {}), **self.durable.times}
        naming_ = (naming.prefix, naming.fixed_length)
        return durable, fast, self.durable.names, local_names, naming_, times

    def adopt(self, listing: Listing) -> None:
        """The primary's listing, in this process: the steps, their folders, the naming."""
        durable, fast, durable_names, local_names, (prefix, length), times = listing
        for tier, names in ((self.durable, durable_names), (self.fast, local_names)):
            if tier is not None:
                tier.names = {int(k): str(v) for k, v in names.items()}
                tier.naming = StepNaming(prefix, length)
        state = self.state
        with state.cond:
            state.durable = {int(k): dict(v) for k, v in durable.items()}
            state.local = {int(k): dict(v) for k, v in fast.items()}
            state.times = {int(k): int(v) for k, v in times.items()}

    def where(self, step: int) -> StoragePath:
        """Where to read ``step``: its local copy when there is one."""
        with self.state.cond:
            if self.fast is not None and step in self.state.local:
                return self.fast.step(step)
        return self.durable.step(step)

    def target(self, step: int) -> StoragePath:
        """Where a save of ``step`` writes: the local tier when there is one."""
        return (self.fast or self.durable).step(step)
