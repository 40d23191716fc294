"""Choosing the host group for a call: the tree decides (slice handles), else the runtime."""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable
from typing import Any, TypeVar

import jax

from milepost.colocated import HostGroup, LocalHostGroup
from milepost.colocated._mcjax import default_group as _multi_controller_group

T = TypeVar("T")

_PROVIDERS: list[Any] = []
"""Callables ``() -> HostGroup | None`` consulted for trees without slice handles (the
multi-controller group registers itself here)."""


def register_default_group_provider(provider: Any) -> None:
    _PROVIDERS.insert(0, provider)


@functools.cache
def _local() -> LocalHostGroup:
    return LocalHostGroup(jax.process_index())


def _multi_controller_if_distributed() -> HostGroup | None:
    """Every process of a multi-process jax.distributed job is a controller (mcJAX): one group
    per distributed runtime."""
    return _multi_controller_group() if jax.process_count() > 1 else None


register_default_group_provider(_multi_controller_if_distributed)


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


def host_group_for(values: list[Any]) -> HostGroup:
    groups = {id(g): g for v in values if (g := getattr(v, "__milepost_host_group__", None)) is not None}
    if len(groups) > 1:
        raise ValueError("the tree mixes arrays from several slices; save each slice's arrays separately")
    if groups:
        return next(iter(groups.values()))
    for provider in _PROVIDERS:
        group = provider()
        if group is not None:
            return group
    return _local()


def host_group_for_abstract(values: list[Any]) -> HostGroup:
    for v in values:
        sharding = getattr(v, "sharding", None)
        group = getattr(sharding, "__milepost_host_group__", None) or getattr(v, "__milepost_host_group__", None)
        if group is not None:
            return group
    return host_group_for([])
