"""``milepost.io_stats``: where bytes went, per host, gathered from the hosts.

Each host process keeps its own counters (``milepost.workers.HostIoStats`` says exactly what is
counted); this asks every host for them with a host job and returns them side by side. Subtract
two readings to measure a call:

>>> before = milepost.io_stats(slice=s)
>>> milepost.load(path, abstract)
>>> print(milepost.io_stats(slice=s) - before)
"""

from __future__ import annotations

from dataclasses import dataclass

from milepost import _hosts, _options
from milepost.colocated import HostGroup, Slice
from milepost.workers import HostIoStats, human_bytes
from milepost.workers import io_snapshot as snapshot

__all__ = ["HostIoStats", "IoStats", "io_stats"]


@dataclass(frozen=True)
class IoStats:
    """Storage and between-host byte counts of every host process (and, in a slice, of the
    controller), since each process started."""

    hosts: tuple[HostIoStats, ...]
    """One entry per host, in host order. In one process (and in each process of a
    multi-controller job) the controller is a host: its own reads and writes are in its entry."""
    controller: HostIoStats | None = None
    """A slice's controller process (metadata, the commit's merge); None when it is a host."""

    @property
    def bytes_read(self) -> int:
        """Bytes the hosts read from storage, in all (the controller's not included)."""
        return sum(h.bytes_read for h in self.hosts)

    @property
    def read_requests(self) -> int:
        """Read requests the hosts made to storage, in all."""
        return sum(h.read_requests for h in self.hosts)

    @property
    def bytes_written(self) -> int:
        """Bytes the hosts wrote to storage, in all (the controller's not included)."""
        return sum(h.bytes_written for h in self.hosts)

    @property
    def write_requests(self) -> int:
        """Write requests the hosts made to storage, in all."""
        return sum(h.write_requests for h in self.hosts)

    @property
    def bytes_between_hosts(self) -> int:
        """Bytes milepost moved from one host to another (each counted once)."""
        return sum(h.bytes_sent for h in self.hosts)

    def __sub__(self, other: IoStats) -> IoStats:
        if not isinstance(other, IoStats):
            return NotImplemented
        before = {h.process_index: h for h in other.hosts}
        missing = [h.process_index for h in self.hosts if h.process_index not in before]
        if missing or len(before) != len(self.hosts):
            raise ValueError(
                "these readings come from different host groups "
                f"(hosts {[h.process_index for h in self.hosts]} and "
                f"{[h.process_index for h in other.hosts]}); "
                "subtract readings of the same slice or job"
            )
        controller = None
        if self.controller is not None and other.controller is not None:
            controller = self.controller - other.controller
        return IoStats(tuple(h - before[h.process_index] for h in self.hosts), controller)

    def __str__(self) -> str:
        rows = [("host", "read", "requests", "written", "requests", "sent", "received")]
        entries = [(str(h.process_index), h) for h in self.hosts]
        if self.controller is not None:
            entries.append(("controller", self.controller))
        for name, h in entries:
            rows.append(
                (
                    name,
                    human_bytes(h.bytes_read),
                    str(h.read_requests),
                    human_bytes(h.bytes_written),
                    str(h.write_requests),
                    human_bytes(h.bytes_sent),
                    human_bytes(h.bytes_received),
                )
            )
        widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
        return "\n".join(
            "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows
        )


def io_stats(*, slice: Slice | None = None) -> IoStats:
    """Every host's storage and between-host byte counts since it started.

    ``slice``: a :class:`milepost.Slice` (its hosts are asked; its controller is reported
    apart); default: this process, or — in a multi-controller job, where every process must
    make this call — every process of the job (every process gets the same answer).
    """
    timeout = _options.current().async_.timeout_secs
    group: HostGroup = slice.group if slice is not None else _hosts.host_group_for([])
    hosts = tuple(
        group.run("io_stats", {p: () for p in group.processes()}, timeout)
    )  # no plan: () (None means "no part")
    controller = snapshot("controller") if getattr(group, "name", "") == "slice" else None
    return _hosts.shared(group, "io-stats", lambda: IoStats(hosts, controller), timeout)
