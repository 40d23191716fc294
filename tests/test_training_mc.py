"""The Checkpointer in real 2-process multi-controller jobs: the same steps everywhere."""

from __future__ import annotations

from pathlib import Path

from tests import _training_mc


def test_two_processes_save_the_same_steps_and_a_primary_only_signal_reaches_all(
    tmp_path: Path,
) -> None:
    outs = _training_mc.launch("user_signal", tmp_path / "run")
    for o in outs:
        assert o["saved"] == [0, 4, 6, 8] and o["steps"] == [6, 8] and o["preempted"], o
        assert o["latest"] == 8 and o["exact"] == 4 and o["after_delete"] == [8], o
    assert outs[0]["on_disk"] == ["8"]


def test_sigterm_to_one_process_makes_every_process_save_the_same_step(tmp_path: Path) -> None:
    outs = _training_mc.launch("sigterm", tmp_path / "run")
    stopped = {o["stopped"] for o in outs}
    assert len(stopped) == 1 and None not in stopped, outs
    for o in outs:
        assert o["saved"] == [o["stopped"]] and o["steps"] == [o["stopped"]] and o["exact"] == 4, o


def test_a_local_tier_mirrors_collectively(tmp_path: Path) -> None:
    outs = _training_mc.launch("tiered", tmp_path / "run")
    for o in outs:
        assert (
            o["steps"] == [1, 2, 3]
            and o["durable"] == [1, 2, 3]
            and o["exact"] == 4
            and o["exact_durable"] == 4
        ), o
    assert outs[0]["on_disk"] == ["1", "2", "3"] and outs[0]["local_on_disk"] == ["3"], outs[0]
