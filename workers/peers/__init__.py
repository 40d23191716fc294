"""The peer tier's host side: a node's folder of parts (``_store``), and a host's staging and
rebuilding of its arrays (``_host``). Transport between hosts is the host group's."""

from milepost.workers.peers._host import ArrayRecord, Staged, record_of, restore, stage
from milepost.workers.peers._store import (
    Box,
    Held,
    Part,
    check,
    listing,
    part_folder,
    prune,
    read,
    run_folder,
    write,
)

__all__ = [
    "ArrayRecord",
    "Box",
    "Held",
    "Part",
    "Staged",
    "check",
    "listing",
    "part_folder",
    "prune",
    "read",
    "record_of",
    "restore",
    "run_folder",
    "stage",
    "write",
]
