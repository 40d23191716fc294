"""The notebooks are committed with their outputs, and the docs site shows them (fast: nothing
is executed; tests/test_notebook*.py run the notebooks and compare the committed outputs)."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

from tests._notebooks import NOTEBOOKS, stale_cells

HOOK = Path(__file__).resolve().parents[1] / "docs" / "_hooks" / "notebooks.py"
_spec = importlib.util.spec_from_file_location("milepost_docs_notebooks", HOOK)
assert _spec is not None and _spec.loader is not None
pages = importlib.util.module_from_spec(_spec)  # the docs build's hook (needs no MkDocs here)
_spec.loader.exec_module(pages)

NAMES = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))


def test_there_are_notebooks() -> None:
    assert len(NAMES) >= 3


@pytest.mark.parametrize("name", NAMES)
def test_committed_with_outputs_as_written_by_the_tests(name: str) -> None:
    notebook = json.loads((NOTEBOOKS / name).read_text(encoding="utf-8"))
    code = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    with_outputs = [c for c in code if c.get("outputs")]
    assert len(with_outputs) >= len(code) // 2, (
        f"{name} is committed without its outputs: run MILEPOST_WRITE_NOTEBOOKS=1 python -m "
        "pytest tests/test_notebook*.py"
    )
    for cell in code:  # what tests/_notebooks.for_commit leaves out
        assert "execution" not in cell.get("metadata", {})
        assert all(o.get("name") != "stderr" for o in cell.get("outputs", []))


@pytest.mark.parametrize("name", NAMES)
def test_the_page_shows_every_output(name: str) -> None:
    notebook = json.loads((NOTEBOOKS / name).read_text(encoding="utf-8"))
    page, images = pages.to_markdown(notebook, Path(name).stem)
    outputs = [o for c in notebook["cells"] if c["cell_type"] == "code" for o in c["outputs"]]
    pngs = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == len(pngs) and all(f"]({image})" in page for image in images)
    assert all(png.startswith(b"\x89PNG") for png in images.values())
    for o in outputs:
        data = o.get("data", {})
        if "image/png" in data:
            continue
        shown = "".join(data.get("text/html") or data.get("text/plain") or o.get("text", ""))
        assert shown.strip().splitlines()[0].strip() in page  # the output, not just its cell
    for cell in notebook["cells"]:
        assert "".join(cell["source"]).strip().splitlines()[0] in page


@pytest.mark.parametrize("name", NAMES)
def test_stale_outputs_are_told(name: str) -> None:
    """The comparison the notebook tests make after a run: a cell committed without its outputs,
    or with other kinds of outputs, is named; the committed notebook matches itself."""
    nbformat = pytest.importorskip("nbformat")
    committed = nbformat.read(NOTEBOOKS / name, as_version=4)
    assert stale_cells(committed, committed) == []
    cleared = copy.deepcopy(committed)
    cell = next(c for c in cleared.cells if c.cell_type == "code" and c.outputs)
    cell.outputs = []
    assert len(stale_cells(cleared, committed)) == 1
    assert len(stale_cells(committed, cleared)) == 1
