"""The ``milepost`` command (also ``python -m milepost``)."""

# Importing a command's module registers it on the group (``_main.cli``); `milepost --help`
# lists the commands by name, whatever the order here.
from milepost._cli import _arrays, _convert, _demo, _peers, _reading  # noqa: F401
from milepost._cli._errors import DAMAGED, FAILED, INTERRUPTED, NOT_FOUND, OK, USAGE, CliError
from milepost._cli._main import main

__all__ = ["DAMAGED", "FAILED", "INTERRUPTED", "NOT_FOUND", "OK", "USAGE", "CliError", "main"]
