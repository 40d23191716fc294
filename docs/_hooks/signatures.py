"""MkDocs hook: the API reference's signatures are formatted by ruff, or the build fails.

mkdocstrings-python (``separate_signature``) formats each long signature with Black or, without
it, ruff; with neither it logs one line at INFO level and shows each signature on one long
line. The ``docs`` extra installs ruff; this hook makes its absence an error that says so, not a
reference quietly harder to read. ``line_length`` in mkdocs.yml sets the width.
"""

from __future__ import annotations

import shutil

from mkdocs.exceptions import PluginError


def ruff_binary() -> str | None:
    """The ruff executable mkdocstrings-python would run, if there is one."""
    try:
        from ruff.__main__ import find_ruff_bin
    except ImportError:
        return shutil.which("ruff")
    try:
        return str(find_ruff_bin())
    except FileNotFoundError:
        return shutil.which("ruff")


def on_config(config):
    if ruff_binary() is None:
        raise PluginError(
            "the API reference's signatures are formatted by ruff, which is not installed: "
            "pip install -e '.[docs]'"
        )
    return config
