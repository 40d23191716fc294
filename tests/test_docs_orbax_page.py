"""docs/guide/coming-from-orbax.md stays true: its code runs (the blocks after ``<!-- run -->``,
in order, in one namespace, in a temporary folder), every option field and manager method of the
installed orbax-checkpoint is on it, and every name its tables cite exists (Orbax's in Orbax,
milepost's in milepost)."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

ocp = pytest.importorskip("orbax.checkpoint")

import milepost  # noqa: E402
import milepost.training as training  # noqa: E402

PAGE = Path(__file__).parent.parent / "docs" / "guide" / "coming-from-orbax.md"
NOT_POLICIES = {
    "AbstractCheckpointManager",
    "CheckpointManager",
    "CheckpointManagerOptions",
    "PolicyCheckpointInfo",
}
CONSTANTS = {"True", "False", "None"}
NESTED = ("AsyncOptions", "MultiprocessingOptions", "FileOptions", "AtomicityOptions")


def page() -> str:
    return PAGE.read_text(encoding="utf-8")


def run_blocks(text: str) -> list[str]:
    return re.findall(r"<!-- run -->\n```python\n(.*?)```", text, flags=re.S)


def field_names(cls: Any) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def public_methods() -> set[str]:
    return {n for n, _ in inspect.getmembers(ocp.CheckpointManager) if not n.startswith("_")}


def table_rows(text: str) -> list[list[str]]:
    """The cells of every row of the tables whose header starts with ``| Orbax |``."""
    rows: list[list[str]] = []
    inside = False
    for line in text.splitlines():
        if line.startswith("| Orbax |"):
            inside = True
        elif not line.startswith("|"):
            inside = False
        elif inside and not line.startswith("|---"):
            rows.append([c.strip() for c in line.strip("|").split(" | ")])
    return rows


def spans(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_the_pages_code_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = run_blocks(page())
    assert len(blocks) == 3
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {}
    for block in blocks:
        exec(compile(block, str(PAGE), "exec"), namespace)
    assert sorted(p.name for p in (tmp_path / "milepost_run").iterdir()) == [
        f"checkpoint_{s:06d}" for s in (0, 50, 80, 90, 100)
    ]


def test_every_orbax_field_and_method_is_on_the_page() -> None:
    cited = {s for row in table_rows(page()) for s in spans(row[0])}
    leading = {re.match(r"[\w.]+", s).group(0) for s in cited}  # type: ignore[union-attr]
    missing = sorted(field_names(ocp.CheckpointManagerOptions) - leading)
    assert not missing, f"CheckpointManagerOptions fields not on {PAGE.name}: {missing}"
    methods = {name.split(".")[0] for name in leading}
    assert not sorted(public_methods() - methods), "CheckpointManager methods missing"
    for cls in NESTED:
        want = {f"{cls}.{name}" for name in field_names(getattr(ocp.options, cls))}
        assert not sorted(want - leading), f"{cls} fields missing"
    managers = ocp.checkpoint_managers
    policies = {n for n in dir(managers) if isinstance(getattr(managers, n), type)} - NOT_POLICIES
    assert not sorted(policies - methods), "policies missing"


def orbax_name_exists(name: str) -> bool:
    head, _, rest = name.partition(".")
    if head in field_names(ocp.CheckpointManagerOptions) or head in public_methods():
        return not rest
    for module in (ocp.options, ocp.checkpoint_managers):
        cls = getattr(module, head, None)
        if isinstance(cls, type):
            return not rest or rest in field_names(cls)
    return False


def test_every_orbax_name_cited_exists() -> None:
    for row in table_rows(page()):
        for span in spans(row[0]):
            name = re.match(r"[\w.]+", span).group(0)  # type: ignore[union-attr]
            assert orbax_name_exists(name), f"{span!r} is not an Orbax name"


def milepost_keywords() -> set[str]:
    names: set[str] = set(inspect.signature(training.Checkpointer).parameters)
    for module in (training, milepost):
        for n in dir(module):
            obj = getattr(module, n)
            if dataclasses.is_dataclass(obj) and isinstance(obj, type):
                names |= field_names(obj)
    for _n, fn in inspect.getmembers(training.Checkpointer, inspect.isfunction):
        names |= set(inspect.signature(fn).parameters)
    return names


def test_every_milepost_name_cited_exists(tmp_path: Path) -> None:
    ckpt = training.Checkpointer(tmp_path, read_only=True)
    keywords = milepost_keywords()
    for row in table_rows(page()):
        for span in spans(row[1]):
            for name in re.findall(r"\bmp\.([\w.]+)", span):
                obj: Any = milepost
                for part in name.split("."):
                    assert hasattr(obj, part), f"{span!r}: milepost has no {name}"
                    obj = getattr(obj, part)
            for name in re.findall(r"\bckpt\.(\w+)", span):
                assert hasattr(ckpt, name), f"{span!r}: a Checkpointer has no {name}"
            for name in set(re.findall(r"(?<![.\w])([A-Z]\w*)", span)) - CONSTANTS:
                assert hasattr(training, name) or hasattr(milepost, name), f"{span!r}: {name}"
            for name in re.findall(r"(\w+)=", span):
                assert name in keywords, f"{span!r}: no keyword {name}"
            if re.fullmatch(r"[a-z_]+", span):
                assert span in keywords, f"{span!r} is not a milepost option"
    ckpt.close()
