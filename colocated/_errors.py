"""Errors raised by host groups (the controller re-exports them)."""

from __future__ import annotations


class HostError(RuntimeError):
    """A host process failed or did not answer in time; the message names it."""
