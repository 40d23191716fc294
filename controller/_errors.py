"""Typed errors. Each subclasses the builtin a caller would naturally catch.

Errors are defined in the lowest layer that raises them: checkpoint contents (not found,
corrupt) in ``milepost.workers``, host failures in ``milepost.colocated``; they are re-exported
here.
"""

from __future__ import annotations

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
    "CorruptCheckpointError",
    "HostError",
    "HostMemoryError",
    "InvalidKeyError",
    "LostWriteError",
    "MissingDevicesError",
    "RayNotInstalledError",
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
