"""milepost.colocated: host groups that run the controller's plans where the data lives."""

from milepost.colocated._errors import HostError, RayNotInstalledError
from milepost.colocated._handles import AbstractArray, RemoteArray, SliceMesh, SliceSharding
from milepost.colocated._hostgroup import (
    DevicesHere,
    HostGroup,
    HostLoad,
    LocalHostGroup,
    PendingHostSave,
)
from milepost.colocated._jax_internals import preemption_service_running, reachable_address
from milepost.colocated._mcjax import MultiControllerHostGroup, default_group, set_primary_process
from milepost.colocated._peer_transport import PeerRestoreAck, PeerTransport
from milepost.colocated._process_peers import ProcessPeers
from milepost.colocated._ray_group import RayHostGroup, Traffic
from milepost.colocated._slice import Slice, SliceOptions
from milepost.colocated._slice_peers import SlicePeers, choose_peers

__all__ = [
    "AbstractArray",
    "DevicesHere",
    "HostError",
    "HostGroup",
    "HostLoad",
    "LocalHostGroup",
    "MultiControllerHostGroup",
    "PeerRestoreAck",
    "PeerTransport",
    "PendingHostSave",
    "ProcessPeers",
    "RayHostGroup",
    "RayNotInstalledError",
    "RemoteArray",
    "Slice",
    "SliceMesh",
    "SliceOptions",
    "SlicePeers",
    "SliceSharding",
    "Traffic",
    "choose_peers",
    "default_group",
    "preemption_service_running",
    "reachable_address",
    "set_primary_process",
]
