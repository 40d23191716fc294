"""Promises of docs/guide/guarantees.md that a small, plausible bug once broke with every other
test passing (issue #47): each test here fails on that bug. ``tests/mutations.py`` makes each
bug on a copy of the code and runs the tests that must catch it; a promise added to the page
gets its test here and its bug there.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import milepost as mp
from milepost import surgery as ms
from milepost.workers import _paths
from tests import _subproc
from tests._helpers import assert_tree_equal, same_bits
from tests._object_stores import new_s3_bucket

# -- one writer per path -----------------------------------------------------------------------


def _lease(url: str) -> dict[str, Any] | None:
    raw = _paths.as_path(url + ".milepost-lease").read_bytes()
    return json.loads(raw) if raw else None


def _until_older_than_its_lease(url: str, lease_secs: float, timeout: float = 60.0) -> None:
    """Until the live save's lease was taken more than ``lease_secs`` ago, and renewed since
    (it runs until a later time than its first term): a bug that judges a lease by its age
    would now take it over."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lease = _lease(url)
        now = time.time()
        if lease and now > lease["since"] + 1.5 * lease_secs and lease["expires"] > now:
            assert lease["expires"] > lease["since"] + lease_secs  # renewed, not first written
            return
        time.sleep(0.05)  # (a poll of the lease object; the wait is bounded above)
    raise AssertionError(f"the holder's lease at {url} was never older than {lease_secs} s")


def test_a_second_writer_after_lease_secs_is_refused_while_the_first_renews(
    s3_endpoint: Any,
) -> None:
    """The first save holds its lease (renewing it) for longer than ``lease_secs``; a second
    writer arriving then is refused, and the first one commits what it wrote. (The bug: a live
    lease treated as stale once older than ``lease_secs``; the second writer took the path over,
    deleted the first one's objects and committed.)"""
    lease_secs = 1.0
    url = f"s3://{new_s3_bucket(s3_endpoint[0])}/run/1"
    holder = _subproc.popen_module(
        "tests._held_save", url, str(lease_secs), devices=1, stdin=subprocess.PIPE
    )
    lines = _subproc.Lines(holder)
    try:
        assert lines.next(120) == "holding"
        _until_older_than_its_lease(url, lease_secs)
        with pytest.raises(mp.CheckpointExistsError, match="is writing it now"):
            with mp.Context(saving=mp.SaveOptions(lease_secs=lease_secs)):
                mp.save(url, {"x": np.arange(3)})
        assert holder.stdin is not None
        holder.stdin.write("go\n")
        holder.stdin.flush()
        assert lines.next(120) == "committed"
        assert holder.wait(60) == 0
    finally:
        holder.kill()
        holder.wait(60)
    assert_tree_equal(mp.load(url), {"x": np.arange(1000)})
    assert mp.verify(url).ok


# -- safetensors export is exact ---------------------------------------------------------------


def test_an_export_of_tensors_of_odd_byte_sizes_is_read_exactly_by_safetensors(
    tmp_path: Path,
) -> None:
    """Tensors of 1, 3, 5, 6, 7 and 14 bytes back to back: the header's offsets are where the
    bytes are (the bug: offsets padded to 8 bytes while the data was not; the safetensors
    library then refuses the file, 'invalid offset')."""
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    import milepost.safetensors

    want = {
        "a": np.array([True]),
        "b": np.arange(3, dtype=np.uint8),
        "c": np.arange(5, dtype=np.int8) - 2,
        "d": np.arange(3, dtype=np.float16),
        "e": np.arange(7, dtype=np.uint8) * 3,
        "f": np.arange(7).astype(ml_dtypes.bfloat16),
        "g": np.arange(6, dtype=np.int32).reshape(2, 3),
    }
    ckpt = mp.save(tmp_path / "c", want)
    summary = milepost.safetensors.export(ckpt, tmp_path / "out")
    got: dict[str, np.ndarray] = {}
    for file in summary.files:
        got.update(safetensors_numpy.load_file(str(tmp_path / "out" / file)))
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert same_bits(got[name], value), name
    assert_tree_equal(mp.load(tmp_path / "out"), want, check_sharding=False)


# -- surgery never loses a leaf ----------------------------------------------------------------


def test_a_rename_onto_a_leaf_kept_later_in_the_tree_is_refused(tmp_path: Path) -> None:
    """``{"a", "b"}`` renamed ``{"^a$": "b"}``: ``b`` is kept under its name, after ``a`` in the
    tree; the two would be one. (The bug: the kept leaf silently replaced the renamed one.)"""
    mp.save(tmp_path / "c", {"a": np.arange(3, dtype=np.int32), "b": np.arange(4, dtype=np.int32)})
    tree = ms.open(tmp_path / "c").tree
    with pytest.raises(ValueError, match=r"'a' would be renamed to 'b', which another leaf keeps"):
        ms.rename(tree, {r"^a$": "b"})
    with pytest.raises(ValueError, match=r"'a' and 'b' would both be named 'a'"):
        ms.rename(tree, {r"^b$": "a"})  # (the kept leaf comes first)
    swapped = ms.rename(tree, {r"^a$": "b", r"^b$": "a"})  # both renamed: no leaf is lost
    out = ms.write(tmp_path / "out", swapped)
    got = mp.load(out)
    assert same_bits(got["a"], np.arange(4, dtype=np.int32))
    assert same_bits(got["b"], np.arange(3, dtype=np.int32))


# -- save_async keeps the values as of the call ------------------------------------------------


def test_save_async_saves_the_values_of_the_call_when_the_caller_changes_them_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An 8 MiB NumPy leaf changed on the line after ``save_async`` returns. Every staging copy
    made off the caller's thread waits until the caller has changed the array: a save that
    copied in its background part would then save the changed values (the bug), every time."""
    from milepost.workers.save import _stage

    caller = threading.current_thread()
    changed = threading.Event()
    real = _stage.parallel_copy
    off_thread: list[str] = []

    def copy(pairs: Any) -> Any:
        if threading.current_thread() is not caller:
            off_thread.append(threading.current_thread().name)
            assert changed.wait(60), "the caller never changed its array"
        return real(pairs)

    monkeypatch.setattr(_stage, "parallel_copy", copy)
    x = np.arange(2 << 20, dtype=np.float32)  # 8 MiB
    want = x.copy()
    handle = mp.save_async(tmp_path / "c", {"x": x, "y": x[:1000]})
    x[:] = -1.0  # the very next line
    changed.set()
    handle.result(timeout=120)
    got = mp.load(tmp_path / "c")
    assert same_bits(got["x"], want) and same_bits(got["y"], want[:1000])
    assert off_thread == []


# -- a surgery plan reports what it will write -------------------------------------------------


def test_a_cast_is_what_the_plan_stats_and_diff_report(tmp_path: Path) -> None:
    """After ``ms.cast`` to bfloat16, the lazy leaf, ``ms.stats`` and ``ms.diff`` say bfloat16,
    its size counts 2 bytes an element, and a float32 tree is not equal to its cast. (The bug:
    the cast recorded its input's dtype; the written values were right, everything that
    reports the plan was wrong, and ``diff`` called the two trees equal.)"""
    w = np.linspace(-3, 3, 64 * 32, dtype=np.float32).reshape(64, 32) + np.float32(1e-3)
    mp.save(tmp_path / "c", {"w": w, "b": np.arange(32, dtype=np.float32)})
    tree = ms.open(tmp_path / "c").tree
    cast = ms.cast(tree, jnp.bfloat16, where=r"^w$")
    assert cast["w"].dtype == jnp.bfloat16 and cast["b"].dtype == np.float32
    assert cast["w"].nbytes == 64 * 32 * 2
    table = ms.stats(cast)
    assert table["w"]["dtype"] == "bfloat16" and table["b"]["dtype"] == "float32"
    assert table["w"]["max"] == float(w.astype(ml_dtypes.bfloat16).astype(np.float32).max())
    d = ms.diff(tree, cast)
    assert not d.equal and d.different == ("w",), d
    assert "float32" in d.table["w"]["note"] and "bfloat16" in d.table["w"]["note"], d
    assert math.isnan(d.table["w"]["max_abs_diff"]) or d.table["w"]["max_abs_diff"] > 0
    out = ms.write(tmp_path / "out", cast)
    assert mp.metadata(out).tree["w"].dtype == jnp.bfloat16
    assert same_bits(mp.load(out)["w"], w.astype(ml_dtypes.bfloat16))


# -- a recovery never mixes two saves of a step ------------------------------------------------


def test_a_recovery_refuses_a_part_of_another_save_of_the_step_planted_after_the_listing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 3 is saved twice, by two runs with different values. After the recovery lists the
    node folder (the first run's save of step 3, its token), the other run's part of step 3 is
    put in its place: the part is refused as another save's, and the step comes from storage,
    exactly the first run's values. (The bug: the token no longer checked when a part is read;
    the recovery returned the other save's values as step 3.)"""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from milepost.colocated import _process_peers
    from milepost.training import Checkpointer, FixedInterval, PeerTier
    from milepost.workers import peers

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    sharding = NamedSharding(mesh, P("data", "model"))
    w = jax.device_put(np.arange(64 * 32, dtype=np.float32).reshape(64, 32), sharding)

    def run(root: Path, shm: Path, offset: float) -> None:
        tier = PeerTier(copies=0, path=str(shm), node="here", keep_on_close=True)
        with Checkpointer(root, save_policy=FixedInterval(interval=3), peers=tier) as c:
            for step in (1, 2, 3):
                c.save(step, {"w": w + step + offset, "step": step})

    run(tmp_path / "ckpt", tmp_path / "shm", 0.0)
    run(tmp_path / "other", tmp_path / "other-shm", 1000.0)  # step 3, another save
    (ours,) = (tmp_path / "shm").iterdir()
    (theirs,) = (tmp_path / "other-shm").iterdir()
    tokens = {p.name: {h.token for h in peers.listing(p) if h.step == 3} for p in (ours, theirs)}
    assert tokens[ours.name] != tokens[theirs.name]
    real_held = _process_peers.ProcessPeers.held

    def held(self: Any, timeout: float) -> Any:
        listed = real_held(self, timeout)
        shutil.rmtree(ours / "step_3" / "owner_0")
        shutil.copytree(theirs / "step_3" / "owner_0", ours / "step_3" / "owner_0")
        return listed

    monkeypatch.setattr(_process_peers.ProcessPeers, "held", held)
    abstract = {"w": jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=sharding), "step": 0}
    tier = PeerTier(copies=0, path=str(tmp_path / "shm"), node="here", keep_on_close=True)
    with Checkpointer(tmp_path / "ckpt", peers=tier) as again:
        r = again.recover(abstract_state=abstract)
    assert r.step == 3 and r.tier != "peers", r
    assert any("another save of step 3" in note for note in r.notes), r.notes
    assert np.array_equal(np.asarray(r.state["w"]), np.asarray(w + 3)) and r.state["step"] == 3
