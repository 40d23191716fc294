"""A host's part of a load: read what its devices need, check it, and place it."""

from milepost.workers.load._load import load
from milepost.workers.load._tables import ArrayChecks

__all__ = ["ArrayChecks", "load"]
