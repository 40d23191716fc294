"""The peer tier's host side: a node's folder of parts (``_store``), and a host's staging and
rebuilding of its arrays (``_host``). Transport between hosts is the host group's."""

from milepost.workers._iostats import count_between_hosts
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
from milepost.workers.peers._wire import PeerServer, fetch_part, send_part

__all__ = [
    "ArrayRecord",
    "Box",
    "Held",
    "Part",
    "PeerServer",
    "Staged",
    "check",
    "count_between_hosts",
    "fetch_part",
    "listing",
    "part_folder",
    "prune",
    "read",
    "record_of",
    "restore",
    "run_folder",
    "send_part",
    "stage",
    "write",
]
