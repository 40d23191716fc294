"""The training-Checkpointer notebook runs top to bottom (so it cannot rot), and shows what it
says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests._notebooks import execute


def test_training_checkpointer_notebook_executes(tmp_path: Path) -> None:
    for module in ("matplotlib", "flax", "optax", "grain"):
        pytest.importorskip(module)
    run = execute("training_checkpointer.ipynb", tmp_path, "milepost-training-notebook-")
    outs, text, html = run.outputs, run.text, run.html

    # the preemption: a save at the step the signal arrived, then the loop stopped
    assert "preempted: saved step 37, stopping" in text
    assert "committed steps: [30, 35, 37] - latest step after the preemption: 37" in text
    # the steps table (text and HTML), with the loss of each step and the preemption noted
    tables = [
        str(o["data"]["text/plain"])
        for o in outs
        if str(o.get("data", {}).get("text/plain", "")).startswith("Checkpointer(")
    ]
    assert len(tables) == 3
    steps = [[int(line.split()[0]) for line in table.splitlines()[3:]] for table in tables]
    assert steps == [[30, 35, 37], [50, 55, 60], [50, 55, 60]]  # KeepLatest(n=3)
    assert re.search(r"latest 37; .*keep=KeepLatest\(n=3\), preempted", tables[0])
    assert (
        "latest 60;" in tables[1] and "preempted" not in tables[1] and "read_only=True" in tables[2]
    )
    assert all(
        table.splitlines()[1].split() == ["step", "tier", "state", "loss"] for table in tables
    )
    assert "<table" in html and "loss" in html

    # the resume: from the preempted step, and the run then matches one never interrupted, bit for
    # bit
    assert (
        "resumed from step 37 - optimizer step count: 37 - data iterator: {'next_index': 37}"
        in text
    )
    assert "losses after the resume identical to the uninterrupted run: True" in text
    assert "final state identical to the uninterrupted run: True" in text
    # the data: the resumed run trained on the batches the uninterrupted one did, not on the
    # epoch's first batches again
    assert "batches after the resume identical to the uninterrupted run: True" in text
    seen = {
        who: re.search(rf"{who}: +(\[[\d, ]+\])", text).group(1)
        for who in ("resumed", "uninterrupted", "not restored")
    }
    assert seen["resumed"] == seen["uninterrupted"] != seen["not restored"], seen
    assert sum("image/png" in o.get("data", {}) for o in outs) == 1
    # a read-only watcher sees the retained steps and their metrics
    assert re.search(r"\{50: [\d.]+, 55: [\d.]+, 60: [\d.]+\}", text)

    work = re.search(r"removed (\S+) - still there: False", text).group(1)
    assert run.written == [work]
    assert "milepost-training-notebook-" in work and not Path(work).exists()
