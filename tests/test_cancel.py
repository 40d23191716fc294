"""Cancelling a save in flight: ``SaveHandle.cancel()`` and ``Checkpointer.cancel()``.

Before the commit point (the lock right before the commit marker that also decides an exit's
"abandoned or under way") a cancel wins: the save never commits, its writes are waited for,
then everything it wrote is removed, and ``result()`` raises ``SaveCancelledError``. After it,
``cancel()`` returns False and the save ends as it would have. Each race is decided by holding
the save at a gate (an event) at the point under test: a host write, the OCDBT merge, the
commit marker, the rename into place."""

from __future__ import annotations

import pickle
import threading
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost._storage import LocalWorkspace
from milepost.training import Checkpointer, KeepLatest
from milepost.workers.save import _packed
from tests._helpers import assert_tree_equal, gate_merge, listing, put, same_bits
from tests._object_stores import new_s3_bucket

LIMIT = 60.0
"""The longest a test waits for an event (it never takes that long)."""


def state(mesh: jax.sharding.Mesh, k: int) -> dict[str, Any]:
    rng = np.random.default_rng(k)
    return {
        "w": put(rng.standard_normal((32, 16), dtype=np.float32), mesh, P("data", "model")),
        "host": np.arange(100) * (k + 1),
        "step": k,
    }


class Gate:
    """Holds the save where it is installed: ``reached`` is set once the save got there, and the
    save goes on once ``opened`` is set."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.opened = threading.Event()

    def hold(self) -> None:
        self.reached.set()
        assert self.opened.wait(LIMIT), "test gate never opened"


def gate_at(where: str, monkeypatch: pytest.MonkeyPatch) -> Gate:
    """A gate at ``where``: a host job about to write a database ("write"), the OCDBT merge once
    the writes landed ("merge"), right before the commit point ("marker"), or once the marker
    is written, right before the rename into place ("publish")."""
    gate = Gate()
    if where == "write":
        real_write = _packed.Packer.write

        def write(self: _packed.Packer) -> None:
            gate.hold()
            real_write(self)

        monkeypatch.setattr(_packed.Packer, "write", write)
    elif where == "merge":
        real_merge = mp.workers.format.merge_ocdbt

        def merge(directory: Any) -> None:
            gate.hold()
            real_merge(directory)

        monkeypatch.setattr(mp.workers.format, "merge_ocdbt", merge)
    elif where == "marker":
        real_check = LocalWorkspace.check

        def check(self: LocalWorkspace, stage: str = "", record: Any = None) -> None:
            if stage == "before the commit marker":
                gate.hold()
            real_check(self, stage, record)

        monkeypatch.setattr(LocalWorkspace, "check", check)
    else:
        real_publish = LocalWorkspace.publish

        def publish(self: LocalWorkspace) -> None:
            gate.hold()
            real_publish(self)

        monkeypatch.setattr(LocalWorkspace, "publish", publish)
    return gate


@pytest.mark.parametrize("where", ["write", "merge", "marker"])
def test_a_save_cancelled_before_its_commit_leaves_nothing(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    gate = gate_at(where, monkeypatch)
    handle = mp.save_async(tmp_path / "7", state(mesh24, 7))
    assert gate.reached.wait(LIMIT)
    assert handle.cancel() is True
    assert handle.cancel() is True  # still cancelled
    assert not handle.done()  # its writes (or its commit's checks) are still held
    gate.opened.set()
    with pytest.raises(mp.SaveCancelledError, match="cancelled before its commit") as e:
        handle.result(timeout=LIMIT)
    assert isinstance(e.value, RuntimeError)
    assert e.value.path == (tmp_path / "7").absolute()
    copy = pickle.loads(pickle.dumps(e.value))  # how other controller processes get it
    assert (type(copy), copy.path, str(copy)) == (type(e.value), e.value.path, str(e.value))
    assert "cancelled" in repr(handle)
    assert handle.cancel() is True  # ended cancelled: nothing more to do
    assert listing(tmp_path) == []  # no step folder, no temporary directory, no lock
    # The path and the root stay usable: the same step again, and another.
    again, other = state(mesh24, 8), state(mesh24, 9)
    mp.save_async(tmp_path / "7", again).result(timeout=LIMIT)
    mp.save(tmp_path / "9", other)
    assert_tree_equal(mp.load(tmp_path / "7", again), again)
    assert_tree_equal(mp.load(tmp_path / "9", other), other)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["7", "9"]


def test_cancel_once_the_commit_marker_is_written_is_too_late(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = gate_at("publish", monkeypatch)
    want = state(mesh24, 3)
    handle = mp.save_async(tmp_path / "3", want)
    assert gate.reached.wait(LIMIT)
    assert handle.cancel() is False  # past the commit point: it commits
    gate.opened.set()
    assert handle.result(timeout=LIMIT) == (tmp_path / "3").absolute()
    assert handle.cancel() is False
    assert mp.verify(tmp_path / "3").ok
    assert_tree_equal(mp.load(tmp_path / "3", want), want)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3"]


def test_cancel_after_the_save_ended_returns_false(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    want = state(mesh24, 1)
    handle = mp.save_async(tmp_path / "1", want)
    handle.result(timeout=LIMIT)
    assert handle.cancel() is False
    assert handle.result() == (tmp_path / "1").absolute()
    assert_tree_equal(mp.load(tmp_path / "1", want), want)


def test_checkpointer_cancel_keeps_the_older_steps(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "run"
    states = {k: state(mesh24, k) for k in range(1, 6)}
    with Checkpointer(root, keep=KeepLatest(n=2)) as ckpt:
        for k in (1, 2):
            assert ckpt.save(k, states[k])
        ckpt.wait()
        gate = gate_merge(monkeypatch)
        assert ckpt.save(3, states[3])
        assert ckpt.cancel(step=4) == []  # not in flight
        assert ckpt.cancel() == [3]
        gate.set()
        ckpt.wait()  # the cancelled save is no failure
        assert ckpt.steps == [1, 2]
        assert sorted(p.name for p in root.iterdir()) == ["1", "2"]
        # The cancelled step saved again, then another: retention counts only committed steps.
        assert ckpt.save(3, states[3])
        assert ckpt.save(4, states[4])
        ckpt.wait()
        assert ckpt.cancel() == []
        assert ckpt.steps == [3, 4]
        assert ckpt.load(3, states[3])["step"] == 3
        assert same_bits(ckpt.load(4, states[4])["w"], states[4]["w"])
    assert sorted(p.name for p in root.iterdir()) == ["3", "4"]
    assert Checkpointer(root, read_only=True).steps == [3, 4]


@pytest.fixture(params=["s3", "memory"])
def store_url(request: pytest.FixtureRequest) -> str:
    """A fresh, empty location in moto's S3 server and in memory://."""
    if request.param == "s3":
        endpoint, _ = request.getfixturevalue("s3_endpoint")
        return f"s3://{new_s3_bucket(endpoint)}/run"
    return f"memory://cancel-{threading.get_ident()}-{id(request)}/run"


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_cancelled_save_leaves_nothing_in_an_object_store(
    store_url: str, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = mp.workers.as_path(store_url)
    gate = gate_merge(monkeypatch)
    handle = mp.save_async(f"{store_url}/5", state(mesh24, 5))
    assert root.keys()  # the save's objects and its lease are there
    assert handle.cancel() is True
    gate.set()
    with pytest.raises(mp.SaveCancelledError):
        handle.result(timeout=LIMIT)
    assert root.keys() == []  # no object, no lease
    want = state(mesh24, 6)
    mp.save(f"{store_url}/5", want)
    assert_tree_equal(mp.load(f"{store_url}/5", want), want)


@pytest.mark.slow
@pytest.mark.usefixtures("ray_runtime")
def test_a_cancelled_slice_save_waits_for_the_hosts_writes_then_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = gate_merge(monkeypatch)  # on the controller, once every host's writes landed
    with mp.Slice.start(hosts=2, devices_per_host=2) as s:
        mesh = s.mesh({"data": 2, "model": 2})
        values = {"w": np.arange(64 * 8, dtype=np.float32).reshape(64, 8)}
        tree = s.put(values, {"w": mesh.sharding(P("data", "model"))})
        handle = mp.save_async(tmp_path / "2", {"params": tree, "step": 2})
        assert handle.cancel() is True
        gate.set()
        with pytest.raises(mp.SaveCancelledError):
            handle.result(timeout=LIMIT)
        assert listing(tmp_path) == []
        mp.save(tmp_path / "2", {"params": tree, "step": 2})
    assert same_bits(mp.load(tmp_path / "2")["params"]["w"], values["w"])


def test_a_cancel_that_won_holds_when_the_save_then_fails_otherwise(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cancel() returned True, then a later phase of the commit failed on its own (a storage
    error before the marker): result() still raises SaveCancelledError (caused by that error),
    a second cancel() still says True, and a Checkpointer records no failure for it."""
    gate = gate_at("marker", monkeypatch)
    held_check = LocalWorkspace.check  # (the gate's)

    def failing(self: LocalWorkspace, stage: str = "", record: Any = None) -> None:
        held_check(self, stage, record)
        if stage == "before the commit marker":
            raise OSError(5, "the storage failed on its own")

    monkeypatch.setattr(LocalWorkspace, "check", failing)
    handle = mp.save_async(tmp_path / "c", state(mesh24, 2))
    assert gate.reached.wait(LIMIT)
    assert handle.cancel() is True
    gate.opened.set()
    with pytest.raises(mp.SaveCancelledError) as info:
        handle.result(LIMIT)
    assert isinstance(info.value.__cause__, OSError)
    assert handle.cancel() is True
    assert listing(tmp_path) == []
    gate.reached.clear()
    gate.opened.clear()
    with Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save(1, state(mesh24, 1))
        assert gate.reached.wait(LIMIT)
        assert ckpt.cancel() == [1]
        gate.opened.set()
        ckpt.wait()  # no BackgroundSaveError: a cancelled save is no failure
        assert ckpt.steps == []
