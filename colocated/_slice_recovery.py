"""Where the hosts of a recovered slice go, and starting them there (``Slice.recover``).

A host whose node is alive starts again on it, with its index; a host whose node is gone goes
to a spare, a live node where no host of the slice ran (the controller's own node last). Ray
lists a node whose raylet was just killed alive for another 10-15 s: a raylet that refuses a TCP
connection counts as gone at once, and a host that dies as it starts marks its node gone for
the next attempt.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

from milepost.colocated._actors import host_on
from milepost.colocated._errors import HostError

if TYPE_CHECKING:
    from milepost.colocated._slice import SliceOptions
    from milepost.colocated._standby import Standby

log = logging.getLogger("milepost.slice")


def raylet_answers(node: Mapping[str, Any], timeout: float = 2.0) -> bool:
    """Whether ``node``'s raylet accepts a connection: a node whose raylet was killed stays
    listed alive until its health checks fail (about 10 s later), and a host placed there waits
    for that verdict."""
    try:
        address = (str(node["NodeManagerAddress"]), int(node["NodeManagerPort"]))
    except (KeyError, TypeError, ValueError):
        return True  # nothing to probe: trust Ray's listing
    try:
        with socket.create_connection(address, timeout=timeout):
            return True
    except OSError:
        return False


def live_nodes(gone: Collection[str] = ()) -> list[str]:
    """The ids of the Ray nodes listed alive whose raylets answer, but for ``gone``."""
    import ray

    return [
        n["NodeID"]
        for n in ray.nodes()
        if n["Alive"] and n["NodeID"] not in gone and raylet_answers(n)
    ]


def recovery_nodes(before: list[str], gone: Collection[str]) -> list[str]:
    """Where each host of a recovered slice goes (``before``: each host's node until now): its
    node if alive, else a spare (the controller's own node last)."""
    import ray

    alive = live_nodes(gone)
    here = ray.get_runtime_context().get_node_id()
    spares = sorted((n for n in alive if n not in before), key=lambda n: n == here)
    nodes: list[str] = []
    for i, node in enumerate(before):
        if node in alive:
            nodes.append(node)
            continue
        if not spares:
            raise HostError(
                f"cannot recover the slice: host {i}'s node {node[:12]} is gone and every "
                f"live node ({len(alive)}) already runs a host of it; add a node (a spare) "
                "to the Ray cluster, then call recover() again",
                hosts=[i],
            )
        nodes.append(spares.pop(0))
        log.warning(
            "recovering the slice: host %d moves from lost node %s to node %s",
            i,
            node[:12],
            nodes[-1][:12],
        )
    return nodes


def start_hosts(
    before: list[str],
    standby: Standby | None,
    options: SliceOptions,
    devices_per_host: int | None,
) -> list[Any]:
    """Host actors for a recovered slice, one per entry of ``before`` (each host's node until
    now), each answering: standby hosts where ``standby`` has one on the node, else new ones.
    A node whose host dies as it starts is left out and the hosts are placed again, until
    ``options.start_timeout_secs``; then a HostError naming the nodes (``standby`` closed)."""
    import ray

    gone: set[str] = set()
    deadline = time.monotonic() + options.start_timeout_secs
    while True:
        nodes = recovery_nodes(before, gone)
        actors = []
        for i, node in enumerate(nodes):
            actor = standby.take(node) if standby is not None else None
            if actor is not None:
                actor.assign.remote(i, len(nodes))  # runs before its identity call
            else:
                actor = host_on(
                    node,
                    index=i,
                    hosts=len(nodes),
                    devices_per_host=devices_per_host,
                    options=options,
                    cpus=options.cpus_per_host,
                )
            actors.append(actor)
        calls = {a.identity.remote(): (a, node) for a, node in zip(actors, nodes, strict=True)}
        ready, _ = ray.wait(
            list(calls), num_returns=len(calls), timeout=deadline - time.monotonic()
        )
        dead = set()
        for ref in ready:
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayActorError:
                dead.add(calls[ref][1])
        if len(ready) == len(calls) and not dead:
            return actors
        for a in actors:
            ray.kill(a)
        if not dead or time.monotonic() > deadline:
            if standby is not None:
                standby.close()
            raise HostError(
                f"recovering the slice: its hosts could not start on nodes "
                f"{[n[:12] for n in nodes]} within {options.start_timeout_secs:g}s"
            )
        log.warning("recovering the slice: nodes %s are gone too", [n[:12] for n in dead])
        gone |= dead
