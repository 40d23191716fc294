"""Loads that run in the background (``load_async``): checked on the caller's thread, read on
the runtime's load thread with the options in force at the call, awaited through a
:class:`LoadHandle`."""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from concurrent import futures
from typing import TypeVar

from milepost import _hosts, _options, _progress
from milepost._checkpoint._background import LOADS
from milepost._checkpoint._handle import Handle
from milepost._errors import CheckpointNotFoundError
from milepost.workers import StoragePath

T = TypeVar("T")


class LoadHandle(Handle[T]):
    """A load running in the background (``milepost.load_async``,
    ``Checkpointer.load_async``). ``result()`` waits for it and returns what ``load`` would
    have returned, or re-raises its failure on your thread; ``done()`` never waits;
    ``add_done_callback(fn)`` calls ``fn(handle)`` when it ends.

    >>> handle = mp.load_async("/ckpt/200", abstract_state)
    >>> step_fn = jax.jit(train_step).lower(abstract_state, batch).compile()  # meanwhile
    >>> handle
    LoadHandle('/ckpt/200', running: 96.0 MiB of 512.0 MiB read, 0.3 s)
    >>> state = handle.result()      # waits for the reads; re-raises a failure
    >>> handle
    LoadHandle('/ckpt/200', loaded: 512.0 MiB in 0.61 s (880 MB/s))
    """

    _doing = "load of"
    _moved = "read"
    _ended = "loaded"

    def _attach(self, op: _progress.Operation) -> None:
        """The load's operation started (on the load thread): its bytes are what the repr
        shows. Only the first counts (a load's own steps may open more)."""
        if self._op is None:
            self._op = op

    def _state(self) -> str:
        if not self._future.running() and not self._future.done():
            return "queued: loads run one after another"
        return super()._state()


def start_load(where: StoragePath, read: Callable[[], T]) -> LoadHandle[T]:
    """Check on the caller's thread what is cheap to check (the path can be used by every
    controller process, and exists), then run ``read`` on the runtime's load thread, after the
    loads started before it, with the options in force now; its handle."""
    options = _options.current()
    timeout = options.async_.timeout_secs
    group = _hosts.check_storage(_hosts.host_group_for([]), where)
    # Decided by the primary, so that every controller process raises it here, or none does.
    _hosts.shared(group, f"load-async:{where}", lambda: _require_path(where), timeout)
    context = contextvars.copy_context()  # the options (a Context) in force at the call
    handle: LoadHandle[T] = LoadHandle(where, futures.Future())  # the job's future, below

    def run() -> T:
        with _progress.watching(handle._attach):
            return read()

    handle._future = LOADS.submit(str(where), lambda: context.run(run), timeout)
    return handle


def _require_path(where: StoragePath) -> None:
    if not where.exists():
        raise CheckpointNotFoundError(
            f"no checkpoint at {where}: the path does not exist. Check the path or the step."
        )
