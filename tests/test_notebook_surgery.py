"""The checkpoint-surgery notebook runs top to bottom (so it cannot rot)."""

from __future__ import annotations

from pathlib import Path

from tests._notebooks import execute


def test_checkpoint_surgery_notebook_executes(tmp_path: Path) -> None:
    outputs = execute("checkpoint_surgery.ipynb", tmp_path).text
    assert "refused:" in outputs and "matches no leaf" in outputs
    assert "matches the NumPy reference to bfloat16 precision: True" in outputs
    assert "'lora_merge'" in outputs and "params.layer0.kernel" in outputs
    assert "cleaned up" in outputs
