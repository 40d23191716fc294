"""The peer tier's owner in a Checkpointer: which runner keeps the steps (a slice's, or this
job's processes'), made at its first use, and the checks a recovery's arguments pass."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from milepost import _checkpoint, _hosts
from milepost.colocated import HostGroup, RayHostGroup, Slice
from milepost.training._peers import PeerTier, PeerTierRun, Recovery, run_name
from milepost.training._peers_mc import ProcessPeerTierRun
from milepost.workers import check


class PeerTiers:
    """Keeps a Checkpointer's steps in node memory through the runner its state needs."""

    def __init__(self, tier: PeerTier, root: str, timeout: float) -> None:
        self.tier = tier
        self._run = run_name(root)
        self._timeout = timeout
        self._runner: PeerTierRun | ProcessPeerTierRun | None = None

    def due(self, step: int) -> bool:
        return step % self.tier.every_n_steps == 0

    def save(self, step: int, state: Any) -> None:
        group = _hosts.host_group_for(_checkpoint.all_leaves({"state": state}))
        self._runner_for(group).save(step, state)

    def finish(self) -> None:
        if self._runner is not None:
            self._runner.finish()

    def close(self) -> None:
        if self._runner is not None:
            self._runner.close()

    def check(self, lost: Slice | None, abstract_state: Any) -> None:
        """Refuse a recovery's arguments before anything is waited for."""
        if lost is not None:
            check.instance(lost, "recover(lost)", Slice, "the Slice that lost a host")
            if not isinstance(self._runner, PeerTierRun):
                raise ValueError(
                    "this Checkpointer kept no step of a slice, so it knows no tree to recover; "
                    "start a new slice (lost.recover()) and load(step, abstract_state)"
                )
        elif abstract_state is None:
            raise ValueError(
                "recover() without a lost slice restores this job's processes: pass "
                "abstract_state=, the tree to restore (as for load)"
            )

    def recover(
        self,
        lost: Slice | None,
        abstract_state: Any,
        from_storage: Callable[[Any], tuple[int, Any, str, int]],
        newest_stored: int | None,
    ) -> Recovery:
        if lost is not None:
            assert isinstance(self._runner, PeerTierRun)
            return self._runner.recover(lost, from_storage, newest_stored)
        leaves = _checkpoint.all_leaves({"state": abstract_state})
        runner = self._runner_for(_hosts.host_group_for_abstract(leaves))
        assert isinstance(runner, ProcessPeerTierRun)
        return runner.recover(abstract_state, from_storage, newest_stored)

    def _runner_for(self, group: HostGroup) -> PeerTierRun | ProcessPeerTierRun:
        on_slice = isinstance(group, RayHostGroup)
        if self._runner is None:
            self._runner = (
                PeerTierRun(self.tier, self._run, self._timeout)
                if on_slice
                else ProcessPeerTierRun(self.tier, self._run, self._timeout, group)
            )
        elif on_slice != isinstance(self._runner, PeerTierRun):
            raise ValueError(
                "this Checkpointer's peer tier keeps "
                + ("a slice's arrays" if not on_slice else "this job's own arrays")
                + "; a Checkpointer keeps the steps of one kind of state"
            )
        return self._runner
