"""Boxes: the half-open index ranges of an array that a shard, a chunk or a read covers."""

from __future__ import annotations

from typing import Any

Box = tuple[tuple[int, int], ...]
"""One ``(start, stop)`` pair per dimension."""


def box_to_slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def box_size(box: Box) -> int:
    """The number of elements in ``box``."""
    n = 1
    for a, b in box:
        n *= b - a
    return n


def addressable_boxes(
    sharding: Any, shape: tuple[int, ...], readers: frozenset[int] | None = None
) -> tuple[list[tuple[tuple[Any, ...], Box]], dict[Any, Box]]:
    """The distinct boxes this host's devices hold (each with its devices; each box is read
    once, its replicas get copies in memory), and every device's box. ``readers``: only these
    device ids read (load-and-broadcast)."""
    by_box: dict[Box, list[Any]] = {}
    of_device: dict[Any, Box] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        box = of_device[device] = slices_to_box(index, shape)
        if readers is None or device.id in readers:
            by_box.setdefault(box, []).append(device)
    return [(tuple(d), box) for box, d in by_box.items()], of_device


def slices_to_box(index: tuple[slice, ...] | None, shape: tuple[int, ...]) -> Box:
    """The box a tuple of slices (as JAX gives a shard's index; None or ``()``: all of it)
    selects in an array of ``shape``."""
    return (
        tuple(
            (s.start or 0, n if s.stop is None else s.stop)
            for s, n in zip(index, shape, strict=True)
        )
        if index
        else tuple((0, n) for n in shape)
    )
