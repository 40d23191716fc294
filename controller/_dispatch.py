"""Choosing the host group for a call: the tree decides (slice handles), else the runtime."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import jax

from milepost.colocated import HostGroup, LocalHostGroup, MultiControllerHostGroup

T = TypeVar("T")

_PROVIDERS: list[Any] = []
"""Callables ``() -> HostGroup | None`` consulted for trees without slice handles (the
multi-controller group registers itself here)."""


def register_default_group_provider(provider: Any) -> None:
    _PROVIDERS.insert(0, provider)


@functools.cache
def _local() -> LocalHostGroup:
    return LocalHostGroup(jax.process_index())


@functools.cache
def _multi_controller() -> MultiControllerHostGroup:
    return MultiControllerHostGroup()


def _multi_controller_if_distributed() -> HostGroup | None:
    return _multi_controller() if jax.process_count() > 1 else None


register_default_group_provider(_multi_controller_if_distributed)


def shared(group: HostGroup, name: str, fn: Callable[[], T], timeout: float) -> T:
    """Run ``fn`` on the primary only and give every controller process its result, or its
    error: listings and metadata reads are done once, not by every process."""
    if group.is_primary():
        try:
            outcome: tuple[bool, Any] = (True, fn())
        except Exception as e:
            outcome = (False, e)
        group.broadcast(name, outcome, timeout)
    else:
        outcome = group.broadcast(name, None, timeout)
    ok, value = outcome
    if not ok:
        raise value
    return value


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
