"""Typed errors. Each subclasses the builtin a caller would naturally catch."""

from __future__ import annotations

from milepost.colocated import _errors as _colocated_errors


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


HostError = _colocated_errors.HostError
"""A host process failed or did not answer in time; the message names it."""
