"""milepost.colocated: host groups that run the controller's plans where the data lives."""

from milepost.colocated._errors import HostError
from milepost.colocated._hostgroup import HostGroup, LocalHostGroup, PendingHostSave
from milepost.colocated._mcjax import MultiControllerHostGroup

__all__ = ["HostError", "HostGroup", "LocalHostGroup", "MultiControllerHostGroup", "PendingHostSave"]
