"""Choosing the host group for a call (the tree's slice handles, else the runtime), and running
a step once on the primary for every controller process."""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable
from typing import Any, TypeVar

import jax

from milepost.colocated import HostGroup, LocalHostGroup, MultiControllerHostGroup
from milepost.colocated import default_group as _multi_controller_group
from milepost.workers import as_path, in_object_store

T = TypeVar("T")

CONTROLLER = "controller"
"""The host index of the controller itself: its own leaves (NumPy arrays, scalars) are written
into ``ocdbt.process_controller`` and read by it."""


@functools.cache
def _local() -> LocalHostGroup:
    return LocalHostGroup(jax.process_index())


@functools.cache
def controller_host() -> LocalHostGroup:
    """The host group for the leaves the controller itself holds, in every mode."""
    return LocalHostGroup(CONTROLLER)


def _default_group() -> HostGroup:
    """Every process of a multi-process jax.distributed job is a controller (mcJAX, one group
    per distributed runtime); otherwise this process is the only host."""
    if jax.process_count() > 1:
        group = _multi_controller_group()
        if group is not None:
            return group
    return _local()


def controller_process(group: HostGroup) -> tuple[int, int]:
    """This controller process's index and the number of controller processes of ``group``:
    each process of a multi-controller job, else the one controller (0 of 1, embedded or with a
    Ray slice, whose hosts are not controllers)."""
    if isinstance(group, MultiControllerHostGroup):
        return jax.process_index(), len(group.processes())
    return 0, 1


def shared(group: HostGroup, name: str, fn: Callable[[], T], timeout: float) -> T:
    """Run ``fn`` on the primary only and give every controller process its result, or its
    error: listings and metadata reads are done once, not by every process."""
    if group.is_primary():
        try:
            value = fn()
        except Exception as e:
            group.broadcast(name, (False, _portable(e)), timeout)
            raise
        group.broadcast(name, (True, value), timeout)
        return value
    ok, value = group.broadcast(name, None, timeout)
    if not ok:
        raise value
    return value


def _portable(error: Exception) -> Exception:
    """``error`` if it survives pickling (to reach the other processes), else a RuntimeError
    with its type and message."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


def check_storage(group: HostGroup, where: Any) -> HostGroup:
    """``group``, if its hosts can all reach ``where``: ``memory://`` lives inside one process."""
    place = as_path(where)
    if (
        not isinstance(group, LocalHostGroup)
        and in_object_store(place)
        and place.scheme == "memory"
    ):
        raise ValueError(
            f"{where} is in memory, inside this process; the other processes of "
            f"{group!r} cannot reach it. Save to storage every host shares "
            "instead: a shared file system, gs:// or s3://"
        )
    return group


def host_group_for(values: list[Any]) -> HostGroup:
    """The group of the slice whose handles ``values`` hold, else the runtime's default."""
    groups = {
        id(g): g for v in values if (g := getattr(v, "__milepost_host_group__", None)) is not None
    }
    if len(groups) > 1:
        raise ValueError(
            "the tree mixes arrays from several slices; save each slice's arrays separately"
        )
    if groups:
        return next(iter(groups.values()))
    return _default_group()


def host_group_for_abstract(values: list[Any]) -> HostGroup:
    """Like :func:`host_group_for`, for abstract leaves (their shardings may name a slice)."""
    for v in values:
        sharding = getattr(v, "sharding", None)
        group = getattr(sharding, "__milepost_host_group__", None) or getattr(
            v, "__milepost_host_group__", None
        )
        if group is not None:
            return group
    return _default_group()
