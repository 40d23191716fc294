"""Standby host processes: idle host actors kept on the nodes, JAX imported, so that a
recovered slice starts from them instead of starting processes (``SliceOptions.standby_hosts``).

A standby is a ``HostActor`` not yet in any ``jax.distributed`` cluster (it cannot join one that
runs: JAX forms a cluster once). It reserves no CPU, and it is placed with node affinity: as
many on each node as the slice has hosts there, and one on each other live node (a spare). A
recovery takes the ready standbys on the nodes it chose, tells each its index, and forms the
new cluster with them; the new slice then starts standbys again behind it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger("milepost.slice")


class Standby:
    """A slice's standby host processes, by node."""

    def __init__(self, make: Callable[[str], Any]) -> None:
        self._make = make
        """Starts one standby actor on a node (by its Ray id)."""
        self._by_node: dict[str, list[tuple[Any, Any]]] = {}
        """Node -> its standbys: (actor, the ref of its warm-up call)."""

    def fill(self, wanted: Mapping[str, int]) -> None:
        """Start standbys until each node has as many as ``wanted`` (not waited for)."""
        for node, count in wanted.items():
            have = self._by_node.setdefault(node, [])
            while len(have) < count:
                actor = self._make(node)
                have.append((actor, actor.warm.remote()))

    def keep_only(self, nodes: set[str]) -> None:
        """End the standbys on nodes other than ``nodes`` (lost ones, say)."""
        import ray

        for node in [n for n in self._by_node if n not in nodes]:
            for actor, _ in self._by_node.pop(node):
                try:
                    ray.kill(actor)
                except Exception as e:
                    log.info("could not end a standby host: %s", e)

    def take(self, node: str) -> Any | None:
        """A standby on ``node`` that is ready (warmed up, alive), or None."""
        import ray

        have = self._by_node.get(node, [])
        for k, (actor, ref) in enumerate(have):
            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                continue
            del have[k]
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayError as e:
                log.info("a standby host on node %s is gone: %s", node[:12], e)
                return self.take(node)
            return actor
        return None

    def close(self) -> None:
        """End every standby."""
        import ray

        for have in self._by_node.values():
            for actor, _ in have:
                try:
                    ray.kill(actor)
                except Exception as e:
                    log.info("could not end a standby host: %s", e)
        self._by_node.clear()
