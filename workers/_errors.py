"""Errors about a checkpoint's contents, raised where they are found (often on a host).

The controller re-exports them as ``milepost.CheckpointNotFoundError`` and
``milepost.CorruptCheckpointError``; each subclasses the builtin a caller would catch.
"""

from __future__ import annotations

from typing import Any

from milepost.workers import _views


class CheckpointNotFoundError(FileNotFoundError):
    """The path is not a committed checkpoint, or a file a checkpoint needs is missing."""


class StillWritingError(TimeoutError):
    """A wait for a save's writes ran out of time while some are still in flight. Whoever
    removes what they write into first settles them (``unsettled``: the pending writes the
    raiser did not hand back otherwise), or they would land after it."""

    def __init__(self, *args: object, unsettled: list[Any] | None = None) -> None:
        super().__init__(*args)
        self.unsettled: list[Any] = list(unsettled or [])


class LostWriteError(OSError):
    """A file a save wrote is missing, or shorter than written, when the save confirms its
    files before the commit: the storage acknowledged a write it did not keep (a proxy or
    gateway that drops writes), or another program removed or cut the file. Nothing was
    committed; save again. ``path``: the file; ``expected_bytes``: what it must at least hold;
    ``found_bytes``: what it holds (None: missing). ``errno`` is ``EIO``."""

    def __init__(
        self,
        *args: Any,
        path: str | None = None,
        expected_bytes: int = 0,
        found_bytes: int | None = None,
    ) -> None:
        super().__init__(*args)
        self.path = path
        self.expected_bytes = expected_bytes
        self.found_bytes = found_bytes


class HostMemoryError(MemoryError):
    """A load cannot allocate the host buffer a box of an array needs: ``nbytes`` for
    ``shape`` of ``dtype``. Either the array is larger than this host can hold (load a part of
    the tree, or onto more hosts), or its header declares more than the checkpoint holds
    (crafted or damaged: ``milepost verify`` reports the chunks it lacks)."""

    def __init__(self, message: str, *, shape: tuple[int, ...], dtype: str, nbytes: int) -> None:
        super().__init__(message)
        self.shape = shape
        self.dtype = dtype
        self.nbytes = nbytes


class MissingDevicesError(ValueError):
    """An array would be placed on devices this JAX runtime does not have: a sharding (a saved
    one from ``milepost.metadata``, or one of the abstract tree) over more devices, or other
    device ids, than are here. ``sharding``: that sharding (a ``ShardingSpec``);
    ``missing``: the device ids not here; ``available``: the ids that are. Load without an
    abstract tree (the saved shardings are placed on the devices here), or pass one with
    shardings over the devices you have."""

    def __init__(
        self,
        message: str,
        *,
        sharding: Any = None,
        missing: tuple[int, ...] = (),
        available: tuple[int, ...] = (),
    ) -> None:
        super().__init__(message)
        self.sharding = sharding
        self.missing = missing
        self.available = available


class CorruptCheckpointError(ValueError):
    """A checkpoint's file is present but damaged: metadata that does not parse or has the
    wrong form, array data that is missing, cut short or fails its checksum.

    What was found damaged, when known, is also data: ``array`` (the array's name), ``chunk``
    (its index in the array's chunk grid), ``path`` (the file, or the folder read) and ``field``
    (what in the file is wrong: ``"shape"``, ``"data_offsets"``...). The
    message may name what a hostile file holds, so it is kept printable (control and
    bidirectional characters as escapes: ``milepost.workers.printable``) for the traceback that
    shows it; the fields keep the names as they are."""

    def __init__(
        self,
        message: str,
        *,
        array: str | None = None,
        chunk: tuple[int, ...] | None = None,
        path: str | None = None,
        field: str | None = None,
    ) -> None:
        super().__init__(_views.printable(message))
        self.array = array
        self.chunk = chunk
        self.path = path
        self.field = field
