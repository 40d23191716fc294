"""What a Checkpointer is opened with: one frozen, validated dataclass, like every option."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from milepost.training._policies import (
    FixedInterval,
    KeepAll,
    KeepLatest,
    RetentionPolicy,
    SavePolicy,
)
from milepost.training.peers import PeerTier
from milepost.workers import as_path, check


@dataclass(frozen=True, kw_only=True)
class CheckpointerOptions:
    """How a :class:`Checkpointer` saves, keeps and waits (its keyword arguments; see there).

    >>> ckpt = Checkpointer("/ckpt", keep=KeepLatest(n=3))
    >>> ckpt.options.keep
    KeepLatest(n=3)
    """

    save_policy: SavePolicy = field(default_factory=lambda: FixedInterval(interval=1))
    """Which steps ``save`` writes (default: every step)."""
    keep: RetentionPolicy = field(default_factory=KeepAll)
    """Which committed steps survive (default: all)."""
    max_in_flight: int = 1
    """Saves that may run in the background at once (the next waits)."""
    asynchronous: bool = True
    """False: ``save`` returns only once the step is committed."""
    timeout_secs: float | None = None
    """Bounds every wait (None: the current ``AsyncOptions.timeout_secs``, when opened)."""
    read_only: bool = False
    """List and load only: never write or delete anything."""
    local: str | os.PathLike[str] | Path | None = None
    """A folder on a fast local disk: steps commit there and are mirrored to the root."""
    local_keep: RetentionPolicy | None = None
    """Which steps the local tier keeps (default ``KeepLatest(n=2)``); never one not mirrored."""
    mirror_timeout_secs: float | None = None
    """How long a mirror may take (None: ``timeout_secs``)."""
    peers: PeerTier | None = None
    """Keep steps in the slice's node memory and on peer hosts (see :class:`PeerTier`)."""
    step_prefix: str | None = None
    """New step folders are named ``<step_prefix>_<step>`` (Orbax's ``step_prefix``)."""
    step_format_fixed_length: int | None = None
    """New step folders' numbers are zero-padded to this many digits (Orbax's option of that
    name). Neither given: new steps are named as the root's committed steps are (``<step>``
    in an empty root)."""

    def __post_init__(self) -> None:
        check.instance(
            self.save_policy,
            "save_policy",
            SavePolicy,
            "a save policy (it needs should_save(ctx)); e.g. FixedInterval(interval=100)",
        )
        check.instance(
            self.keep,
            "keep",
            RetentionPolicy,
            "a retention policy (it needs keep(steps)); e.g. KeepLatest(n=3)",
        )
        check.integer(
            self.max_in_flight,
            "max_in_flight",
            minimum=1,
            error=ValueError,
            expect="an int >= 1",
        )
        check.flag(self.asynchronous, "asynchronous")
        check.number(self.timeout_secs, "timeout_secs", positive=True, optional=True, expect=None)
        check.flag(self.read_only, "read_only")
        check.number(self.mirror_timeout_secs, "mirror_timeout_secs", positive=True, optional=True)
        check.text(self.step_prefix, "step_prefix", optional=True)
        if self.step_prefix is not None and ("." in self.step_prefix or "/" in self.step_prefix):
            raise ValueError(
                f"step_prefix={self.step_prefix!r} holds '.' or '/'; a step folder is named "
                "<step_prefix>_<step>: pass a prefix without them (e.g. 'checkpoint')"
            )
        check.integer(
            self.step_format_fixed_length, "step_format_fixed_length", minimum=1, optional=True
        )
        if self.peers is not None:
            check.instance(self.peers, "peers", PeerTier, "a PeerTier(every_n_steps=..., ...)")
            if self.read_only:
                raise ValueError(
                    "a read-only Checkpointer keeps no peer tier; drop peers=, or read_only"
                )
        if self.local is not None:
            if not isinstance(as_path(self.local), Path):
                raise ValueError(
                    f"local={self.local!r} is not a local folder; the local tier is a fast local "
                    "disk (e.g. /local_ssd/ckpt), and root is where steps are mirrored to (it may "
                    "be gs:// or s3://)"
                )
        elif self.local_keep is not None:
            raise ValueError(
                "local_keep applies to the local tier; pass local=<folder> too, or drop local_keep"
            )
        if self.local_keep is not None:
            check.instance(
                self.local_keep,
                "local_keep",
                RetentionPolicy,
                "a retention policy (it needs keep(steps)); e.g. KeepLatest(n=2)",
            )

    @property
    def local_retention(self) -> RetentionPolicy:
        """What the local tier keeps: ``local_keep``, by default the latest two steps."""
        return self.local_keep if self.local_keep is not None else KeepLatest(n=2)

    def local_path(self) -> Path | None:
        """The local tier's folder, if any."""
        where: Any = as_path(self.local) if self.local is not None else None
        return where
