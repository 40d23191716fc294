"""Roots whose step folders are named as Orbax's step name formats name them
(``checkpoint_000010``, ``000010``, ``checkpoint_10``), written by the real orbax-checkpoint:
listed, loaded and retained like any other; a Checkpointer naming its own steps so, read back
by Orbax; a root named two ways; ``milepost ls`` on them and on a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest

from milepost import _cli
from milepost.training import (
    Checkpointer,
    KeepLatest,
    NotATrainingRootError,
    StepNamingError,
    list_steps,
)

NAMINGS = [
    ("checkpoint", 6, "checkpoint_{:06d}"),
    (None, 6, "{:06d}"),
    ("checkpoint", None, "checkpoint_{}"),
]


def state_of(step: int) -> dict[str, np.ndarray]:
    return {"w": np.arange(6, dtype=np.float32).reshape(2, 3) * step, "n": np.int64([step])}


def orbax_root(root: Path, steps: list[int], prefix: str | None, length: int | None) -> Path:
    options = ocp.CheckpointManagerOptions(step_prefix=prefix, step_format_fixed_length=length)
    with ocp.CheckpointManager(root, options=options) as manager:
        for step in steps:
            manager.save(step, args=ocp.args.StandardSave(state_of(step)))
        manager.wait_until_finished()
    return root


def assert_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        assert np.asarray(got[key]).dtype == value.dtype
        np.testing.assert_array_equal(np.asarray(got[key]), value)


@pytest.mark.parametrize(("prefix", "length", "pattern"), NAMINGS)
def test_an_orbax_root_lists_and_loads(
    tmp_path: Path, prefix: str | None, length: int | None, pattern: str
) -> None:
    root = orbax_root(tmp_path / "run", [10, 20], prefix, length)
    assert sorted(p.name for p in root.iterdir()) == [pattern.format(s) for s in (10, 20)]
    rows = list_steps(root)
    assert [(r["step"], r["state"]) for r in rows] == [(10, "committed"), (20, "committed")]
    assert rows[0]["paths"] == [str(root / pattern.format(10))]
    with Checkpointer(root, read_only=True) as ckpt:
        assert ckpt.steps == [10, 20] and ckpt.latest == 20
        assert ckpt.path(10) == root / pattern.format(10)
        assert_equal(ckpt.load(), state_of(20))
        assert_equal(ckpt.load(10), state_of(10))


def test_retention_keeps_the_naming_and_deletes_old_steps(tmp_path: Path) -> None:
    root = orbax_root(tmp_path / "run", [1, 2, 3], "checkpoint", 6)
    with Checkpointer(root, keep=KeepLatest(n=2)) as ckpt:
        assert ckpt.steps == [1, 2, 3]
        ckpt.save(4, state_of(4))
        ckpt.wait()
        assert ckpt.steps == [3, 4]
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint_000003", "checkpoint_000004"]
    options = ocp.CheckpointManagerOptions(step_prefix="checkpoint", step_format_fixed_length=6)
    with ocp.CheckpointManager(root, options=options) as manager:
        assert list(manager.all_steps()) == [3, 4]
    with Checkpointer(root, read_only=True) as ckpt:
        assert_equal(ckpt.load(4), state_of(4))
        assert_equal(ckpt.load(3), state_of(3))


def test_a_prefixed_milepost_root_is_read_by_orbax(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with Checkpointer(root, step_prefix="ckpt", step_format_fixed_length=4) as ckpt:
        for step in (5, 12345):
            ckpt.save(step, state_of(step))
    assert sorted(p.name for p in root.iterdir()) == ["ckpt_0005", "ckpt_12345"]
    options = ocp.CheckpointManagerOptions(step_prefix="ckpt", step_format_fixed_length=4)
    with ocp.CheckpointManager(root, options=options, item_names=("state",)) as manager:
        assert list(manager.all_steps()) == [5, 12345]
        restored = manager.restore(5, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    assert_equal(dict(restored["state"]), state_of(5))
    with Checkpointer(root) as ckpt:  # a later run: the root's naming, without being told
        ckpt.save(7, state_of(7))
    assert (root / "ckpt_0007").is_dir()


def test_only_known_prefixes_are_steps_or_leftovers(tmp_path: Path) -> None:
    root = orbax_root(tmp_path / "run", [10], "checkpoint", 6)
    (root / "checkpoint_000030").mkdir()  # what a killed save left, of the root's naming
    (root / "logs_2").mkdir()  # someone else's folder
    (root / "logs_2" / "events").write_text("not a step")
    assert [(r["step"], r["state"]) for r in list_steps(root)] == [
        (10, "committed"),
        (30, "uncommitted"),
    ]
    with Checkpointer(root) as ckpt:
        assert ckpt.steps == [10]
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint_000010", "logs_2"]


def test_a_root_named_two_ways(tmp_path: Path) -> None:
    root = orbax_root(tmp_path / "run", [10], None, None)
    orbax_root(root, [20], "checkpoint", None)
    assert sorted(p.name for p in root.iterdir()) == ["10", "checkpoint_20"]
    assert [r["step"] for r in list_steps(root)] == [10, 20]
    with Checkpointer(root, read_only=True) as ckpt:  # reading: both namings
        assert ckpt.steps == [10, 20]
        assert_equal(ckpt.load(10), state_of(10))
        assert_equal(ckpt.load(20), state_of(20))
    with pytest.raises(StepNamingError, match="step_prefix=") as e:
        Checkpointer(root)  # writing: which naming new steps take is not known
    assert set(e.value.names) == {"10", "checkpoint_20"}
    with Checkpointer(root, step_prefix="checkpoint", keep=KeepLatest(n=1)) as ckpt:
        ckpt.save(30, state_of(30))
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint_30"]


def test_two_folders_of_one_step_are_an_error(tmp_path: Path) -> None:
    root = orbax_root(tmp_path / "run", [10], None, None)
    orbax_root(root, [10], None, 6)
    rows = list_steps(root)
    assert [r["step"] for r in rows] == [10] and len(rows[0]["paths"]) == 2
    with pytest.raises(StepNamingError, match="two folders") as e:
        Checkpointer(root, read_only=True)
    assert set(e.value.names) == {"10", "000010"}


@pytest.mark.parametrize(
    ("given", "error"),
    [
        ({"step_prefix": "a.b"}, ValueError),
        ({"step_prefix": ""}, TypeError),
        ({"step_format_fixed_length": 0}, ValueError),
        ({"step_format_fixed_length": "6"}, TypeError),
    ],
)
def test_step_naming_options_are_checked(
    tmp_path: Path, given: dict[str, object], error: type[Exception]
) -> None:
    with pytest.raises(error):
        Checkpointer(tmp_path / "run", **given)  # type: ignore[arg-type]
    assert not (tmp_path / "run").exists()


def test_ls_on_an_orbax_root_and_on_a_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = orbax_root(tmp_path / "run", [10, 20], "checkpoint", 6)
    assert _cli.main(["ls", str(root)]) == 0
    assert "2 committed steps, latest 20" in capsys.readouterr().out
    assert _cli.main(["ls", str(root), "--json"]) == 0
    assert [r["step"] for r in json.loads(capsys.readouterr().out)] == [10, 20]
    step = root / "checkpoint_000010"
    assert _cli.main(["ls", str(step)]) == 2
    err = capsys.readouterr().err
    assert f"{step} is a checkpoint, not a root of steps: run `milepost inspect {step}`" in err
    with pytest.raises(NotATrainingRootError):
        list_steps(step)


def test_a_local_tier_mirrors_under_the_roots_naming(tmp_path: Path) -> None:
    root = orbax_root(tmp_path / "run", [1], "checkpoint", 6)
    fast = tmp_path / "fast"
    with Checkpointer(root, local=fast, keep=KeepLatest(n=2), local_keep=KeepLatest(n=1)) as c:
        for step in (2, 3):
            c.save(step, state_of(step))
        c.wait()
        assert c.durable_steps == [2, 3]
    assert sorted(p.name for p in fast.iterdir()) == ["checkpoint_000003"]
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint_000002", "checkpoint_000003"]
    with Checkpointer(root, read_only=True) as ckpt:
        assert_equal(ckpt.load(2), state_of(2))
