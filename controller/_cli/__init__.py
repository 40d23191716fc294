"""The ``milepost`` command (also ``python -m milepost``)."""

from milepost._cli import _peers  # noqa: F401  (registers ``milepost peers``)
from milepost._cli._errors import DAMAGED, FAILED, INTERRUPTED, NOT_FOUND, OK, USAGE, CliError
from milepost._cli._main import main

__all__ = ["DAMAGED", "FAILED", "INTERRUPTED", "NOT_FOUND", "OK", "USAGE", "CliError", "main"]
