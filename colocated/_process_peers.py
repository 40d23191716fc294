"""The peer tier's transport over the processes of a multi-controller job (every process runs the
script), or over the one process: :class:`ProcessPeers` runs in every process, which is both a
controller and the host of its own devices (a :class:`~._peer_transport.PeerTransport`; the
runner that decides is ``milepost.training.peers``).

Each process keeps its own part of a step in its node's folder and sends copies to processes on
other nodes over the job's own sockets (``milepost.workers.peers.PeerServer``, one per process,
started at the first use); the processes agree through the ``jax.distributed`` coordination
service (``MultiControllerHostGroup``): the save's token (the primary's), every process's node
and address, each save's outcome, every process's listing and every process's restore. A part
also keeps the tree's leaves that are not arrays (JSON values), which a restarted job has no
controller to remember.

Every method is collective: every process calls it, in the same order.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import jax

from milepost.colocated._errors import HostError
from milepost.colocated._hostgroup import HostGroup
from milepost.colocated._jax_internals import reachable_address
from milepost.colocated._mcjax import MultiControllerHostGroup
from milepost.colocated._peer_transport import PeerRestoreAck, json_leaves
from milepost.workers import (
    RUNTIME,
    CorruptCheckpointError,
    ShardingSpec,
    dtype_name,
    dtype_of,
    peers,
)

log = logging.getLogger("milepost.peers")


class ProcessPeers:
    """The peer tier of this job's processes (``group``: its host group; node folders named by
    ``folder``, ``run`` and ``node``, this process's node: its host name when None)."""

    of_slice = False
    slice = None
    healthy = True
    """A process that failed makes every process raise the same HostError: none is replaced."""

    def __init__(
        self, group: HostGroup, folder: str, run: str, *, node: str | None, timeout: float
    ) -> None:
        self.group = group
        self.index = jax.process_index()
        self.count = jax.process_count()
        self.node = node or socket.gethostname()
        self.root = peers.run_folder(folder, run, self.node)
        self._timeout = timeout
        self._server: peers.PeerServer | None = None
        self._secret = b""
        self._addresses: list[tuple[str, int]] = []
        self._nodes: list[str] = []
        self._pending: tuple[int, Future[None]] | None = None
        self._last: tuple[peers.Staged, Future[None]] | None = None

    @property
    def hosts(self) -> int:
        return self.count

    def record(self, leaf: Any) -> peers.ArrayRecord | None:
        if not isinstance(leaf, jax.Array | jax.ShapeDtypeStruct):
            return None
        return peers.ArrayRecord(
            shape=tuple(leaf.shape),
            dtype=dtype_name(leaf.dtype),
            sharding=ShardingSpec.from_jax(leaf.sharding),
        )

    def abstract(self, record: peers.ArrayRecord) -> Any:
        return jax.ShapeDtypeStruct(
            record.shape, dtype_of(record.dtype), sharding=record.sharding.to_jax()
        )

    # -- agreement ------------------------------------------------------------------------
    def _gather(
        self, name: str, value: Any, timeout: float, error: BaseException | None = None
    ) -> list[Any]:
        """Every process's ``value``, in every process (a HostError everywhere if one failed;
        ``value`` None in every process: only that agreement)."""
        if isinstance(self.group, MultiControllerHostGroup):
            values = self.group.sync(f"peer-tier:{name}", timeout, error, value=value, doing=name)
            if value is None:  # an agreement only (every process passes None)
                return [None] * self.count
            return list(self.group.broadcast(f"peer-tier:{name}", values, timeout))
        if error is not None and not isinstance(error, Exception):
            raise error  # (Ctrl-C, an exit: not a host's failure)
        if error is not None:  # one process: the same HostError many processes would raise
            raise HostError(
                f"process 0 failed {name}: {type(error).__name__}: {error}", hosts=(0,)
            ) from error
        return [value]

    def _connect(self, timeout: float) -> None:
        """Start this process's server; learn every process's node and address (once)."""
        if self._server is not None:
            return
        secret = os.urandom(16) if self.group.is_primary() else b""
        self._secret = self.group.broadcast("peer-tier:secret", secret, timeout)
        peers.make_run_folder(self.root)
        # listening only on the interface the job's processes reach each other through
        address = reachable_address() if self.count > 1 else "127.0.0.1"
        self._server = peers.PeerServer(
            self.root, self._secret, host=address, timeout=self._timeout
        )
        found = self._gather("hello", (self.node, address, self._server.port), timeout)
        self._nodes = [node for node, _, _ in found]
        self._addresses = [(host, port) for _, host, port in found]

    def nodes(self, timeout: float) -> list[str]:
        self._connect(timeout)
        return list(self._nodes)

    def close(self, remove: bool, timeout: float) -> None:
        """Stop this process's server; remove the run's folder from this node (the last process
        of the node does: ``remove``) or let go of it."""
        if self._server is None:
            return  # this process never used its node's folder
        self._server.close()
        self._server = None
        try:
            if remove:
                peers.remove_run(self.root)
            else:
                peers.release_run(self.root)
        except OSError as e:
            log.warning("peer tier: %s left as it is: %s: %s", self.root, type(e).__name__, e)

    # -- saving ---------------------------------------------------------------------------
    def save(
        self,
        step: int,
        arrays: Sequence[Any],
        leaves: Sequence[tuple[int, Any]],
        copies_to: Sequence[Sequence[int]],
        keep: Sequence[int],
        timeout: float,
    ) -> tuple[str, int]:
        """Copy this process's shards of ``arrays`` to host memory; its part (with ``leaves``)
        and its copies are written behind."""
        self._connect(timeout)
        kept, others = json_leaves(leaves)
        if others:
            k = others[0]
            raise TypeError(
                f"leaf {k} of the state is a {type(dict(leaves)[k]).__name__}: in a "
                "multi-controller job the peer tier keeps jax.Arrays and plain scalars (int, "
                "float, bool, str, None); make it a jax.Array or a scalar"
            )
        token = self.group.broadcast("peer-tier:token", uuid.uuid4().hex, timeout)
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
        future = RUNTIME.pool("peer-tier", 1).submit(
            self._write, staged, set(keep), list(copies_to[self.index]), timeout
        )
        self._pending = (step, future)
        self._last = (staged, future)  # its buffer serves the next save, once written
        return token, int(staged.data.nbytes)

    def _write(
        self, staged: peers.Staged, keep: set[int], chosen: list[int], timeout: float
    ) -> None:
        peers.prune(self.root, keep)
        part = staged.part()
        peers.write(self.root, part, staged.data)
        for j in chosen:
            peers.send_part(
                self._addresses[j],
                self._secret,
                part,
                staged.data,
                timeout,
                f"process {j} (node {self._nodes[j]})",
            )

    def wait_saved(self, timeout: float) -> None:
        """Once every process's part and copies of the last save are written (collective)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        step, future = pending
        error: BaseException | None = None
        try:
            future.result(timeout)
        except BaseException as e:
            error = e
        self._gather(f"saved:{step}", None, timeout, error)

    # -- recovery -------------------------------------------------------------------------
    def held(self, timeout: float) -> list[list[peers.Held]]:
        self._connect(timeout)
        return self._gather("held", peers.listing(self.root), timeout)

    def restore(
        self,
        step: int,
        token: str,
        records: Sequence[peers.ArrayRecord],
        sources: Sequence[Sequence[int | None]],
        timeout: float,
    ) -> tuple[list[Any], list[PeerRestoreAck]]:
        """This process's arrays of ``step`` (from the first good copy ``sources`` names for
        it), and every process's ack; a HostError in every process if one found no good copy."""
        error: BaseException | None = None
        arrays: list[Any] = []
        ack: PeerRestoreAck | None = None
        try:
            arrays, ack = self._restore_own(step, token, records, sources[self.index], timeout)
        except (OSError, CorruptCheckpointError, ValueError) as e:
            error = e
        return arrays, self._gather(f"restored:{step}:{token}", ack, timeout, error)

    def _restore_own(
        self,
        step: int,
        token: str,
        records: Sequence[peers.ArrayRecord],
        sources: Sequence[int | None],
        timeout: float,
    ) -> tuple[list[Any], PeerRestoreAck]:
        """This process's part of ``step``: from this node's folder (None), or from the first
        process that sends a good copy; its arrays built."""
        skipped = []
        for holder in sources:
            try:
                if holder is None:
                    part, data = peers.read(self.root, step, self.index, token)
                else:
                    part, data = peers.fetch_part(
                        self._addresses[holder],
                        self._secret,
                        step,
                        self.index,
                        token,
                        timeout,
                        f"process {holder} (node {self._nodes[holder]})",
                    )
                    peers.write(self.root, part, data)  # this node holds its part again
            except (OSError, CorruptCheckpointError) as e:
                where = "its own node" if holder is None else f"process {holder}"
                skipped.append(f"{where}: {type(e).__name__}: {e}")
                continue
            arrays = peers.restore(part, data, list(records))
            ack = PeerRestoreAck(
                host=self.index,
                nbytes=part.nbytes,
                source=holder,
                skipped=tuple(skipped),
                leaves=part.leaves,
            )
            return arrays, ack
        raise FileNotFoundError(
            f"process {self.index} found no good copy of its part of step {step}: "
            + "; ".join(skipped)
        )
