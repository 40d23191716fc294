"""The peer tier's host side: a node's folder of parts (``_store``, opened by the rules of
``_folder``: this user's own, never through a link), the runs a node's folder holds (``_runs``:
listed, removed, cleared), and a host's staging and rebuilding of its arrays (``_host``).
Transport between hosts is the host group's."""

from milepost.workers._iostats import count_between_hosts
from milepost.workers.peers._folder import UnsafeFolderError, user_name
from milepost.workers.peers._host import ArrayRecord, Staged, record_of, restore, stage
from milepost.workers.peers._runs import (
    DEFAULT_FOLDER,
    PeerRun,
    clear_peer_runs,
    list_peer_runs,
    release_run,
    remove_run,
    tier_folder,
)
from milepost.workers.peers._store import (
    Box,
    Held,
    Part,
    check,
    listing,
    make_run_folder,
    part_folder,
    prune,
    read,
    run_folder,
    validate,
    write,
)
from milepost.workers.peers._wire import PeerServer, fetch_part, send_part

__all__ = [
    "DEFAULT_FOLDER",
    "ArrayRecord",
    "Box",
    "Held",
    "Part",
    "PeerRun",
    "PeerServer",
    "Staged",
    "UnsafeFolderError",
    "check",
    "clear_peer_runs",
    "count_between_hosts",
    "fetch_part",
    "list_peer_runs",
    "listing",
    "make_run_folder",
    "part_folder",
    "prune",
    "read",
    "record_of",
    "release_run",
    "remove_run",
    "restore",
    "run_folder",
    "send_part",
    "stage",
    "tier_folder",
    "user_name",
    "validate",
    "write",
]
