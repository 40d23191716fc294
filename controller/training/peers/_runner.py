"""The peer tier of a Checkpointer: one runner over the transport its state's hosts use (a slice's
Ray hosts, or this job's processes: ``milepost.colocated``'s ``PeerTransport``).

The runner keeps what it needs to rebuild each kept step (the tree's structure, each array's
shape, dtype and sharding, the leaves that are not arrays) and which save wrote it (its token);
the bytes stay on the hosts. A recovery asks the hosts what their node folders hold, takes the
newest step every part of which has a copy of one save on a live node, orders each part's
sources (its own node first, then the hosts holding copies on other nodes) and has every host
rebuild its arrays. When no step can be rebuilt so, or a rebuild fails (a copy damaged, a second
host lost), the step comes from the Checkpointer's local tier or durable root instead, and the
recovery's notes say why.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from milepost import _checkpoint, _hosts
from milepost.colocated import (
    HostError,
    HostGroup,
    PeerRestoreAck,
    PeerTransport,
    ProcessPeers,
    RayHostGroup,
    Slice,
    SlicePeers,
    choose_peers,
)
from milepost.training.peers._options import PeerTier, Recovery, run_name
from milepost.workers import check, peers

log = logging.getLogger("milepost.training")

FromStorage = Callable[[Any], tuple[int, Any, str, int]]
"""A recovery's fallback: the newest stored step loaded as the abstract tree given (step,
state, tier, bytes)."""
Restored = tuple[Any, int, str, dict[str, int]]
"""(state, step, tier, bytes by source): a Recovery's fields but its slice and notes."""


@dataclasses.dataclass(frozen=True)
class _Saved:
    """What the runner keeps of one peer save."""

    token: str
    treedef: Any
    slots: tuple[int | None, ...]
    """Per leaf: its array's place in ``records``, or None for a leaf that is not an array."""
    records: tuple[peers.ArrayRecord, ...]
    kept: dict[int, Any]
    """The leaves that are not arrays (NumPy arrays copied, scalars), by leaf."""


class PeerTierRunner:
    """Keeps a Checkpointer's steps in node memory, and recovers from there."""

    def __init__(self, tier: PeerTier, root: str, timeout: float) -> None:
        self.tier = tier
        self.run = run_name(root)
        self.timeout = tier.timeout_secs if tier.timeout_secs is not None else timeout
        self._transport: PeerTransport | None = None
        self._saved: dict[int, _Saved] = {}
        self._pending: int | None = None
        self._recoverable: int | None = None

    def due(self, step: int) -> bool:
        return step % self.tier.every_n_steps == 0

    def _transport_for(self, group: HostGroup) -> PeerTransport:
        """The transport of ``group``'s hosts: a slice's, else this job's processes' (made at
        the first use; a slice's again for each new slice)."""
        on_slice = isinstance(group, RayHostGroup)
        current = self._transport
        if current is not None:
            if current.group is group or not (on_slice or current.of_slice):
                return current
            if current.of_slice != on_slice:
                raise ValueError(
                    "this Checkpointer's peer tier keeps "
                    + ("a slice's arrays" if current.of_slice else "this job's own arrays")
                    + "; a Checkpointer keeps the steps of one kind of state"
                )
            # a new slice's: the old one's hosts are gone (or no longer hold this state)
        transport: PeerTransport
        if isinstance(group, RayHostGroup):
            transport = SlicePeers(group, self.tier.path, self.run)
        else:
            transport = ProcessPeers(
                group, self.tier.path, self.run, node=self.tier.node, timeout=self.timeout
            )
        self._transport = transport
        return transport

    # -- saving ---------------------------------------------------------------------------
    def save(self, step: int, state: Any) -> int:
        """Copy ``state``'s arrays to host memory on every host (returns then, with the bytes
        staged); parts and copies are written behind."""
        import jax

        self.finish()
        transport = self._transport_for(
            _hosts.host_group_for(_checkpoint.all_leaves({"state": state}))
        )
        leaves, treedef = jax.tree_util.tree_flatten(state)
        slots: list[int | None] = []
        records: list[peers.ArrayRecord] = []
        arrays: list[Any] = []
        kept: dict[int, Any] = {}
        for k, x in enumerate(leaves):
            record = transport.record(x)
            if record is None:
                slots.append(None)
                kept[k] = np.array(x, copy=True) if isinstance(x, np.ndarray) else x
            else:
                slots.append(len(records))
                records.append(record)
                arrays.append(x)
        if not arrays:
            raise ValueError(
                "the state holds no jax.Array for the peer tier to keep; save the training "
                "state's arrays, or drop peers= from the Checkpointer"
            )
        copies_to = choose_peers(transport.nodes(self.timeout), self.tier.copies)
        keep = [s for s in (self._recoverable, step) if s is not None]
        for old in [s for s in self._saved if s not in keep]:  # the hosts remove them now
            del self._saved[old]
        token, staged = transport.save(
            step, arrays, tuple(kept.items()), copies_to, keep, self.timeout
        )
        self._saved[step] = _Saved(token, treedef, tuple(slots), tuple(records), kept)
        self._pending = step
        return staged

    def finish(self) -> None:
        """Wait for the last save's parts and copies (a HostError if a host failed them); then
        that step is the newest recoverable one."""
        step, self._pending = self._pending, None
        if step is None or self._transport is None:
            return
        self._transport.wait_saved(self.timeout)
        self._recoverable = step
        log.debug("step %s is kept in node memory and on peers", step)

    def close(self) -> None:
        """The hosts remove this run's node folders (unless the tier keeps them)."""
        if self._transport is not None:
            self._transport.close(not self.tier.keep_on_close, self.timeout)

    # -- recovery -------------------------------------------------------------------------
    def check(self, lost: Slice | None, abstract_state: Any) -> None:
        """Refuse a recovery's arguments before anything is waited for."""
        if lost is not None:
            check.instance(lost, "recover(lost)", Slice, "the Slice that lost a host")
            if self._transport is None or not self._transport.of_slice:
                raise ValueError(
                    "this Checkpointer kept no step of a slice, so it knows no tree to recover; "
                    "start a new slice (lost.recover()) and recover(abstract_state=...) onto "
                    "it, or load(step, abstract_state)"
                )
        elif abstract_state is None:
            raise ValueError(
                "recover() without a lost slice restores onto the hosts of abstract_state (this "
                "job's processes, or a slice's): pass abstract_state=, the tree to restore (as "
                "for load)"
            )

    def recover(
        self,
        lost: Slice | None,
        abstract_state: Any,
        fallback: FromStorage,
        newest_stored: int | None,
    ) -> Recovery:
        """The newest step every part of which has a good copy on a live node, restored on a
        new slice of ``lost``'s topology (the steps this runner saved), or, without ``lost``,
        on the hosts ``abstract_state`` is placed on (the steps their node folders hold);
        ``fallback`` loads the newest stored step instead when that is newer, or when no step
        can be rebuilt from memory. A host lost during a slice's recovery starts it again on
        another new slice (a few times)."""
        self._pending = None  # the work in flight is abandoned with its hosts
        t0 = time.monotonic()
        notes: list[str] = []
        if lost is None:
            leaves = _checkpoint.all_leaves({"state": abstract_state})
            transport = self._transport_for(_hosts.host_group_for_abstract(leaves))
            done = self._from_memory(transport, abstract_state, newest_stored, notes, t0)
            if done is None:
                done = self._from_storage(transport, abstract_state, fallback, notes)
            return Recovery(transport.slice, *done, tuple(notes))
        for _attempt in range(3):
            new = lost.recover(refill=False)  # standby hosts start again after the restore
            transport = self._transport_for(new.group)
            try:
                done = self._from_memory(transport, None, newest_stored, notes, t0)
            except HostError as e:
                if new.healthy:
                    raise
                notes.append(f"a host was lost during the recovery ({e}); starting again")
                log.warning("recovery: %s", notes[-1])
                lost = new
                continue
            if done is None:
                done = self._from_storage(transport, None, fallback, notes)
            new.start_standby()
            return Recovery(new, *done, tuple(notes))
        raise HostError("the recovery lost a host three times in a row; " + "; ".join(notes[-3:]))

    def _from_storage(
        self, transport: PeerTransport, abstract: Any, fallback: FromStorage, notes: list[str]
    ) -> Restored:
        step, state, tier, nbytes = fallback(
            abstract if abstract is not None else self._abstract(transport)
        )
        log.warning("recovered step %s from the %s tier (%s)", step, tier, "; ".join(notes))
        self._recoverable = None
        return state, step, tier, {tier: nbytes}

    def _from_memory(
        self,
        transport: PeerTransport,
        abstract: Any,
        newest_stored: int | None,
        notes: list[str],
        t0: float,
    ) -> Restored | None:
        """The newest step the hosts rebuild from node memory: of the saves this runner
        recorded (``abstract`` None), else of those the node folders hold, as ``abstract``."""
        held = transport.held(self.timeout)
        nodes = transport.nodes(self.timeout)
        one, many = ("host", "hosts") if transport.of_slice else ("process", "processes")
        holders: dict[tuple[int, str], dict[int, list[int]]] = {}
        for host, parts in enumerate(held):
            for p in parts:
                holders.setdefault((p.step, p.token), {}).setdefault(p.owner, []).append(host)
        records, place = _records(transport, abstract) if abstract is not None else ([], [])
        if abstract is not None and not any(held):
            notes.append(f"no {one}'s node folder holds a step")
        for step, token, saved in self._candidates(holders, abstract, notes):
            if newest_stored is not None and newest_stored > step:
                notes.append(f"the stored step {newest_stored} is newer than step {step}")
                return None
            owners = holders.get((step, token), {})
            missing = [o for o in range(transport.hosts) if o not in owners]
            if missing:
                notes.append(f"step {step}: no copy of the parts of {many} {missing} survives")
                continue
            sources = [_sources(owners[o], nodes, o) for o in range(transport.hosts)]
            wanted = list(saved.records) if saved is not None else records
            try:
                arrays, acks = transport.restore(step, token, wanted, sources, self.timeout)
            except HostError as e:
                if not transport.healthy:
                    raise
                notes.append(f"step {step}: rebuilding it from node memory failed: {e}")
                log.warning("recovery: %s", notes[-1])
                continue
            state = (
                _unflatten(saved, arrays)
                if saved is not None
                else _fill(abstract, place, arrays, dict(acks[0].leaves))
            )
            return self._restored(step, state, acks, (one, many), notes, t0)
        return None

    def _candidates(
        self, holders: dict[tuple[int, str], Any], abstract: Any, notes: list[str]
    ) -> list[tuple[int, str, _Saved | None]]:
        """The saves to try, newest step first: those this runner recorded (``abstract``
        None), else those the node folders hold."""
        if abstract is not None:
            found: list[tuple[int, str, _Saved | None]] = [(s, t, None) for s, t in holders]
            return sorted(found, key=lambda c: c[0], reverse=True)
        if not self._saved:
            notes.append("the peer tier holds no step this Checkpointer saved")
        return [(s, self._saved[s].token, self._saved[s]) for s in sorted(self._saved)[::-1]]

    def _restored(
        self,
        step: int,
        state: Any,
        acks: list[PeerRestoreAck],
        words: tuple[str, str],
        notes: list[str],
        t0: float,
    ) -> Restored:
        """``step`` restored from node memory: the newest recoverable step from now on."""
        own = sum(a.nbytes for a in acks if a.source is None)
        moved = sum(a.nbytes for a in acks if a.source is not None)
        notes.extend(f"{words[0]} {a.host}: passed over {s}" for a in acks for s in a.skipped)
        self._recoverable = step
        for later in [s for s in self._saved if s > step]:
            del self._saved[later]
        log.info(
            "recovered step %s from node memory in %.1fs: %d bytes from own nodes, %d from "
            "peers (to %s %s)",
            step,
            time.monotonic() - t0,
            own,
            moved,
            words[1],
            [a.host for a in acks if a.source is not None],
        )
        return state, step, "peers", {"own node": own, "peer": moved}

    def _abstract(self, transport: PeerTransport) -> Any:
        """The newest saved tree as an abstract tree on ``transport``'s hosts (for a load from
        storage)."""
        if not self._saved:
            return None
        import jax

        saved = self._saved[max(self._saved)]
        leaves = [
            saved.kept[k] if slot is None else transport.abstract(saved.records[slot])
            for k, slot in enumerate(saved.slots)
        ]
        return jax.tree_util.tree_unflatten(saved.treedef, leaves)


def _sources(holders: Sequence[int], nodes: Sequence[str], owner: int) -> list[int | None]:
    """Where ``owner`` takes its part from, in order: its own node's folder (None) when a host
    there holds a copy, then the hosts holding one on other nodes, in index order."""
    own: list[int | None] = [None] if any(nodes[h] == nodes[owner] for h in holders) else []
    return own + [h for h in holders if nodes[h] != nodes[owner]]


def _records(transport: PeerTransport, abstract: Any) -> tuple[list[peers.ArrayRecord], list[int]]:
    """The records of ``abstract``'s arrays, and the leaves they are."""
    import jax

    records: list[peers.ArrayRecord] = []
    place: list[int] = []
    for k, x in enumerate(jax.tree_util.tree_leaves(abstract)):
        record = transport.record(x)
        if record is not None:
            records.append(record)
            place.append(k)
    return records, place


def _unflatten(saved: _Saved, arrays: list[Any]) -> Any:
    import jax

    leaves = [
        (np.array(saved.kept[k]) if isinstance(saved.kept[k], np.ndarray) else saved.kept[k])
        if slot is None
        else arrays[slot]
        for k, slot in enumerate(saved.slots)
    ]
    return jax.tree_util.tree_unflatten(saved.treedef, leaves)


def _fill(abstract: Any, place: list[int], arrays: list[Any], values: dict[int, Any]) -> Any:
    """``abstract`` with its arrays restored (at ``place``) and its other leaves from the part
    (those a part does not keep stay as given)."""
    import jax

    leaves, treedef = jax.tree_util.tree_flatten(abstract)
    out = [values.get(k, leaf) for k, leaf in enumerate(leaves)]
    for k, array in zip(place, arrays, strict=True):
        out[k] = array
    return jax.tree_util.tree_unflatten(treedef, out)
