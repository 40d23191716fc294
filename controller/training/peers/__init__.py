"""The peer tier of a Checkpointer: steps kept in the nodes' memory and on peer hosts, and a lost
host recovered from there. Its options and report (``_options``: :class:`PeerTier`,
:class:`Recovery`) and the one runner that decides what to keep and what to restore
(``_runner``); the runner reaches the hosts through a ``milepost.colocated.PeerTransport``."""

from milepost.training.peers._options import PeerTier, Recovery, run_name
from milepost.training.peers._runner import PeerTierRunner

__all__ = ["PeerTier", "PeerTierRunner", "Recovery", "run_name"]
