"""Typed errors. Each subclasses the builtin a caller would naturally catch."""

from __future__ import annotations


class CheckpointNotFoundError(FileNotFoundError):
    """The path is not a committed checkpoint (or a part of one is missing)."""


class CheckpointExistsError(FileExistsError):
    """A checkpoint already exists where a save was asked to write."""


class CorruptCheckpointError(ValueError):
    """A metadata file is present but cannot be parsed."""


class StructureMismatchError(ValueError):
    """The abstract tree does not match what the checkpoint holds."""


class UnsupportedLeafError(TypeError):
    """A leaf of the tree has a type milepost cannot save."""


class InvalidKeyError(ValueError):
    """A tree key cannot be used as a storage name."""


class HostError(RuntimeError):
    """A host process failed or did not answer in time; the message names it."""
