"""Counters of where bytes go: what this process read from and wrote to storage, and what it
sent to and received from other hosts, since it started.

Storage is counted at the lowest layer milepost can see:

- TensorStore's storage drivers (``file``, ``s3``, ``gcs``, ``gcs_grpc``, ``http``): their own
  process-wide metrics (``/tensorstore/kvstore/<driver>/{read,bytes_read,write,bytes_written}``).
  A *request* there is one kvstore read or write the driver performed: on a local file one
  ranged read (or one whole-file write) of one file, on an object store one GET (or PUT). Reads
  OCDBT coalesced are one request; chunks TensorStore found in flight for another reader are
  not read again, so not counted again. Listings, deletions and retries are not requests here.
- milepost's own file I/O: each ``preadv`` system call of a direct read (``_direct``), of a
  safetensors read, and each ``write`` of a safetensors export is one request of the bytes it
  moved; a local file copy (``mp.copy``, the local tier's mirror) is one read and one write
  request of the file's size.

``memory://`` is not storage (it lives in this process) and is not counted. Small metadata
files the controller reads or writes with Python file calls on a local disk are not counted;
on object stores they go through TensorStore and are.

Between hosts: the bytes of the shards milepost itself moved from one host process to another,
counted once by the sender and once by the receiver: load-and-broadcast (each shard a receiving
device got from a device of another process), and the peer tier (each copy of a part sent to a
peer, and each part a recovering host got from the host holding a copy). The peer tier's node
folders are memory, not storage: what it writes and reads there is not counted. Collectives
inside your own jitted functions are XLA's and are not counted.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields

STORAGE_DRIVERS = ("file", "s3", "gcs", "gcs_grpc", "http")
"""TensorStore kvstore drivers that reach storage (``memory`` is this process's RAM)."""

_TS_FIELDS = {
    "read": "read_requests",
    "bytes_read": "bytes_read",
    "write": "write_requests",
    "bytes_written": "bytes_written",
}


@dataclass(frozen=True, kw_only=True)
class HostIoStats:
    """One host process's counters since it started (subtract two readings to measure a call)."""

    process_index: int | str
    """The host (``"controller"``: the controller process of a slice)."""
    bytes_read: int = 0
    """Bytes read from storage."""
    read_requests: int = 0
    """Read requests made to storage."""
    bytes_written: int = 0
    """Bytes written to storage."""
    write_requests: int = 0
    """Write requests made to storage."""
    bytes_sent: int = 0
    """Bytes this host sent to other hosts (load-and-broadcast, the peer tier's copies)."""
    bytes_received: int = 0
    """Bytes this host received from other hosts (load-and-broadcast, the peer tier's
    copies)."""

    def __sub__(self, other: HostIoStats) -> HostIoStats:
        if not isinstance(other, HostIoStats):
            return NotImplemented
        if other.process_index != self.process_index:
            raise ValueError(
                f"cannot subtract the counters of host {other.process_index!r} "
                f"from those of host {self.process_index!r}"
            )
        counts = {
            f.name: getattr(self, f.name) - getattr(other, f.name)
            for f in fields(self)
            if f.name != "process_index"
        }
        return HostIoStats(process_index=self.process_index, **counts)


class _Counters:
    """milepost's own counts (TensorStore keeps its own); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = {
            "bytes_read": 0,
            "read_requests": 0,
            "bytes_written": 0,
            "write_requests": 0,
            "bytes_sent": 0,
            "bytes_received": 0,
        }

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                self._values[name] += n

    def values(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


COUNTERS = _Counters()


def count_read(nbytes: int, requests: int = 1) -> None:
    COUNTERS.add(bytes_read=nbytes, read_requests=requests)


def count_write(nbytes: int, requests: int = 1) -> None:
    COUNTERS.add(bytes_written=nbytes, write_requests=requests)


def count_between_hosts(sent: int = 0, received: int = 0) -> None:
    COUNTERS.add(bytes_sent=sent, bytes_received=received)


def _tensorstore_counts() -> dict[str, int]:
    import tensorstore as ts

    out = dict.fromkeys(_TS_FIELDS.values(), 0)
    for driver in STORAGE_DRIVERS:
        for metric in ts.experimental_collect_matching_metrics(f"/tensorstore/kvstore/{driver}/"):
            name = metric["name"].rsplit("/", 1)[-1]
            if name in _TS_FIELDS:
                out[_TS_FIELDS[name]] += sum(
                    int(v.get("value", 0)) for v in metric.get("values", ())
                )
    return out


def snapshot(process_index: int | str = 0) -> HostIoStats:
    """This process's counters now."""
    counts = COUNTERS.values()
    for name, n in _tensorstore_counts().items():
        counts[name] += n
    return HostIoStats(process_index=process_index, **counts)


def io_stats(plan: object, process_index: int | str) -> HostIoStats:
    """The host job ``io_stats`` (``plan`` is ignored; pass ``()``): this host's counters."""
    return snapshot(process_index)
