"""Writes that may still land: the one protocol every layer uses for them.

The subtlest rule of a save is that no write lands in a temporary directory after it was
removed. Whoever issues writes returns a :class:`PendingWrite`; after a failure anywhere, the
save *settles* every pending write (waits for it, ignoring its outcome) before removing the
directory. The same protocol is implemented by the engine (a host's TensorStore writes), by
each host group (its hosts' writes), and by each checkpointable's save.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, TypeVar, runtime_checkable

T_co = TypeVar("T_co", covariant=True)


@runtime_checkable
class PendingWrite(Protocol[T_co]):
    """Writes in flight. ``wait`` makes them durable (or raises why not); ``settle`` only waits
    for them to stop, whatever their outcome, so a failed save can clean up safely."""

    def wait(self, timeout: float | None = None) -> T_co:
        """Block until every write is durable and return the outcome; raise on failure (after
        settling, so that nothing lands later), except when ``timeout`` runs out: then
        :class:`StillWritingError` at once, and the caller settles."""
        ...

    def settle(self, timeout: float | None = None) -> None:
        """Block until no write is in flight any more, ignoring failures. Never raises."""
        ...


class Done:
    """A pending write with nothing in flight: ``wait`` returns ``value``."""

    def __init__(self, value: Any = None) -> None:
        self._value = value

    def wait(self, timeout: float | None = None) -> Any:
        return self._value

    def settle(self, timeout: float | None = None) -> None:
        return None


def settle_all(pending: Iterable[PendingWrite[Any] | None], timeout: float | None = None) -> None:
    """Settle each of ``pending`` (None entries skipped); never raises."""
    for p in pending:
        if p is None:
            continue
        try:
            p.settle(timeout)
        except Exception:  # settle must not raise; a broken implementation must not stop the rest
            pass
