"""What a user gives and gets of the peer tier: its options (:class:`PeerTier`), what a recovery
did (:class:`Recovery`), and the folder name every Checkpointer of a root shares (``run_name``)."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

from milepost.colocated import Slice
from milepost.workers import check, peers


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
    the one being saved. ``Checkpointer.close()`` removes the run's folders from the nodes'
    memory unless ``keep_on_close``."""

    every_n_steps: int = 1
    """Keep every n-th step (the steps ``save`` is called with, counted from 0)."""
    copies: int = 1
    """Copies of each host's part on other nodes (the slice needs hosts on copies + 1 nodes);
    0 keeps each part on its own node only (it survives its host's process, not its node)."""
    path: str = peers.DEFAULT_FOLDER
    """The folder on each node (node-local memory, one per user by default); ``{user}``
    becomes the user name of each host's process, ``{node}`` the node's id."""
    timeout_secs: float | None = None
    """Bounds each wait on the hosts (None: the Checkpointer's timeout)."""
    node: str | None = None
    """In a multi-controller job: this process's node name (None: its host name). Processes of
    one node share its folder and never keep each other's copies. A slice's hosts use their Ray
    node ids."""
    keep_on_close: bool = False
    """Keep the run's folders in the nodes' memory when the Checkpointer closes, for a restarted
    job or controller to recover from (they stay until ``milepost peers clear`` or a later
    Checkpointer of the root that does not keep them closes). False: ``close()`` removes them."""

    def __post_init__(self) -> None:
        check.integer(self.every_n_steps, "PeerTier.every_n_steps", minimum=1)
        check.integer(self.copies, "PeerTier.copies", minimum=0)
        check.text(self.path, "PeerTier.path")
        check.number(self.timeout_secs, "PeerTier.timeout_secs", positive=True, optional=True)
        if self.node is not None:
            check.text(self.node, "PeerTier.node")
        check.flag(self.keep_on_close, "PeerTier.keep_on_close")
        if not self.path.startswith("/"):
            raise ValueError(
                f"PeerTier.path={self.path!r} is not an absolute local folder; give a folder on "
                "each node's memory, e.g. /dev/shm/milepost-{user}"
            )


@dataclasses.dataclass(frozen=True)
class Recovery:
    """What :meth:`Checkpointer.recover` did: the slice, the restored state and its step, and
    where the bytes came from."""

    slice: Slice | None
    """The slice holding the state: the new one ``recover(lost)`` started, or the one the
    ``abstract_state`` is placed on (None in a multi-controller job or one process, whose
    processes are the job's own)."""
    state: Any
    """The restored state: on the new slice after ``recover(lost)``, else where
    ``abstract_state`` placed it."""
    step: int
    """The step it was restored from."""
    tier: str
    """``"peers"`` (node memory), ``"local"`` or ``"durable"``."""
    bytes_by_source: dict[str, int]
    """Bytes restored from ``own node``, ``peer`` memory, or the checkpoint on storage."""
    notes: tuple[str, ...]
    """Why a copy or a tier was passed over, in order."""

    def __repr__(self) -> str:
        moved = ", ".join(f"{k} {v}" for k, v in self.bytes_by_source.items())
        return f"Recovery(step {self.step} from {self.tier}; bytes: {moved})"


def run_name(root: str) -> str:
    """The folder name of a run's peer tier: the same for every Checkpointer of ``root`` (a
    restarted controller finds its run's parts by it)."""
    return "run-" + hashlib.sha256(root.encode()).hexdigest()[:16]
