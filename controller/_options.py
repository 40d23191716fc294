"""Options, one frozen keyword-only dataclass per concern, and the ``Context`` that applies them.

Every public call takes a snapshot of the current context when it starts, so changing the
context while a save is in flight does not affect it.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from milepost.workers import AdaptiveStagingBudget, check

AUTO_WRITERS = 4
"""The most OCDBT databases a host writes under ``ocdbt_writers_per_host="auto"``."""
AUTO_WRITER_BYTES = 32 << 20
"""Under ``"auto"``, a host writes one more database per this many bytes."""


def max_writers(options: SaveOptions) -> int:
    """The most OCDBT databases any host writes under ``options``."""
    n = options.ocdbt_writers_per_host
    return AUTO_WRITERS if n == "auto" else n


def writers_for(options: SaveOptions, nbytes: int) -> int:
    """How many OCDBT databases a host writing ``nbytes`` spreads them over."""
    n = options.ocdbt_writers_per_host
    if n != "auto":
        return n
    return max(1, min(AUTO_WRITERS, -(-nbytes // AUTO_WRITER_BYTES)))


@dataclass(frozen=True, kw_only=True)
class SaveOptions:
    """How saves write: layout, compression, chunking, replica-parallel writing, and how a save
    meets another writer of the same path. Set them for a block of calls with a Context:

    >>> with mp.Context(saving=mp.SaveOptions(compression="zstd", chunk_byte_size=4 << 20)):
    ...     mp.save("/ckpt/1000", state)
    """

    use_ocdbt: bool = True
    """Write each host's data into an OCDBT database and merge them (Orbax's default layout).
    False writes one plain zarr3 folder per array."""
    compression: str | None = None
    """None (fastest; training state rarely compresses) or 'zstd' (Orbax's default)."""
    chunk_byte_size: int | Literal["auto"] | None = "auto"
    """How each written shard is cut into inner chunks (every chunk is read and checked whole,
    so a resharded or partial load that keeps part of a shard reads only the chunks it touches).

    ``"auto"`` (the default): shards of 2 MiB and more are cut into bands of whole rows of about
    1 MiB (the outermost dimensions first; the nearest divisor of the row count), smaller ones
    stay one chunk. Saves and same-topology loads cost what they cost unchunked (the bands of a
    shard lie one after another, and are read with the shard in one go), while a load onto
    another sharding along the rows reads only the bands it keeps (not the whole shards: in the
    Orbax paper's (2, 4) -> (8, 1) case a quarter of the bytes). An int: chunks of at most this many
    bytes (bands of rows halved by their smallest prime factor, then pieces of a row once a single
    row is larger). None: one chunk per written shard (what milepost wrote before ``"auto"``).
    A surgery relinks stored leaves only under ``"auto"`` (they keep how they were stored); any
    other value rewrites every array in that chunking."""
    replica_parallel: bool = True
    """Split a replicated shard among its replicas so that every replica writes a part (a shard
    written whole goes to one of its replicas in turn, array by array)."""
    min_write_bytes: int = 1 << 20
    """Replica-parallel writing cuts a shard into parts of at least this many bytes: a shard
    under twice this is written whole by one replica, one of 64 MiB over 128 replicas in 64
    parts of 1 MiB. Below about a MiB a write costs the same whatever its size (a chunk, a
    checksum entry, a request on an object store), so smaller parts only add cost. 0: a part per
    replica whenever the shard divides evenly."""
    orbax_sharding_max_bytes: int = 256 * 1024
    """Milepost records each array's sharding in ``_milepost.json`` compactly (each device mesh
    once, then per array its PartitionSpec). Orbax's own ``_sharding`` file repeats the whole
    mesh, every device id, for every array: it is written too as long as it comes to at most
    this many bytes. The default keeps it for a few hundred arrays on a few devices (100 arrays
    on 8 devices: about 30 KB) and leaves it out at scale (100 arrays on 512 devices: about
    800 KB; 2000 arrays on 4096 devices: about 125 MB). Without it, milepost loads as before,
    and Orbax restores only with an abstract tree that gives every array's sharding. 0: never
    write it; a very large number: always."""
    ocdbt_writers_per_host: int | Literal["auto"] = "auto"
    """With OCDBT, each host spreads its arrays over up to this many databases
    (``ocdbt.process_<i>``, ``ocdbt.process_<i>.1``, ...) written in parallel; one database
    writes its data files one after another. The commit merges them all into the root view.
    ``"auto"``: one database per 32 MiB the host writes, at most 4 (each database costs a few
    ms to create, commit and merge; the figures are in the performance guide)."""

    wait_for_writer_secs: float = 0.0
    """When another process is saving to the same path: wait up to this long for it to finish
    (its checkpoint then exists: overwrite it or not as ``overwrite`` says) instead of failing
    at once with ``CheckpointExistsError``."""

    lease_secs: float = 60.0
    """On object stores (no locks): how long a save owns its path without renewing its lease (it
    renews every quarter of this). A path whose writer died can be saved again after this."""

    host_staging_budget_bytes: int | None = None
    """``save_async`` copies every shard into host memory of its own so that it can return while
    the writes go on (the caller may then change or donate its arrays). With a budget, each host
    copies at most this many bytes; the shards beyond it are written straight from the caller's
    arrays, and ``save_async`` returns once those writes are durable and the rest is copied. The
    host memory a save adds then stays within the budget (plus TensorStore's small buffers),
    at the price of a longer blocking part. None: copy everything; 0: copy nothing (the whole
    write happens before ``save_async`` returns; only the commit runs in the background).
    On accelerators every shard is copied to host memory to be written: there the budget bounds
    the copies in host memory whose writes are not yet durable (the next copy waits for an
    earlier write; one shard's part at a time when the budget is smaller), and ``save_async``
    returns once the last copy is done. Plain ``save`` stages nothing (on accelerators it
    copies each shard to host memory to write it, with no budget)."""

    adaptive_staging: AdaptiveStagingBudget | None = None
    """A host staging budget that adapts to the saves, instead of the fixed
    ``host_staging_budget_bytes`` (give one of the two): each host's next save of a
    checkpointable stages within ``headroom`` times the most bytes its last one held in staging,
    within ``[min_bytes, max_bytes]`` (see :class:`~milepost.AdaptiveStagingBudget`)."""

    device_staging: Literal["auto", "pinned_host", "host_copy"] = "auto"
    """How shards in accelerator memory reach host memory to be written. Each region a host
    writes is copied into host memory of milepost's own (a replicated shard split among its
    replicas: only its part, cut out on the device), every copy started before the first wait,
    each written as soon as it arrives; nothing is cached on your arrays.

    ``"auto"``: ``"pinned_host"`` on GPUs, ``"host_copy"`` on other accelerators (TPU
    pinned-host buffers may carry device layouts, which NumPy unpacks with a second copy).
    ``"pinned_host"``: a ``jax.device_put`` into the device's page-locked ``'pinned_host'``
    memory (the fastest DMA; NumPy reads it in place); an error where a device offers none. On
    GPUs that memory is XLA's pinned-host pool, which keeps what it allocated for the process's
    lifetime and holds 64 GiB at most (``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``): a save puts at
    most half of that limit there, and copies the rest the ``"host_copy"`` way.
    ``"host_copy"``: JAX's own copy (``copy_to_host_async``) into pageable memory, for hosts
    short of page-locked memory. Shards on CPU devices are host memory already and are not
    transferred, except under ``"pinned_host"`` (which runs the accelerator path on CPU)."""

    def __post_init__(self) -> None:
        check.flag(self.use_ocdbt, "SaveOptions.use_ocdbt")
        check.one_of(
            self.device_staging, "SaveOptions.device_staging", ("auto", "pinned_host", "host_copy")
        )
        check.integer(
            self.host_staging_budget_bytes,
            "SaveOptions.host_staging_budget_bytes",
            minimum=0,
            optional=True,
        )
        if self.adaptive_staging is not None:
            check.instance(
                self.adaptive_staging,
                "SaveOptions.adaptive_staging",
                AdaptiveStagingBudget,
                "an AdaptiveStagingBudget or None",
            )
            if self.host_staging_budget_bytes is not None:
                raise ValueError(
                    "SaveOptions has both host_staging_budget_bytes (a fixed budget) and "
                    "adaptive_staging (one that adapts); give one of the two"
                )
        check.seconds(self.lease_secs, "SaveOptions.lease_secs")
        check.seconds(self.wait_for_writer_secs, "SaveOptions.wait_for_writer_secs", zero=True)
        check.flag(self.replica_parallel, "SaveOptions.replica_parallel")
        check.integer(self.min_write_bytes, "SaveOptions.min_write_bytes", minimum=0)
        check.integer(
            self.orbax_sharding_max_bytes, "SaveOptions.orbax_sharding_max_bytes", minimum=0
        )
        if self.ocdbt_writers_per_host != "auto":
            check.integer(
                self.ocdbt_writers_per_host,
                "SaveOptions.ocdbt_writers_per_host (or 'auto')",
                minimum=1,
            )
        if self.chunk_byte_size != "auto":
            check.integer(
                self.chunk_byte_size,
                "SaveOptions.chunk_byte_size",
                minimum=1,
                optional=True,
                expect="'auto' (the default), a number of bytes of at least 1, or None (one "
                "chunk per shard)",
            )
        check.one_of(self.compression, "SaveOptions.compression", (None, "zstd"))


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """How loads read: the memory budget per host, direct reads, and load-and-broadcast of
    replicated arrays. Set them for a block of calls with a Context:

    >>> with mp.Context(loading=mp.LoadOptions(load_and_broadcast=True, replica_axis="data")):
    ...     params = mp.load("/ckpt/7", abstract_params)
    """

    memory_budget_bytes: int | None = 128 << 20
    """At most this many bytes of reads in flight on each host (None: no cap). A direct read
    (see ``direct_reads``) fills the final buffer and holds nothing else; a read through
    TensorStore holds TensorStore's buffer and ours for a moment. So the transient memory of a
    load stays at most near twice this, whatever the checkpoint size; a read larger than the
    budget runs alone."""
    direct_reads: bool = True
    """Read uncompressed, unsubchunked shards (milepost's default layout) straight from their
    files into the memory the device arrays adopt, skipping TensorStore's intermediate buffer.
    The shard index and its checksum are checked as TensorStore would. Other arrays, and every
    array when this is False, are read through TensorStore."""
    load_and_broadcast: bool = False
    """Read each array replicated along ``replica_axis`` once: only the hosts holding replica 0
    (index 0 of that mesh axis) read storage, and the other replicas receive their shards from
    them by collectives among the hosts (never through the controller). For slices and
    multi-controller jobs; in one process it changes nothing (replicas there are read once and
    copied in memory anyway). Every target sharding on a mesh must have the axis (else
    ValueError); arrays sharded along it, or on one device, load as usual (they hold no replicas
    along it)."""
    replica_axis: str | None = None
    """The mesh axis (by name) along which arrays are replicated, e.g. ``"data"``; required with
    ``load_and_broadcast``."""

    def __post_init__(self) -> None:
        check.integer(
            self.memory_budget_bytes, "LoadOptions.memory_budget_bytes", minimum=1, optional=True
        )
        check.flag(self.direct_reads, "LoadOptions.direct_reads")
        check.flag(self.load_and_broadcast, "LoadOptions.load_and_broadcast")
        check.text(
            self.replica_axis,
            "LoadOptions.replica_axis",
            optional=True,
            expect="a mesh axis name (a non-empty str) or None",
        )
        if self.load_and_broadcast and self.replica_axis is None:
            raise ValueError(
                "LoadOptions(load_and_broadcast=True) needs the mesh axis the replicas lie along: "
                "add replica_axis='data' (the name of that axis in your mesh)"
            )
        if self.replica_axis is not None and not self.load_and_broadcast:
            raise ValueError(
                f"LoadOptions(replica_axis={self.replica_axis!r}) does nothing without "
                "load_and_broadcast=True; add it, or drop replica_axis"
            )


@dataclass(frozen=True, kw_only=True)
class AsyncOptions:
    """How long milepost waits for other processes (hosts, the other processes of a
    multi-controller job) before it fails with an error naming the one that did not answer.

    >>> with mp.Context(async_=mp.AsyncOptions(timeout_secs=1800)):
    ...     mp.load("gs://huge/1000", abstract)
    """

    timeout_secs: float = 600.0
    """How long to wait for hosts (staging, writing, reading) before failing with a clear error."""

    def __post_init__(self) -> None:
        check.seconds(self.timeout_secs, "AsyncOptions.timeout_secs")


@dataclass(frozen=True, kw_only=True)
class ProgressOptions:
    """How saves, loads and verifies show their progress: bytes done of bytes planned, with the
    rate and the time left. Off in library calls unless a context turns it on
    (``milepost.Context(progress=True)``); on in the ``milepost`` command.

    In a terminal the bar is redrawn in place (``rich``); in Jupyter it is an HTML bar in the
    cell's output, updated in place; in a file or a pipe only the final line is written. In a
    slice the controller counts the hosts' bytes as each host acknowledges (per host, when it
    finishes); in a multi-controller job only the primary process shows a bar.

    >>> with milepost.Context(progress=milepost.ProgressOptions(delay_secs=0)):
    ...     milepost.save(path, state)
    """

    file: Any = None
    """A text stream to draw on (None: standard error, or the notebook's output in Jupyter)."""
    delay_secs: float = 1.0
    """Show a bar only once the operation has run this long (0: at once), so quick calls stay
    quiet."""
    refresh_secs: float = 0.1
    """Redraw at most this often (0: at every update)."""

    def __post_init__(self) -> None:
        if self.file is not None and not callable(getattr(self.file, "write", None)):
            raise TypeError(
                "ProgressOptions.file must be a text stream (with .write) "
                f"or None, got {type(self.file).__name__}"
            )
        for name in ("delay_secs", "refresh_secs"):
            check.number(getattr(self, name), f"ProgressOptions.{name} (seconds)", minimum=0)


@dataclass(frozen=True, kw_only=True)
class Options:
    """A snapshot of everything a call needs from the context."""

    saving: SaveOptions = field(default_factory=SaveOptions)
    loading: LoadOptions = field(default_factory=LoadOptions)
    async_: AsyncOptions = field(default_factory=AsyncOptions)
    handlers: tuple[Any, ...] = ()
    progress: ProgressOptions | None = None
    """None: no progress bars (the default for library calls)."""


_DEFAULTS = Options()  # frozen: safe to share as the default
_CURRENT: contextvars.ContextVar[Options] = contextvars.ContextVar(
    "milepost_options", default=_DEFAULTS
)


def current() -> Options:
    return _CURRENT.get()


class Context:
    """Apply options (and extra checkpointable handlers) to the calls made inside ``with``.

    >>> with milepost.Context(saving=milepost.SaveOptions(compression="zstd")):
    ...     milepost.save(path, state)

    Contexts nest: unspecified options are inherited from the enclosing context.

    ``handlers``: :class:`~milepost.CheckpointableHandler` objects tried before the registered
    and built-in ones. An entry may also be a pair ``(handler, name)``: then the handler is
    used only for the checkpointable called ``name``.

    ``progress``: True (a :class:`ProgressOptions` with its defaults) or a
    :class:`ProgressOptions` shows progress bars for long saves, loads and verifies; False turns
    them off inside an enclosing context that turned them on.

    >>> with milepost.Context(progress=True):
    ...     state = milepost.load("/ckpt/100", abstract_state)
    """

    def __init__(
        self,
        *,
        saving: SaveOptions | None = None,
        loading: LoadOptions | None = None,
        async_: AsyncOptions | None = None,
        handlers: Sequence[Any] = (),
        progress: bool | ProgressOptions | None = None,
    ) -> None:
        for name, value, cls in (
            ("saving", saving, SaveOptions),
            ("loading", loading, LoadOptions),
            ("async_", async_, AsyncOptions),
        ):
            if value is not None and not isinstance(value, cls):
                raise TypeError(
                    f"Context({name}=...) takes a {cls.__name__}, got {type(value).__name__}"
                )
        if progress is not None and not isinstance(progress, bool | ProgressOptions):
            raise TypeError(
                "Context(progress=...) takes True, False or a "
                f"ProgressOptions, got {type(progress).__name__}"
            )
        self._changes: dict[str, Any] = {
            k: v
            for k, v in (("saving", saving), ("loading", loading), ("async_", async_))
            if v is not None
        }
        if progress is not None:
            self._changes["progress"] = (
                ProgressOptions() if progress is True else (progress or None)
            )
        self._handlers = tuple(handlers)
        self._tokens: list[contextvars.Token[Options]] = []

    def __enter__(self) -> Options:
        outer = _CURRENT.get()
        options = dataclasses.replace(
            outer, **self._changes, handlers=self._handlers + outer.handlers
        )
        self._tokens.append(_CURRENT.set(options))
        return options

    def __exit__(self, *exc: object) -> None:
        _CURRENT.reset(self._tokens.pop())
