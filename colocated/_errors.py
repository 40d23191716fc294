"""Errors raised by host groups (the controller re-exports them)."""

from __future__ import annotations

from collections.abc import Iterable


class HostError(RuntimeError):
    """A host process failed or did not answer in time; the message names it and says what to
    do. ``hosts`` holds the indices of the hosts it is about (a slice's hosts, or a
    multi-controller job's processes), sorted; empty when it is about the group as a whole (a
    slice shut down or unhealthy, one that could not start)."""

    def __init__(self, message: str, *, hosts: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.hosts: tuple[int, ...] = tuple(sorted(set(hosts)))


class RayNotInstalledError(ImportError):
    """A slice was asked for where Ray is not installed; the embedded and multi-controller modes
    do not need it. ``what`` is the call that needs it, ``install`` the command that adds it."""

    install = "pip install 'milepost[ray]'"

    def __init__(self, what: str, missing: str) -> None:
        super().__init__(
            f"{what} runs its hosts as Ray actors, but {missing!r} is not installed here; "
            f"install it with {self.install} (ray and cloudpickle). Saving and loading in "
            "this process, or in a multi-controller JAX job, need neither.",
            name=missing,
        )
        self.what = what
        self.missing = missing
        """The module that did not import (``ray`` or ``cloudpickle``)."""


def require_ray(what: str) -> None:
    """Raise :class:`RayNotInstalledError` naming ``what`` unless Ray and cloudpickle import."""
    for module in ("ray", "cloudpickle"):
        try:
            __import__(module)
        except ImportError:
            raise RayNotInstalledError(what, module) from None
