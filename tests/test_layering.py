"""DESIGN.md's layers: workers/ imports neither the controller nor colocated/, colocated/ never
imports the controller."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "milepost":  # `from milepost import workers` imports milepost.workers
                names.extend(f"milepost.{a.name}" for a in node.names)
            else:
                names.append(node.module)
    return names


def _allowed(name: str, allowed: tuple[str, ...]) -> bool:
    if name != "milepost" and not name.startswith("milepost."):
        return True
    return any(name == a or name.startswith(a + ".") for a in allowed)


@pytest.mark.parametrize(
    ("folder", "allowed"),
    [("workers", ("milepost.workers",)), ("colocated", ("milepost.workers", "milepost.colocated"))],
)
def test_layer_imports(folder: str, allowed: tuple[str, ...]) -> None:
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for name in _imports(path):
            if not _allowed(name, allowed):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "layering violated (see DESIGN.md):\n" + "\n".join(bad)


def test_layer_check_catches_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "x.py"
    bad.write_text("from milepost import _api\nimport milepost.colocated\n")
    names = _imports(bad)
    assert not all(_allowed(n, ("milepost.workers",)) for n in names)
