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


def test_the_wheel_ships_py_typed(tmp_path: Path) -> None:
    """The annotations reach IDEs and mypy: every package of the wheel carries py.typed."""
    import shutil
    import subprocess
    import sys
    import zipfile

    source = tmp_path / "src"  # a copy: building writes build/ and *.egg-info/ beside the sources
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", ".*cache"),
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("milepost-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in ("milepost", "milepost/workers", "milepost/colocated"):
        assert f"{package}/py.typed" in names, sorted(n for n in names if n.endswith("typed"))
