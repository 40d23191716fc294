"""MkDocs hook: show mkdocstrings (griffe) milepost's sources as one package.

pyproject.toml maps ``milepost`` to controller/, ``milepost.colocated`` to colocated/ and
``milepost.workers`` to workers/ (``[tool.setuptools] package-dir``). griffe, which reads the
sources for mkdocstrings, finds a package by a folder of its name, so it would find none of
them; worse, the ``milepost`` command beside the ``mkdocs`` command (first on ``sys.path`` when
``mkdocs`` runs) would be taken for the package. This hook builds, for the duration of the
build, a folder ``milepost/`` of symlinks that follows the mapping, and puts it first on the
python handler's search paths. The sources are read, never imported: the build needs neither
milepost nor JAX installed. The type checker reads the code through the same view
(``python docs/_hooks/package_view.py FOLDER``, in ``.ci/typecheck``).
"""

from __future__ import annotations

import shutil
import tempfile
import tomllib
from pathlib import Path

_views: list[Path] = []


def build_view(root: Path, view: Path) -> bool:
    """Fill ``view`` with each package pyproject maps, at its import path (symlinks to the
    sources); False when pyproject maps none."""
    pyproject = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    mapping = pyproject.get("tool", {}).get("setuptools", {}).get("package-dir", {})
    mapping = {name: folder for name, folder in mapping.items() if name}
    if not mapping:
        return False
    for name in sorted(mapping, key=lambda n: n.count(".")):  # parents before children
        source = root / mapping[name]
        target = view.joinpath(*name.split("."))
        if target.is_symlink():  # the parent's folder has one of this name: the mapping wins
            target.unlink()
        target.mkdir(parents=True, exist_ok=True)
        for entry in sorted(source.iterdir()):
            if entry.name != "__pycache__" and not (target / entry.name).exists():
                (target / entry.name).symlink_to(entry.resolve())
    return True


def _package_view(root: Path) -> Path | None:
    """A temporary folder holding each mapped package at its import path (symlinks)."""
    view = Path(tempfile.mkdtemp(prefix="milepost-docs-"))
    _views.append(view)
    return view if build_view(root, view) else None


def _remove_views() -> None:
    while _views:
        shutil.rmtree(_views.pop(), ignore_errors=True)


def on_config(config):
    _remove_views()  # `mkdocs serve` calls this again for every rebuild
    root = Path(config["config_file_path"]).resolve().parent
    view = _package_view(root)
    if view is not None:
        python = config["plugins"]["mkdocstrings"].config["handlers"].setdefault("python", {})
        python["paths"] = [str(view), *python.get("paths", [])]
    return config


on_config.mkdocs_priority = 100  # type: ignore[attr-defined]  # before mkdocstrings' on_config


def on_shutdown():
    _remove_views()


if __name__ == "__main__":  # the same view for the type checker: package_view.py FOLDER
    import sys

    here = Path(__file__).resolve().parents[2]
    target = Path(sys.argv[1])
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    build_view(here, target)
