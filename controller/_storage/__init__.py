"""Where a save writes before it commits, and who may write a checkpoint path: locked
temporary directories renamed into place on local disks, leases and a commit marker written
last on object stores."""

from milepost._storage._ownership import (
    NEW_MARKER,
    create_locked,
    remove_tree,
    try_lock,
)
from milepost._storage._ownership import remove_if_abandoned as remove_abandoned_folder
from milepost._storage._workspace import (
    DELETING,
    LEASE_SUFFIX,
    LocalWorkspace,
    ObjectWorkspace,
    check_final,
    for_path,
    read_lease,
    remove_expired_lease,
)
from milepost._storage._workspace import remove_if_abandoned as remove_abandoned_objects

__all__ = [
    "DELETING",
    "LEASE_SUFFIX",
    "NEW_MARKER",
    "LocalWorkspace",
    "ObjectWorkspace",
    "check_final",
    "create_locked",
    "for_path",
    "read_lease",
    "remove_abandoned_folder",
    "remove_abandoned_objects",
    "remove_expired_lease",
    "remove_tree",
    "try_lock",
]
