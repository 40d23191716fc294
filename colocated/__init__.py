"""milepost.colocated: host groups that run the controller's plans where the data lives."""

from milepost.colocated._hostgroup import HostGroup, LocalHostGroup, PendingHostSave

__all__ = ["HostGroup", "LocalHostGroup", "PendingHostSave"]
