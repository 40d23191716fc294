"""What the caller holds of a call that finishes in the background (a ``save_async``, a
``load_async``): wait for its outcome, re-raise its failure on the caller's thread, be called
back when it ends, and show how far it got."""

from __future__ import annotations

from collections.abc import Callable
from concurrent import futures
from typing import Any, Generic, Self, TypeVar

from milepost import _progress, _views

T = TypeVar("T")


class Handle(Generic[T]):
    """The part of a call that runs in the background, by the path it is about."""

    _doing = "call on"
    """What the call does, before the path in messages: ``'save to'``, ``'load of'``."""
    _moved = "moved"
    """What happens to its bytes while it runs: ``'written'``, ``'read'``."""
    _ended = "done"
    """Its state once it succeeded: ``'committed'``, ``'loaded'``."""

    def __init__(
        self, path: Any, future: futures.Future[T], operation: _progress.Operation | None = None
    ) -> None:
        self.path = path
        """The checkpoint it saves or loads (a save's final path, not its temporary one)."""
        self._future = future
        self._op = operation

    def done(self) -> bool:
        """Whether it has ended (succeeded or failed); never waits."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> T:
        """Wait for it (at most ``timeout`` seconds; None: as long as it takes) and return its
        result, or re-raise its failure. ``TimeoutError`` if it is still running then (it goes
        on: call again to wait more)."""
        try:
            return self._future.result(timeout)
        except futures.TimeoutError as e:
            raise TimeoutError(
                f"the {self._doing} {self.path} did not finish within {timeout}s; it is still "
                "running"
            ) from e

    def add_done_callback(self, fn: Callable[[Self], Any]) -> None:
        """Call ``fn(self)`` once it succeeded or failed (at once if it already has), on the
        thread that finished it. Exceptions ``fn`` raises are logged, not raised. As with
        ``concurrent.futures``, :meth:`result` may return while that thread still runs the
        callbacks."""
        self._future.add_done_callback(lambda _: fn(self))

    def _state(self) -> str:
        op = self._op
        if not self._future.done():
            if op is None or op.total <= 0:
                return "running" if op is None else f"running, {op.seconds:.1f} s"
            return (
                f"running: {_progress.human_bytes(op.done)} of "
                f"{_progress.human_bytes(op.total)} {self._moved}, {op.seconds:.1f} s"
            )
        error = self._future.exception()
        if error is None:
            return self._ended + (
                f": {op.summary()}" if op is not None and op.ended is not None else ""
            )
        return f"failed: {type(error).__name__}: {error}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, {_views.printable(self._state())})"

    def _repr_html_(self) -> str:
        return _views.html_fields(
            type(self).__name__, {"path": str(self.path), "state": self._state()}
        )
