"""Background saves have an owner: callbacks, waiting for every save, interpreter exit; and the
pending-write protocol that keeps late writes out of a removed temporary directory."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import milepost as mp
from tests import _subproc
from tests._helpers import gate_merge, listing, same_bits


def test_done_callbacks_run_once_with_the_handle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = gate_merge(monkeypatch)
    seen: list[tuple[str, bool]] = []
    called = threading.Event()

    def first(h: mp.SaveHandle) -> None:
        seen.append(("first", (tmp_path / "c").exists()))
        called.set()

    handle = mp.save_async(tmp_path / "c", {"x": np.arange(10)})
    handle.add_done_callback(first)
    assert seen == [] and "running" in repr(handle)
    gate.set()
    handle.result(timeout=60)
    # As with concurrent.futures, result() may return while the finishing thread still runs the
    # callbacks: wait for it, then check it was called once, after the commit.
    assert called.wait(60)
    mp.wait_for_saves(timeout=60)  # returns once the finishing thread is done with the save
    assert seen == [("first", True)]
    handle.add_done_callback(lambda h: seen.append(("late", h is handle)))  # already done: at once
    assert seen == [("first", True), ("late", True)]
    assert repr(handle).startswith(f"SaveHandle({str((tmp_path / 'c').absolute())!r}, committed: ")


def test_done_callback_sees_a_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def merge(directory: Any) -> None:
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(mp.workers.format, "merge_ocdbt", merge)
    errors: list[BaseException] = []
    done = threading.Event()

    def record(h: mp.SaveHandle) -> None:
        try:
            h.result(0)
        except OSError as e:
            errors.append(e)
        done.set()

    handle = mp.save_async(tmp_path / "c", {"x": np.arange(10)})
    handle.add_done_callback(record)
    assert done.wait(60)
    assert len(errors) == 1 and "No space left" in str(errors[0])
    assert "failed: OSError" in repr(handle)
    assert listing(tmp_path) == []


def test_wait_for_saves_waits_for_every_save_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from concurrent import futures
    from types import SimpleNamespace

    from milepost._checkpoint import _background

    gate = gate_merge(monkeypatch)
    handles = [mp.save_async(tmp_path / str(i), {"x": np.full(4, i)}) for i in range(3)]
    with pytest.raises(TimeoutError, match="3 milepost save"):
        mp.wait_for_saves(timeout=0.2)
    assert not any(h.done() for h in handles)
    waited: list[int] = []

    def wait(running: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        # The saves are let go once wait_for_saves waits for them, not at a guessed time.
        waited.append(sum(not f.done() for f in running))
        gate.set()
        return futures.wait(running, timeout, **kwargs)

    monkeypatch.setattr(
        _background,
        "futures",
        SimpleNamespace(Future=futures.Future, TimeoutError=futures.TimeoutError, wait=wait),
    )
    mp.wait_for_saves(timeout=60)
    assert waited and waited[0] == 3, waited  # it waited while all three were held
    assert all(h.done() for h in handles)
    for i in range(3):
        assert same_bits(mp.load(tmp_path / str(i))["x"], np.full(4, i))
    mp.wait_for_saves(timeout=0)  # nothing in flight: returns at once


def test_interpreter_exit_waits_for_a_save_in_flight(tmp_path: Path) -> None:
    proc = _subproc.popen_module("tests._exit_in_flight", "save-wait", str(tmp_path / "c"))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "returned" in out
    assert "waiting" in err and "c" in err  # says what it waits for
    loaded = mp.load(tmp_path / "c")
    assert same_bits(loaded["x"], np.arange(1000)) and same_bits(
        np.asarray(loaded["y"]), np.arange(1 << 20, dtype=np.int32)
    )


def test_interpreter_exit_says_loudly_when_it_abandons_a_save(tmp_path: Path) -> None:
    proc = _subproc.popen_module("tests._exit_in_flight", "save-hang", str(tmp_path / "c"))
    out, err = proc.communicate(timeout=120)
    assert "returned" in out
    assert "abandoned the save to" in err and "nothing of it was committed" in err, err
    assert not (tmp_path / "c").exists()  # never half-visible


class Recorder:
    """A checkpointable handler whose save leaves writes 'in flight' and records what the save
    did with them."""

    typestr = "tests.Recorder"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def is_handleable(self, obj: Any) -> bool:
        return isinstance(obj, list) and obj == ["record"]

    def save(self, directory: Path, obj: Any, call: Any) -> mp.PendingWrite[None]:
        recorder = self

        class Pending:
            def wait(self, timeout: float | None = None) -> None:
                recorder.calls.append("wait")
                (directory / "data").write_text("x")

            def settle(self, timeout: float | None = None) -> None:
                recorder.calls.append("settle")

        return Pending()

    def load(self, directory: Path, abstract: Any, call: Any) -> Any:
        return ["record"]

    def metadata(self, directory: Path) -> Any:
        return None


def test_a_failed_part_settles_the_parts_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tree's writes fail: the handler after it is settled, never waited for, and the
    temporary directory goes only then."""
    recorder = Recorder()
    real = mp.workers.PendingSave.wait

    def wait(self: Any, timeout: float | None = None) -> Any:
        real(self, timeout)  # (the tree's data writes fail: the merge is the commit's, after)
        raise OSError(5, "Input/output error (injected)")

    monkeypatch.setattr(mp.workers.PendingSave, "wait", wait)
    with mp.Context(handlers=[(recorder, "extra")]), pytest.raises(OSError, match="injected"):
        mp.save_checkpointables(tmp_path / "c", {"state": {"x": np.arange(3)}, "extra": ["record"]})
    assert recorder.calls == ["settle"]
    assert listing(tmp_path) == []
    monkeypatch.undo()
    with mp.Context(handlers=[(recorder, "extra")]):
        mp.save_checkpointables(tmp_path / "c", {"state": {"x": np.arange(3)}, "extra": ["record"]})
        assert mp.load_checkpointables(tmp_path / "c")["extra"] == ["record"]
    assert recorder.calls == ["settle", "wait"]
    assert (tmp_path / "c" / "extra" / "data").read_text() == "x"


def test_a_save_to_a_path_in_flight_is_its_own_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = gate_merge(monkeypatch)
    handle = mp.save_async(tmp_path / "c", {"x": np.arange(3)})
    with pytest.raises(mp.SaveInProgressError, match="still in flight") as info:
        mp.save_async(tmp_path / "c", {"x": np.arange(3)})
    assert isinstance(info.value, mp.CheckpointExistsError)
    gate.set()
    handle.result(timeout=60)
