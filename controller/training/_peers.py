"""The peer tier of a Checkpointer on a slice: each step kept in the hosts' node memory and on
peers, and a lost host recovered from there.

The controller keeps what it needs to rebuild a step (the tree's structure, each array's shape,
dtype and sharding, the leaves it holds itself) and which save wrote it (its token); the bytes
stay on the hosts. A recovery asks the new slice's hosts what their node folders hold, takes
the newest step whose every part has a copy from that one save on a live node, and has each host
rebuild its arrays from its own node's copy or a peer's. When no step can be rebuilt so, or a
rebuild fails (a copy damaged, a second host lost), the step comes from the Checkpointer's
local tier or durable root instead, and the recovery says so.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from milepost.colocated import (
    AbstractArray,
    HostError,
    RemoteArray,
    Slice,
    SlicePeers,
    SliceSharding,
)
from milepost.workers import check, dtype_of, peers

log = logging.getLogger("milepost.training")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PeerTier:
    """Keep steps in the slice's node memory and on peer hosts, to recover a lost host without
    reading durable storage.

    >>> ckpt = Checkpointer("gs://b/run", save_policy=FixedInterval(interval=1000),
    ...                     peers=PeerTier(every_n_steps=50, copies=1))

    Each host writes its shards of every ``every_n_steps``-th step into ``path`` on its own node
    (a RAM disk; ``{node}`` in it is replaced by the node's Ray id, for nodes that share a
    machine) and sends ``copies`` copies to hosts on other nodes. The durable root keeps its own
    save policy. The tier holds two steps of each part at most: the newest recoverable one, and
    the one being saved."""

    every_n_steps: int = 1
    """Keep every n-th step (the steps ``save`` is called with, counted from 0)."""
    copies: int = 1
    """Copies of each host's part on other nodes (the slice needs hosts on copies + 1 nodes);
    0 keeps each part on its own node only (it survives its host's process, not its node)."""
    path: str = "/dev/shm/milepost"
    """The folder on each node (node-local memory); ``{node}`` becomes the node's id."""
    timeout_secs: float | None = None
    """Bounds each wait on the hosts (None: the Checkpointer's timeout)."""
    node: str | None = None
    """In a multi-controller job: this process's node name (None: its host name). Processes of
    one node share its folder and never keep each other's copies. A slice's hosts use their Ray
    node ids."""

    def __post_init__(self) -> None:
        check.integer(self.every_n_steps, "PeerTier.every_n_steps", minimum=1)
        check.integer(self.copies, "PeerTier.copies", minimum=0)
        check.text(self.path, "PeerTier.path")
        check.number(self.timeout_secs, "PeerTier.timeout_secs", positive=True, optional=True)
        if self.node is not None:
            check.text(self.node, "PeerTier.node")
        if not self.path.startswith("/"):
            raise ValueError(
                f"PeerTier.path={self.path!r} is not an absolute local folder; give a folder on "
                "each node's memory, e.g. /dev/shm/milepost"
            )


@dataclasses.dataclass(frozen=True)
class Recovery:
    """What :meth:`Checkpointer.recover` did: the new slice, the restored state and its step,
    and where the bytes came from."""

    slice: Slice | None
    """The new slice (None in a multi-controller job, whose processes are the job's own)."""
    state: Any
    step: int
    tier: str
    """``"peers"`` (node memory), ``"local"`` or ``"durable"``."""
    bytes_by_source: dict[str, int]
    """Bytes restored from ``own node``, ``peer`` memory, or the checkpoint on storage."""
    notes: tuple[str, ...]
    """Why a copy or a tier was passed over, in order."""

    def __repr__(self) -> str:
        moved = ", ".join(f"{k} {v}" for k, v in self.bytes_by_source.items())
        return f"Recovery(step {self.step} from {self.tier}; bytes: {moved})"


@dataclasses.dataclass(frozen=True)
class _Saved:
    """What the controller keeps of one peer save."""

    token: str
    treedef: Any
    slots: tuple[int | None, ...]
    """Per leaf: its array's place in ``records``, or None for a leaf kept here."""
    records: tuple[peers.ArrayRecord, ...]
    kept: dict[int, Any]
    """The leaves this controller holds itself (NumPy arrays, scalars), by leaf."""


def run_name(root: str) -> str:
    """The folder name of a run's peer tier: the same for every Checkpointer of ``root``."""
    return "run-" + hashlib.sha256(root.encode()).hexdigest()[:16]


class PeerTierRun:
    """The controller's side of a peer tier for one Checkpointer."""

    def __init__(self, tier: PeerTier, run: str, timeout: float) -> None:
        self.tier = tier
        self.run = run
        self.timeout = tier.timeout_secs if tier.timeout_secs is not None else timeout
        self._saved: dict[int, _Saved] = {}
        self._pending: Any = None
        self._recoverable: int | None = None

    def close(self) -> None:
        """Nothing runs here between calls (the hosts own their background work)."""

    def save(self, step: int, tree: Any) -> int:
        """Copy ``tree``'s arrays to host memory on every host (returns then, with the bytes
        staged); parts and copies are written behind."""
        import jax

        self.finish()
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        arrays = [x for x in leaves if isinstance(x, RemoteArray)]
        if not arrays:
            raise ValueError(
                "the peer tier keeps the arrays of a slice (Slice.start / Slice.connect), and "
                "this state holds none: in one process or a multi-controller job it is not "
                "supported yet; save a slice's RemoteArrays, or drop peers= (a local tier, "
                "local=, keeps steps on a fast disk)"
            )
        group = arrays[0].__milepost_host_group__
        slots: list[int | None] = []
        kept: dict[int, Any] = {}
        records: list[peers.ArrayRecord] = []
        for k, x in enumerate(leaves):
            if isinstance(x, RemoteArray):
                slots.append(len(records))
                records.append(peers.record_of(x, x.sharding.milepost_spec))
            else:
                slots.append(None)
                kept[k] = np.array(x, copy=True) if isinstance(x, np.ndarray) else x
        keep = [s for s in (self._recoverable, step) if s is not None]
        for old in [s for s in self._saved if s not in keep]:  # the hosts remove them now
            del self._saved[old]
        pending, staged = SlicePeers(group, self.tier.path, self.run).save(
            step, arrays, self.tier.copies, self.timeout, keep
        )
        self._saved[step] = _Saved(pending.token, treedef, tuple(slots), tuple(records), kept)
        self._pending = pending
        return staged

    def finish(self) -> None:
        """Wait for the last save's parts and copies (a HostError if a host failed them); then
        that step is the newest recoverable one."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        pending.wait(self.timeout)
        self._recoverable = pending.step
        log.debug("step %s is kept in node memory and on peers", pending.step)

    # -- recovery -------------------------------------------------------------------------
    def recover(
        self,
        old: Slice,
        fallback: Callable[[Any], tuple[int, Any, str, int]],
        newest_stored: int | None,
    ) -> Recovery:
        """A new slice of ``old``'s topology, with the newest step every part of which has a
        good copy; ``fallback(abstract)`` loads the newest stored step instead (step,
        state, tier, bytes) when that is newer, or when no step can be rebuilt from memory. A
        host lost during the recovery starts it again on another new slice (a few times)."""
        self._pending = None  # the old slice's work is gone with it
        t0 = time.monotonic()
        notes: list[str] = []
        for _attempt in range(3):
            new = old.recover(refill=False)  # standby hosts start again after the restore
            try:
                done = self._from_memory(new, newest_stored, notes, t0)
            except HostError as e:
                if new.healthy:
                    raise
                notes.append(f"a host was lost during the recovery ({e}); starting again")
                log.warning("recovery: %s", notes[-1])
                old = new
                continue
            if done is not None:
                new.start_standby()
                return done
            step, state, tier, nbytes = fallback(self._abstract(new))
            new.start_standby()
            log.warning("recovered step %s from the %s tier (%s)", step, tier, "; ".join(notes))
            self._recoverable = None
            return Recovery(new, state, step, tier, {tier: nbytes}, tuple(notes))
        raise HostError("the recovery lost a host three times in a row; " + "; ".join(notes[-3:]))

    def _from_memory(
        self, new: Slice, newest_stored: int | None, notes: list[str], t0: float
    ) -> Recovery | None:
        calls = SlicePeers(new.group, self.tier.path, self.run)
        holders: dict[tuple[int, int, str], list[int]] = {}
        for host, parts in enumerate(calls.held(self.timeout)):
            for part in parts:
                holders.setdefault((part.step, part.owner, part.token), []).append(host)
        if not self._saved:
            notes.append("the peer tier holds no step this Checkpointer saved")
        for step in sorted(self._saved, reverse=True):
            saved = self._saved[step]
            if newest_stored is not None and newest_stored > step:
                notes.append(f"the stored step {newest_stored} is newer than step {step}")
                return None
            sources: list[list[int | None]] = []
            for owner in range(new.hosts):
                found = holders.get((step, owner, saved.token), [])
                sources.append(
                    ([None] if owner in found else []) + [h for h in found if h != owner]
                )
            missing = [o for o, s in enumerate(sources) if not s]
            if missing:
                notes.append(f"step {step}: no copy of the parts of hosts {missing} survives")
                continue
            try:
                arrays, acks = calls.restore(
                    step, saved.token, saved.records, sources, self.timeout
                )
            except HostError as e:
                if not new.healthy:
                    raise
                notes.append(f"step {step}: rebuilding it from node memory failed: {e}")
                log.warning("recovery: %s", notes[-1])
                continue
            own = sum(a.nbytes for a in acks if a.source is None)
            moved = sum(a.nbytes for a in acks if a.source is not None)
            notes.extend(f"host {a.host}: passed over {s}" for a in acks for s in a.skipped)
            self._recoverable = step
            for later in [s for s in self._saved if s > step]:
                del self._saved[later]
            log.info(
                "recovered step %s from node memory in %.1fs: %d bytes from the hosts' own "
                "nodes, %d from peers (to hosts %s)",
                step,
                time.monotonic() - t0,
                own,
                moved,
                [a.host for a in acks if a.source is not None],
            )
            state = self._unflatten(saved, arrays)
            return Recovery(
                new, state, step, "peers", {"own node": own, "peer": moved}, tuple(notes)
            )
        return None

    def _abstract(self, new: Slice) -> Any:
        """The newest saved tree as an abstract tree on ``new`` (for a load from storage)."""
        if not self._saved:
            return None
        import jax

        saved = self._saved[max(self._saved)]
        leaves = [
            saved.kept[k]
            if slot is None
            else AbstractArray(
                saved.records[slot].shape,
                dtype_of(saved.records[slot].dtype),
                SliceSharding(new.group, saved.records[slot].sharding),
            )
            for k, slot in enumerate(saved.slots)
        ]
        return jax.tree_util.tree_unflatten(saved.treedef, leaves)

    @staticmethod
    def _unflatten(saved: _Saved, arrays: list[RemoteArray]) -> Any:
        import jax

        leaves = [
            (np.array(saved.kept[k]) if isinstance(saved.kept[k], np.ndarray) else saved.kept[k])
            if slot is None
            else arrays[slot]
            for k, slot in enumerate(saved.slots)
        ]
        return jax.tree_util.tree_unflatten(saved.treedef, leaves)
