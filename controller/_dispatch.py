"""Choosing the host group for a call: the tree decides (slice handles), else the runtime."""

from __future__ import annotations

import functools
from typing import Any

import jax

from milepost.colocated import HostGroup, LocalHostGroup

_PROVIDERS: list[Any] = []
"""Callables ``() -> HostGroup | None`` consulted for trees without slice handles (the
multi-controller group registers itself here)."""


def register_default_group_provider(provider: Any) -> None:
    _PROVIDERS.insert(0, provider)


@functools.cache
def _local() -> LocalHostGroup:
    return LocalHostGroup(jax.process_index())


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
