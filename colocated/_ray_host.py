"""The host side of a slice: one Ray actor per worker host, running the worker engine.

An actor owns a registry of the global arrays it holds a part of, keyed by ids the controller
chooses. It receives plans and ids, never array bytes (except when the user explicitly calls
``Slice.put`` / ``Slice.fetch``), and answers with small acks.
"""

from __future__ import annotations

import builtins
import collections
import os
import pickle
import socket
import threading
from typing import Any

import milepost.workers as workers
from milepost.colocated._ray_peers import PeerHost


class Ref:
    """Stands for a host-resident array in a message (the controller's RemoteArray)."""

    __slots__ = ("id",)

    def __init__(self, array_id: str) -> None:
        self.id = array_id

    def __reduce__(self) -> tuple[Any, ...]:
        return (Ref, (self.id,))


_JITTED_KEPT = 64


def _portable(error: Exception) -> Exception:
    """``error`` as the controller can unpickle it: itself when it can, else (JAX's tracer
    errors, say) its nearest builtin type with its type's name and message."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        base = next(c for c in type(error).__mro__ if c.__module__ == builtins.__name__)
        try:
            return base(f"{type(error).__name__}: {error}")
        except Exception:
            return RuntimeError(f"{type(error).__name__}: {error}")


class HostActor(PeerHost):
    """Runs in the worker host's process; imports JAX only after its environment is set."""

    def __init__(self, index: int, count: int, devices_per_host: int) -> None:
        self.index: int = index
        self.count = count
        self.devices_per_host = devices_per_host
        self.arrays: dict[str, Any] = {}
        self.pending: dict[str, workers.PendingSave | None] = {}
        """Saves staged here by token (None: staging failed), until their ``wait_save`` ends."""
        self.staged = threading.Condition()
        """Notified when a save is staged (or fails to): its ``wait_save`` may be waiting
        already."""
        self.started: collections.deque[str] = collections.deque(maxlen=256)
        """The latest saves whose ``start_save`` ran here (see ``abandon_save``)."""
        self.jitted: collections.OrderedDict[bytes, Any] = collections.OrderedDict()
        """``jax.jit`` of the functions ``run`` was given, by their pickled bytes and output
        shardings: the same function sent again reuses its compiled program."""

    # -- start-up -------------------------------------------------------------------------
    def warm(self) -> bool:
        """A standby's warm-up: import what a host runs (JAX is not initialized: the host joins
        a ``jax.distributed`` cluster later)."""
        import jax
        import jax.numpy  # noqa: F401

        import milepost.workers.load
        import milepost.workers.save  # noqa: F401

        return True

    def assign(self, index: int, count: int) -> None:
        """A standby becomes host ``index`` of ``count`` (before ``initialize``)."""
        self.index = index
        self.count = count

    def identity(self) -> dict[str, Any]:
        import ray

        return {
            "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
        }

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    def initialize(self, coordinator: str, timeout_secs: int) -> list[int]:
        import jax

        jax.config.update(
            "jax_cpu_collectives_implementation", "gloo"
        )  # CPU collectives across processes
        jax.distributed.initialize(
            coordinator,
            num_processes=self.count,
            process_id=self.index,
            initialization_timeout=timeout_secs,
        )
        return [d.id for d in jax.local_devices()]

    def device_map(self) -> dict[int, int]:
        """Every global device id -> the process that owns it (as this host sees the cluster)."""
        import jax

        return {d.id: d.process_index for d in jax.devices()}

    # -- arrays ---------------------------------------------------------------------------
    def _resolve(self, tree: Any) -> Any:
        import jax

        def get(x: Any) -> Any:
            if isinstance(x, Ref):
                try:
                    return self.arrays[x.id]
                except KeyError:
                    raise KeyError(
                        f"host {self.index} holds no array "
                        f"{x.id!r}: it was released or never placed"
                    ) from None
            return x

        return jax.tree_util.tree_map(get, tree, is_leaf=lambda x: isinstance(x, Ref))

    def _register(self, tree: Any, prefix: str) -> Any:
        import jax

        leaves, treedef = jax.tree_util.tree_flatten(tree)
        described = []
        for k, leaf in enumerate(leaves):
            array_id = f"{prefix}.{k}"
            self.arrays[array_id] = leaf
            spec = workers.ShardingSpec.from_jax(leaf.sharding)
            described.append((array_id, tuple(leaf.shape), workers.dtype_name(leaf.dtype), spec))
        return jax.tree_util.tree_unflatten(treedef, described)

    def put(
        self,
        ids: list[str],
        shapes: list[tuple[int, ...]],
        specs: list[workers.ShardingSpec],
        parts: list[list[tuple[Any, Any]]],
    ) -> list[str]:
        """Place controller data: per array, the ``(box, object ref)`` shards this host's devices
        need. Returns the dtypes JAX gave the arrays."""
        import jax
        import numpy as np
        import ray

        dtypes = []
        for array_id, shape, spec, mine in zip(ids, shapes, specs, parts, strict=True):
            pieces = dict(
                zip([box for box, _ in mine], ray.get([ref for _, ref in mine]), strict=True)
            )

            def piece(
                index: tuple[slice, ...] | None,
                shape: tuple[int, ...] = tuple(shape),
                pieces: dict[Any, Any] = pieces,
            ) -> Any:
                assert index is not None  # JAX gives every shard's index
                return np.asarray(
                    pieces[tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))]
                )

            array = jax.make_array_from_callback(tuple(shape), spec.to_jax(), piece)
            self.arrays[array_id] = array
            dtypes.append(str(array.dtype))
        return dtypes

    def fetch(self, ids: list[str]) -> list[list[tuple[Any, Any]]]:
        """This host's replica-0 shards of each array: ``(index, data)`` pairs."""
        import numpy as np

        arrays = self._resolve([Ref(i) for i in ids])
        return [
            [(s.index, np.asarray(s.data)) for s in a.addressable_shards if s.replica_id == 0]
            for a in arrays
        ]

    def run(self, fn: bytes, args: Any, kwargs: Any, prefix: str, out_shardings: Any = None) -> Any:
        """``jax.jit(fn)`` on this process's part of the global arrays (every host runs the same
        call: SPMD); registers the outputs as ``<prefix>.<k>`` and describes them."""
        import cloudpickle
        import jax

        key = fn + cloudpickle.dumps(out_shardings)
        jitted = self.jitted.get(key)
        if jitted is None:
            function = cloudpickle.loads(fn)
            if out_shardings is not None:
                out_shardings = jax.tree_util.tree_map(
                    lambda s: s.to_jax(),
                    out_shardings,
                    is_leaf=lambda x: isinstance(x, workers.ShardingSpec),
                )
            jitted = jax.jit(function, out_shardings=out_shardings)
            self.jitted[key] = jitted
            while len(self.jitted) > _JITTED_KEPT:
                self.jitted.popitem(last=False)
        else:
            self.jitted.move_to_end(key)
        try:
            out = jitted(*self._resolve(args), **self._resolve(kwargs))
        except Exception as e:
            raise _portable(e) from None
        return self._register(out, prefix)

    def release(self, ids: list[str]) -> None:
        for array_id in ids:
            self.arrays.pop(array_id, None)

    def held(self) -> int:
        return len(self.arrays)

    # -- checkpointing --------------------------------------------------------------------
    def start_save(self, plan: workers.SavePlan, sources: list[Any], token: str) -> str:
        """Stage this host's shards (the blocking part of a save) under ``token``, the controller's
        name for this save (its ``wait_save`` is sent at the same time and may already wait)."""
        self.started.append(token)
        pending = None  # if staging fails, the waiter has nothing to wait for: it ends at once
        try:
            pending = workers.start_save(plan, self._resolve(sources))
        finally:
            with self.staged:
                self.pending[token] = pending
                self.staged.notify_all()
        return token

    def wait_save(self, token: str, timeout: float) -> workers.SaveAck:
        """Runs in the actor's wait group: other calls are served while the writes land. Sent
        with ``start_save``, so it first waits (bounded) for that call to have staged the save; the
        writes then get the whole ``timeout`` again, as when the controller asked after staging."""
        with self.staged:
            staged = self.staged.wait_for(lambda: token in self.pending, timeout)
        if not staged:
            raise TimeoutError(
                f"host {self.index} was asked to wait for a save whose staging (start_save) did "
                f"not run here within {timeout:g}s; the host was busy with an earlier call (raise "
                "AsyncOptions.timeout_secs if it is slow)"
            )
        keep = False
        try:
            pending = self.pending[token]
            if pending is None:
                raise RuntimeError(
                    f"host {self.index} could not stage this save (its staging failed, or was "
                    "dropped after a failure on another host): it wrote nothing"
                )
            return pending.wait(timeout)
        except workers.StillWritingError:
            keep = True  # still writing: the controller's settle_save waits for it, then drops it
            raise
        finally:
            if not keep:
                self.pending.pop(token, None)

    def abandon_save(self, token: str) -> None:
        """After a failed staging elsewhere: runs after this save's ``start_save`` (the same call
        order), or after the controller cancelled it before it ran; then its ``wait_save`` has
        nothing to wait for and ends."""
        if token in self.started:
            return  # staging ran and woke the wait itself (which may be over already)
        with self.staged:
            self.pending[token] = None
            self.staged.notify_all()

    def settle_save(self, token: str, timeout: float | None) -> None:
        """An abandoned save: let its writes land, ignoring their outcome. If a ``wait_save``
        of the same save is running, this returns only after it (the same lock)."""
        pending = self.pending.get(token)
        if pending is not None:
            pending.settle(timeout)
        self.pending.pop(token, None)

    def load(self, plan: workers.LoadPlan, prefix: str) -> workers.LoadAck:
        """Read exactly the ranges this host's devices need; register the arrays as
        ``<prefix>.<k>``. Answers with an ack, never data."""
        arrays, ack = workers.load(plan, self.index)
        for k, array in enumerate(arrays):
            self.arrays[f"{prefix}.{k}"] = array
        return ack

    def run_job(self, job: str, plan: Any) -> Any:
        """This host's part of a host job (``milepost.workers.JOBS``): verify, export..."""
        return workers.run_job(job, plan, self.index)

    def shutdown(self) -> None:
        import jax

        self.arrays.clear()
        try:
            jax.distributed.shutdown()
        except Exception:
            pass
