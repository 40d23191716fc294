"""A host's part of a load: read what its devices need, check it, and place it."""

from milepost.workers.load._load import load

__all__ = ["load"]
