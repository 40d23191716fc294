"""How a root names its step folders: ``<step>`` (milepost's default), or what Orbax's step
name formats produce: ``<prefix>_<step>``, and either zero-padded to a fixed length
(``000010``, ``checkpoint_000010``; a step with more digits than that length is not cut).

A name's shape says its step and prefix; a root's naming is read from the names of its
committed steps (:func:`naming_of`), and new steps are named by it (or by the naming given).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

_SHAPE = re.compile(r"(?:([^./]+)_)?(\d+)")
"""``[<prefix>_]<digits>``: a prefix holds no ``.`` (temporary and deleted steps add one)."""


@dataclass(frozen=True)
class StepNaming:
    """``prefix`` (None: none) and ``fixed_length`` (None: the digits of the step, unpadded)."""

    prefix: str | None = None
    fixed_length: int | None = None

    def name(self, step: int) -> str:
        digits = str(step).zfill(self.fixed_length or 0)
        return digits if self.prefix is None else f"{self.prefix}_{digits}"

    def __str__(self) -> str:
        shown = f"step_prefix={self.prefix!r}, step_format_fixed_length={self.fixed_length!r}"
        return f"{self.name(10)!r} ({shown})"


PLAIN = StepNaming()


def parse(name: str) -> tuple[str | None, int] | None:
    """(prefix, step) of a step folder's name, or None when it is not one."""
    m = _SHAPE.fullmatch(name)
    return None if m is None else (m.group(1), int(m.group(2)))


def step_of(name: str) -> int | None:
    """The step a folder name holds (any naming), or None."""
    found = parse(name)
    return None if found is None else found[1]


def naming_of(names: Iterable[str]) -> StepNaming | None:
    """The one naming that gives every name in ``names`` (step folder names; PLAIN when there
    are none), or None when they were named more than one way."""
    parsed = [(name, parse(name)) for name in names]
    prefixes = {p[0] for _, p in parsed if p is not None}
    padded = {
        len(digits)
        for name, p in parsed
        if p is not None
        for digits in [name.rpartition("_")[2] if p[0] is not None else name]
        if len(digits) > 1 and digits.startswith("0")
    }
    if len(prefixes) > 1 or len(padded) > 1:
        return None
    naming = StepNaming(
        next(iter(prefixes)) if prefixes else None, next(iter(padded)) if padded else None
    )
    if any(p is None or naming.name(p[1]) != name for name, p in parsed):
        return None
    return naming


def is_leftover_name(name: str, markers: Iterable[str], prefixes: set[str | None]) -> bool:
    """``<step name><marker>...`` (a temporary or half-deleted step) of a known prefix."""
    for marker in markers:
        head, found, _ = name.partition(marker)
        found_step = parse(head) if found else None
        if found_step is not None and found_step[0] in prefixes:
            return True
    return False
