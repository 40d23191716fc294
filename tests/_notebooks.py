"""Executing a notebook in a test: top to bottom, in a temporary working directory, and whatever
folder it says it writes under removed even if a cell failed.

The notebooks are committed executed, so that the docs site (docs/_hooks/notebooks.py) and
anyone browsing the repository see their tables, pictures and printed results. A test runs the
notebook afresh (its committed outputs cleared first) and fails when the committed outputs are
stale: a code cell whose committed outputs are not of the kinds the run gave (text on stdout,
a table, a picture, a value; stderr is left out of the comparison: logs and progress bars come
and go with timing). To rewrite the committed notebooks with fresh outputs, run their tests with
``MILEPOST_WRITE_NOTEBOOKS=1`` (e.g. ``MILEPOST_WRITE_NOTEBOOKS=1 python -m pytest
tests/test_notebook*.py``): each run that finished without error is written back as
``for_commit`` makes it: its stderr outputs, the lines Ray forwards from its workers to stdout
and execution timings dropped (they come and go from run to run), pictures in 64 colours (a
quarter of the bytes), everything else as run.
"""

from __future__ import annotations

import base64
import copy
import io
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
WRITE = "MILEPOST_WRITE_NOTEBOOKS"


@dataclass
class Executed:
    outputs: list[dict[str, Any]]
    text: str
    """Every stream and plain-text output, joined."""
    html: str
    written: list[str]
    """The folders it said it writes under (``writing under <path>``)."""


def kinds(cell: dict[str, Any]) -> list[str]:
    """What a code cell's outputs are, in order, stderr left out: ``stdout``, ``error``, or
    the MIME types of a value or display (``image/png``, ``text/html``...)."""
    out = []
    for o in cell.get("outputs", []):
        if o.get("output_type") == "stream":
            if o.get("name") == "stdout" and (not out or out[-1] != "stdout"):
                out.append("stdout")  # one print or several: one stream (they merge)
        elif o.get("output_type") == "error":
            out.append("error")
        else:
            out.append("+".join(sorted(o.get("data", {}))))
    return out


def stale_cells(committed: Any, run: Any) -> list[str]:
    """The code cells whose committed outputs are not of the kinds the run gave."""
    pairs = zip(committed.cells, run.cells, strict=True)
    code = [(c, r) for c, r in pairs if c.cell_type == "code"]
    return [
        f"code cell {i} ({c.source.splitlines()[0] if c.source else ''!r}): committed "
        f"{kinds(c)}, run {kinds(r)}"
        for i, (c, r) in enumerate(code, 1)
        if kinds(c) != kinds(r)
    ]


# a line Ray forwards from a worker or the raylet: "(raylet) ...", "(HostActor pid=12) ..."
_RAY_LOG = re.compile(r"^(\x1b\[[0-9;]*m)?\((raylet|[\w.]* ?pid=\d+[^)]*)\).*\n?", re.M)


def _small_png(data: str) -> str:
    """A PNG (base64) in 64 colours, if Pillow (matplotlib's dependency) is here."""
    try:
        from PIL import Image
    except ImportError:
        return data
    image = Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB")
    out = io.BytesIO()
    image.quantize(colors=64, method=Image.Quantize.MEDIANCUT).save(out, "PNG", optimize=True)
    return base64.b64encode(out.getvalue()).decode("ascii") + "\n"


def for_commit(nb: Any) -> Any:
    """``nb`` as committed (see the module's docstring)."""
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type != "code":
            continue
        kept = []
        for output in cell.outputs:
            if output.get("name") == "stderr":
                continue
            if output.get("name") == "stdout":
                output.text = _RAY_LOG.sub("", output.text)
                if not output.text:
                    continue
            if "image/png" in output.get("data", {}):
                output.data["image/png"] = _small_png(output.data["image/png"])
            kept.append(output)
        cell.outputs = kept
    return nb


def execute(name: str, cwd: Path, folder_prefix: str | None = None) -> Executed:
    """Run ``notebooks/<name>``; with ``folder_prefix``, the folders it prints as ``writing under
    <path>`` (named with that prefix) must be gone afterwards (the test removes any left)."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    committed = nbformat.read(NOTEBOOKS / name, as_version=4)
    nb = copy.deepcopy(committed)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
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
    if os.environ.get(WRITE):
        nbformat.write(for_commit(nb), NOTEBOOKS / name)
    else:
        stale = stale_cells(committed, for_commit(nb))  # compared as it would be committed
        assert not stale, (
            f"notebooks/{name}'s committed outputs are stale; rewrite them with "
            f"{WRITE}=1 python -m pytest tests/test_notebook*.py:\n" + "\n".join(stale)
        )
    return Executed(outs, text, html, written)
