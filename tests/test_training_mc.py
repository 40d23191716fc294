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


def test_a_job_restarted_with_a_node_replaced_recovers_from_peers(tmp_path: Path) -> None:
    """Four processes, two per node (n0, n1), copies=1: each part is also kept on the other
    node. The job ends; node n1 is replaced (its memory folder gone); the restarted job takes
    n1's processes' parts from their copies on n0, the others from their own node."""
    import shutil

    root = tmp_path / "run"
    for o in _training_mc.launch("peers_save", root, processes=4, devices=2):
        assert o["steps"] == [2], o  # the durable root: every second step
    shutil.rmtree(tmp_path / "run-shm" / "n1")
    outs = _training_mc.launch("peers_recover", root, processes=4, devices=2)
    part = 16 * 32 * 4 // 4  # each process holds a quarter of w
    for o in outs:
        assert (o["step"], o["tier"]) == (3, "peers"), o
        assert o["moved"] == {"own node": 2 * part, "peer": 2 * part}, o
        assert o["exact"] == 2, o  # its two shards, bit for bit
        assert o["io"] == [0, [0, 0, part, part]], o  # n1's processes got their parts
    (run_dir,) = (tmp_path / "run-shm" / "n1").iterdir()  # n1 holds its parts again
    assert sorted(p.name for p in run_dir.iterdir()) == ["step_3", "step_4"]
