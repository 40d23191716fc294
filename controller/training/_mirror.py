"""The mirror of a local tier: each step committed locally is copied to the durable root in
the background (``milepost.copy``: each host copies the files it wrote), oldest first, and
becomes durable once that copy commits. A mirror that fails or times out keeps the local step
and is reported by the next call (:class:`MirrorError`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from milepost import _copy, _options
from milepost.training._errors import MirrorError
from milepost.training._retention import Retention
from milepost.training._state import StepState
from milepost.training._worker import Worker

log = logging.getLogger("milepost.training")


class Mirror:
    def __init__(
        self,
        state: StepState,
        local: Path,
        root: Any,
        retention: Retention,
        timeout: float,
        options: _options.Options,
    ) -> None:
        self.state = state
        self.local = local
        self.root = root
        self.retention = retention
        self.timeout = timeout
        self.options = options
        """The options when the Checkpointer was opened (the mirror's copies use them)."""
        self._worker = Worker(self._next, f"mirror:{getattr(root, 'name', root)}")

    def request(self, step: int, group: Any) -> None:
        """Mirror the local ``step`` (whose files ``group``'s hosts wrote) after those before
        (callers holding ``state.cond`` make it part of their change)."""
        with self.state.cond:
            self.state.mirrors[step] = group
        self._worker.submit()

    def resume(self, group: Any) -> None:
        """Mirror the steps only in the local tier (a mirror that did not finish before the
        last run ended), oldest first."""
        with self.state.cond:
            unmirrored = sorted(set(self.state.local) - set(self.state.durable))
        for step in unmirrored:
            log.warning("step %s is only in %s; mirroring it to %s", step, self.local, self.root)
            self.request(step, group)

    def _local_step(self, step: int) -> Any:
        assert self.retention.fast is not None
        return self.retention.fast.step(step)

    def stop(self, timeout: float) -> None:
        self._worker.stop(timeout)

    def _next(self) -> None:
        """Mirror the oldest local step waiting for it (on the mirror thread)."""
        state = self.state
        with state.cond:
            if not state.mirrors:
                return
            step, group = next(iter(state.mirrors.items()))
            metrics = state.local.get(step, {})
            done = step in state.durable
        lease_secs = self.options.saving.lease_secs
        try:
            if not done:
                # A mirror a killed process left may still hold its lease: wait for it to expire.
                _copy.copy_with(
                    group,
                    self._local_step(step),
                    self.retention.durable.step(step),
                    overwrite=False,
                    timeout=self.timeout,
                    options=self.options,
                    wait_for_writer_secs=min(self.timeout, 1.5 * lease_secs),
                )
        except Exception as e:
            log.error(
                "mirroring step %s to %s failed: %s: %s", step, self.root, type(e).__name__, e
            )
            with state.cond:  # one change: a waiter sees the failure with the mirror's end
                state.unmirrored.add(step)
                del state.mirrors[step]
                state.fail(MirrorError(step, self.local, self.root, e))
            return
        log.info("mirrored step %s to %s", step, self.root)
        with state.cond:  # one change: durable, and retention asked for
            state.durable[step] = metrics
            del state.mirrors[step]
            self.retention.request()
            state.cond.notify_all()
