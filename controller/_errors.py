"""Typed errors. Each subclasses the builtin a caller would naturally catch.

Errors are defined in the lowest layer that raises them: checkpoint contents (not found,
corrupt) in ``milepost.workers``, host failures in ``milepost.colocated``; they are re-exported
here.
"""

from __future__ import annotations

from typing import Any

from milepost.colocated import HostError, RayNotInstalledError
from milepost.workers import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    HostMemoryError,
    LostWriteError,
    MissingDevicesError,
)

__all__ = [
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CheckpointReplacedError",
    "CheckpointableNotFoundError",
    "CorruptCheckpointError",
    "HostError",
    "HostMemoryError",
    "InvalidKeyError",
    "LastCheckpointableError",
    "LostWriteError",
    "MissingDevicesError",
    "RayNotInstalledError",
    "SaveCancelledError",
    "SaveInProgressError",
    "StructureMismatchError",
    "TemporaryDirectoryRemovedError",
    "UnsupportedLeafError",
]


class CheckpointExistsError(FileExistsError):
    """A checkpoint already exists where a save was asked to write."""


class CheckpointReplacedError(CheckpointNotFoundError):
    """The checkpoint was replaced or deleted while it was being loaded; load it again."""


class SaveInProgressError(CheckpointExistsError):
    """Another save to the same path is still in flight in this process."""


class SaveCancelledError(RuntimeError):
    """The save to ``path`` was cancelled (``SaveHandle.cancel()``, ``Checkpointer.cancel()``)
    before its commit: it never committed, and what it wrote was removed (its writes stopped
    first). Raised by the cancelled handle's ``result()``; save again to write the checkpoint."""

    def __init__(self, path: Any) -> None:
        super().__init__(
            f"the save to {path} was cancelled before its commit: nothing of it was committed, "
            "and what it wrote was removed once its writes stopped. Save again to write it"
        )
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.path,)


class TemporaryDirectoryRemovedError(FileNotFoundError):
    """A save's temporary directory (``<path>.orbax-checkpoint-tmp``) was removed or replaced by
    another program while the save ran, so nothing was committed; stop what deletes it while
    saves run, then save again."""


class StructureMismatchError(ValueError):
    """The abstract tree does not match what the checkpoint holds."""


class UnsupportedLeafError(TypeError):
    """A leaf of the tree has a type milepost cannot save; ``leaf`` names it, once known."""

    def __init__(self, message: str, *, leaf: str | None = None) -> None:
        super().__init__(message)
        self.leaf = leaf


class InvalidKeyError(ValueError):
    """A tree key cannot be used as a storage name."""


class CheckpointableNotFoundError(KeyError):
    """The checkpoint at ``path`` has no checkpointable ``name``; ``names`` are the ones it has,
    ``message`` says so."""

    def __init__(self, path: object, name: str, names: tuple[str, ...], message: str) -> None:
        super().__init__(message)
        self.path: str = str(path)
        self.name: str = name
        self.names: tuple[str, ...] = names
        self.message: str = message

    def __str__(self) -> str:  # not KeyError's repr of the message
        return self.message

    def __reduce__(self) -> tuple[object, ...]:
        return type(self), (self.path, self.name, self.names, self.message)


class LastCheckpointableError(ValueError):
    """Deleting the checkpointable ``name`` would leave the checkpoint at ``path`` with none (or
    the checkpoint records no checkpointables to delete one of): delete the checkpoint, or the
    step."""

    def __init__(self, path: object, name: str, message: str) -> None:
        super().__init__(message)
        self.path: str = str(path)
        self.name: str = name

    def __reduce__(self) -> tuple[object, ...]:
        return type(self), (self.path, self.name, str(self))
