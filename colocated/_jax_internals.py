"""What milepost uses of JAX beyond its public API, in one place.

- The coordination service's client of ``jax.distributed`` (``global_state.client``): barriers
  with timeouts and key-value reads and writes, which carry every multi-controller step. JAX
  exposes it only through ``jax._src.distributed`` (whether it runs is public:
  ``jax.distributed.is_initialized``, used where the installed JAX has it).
- The coordinator's address (``global_state.coordinator_address``): the peer tier's processes
  are reached at the address of their interface towards it.
- Whether JAX's preemption sync service runs (``global_state.preemption_sync_manager``): then
  it owns SIGTERM and agrees on the step every process saves at.

:func:`check` says what of this the installed JAX no longer has; a test runs it, so a JAX
release that moves them fails that test by name (``pyproject.toml`` states the tested range).
"""

from __future__ import annotations

from typing import Any


def _state() -> Any:
    from jax._src import distributed

    return distributed.global_state


def distributed_client() -> Any:
    """The coordination service's client of this process's ``jax.distributed`` runtime."""
    client = _state().client if _initialized() else None
    if client is None:
        raise RuntimeError(
            "jax.distributed is not initialized in this process: call jax.distributed.initialize() "
            "in every process before using milepost in a multi-process job"
        )
    return client


def _initialized() -> bool:
    """Whether ``jax.distributed`` runs here: JAX's public ``jax.distributed.is_initialized``
    where the installed JAX has it, else whether the coordination client exists."""
    import jax

    public = getattr(jax.distributed, "is_initialized", None)
    return bool(public()) if public is not None else _state().client is not None


def reachable_address() -> str:
    """This process's IP address on the interface that reaches the ``jax.distributed``
    coordinator (the job's other processes reach it there too); ``127.0.0.1`` without one."""
    import socket

    address = getattr(_state(), "coordinator_address", None)
    if not address:
        return "127.0.0.1"
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))  # no packet is sent: this only picks the route
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def preemption_service_running() -> bool:
    """Whether JAX's preemption sync service runs (multi-process ``jax.distributed``)."""
    import jax

    if jax.process_count() <= 1:
        return False
    return getattr(_state(), "preemption_sync_manager", None) is not None


_CLIENT_METHODS = (
    "wait_at_barrier",
    "key_value_set",
    "key_value_set_bytes",
    "key_value_dir_get",
    "key_value_dir_get_bytes",
    "key_value_delete",
    "blocking_key_value_get_bytes",
    "key_value_increment",
)


def check() -> list[str]:
    """What of the above the installed JAX no longer has, one line each (empty: all of it)."""
    try:
        state = _state()
    except ImportError as e:
        return [f"jax._src.distributed is gone ({e})"]
    problems = [
        f"jax._src.distributed.global_state has no {name!r}"
        for name in ("client", "preemption_sync_manager", "coordinator_address")
        if not hasattr(state, name)
    ]
    try:
        from jax._src.lib import _jax  # the client's type, with the methods milepost calls
    except ImportError:
        try:
            # (older jaxlib; gone from the jax this is checked against)
            from jax._src.lib import xla_extension as _jax  # type: ignore[attr-defined]
        except ImportError as e:
            return [*problems, f"the coordination client's type cannot be found ({e})"]
    kind = getattr(_jax, "DistributedRuntimeClient", None)
    if kind is None:
        return [*problems, "the coordination client's type (DistributedRuntimeClient) is gone"]
    problems += [
        f"the coordination client has no {name}()"
        for name in _CLIENT_METHODS
        if not hasattr(kind, name)
    ]
    return problems
