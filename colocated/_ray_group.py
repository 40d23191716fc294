"""The controller side of a Ray slice: a host group whose hosts are Ray actors.

Every message to a host goes through :meth:`RayHostGroup.call` and every answer through
:meth:`RayHostGroup.gather`, which count their pickled sizes (``traffic()``) so tests can prove
that checkpointing sends plans and ids, never array bytes. Every wait has a timeout; a host that
dies, hangs or fails is reported by name (index, node, ip, pid) as a :class:`HostError`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import pickle
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import milepost.workers as workers
from milepost.colocated._errors import HostError
from milepost.colocated._handles import RemoteArray
from milepost.colocated._hostgroup import DevicesHere, HostLoad, PendingHostSave
from milepost.colocated._ray_host import Ref

log = logging.getLogger("milepost.slice")

WAIT_GROUP = "wait"
"""The actors' concurrency group for waits on background writes: a host keeps serving
``run``/``load`` calls (one at a time, in the controller's order) while its writes land."""


def pickled_size(value: Any) -> int:
    """Bytes ``value`` takes on the wire (out-of-band buffers counted, not copied)."""
    import cloudpickle  # (a slice's own dependency, with Ray)

    buffers: list[pickle.PickleBuffer] = []
    head = cloudpickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    return len(head) + sum(b.raw().nbytes for b in buffers)


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Controller<->host message counts and pickled bytes since the group started."""

    messages: int = 0
    """Messages exchanged with the hosts."""
    bytes_to_hosts: int = 0
    """Pickled bytes sent to the hosts."""
    bytes_from_hosts: int = 0
    """Pickled bytes received from the hosts."""

    @property
    def total_bytes(self) -> int:
        """Bytes both ways."""
        return self.bytes_to_hosts + self.bytes_from_hosts

    def __sub__(self, other: Traffic) -> Traffic:
        return Traffic(
            self.messages - other.messages,
            self.bytes_to_hosts - other.bytes_to_hosts,
            self.bytes_from_hosts - other.bytes_from_hosts,
        )


class _PendingRaySave:
    """The hosts' background writes of one save: a :class:`~milepost.workers.PendingWrite`
    (see ``HostGroup.start_save``). Its ``wait_save`` calls were sent with the ``start_save``
    calls, so a host answers as soon as its writes land (no round trip after the staging)."""

    def __init__(self, group: RayHostGroup, token: str, waits: Mapping[int, Any]) -> None:
        self._group = group
        self._token = token
        self._waits = dict(waits)

    def wait(self, timeout: float | None = None) -> list[workers.SaveAck]:
        t = self._group.timeout_secs if timeout is None else timeout
        acks = self._group.gather(self._waits, t, "writing its checkpoint shards")
        return [acks[i] for i in sorted(acks)]

    def settle(self, timeout: float | None = None) -> None:
        """After a failure: let the live hosts' writes land (outcome ignored, bounded).

        Fresh ``settle_save`` calls, not the ``wait_save`` calls already made: a failure
        cancels a gather's pending calls, and a cancelled call reports done at once while the
        host may still be writing."""
        # None: as long as the storage may take to give up on a request (the host's own budget),
        # and a margin for the call itself.
        t = workers.storage_budget_secs() + 30.0 if timeout is None else timeout
        live = [i for i in self._waits if i not in self._group.failed_hosts]
        settles = {
            i: self._group.call(
                i, "settle_save", self._token, timeout, concurrency_group=WAIT_GROUP
            )
            for i in live
        }
        self._group.settle(settles, t)


@dataclasses.dataclass
class _Answers:
    """What a gather has heard so far: each host's value, or its failure."""

    results: dict[int, Any] = dataclasses.field(default_factory=dict)
    failures: list[str] = dataclasses.field(default_factory=list)
    failed: list[int] = dataclasses.field(default_factory=list)  # (the hosts of ``failures``)
    causes: list[BaseException] = dataclasses.field(default_factory=list)
    dead: bool = False
    """Whether a host died or did not answer (the slice is then unhealthy)."""


def _cancel(pending: Mapping[Any, int]) -> None:
    """Drop the calls left, if they have not started: a hung host must not act on them later
    (say, write into a temporary directory the controller has removed)."""
    import ray

    for ref in pending:
        try:
            ray.cancel(ref)
        except Exception as e:
            log.info("could not cancel a call to a failed slice: %s", e)


class RayHostGroup:
    """H Ray actors forming one ``jax.distributed`` cluster, as a milepost host group."""

    name = "slice"
    """``slice``."""

    def __init__(
        self,
        actors: list[Any],
        identities: list[dict[str, Any]],
        device_ids: list[list[int]],
        timeout_secs: float,
    ) -> None:
        self.timeout_secs = timeout_secs
        """How long a call to the hosts waits for their answers when it is given no timeout."""
        self._actors = actors
        self._identities = identities
        self._device_ids = device_ids
        self._owner = {d: i for i, ids in enumerate(device_ids) for d in ids}
        self._checked_ids: tuple[int, ...] | None = None
        """The device ids :meth:`check_devices` last found in the slice."""
        self._healthy = True
        self._closed = False
        self._failed: set[int] = set()
        """Hosts that died or hung in some call: nothing more is awaited from them."""
        self._counts = [0, 0, 0]  # messages, bytes to hosts, bytes from hosts
        self._lock = threading.Lock()
        self.owner: Callable[[], Any] = lambda: None
        """The Slice these hosts are (a weak reference the Slice sets): a recovery onto them
        reports it."""
        self._released: collections.deque[str] = collections.deque()
        """Ids of handles the controller dropped; appended by finalizers (any thread, maybe in
        the middle of a call), sent to the hosts in one batch by the next call."""

    # -- state ----------------------------------------------------------------------------
    @property
    def hosts(self) -> int:
        """The number of hosts."""
        return len(self._actors)

    @property
    def device_ids(self) -> list[int]:
        """Every global device id, host by host."""
        return [d for ids in self._device_ids for d in ids]

    @property
    def device_ids_by_host(self) -> list[list[int]]:
        """Each host's global device ids, host by host."""
        return [list(ids) for ids in self._device_ids]

    @property
    def healthy(self) -> bool:
        """False once a host failed or the group was closed: start a new slice then."""
        return self._healthy and not self._closed

    def actor(self, i: int) -> Any:
        """Host ``i``'s actor handle (for calls one host makes to another)."""
        return self._actors[i]

    def describe_host(self, i: int) -> str:
        """Host ``i`` in words, for messages: its index, Ray node, ip and pid."""
        ident = self._identities[i]
        return f"host {i} (node {ident['node'][:12]}, ip {ident['ip']}, pid {ident['pid']})"

    def identities(self) -> list[dict[str, Any]]:
        """Each host's Ray node id, ip and pid."""
        return [dict(ident) for ident in self._identities]

    def traffic(self) -> Traffic:
        """The messages and bytes exchanged with the hosts so far."""
        with self._lock:
            return Traffic(*self._counts)

    def check_usable(self) -> None:
        """Raise a ``HostError`` saying what to do if the group is closed or a host failed."""
        if self._closed:
            raise HostError("the slice is shut down; start a new one")
        if not self._healthy:
            raise HostError(
                "the slice is unhealthy after a host failure; shut it down and start a new one"
            )

    def _count(self, to_hosts: int = 0, from_hosts: int = 0, messages: int = 0) -> None:
        with self._lock:
            self._counts[0] += messages
            self._counts[1] += to_hosts
            self._counts[2] += from_hosts

    # -- messaging ------------------------------------------------------------------------
    def call(
        self,
        i: int,
        method: str,
        *args: Any,
        concurrency_group: str | None = None,
        size: int | None = None,
    ) -> Any:
        """Send one message to host ``i``; returns its Ray object ref (see :meth:`gather`).
        ``size``: the bytes to count when ``args`` hold object-store refs (``Slice.put``)."""
        self._flush_releases()
        self._count(to_hosts=pickled_size(args) if size is None else size, messages=1)
        remote = getattr(self._actors[i], method)
        if concurrency_group is not None:
            remote = remote.options(concurrency_group=concurrency_group)
        return remote.remote(*args)

    def gather(
        self,
        calls: Mapping[int, Any],
        timeout: float,
        doing: str,
        passthrough: tuple[type[BaseException], ...] = (),
    ) -> dict[int, Any]:
        """The answers of ``calls`` (host -> ref), or a HostError naming every host that died,
        failed or did not answer within ``timeout`` seconds. Returns at the first failure:
        the other hosts may be blocked in a collective with the failed one. When every failure
        is a live host's error of a ``passthrough`` type, the first is raised itself (from the
        HostError naming the hosts)."""
        pending = {ref: i for i, ref in calls.items()}
        answers = _Answers()
        self._collect(pending, answers, time.monotonic() + timeout, doing)
        if not answers.failures and pending:
            self._time_out(pending, answers, timeout, doing)
        if answers.dead:
            _cancel(pending)
        if answers.failures:
            self._raise(answers, passthrough)
        return answers.results

    def _collect(
        self, pending: dict[Any, int], answers: _Answers, deadline: float, doing: str
    ) -> None:
        """Take the answers as they come, until all are in, one failed, or ``deadline`` (what is
        left in ``pending`` did not answer). It stops at the first failure: the other hosts
        may be blocked in a collective with the failed one, and would never answer."""
        import ray

        while pending and not answers.failures:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=remaining)
            for ref in ready:
                self._take(ref, pending.pop(ref), answers, doing)

    def _take(self, ref: Any, i: int, answers: _Answers, doing: str) -> None:
        """Host ``i``'s answer: its value (counted, and told to a progress bar), or its failure:
        a dead host (marked failed at once) or a host's error (its cause kept, for
        ``passthrough``)."""
        import ray

        try:
            value = ray.get(ref, timeout=0)
        except ray.exceptions.RayActorError as e:
            answers.dead = True
            self._failed.add(i)
            answers.failed.append(i)
            answers.failures.append(
                f"{self.describe_host(i)} died while {doing} ({type(e).__name__})"
            )
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None) or e
            answers.causes.append(cause)
            answers.failed.append(i)
            answers.failures.append(
                f"{self.describe_host(i)} failed while {doing}: {type(cause).__name__}: {cause}"
            )
        else:
            answers.results[i] = value
            self._count(from_hosts=pickled_size(value))
            workers.progress.acked(
                i, value
            )  # a progress bar counts the host's bytes as it finishes

    def _time_out(
        self, pending: dict[Any, int], answers: _Answers, timeout: float, doing: str
    ) -> None:
        """The hosts that did not answer in time, with no other failure: each is marked failed
        (a hung host is as good as dead to this slice)."""
        answers.dead = True
        self._failed.update(pending.values())
        answers.failed = sorted(pending.values())
        answers.failures = [
            f"{self.describe_host(i)} did not answer within {timeout:g}s while {doing}"
            for i in sorted(pending.values())
        ]

    def _raise(self, answers: _Answers, passthrough: tuple[type[BaseException], ...]) -> None:
        """The HostError naming every failure (after the calls left are cancelled: a host that
        died leaves the slice unhealthy); or, when every failure is a live host's error of a
        ``passthrough`` type, the first of them, from that HostError."""
        if answers.dead:
            self._healthy = False
        hint = (
            " The slice is now unhealthy; shut it down and start a new one." if answers.dead else ""
        )
        error = HostError("; ".join(answers.failures) + "." + hint, hosts=answers.failed)
        if (
            not answers.dead
            and passthrough
            and len(answers.causes) == len(answers.failures)
            and all(isinstance(c, passthrough) for c in answers.causes)
        ):
            raise answers.causes[0] from error
        raise error

    def settle(self, calls: Mapping[int, Any], timeout: float) -> None:
        """Wait up to ``timeout`` for ``calls`` to finish, ignoring their outcome (hosts known to
        have failed are not waited for)."""
        import ray

        refs = [ref for i, ref in calls.items() if i not in self._failed]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=timeout)

    def all(self, method: str, *args: Any, doing: str, timeout: float | None = None) -> list[Any]:
        """Call ``method`` on every host; their answers in host order."""
        self.check_usable()
        t = self.timeout_secs if timeout is None else timeout
        out = self.gather({i: self.call(i, method, *args) for i in range(self.hosts)}, t, doing)
        return [out[i] for i in range(self.hosts)]

    def release(self, array_id: str) -> None:
        """Free a dropped handle's array on the hosts (asynchronously, with the next call)."""
        if self._healthy and not self._closed:
            self._released.append(array_id)

    def _flush_releases(self) -> None:
        if not self._released or self._closed or not self._healthy:
            return
        ids = []
        while self._released:
            try:
                ids.append(self._released.popleft())
            except IndexError:
                break
        if ids:
            self._count(to_hosts=pickled_size((ids,)) * self.hosts, messages=self.hosts)
            for actor in self._actors:
                actor.release.remote(ids)  # fire and forget: a dead host frees nothing

    # -- HostGroup protocol ---------------------------------------------------------------
    def process_of_device(self, device_id: int) -> int:
        """The host that owns global device ``device_id``; ValueError for an id not in the slice."""
        try:
            return self._owner[device_id]
        except KeyError:
            raise ValueError(
                f"device {device_id} is not in this slice (devices {self.device_ids})"
            ) from None

    def processes(self) -> Sequence[int]:
        """Every host's index."""
        return range(self.hosts)

    def is_primary(self) -> bool:
        """Always true: the controller is the only process that commits."""
        return True

    def check_devices(self, spec: workers.ShardingSpec, name: str) -> None:
        """Raise a ValueError naming array ``name`` if ``spec`` places it on devices the slice
        does not have, saying how to place it on the slice instead."""
        # The arrays of a model share a few shardings (one object each, as read): check each
        # once, not its device ids (all of the slice's) once per array.
        if spec.device_ids is self._checked_ids:
            return
        missing = [d for d in spec.device_ids if d not in self._owner]
        if missing:
            raise ValueError(
                f"cannot load {name!r} with its saved sharding: devices {missing[:8]} are not in "
                f"this slice (it has {self.device_ids[:8]}...); pass an abstract tree whose "
                "leaves carry shardings over slice.mesh(...), e.g. milepost.AbstractArray(shape, "
                "dtype, mesh.sharding(PartitionSpec(...)))"
            )
        self._checked_ids = spec.device_ids  # held: the same tuple, never another at its id

    def mesh_device_ids(
        self, axis_names: tuple[str, ...], axis_sizes: tuple[int, ...]
    ) -> tuple[int, ...]:
        """The slice's devices, host by host (as ``slice.mesh`` orders them)."""
        if math.prod(axis_sizes) != len(self.device_ids):
            raise ValueError(
                "the sharding is on an AbstractMesh "
                f"{dict(zip(axis_names, axis_sizes, strict=True))} of "
                f"{math.prod(axis_sizes)} devices, but the slice has {len(self.device_ids)}; "
                "give the abstract tree shardings over slice.mesh(...)"
            )
        return tuple(self.device_ids)

    def devices_here(self) -> DevicesHere:
        """The slice's devices, host by host; their memory kinds are the hosts' to know."""
        return DevicesHere(tuple(self.device_ids), None, "this slice")

    def start_save(
        self, plans: Mapping[int, workers.SavePlan], sources: Sequence[Any], timeout: float
    ) -> PendingHostSave:
        """Stage on every host: sources go as ids, which each host resolves in its registry."""
        self.check_usable()
        refs = []
        for k, s in enumerate(sources):
            group = getattr(s, "__milepost_host_group__", None)
            if group is not self:
                raise TypeError(
                    f"source {k} ({type(s).__name__}) is not an array of this slice; a slice host "
                    "can only save RemoteArrays of its own slice"
                )
            refs.append(Ref(s.id))
        # Each host's wait for its writes goes out with its plan (it runs in the host's wait
        # group, and first waits for the staging): once staged, a host answers as soon as its
        # writes land, without another round trip from the controller.
        token = uuid.uuid4().hex
        calls = {i: self.call(i, "start_save", plan, refs, token) for i, plan in plans.items()}
        waits = {
            i: self.call(i, "wait_save", token, timeout, concurrency_group=WAIT_GROUP)
            for i in plans
        }
        try:
            self.gather(calls, timeout, "copying its shards to host memory")
        except HostError:
            # Only once every live host's wait ended (its staging failed, or its writes landed;
            # a host may still be staging now) may the caller remove the temporary directory.
            # A staging call the failure cancelled before it ran never wakes its wait: the
            # host's next call in order does (bounded; hosts that died or hung are skipped).
            import ray

            answered, _ = ray.wait(list(calls.values()), num_returns=len(calls), timeout=0)
            for i, ref in calls.items():
                if ref not in answered and i not in self._failed:
                    self.call(i, "abandon_save", token)
            self.settle(waits, timeout)
            raise
        return _PendingRaySave(self, token, waits)

    def load(self, plans: Mapping[int, workers.LoadPlan], timeout: float) -> HostLoad:
        """Every host reads the ranges its devices need and registers its part of each global
        array under ``<prefix>.<k>``; the controller gets handles."""
        self.check_usable()
        prefix = uuid.uuid4().hex
        acks = self.gather(
            {
                i: self.call(i, "load", *args, size=n)
                for i, (args, n) in self._shared(plans, prefix)
            },
            timeout,
            "reading its shards",
            # what a host found wrong with the checkpoint is the caller's error, as embedded
            passthrough=(workers.CorruptCheckpointError, workers.CheckpointNotFoundError),
        )
        (plan, *_) = plans.values()
        out = []
        for k, task in enumerate(plan.tasks):
            spec = task.sharding
            if not isinstance(spec, workers.ShardingSpec):
                spec = workers.ShardingSpec.from_jax(spec)
            if (
                task.random_key_impl is not None
            ):  # typed keys: the spec of the keys, not of their data
                spec = dataclasses.replace(spec, spec=spec.spec[: len(task.result_shape)])
            out.append(
                RemoteArray(self, f"{prefix}.{k}", task.result_shape, task.result_dtype, spec)
            )
        return HostLoad(out, [acks[i] for i in sorted(acks)])

    def _shared(self, plans: Mapping[int, Any], *rest: Any) -> list[tuple[int, Any]]:
        """Each host's call arguments ``(plan, *rest)`` and their size: a plan object that several
        hosts share (a load without per-host checksums) is pickled once, into the object store,
        and each host is sent its reference (each still receives its bytes, and is counted so);
        a plan of one host goes in its call."""
        import ray

        hosts: dict[int, list[int]] = {}
        for i, plan in plans.items():
            hosts.setdefault(id(plan), []).append(i)
        out: list[tuple[int, Any]] = []
        for mine in hosts.values():
            plan = plans[mine[0]]
            if len(mine) == 1:
                out.append((mine[0], ((plan, *rest), None)))
                continue
            size = pickled_size((plan, *rest))
            ref = ray.put(plan)
            out.extend((i, ((ref, *rest), size)) for i in mine)
        return out

    def run(self, job: str, plans: Mapping[int, Any], timeout: float) -> list[Any]:
        """Every host runs its part of the host job ``job``; their acks, in host order."""
        self.check_usable()
        acks = self.gather(
            {i: self.call(i, "run_job", job, p) for i, p in plans.items()},
            timeout,
            f"running {job}",
        )
        return [acks[i] for i in sorted(acks)]

    def wrap(self, described: Any) -> Any:
        """Handles for a tree of ``(id, shape, dtype, ShardingSpec)`` that hosts registered."""
        import jax

        return jax.tree_util.tree_map(
            lambda d: RemoteArray(self, *d),
            described,
            is_leaf=lambda x: (
                isinstance(x, tuple) and len(x) == 4 and isinstance(x[3], workers.ShardingSpec)
            ),
        )

    def barrier(self, name: str, timeout: float) -> None:
        """Nothing to wait for: one controller."""
        return None

    @property
    def failed_hosts(self) -> frozenset[int]:
        """The indices of the hosts that failed."""
        return frozenset(self._failed)

    def broadcast(self, name: str, value: Any, timeout: float) -> Any:
        """``value`` itself: one controller."""
        return value

    # -- shutdown -------------------------------------------------------------------------
    def close(self, placement_group: Any) -> None:
        """End the actors (and their distributed runtime) and free the placement group;
        tolerates dead hosts and a Ray runtime that is already gone."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if self._closed:
            return
        self._closed = True
        if not ray.is_initialized():
            return
        if self._healthy:
            try:
                ray.get([a.shutdown.remote() for a in self._actors], timeout=30)
            except Exception as e:
                log.info("hosts did not all shut down cleanly: %s", e)
        for a in self._actors:
            try:
                ray.kill(a)
            except Exception as e:
                log.info("could not kill a host actor: %s", e)
        if placement_group is not None:
            try:
                remove_placement_group(placement_group)
            except Exception as e:
                log.info("could not remove the placement group: %s", e)

    def __repr__(self) -> str:
        return f"RayHostGroup(hosts={self.hosts}, healthy={self.healthy})"
