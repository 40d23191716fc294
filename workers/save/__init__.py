"""A host's part of a save: stage its shards, write them, and report what it wrote."""

from milepost.workers.save._pending import PendingSave
from milepost.workers.save._stage import start_save

__all__ = ["PendingSave", "start_save"]
