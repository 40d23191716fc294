"""``load_async``: the load runs on the runtime's load thread while the caller goes on (an event
holds the reads, never a timing), its failure comes back from ``result()``, it uses the options
of its call, a Checkpointer keeps the step it loads and waits for it on close, an exit waits
for it (at most its timeout)."""

from __future__ import annotations

import io
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost.training import Checkpointer, KeepLatest, StepBusyError, StepNotFoundError
from tests import _subproc
from tests._helpers import abstract_of, assert_tree_equal, put


class ReadGate:
    """Holds every worker read (``milepost.workers.load``) until ``release`` is set;
    ``entered`` says one is held; ``plans`` are the plans read, in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.plans: list[Any] = []
        real = mp.workers.load

        def load(plan: Any, *args: Any, **kwargs: Any) -> Any:
            self.plans.append(plan)
            self.entered.set()
            # A load_async that did not return before its reads would fail here, not hang.
            assert self.release.wait(60), "the test never released the read"
            return real(plan, *args, **kwargs)

        monkeypatch.setattr(mp.workers, "load", load)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[ReadGate]:
    held = ReadGate(monkeypatch)
    yield held
    held.release.set()  # a failed test leaves no load holding the load thread


def state_of(mesh: jax.sharding.Mesh, value: int) -> dict[str, Any]:
    return {
        "w": put(
            np.arange(16 * 8, dtype=np.float32).reshape(16, 8) + value, mesh, P("data", "model")
        ),
        "host": np.full((3, 5), value, np.int64),
        "step": value,
        "name": f"run-{value}",
    }


def test_round_trip_is_exact(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    state = state_of(mesh24, 7)
    mp.save(tmp_path / "c", state)
    handle = mp.load_async(tmp_path / "c", abstract_of(state))
    assert_tree_equal(handle.result(timeout=60), state)
    assert handle.done() and repr(handle).startswith(
        f"LoadHandle({str(tmp_path / 'c')!r}, loaded: "
    )
    assert "loaded" in handle._repr_html_()
    parts = mp.load_checkpointables_async(tmp_path / "c", {"state": abstract_of(state)}).result(60)
    assert list(parts) == ["state"]
    assert_tree_equal(parts["state"], state)


def test_the_caller_is_free_while_the_reads_run(
    tmp_path: Path, mesh24: jax.sharding.Mesh, gate: ReadGate
) -> None:
    state = state_of(mesh24, 1)
    mp.save(tmp_path / "c", state)
    ended: list[bool] = []
    handle = mp.load_async(tmp_path / "c", abstract_of(state))
    handle.add_done_callback(lambda h: ended.append(h is handle))
    # load_async returned; its reads are held in a worker read until this thread says so.
    assert gate.entered.wait(60)
    assert not handle.done() and ended == []
    assert "running" in repr(handle), handle
    with pytest.raises(TimeoutError, match="still running") as info:
        handle.result(timeout=0.01)
    assert str(tmp_path / "c") in str(info.value)
    gate.release.set()
    assert_tree_equal(handle.result(timeout=60), state)
    assert handle.done()


def test_a_failure_is_raised_by_result_with_its_fields(tmp_path: Path) -> None:
    state = {"w": np.arange(64 * 64, dtype=np.float32).reshape(64, 64)}
    with mp.Context(saving=mp.SaveOptions(use_ocdbt=False)):  # a chunk is a file of its own
        mp.save(tmp_path / "c", state)
    chunk = tmp_path / "c" / "state" / "w" / "c" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x01
    chunk.write_bytes(bytes(data))
    handle = mp.load_async(tmp_path / "c")  # the damage is found by the reads, not at the call
    with pytest.raises(mp.CorruptCheckpointError) as info:
        handle.result(timeout=60)
    error = info.value
    assert error.array == "w" and error.chunk == (0, 0) and error.path.startswith(str(chunk)), error
    assert "failed: CorruptCheckpointError" in repr(handle)
    with pytest.raises(mp.CorruptCheckpointError):  # asked again: the same failure
        handle.result(0)

    mp.save(tmp_path / "d", {"w": np.ones(4, np.float32)})
    abstract = {
        "w": jax.ShapeDtypeStruct((4,), np.float32),
        "b": jax.ShapeDtypeStruct((2,), np.float32),
    }
    with pytest.raises(mp.StructureMismatchError, match=r"\['b'\]"):
        mp.load_async(tmp_path / "d", abstract).result(timeout=60)


def test_what_is_wrong_with_the_arguments_is_raised_at_the_call(tmp_path: Path) -> None:
    with pytest.raises(mp.CheckpointNotFoundError, match="does not exist"):
        mp.load_async(tmp_path / "missing")
    with pytest.raises(mp.CheckpointNotFoundError, match="does not exist"):
        mp.load_checkpointables_async(str(tmp_path / "missing"), {"state": None})
    with pytest.raises(TypeError, match="milepost.load_async takes the path"):
        mp.load_async(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="milepost.load"):
        mp.load_async({"w": np.ones(2)})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty"):
        mp.load_async("")


def test_loads_run_in_call_order_with_the_options_of_their_call(
    tmp_path: Path, gate: ReadGate
) -> None:
    for name in ("c1", "c2"):
        mp.save(tmp_path / name, {"x": np.arange(6) + len(name)})
    first = mp.load_async(tmp_path / "c1")  # default options; holds the load thread
    assert gate.entered.wait(60)
    shown = io.StringIO()
    with mp.Context(
        loading=mp.LoadOptions(memory_budget_bytes=12345, direct_reads=False),
        progress=mp.ProgressOptions(file=shown, delay_secs=0),
    ):
        second = mp.load_async(tmp_path / "c2")
    assert repr(second).endswith("queued: loads run one after another)"), second
    with mp.Context(loading=mp.LoadOptions(memory_budget_bytes=999)):  # in force as they run
        gate.release.set()
        assert np.array_equal(first.result(60)["x"], np.arange(6) + 2)
        assert np.array_equal(second.result(60)["x"], np.arange(6) + 2)
    read = [
        (Path(p.store.directory).parent.name, p.memory_budget_bytes, p.direct_reads)
        for p in gate.plans
    ]
    assert read == [("c1", 128 << 20, True), ("c2", 12345, False)], read
    assert "load c2" in shown.getvalue() and "c1" not in shown.getvalue(), shown.getvalue()


def test_checkpointer_load_async_keeps_its_step_from_retention(
    tmp_path: Path, mesh24: jax.sharding.Mesh, gate: ReadGate
) -> None:
    root = tmp_path / "r"
    zero, one = state_of(mesh24, 0), state_of(mesh24, 1)
    with Checkpointer(root, keep=KeepLatest(n=1)) as ckpt:
        gate.release.set()  # saves and their commits read nothing through it; hold loads only
        ckpt.save(0, zero)
        ckpt.wait()
        gate.release.clear()
        gate.entered.clear()
        with pytest.raises(StepNotFoundError):  # the step is chosen at the call
            ckpt.load_async(5)
        handle = ckpt.load_async(abstract_state=abstract_of(zero))  # the latest: 0
        assert gate.entered.wait(60) and not handle.done()
        ckpt.save(1, one)
        ckpt.wait()
        assert sorted(p.name for p in root.iterdir()) == ["0", "1"], "retention took step 0"
        with pytest.raises(StepBusyError, match="being loaded"):
            ckpt.delete(0)
        gate.release.set()
        assert_tree_equal(handle.result(60), zero)
        ckpt.wait()  # the deletion retention put off runs once the load ended
        assert ckpt.steps == [1] and sorted(p.name for p in root.iterdir()) == ["1"]

        bad = {**abstract_of(one), "extra": jax.ShapeDtypeStruct((2,), np.float32)}
        failed = ckpt.load_async(1, bad)
        with pytest.raises(mp.StructureMismatchError):
            failed.result(60)
        assert not ckpt._state.loading  # released, failed or not
        ckpt.delete(1)


def test_checkpointer_close_waits_for_a_load_in_flight(
    tmp_path: Path, mesh24: jax.sharding.Mesh, gate: ReadGate, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = state_of(mesh24, 3)
    gate.release.set()
    ckpt = Checkpointer(tmp_path / "r")
    ckpt.save(3, state)
    ckpt.wait()
    gate.release.clear()
    handle = ckpt.load_async(3, abstract_of(state))
    assert gate.entered.wait(60)
    steps = ckpt._state
    waiting = threading.Event()
    real_wait_while = steps.wait_while

    def wait_while(busy: Any, message: Any, timeout: float | None = None) -> None:
        if "loads" in message():
            waiting.set()
        real_wait_while(busy, message, timeout)

    monkeypatch.setattr(steps, "wait_while", wait_while)
    released_at_close: list[bool] = []
    closer = threading.Thread(
        target=lambda: (ckpt.close(), released_at_close.append(gate.release.is_set()))
    )
    closer.start()
    assert waiting.wait(60), "close() did not wait for the load"
    assert not handle.done()
    gate.release.set()
    closer.join(60)
    assert released_at_close == [True]
    assert_tree_equal(handle.result(60), state)


def test_checkpointer_close_waits_for_a_load_at_most_its_timeout(
    tmp_path: Path, mesh24: jax.sharding.Mesh, gate: ReadGate
) -> None:
    state = state_of(mesh24, 4)
    mp.save(tmp_path / "r" / "4", state)
    ckpt = Checkpointer(tmp_path / "r", timeout_secs=0.2)  # (a save would wait as little)
    handle = ckpt.load_async(4, abstract_of(state))
    assert gate.entered.wait(60)
    with pytest.raises(TimeoutError, match=r"the loads of steps \[4\]"):
        ckpt.close()
    gate.release.set()  # the load goes on, and ends as it would have
    assert_tree_equal(handle.result(60), state)


def test_an_interpreter_exit_waits_for_a_load_at_most_its_timeout(tmp_path: Path) -> None:
    proc = _subproc.popen_module("tests._exit_in_flight", "load", str(tmp_path / "c"))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "returned" in out
    assert "waiting (at most 1s) for the load of" in err, err
    assert "abandoned the load of" in err and str(tmp_path / "c") in err, err
