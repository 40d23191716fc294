"""The peer tier in a multi-controller job (every process runs the script), or in one process.

Each process keeps its own part of a step in its node's folder and sends ``copies`` copies to
processes on other nodes over the job's own sockets (``milepost.workers.peers.PeerServer``);
the processes agree through the ``jax.distributed`` coordination service. A job restarted with
a node replaced calls ``Checkpointer.recover(abstract_state=...)`` in every process: each takes
its part of the newest step every part of which survives, from its own node or from the
process holding a copy, and the leaves that are not arrays from its part.

Every method is collective: every process calls it, in the same order.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from milepost.colocated import (
    HostError,
    HostGroup,
    MultiControllerHostGroup,
    choose_peers,
    reachable_address,
)
from milepost.training._peers import PeerTier, Recovery
from milepost.workers import RUNTIME, CorruptCheckpointError, ShardingSpec, dtype_name, peers

log = logging.getLogger("milepost.training")

_JSON_LEAVES = (bool, int, float, str, type(None))


def _plain(value: Any, k: int) -> Any:
    """A leaf that is not an array, as JSON (what a part can keep)."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, _JSON_LEAVES):
        return value
    raise TypeError(
        f"leaf {k} of the state is a {type(value).__name__}: in a multi-controller job the peer "
        "tier keeps jax.Arrays and plain scalars (int, float, bool, str, None); make it a "
        "jax.Array or a scalar"
    )


class ProcessPeerTierRun:
    """The peer tier of one Checkpointer in this process's job (``group``: its host group)."""

    def __init__(self, tier: PeerTier, run: str, timeout: float, group: HostGroup) -> None:
        import jax

        self.tier = tier
        self.run = run
        self.timeout = tier.timeout_secs if tier.timeout_secs is not None else timeout
        self.group = group
        self.index = jax.process_index()
        self.count = jax.process_count()
        self.node = tier.node or socket.gethostname()
        self.root = peers.run_folder(tier.path, run, self.node)
        self._server: peers.PeerServer | None = None
        self._secret = b""
        self._addresses: list[tuple[str, int]] = []
        self._nodes: list[str] = []
        self._pending: tuple[int, Future[None]] | None = None
        self._last: tuple[peers.Staged, Future[None]] | None = None
        self._recoverable: int | None = None

    # -- agreement ------------------------------------------------------------------------
    def _gather(self, name: str, value: Any, error: BaseException | None = None) -> list[Any]:
        """Every process's ``value``, in every process (a HostError everywhere if one failed;
        ``value`` None in every process: only that agreement)."""
        if isinstance(self.group, MultiControllerHostGroup):
            values = self.group.sync(
                f"peer-tier:{name}", self.timeout, error, value=value, doing=name
            )
            if value is None:  # an agreement only (every process passes None)
                return [None] * self.count
            return list(self.group.broadcast(f"peer-tier:{name}", values, self.timeout))
        if error is not None:
            raise error
        return [value]

    def _connect(self) -> None:
        """Start this process's server; learn every process's node and address (once)."""
        if self._server is not None:
            return
        secret = os.urandom(16) if self.group.is_primary() else b""
        self._secret = self.group.broadcast("peer-tier:secret", secret, self.timeout)
        self.root.mkdir(parents=True, exist_ok=True)
        # listening only on the interface the job's processes reach each other through
        address = reachable_address() if self.count > 1 else "127.0.0.1"
        self._server = peers.PeerServer(self.root, self._secret, host=address, timeout=self.timeout)
        found = self._gather("hello", (self.node, address, self._server.port))
        self._nodes = [node for node, _, _ in found]
        self._addresses = [(host, port) for _, host, port in found]

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    # -- saving ---------------------------------------------------------------------------
    def save(self, step: int, tree: Any) -> int:
        """Copy this process's shards of ``tree`` to host memory; its part and copies are
        written behind."""
        import jax

        self.finish()
        self._connect()
        leaves, _ = jax.tree_util.tree_flatten(tree)
        arrays = [x for x in leaves if isinstance(x, jax.Array)]
        if not arrays:
            raise ValueError(
                "the state holds no jax.Array for the peer tier to keep; save the training "
                "state's arrays, or drop peers= from the Checkpointer"
            )
        kept = tuple(
            (k, _plain(x, k)) for k, x in enumerate(leaves) if not isinstance(x, jax.Array)
        )
        chosen = choose_peers(self._nodes, self.tier.copies)[self.index]
        token = self.group.broadcast("peer-tier:token", uuid.uuid4().hex, self.timeout)
        keep = {s for s in (self._recoverable, step) if s is not None}
        last = self._last
        staged = peers.stage(
            arrays,
            step=step,
            owner=self.index,
            token=token,
            hosts=self.count,
            leaves=kept,
            reuse=last[0].data if last is not None and last[1].done() else None,
        )
        future = RUNTIME.pool("peer-tier", 1).submit(self._write, staged, keep, chosen)
        self._pending = (step, future)
        self._last = (staged, future)  # its buffer serves the next save, once written
        return int(staged.data.nbytes)

    def _write(self, staged: peers.Staged, keep: set[int], chosen: list[int]) -> None:
        peers.prune(self.root, keep)
        part = staged.part()
        peers.write(self.root, part, staged.data)
        for j in chosen:
            peers.send_part(
                self._addresses[j],
                self._secret,
                part,
                staged.data,
                self.timeout,
                f"process {j} (node {self._nodes[j]})",
            )

    def finish(self) -> None:
        """Once every process's part and copies of the last save are written (collective);
        then that step is the newest recoverable one."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        step, future = pending
        error: BaseException | None = None
        try:
            future.result(self.timeout)
        except BaseException as e:
            error = e
        self._gather(f"saved:{step}", None, error)
        self._recoverable = step

    # -- recovery -------------------------------------------------------------------------
    def recover(
        self,
        abstract: Any,
        fallback: Callable[[Any], tuple[int, Any, str, int]],
        newest_stored: int | None,
    ) -> Recovery:
        """Every process's part of the newest step every part of which has a good copy on a
        live node; ``fallback(abstract)`` loads the newest stored step when that is newer, or
        when no step can be rebuilt from node memory (in every process alike)."""
        import jax

        t0 = time.monotonic()
        self._pending = None
        self._connect()
        leaves, treedef = jax.tree_util.tree_flatten(abstract)
        array_at = [k for k, x in enumerate(leaves) if isinstance(x, jax.ShapeDtypeStruct)]
        records = [
            peers.ArrayRecord(
                shape=tuple(leaves[k].shape),
                dtype=dtype_name(leaves[k].dtype),
                sharding=ShardingSpec.from_jax(leaves[k].sharding),
            )
            for k in array_at
        ]
        held = self._gather("held", peers.listing(self.root))
        notes: list[str] = []
        for step, token, sources in self._candidates(held, notes):
            if newest_stored is not None and newest_stored > step:
                notes.append(f"the stored step {newest_stored} is newer than step {step}")
                break
            error: BaseException | None = None
            result: Any = None
            try:
                result = self._restore(step, token, sources[self.index], records)
            except (OSError, CorruptCheckpointError, ValueError) as e:
                error = e
            try:
                outcomes = self._gather(
                    f"restored:{step}:{token}", None if error else result[1], error
                )
            except HostError as e:
                notes.append(f"step {step}: rebuilding it from node memory failed: {e}")
                log.warning("recovery: %s", notes[-1])
                continue
            part, (source, _), arrays = result
            own = sum(nbytes for src, nbytes in outcomes if src is None)
            moved = sum(nbytes for src, nbytes in outcomes if src is not None)
            self._recoverable = step
            values = dict(part.leaves)
            out = list(leaves)
            for k, array in zip(array_at, arrays, strict=True):
                out[k] = array
            for k in range(len(out)):
                if k not in array_at:
                    out[k] = values.get(k, out[k])
            log.info(
                "recovered step %s from node memory in %.1fs (%s): %d bytes from the processes' "
                "own nodes, %d from peers",
                step,
                time.monotonic() - t0,
                "its own node" if source is None else f"process {source}",
                own,
                moved,
            )
            state = jax.tree_util.tree_unflatten(treedef, out)
            return Recovery(
                None, state, step, "peers", {"own node": own, "peer": moved}, tuple(notes)
            )
        if not held or not any(held):
            notes.append("no process's node folder holds a step")
        step, state, tier, nbytes = fallback(abstract)
        log.warning("recovered step %s from the %s tier (%s)", step, tier, "; ".join(notes))
        self._recoverable = None
        return Recovery(None, state, step, tier, {tier: nbytes}, tuple(notes))

    def _candidates(
        self, held: list[list[peers.Held]], notes: list[str]
    ) -> list[tuple[int, str, list[list[int]]]]:
        """The steps every part of which has a copy of one save, newest first, with the
        processes holding a copy of each owner's part (those on the owner's node first)."""
        holders: dict[tuple[int, str], dict[int, list[int]]] = {}
        for process, parts in enumerate(held):
            for p in parts:
                holders.setdefault((p.step, p.token), {}).setdefault(p.owner, []).append(process)
        out = []
        for (step, token), owners in sorted(holders.items(), key=lambda kv: kv[0][0], reverse=True):
            missing = [o for o in range(self.count) if o not in owners]
            if missing:
                notes.append(f"step {step}: no copy of the parts of processes {missing} survives")
                continue
            nodes = self._nodes
            sources = [  # a copy on the owner's own node first
                [p for p in owners[o] if nodes[p] == nodes[o]]
                + [p for p in owners[o] if nodes[p] != nodes[o]]
                for o in range(self.count)
            ]
            out.append((step, token, sources))
        return out

    def _restore(
        self, step: int, token: str, sources: list[int], records: list[peers.ArrayRecord]
    ) -> tuple[peers.Part, tuple[int | None, int], list[Any]]:
        """This process's part of ``step``: from this node's folder, or from the first process
        that sends a good copy; its arrays built."""
        skipped = []
        for holder in sources:
            source: int | None = holder
            try:
                if self._nodes[holder] == self.node:
                    part, data = peers.read(self.root, step, self.index, token)
                    source = None
                else:
                    part, data = peers.fetch_part(
                        self._addresses[holder],
                        self._secret,
                        step,
                        self.index,
                        token,
                        self.timeout,
                        f"process {holder} (node {self._nodes[holder]})",
                    )
                    peers.write(self.root, part, data)  # this node holds its part again
            except (OSError, CorruptCheckpointError) as e:
                where = "its own node" if source is None else f"process {holder}"
                skipped.append(f"{where}: {type(e).__name__}: {e}")
                continue
            arrays = peers.restore(part, data, records)
            return part, (source, part.nbytes), arrays
        raise FileNotFoundError(
            f"process {self.index} found no good copy of its part of step {step}: "
            + "; ".join(skipped)
        )
