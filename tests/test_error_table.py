"""Every error class milepost exports is a row of the typed-error table in the guide
(docs/guide/saving-and-loading.md, the table headed ``| error | is a | when |``): the row names
it as users reach it (``mp.X``, ``mp.training.X``, ``milepost.workers.X``) and says the builtin
(or milepost error) it subclasses. A new public error needs only its row."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path
from typing import Any

import milepost

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guide"
HEADER = re.compile(r"^\|\s*error\s*\|\s*is a\s*\|\s*when\s*\|\s*$")
PUBLIC_ROOTS = ("milepost", "milepost.workers", "milepost.colocated")


def _public_modules() -> list[Any]:
    """milepost's public packages and modules: no part of their name starts with '_'."""
    found = {}
    for root in PUBLIC_ROOTS:
        package = importlib.import_module(root)
        found[root] = package
        for info in pkgutil.walk_packages(package.__path__, prefix=f"{root}."):
            if any(part.startswith("_") for part in info.name.split(".")):
                continue
            found[info.name] = importlib.import_module(info.name)
    return list(found.values())


def _exported_errors() -> dict[type[BaseException], str]:
    """Each exception class in a public module's ``__all__`` -> where it is exported first."""
    errors: dict[type[BaseException], str] = {}
    for module in _public_modules():
        for name in getattr(module, "__all__", ()):
            value = getattr(module, name)
            if isinstance(value, type) and issubclass(value, BaseException):
                errors.setdefault(value, f"{module.__name__}.{name}")
    return errors


def _table_rows() -> list[tuple[str, str]]:
    """(error, is a) of every row of every typed-error table in the guide."""
    rows = []
    for page in sorted(GUIDE.glob("*.md")):
        inside = False
        for line in page.read_text().splitlines():
            if HEADER.match(line):
                inside = True
                continue
            if inside and not line.startswith("|"):
                inside = False
            if inside and not re.match(r"^\|[\s|:-]+\|$", line):
                cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
                rows.append((cells[0], cells[1]))
    return rows


def _resolve(dotted: str) -> Any:
    parts = dotted.split(".")
    if parts[0] == "mp":
        parts[0] = "milepost"
    value: Any = importlib.import_module(parts[0])
    for part in parts[1:]:
        value = getattr(value, part)
    return value


def test_the_table_names_real_errors_and_their_bases() -> None:
    rows = _table_rows()
    assert len(rows) >= 10, rows
    for error, base in rows:
        cls = _resolve(error)
        assert isinstance(cls, type) and issubclass(cls, BaseException), error
        assert base in {c.__name__ for c in cls.__mro__[1:]}, (error, base, cls.__mro__)


def test_every_exported_error_is_in_the_table() -> None:
    exported = _exported_errors()
    assert milepost.MissingDevicesError in exported and len(exported) >= 20, exported
    listed = {_resolve(error) for error, _ in _table_rows()}
    missing = sorted(where for cls, where in exported.items() if cls not in listed)
    assert not missing, (
        f"exported errors missing from the typed-error table of {GUIDE / 'saving-and-loading.md'}"
        f": {missing}; add a row `| `mp.Name` | `Base` | when, and what to do |` for each"
    )
