"""The single-controller notebook runs top to bottom (so it cannot rot), and shows what it says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests._notebooks import execute


def _number(pattern: str, text: str) -> int:
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not in the notebook's output"
    return int(match.group(1).replace(",", ""))


def test_single_controller_notebook_executes(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    run = execute("single_controller.ipynb", tmp_path, "milepost-notebook-")
    outs, text = run.outputs, run.text

    # the sharding pictures and the loss curve were drawn
    assert sum("image/png" in o.get("data", {}) for o in outs) >= 3
    first, last = re.search(r"loss: ([\d.]+) at step 0, ([\d.]+) at step 29", text).groups()
    assert float(last) < 0.8 * float(first)

    # the async save: running right after the call, committed once waited for
    assert re.search(r"right after save_async: SaveHandle\('.*step_30', (running|committed)", text)
    assert re.search(r"SaveHandle\('.*step_30', committed: ", text)
    # the metadata table: the saved (sharded) layout and the custom metadata, no array data read
    assert "P('data', 'model') on {data: 2, model: 4}" in text and "P('model', 'data')" in text
    assert 'custom_metadata: {"note": "notebook tour"}' in text

    # the resharded load onto the other slice: every value, exactly
    assert "load step_30:" in text  # the progress bar's final line
    assert "resharded onto {'x': 4, 'y': 2} identical: True step: 30" in text

    # plans and acks through the controller, not the model's bytes
    model = _number(r"model: ([\d,]+) bytes", text)
    save = _number(
        r"save_async \(planning and staging\): ([\d,]+) bytes through the controller", text
    )
    load = _number(r"load onto slice B: ([\d,]+) bytes through the controller", text)
    assert model > 1_000_000
    assert 0 < save < model // 50 and 0 < load < model // 50

    # everything it wrote (checkpoint, Ray's session files) is gone
    work = re.search(r"removed (\S+) - still there: False", text).group(1)
    assert run.written == [work]
    assert "milepost-notebook-" in work and not Path(work).exists()
