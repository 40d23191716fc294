"""Where the bytes of a long operation are counted as they move, for its progress bar.

The controller opens a sink around a save, load or verify (:func:`reporting`); on this process
the engine adds the bytes of each write once durable, each box read and each chunk checked
(:func:`counter`, captured on the calling thread, since completions arrive on TensorStore's
threads); a host group adds a remote host's bytes when its ack arrives (:func:`acked`: a
slice's hosts have no sink of their own, so nothing is counted twice). Without a sink (the
default, and always inside a slice's host actors) nothing is counted.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any, Protocol


class Sink(Protocol):
    def expect(self, nbytes: int) -> None:
        """More bytes are planned (a checkpointable's share)."""
        ...

    def add(self, nbytes: int) -> None:
        """Bytes this process moved (any thread)."""
        ...

    def acked(self, host: int | str, nbytes: int) -> None:
        """A remote host finished its part: ``nbytes`` in all."""
        ...


_SINK: contextvars.ContextVar[Sink | None] = contextvars.ContextVar(
    "milepost_progress_sink", default=None
)


def current() -> Sink | None:
    return _SINK.get()


@contextlib.contextmanager
def reporting(sink: Sink | None) -> Iterator[None]:
    """Count into ``sink`` inside the block (on this thread)."""
    token = _SINK.set(sink)
    try:
        yield
    finally:
        _SINK.reset(token)


def expect(nbytes: int) -> None:
    sink = _SINK.get()
    if sink is not None:
        sink.expect(int(nbytes))


def counter() -> Callable[[int], None] | None:
    """The current sink's ``add`` (None without a sink), to call from any thread."""
    sink = _SINK.get()
    return sink.add if sink is not None else None


def acked(host: int | str, ack: Any) -> None:
    """Count a host's ack (a SaveAck, LoadAck or VerifyAck) into the current sink, if any."""
    sink = _SINK.get()
    if sink is None:
        return
    nbytes = getattr(ack, "bytes_written", None)
    if nbytes is None:
        nbytes = getattr(ack, "bytes_read", None)
    if isinstance(nbytes, int):
        sink.acked(host, nbytes)
