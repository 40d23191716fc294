"""The multi-controller host group: every process runs the script and is its own host.

Each process runs only its own plan through the worker engine. Coordination (barriers and the
primary's broadcasts) goes through the ``jax.distributed`` coordination service, always with a
timeout, and a wait that times out names the processes that did not arrive.
"""

from __future__ import annotations

import base64
import collections
import pickle
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from milepost import workers
from milepost.colocated._errors import HostError

PREFIX = "milepost"


def _client() -> Any:
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized: call jax.distributed.initialize() in every process first")
    return client


class _Pending:
    def __init__(self, pending: workers.PendingSave | None) -> None:
        self._pending = pending

    def wait(self, timeout: float | None = None) -> list[workers.SaveAck]:
        return [self._pending.wait(timeout)] if self._pending is not None else []


class MultiControllerHostGroup:
    """Every process of a ``jax.distributed`` job is a controller and the host of its devices.

    ``primary`` (process 0 by default) alone creates directories, writes metadata and commits.
    """

    name = "mcjax"

    def __init__(self, primary: int = 0) -> None:
        self._index = jax.process_index()
        self._count = jax.process_count()
        if not 0 <= primary < self._count:
            raise ValueError(f"primary process {primary} does not exist (process_count={self._count})")
        self._primary = primary
        self._owner = {d.id: d.process_index for d in jax.devices()}
        self._lock = threading.Lock()
        self._seq: collections.Counter[str] = collections.Counter()

    # -- topology -------------------------------------------------------------------------
    def process_of_device(self, device_id: int) -> int:
        try:
            return self._owner[device_id]
        except KeyError:
            raise ValueError(f"device {device_id} is not part of this jax.distributed job") from None

    def processes(self) -> Sequence[int]:
        return range(self._count)

    def is_primary(self) -> bool:
        return self._index == self._primary

    def check_devices(self, spec: workers.ShardingSpec, name: str) -> None:
        try:
            spec.to_jax()
        except ValueError as e:
            raise ValueError(f"cannot load {name!r} with its saved sharding: {e}") from None

    # -- work -----------------------------------------------------------------------------
    def start_save(self, plans: Mapping[int, workers.SavePlan], sources: Sequence[Any], timeout: float) -> _Pending:
        plan = plans.get(self._index)
        return _Pending(workers.start_save(plan, sources) if plan is not None else None)

    def load(self, plans: Mapping[int, workers.LoadPlan], timeout: float) -> list[Any]:
        return workers.load(plans[self._index])

    # -- coordination ---------------------------------------------------------------------
    def _key(self, name: str) -> str:
        """A key unique to this call: the name and how often this process used it before
        (every process calls the same named operations in the same order)."""
        with self._lock:
            self._seq[name] += 1
            n = self._seq[name]
        digest = base64.urlsafe_b64encode(name.encode()).decode().rstrip("=")
        return f"{PREFIX}/{digest}/{n}"

    def barrier(self, name: str, timeout: float) -> None:
        key = self._key(name)
        client = _client()
        client.key_value_set(f"{key}/arrived/{self._index}", "1")
        try:
            client.wait_at_barrier(key.replace("/", ":"), int(timeout * 1000))
        except Exception as e:
            missing = self._missing(f"{key}/arrived/")
            raise HostError(
                f"processes {missing or '(unknown)'} did not reach the barrier {name!r} within {timeout}s "
                f"(this is process {self._index} of {self._count}); they died or hung. Nothing was committed. ({e})"
            ) from None

    def _missing(self, prefix: str) -> list[int]:
        try:
            arrived = {int(k.rsplit("/", 1)[-1]) for k, _ in _client().key_value_dir_get(prefix)}
        except Exception:
            return []
        return [p for p in range(self._count) if p not in arrived]

    def broadcast(self, name: str, value: Any, timeout: float) -> Any:
        key = self._key(name)
        client = _client()
        if self.is_primary():
            client.key_value_set(key, base64.b64encode(pickle.dumps(value)).decode())
            return value
        try:
            raw = client.blocking_key_value_get(key, int(timeout * 1000))
        except Exception as e:
            raise HostError(
                f"the primary process {self._primary} did not publish {name!r} within {timeout}s "
                f"(this is process {self._index}); it died or hung. ({e})"
            ) from None
        return pickle.loads(base64.b64decode(raw))
