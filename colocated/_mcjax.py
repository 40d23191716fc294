"""The multi-controller (mcJAX) host group: every process runs the same script and is both a
controller and the host of its own devices.

Each process runs only its own plan (``plans[jax.process_index()]``) through the worker engine.
The processes agree through the ``jax.distributed`` coordination service, with a timeout on
every wait:

- a *sync* is a barrier that carries each process's outcome: a process whose part failed posts
  its error and still arrives, so every process raises the same :class:`HostError`; a process
  that never arrives (it died or hung) is named, found by the per-process ``arrived`` keys;
- a *broadcast* is the primary publishing a value that the others read; the last reader deletes
  it.

Every operation gets an id from its name and how often this group used that name before. Every
process calls the same named operations in the same order, so the ids match across processes,
also when saves finish concurrently in background threads (their names hold their paths).

JAX's own heartbeat (``jax.distributed.initialize(heartbeat_timeout_seconds=100)``) also notices
a dead process, and unless ``jax_enable_recoverability`` is set it terminates every other
process of the job. Keep ``AsyncOptions.timeout_secs`` below it for milepost's error, which names
the missing process, to come first.
"""

from __future__ import annotations

import hashlib
import itertools
import pickle
import threading
import zlib
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import jax

import milepost.workers as workers
from milepost.colocated._errors import HostError
from milepost.colocated._hostgroup import HostLoad, JaxDevices, PendingHostSave
from milepost.colocated._jax_internals import distributed_client
from milepost.workers import check

PREFIX = "milepost"
_generations = itertools.count()
_NOT_COMMITTED = "Nothing was committed."


def _ms(timeout: float) -> int:
    return max(1, int(timeout * 1000))


def _describe(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= 2000 else text[:2000] + "..."


def _directory(plans: Mapping[int, Any]) -> str:
    return next(iter(plans.values())).store.directory if plans else "?"


class _Op:
    """One coordinated operation: its barrier id and key prefix."""

    def __init__(self, generation: int, name: str, seq: int) -> None:
        self.name = name
        digest = hashlib.sha1(name.encode()).hexdigest()[:20]
        self.barrier_id = f"{PREFIX}:{generation}:{digest}:{seq}"
        self.keys = f"{PREFIX}/{generation}/{digest}.{seq}"


class _Pending:
    """This process's writes; ``wait`` makes them durable, then syncs with the other processes
    (the primary gets every process's ack)."""

    def __init__(
        self,
        group: MultiControllerHostGroup,
        pending: workers.PendingSave | None,
        directory: str,
        timeout: float,
    ) -> None:
        self._group = group
        self._pending = pending
        self._directory = directory
        self._timeout = timeout
        self._lock = threading.Lock()
        self._outcome: list[workers.SaveAck] | BaseException | None = None

    def settle(self, timeout: float | None = None) -> None:
        """Local only: wait for this process's writes to land; no other process is waited for."""
        workers.settle_all([self._pending], timeout)  # None: the storage's request budget

    def wait(self, timeout: float | None = None) -> list[workers.SaveAck]:
        timeout = self._timeout if timeout is None else timeout
        with self._lock:
            if self._outcome is None:  # sync once: a second wait must not start another barrier
                ack: workers.SaveAck | None = None
                error: BaseException | None = None
                try:
                    if self._pending is not None:
                        ack = self._pending.wait(timeout)  # settles before it raises
                except Exception as e:
                    error = e
                    if isinstance(e, workers.StillWritingError) and self._pending is not None:
                        # (out of time: it raised at once) The job decides together, after
                        # every process's writes stopped, so none lands after the cleanup.
                        self._pending.settle()
                self._pending = None  # the staged buffers go as soon as they are on disk
                try:
                    acks = self._group.sync(
                        f"written:{self._directory}",
                        timeout,
                        error,
                        doing="writing its shards",
                        consequence=_NOT_COMMITTED,
                        value=ack,
                    )
                    self._outcome = [
                        a for a in (acks if acks is not None else [ack]) if a is not None
                    ]
                except BaseException as e:
                    self._outcome = e
            if isinstance(self._outcome, BaseException):
                raise self._outcome
            return self._outcome


class MultiControllerHostGroup(JaxDevices):
    """Every process of a ``jax.distributed`` job is a controller and the host of its devices.

    ``primary`` (process 0 unless given; see :func:`set_primary_process` for the default group)
    alone creates directories, reads and writes metadata, and commits; the others get its
    answers by broadcast. Call every milepost function in every process, in the same order.
    """

    name = "mcjax"
    """``mcjax``."""

    def __init__(self, primary: int = 0, *, client: Any | None = None) -> None:
        self._client = client if client is not None else distributed_client()
        self._index = jax.process_index()
        self._count = jax.process_count()
        check.integer(
            primary,
            "primary",
            minimum=0,
            error=ValueError,
            expect=f"a process index in [0, {self._count})",
        )
        if primary >= self._count:
            raise ValueError(
                f"primary must be a process index in [0, {self._count}), got {primary!r}"
            )
        self.primary = primary
        self._owner = {d.id: d.process_index for d in jax.devices()}
        self._lock = threading.Lock()
        self._uses: Counter[str] = Counter()
        # Groups are made at the same point of the script in every process, so this number is
        # the same everywhere; it keeps a new group's ids apart from an earlier group's.
        self._generation = next(_generations)

    def __repr__(self) -> str:
        return (
            f"MultiControllerHostGroup(process={self._index} "
            f"of {self._count}, primary={self.primary})"
        )

    # -- topology -------------------------------------------------------------------------
    def process_of_device(self, device_id: int) -> int:
        """The JAX process that owns global device ``device_id``; ValueError for an unknown id."""
        try:
            return self._owner[device_id]
        except KeyError:
            raise ValueError(
                f"device {device_id} is not part of this jax.distributed job (its devices: "
                f"{sorted(self._owner)[:8]}{'...' if len(self._owner) > 8 else ''})"
            ) from None

    def processes(self) -> Sequence[int]:
        """Every JAX process's index."""
        return tuple(range(self._count))

    def is_primary(self) -> bool:
        """Whether this process is the primary (it writes the shared files and commits)."""
        return self._index == self.primary

    # -- work: each process runs its own plan ---------------------------------------------
    def start_save(
        self, plans: Mapping[int, workers.SavePlan], sources: Sequence[Any], timeout: float
    ) -> PendingHostSave:
        """Stage this process's shards; return once every process staged (or raise everywhere)."""
        directory = _directory(plans)
        plan = plans.get(self._index)
        pending = None
        error: BaseException | None = None
        try:
            if plan is not None:
                pending = workers.start_save(plan, sources)
        except Exception as e:
            error = e
        doing, op = "staging its shards (device-to-host copy)", self._op(f"staged:{directory}")
        try:
            failed, _ = self._arrive(op, timeout, error, _NOT_COMMITTED)
        except HostError:
            workers.settle_all([pending], timeout)
            raise
        if failed:
            # Every process arrived: let each finish the writes it issued before the primary
            # removes the temporary directory, so none lands there afterwards.
            workers.settle_all([pending], timeout)
            self._arrive(self._op(f"abandoned:{directory}"), timeout, None, _NOT_COMMITTED)
            raise self._failed(failed, doing, _NOT_COMMITTED) from error
        return _Pending(self, pending, directory, timeout)

    def load(self, plans: Mapping[int, workers.LoadPlan], timeout: float) -> HostLoad:
        """Read and place this process's shards; every process returns, or all raise."""
        plan = plans.get(self._index)
        results: list[Any] = []
        ack: workers.LoadAck | None = None
        error: BaseException | None = None
        try:
            if plan is None:
                raise ValueError(
                    f"the load plan has no part for process {self._index} (it has {sorted(plans)})"
                )
            results, ack = workers.load(plan, self._index)
        except Exception as e:
            error = e
        directory = plan.store.directory if plan is not None else _directory(plans)
        acks = self.sync(
            f"loaded:{directory}",
            timeout,
            error,
            doing="reading its shards",
            value=ack,
            # what a process found wrong with the checkpoint is every process's error
            passthrough=(workers.CorruptCheckpointError, workers.CheckpointNotFoundError),
        )
        return HostLoad(
            results, [a for a in (acks if acks is not None else [ack]) if a is not None]
        )

    def run(self, job: str, plans: Mapping[int, Any], timeout: float) -> list[Any]:
        """Run this process's part of a host job; the primary gets every process's ack."""
        plan = plans.get(self._index)
        ack: Any = None
        error: BaseException | None = None
        try:
            if plan is not None:
                ack = workers.run_job(job, plan, self._index)
        except Exception as e:
            error = e
        acks = self.sync(f"job-{job}", timeout, error, doing=f"running {job}", value=ack)
        return [a for a in (acks if acks is not None else [ack]) if a is not None]

    # -- coordination ---------------------------------------------------------------------
    def _op(self, name: str) -> _Op:
        with self._lock:
            seq = self._uses[name]
            self._uses[name] = seq + 1
        return _Op(self._generation, name, seq)

    def barrier(self, name: str, timeout: float) -> None:
        """Wait until every process reaches the barrier ``name`` (``sync`` with no value)."""
        self.sync(name, timeout)

    def sync(
        self,
        name: str,
        timeout: float,
        error: BaseException | None = None,
        *,
        doing: str = "",
        consequence: str = "",
        value: Any = None,
        passthrough: tuple[type[BaseException], ...] = (),
    ) -> list[Any] | None:
        """Arrive at the barrier ``name`` with this process's outcome (``error``: its part failed)
        and, optionally, a small picklable ``value`` for the primary.

        Raises :class:`HostError` in every process if any process failed, and names the
        processes that did not arrive within ``timeout``; when every failed process's error is
        of a ``passthrough`` type, every process raises the lowest process's error itself (from
        that HostError). Returns, on the primary, every process's ``value`` in process order
        when a value was posted; None elsewhere.
        """
        op = self._op(name)
        if isinstance(error, passthrough):
            try:
                self._client.key_value_set_bytes(
                    f"{op.keys}/error/{self._index}", pickle.dumps(error), allow_overwrite=True
                )
            except Exception:  # not picklable: the HostError says what it was
                pass
        failed, values = self._arrive(op, timeout, error, consequence, value)
        if failed:
            host_error = self._failed(failed, doing, consequence)
            if passthrough:
                try:
                    posted = {
                        int(k.rsplit("/", 1)[-1]): v
                        for k, v in self._client.key_value_dir_get_bytes(f"{op.keys}/error/")
                    }
                except Exception:
                    posted = {}
                first = failed[0][0]
                if all(p in posted for p, _ in failed):
                    own = error if first == self._index else None
                    chosen: BaseException = own or pickle.loads(posted[first])
                    raise chosen from host_error
            raise host_error from error
        return values

    def _arrive(
        self,
        op: _Op,
        timeout: float,
        error: BaseException | None,
        consequence: str,
        value: Any = None,
    ) -> tuple[list[tuple[int, str]], list[Any] | None]:
        """Post this process's outcome (and value) and wait for every process; the failures they
        posted, and on the primary the values. Raises :class:`HostError` naming the processes
        that did not arrive in time."""
        client = self._client
        if error is not None:
            client.key_value_set(
                f"{op.keys}/failed/{self._index}", _describe(error), allow_overwrite=True
            )
        if value is not None:
            payload = zlib.compress(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL), 1)
            client.key_value_set_bytes(
                f"{op.keys}/value/{self._index}", payload, allow_overwrite=True
            )
        client.key_value_set(f"{op.keys}/arrived/{self._index}", "1", allow_overwrite=True)
        try:
            client.wait_at_barrier(op.barrier_id, _ms(timeout))
        except Exception as e:
            raise self._not_arrived(op, timeout, e, consequence) from (
                error if error is not None else e
            )
        failed = self._failures(op)
        client.key_value_delete(f"{op.keys}/arrived/{self._index}")
        values = None
        if self.is_primary():
            posted = dict(client.key_value_dir_get_bytes(f"{op.keys}/value/"))
            if posted:
                client.key_value_delete(f"{op.keys}/value/")
                by_process = {
                    int(k.rsplit("/", 1)[-1]): pickle.loads(zlib.decompress(v))
                    for k, v in posted.items()
                }
                values = [by_process[p] for p in sorted(by_process)]
        return failed, values

    @staticmethod
    def _failed(failed: list[tuple[int, str]], doing: str, consequence: str) -> HostError:
        what = f" {doing}" if doing else ""
        parts = "; ".join(f"process {p} failed{what}: {msg}" for p, msg in failed[:4])
        more = f" (and {len(failed) - 4} more)" if len(failed) > 4 else ""
        return HostError(f"{parts}{more}. {consequence}".rstrip(), hosts=(p for p, _ in failed))

    def _failures(self, op: _Op) -> list[tuple[int, str]]:
        try:
            entries = self._client.key_value_dir_get(f"{op.keys}/failed/")
        except Exception:
            return []
        return sorted((int(k.rsplit("/", 1)[-1]), v) for k, v in entries)

    def _not_arrived(
        self, op: _Op, timeout: float, cause: BaseException, consequence: str
    ) -> HostError:
        failed = self._failures(op)
        try:
            arrived = {
                int(k.rsplit("/", 1)[-1])
                for k, _ in self._client.key_value_dir_get(f"{op.keys}/arrived/")
            }
        except Exception:
            arrived = set()
        missing = [p for p in range(self._count) if p not in arrived]
        me = f"(this is process {self._index} of {self._count})"
        extra = "".join(f" Process {p} reported: {msg}." for p, msg in failed[:4])
        if missing:
            shown = ", ".join(map(str, missing[:16])) + (", ..." if len(missing) > 16 else "")
            noun = "process" if len(missing) == 1 else "processes"
            return HostError(
                f"{noun} {shown} did not reach {op.name!r} within {timeout:g}s {me}: they "
                "died, hung, raised an error before it, or did not make this milepost call "
                "(every process of the job must make the same milepost calls, in the same "
                f"order); check their logs.{extra} {consequence}".rstrip(),
                hosts=missing,
            )
        return HostError(
            f"the barrier {op.name!r} failed {me}: {cause}.{extra} {consequence}".rstrip(),
            hosts=(p for p, _ in failed),
        )

    def broadcast(self, name: str, value: Any, timeout: float) -> Any:
        """The primary's ``value`` in every process (the others pass anything, e.g. None).

        The primary publishes and returns at once; each other process reads, and the last
        reader deletes the key.
        """
        op = self._op(f"broadcast:{name}")
        key = f"{op.keys}/value"
        client = self._client
        if self.is_primary():
            try:
                payload = b"V" + zlib.compress(
                    pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL), 1
                )
            except Exception as e:
                client.key_value_set_bytes(key, b"E" + _describe(e).encode(), allow_overwrite=True)
                raise HostError(
                    f"the primary could not send {name!r} to the other processes: {_describe(e)}"
                ) from e
            client.key_value_set_bytes(key, payload, allow_overwrite=True)
            return value
        try:
            payload = client.blocking_key_value_get_bytes(key, _ms(timeout))
        except Exception as e:
            raise HostError(
                f"the primary process {self.primary} did not publish {name!r} within {timeout:g}s "
                f"(this is process {self._index} of {self._count}): it died, hung, raised an error "
                "before it, or did not make this milepost call (every process of the job must make "
                "the same milepost calls, in the same order); check its logs",
                hosts=[self.primary],
            ) from e
        if client.key_value_increment(f"{op.keys}/read", 1) == self._count - 1:
            client.key_value_delete(key)
            client.key_value_delete(f"{op.keys}/read")
        if payload[:1] == b"E":
            raise HostError(
                f"the primary could not send {name!r} to the "
                f"other processes: {payload[1:].decode()}"
            )
        return pickle.loads(zlib.decompress(payload[1:]))


# ------------------------------------------------------------------------------------------
# The default group of this process's jax.distributed runtime
# ------------------------------------------------------------------------------------------

_default_lock = threading.Lock()
_default: MultiControllerHostGroup | None = None
_default_primary = 0


def set_primary_process(index: int) -> None:
    """Choose the process that writes metadata and commits in multi-controller jobs (default 0).

    Call it in every process with the same index, before the saves and loads it should apply to.
    """
    global _default_primary
    check.integer(
        index, "the primary process", minimum=0, error=ValueError, expect="a non-negative int"
    )
    with _default_lock:
        _default_primary = index


def default_group() -> MultiControllerHostGroup | None:
    """The multi-controller group of this process's ``jax.distributed`` runtime, or None when
    the job has a single process. One group per runtime: re-initializing gives a new one."""
    if jax.process_count() <= 1:
        return None
    global _default
    client = distributed_client()
    with _default_lock:
        group = _default
        if group is None or group._client is not client or group.primary != _default_primary:
            group = _default = MultiControllerHostGroup(_default_primary, client=client)
        return group
