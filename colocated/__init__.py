"""milepost.colocated: host groups that run the controller's plans where the data lives."""

from milepost.colocated._errors import HostError
from milepost.colocated._hostgroup import HostGroup, LocalHostGroup, PendingHostSave
from milepost.colocated._mcjax import MultiControllerHostGroup, set_primary_process
from milepost.colocated._slice import (
    AbstractArray,
    RemoteArray,
    Slice,
    SliceMesh,
    SliceOptions,
    SliceSharding,
)

__all__ = [
    "AbstractArray",
    "HostError",
    "HostGroup",
    "LocalHostGroup",
    "MultiControllerHostGroup",
    "PendingHostSave",
    "RemoteArray",
    "Slice",
    "SliceMesh",
    "SliceOptions",
    "SliceSharding",
    "set_primary_process",
]
