"""Executing a notebook in a test: top to bottom, in a temporary working directory, saved
without outputs, and whatever folder it says it writes under removed even if a cell failed."""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


@dataclass
class Executed:
    outputs: list[dict[str, Any]]
    text: str
    """Every stream and plain-text output, joined."""
    html: str
    written: list[str]
    """The folders it said it writes under (``writing under <path>``)."""


def execute(name: str, cwd: Path, folder_prefix: str | None = None) -> Executed:
    """Run ``notebooks/<name>``; with ``folder_prefix``, the folders it prints as ``writing under
    <path>`` (named with that prefix) must be gone afterwards (the test removes any left)."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
        "save the notebook without outputs"
    )
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}
    )
    left: list[str] = []
    written: list[str] = []
    try:
        client.execute()
    finally:  # a failed cell must not leave the notebook's directory behind
        outs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
        written = re.findall(r"writing under (\S+)", "".join(o.get("text", "") for o in outs))
        if folder_prefix is not None:
            left = [w for w in written if folder_prefix in w and Path(w).exists()]
            for where in left:
                shutil.rmtree(where, ignore_errors=True)
    assert not left, f"the notebook left {left} behind"
    text = "".join(o.get("text", "") + str(o.get("data", {}).get("text/plain", "")) for o in outs)
    html = "".join(str(o.get("data", {}).get("text/html", "")) for o in outs)
    assert "Traceback" not in text and not any(o.get("output_type") == "error" for o in outs)
    return Executed(outs, text, html, written)
