"""The peer tier's transport over a slice's Ray hosts, on the controller: :class:`SlicePeers`
sends each host its plan and gathers the acks (a :class:`~._peer_transport.PeerTransport`; the
runner that decides is ``milepost.training.peers``). The hosts' side is
``_ray_peers.PeerHost``, in each host actor. :func:`choose_peers` picks the hosts that keep the
copies of each part, for either transport.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import Any

import milepost.workers as workers
from milepost.colocated._errors import HostError
from milepost.colocated._handles import AbstractArray, RemoteArray, SliceSharding
from milepost.colocated._peer_transport import PeerRestoreAck, json_leaves
from milepost.colocated._ray_group import WAIT_GROUP, RayHostGroup
from milepost.colocated._ray_host import Ref
from milepost.colocated._ray_peers import PeerRestorePlan, PeerSaveAck, PeerSavePlan
from milepost.workers import peers

log = logging.getLogger("milepost.peers")


def choose_peers(nodes: Sequence[str], copies: int) -> list[list[int]]:
    """For each host, the ``copies`` hosts that keep a copy of its part: the next hosts in index
    order whose nodes differ from its own and from each other, so that losing one node never
    loses a part and all its copies."""
    hosts = len(nodes)
    distinct = len(set(nodes))
    if copies >= distinct:
        raise ValueError(
            f"a peer tier with copies={copies} needs the slice's hosts on at least {copies + 1} "
            f"nodes (a part and each copy on a node of its own); its {hosts} hosts are on "
            f"{distinct}: lower copies, or start the slice across more nodes (Slice.connect)"
        )
    out = []
    for i in range(hosts):
        chosen: list[int] = []
        used = {nodes[i]}
        for step in range(1, hosts):
            j = (i + step) % hosts
            if nodes[j] not in used:
                chosen.append(j)
                used.add(nodes[j])
                if len(chosen) == copies:
                    break
        out.append(chosen)
    return out


class PendingPeerSave:
    """The hosts' background work of one peer save: their own parts and the copies."""

    def __init__(self, group: RayHostGroup, step: int, token: str, waits: dict[int, Any]) -> None:
        self.group = group
        self.step = step
        self.token = token
        self._waits = waits
        self._acks: list[PeerSaveAck] | None = None

    def wait(self, timeout: float) -> list[PeerSaveAck]:
        """Every host's ack; a HostError naming the hosts that failed or did not answer."""
        if self._acks is None:
            acks = self.group.gather(self._waits, timeout, f"keeping step {self.step} in memory")
            self._acks = [acks[i] for i in sorted(acks)]
        return self._acks


class SlicePeers:
    """The peer tier of a slice's hosts (node folders named by ``folder`` and ``run``)."""

    of_slice = True

    def __init__(self, group: RayHostGroup, folder: str, run: str) -> None:
        self.group = group
        self.folder = folder
        self.run = run
        self._pending: PendingPeerSave | None = None

    @property
    def hosts(self) -> int:
        return self.group.hosts

    @property
    def healthy(self) -> bool:
        return self.group.healthy

    @property
    def slice(self) -> Any:
        """The Slice of these hosts (None once it is gone)."""
        return self.group.owner()

    def record(self, leaf: Any) -> peers.ArrayRecord | None:
        sharding = getattr(leaf, "sharding", None)
        if not isinstance(leaf, RemoteArray | AbstractArray) or not isinstance(
            sharding, SliceSharding
        ):
            return None
        return peers.record_of(leaf, sharding.milepost_spec)

    def abstract(self, record: peers.ArrayRecord) -> Any:
        sharding = SliceSharding(self.group, record.sharding)
        return AbstractArray(record.shape, workers.dtype_of(record.dtype), sharding)

    def nodes(self, timeout: float) -> list[str]:
        return [ident["node"] for ident in self.group.identities()]

    def save(
        self,
        step: int,
        arrays: Sequence[Any],
        leaves: Sequence[tuple[int, Any]],
        copies_to: Sequence[Sequence[int]],
        keep: Sequence[int],
        timeout: float,
    ) -> tuple[str, int]:
        """Every host copies its boxes of ``arrays`` to host memory (this returns then, with
        the bytes staged); each then removes from its node's folder every step but ``keep`` and
        writes its part and its copies, in the background. The parts keep the ``leaves`` that
        are JSON values (a restarted controller finds them there); the others stay with the
        runner."""
        group = self.group
        group.check_usable()
        refs = []
        for k, s in enumerate(arrays):
            if getattr(s, "__milepost_host_group__", None) is not group:
                raise TypeError(
                    f"array {k} ({type(s).__name__}) is not an array of this slice; the peer "
                    "tier keeps a slice's RemoteArrays"
                )
            refs.append(Ref(s.id))
        token = uuid.uuid4().hex
        kept, _ = json_leaves(leaves)
        starts = {}
        for i in range(group.hosts):
            plan = PeerSavePlan(
                folder=self.folder,
                run=self.run,
                step=step,
                hosts=group.hosts,
                copies_to=tuple((j, group.actor(j)) for j in copies_to[i]),
                keep=tuple(keep),
                leaves=kept,
                timeout_secs=timeout,
            )
            starts[i] = group.call(i, "peer_start", plan, refs, token)
        waits = {
            i: group.call(i, "peer_wait", token, timeout, concurrency_group=WAIT_GROUP)
            for i in range(group.hosts)
        }
        staged = group.gather(starts, timeout, f"copying step {step} to host memory")
        self._pending = PendingPeerSave(group, step, token, waits)
        return token, sum(staged.values())

    def wait_saved(self, timeout: float) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait(timeout)

    def held(self, timeout: float) -> list[list[peers.Held]]:
        """What each host's node folder holds, host by host."""
        return self.group.all(
            "peer_list", self.folder, self.run, doing="listing its peer tier", timeout=timeout
        )

    def restore(
        self,
        step: int,
        token: str,
        records: Sequence[peers.ArrayRecord],
        sources: Sequence[Sequence[int | None]],
        timeout: float,
    ) -> tuple[list[RemoteArray], list[PeerRestoreAck]]:
        """Every host rebuilds its arrays of ``step`` from the copies ``sources[i]`` names for
        it (None: its own node folder), in order; handles to the arrays, and the acks."""
        group = self.group
        group.check_usable()
        prefix = uuid.uuid4().hex
        calls = {}
        for i in range(group.hosts):
            plan = PeerRestorePlan(
                folder=self.folder,
                run=self.run,
                step=step,
                token=token,
                records=tuple(records),
                sources=tuple((i, None) if s is None else (s, group.actor(s)) for s in sources[i]),
                timeout_secs=timeout,
            )
            calls[i] = group.call(i, "peer_restore", plan, prefix)
        try:
            acks = group.gather(calls, timeout, f"restoring step {step} from the peer tier")
        except HostError:
            for k in range(len(records)):  # what some hosts built before others failed
                group.release(f"{prefix}.{k}")
            raise
        arrays = [
            RemoteArray(group, f"{prefix}.{k}", r.shape, workers.dtype_of(r.dtype), r.sharding)
            for k, r in enumerate(records)
        ]
        return arrays, [acks[i] for i in sorted(acks)]

    def close(self, remove: bool, timeout: float) -> None:
        """Every host removes the run's folder from its node, or lets go of it (``remove``
        False); nothing else runs here between calls. On a slice shut down or lost, nothing is
        asked (the folders stay until ``milepost peers clear``)."""
        doing = "removing its node's peer tier folder" if remove else "keeping its peer tier"
        try:
            self.group.check_usable()
            self.group.all(
                "peer_close", self.folder, self.run, remove, timeout, doing=doing, timeout=timeout
            )
        except HostError as e:
            log.warning("peer tier: %s left as it is: %s", self.run, e)


__all__ = ["PendingPeerSave", "SlicePeers", "choose_peers"]
