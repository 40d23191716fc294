"""The writes of one :func:`~milepost.workers.start_save` on this host, until they are durable."""

from __future__ import annotations

import collections
import errno
import math
import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from typing import Any

import numpy as np
import tensorstore as ts

from milepost.workers import _requests
from milepost.workers._boxes import Box
from milepost.workers._errors import LostWriteError, StillWritingError
from milepost.workers._keys import dtype_of
from milepost.workers._memory import on_copy_pool
from milepost.workers._messages import ArraySpec, SaveAck, SavePlan, WrittenArray
from milepost.workers._paths import as_path, in_object_store
from milepost.workers.format import (
    chunk_checksums,
    chunk_tables,
    from_tensorstore,
    lost_write,
    specs,
    unread_file,
)
from milepost.workers.save import _packed, _staging


class PendingSave:
    """The TensorStore writes (and array creations) of one :func:`start_save`: a
    :class:`~milepost.workers.PendingWrite` whose ``wait`` returns this host's :class:`SaveAck`."""

    def __init__(self, plan: SavePlan, context: Any = None) -> None:
        self._plan = plan
        self._context = context
        """The TensorStore context the arrays were written with (the chunk checksum tables are
        written into the same databases through it)."""
        self._deadline = None if plan.timeout_secs is None else time.monotonic() + plan.timeout_secs
        """When the staging's own waits (``staging_left``) run out."""
        self._inflight: list[Any] | None = []
        """TensorStore futures that may still write: array opens (they create zarr.json) and
        write commits. Dropped once durable, which frees the staged buffers."""
        self._names: list[str] = []
        """The array each of ``_inflight`` writes to."""
        self._nbytes = 0
        self._checksums: list[tuple[str | None, str, Any]] = []
        """(database, array name, future of its chunks' checksums), computed while the writes
        run."""
        self._lock = threading.Lock()
        self._ack: SaveAck | None = None
        self._staged: list[np.ndarray] = []
        """Raw buffers of the staging copies, returned to the pool once the writes are durable."""
        self._staged_bytes = 0
        self._packed: list[str] = []
        """The packed databases being written (:mod:`._packed`), each with its table."""
        self._issuing: list[Future[Any]] = []
        """The jobs issuing writes off the caller's thread (the staging copies', the device
        copies'; they add to ``_inflight`` and ``_checksums``): waited for before either is
        read."""
        self._tracking = threading.Lock()
        """Serializes what those jobs and the caller's thread add."""

    def track(self, future: Any, nbytes: int = 0, name: str = "") -> None:
        """Count a TensorStore future that may still write (an open, a write's commit), the
        bytes it writes and the array it writes to."""
        with self._tracking:
            assert self._inflight is not None
            self._inflight.append(future)
            self._names.append(name)
            self._nbytes += nbytes

    def checksum(
        self, spec: ArraySpec, box: Box, data: np.ndarray, database: str | None = None
    ) -> Future[Any]:
        """Compute the checksums of the chunks of ``data`` (the region ``box``, written into
        ``database``) on the copy pool."""
        future = on_copy_pool(chunk_checksums.region_crc32c, data, box, spec.chunk_shape)
        with self._tracking:
            self._checksums.append((database, spec.name, future))
        return future

    def packing(self, packer: _packed.Packer, job: Future[None], progress: Any = None) -> None:
        """Track ``job``, writing the packed shards of ``packer``, like the array writes;
        ``progress`` (if any) counts their bytes once durable."""
        self.track(job, packer.data_bytes, packer.database)
        self._packed.append(packer.database)
        if progress is not None:
            count, nbytes = progress, packer.data_bytes

            def durable(f: Future[None]) -> None:
                if f.exception() is None:
                    count(nbytes)

            job.add_done_callback(durable)

    def hold(self, raw: np.ndarray) -> None:
        """Keep a staging buffer until the writes are durable, then give it back to the pool."""
        self._staged.append(raw)
        self._staged_bytes += raw.nbytes

    def staging_left(self) -> float | None:
        """Seconds left for the staging's waits (None: no limit)."""
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def staging_timeout(self) -> StillWritingError:
        """The error of a staging that waited past its ``timeout_secs`` (this save's writes
        still to settle)."""
        error = self._late(self._plan.timeout_secs)
        error.unsettled.append(self)
        return error

    def issued_by(self, job: Future[Any]) -> None:
        """``job`` issues writes (adding to what is tracked): waited for before the writes."""
        self._issuing.append(job)

    def wait(self, timeout: float | None = None) -> SaveAck:
        with self._lock:
            if self._ack is None:
                deadline = None if timeout is None else time.monotonic() + timeout

                def left() -> float | None:
                    return None if deadline is None else max(0.0, deadline - time.monotonic())

                self._wait_inflight(left, timeout, issued_only=True)
                # Each database's chunk checksums go into a table of its own, written as soon as
                # they are known, with the last chunks (a plain zarr3 folder has no database: the
                # commit records those).
                checksums: dict[str, list[tuple[tuple[int, ...], int]]] = collections.defaultdict(
                    list
                )
                tables: dict[str, dict[str, list[tuple[tuple[int, ...], int]]]] = {}
                for database, name, future in self._checksums:
                    if database is None:
                        checksums[name].extend(future.result())
                    else:
                        tables.setdefault(database, {}).setdefault(name, []).extend(future.result())
                self._checksums = []
                for database, table in tables.items():
                    self._write_table(database, table)
                self._wait_inflight(left, timeout)
                self._inflight = None
                # Chunks stored inline in the B-tree have no data file to find their writer
                # by: the commit records their checksums (small arrays, or compressed ones).
                for name, crcs in self._inline_chunks(tables).items():
                    checksums[name].extend(crcs)
                _staging.POOL.give_back(self._staged, keep_bytes=self._staged_bytes)
                arrays = tuple(
                    WrittenArray(
                        name=t.spec.name,
                        write_shape=t.spec.write_shape,
                        chunk_shape=t.spec.chunk_shape,
                        chunk_crc32c=tuple(sorted(checksums.get(t.spec.name, ()))),
                        random_key_impl=t.spec.random_key_impl,
                        shard_bytes=0 if self._plan.store.use_ocdbt else _shard_bytes(t.spec),
                    )
                    for t in self._plan.tasks
                    # One host per array reports it (the one writing its header), and hosts
                    # whose checksums the commit records: acks stay O(arrays) over all hosts.
                    if (t.regions or t.create) and (t.write_metadata or t.spec.name in checksums)
                )
                self._ack = SaveAck(
                    process_index=self._plan.process_index,
                    bytes_written=self._nbytes,
                    arrays=arrays,
                    chunk_tables=tuple(sorted([*tables, *self._packed])),
                )
            return self._ack

    def _wait_inflight(self, left: Any, timeout: float | None, issued_only: bool = False) -> None:
        """Wait for every write in flight (``left()``: the seconds left), or (``issued_only``)
        only until every write is issued and its checksums computed; a failure settles the
        others first."""
        try:
            for job in self._issuing:
                job.result(timeout=left())
            if issued_only:
                for _, _, future in self._checksums:
                    future.result(timeout=left())
                return
            for f in self._inflight or []:
                f.result(timeout=left())
        except BaseException as e:
            if isinstance(e, TimeoutError) and not str(e):  # the deadline, not storage
                # At once: the caller settles the writes before it cleans up (they end
                # within the storage's request budget), on a thread of its choice.
                raise self._late(timeout) from None
            self._settle()  # no write may land after the caller cleans up
            mapped = _lost(e, self._plan.store.directory) or from_tensorstore(
                e, "writing the checkpoint's arrays", self._plan.store.directory
            )
            if mapped is e:
                raise
            raise mapped from e

    def _inline_chunks(
        self, tables: dict[str, dict[str, list[tuple[tuple[int, ...], int]]]]
    ) -> dict[str, list[tuple[tuple[int, ...], int]]]:
        """The checksums of the chunks written into ``tables``' databases whose shard value
        ended up inline in the B-tree (found in the database itself, for the arrays whose shards
        may be small enough: compressed, or of at most twice the inline limit)."""
        by_name = {t.spec.name: t.spec for t in self._plan.tasks}
        out: dict[str, list[tuple[tuple[int, ...], int]]] = {}
        for database, arrays in tables.items():
            small = [n for n in arrays if _may_be_inline(by_name[n])]
            if not small:
                continue
            stored = chunk_tables.keys_in_data_files(as_path(self._plan.store.directory) / database)
            for name in small:
                spec = by_name[name]
                for grid, crc in arrays[name]:
                    key = chunk_tables.shard_key(name, grid, spec.chunk_shape, spec.write_shape)
                    if key.encode() not in stored:
                        out.setdefault(name, []).append((grid, crc))
        return out

    def _write_table(
        self, database: str, table: dict[str, list[tuple[tuple[int, ...], int]]]
    ) -> None:
        """Write one database's chunk checksum table into it (tracked like the array writes)."""
        store = self._plan.store
        kv = ts.KvStore.open(
            specs.ocdbt_kvstore(as_path(store.directory) / database, writable=True),
            context=self._context,
        ).result()
        key = chunk_tables.table_key(database)
        self.track(kv.write(key, chunk_tables.encode(database, table)), name=key)

    def settle(self, timeout: float | None = None) -> None:
        with self._lock:
            self._settle(timeout)

    def _settle(self, timeout: float | None = None) -> None:
        """Wait until no write is in flight: at most ``timeout``, or (None) as long as one
        storage request may take with its retries, after which TensorStore has given up."""
        if timeout is None:
            timeout = _requests.budget_secs()
        deadline = time.monotonic() + timeout
        futures_wait(self._issuing, timeout=timeout)
        for f in self._inflight or []:
            try:
                f.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:
                pass

    def _late(self, timeout: float | None) -> StillWritingError:
        """The error of a wait that reached its deadline: what was still being written."""
        running = sorted(
            {
                name
                for f, name in zip(self._inflight or [], self._names, strict=True)
                if not f.done()
            }
        )
        shown = ", ".join(repr(n) for n in running[:5]) + (" ..." if len(running) > 5 else "")
        return StillWritingError(
            errno.ETIMEDOUT,
            f"writing the checkpoint's arrays to {self._plan.store.directory} did not finish "
            f"within {round(timeout or 0, 2):g} s"
            + (f"; still writing {len(running)} array(s): {shown}" if running else "")
            + ". The storage is stalled or slower than the timeout allows: check it, or raise "
            "AsyncOptions(timeout_secs=...)",
        )


def _may_be_inline(spec: ArraySpec) -> bool:
    """Whether an array's shard values may be small enough to be stored inline in the OCDBT
    B-tree (compressed, or of at most twice the inline limit uncompressed: a margin for the
    element types stored packed)."""
    if spec.compression is not None:
        return True
    try:
        itemsize = int(np.dtype(dtype_of(spec.dtype)).itemsize)
    except TypeError:
        return True
    limit = int(specs.OCDBT_CONFIG["max_inline_value_bytes"])  # type: ignore[call-overload]
    return math.prod(spec.write_shape) * itemsize <= 2 * limit


def _shard_bytes(spec: ArraySpec) -> int:
    """An uncompressed zarr3 shard's bytes as TensorStore writes it: every inner chunk (each
    stored, zeros too), then the index (16 bytes a chunk) and its CRC32C; 0 if compressed."""
    if spec.compression is not None:
        return 0
    shape = zip(spec.write_shape, spec.chunk_shape, strict=True)
    chunks = math.prod(w // c if c else 1 for w, c in shape)
    values = math.prod(spec.chunk_shape) * np.dtype(dtype_of(spec.dtype)).itemsize
    return chunks * (values + 16) + 4


def _lost(error: BaseException, directory: str) -> LostWriteError | None:
    """A write that failed reading back a data file of its own database (TensorStore reads
    the B-tree it extends): that file, which this save wrote, is missing or cut short."""
    found = unread_file(error)
    if found is None:
        return None
    name, needed, size = found
    where = as_path(directory)
    path = name
    if "://" not in name and in_object_store(where):  # (a key in the bucket)
        path = f"{where.scheme}://{where.bucket}/{name}"
    return lost_write(path, needed, size, "this save (writing its arrays)")
