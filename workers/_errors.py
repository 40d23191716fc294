"""Errors about a checkpoint's contents, raised where they are found (often on a host).

The controller re-exports them as ``milepost.CheckpointNotFoundError`` and
``milepost.CorruptCheckpointError``; each subclasses the builtin a caller would catch.
"""

from __future__ import annotations


class CheckpointNotFoundError(FileNotFoundError):
    """The path is not a committed checkpoint, or a file a checkpoint needs is missing."""


class CorruptCheckpointError(ValueError):
    """A checkpoint's file is present but damaged: metadata that does not parse or has the
    wrong form, array data that is missing, cut short or fails its checksum."""
