"""Preemption requests: the signals a :class:`Preemption` policy listens to, and JAX's
preemption sync service when a multi-process job runs it.

Signal handlers only count (they may run at any point of the main thread); ``should_save``
compares the count with the requests a save has already served. With JAX's service (it owns
SIGTERM and agrees on a step across processes), every process asks it at every step.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from milepost.colocated import preemption_service_running
from milepost.training._policies import preemption_signals

log = logging.getLogger("milepost.training")


class PreemptionWatch:
    """Counts preemption requests for a save policy; :meth:`close` restores the handlers."""

    def __init__(self, policy: Any) -> None:
        self.seen = 0
        """Requests so far (signals, and :meth:`request`)."""
        self.served = 0
        """Requests a save has served."""
        self._previous: dict[int, Any] = {}
        signals = preemption_signals(policy)
        self.jax_service = signal.SIGTERM in signals and preemption_service_running()
        for sig in signals:
            if sig == signal.SIGTERM and self.jax_service:
                continue  # JAX's preemption service owns SIGTERM and agrees on the step
            self._install(sig)

    def _install(self, sig: int) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.warning(
                "the Checkpointer was opened off the main thread, so it cannot handle "
                "signal %s; call ckpt.preempt() from your own handler instead",
                signal.Signals(sig).name,
            )
            return
        previous = signal.getsignal(sig)

        def handler(signum: int, frame: Any) -> None:
            self.seen += 1
            if callable(previous):
                previous(signum, frame)

        signal.signal(sig, handler)
        self._previous[sig] = previous

    def request(self) -> None:
        """A request from the program itself (what a signal handler does)."""
        self.seen += 1

    def reached_sync_point(self, step: int) -> bool:
        """With JAX's service: whether every process is to save at ``step`` (collective: every
        process asks at every step)."""
        if not self.jax_service:
            return False
        from jax.experimental import multihost_utils

        return bool(multihost_utils.reached_preemption_sync_point(step))

    def close(self) -> None:
        """Put the signal handlers back (from the main thread)."""
        if threading.current_thread() is threading.main_thread():
            for sig, previous in self._previous.items():
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
            self._previous.clear()
