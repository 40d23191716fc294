"""The peer tier on a slice, on the hosts: each host keeps its shards of a step in its node's
memory folder and sends a copy to peers on other nodes; a recovered slice rebuilds its arrays
from those copies.

Host side: :class:`PeerHost`, mixed into the host actor; the controller's side is
``_slice_peers.SlicePeers``, which sends plans and gets acks. Bytes move host to host (a Ray
call from one host actor to another, its arguments and answers carried by Ray's object transfer
between nodes), never through the controller.

Call order, for one peer save (``SlicePeers.save``):

1. every host ``peer_start``: copy its boxes to host memory (the caller's step blocks on this);
2. in the background on each host: CRC32C every box, write the part into its node's folder,
   send it to each of its peers (``peer_receive``, in the peers' ``peer`` concurrency group),
   which check and write it into theirs;
3. every host ``peer_wait`` (sent with ``peer_start``, in the ``wait`` group): answers once its
   own part and every copy of it are written, or with the error that stopped them.

A recovery (``SlicePeers.restore``): each host of the new slice gets its part of the
chosen step from its own node's folder, or from the host holding a copy (``peer_read``), checks
it, keeps a copy in its own folder, and builds its arrays.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future
from typing import Any

import numpy as np

import milepost.workers as workers
from milepost.colocated._peer_transport import PeerRestoreAck
from milepost.workers import peers

PEER_GROUP = "peer"
"""The actors' concurrency group for what peers ask of a host (receive a copy, read one): served
while the host runs the training step or a checkpoint call."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PeerSavePlan:
    """One host's peer save: where its node's folder is, the step, and who keeps copies."""

    folder: str
    run: str
    step: int
    hosts: int
    copies_to: tuple[tuple[int, Any], ...]
    """``(host index, actor handle)`` of each peer that keeps a copy of this host's part."""
    keep: tuple[int, ...]
    """The steps the node folders keep (the newest recoverable one and this one): the others
    are removed before this part is written."""
    timeout_secs: float
    leaves: tuple[tuple[int, Any], ...] = ()
    """The saved tree's leaves that are JSON values, by leaf index: the part keeps them."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PeerRestorePlan:
    """One host's part of a recovery: the step's part of this host, and where a copy is."""

    folder: str
    run: str
    step: int
    token: str
    records: tuple[peers.ArrayRecord, ...]
    sources: tuple[tuple[int, Any], ...]
    """Hosts holding a copy of this host's part, in the order to try (``(index, None)``: this
    host's own node folder)."""
    timeout_secs: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class PeerSaveAck:
    host: int
    step: int
    token: str
    nbytes: int
    copies: tuple[int, ...]
    """The hosts that wrote a copy."""


class PeerHost:
    """The peer tier's calls on a host actor (mixed into ``HostActor``)."""

    index: int
    arrays: dict[str, Any]

    def _peer_state(self) -> dict[str, Future[PeerSaveAck]]:
        state: dict[str, Future[PeerSaveAck]] | None = getattr(self, "_peer_saves", None)
        if state is None:
            state = {}
            self._peer_saves = state
        return state

    def _peer_root(self, folder: str, run: str) -> Any:
        import ray

        return peers.run_folder(folder, run, ray.get_runtime_context().get_node_id())

    def peer_start(self, plan: PeerSavePlan, sources: list[Any], token: str) -> int:
        """Copy this host's boxes of ``sources`` to host memory; the rest runs behind."""
        arrays = self._resolve(sources)  # type: ignore[attr-defined]
        last: tuple[peers.Staged, Future[PeerSaveAck]] | None = getattr(self, "_peer_last", None)
        staged = peers.stage(
            arrays,
            step=plan.step,
            owner=self.index,
            token=token,
            hosts=plan.hosts,
            leaves=plan.leaves,
            reuse=last[0].data if last is not None and last[1].done() else None,
        )
        root = self._peer_root(plan.folder, plan.run)
        future = workers.RUNTIME.pool("peer-tier", 1).submit(self._peer_write, plan, root, staged)
        self._peer_state()[token] = future
        self._peer_last = (staged, future)  # its buffer serves the next save, once written
        return int(staged.data.nbytes)

    def _peer_write(self, plan: PeerSavePlan, root: Any, staged: peers.Staged) -> PeerSaveAck:
        import ray

        peers.prune(root, set(plan.keep))
        part = staged.part()
        peers.write(root, part, staged.data)
        encoded = part.encode()
        calls = {
            i: actor.peer_receive.options(concurrency_group=PEER_GROUP).remote(
                plan.folder, plan.run, encoded, staged.data
            )
            for i, actor in plan.copies_to
        }
        deadline = time.monotonic() + plan.timeout_secs
        for i, ref in calls.items():
            try:
                ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                raise TimeoutError(
                    f"host {i} did not store host {self.index}'s peer copy of step {plan.step} "
                    f"within {plan.timeout_secs:g}s"
                ) from None
            except ray.exceptions.RayActorError as e:
                raise ConnectionError(
                    f"host {i}, which keeps host {self.index}'s peer copy of step {plan.step}, "
                    f"died ({type(e).__name__})"
                ) from None
        peers.count_between_hosts(sent=part.nbytes * len(calls))
        return PeerSaveAck(
            host=self.index,
            step=plan.step,
            token=part.token,
            nbytes=part.nbytes,
            copies=tuple(calls),
        )

    def peer_wait(self, token: str, timeout: float) -> PeerSaveAck:
        """Once this host's part and its copies are written (runs in the wait group)."""
        deadline = time.monotonic() + timeout
        while token not in self._peer_state():  # sent with peer_start: wait for it to run
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"host {self.index} was asked to wait for a peer save whose start did not "
                    f"run here within {timeout:g}s"
                )
            time.sleep(0.005)
        future = self._peer_state()[token]
        try:
            return future.result(max(0.0, deadline - time.monotonic()))
        finally:
            if future.done():
                self._peer_state().pop(token, None)

    def peer_receive(self, folder: str, run: str, encoded: bytes, data: np.ndarray) -> int:
        """Keep a peer's part (checked first: a copy damaged on the way is refused)."""
        root = self._peer_root(folder, run)
        part = peers.Part.decode(encoded, f"sent to host {self.index}")
        peers.check(part, data, f"sent to host {self.index}")
        peers.count_between_hosts(received=part.nbytes)
        peers.write(root, part, data)
        return part.nbytes

    def peer_close(self, folder: str, run: str, remove: bool, timeout: float) -> bool:
        """Remove the run's folder from this node (True once gone; False: another process of
        the run still holds it and removes it) or let go of it, after this host's peer-tier
        writes in flight."""
        root = self._peer_root(folder, run)
        job = peers.remove_run if remove else peers.release_run
        return workers.RUNTIME.pool("peer-tier", 1).submit(job, root).result(timeout) is not False

    def peer_list(self, folder: str, run: str) -> list[peers.Held]:
        """The complete parts in this host's node folder."""
        return peers.listing(self._peer_root(folder, run))

    def peer_read(self, folder: str, run: str, step: int, owner: int, token: str) -> Any:
        """A part in this host's node folder, checked, for a host that lost its own."""
        # The host it goes to checks every box; here only the manifest and the size.
        part, data = peers.read(self._peer_root(folder, run), step, owner, token, checked=False)
        peers.count_between_hosts(sent=part.nbytes)
        return part.encode(), np.asarray(data)

    def peer_restore(self, plan: PeerRestorePlan, prefix: str) -> PeerRestoreAck:
        """Rebuild this host's arrays of ``plan.step`` from the first good copy of its part;
        register them as ``<prefix>.<k>``."""
        import ray

        root = self._peer_root(plan.folder, plan.run)
        skipped: list[str] = []
        for source, actor in plan.sources:
            try:
                if actor is None:
                    part, data = peers.read(root, plan.step, self.index, plan.token)
                else:
                    ref = actor.peer_read.options(concurrency_group=PEER_GROUP).remote(
                        plan.folder, plan.run, plan.step, self.index, plan.token
                    )
                    encoded, data = ray.get(ref, timeout=plan.timeout_secs)
                    where = f"of host {self.index} (a copy from host {source})"
                    part = peers.Part.decode(encoded, where)
                    peers.count_between_hosts(received=int(data.nbytes))
                    peers.check(part, data, where)
                    if (part.step, part.owner, part.token) != (plan.step, self.index, plan.token):
                        raise workers.CorruptCheckpointError(f"the {where} is of another save")
                    # this node holds its part again (behind, before this host's next save)
                    workers.RUNTIME.pool("peer-tier", 1).submit(peers.write, root, part, data)
            except (
                OSError,
                workers.CorruptCheckpointError,
                ray.exceptions.RayError,
            ) as e:
                cause = getattr(e, "cause", None) or e  # a peer's own error, not Ray's wrapper
                where = "its own node folder" if actor is None else f"host {source}"
                skipped.append(f"{where}: {type(cause).__name__}: {cause}")
                continue
            arrays = peers.restore(part, data, plan.records)
            for k, array in enumerate(arrays):
                self.arrays[f"{prefix}.{k}"] = array
            return PeerRestoreAck(
                host=self.index,
                nbytes=part.nbytes,
                source=None if actor is None else source,
                skipped=tuple(skipped),
                leaves=part.leaves,
            )
        raise FileNotFoundError(
            f"host {self.index} found no good copy of its part of step {plan.step}: "
            + "; ".join(skipped)
        )
