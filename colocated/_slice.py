"""Single-controller slices on Ray: the controller holds handles, the hosts hold the data.

``Slice.start(hosts=H, devices_per_host=D)`` starts H Ray actors that form one
``jax.distributed`` cluster. The controller plans; hosts copy, write, read and place. The slice
is also a host group (see ``_hostgroup.py``): checkpoint calls on trees of ``RemoteArray``s run
their plans on its actors.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import threading
import uuid
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import cloudpickle
import numpy as np

from milepost import workers
from milepost.colocated._errors import HostError
from milepost.colocated._ray_host import HostActor, Ref

log = logging.getLogger("milepost.slice")


# ------------------------------------------------------------------------------------------
# Controller-side handles
# ------------------------------------------------------------------------------------------


class SliceSharding:
    """A sharding over a slice's global devices, described by device ids only."""

    def __init__(self, slice_: Slice, spec: workers.ShardingSpec) -> None:
        self.milepost_spec = spec
        self.__milepost_host_group__ = slice_

    @property
    def spec(self) -> tuple[Any, ...]:
        return self.milepost_spec.spec

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SliceSharding) and other.milepost_spec == self.milepost_spec

    def __hash__(self) -> int:
        return hash(self.milepost_spec)

    def __repr__(self) -> str:
        return f"SliceSharding({self.milepost_spec.describe()})"


class SliceMesh:
    """A mesh over a slice's global device ids (controller-side; no JAX devices needed)."""

    def __init__(self, slice_: Slice, axes: Mapping[str, int], device_ids: Sequence[int]) -> None:
        self._slice = slice_
        self.shape = dict(axes)
        self.axis_names = tuple(axes)
        self.device_ids = tuple(device_ids)

    def sharding(self, spec: Any = None) -> SliceSharding:
        entries = tuple(spec) if spec is not None else ()
        return SliceSharding(
            self._slice,
            workers.ShardingSpec.named(tuple(self.shape.values()), self.axis_names, self.device_ids, entries),
        )

    def __repr__(self) -> str:
        return f"SliceMesh({self.shape})"


@dataclasses.dataclass(frozen=True)
class AbstractArray:
    """Shape, dtype and (slice or JAX) sharding of an array to load."""

    shape: tuple[int, ...]
    dtype: Any
    sharding: Any = None


class RemoteArray:
    """The controller's handle to a global array held by the slice's hosts."""

    def __init__(self, slice_: Slice, array_id: str, shape: tuple[int, ...], dtype: Any, spec: workers.ShardingSpec) -> None:
        self.id = array_id
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.sharding = SliceSharding(slice_, spec)
        self.__milepost_host_group__ = slice_
        self._finalizer = weakref.finalize(self, slice_._release, array_id)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __repr__(self) -> str:
        return f"RemoteArray(shape={self.shape}, dtype={self.dtype}, sharding={self.sharding.milepost_spec.describe()})"


# ------------------------------------------------------------------------------------------
# The slice
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class SliceOptions:
    timeout_secs: float = 300.0
    """How long any host may take to answer before the slice reports it by name."""
    start_timeout_secs: float = 300.0
    cpus_per_host: float = 0.5
    """Ray CPUs each host actor reserves (its bundle in the placement group)."""


class _PendingSlice:
    def __init__(self, slice_: Slice, tokens: dict[int, Any]) -> None:
        self._slice = slice_
        self._tokens = tokens

    def wait(self, timeout: float | None = None) -> list[workers.SaveAck]:
        t = timeout if timeout is not None else self._slice.options.timeout_secs
        calls = {i: self._slice._call(i, "wait_save", token, t) for i, token in self._tokens.items()}
        return list(self._slice._gather(calls, t, "writing its checkpoint shards").values())


class Slice:
    """H worker hosts on Ray, each a JAX process with D devices, driven from this controller."""

    name = "slice"

    def __init__(self, actors: list[Any], identities: list[dict[str, Any]], device_ids: list[list[int]],
                 placement_group: Any, options: SliceOptions) -> None:
        self.options = options
        self._actors = actors
        self._identities = identities
        self._device_ids = device_ids
        self._owner = {d: i for i, ids in enumerate(device_ids) for d in ids}
        self._pg = placement_group
        self._healthy = True
        self._closed = False
        self._lock = threading.Lock()
        self.bytes_to_hosts = 0
        self.bytes_from_hosts = 0
        self.messages = 0

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def start(cls, *, hosts: int, devices_per_host: int, options: SliceOptions | None = None,
              ray_init: Mapping[str, Any] | None = None) -> Slice:
        """Start a local Ray runtime if none is running, and ``hosts`` actors on it."""
        import ray

        if not ray.is_initialized():
            kwargs = {"include_dashboard": False, "log_to_driver": False, "num_cpus": max(os.cpu_count() or 1, hosts)}
            kwargs.update(ray_init or {})
            ray.init(**kwargs)
        return cls._launch(hosts, devices_per_host, "PACK", options or SliceOptions())

    @classmethod
    def connect(cls, *, address: str = "auto", hosts: int, devices_per_host: int | None = None,
                options: SliceOptions | None = None) -> Slice:
        """Use an existing Ray cluster: one host actor on each of ``hosts`` nodes (STRICT_SPREAD)."""
        import ray

        if not ray.is_initialized():
            ray.init(address=address, log_to_driver=False)
        return cls._launch(hosts, devices_per_host, "STRICT_SPREAD", options or SliceOptions())

    @classmethod
    def _launch(cls, hosts: int, devices_per_host: int | None, strategy: str, options: SliceOptions) -> Slice:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if hosts < 1:
            raise ValueError(f"a slice needs at least one host, got hosts={hosts}")
        pg = placement_group([{"CPU": options.cpus_per_host}] * hosts, strategy=strategy)
        try:
            ray.get(pg.ready(), timeout=options.start_timeout_secs)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(pg)
            raise HostError(
                f"Ray could not place {hosts} hosts ({strategy}, {options.cpus_per_host} CPU each) within "
                f"{options.start_timeout_secs}s; the cluster has {ray.cluster_resources()}"
            ) from None
        env = {"JAX_PLATFORMS": "cpu"} if devices_per_host else {}
        if devices_per_host:
            env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices_per_host}"
        remote = ray.remote(HostActor)
        actors = [
            remote.options(
                num_cpus=options.cpus_per_host,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i),
                runtime_env={"env_vars": env},
                max_restarts=0,
            ).remote(i, hosts, devices_per_host or 0)
            for i in range(hosts)
        ]
        try:
            identities = ray.get([a.identity.remote() for a in actors], timeout=options.start_timeout_secs)
            port = ray.get(actors[0].free_port.remote(), timeout=options.start_timeout_secs)
            coordinator = f"{identities[0]['ip']}:{port}"
            device_ids = ray.get(
                [a.initialize.remote(coordinator, int(options.start_timeout_secs)) for a in actors],
                timeout=options.start_timeout_secs,
            )
        except Exception as e:
            for a in actors:
                ray.kill(a)
            remove_placement_group(pg)
            raise HostError(f"starting the slice's {hosts} hosts failed: {e}") from e
        s = cls(actors, identities, device_ids, pg, options)
        log.info("milepost slice started: %d hosts, devices %s", hosts, device_ids)
        return s

    def __enter__(self) -> Slice:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """End the host actors (and their distributed runtime) and free the placement group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if self._closed:
            return
        self._closed = True
        if not ray.is_initialized():
            return  # the Ray runtime (and with it every actor) is already gone
        try:
            ray.get([a.shutdown.remote() for a in self._actors], timeout=30)
        except Exception as e:  # a dead host, or handles from an earlier Ray session
            log.info("milepost slice: hosts did not all shut down cleanly: %s", e)
        for a in self._actors:
            try:
                ray.kill(a)
            except Exception as e:
                log.info("milepost slice: could not kill a host actor: %s", e)
        try:
            remove_placement_group(self._pg)
        except Exception as e:
            log.info("milepost slice: could not remove the placement group: %s", e)

    # -- introspection --------------------------------------------------------------------
    @property
    def hosts(self) -> int:
        return len(self._actors)

    @property
    def device_ids(self) -> list[int]:
        """Global device ids, host by host (not contiguous across hosts)."""
        return [d for ids in self._device_ids for d in ids]

    @property
    def healthy(self) -> bool:
        return self._healthy and not self._closed

    def describe_host(self, i: int) -> str:
        ident = self._identities[i]
        return f"host {i} (node {ident['node'][:12]}, ip {ident['ip']}, pid {ident['pid']})"

    def mesh(self, axes: Mapping[str, int]) -> SliceMesh:
        size = int(np.prod(list(axes.values())))
        if size != len(self.device_ids):
            raise ValueError(f"mesh {dict(axes)} has {size} devices but the slice has {len(self.device_ids)}")
        return SliceMesh(self, axes, self.device_ids)

    # -- messaging ------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._closed:
            raise HostError("the slice is shut down; start a new one")
        if not self._healthy:
            raise HostError("the slice is unhealthy after a host failure; shut it down and start a new one")

    def _call(self, i: int, method: str, *args: Any) -> Any:
        size = len(pickle.dumps(args, protocol=5)) if not any(isinstance(a, bytes) and len(a) > 1 << 20 for a in args) else 0
        with self._lock:
            self.bytes_to_hosts += size
            self.messages += 1
        return getattr(self._actors[i], method).remote(*args)

    def _gather(self, calls: Mapping[int, Any], timeout: float, doing: str) -> dict[int, Any]:
        import ray

        refs = {ref: i for i, ref in calls.items()}
        ready, not_ready = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
        results: dict[int, Any] = {}
        failures = []
        for ref in ready:
            i = refs[ref]
            try:
                value = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                failures.append(f"{self.describe_host(i)} died while {doing}: {type(e).__name__}")
                continue
            except ray.exceptions.RayTaskError as e:
                cause = e.cause if getattr(e, "cause", None) is not None else e
                failures.append(f"{self.describe_host(i)} failed while {doing}: {type(cause).__name__}: {cause}")
                continue
            results[i] = value
            with self._lock:
                self.bytes_from_hosts += len(pickle.dumps(value, protocol=5))
        for ref in not_ready:
            failures.append(f"{self.describe_host(refs[ref])} did not answer within {timeout}s while {doing}")
        if failures:
            self._healthy = False
            raise HostError("; ".join(failures) + ". The slice is now unhealthy; start a new one.")
        return results

    def _all(self, method: str, *args: Any, doing: str, timeout: float | None = None) -> list[Any]:
        self._check_usable()
        t = timeout or self.options.timeout_secs
        out = self._gather({i: self._call(i, method, *args) for i in range(self.hosts)}, t, doing)
        return [out[i] for i in range(self.hosts)]

    def _release(self, array_id: str) -> None:
        if self._closed or not self._healthy:
            return
        try:
            for i in range(self.hosts):
                self._call(i, "release", [array_id])
        except Exception:  # interpreter shutdown or a dead host: nothing left to free
            pass

    def _wrap(self, described: Any) -> Any:
        import jax

        return jax.tree_util.tree_map(
            lambda d: RemoteArray(self, d[0], d[1], d[2], d[3]),
            described,
            is_leaf=lambda x: isinstance(x, tuple) and len(x) == 4 and isinstance(x[3], workers.ShardingSpec),
        )

    # -- the programming model -------------------------------------------------------------
    def put(self, tree: Any, shardings: Any) -> Any:
        """Place controller NumPy data on the slice (this sends the bytes: only when you ask)."""
        import jax
        import ray

        self._check_usable()
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        sh_leaves = treedef.flatten_up_to(shardings) if not isinstance(shardings, SliceSharding) else [shardings] * len(leaves)
        out = []
        for leaf, sharding in zip(leaves, sh_leaves, strict=True):
            host = np.asarray(leaf)
            array_id = uuid.uuid4().hex
            ref = ray.put(host)
            dtypes = self._gather(
                {i: self._actors[i].put.remote(array_id, ref, sharding.milepost_spec) for i in range(self.hosts)},
                self.options.timeout_secs, "placing data",
            )
            out.append(RemoteArray(self, array_id, host.shape, dtypes[0], sharding.milepost_spec))
        return jax.tree_util.tree_unflatten(treedef, out)

    def fetch(self, tree: Any) -> Any:
        """Bring arrays back to the controller as NumPy (this moves the bytes: only when you ask)."""
        import jax

        def one(x: Any) -> Any:
            if not isinstance(x, RemoteArray):
                return x
            pieces = self._all("fetch", x.id, doing="fetching an array")
            out = np.empty(x.shape, x.dtype)
            for host_pieces in pieces:
                for index, data in host_pieces:
                    out[index] = data
            return out

        return jax.tree_util.tree_map(one, tree)

    def run(self, fn: Any, *args: Any, out_shardings: Any = None, **kwargs: Any) -> Any:
        """Run ``jax.jit(fn, out_shardings=...)`` SPMD on every host over RemoteArrays; returns
        RemoteArrays. ``out_shardings``: slice shardings (``mesh.sharding(P(...))``), or None to
        let JAX choose."""
        import jax

        def ref(x: Any) -> Any:
            return Ref(x.id) if isinstance(x, RemoteArray) else x

        args_ = jax.tree_util.tree_map(ref, args)
        kwargs_ = jax.tree_util.tree_map(ref, kwargs)
        payload = cloudpickle.dumps(fn)
        ids = [uuid.uuid4().hex for _ in range(256)]
        specs = None
        if out_shardings is not None:
            specs = jax.tree_util.tree_map(
                lambda s: s.milepost_spec, out_shardings, is_leaf=lambda x: isinstance(x, SliceSharding)
            )
        described = self._all(
            "run", payload, args_, kwargs_, ids, specs, doing=f"running {getattr(fn, '__name__', 'a function')}"
        )
        return self._wrap(described[0])

    # -- HostGroup protocol ---------------------------------------------------------------
    def process_of_device(self, device_id: int) -> int:
        try:
            return self._owner[device_id]
        except KeyError:
            raise ValueError(f"device {device_id} is not in this slice (devices {self.device_ids})") from None

    def processes(self) -> Sequence[int]:
        return range(self.hosts)

    def is_primary(self) -> bool:
        return True

    def check_devices(self, spec: workers.ShardingSpec, name: str) -> None:
        missing = [d for d in spec.device_ids if d not in self._owner]
        if missing:
            raise ValueError(
                f"cannot load {name!r} with its saved sharding: devices {missing[:8]} are not in this slice "
                f"(it has {self.device_ids[:8]}...); pass an abstract tree with shardings over slice.mesh(...)"
            )

    def start_save(self, plans: Mapping[int, workers.SavePlan], sources: Sequence[Any], timeout: float) -> _PendingSlice:
        self._check_usable()
        refs = [Ref(s.id) if isinstance(s, RemoteArray) else None for s in sources]
        if any(r is None for r in refs):
            raise TypeError("a slice host can only save RemoteArrays of its own slice")
        calls = {i: self._call(i, "start_save", plan, refs) for i, plan in plans.items()}
        tokens = self._gather(calls, timeout, "copying its shards to host memory")
        return _PendingSlice(self, tokens)

    def load(self, plans: Mapping[int, workers.LoadPlan], timeout: float) -> list[Any]:
        self._check_usable()
        (plan, *_) = plans.values()
        ids = [uuid.uuid4().hex for _ in plan.tasks]
        self._gather({i: self._call(i, "load", p, ids) for i, p in plans.items()}, timeout, "reading its shards")
        out = []
        for task, array_id in zip(plan.tasks, ids, strict=True):
            spec = task.sharding if isinstance(task.sharding, workers.ShardingSpec) else workers.ShardingSpec.from_jax(task.sharding)
            out.append(RemoteArray(self, array_id, task.shape, task.dtype, spec))
        return out

    def barrier(self, name: str, timeout: float) -> None:
        return None

    def broadcast(self, name: str, value: Any, timeout: float) -> Any:
        return value

    def __repr__(self) -> str:
        return f"Slice(hosts={self.hosts}, devices={len(self.device_ids)}, healthy={self.healthy})"



