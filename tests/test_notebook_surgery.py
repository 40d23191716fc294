"""The checkpoint-surgery notebook runs top to bottom (so it cannot rot)."""

from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "checkpoint_surgery.ipynb"


def test_checkpoint_surgery_notebook_executes(tmp_path: Path) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = "".join(
        o.get("text", "") + str(o.get("data", {}).get("text/plain", "")) for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )
    assert "Traceback" not in outputs
    assert "refused:" in outputs and "matches no leaf" in outputs
    assert "matches the NumPy reference to bfloat16 precision: True" in outputs
    assert "'lora_merge'" in outputs and "params.layer0.kernel" in outputs
    assert "cleaned up" in outputs
