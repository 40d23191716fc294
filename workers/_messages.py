"""Plans and acknowledgements exchanged between a controller and its hosts.

Everything here is a small frozen dataclass that pickles to a few hundred bytes per array: a plan
names arrays, regions and storage locations, never array bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from milepost.workers._keys import key_words
from milepost.workers._sharding import ShardingSpec
from milepost.workers._staging_budget import AdaptiveStagingBudget

if TYPE_CHECKING:  # (the format package builds on these messages)
    from milepost.workers.format import Tensor

_TOKEN = re.compile(r"[0-9a-f]{8}")

Index = tuple[tuple[int, int], ...]
"""A box in an array: one half-open ``(start, stop)`` pair per dimension."""


@dataclass(frozen=True, kw_only=True)
class StoreSpec:
    """Where a checkpointable's arrays live.

    ``directory`` is the checkpointable folder (``<ckpt>/state``). With OCDBT a host writes into
    its own ``ocdbt.process_<i>`` sub-stores (``ocdbt.process_<i>.<k>`` for its extra writers)
    and reads through the merged root view.
    """

    directory: str
    use_ocdbt: bool = True
    zarr_format: int = 3
    """3 (milepost, Orbax v1) or 2 (Orbax v0's default: ``.zarray`` arrays; read only)."""
    file_token: str = ""
    """The save's token (8 hex digits, drawn once per save and shared by its hosts) naming the
    data files of the databases milepost writes itself (``d/<token>.<k>``); "": each database
    draws its own. See :func:`~milepost.workers.format.write_database`."""

    def __post_init__(self) -> None:
        token = self.file_token
        if not isinstance(token, str) or (token and not _TOKEN.fullmatch(token)):
            raise ValueError(
                f"file_token={token!r}: a save's file token is 8 lowercase hex digits "
                "(os.urandom(4).hex()), or empty to draw one per database"
            )


@dataclass(frozen=True, kw_only=True)
class ArraySpec:
    """How one array is laid out on disk (zarr3, sharding_indexed codec)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    write_shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    compression: str | None = None
    random_key_impl: str | None = None
    """Set for typed PRNG keys: the array stored is their key data (``shape`` and ``dtype`` are
    the data's: uint32 with the trailing key dimension), of this implementation."""


@dataclass(frozen=True, kw_only=True)
class Region:
    """One box of an array that one device's shard provides (``device_id`` -1: host memory)."""

    device_id: int
    index: Index


@dataclass(frozen=True, kw_only=True)
class SaveTask:
    """One array for one host: which source, and which regions this host writes."""

    source: int
    spec: ArraySpec
    regions: tuple[Region, ...]
    create: bool = False
    """Create the array's metadata even if this host writes no region (zero-size arrays)."""
    write_metadata: bool = True
    """Write the array's ``zarr.json`` into this host's database. The controller asks one host
    per array to: the others write chunks only, so the commit's merge does not carry one copy
    of every header per host (with H hosts, H times the arrays' keys to merge)."""


@dataclass(frozen=True, kw_only=True)
class SavePlan:
    store: StoreSpec
    process_index: int | str
    """The host process writing (``ocdbt.process_<i>``); the controller's own leaves use
    ``"controller"``."""
    tasks: tuple[SaveTask, ...]
    copy: bool = True
    """Copy the data to host memory before returning from staging (False: the caller promises
    not to touch its arrays until the write is committed)."""
    writers: int = 1
    """With OCDBT: spread the arrays over up to this many databases written in parallel."""
    first_writer: int = 0
    """Number the databases from here (``ocdbt.process_<i>.<first_writer + w>``): several plans
    written into one checkpoint one after another (a surgery's groups) use distinct ones."""
    staging_budget_bytes: int | None = None
    """With ``copy``: copy at most this many bytes; write the other regions from the caller's
    memory and return only once they are durable (None: copy every region)."""
    adaptive_staging: AdaptiveStagingBudget | None = None
    """With ``copy``: the budget is the one this host's earlier saves of the checkpointable
    lead to (``staging_budget_bytes`` is then not used)."""
    timeout_secs: float | None = None
    """The staging's writes that it waits for (array creations, regions not copied) must be
    durable within this (a :class:`TimeoutError` naming them otherwise; None: no limit)."""
    device_staging: str = "auto"
    """How regions in accelerator memory reach host memory (``SaveOptions.device_staging``):
    ``'auto'``, ``'pinned_host'`` or ``'host_copy'`` (:mod:`milepost.workers.save._device`)."""


@dataclass(frozen=True, kw_only=True)
class WrittenArray:
    """What a host wrote of one array: the per-process entry of ``array_metadatas/``."""

    name: str
    write_shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    chunk_crc32c: tuple[tuple[tuple[int, ...], int], ...] = ()
    """``(chunk grid index, CRC32C of its values)`` of every chunk this host wrote."""
    random_key_impl: str | None = None
    """For typed PRNG keys: their implementation (Orbax's ``ext_metadata.random_key_impl``)."""
    shard_bytes: int = 0
    """Plain zarr3 folders, uncompressed: the bytes of each chunk file (a shard: its values and
    index), which the commit confirms; 0 where unknown (compressed: at least the index)."""


@dataclass(frozen=True, kw_only=True)
class SaveAck:
    """A host's answer once its writes are durable; the commit writes ``array_metadatas/``
    from these."""

    process_index: int | str
    bytes_written: int
    arrays: tuple[WrittenArray, ...]
    """The arrays whose header this host wrote, and those whose chunk checksums it reports
    (``chunk_crc32c``: plain zarr3 folders), in plan order: each array is reported once over
    all hosts, so the acks of a save grow with its arrays, not with arrays x hosts."""
    chunk_tables: tuple[str, ...] = ()
    """The databases this host wrote a chunk checksum table into (:mod:`._chunk_tables`); the
    chunks of those carry no ``chunk_crc32c`` here."""


@dataclass(frozen=True, kw_only=True)
class LoadTask:
    """One array to read and place: ``sharding`` None means a host NumPy array."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    sharding: ShardingSpec | None
    checksums: tuple[tuple[tuple[int, ...], int], ...] | None = None
    """The recorded ``(chunk grid index, CRC32C)`` of every chunk; None for checkpoints written
    without them (then nothing can be verified)."""
    chunk_tables: bool = False
    """The chunks' checksums are in their writers' tables (:mod:`._chunk_tables`), which the
    host reads: every chunk in a data file is checked against its writer's table."""
    random_key_impl: str | None = None
    """Read the stored key data (``shape``/``dtype`` are the data's) and return typed PRNG keys of
    this implementation."""
    tensor: Tensor | None = None
    """Read from a safetensors file instead of the plan's store."""
    broadcast_axis: str | None = None
    """Load-and-broadcast along this axis of the sharding's mesh (the array is replicated along
    it): only the devices at index 0 of the axis read; the others receive their shards from them
    by a collective among the hosts. None: every host reads what its devices need."""

    @property
    def result_shape(self) -> tuple[int, ...]:
        """The shape of the array the load returns (typed keys drop the key-data dimension)."""
        if self.random_key_impl is None:
            return self.shape
        return self.shape[: len(self.shape) - len(key_words(self.random_key_impl))]

    @property
    def result_dtype(self) -> str:
        return f"key<{self.random_key_impl}>" if self.random_key_impl is not None else self.dtype


@dataclass(frozen=True, kw_only=True)
class LoadPlan:
    store: StoreSpec
    tasks: tuple[LoadTask, ...]
    memory_budget_bytes: int | None = None
    """At most this many bytes of read buffers in flight on a host (None: no cap)."""
    fill_missing: bool = False
    """Read a missing chunk as the fill value (zeros) instead of failing. Only for checkpoints
    written without ``store_array_data_equal_to_fill_value``; otherwise a missing chunk is lost
    data."""
    direct_reads: bool = True
    """Read uncompressed single-chunk shards straight from their files into the destination
    buffers (see ``_direct``); False sends every read through TensorStore."""


@dataclass(frozen=True, kw_only=True)
class LoadAck:
    """A host's answer once its devices hold their shards."""

    process_index: int | str
    bytes_read: int
    """Bytes this host read from storage."""
    arrays: int
    """How many arrays of the plan it placed (its part of each)."""


@dataclass(frozen=True, kw_only=True)
class VerifyTask:
    """One array a host checks: the chunks of its share of the shards storage holds (never of
    the shards its header declares: those are counted, not walked)."""

    store: StoreSpec
    name: str
    share: tuple[int, int] = (0, 1)
    """``(k, n)``: this host checks the k-th, (k+n)-th... of the array's stored shards in key
    order; the host with ``k == 0`` also reports the shards missing from storage."""
    expected: tuple[tuple[tuple[int, ...], int], ...] | None = None
    """The chunks' recorded checksums, by chunk-grid index; None: none recorded (the chunks are
    only read)."""
    fill_missing: bool = False
    chunk_tables: bool = False
    """The checksums are in the writers' tables (:mod:`._chunk_tables`), read by the host."""


@dataclass(frozen=True, kw_only=True)
class VerifyPlan:
    tasks: tuple[VerifyTask, ...]
    memory_budget_bytes: int | None = None


@dataclass(frozen=True, kw_only=True)
class VerifyAck:
    process_index: int | str
    chunks_checked: int
    bytes_read: int
    problems: tuple[str, ...]
    """One line per damaged, missing or unreadable chunk."""
