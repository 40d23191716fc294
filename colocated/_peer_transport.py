"""The peer tier's transport: how its one runner (``milepost.training.peers``) reaches the hosts
that keep each step's parts in their nodes' memory. The runner decides what to keep, which step
to restore and from where; a transport carries that out on its hosts. Two implement
:class:`PeerTransport`, named by the side that runs them:

- ``_slice_peers.SlicePeers`` runs on a slice's controller: it sends the slice's Ray hosts plans
  and gathers their acks; ``_ray_peers.PeerHost`` runs in each host actor (stage, write, send
  and receive copies host to host over Ray, restore);
- ``_process_peers.ProcessPeers`` runs in every process of a multi-controller job, or in the one
  process: each process is the host of its own devices, keeps its own part and sends its copies
  over TCP (``milepost.workers.peers.PeerServer``); the processes agree through
  ``jax.distributed``.

Both keep parts in the node folders of ``milepost.workers.peers``. Every call below is made in
every controller process, in the same order (a slice has one).

A peer save, in the order the runner calls a transport:

1. ``nodes(timeout)``: each host's node, by host index (the runner picks the hosts that keep
   copies of each part: ``choose_peers``);
2. ``save(step, arrays, leaves, copies_to, keep, timeout)`` -> ``(token, staged bytes)``: returns
   once every host copied its boxes of ``arrays`` into host memory (the caller's arrays are free
   then). Behind it each host removes from its node folder every step but ``keep``, writes its
   part (its boxes, and the JSON ``leaves`` the transport's parts keep) and sends it to the
   hosts ``copies_to`` names for it, which check and write it;
3. ``wait_saved(timeout)`` (at the next save, or the Checkpointer's ``wait``): returns once every
   part and copy of the last save is written; a :class:`HostError` naming a host if not.

A recovery:

1. ``held(timeout)``: the complete parts each host's node folder holds, host by host;
2. ``restore(step, token, records, sources, timeout)`` -> ``(arrays, acks)``: each host rebuilds
   its arrays of the save ``token`` of ``step`` from the first good copy of its part among
   ``sources[host]`` (None: its own node's folder; an index: the host holding a copy on another
   node), keeps a copy in its own folder; a :class:`HostError` if a host found no good copy;
3. after a :class:`HostError`, ``healthy``: False when a host was lost (the runner starts again
   on a new slice).

At the Checkpointer's ``close()``, once its saves are written: ``close(remove, timeout)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from milepost.colocated._hostgroup import HostGroup
from milepost.workers import peers

_JSON_LEAVES = (bool, int, float, str, type(None))


@dataclasses.dataclass(frozen=True, kw_only=True)
class PeerRestoreAck:
    """What one host's restore did."""

    host: int
    nbytes: int
    source: int | None
    """The host whose copy was used (None: this host's own node folder)."""
    skipped: tuple[str, ...]
    """Why each source tried before it was not used."""
    leaves: tuple[tuple[int, Any], ...] = ()
    """The saved tree's leaves that are not arrays, as its part keeps them (JSON values)."""


class PeerTransport(Protocol):
    """The hosts of a peer tier, as its runner reaches them (the call order: above)."""

    @property
    def group(self) -> HostGroup:
        """The host group whose arrays these hosts hold."""
        ...

    of_slice: bool
    """True: a slice's hosts (a recovery replaces them with :meth:`Slice.recover`); False: a
    job's own processes (a restarted job recovers in every process)."""

    @property
    def hosts(self) -> int:
        """How many hosts, each keeping one part of a step."""
        ...

    @property
    def slice(self) -> Any:
        """The Slice these hosts form (a Recovery's), None for a job's own processes."""
        ...

    @property
    def healthy(self) -> bool:
        """Whether every host still lives (after a failure: whether to start again elsewhere)."""
        ...

    def record(self, leaf: Any) -> peers.ArrayRecord | None:
        """The record of an array (or an abstract one) these hosts hold; None for a leaf that
        is not one."""
        ...

    def abstract(self, record: peers.ArrayRecord) -> Any:
        """The abstract array of ``record`` on these hosts (for a load from storage)."""
        ...

    def nodes(self, timeout: float) -> list[str]:
        """Each host's node, by host index."""
        ...

    def save(
        self,
        step: int,
        arrays: Sequence[Any],
        leaves: Sequence[tuple[int, Any]],
        copies_to: Sequence[Sequence[int]],
        keep: Sequence[int],
        timeout: float,
    ) -> tuple[str, int]:
        """Stage every host's boxes of ``arrays`` (returns then: the save's token and the bytes
        staged); each part and its copies are written behind."""
        ...

    def wait_saved(self, timeout: float) -> None:
        """Once every part and copy of the last save is written (a HostError if not)."""
        ...

    def held(self, timeout: float) -> list[list[peers.Held]]:
        """What each host's node folder holds, host by host."""
        ...

    def restore(
        self,
        step: int,
        token: str,
        records: Sequence[peers.ArrayRecord],
        sources: Sequence[Sequence[int | None]],
        timeout: float,
    ) -> tuple[list[Any], list[PeerRestoreAck]]:
        """Every host's arrays of ``step`` rebuilt from the first good copy ``sources[host]``
        names; the arrays (as this controller holds them) and every host's ack."""
        ...

    def close(self, remove: bool, timeout: float) -> None:
        """Stop what runs here for these hosts; every host removes this run's folder from its
        node (``remove``; the last host of a node does) or lets go of it, kept for a restart."""
        ...


def json_leaves(
    leaves: Sequence[tuple[int, Any]],
) -> tuple[tuple[tuple[int, Any], ...], list[int]]:
    """The leaves a part's manifest can keep (JSON values: bool, int, float, str, None; NumPy
    scalars as Python's), by leaf index; and the indices of the others."""
    kept: list[tuple[int, Any]] = []
    others: list[int] = []
    for k, value in leaves:
        if isinstance(value, np.generic):
            value = value.item()
        if isinstance(value, _JSON_LEAVES):
            kept.append((k, value))
        else:
            others.append(k)
    return tuple(kept), others
