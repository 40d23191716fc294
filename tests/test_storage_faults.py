"""Storage that misbehaves, through a fault-injecting proxy in front of the real S3 server
(tests/_faulty_proxy.py): a lost reply is not a conflict. And paths that are not paths are
refused before anything is written."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost.workers import _paths
from tests import _subproc
from tests._faulty_proxy import FaultyProxy, faulty_proxy
from tests._helpers import assert_tree_equal, gate_merge, tensorstore_writes_only
from tests._object_stores import new_gcs_bucket, new_s3_bucket, s3_endpoint  # noqa: F401


@pytest.fixture
def proxy(s3_endpoint: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultyProxy]:  # noqa: F811
    with faulty_proxy(s3_endpoint[0]) as p:
        monkeypatch.setenv("AWS_ENDPOINT_URL", p.url)
        yield p


def test_a_lost_reply_to_taking_the_lease_is_not_another_writer(
    s3_endpoint: Any,  # noqa: F811
    proxy: FaultyProxy,
) -> None:
    """The lease's create-if-absent PUT lands but its answer is lost; the client re-sends it
    and the server refuses the repeat. The lease found is byte for byte the one this save
    wrote: the save goes on (before: CheckpointExistsError naming its own process)."""
    url = f"s3://{new_s3_bucket(s3_endpoint[0])}/run/1"
    rule = proxy.fail("PUT", "1.milepost-lease", "lose-reply")
    mp.save(url, {"x": np.arange(5)})
    assert rule.hits == 1
    assert_tree_equal(mp.load(url), {"x": np.arange(5)})


def test_a_lost_reply_to_a_renewal_is_not_a_takeover(
    s3_endpoint: Any,  # noqa: F811
    proxy: FaultyProxy,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A save held open while its lease's renewals lose their replies still commits (before:
    "another writer took over its lease")."""
    from milepost.training import Checkpointer

    url = f"s3://{new_s3_bucket(s3_endpoint[0])}/run"
    gate = gate_merge(monkeypatch)  # the save waits in its background part: renewals happen
    proxy.fail("PUT", "/0.milepost-lease", "pass")  # the lease's creation goes through
    rule = proxy.fail("PUT", "/0.milepost-lease", "lose-reply", count=2)
    with mp.Context(saving=mp.SaveOptions(lease_secs=1.0)), Checkpointer(url) as ckpt:
        ckpt.save(0, {"x": np.arange(7)}, force=True)
        deadline = time.monotonic() + 30
        while rule.left and time.monotonic() < deadline:  # both renewals lost their replies
            time.sleep(0.05)
        assert rule.hits == 2
        gate.set()
        ckpt.wait()
        assert ckpt.steps == [0]
        assert_tree_equal(ckpt.load(0), {"x": np.arange(7)})


@pytest.mark.parametrize(
    "lost",
    [
        "commit_success.txt",
        "_milepost_checksums.json",
        "_CHECKPOINT_METADATA",
        "state/_METADATA",
        "state/_sharding",
        "state/_milepost.json",
        "state/_strings.json",
        "state/manifest.ocdbt",
        "state/d/",  # the root view's B-tree, written by the merge
    ],
)
def test_a_write_acknowledged_and_not_kept_is_never_called_committed(
    s3_endpoint: Any,  # noqa: F811
    proxy: FaultyProxy,
    lost: str,
    mesh24: Any,
) -> None:
    """The store answers success for a write it drops. The save fails, saying what is missing;
    nothing is left that loads or that blocks the next save of the path (before: success was
    reported, and the step then did not load)."""
    from milepost.training import BackgroundSaveError, Checkpointer

    url = f"s3://{new_s3_bucket(s3_endpoint[0])}/run"
    w = jax.device_put(np.arange(64.0).reshape(8, 8), NamedSharding(mesh24, P("data", "model")))

    def tree(k: int) -> dict[str, Any]:
        return {"x": np.arange(k), "w": w + k, "note": f"step {k}"}

    with Checkpointer(url, asynchronous=False) as ckpt:
        ckpt.save(1, tree(1), force=True)
        rule = proxy.fail("PUT", f"/2/{lost}", "drop-write", count=100)
        with pytest.raises(
            BackgroundSaveError,
            match=r"(?s)(acknowledged writes of|does not read back|is missing before the commit)",
        ) as failed:
            ckpt.save(2, tree(2), force=True)
        assert isinstance(failed.value.__cause__, mp.LostWriteError)
        assert rule.hits >= 1
        rule.left = 0
        assert ckpt.steps == [1]
        assert_tree_equal(ckpt.load(), tree(1))
        ckpt.save(2, tree(2), force=True)  # the path is not blocked
        assert ckpt.steps == [1, 2]
        assert_tree_equal(ckpt.load(2), tree(2))
    proxy.fail("PUT", "/3/commit_success.txt", "drop-write")
    with pytest.raises(mp.LostWriteError, match="acknowledged writes"):
        mp.save(f"{url}/3", {"x": 1})
    with pytest.raises(mp.CheckpointNotFoundError):
        mp.load(f"{url}/3")


def test_a_data_iterator_state_acknowledged_and_not_kept_fails_the_save(
    s3_endpoint: Any,  # noqa: F811
    proxy: FaultyProxy,
) -> None:
    from tests.test_data_iterator import Counter

    url = f"s3://{new_s3_bucket(s3_endpoint[0])}/run/1"
    rule = proxy.fail("PUT", "data_iter/process_0-of-1.json", "drop-write")
    with pytest.raises(mp.CheckpointNotFoundError, match="did not keep it"):
        mp.save_checkpointables(url, {"state": {"x": np.arange(3)}, "data_iter": Counter(3)})
    assert rule.hits == 1
    with pytest.raises(mp.CheckpointNotFoundError):
        mp.load(url)


def test_a_lease_acknowledged_and_not_kept_is_not_held(
    s3_endpoint: Any,  # noqa: F811
    proxy: FaultyProxy,
) -> None:
    """Taking the lease is read back: a save whose lease the store dropped would share the path
    with the next writer. It fails before writing anything."""
    url = f"s3://{new_s3_bucket(s3_endpoint[0])}/run/1"
    rule = proxy.fail("PUT", "1.milepost-lease", "drop-write")
    with pytest.raises(OSError, match="acknowledged the lease"):
        mp.save(url, {"x": np.arange(3)})
    assert rule.hits == 1
    mp.save(url, {"x": np.arange(3)})
    assert_tree_equal(mp.load(url), {"x": np.arange(3)})


@pytest.mark.parametrize("bad", [None, 12345, 3.5, b"/tmp/x", object()])
def test_what_is_not_a_path_is_a_type_error(
    bad: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for call in (
        lambda: mp.save(bad, {"x": 1}),
        lambda: mp.load(bad),
        lambda: mp.metadata(bad),
        lambda: mp.verify(bad),
    ):
        with pytest.raises(TypeError, match="str or os.PathLike"):
            call()
    assert os.listdir(tmp_path) == []  # nothing written, not ./None, not ./12345


def test_an_empty_path_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="empty"):
        mp.save("", {"x": 1})
    assert os.listdir(tmp_path) == []


def _outcome(proxy: FaultyProxy, scenario: str, *argv: str) -> dict[str, Any]:
    """Run a scenario of ``tests/_stalled_storage.py`` in a fresh process (its own storage
    policy) that reaches S3 through ``proxy``; the JSON object it prints last."""
    import json
    import subprocess
    import sys

    child = subprocess.run(
        [sys.executable, "-m", "tests._stalled_storage", scenario, *argv],
        cwd=_subproc.ROOT,
        env={**_subproc.env(1), "AWS_ENDPOINT_URL": proxy.url},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr
    out: dict[str, Any] = json.loads(child.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("who", ["deadline", "storage"])
def test_a_stalled_write_fails_in_time_and_its_late_arrival_blocks_nothing(
    s3_endpoint: Any,  # noqa: F811
    proxy: FaultyProxy,
    who: str,
) -> None:
    """A data-file PUT the storage never answers, then applies after the save gave up on it.
    The save fails with a TimeoutError that says what and how long: at ``timeout_secs`` (the
    deadline; the failed save's writes are waited for and removed in the background), or when
    every attempt has been silent for ``silence_secs`` (the storage) — not after the minutes
    TensorStore's defaults take. The late writes land under the failed save's
    expired lease: the next save of the path takes it over, removes them and commits (before:
    every later save was refused, and the bucket had to be cleaned by hand)."""

    bucket_url = f"s3://{new_s3_bucket(s3_endpoint[0])}"
    url = f"{bucket_url}/run/1"
    rule = proxy.fail("PUT", "/state/ocdbt.process_controller/d/", "stall", count=1000)
    out = _outcome(proxy, "save", url, "4" if who == "deadline" else "600")
    assert out["error"] == "TimeoutError", out
    if who == "deadline":
        assert "did not finish within 4 s" in out["message"] and "'x'" in out["message"], out
        # reported when the deadline passed; the writes stop (the storage policy gives up on
        # them) and are removed afterwards, in the background
        assert out["secs"] < out["cleaned_secs"], out
        assert "removed once its writes stop" in " ".join(out["notes"]), out
    else:
        assert "each of 2 attempts moved nothing for 2 s" in out["message"], out
        assert "run/1.milepost-lease, expired" in " ".join(out["notes"]), out  # what is left
        assert rule.hits >= 2  # the first attempt, then the retry
    assert out["secs"] < 4 + out["budget"] + 30, out  # bounded (before: ~40 minutes)
    stalled = rule.hits
    proxy.release()  # the storage now applies every write it held: they land late
    deadline = time.monotonic() + 60
    while rule.forwarded < stalled and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rule.forwarded == stalled >= 1
    bucket = _paths.as_path(bucket_url)
    late = {k for k in bucket.keys() if k.startswith("run/1/")}
    assert late, "the late writes landed"
    assert "run/1.milepost-lease" in set(bucket.keys())  # the failed save's lease, expired
    state = {"x": np.arange(7), "note": "again"}
    mp.save(url, state)  # the path is not blocked
    assert_tree_equal(mp.load(url), state)
    assert mp.verify(url).ok
    keys = set(bucket.keys())
    assert not late & keys, "the late writes were removed"
    assert "run/1.milepost-lease" not in keys


def test_a_stalled_read_fails_when_the_storage_policy_gives_up(
    s3_endpoint: Any,  # noqa: F811
    proxy: FaultyProxy,
) -> None:
    """A load whose data-file GETs are never answered fails with a TimeoutError naming the
    object, after ``max_retries + 1`` silent attempts (before: a minute of silence per
    attempt, 33 attempts)."""

    url = f"s3://{new_s3_bucket(s3_endpoint[0])}/run/1"
    mp.save(url, {"x": np.arange(1000.0)})
    rule = proxy.fail("GET", "/run/1/state/d/", "stall", count=1000)
    out = _outcome(proxy, "load", url)
    assert out["error"] == "TimeoutError", out
    assert "each of 2 attempts moved nothing for 2 s" in out["message"], out
    assert "run/1/state/d/" in out["message"], out  # the object
    assert rule.hits == 2  # one attempt and one retry, each abandoned after 2 s of silence
    assert out["secs"] < out["budget"] + 30, out


def test_throttling_is_retried_and_every_value_is_exact(
    s3_endpoint: Any,  # noqa: F811
    proxy: FaultyProxy,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """503 SlowDown on the first requests of each kind: retried with the policy's back-off;
    saves, a Checkpointer loop with retention and loads give exact values."""
    import json

    from milepost.training import Checkpointer, KeepLatest
    from milepost.workers import _requests

    policy = mp.StorageOptions(
        silence_secs=_requests.silence_in_effect(), retry_delay_secs=0.01, retry_max_delay_secs=0.05
    )
    monkeypatch.setenv(_requests.ENV, json.dumps(dataclasses.asdict(policy)))
    url = f"s3://{new_s3_bucket(s3_endpoint[0])}/run"
    rules = [proxy.fail(m, "/run", "throttle", count=4) for m in ("PUT", "GET", "HEAD", "DELETE")]
    with Checkpointer(url, keep=KeepLatest(n=2), asynchronous=False) as ckpt:
        for step in range(4):
            ckpt.save(step, {"x": np.arange(step + 3), "step": step}, force=True)
        assert ckpt.steps == [2, 3]
        assert_tree_equal(ckpt.load(3), {"x": np.arange(6), "step": 3})
    assert [r.hits for r in rules if r.method in ("PUT", "GET")] == [4, 4]


def test_a_checkpointer_loop_survives_a_stalled_step(
    s3_endpoint: Any,  # noqa: F811
    proxy: FaultyProxy,
) -> None:
    """Step 2's data writes stall: that step fails with a TimeoutError once the storage
    policy gives up on them (two silent attempts of 2 s). Retention keeps steps 0 and 1
    (nothing good is deleted on the strength of a step that failed); the writes land late, and
    a later run removes them and goes on."""
    import json
    import subprocess
    import sys

    bucket_url = f"s3://{new_s3_bucket(s3_endpoint[0])}"
    url = f"{bucket_url}/run"
    rule = proxy.fail("PUT", "/run/2/state/ocdbt.process_controller/d/", "stall", count=1000)
    child = subprocess.Popen(
        [sys.executable, "-m", "tests._stalled_storage", "loop", url],
        cwd=_subproc.ROOT,
        env={**_subproc.env(1), "AWS_ENDPOINT_URL": proxy.url},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = _subproc.Lines(child)  # every wait for the child bounded: a regression fails
    try:
        assert child.stdin is not None
        first = json.loads(lines.next(300))
        assert first == {"2": "TimeoutError", "steps": [0, 1]}, first
        proxy.release()
        deadline = time.monotonic() + 60
        while rule.forwarded < rule.hits and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rule.forwarded == rule.hits >= 1
        bucket = _paths.as_path(bucket_url)
        assert any(k.startswith("run/2/") for k in bucket.keys())  # the late writes
        child.stdin.write("go\n")
        child.stdin.flush()
        second = json.loads(lines.next(300))
        assert second == {"steps": [1, 3]}, second
        assert child.wait(60) == 0
    finally:
        child.kill()
    keys = set(bucket.keys())
    assert not any(k.startswith("run/2") for k in keys), sorted(keys)  # debris and lease removed
    assert_tree_equal(mp.load(f"{url}/3"), {"x": np.arange(1000.0) + 3})


@pytest.mark.parametrize("fault", ["error-500", "reset", "truncate", "away"])
def test_transient_failures_are_retried_and_every_value_is_exact(
    s3_endpoint: Any,  # noqa: F811
    proxy: FaultyProxy,
    fault: str,
) -> None:
    """500s, connections reset, GET bodies cut short, and the server away for 2 s: a
    Checkpointer loop with retention and the loads after it retry with the storage policy and
    give exact values, and nothing is left that blocks a later save."""
    from milepost.training import Checkpointer, KeepLatest

    url = f"s3://{new_s3_bucket(s3_endpoint[0])}/run"
    rules = []
    if fault == "away":
        proxy.away(2.0)
    else:
        methods = ("GET",) if fault == "truncate" else ("PUT", "GET", "HEAD", "DELETE")
        rules = [proxy.fail(m, "/run", fault, count=3, every=3) for m in methods]
    with Checkpointer(url, keep=KeepLatest(n=2), asynchronous=False) as ckpt:
        for step in range(3):
            ckpt.save(step, {"x": np.arange(1000.0) + step, "step": step}, force=True)
        assert ckpt.steps == [1, 2]
        assert_tree_equal(ckpt.load(2), {"x": np.arange(1000.0) + 2, "step": 2})
    assert_tree_equal(mp.load(f"{url}/1"), {"x": np.arange(1000.0) + 1, "step": 1})
    assert all(r.hits == 3 for r in rules), [(r.method, r.hits) for r in rules]
    assert fault != "away" or proxy.refused >= 1  # the loop met the server away
    mp.save(f"{url}/9", {"x": 9})
    assert_tree_equal(mp.load(f"{url}/9"), {"x": 9})


# ------------------------------------------------------------------------------------------
# A data file lost before the commit: every kind a save writes, on S3, GCS and a local disk
# ------------------------------------------------------------------------------------------

_LOST_DATA_FILES = {
    # kind: (the lost file, matched in the key; the least bytes of its write)
    "packed": (r"/state/ocdbt\.process_0\.p/d/[0-9a-f]{8}\.0000$", 0),  # milepost's own shards
    "packed-table": (r"/state/ocdbt\.process_0\.p/d/[0-9a-f]{8}\.0001$", 0),  # their checksums
    "tensorstore": (r"/state/ocdbt\.process_0/d/[0-9a-f]+$", 100_000),  # TensorStore's values
    "zarr3": (r"/state/w/c/1/0$", 0),  # a plain zarr3 chunk file (SaveOptions(use_ocdbt=False))
}


def _lossy_tree(kind: str, mesh: Any) -> dict[str, Any]:
    """A tree whose save writes a data file of ``kind`` (see _LOST_DATA_FILES)."""
    w = np.arange(512 * 512, dtype=np.float32).reshape(512, 512)
    return {"w": jax.device_put(w, NamedSharding(mesh, P("data"))), "x": np.arange(5)}


@contextlib.contextmanager
def _saving(kind: str) -> Iterator[None]:
    """Saves in this block write ``kind`` (TensorStore's databases only, or plain zarr3)."""
    with contextlib.ExitStack() as stack:
        if kind == "tensorstore":
            stack.enter_context(tensorstore_writes_only())
        if kind == "zarr3":
            stack.enter_context(mp.Context(saving=mp.SaveOptions(use_ocdbt=False)))
        yield


@pytest.fixture(params=["s3", "gs"])
def lossy_store(
    request: Any, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[str, str, FaultyProxy]]:
    """A fresh location on the S3 or the GCS emulator behind a fault-injecting proxy: its URL,
    the method of an object's write there, and the proxy."""
    if request.param == "s3":
        endpoint, _ = request.getfixturevalue("s3_endpoint")
        with faulty_proxy(endpoint) as p:
            monkeypatch.setenv("AWS_ENDPOINT_URL", p.url)
            yield f"s3://{new_s3_bucket(endpoint)}/run", "PUT", p
    else:
        endpoint = request.getfixturevalue("gcs_endpoint")
        with faulty_proxy(endpoint) as p:
            monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", p.url)
            yield f"gs://{new_gcs_bucket(endpoint)}/run", "POST", p


@pytest.mark.parametrize("kind", list(_LOST_DATA_FILES))
def test_a_data_file_write_acknowledged_and_not_kept_fails_the_save(
    lossy_store: tuple[str, str, FaultyProxy], kind: str, mesh24: Any
) -> None:
    """The store answers success for the write of one data file and drops it. The save fails
    with a LostWriteError naming that object, before its commit marker: nothing is listed or
    loads, and the path takes the next save (before: the save reported success, the step was
    listed as committed, and its load failed)."""
    from milepost.training import Checkpointer

    root, write, proxy = lossy_store
    url = f"{root}/1"
    pattern, least = _LOST_DATA_FILES[kind]
    tree = _lossy_tree(kind, mesh24)
    rule = proxy.fail(write, "", "drop-write", pattern=pattern, min_bytes=least)
    with _saving(kind), pytest.raises(mp.LostWriteError) as lost:
        mp.save(url, tree)
    assert rule.hits == 1 and rule.keys is not None
    (dropped,) = rule.keys  # ("/<bucket>/run/1/state/...")
    assert lost.value.path is not None and lost.value.found_bytes is None
    assert lost.value.path.endswith(dropped.split("/", 2)[2]), (lost.value.path, dropped)
    assert dropped.split("/", 2)[2] in str(lost.value)
    assert not _paths.as_path(f"{url}/commit_success.txt").exists()
    with pytest.raises(mp.CheckpointNotFoundError):
        mp.load(url)
    with Checkpointer(root) as ckpt:
        assert ckpt.steps == []
    with _saving(kind):
        mp.save(url, tree)  # the path is not blocked
    assert_tree_equal(mp.load(url), tree)


def _damage_after_the_hosts_wrote(
    monkeypatch: pytest.MonkeyPatch, tmp: Path, pattern: str, how: str
) -> list[str]:
    """Once the host's writes are durable (its pending save answered, before the commit looks
    at the folder), delete or cut to half the largest file below ``tmp`` matching ``pattern``
    (the path from ``tmp``, with a leading '/'). Returns the files damaged (one)."""
    import re

    from milepost.workers.save import PendingSave

    real = PendingSave.wait
    damaged: list[str] = []

    def wait(self: Any, timeout: float | None = None) -> Any:
        ack = real(self, timeout)
        found = [
            p
            for p in tmp.rglob("*")
            if p.is_file() and re.search(pattern, "/" + p.relative_to(tmp).as_posix())
        ]
        if found and not damaged:
            victim = max(found, key=lambda p: p.stat().st_size)
            damaged.append(victim.relative_to(tmp).as_posix())
            if how == "delete":
                victim.unlink()
            else:
                os.truncate(victim, victim.stat().st_size // 2)
        return ack

    monkeypatch.setattr(PendingSave, "wait", wait)
    return damaged


@pytest.mark.parametrize("how", ["delete", "truncate"])
@pytest.mark.parametrize("kind", list(_LOST_DATA_FILES))
def test_a_data_file_removed_or_cut_on_a_local_disk_fails_the_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mesh24: Any, kind: str, how: str
) -> None:
    """A data file removed or cut short after the host wrote it, before the commit: the save
    fails with a LostWriteError naming it (and, cut, its size and the size needed), nothing is
    committed, and the temporary directory is removed (before: committed, and its load
    failed)."""
    final = tmp_path / "1"
    tmp = tmp_path / "1.orbax-checkpoint-tmp"
    pattern, _ = _LOST_DATA_FILES[kind]
    damaged = _damage_after_the_hosts_wrote(
        monkeypatch, tmp, pattern.replace("/state", "^/state"), how
    )
    with _saving(kind), pytest.raises(mp.LostWriteError) as lost:
        mp.save(final, _lossy_tree(kind, mesh24))
    (victim,) = damaged
    assert lost.value.path == str(tmp / victim)
    if how == "delete":
        assert lost.value.found_bytes is None
    else:
        assert lost.value.found_bytes is not None
        assert lost.value.found_bytes < lost.value.expected_bytes
    assert os.listdir(tmp_path) == []  # not committed; the temporary directory removed
    with pytest.raises(mp.CheckpointNotFoundError):
        mp.load(final)


@pytest.mark.parametrize("how", ["delete", "truncate"])
def test_a_safetensors_file_removed_or_cut_fails_the_export(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mesh24: Any, how: str
) -> None:
    """A safetensors file of an export (milepost.safetensors.export, milepost convert --to
    safetensors) removed or cut short after its host wrote it: the export fails with a
    LostWriteError naming it; no folder appears, and its staging folder is removed."""
    from milepost.workers.jobs import _export

    ckpt = tmp_path / "ckpt"
    mp.save(ckpt, _lossy_tree("packed", mesh24))
    real = _export.safetensors_format.write_file
    damaged: list[str] = []

    def write_file(path: str, header: bytes, arrays: Any) -> int:
        written = real(path, header, arrays)
        if not damaged:
            damaged.append(path)
            if how == "delete":
                os.unlink(path)
            else:
                os.truncate(path, os.path.getsize(path) - 1)
        return written

    monkeypatch.setattr(_export.safetensors_format, "write_file", write_file)
    out = tmp_path / "export"
    with pytest.raises(mp.LostWriteError) as lost:
        mp.safetensors.export(ckpt, out, max_shard_bytes=1 << 16)
    assert lost.value.path == damaged[0]
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
