"""What a checkpointable's handler is told about the save or load it is part of, the
background part of a save in the one form every layer uses (a pending write), and what a
background part hands to the commit (a written tree)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from milepost._options import Options
from milepost.colocated import HostGroup
from milepost.workers import PendingWrite, SaveAck, StoragePath
from milepost.workers import format as fmt


@dataclass(frozen=True)
class SaveCall:
    """What a handler gets to know about the save it is part of."""

    options: Options
    group: HostGroup
    copy: bool
    """Stage a copy of the data before returning (``save_async``); False: a blocking save, the
    caller's buffers stay untouched until the commit."""
    check: Callable[[str, Any], None] | None = None
    """On the process that commits, on local disks: raises if the save's workspace is no longer
    its own (removed or replaced from outside), saying at which stage. A handler calls it once
    its data landed, before it writes what describes them, with its folder, whose files must
    then stay until the commit: ``check("after the data writes", directory)``."""
    written: list[WrittenTree] = field(default_factory=list, repr=False, compare=False)
    """Where a pytree's pending write puts the tree once its data is durable (on the process
    that commits), for the commit to write its format files and merge its databases: a handler
    that wraps another's pending write and ignores what its ``wait`` returns still gets its
    tree committed."""


@dataclass(frozen=True)
class LoadCall:
    """What a handler gets to know about the load it is part of."""

    options: Options
    group: HostGroup
    partial: bool = False


@dataclass(frozen=True)
class WrittenTree:
    """A pytree whose data every host wrote and made durable, put by its pending write's
    ``wait`` (on the process that commits) in ``SaveCall.written`` for the commit, which writes
    its format files and merges its databases (``_commit``): ``files`` describe it, ``acks``
    are every writer's."""

    directory: StoragePath
    files: fmt.TreeFiles
    acks: list[SaveAck]


class Deferred:
    """A background part that writes nothing until waited for: ``wait`` runs ``fn`` once (a
    second ``wait`` returns or raises the same); ``settle`` has nothing in flight to wait for."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn: Callable[[], Any] | None = fn
        self._lock = threading.Lock()
        self._outcome: tuple[bool, Any] | None = None

    def wait(self, timeout: float | None = None) -> Any:
        with self._lock:
            if self._outcome is None:
                assert self._fn is not None
                try:
                    self._outcome = (True, self._fn())
                except BaseException as e:
                    self._outcome = (False, e)
                self._fn = None
        ok, value = self._outcome
        if not ok:
            raise value
        return value

    def settle(self, timeout: float | None = None) -> None:
        return None


def as_pending(part: PendingWrite[Any] | Callable[[], Any] | None) -> PendingWrite[Any] | None:
    """A handler's (or a stateful checkpointable's) background part as a pending write: plain
    callables, the simple form user code may return, become :class:`Deferred`."""
    if part is None or isinstance(part, PendingWrite):
        return part
    if callable(part):
        return Deferred(part)
    raise TypeError(
        f"a checkpointable's save returned {type(part).__name__}; it must return None, a callable "
        "to run in the background, or a PendingWrite (wait(timeout) and settle(timeout))"
    )
