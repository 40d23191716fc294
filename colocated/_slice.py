"""Single-controller slices on Ray: the controller holds handles, the hosts hold the data.

``Slice.start(hosts=H, devices_per_host=D)`` starts H Ray actors (one placement-group bundle
each) that form one ``jax.distributed`` cluster. The controller plans; hosts copy, write, read
and place. Checkpoint calls on trees of the slice's ``RemoteArray``s run their plans on its
actors through its host group (``_ray_group.RayHostGroup``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import uuid
import warnings
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

import milepost.workers as workers
from milepost.colocated._actors import actor_env, host_on, host_remote
from milepost.colocated._errors import HostError, require_ray
from milepost.colocated._handles import AbstractArray, RemoteArray, SliceMesh, SliceSharding
from milepost.colocated._ray_group import RayHostGroup, Traffic, pickled_size
from milepost.colocated._ray_host import Ref
from milepost.colocated._slice_recovery import live_nodes, start_hosts
from milepost.colocated._standby import Standby
from milepost.workers import check

log = logging.getLogger("milepost.slice")

__all__ = [
    "AbstractArray",
    "RemoteArray",
    "Slice",
    "SliceMesh",
    "SliceOptions",
    "SliceSharding",
    "Traffic",
]


_RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


class _TokenAuthDefault(logging.Filter):
    """Drops Ray's notice that it turned token authentication on by default."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled")


@contextlib.contextmanager
def quiet_local_ray() -> Iterator[None]:
    """Start a local Ray runtime (``ray.init``) without the two notices the call prints:

    - Ray's "Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled
      to opt out" warning, logged when ``RAY_AUTH_MODE`` is unset and Ray turns token
      authentication on, its default. No ``ray.init`` argument sets the mode (it is the
      environment variable, which Ray reads when it is imported: set later, Ray's processes
      disagree on it), so that one record is dropped for the call; the default stands, and a
      user's own ``RAY_AUTH_MODE`` is used as Ray uses it.
    - JAX's ``os.fork() was called ... deadlock`` RuntimeWarning: ``ray.init`` starts Ray's
      processes with ``subprocess.Popen(preexec_fn=...)``, and a ``preexec_fn`` makes Python run
      the ``os.register_at_fork`` hooks, one of which JAX installs once its backends are up. The
      fork is Ray's, not milepost's (which starts no process by forking), and the child only
      blocks SIGINT and sets its parent-death signal before it executes Ray's binaries, taking
      no lock of a JAX thread; that warning is ignored for the call, by its message."""
    quiet = _TokenAuthDefault()
    logger = logging.getLogger(_RAY_AUTH_LOGGER)
    logger.addFilter(quiet)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning
            )
            yield
    finally:
        logger.removeFilter(quiet)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SliceOptions:
    """How a slice starts and how long it waits for its hosts.

    >>> s = mp.Slice.start(hosts=4, devices_per_host=2, options=mp.SliceOptions(timeout_secs=600))
    """

    timeout_secs: float = 300.0
    """How long any host may take to answer a call (``run``, ``put``, ``fetch``, staging) before
    the slice reports it by name. Checkpoint waits use ``AsyncOptions.timeout_secs``."""
    start_timeout_secs: float = 300.0
    """How long placing the actors and forming the ``jax.distributed`` cluster may take."""
    cpus_per_host: float = 0.5
    """Ray CPUs each host actor reserves (its bundle in the placement group)."""
    ray_num_cpus: int | None = None
    """``num_cpus`` for a Ray runtime that ``Slice.start`` initializes (None: max(4, hosts))."""
    ray_object_store_bytes: int = 1 << 30
    """Object store size for a Ray runtime that ``Slice.start`` initializes (only ``put`` and
    ``fetch`` use it)."""
    standby_hosts: bool = False
    """Keep idle host processes on the nodes (JAX imported; no CPU reserved): as many on each
    node as the slice has hosts there, and one on each other live node. :meth:`Slice.recover`
    then starts the new slice from them, without starting processes. Each costs an idle Python
    process (a few hundred MB of memory)."""
    forward_storage_env: bool = True
    """Give the host actors this process's storage variables (``milepost.workers.
    STORAGE_ENV_VARS``: S3 endpoint, region and credentials, GCS emulator and credentials; only
    those set), so they reach the same ``gs://`` and ``s3://`` as the controller. They travel in
    the actors' Ray ``runtime_env`` (visible to whoever can inspect the Ray cluster); set False
    when the hosts' own environment (their nodes' roles, files, variables) should decide."""

    def __post_init__(self) -> None:
        check.flag(self.forward_storage_env, "SliceOptions.forward_storage_env")
        check.flag(self.standby_hosts, "SliceOptions.standby_hosts")
        for name in ("timeout_secs", "start_timeout_secs", "cpus_per_host"):
            check.number(getattr(self, name), f"SliceOptions.{name}", positive=True)
        check.integer(self.ray_num_cpus, "SliceOptions.ray_num_cpus", minimum=1, optional=True)
        check.integer(self.ray_object_store_bytes, "SliceOptions.ray_object_store_bytes", minimum=1)


class Slice:
    """H worker hosts on Ray, each a JAX process with D devices, driven from this controller.

    >>> with milepost.Slice.start(hosts=4, devices_per_host=2) as s:
    ...     mesh = s.mesh({"data": 2, "model": 4})
    ...     params = s.run(init, key, out_shardings=mesh.sharding(P("data", "model")))
    ...     milepost.save(path, {"params": params, "step": 0})
    """

    def __init__(
        self,
        group: RayHostGroup,
        placement_group: Any,
        options: SliceOptions,
        devices_per_host: int | None = None,
    ) -> None:
        self.options = options
        """The options it was started with."""
        self._devices_per_host = devices_per_host
        self._standby: Standby | None = None
        self.group = group
        """The slice's host group: every controller<->host message goes through it."""
        group.owner = weakref.ref(self)
        self._pg = placement_group

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def start(
        cls,
        *,
        hosts: int,
        devices_per_host: int,
        options: SliceOptions | None = None,
        ray_init: Mapping[str, Any] | None = None,
    ) -> Slice:
        """Start ``hosts`` actors with ``devices_per_host`` fake CPU devices each, in the running
        Ray runtime or a local one started here (``ray_init``: extra ``ray.init`` arguments).
        Needs Ray (``pip install 'milepost[ray]'``): without it, a ``RayNotInstalledError``."""
        require_ray("milepost.Slice.start")
        import ray

        options = options or SliceOptions()
        check.integer(devices_per_host, "devices_per_host", minimum=1)
        check.integer(hosts, "hosts", minimum=1)
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {
                "include_dashboard": False,
                "log_to_driver": False,
                "num_cpus": options.ray_num_cpus or max(4, hosts),
                "object_store_memory": options.ray_object_store_bytes,
            }
            kwargs.update(ray_init or {})
            with quiet_local_ray():
                ray.init(**kwargs)
        return cls._launch(hosts, devices_per_host, "PACK", options)

    @classmethod
    def connect(
        cls,
        *,
        address: str = "auto",
        hosts: int,
        devices_per_host: int | None = None,
        options: SliceOptions | None = None,
    ) -> Slice:
        """Use an existing Ray cluster: one host actor on each of ``hosts`` nodes (STRICT_SPREAD).
        ``devices_per_host`` None: each host uses its node's real accelerators."""
        require_ray("milepost.Slice.connect")
        import ray

        check.integer(hosts, "hosts", minimum=1)
        check.integer(devices_per_host, "devices_per_host", minimum=1, optional=True)
        if not ray.is_initialized():
            ray.init(address=address, log_to_driver=False)
        return cls._launch(hosts, devices_per_host, "STRICT_SPREAD", options or SliceOptions())

    @classmethod
    def _launch(
        cls, hosts: int, devices_per_host: int | None, strategy: str, options: SliceOptions
    ) -> Slice:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        check.integer(hosts, "hosts (a slice needs at least one)", minimum=1)
        pg = placement_group([{"CPU": options.cpus_per_host}] * hosts, strategy=strategy)
        try:
            ray.get(pg.ready(), timeout=options.start_timeout_secs)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(pg)
            raise HostError(
                f"Ray could not place {hosts} hosts ({strategy}, {options.cpus_per_host} "
                f"CPU each) within {options.start_timeout_secs:g}s; the cluster has "
                f"{ray.cluster_resources()}. "
                + ("STRICT_SPREAD needs one node per host; " if strategy == "STRICT_SPREAD" else "")
                + "lower SliceOptions.cpus_per_host or add resources"
            ) from None
        actors = [
            host_remote()
            .options(
                num_cpus=options.cpus_per_host,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=i
                ),
                runtime_env={"env_vars": actor_env(devices_per_host, options)},
                max_restarts=0,
            )
            .remote(i, hosts, devices_per_host or 0)
            for i in range(hosts)
        ]
        return cls._form(actors, devices_per_host, options, pg)

    @classmethod
    def _form(
        cls,
        actors: list[Any],
        devices_per_host: int | None,
        options: SliceOptions,
        pg: Any,
        standby: Standby | None = None,
        refill: bool = True,
    ) -> Slice:
        """Make the placed ``actors`` one ``jax.distributed`` cluster, checked; a HostError (and
        every actor ended) if they do not."""
        import ray
        from ray.util.placement_group import remove_placement_group

        hosts = len(actors)
        try:
            identities = ray.get(
                [a.identity.remote() for a in actors], timeout=options.start_timeout_secs
            )
            port = ray.get(actors[0].free_port.remote(), timeout=options.start_timeout_secs)
            coordinator = f"{identities[0]['ip']}:{port}"
            device_ids = ray.get(
                [a.initialize.remote(coordinator, int(options.start_timeout_secs)) for a in actors],
                timeout=options.start_timeout_secs,
            )
            # Every host must see the same global devices, owned by the hosts that reported them.
            owner = {d: i for i, ids in enumerate(device_ids) for d in ids}
            views = ray.get(
                [a.device_map.remote() for a in actors], timeout=options.start_timeout_secs
            )
            if any(view != owner for view in views):
                raise RuntimeError(f"the hosts disagree on the global devices: {views} vs {owner}")
        except Exception as e:
            for a in actors:
                ray.kill(a)
            if pg is not None:
                remove_placement_group(pg)
            raise HostError(
                f"starting the slice's {hosts} hosts failed: {type(e).__name__}: {e}"
            ) from e
        group = RayHostGroup(actors, identities, device_ids, options.timeout_secs)
        log.info("slice started: %d hosts, devices %s", hosts, device_ids)
        made = cls(group, pg, options, devices_per_host)
        if options.standby_hosts:
            made._standby = standby or made._new_standby()
            if refill:
                made.start_standby()
        elif standby is not None:
            standby.close()
        return made

    def _new_standby(self) -> Standby:
        def make(node: str) -> Any:
            return host_on(
                node,
                index=-1,
                hosts=0,
                devices_per_host=self._devices_per_host,
                options=self.options,
                cpus=0,
            )

        return Standby(make)

    def start_standby(self) -> None:
        """Top the standby hosts up (``SliceOptions.standby_hosts``; not waited for): one per
        host on each host's node, one on each other live node. A slice starts them itself; after
        ``recover(refill=False)`` call this once the state is restored (the standbys' start
        takes the CPU a restore wants)."""
        standby = self._standby
        if standby is None:
            return
        live = set(live_nodes())
        wanted: dict[str, int] = {}
        for ident in self.group.identities():
            wanted[ident["node"]] = wanted.get(ident["node"], 0) + 1
        for node in live - wanted.keys():
            wanted[node] = 1
        standby.keep_only(live)
        standby.fill({node: n for node, n in wanted.items() if node in live})

    def recover(self, *, options: SliceOptions | None = None, refill: bool = True) -> Slice:
        """A new slice of this one's topology, after a host or node was lost: this slice is shut
        down; each host whose node is alive starts again there, with its index (its node's
        memory folders are found again); a host whose node is gone starts on a live node where
        no host of this slice ran (a spare), one such node per lost host. The new slice has the
        same global device ids, so this slice's meshes and shardings describe it too.

        With ``SliceOptions(standby_hosts=True)`` the new hosts are this slice's standby host
        processes where there are some (no process is started), and the new slice starts
        standbys again (``refill=False``: once you call :meth:`start_standby`).

        >>> s = s.recover()  # then restore the state: Checkpointer.recover does both
        """
        options = options or self.options
        before = [ident["node"] for ident in self.group.identities()]
        standby, self._standby = self._standby, None  # not shut down with this slice
        if standby is not None and not options.standby_hosts:
            standby.close()
            standby = None
        self.shutdown()
        actors = start_hosts(before, standby, options, self._devices_per_host)
        return type(self)._form(actors, self._devices_per_host, options, None, standby, refill)

    def __enter__(self) -> Slice:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """End the host actors (and their distributed runtime) and free the placement group.
        Safe to call twice, on an unhealthy slice, or after ``ray.shutdown()``."""
        if self._standby is not None:
            self._standby.close()
            self._standby = None
        self.group.close(self._pg)

    # -- introspection --------------------------------------------------------------------
    @property
    def hosts(self) -> int:
        """The number of hosts."""
        return self.group.hosts

    @property
    def device_ids(self) -> list[int]:
        """Global device ids, host by host (not contiguous across hosts: map by id)."""
        return self.group.device_ids

    @property
    def healthy(self) -> bool:
        """False once a host died or hung (or after shutdown): start a new slice."""
        return self.group.healthy

    def describe_host(self, i: int) -> str:
        """Host ``i`` in words, for messages: its index, Ray node, ip and pid."""
        return self.group.describe_host(i)

    def host_identities(self) -> list[dict[str, Any]]:
        """Each host's Ray node id, ip and pid."""
        return self.group.identities()

    def traffic(self) -> Traffic:
        """Messages and pickled bytes between this controller and the hosts so far (subtract two
        readings to measure a call)."""
        return self.group.traffic()

    def mesh(self, axes: Mapping[str, int]) -> SliceMesh:
        """A mesh over every device of the slice, host by host: ``{'data': 2, 'model': 4}``."""
        return SliceMesh(self.group, axes, self.device_ids)

    # -- the programming model -------------------------------------------------------------
    def put(self, tree: Any, shardings: Any) -> Any:
        """Place controller NumPy data on the slice (this sends the bytes: only when you ask).
        ``shardings``: one SliceSharding, or a tree of them matching ``tree``. Each distinct
        shard goes into the object store once, and each host fetches only its devices' shards."""
        import jax
        import ray

        self.group.check_usable()
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        if isinstance(shardings, SliceSharding):
            sh_leaves = [shardings] * len(leaves)
        else:
            # (jax annotates tree_flatten's treedef with a type that does not resolve)
            sh_leaves = treedef.flatten_up_to(shardings)  # type: ignore[attr-defined]
        for sh in sh_leaves:
            self._own(sh, "put")
        data = [np.asarray(leaf) for leaf in leaves]
        specs = [sh.milepost_spec for sh in sh_leaves]
        prefix = uuid.uuid4().hex
        ids = [f"{prefix}.{k}" for k in range(len(leaves))]
        parts: list[list[list[tuple[Any, Any]]]] = [
            [] for _ in range(self.hosts)
        ]  # host -> leaf -> (box, ref)
        sizes = [0] * self.hosts
        for array, spec in zip(data, specs, strict=True):
            boxes = spec.device_indices(
                array.shape
            )  # ValueError if the sharding does not divide the shape
            refs: dict[Any, Any] = {}
            mine: list[dict[Any, Any]] = [{} for _ in range(self.hosts)]
            for device, box in boxes.items():
                if box not in refs:
                    refs[box] = ray.put(
                        np.array(array[tuple(slice(a, b) for a, b in box)], order="C")
                    )
                mine[self.group.process_of_device(device)][box] = refs[box]
            for i in range(self.hosts):
                parts[i].append(list(mine[i].items()))
                sizes[i] += (
                    sum(math.prod(b - a for a, b in box) for box in mine[i]) * array.itemsize
                )
        head = pickled_size((ids, [a.shape for a in data], specs))
        calls = {
            i: self.group.call(
                i, "put", ids, [a.shape for a in data], specs, parts[i], size=head + sizes[i]
            )
            for i in range(self.hosts)
        }
        dtypes = self.group.gather(calls, self.options.timeout_secs, "placing data")[0]
        out = [
            RemoteArray(self.group, *a)
            for a in zip(ids, [a.shape for a in data], dtypes, specs, strict=True)
        ]
        return jax.tree_util.tree_unflatten(treedef, out)

    def fetch(self, tree: Any) -> Any:
        """Bring arrays back to the controller as NumPy (this moves the bytes: only when you
        ask)."""
        import jax

        leaves, treedef = jax.tree_util.tree_flatten(tree)
        remote = [x for x in leaves if isinstance(x, RemoteArray)]
        for x in remote:
            self._own(x, "fetch")
        by_id: dict[str, np.ndarray] = {}
        if remote:
            pieces = self.group.all("fetch", [x.id for x in remote], doing="fetching arrays")
            for k, x in enumerate(remote):
                out = np.empty(x.shape, x.dtype)
                for host_pieces in pieces:
                    for index, data in host_pieces[k]:
                        out[index] = data
                by_id[x.id] = out
        return jax.tree_util.tree_unflatten(
            treedef, [by_id[x.id] if isinstance(x, RemoteArray) else x for x in leaves]
        )

    def run(self, fn: Any, *args: Any, out_shardings: Any = None, **kwargs: Any) -> Any:
        """Run ``jax.jit(fn, out_shardings=...)`` SPMD on every host over RemoteArrays (other
        arguments are sent as they are); returns RemoteArrays. ``out_shardings``: slice shardings
        (``mesh.sharding(P(...))``), or None to let JAX choose."""
        import jax

        def ref(x: Any) -> Any:
            if isinstance(x, RemoteArray):
                self._own(x, "run")
                return Ref(x.id)
            return x

        args_ = jax.tree_util.tree_map(ref, args)
        kwargs_ = jax.tree_util.tree_map(ref, kwargs)
        specs = None
        if out_shardings is not None:
            specs = jax.tree_util.tree_map(
                lambda s: self._own(s, "run").milepost_spec,
                out_shardings,
                is_leaf=lambda x: isinstance(x, SliceSharding),
            )
        import cloudpickle  # (a slice's own dependency, with Ray)

        described = self.group.all(
            "run",
            cloudpickle.dumps(fn),
            args_,
            kwargs_,
            uuid.uuid4().hex,
            specs,
            doing=f"running {getattr(fn, '__name__', 'a function')}",
        )
        return self.group.wrap(described[0])

    def _own(self, x: Any, doing: str) -> Any:
        if getattr(x, "__milepost_host_group__", None) is not self.group:
            raise ValueError(
                f"slice.{doing} got {x!r}, which belongs to another slice (or none); use this "
                "slice's arrays and this slice's mesh(...).sharding(...)"
            )
        return x

    def _host_rows(self) -> list[tuple[str, ...]]:
        rows: list[tuple[str, ...]] = []
        per_host = self.group.device_ids_by_host
        for i, ident in enumerate(self.host_identities()):
            rows.append(
                (
                    str(i),
                    str(ident.get("node", ""))[:12],
                    str(ident.get("ip", "")),
                    str(ident.get("pid", "")),
                    ", ".join(map(str, per_host[i])),
                )
            )
        return rows

    def __repr__(self) -> str:
        per_host = self.group.device_ids_by_host
        devices = (
            f"{len(per_host[0])} devices each"
            if per_host and len({len(d) for d in per_host}) == 1
            else f"{len(self.device_ids)} devices"
        )
        state = "healthy" if self.healthy else "unhealthy or shut down"
        hosts = "; ".join(
            f"host {r[0]}: {r[2]} pid {r[3]}, devices [{r[4]}]" for r in self._host_rows()
        )
        return workers.printable(f"Slice({self.hosts} hosts x {devices}, {state}; {hosts})")

    def _repr_html_(self) -> str:
        state = "healthy" if self.healthy else "unhealthy or shut down"
        traffic = self.traffic()
        title = (
            f"Slice: {self.hosts} hosts, {len(self.device_ids)} devices, {state}; controller "
            f"traffic so far: {traffic.messages} messages, "
            f"{workers.human_bytes(traffic.total_bytes)}"
        )
        return workers.html_table(
            ("host", "node", "ip", "pid", "devices (global ids)"), self._host_rows(), title=title
        )
