"""Checkpoints in object stores, against real servers on 127.0.0.1 (moto's S3 server,
fake-gcs-server) and memory://: round trips, commit-marker visibility, overwrite, one writer
per path by lease, a writer killed mid-save, no local side effects, unknown schemes."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost import _storage
from milepost.workers import _paths
from tests import _subproc
from tests._helpers import assert_tree_equal, put
from tests._object_stores import new_s3_bucket, wait_out_lease

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def state(mesh: jax.sharding.Mesh, k: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(k)
    return {
        "params": {
            "w": put(rng.standard_normal((64, 128), dtype=np.float32), mesh, P("data", "model")),
            "b": put(np.arange(128, dtype=np.float32) + k, mesh, P()),
        },
        "host": np.arange(300) * (k + 1),
        "step": 10 + k,
        "note": f"state {k}",
    }


def objects(url: str) -> list[str]:
    from milepost import workers as _paths

    return _paths.as_path(url).keys()


def test_round_trip_metadata_and_verify(bucket_url: str, mesh24: jax.sharding.Mesh) -> None:
    want = state(mesh24)
    path = mp.save(f"{bucket_url}/1", want)
    assert str(path) == f"{bucket_url}/1"
    assert_tree_equal(mp.load(f"{bucket_url}/1"), want)
    other = jax.make_mesh((8,), ("x",))
    resharded = mp.load(
        f"{bucket_url}/1",
        {
            "params": {
                "w": jax.ShapeDtypeStruct(
                    (64, 128), np.float32, sharding=jax.sharding.NamedSharding(other, P("x"))
                )
            }
        },
        partial=True,
    )
    assert np.array_equal(np.asarray(resharded["params"]["w"]), np.asarray(want["params"]["w"]))
    meta = mp.metadata(f"{bucket_url}/1")
    assert meta.tree["params"]["w"].shape == (64, 128)
    report = mp.verify(f"{bucket_url}/1")
    assert report.ok and report.chunks_checked > 0, report
    names = objects(f"{bucket_url}/1")
    assert (
        "commit_success.txt" in names
        and "_CHECKPOINT_METADATA" in names
        and "state/_METADATA" in names
    )
    assert not any(
        "milepost-lease" in n or "orbax-checkpoint-tmp" in n for n in objects(bucket_url)
    )


def test_without_its_commit_marker_a_checkpoint_is_invisible(
    bucket_url: str, mesh24: jax.sharding.Mesh
) -> None:
    from milepost import workers as _paths

    mp.save(f"{bucket_url}/1", state(mesh24))
    (_paths.as_path(f"{bucket_url}/1") / "commit_success.txt").unlink()
    with pytest.raises(mp.CheckpointNotFoundError, match="commit marker"):
        mp.load(f"{bucket_url}/1")
    with mp.training.Checkpointer(bucket_url, read_only=True) as ckpt:
        assert ckpt.steps == []


def test_overwrite_replaces_whole(bucket_url: str, mesh24: jax.sharding.Mesh) -> None:
    mp.save(f"{bucket_url}/1", state(mesh24, 0))
    with pytest.raises(mp.CheckpointExistsError, match="overwrite=True"):
        mp.save(f"{bucket_url}/1", state(mesh24, 1))
    mp.save(f"{bucket_url}/1", {"only": np.arange(3)}, overwrite=True)
    assert_tree_equal(mp.load(f"{bucket_url}/1"), {"only": np.arange(3)})
    assert not any(
        n.startswith("state/params") for n in objects(f"{bucket_url}/1")
    )  # nothing of the old one left


def test_a_failed_save_leaves_nothing(
    bucket_url: str, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    def merge(directory: Any) -> None:
        raise OSError(5, "Input/output error (injected)")

    monkeypatch.setattr(mp.workers.format, "merge_ocdbt", merge)
    with pytest.raises(OSError, match="injected"):
        mp.save(f"{bucket_url}/1", state(mesh24))
    # Only the failed save's lease, expired: a write landing late is then the debris of a save
    # that is gone, which the next save removes.
    assert objects(bucket_url) == ["1.milepost-lease"]
    lease, _ = _storage._workspace.read_lease(_paths.as_path(f"{bucket_url}/1.milepost-lease"))
    assert lease is not None and lease.expires <= time.time()
    monkeypatch.undo()
    mp.save(f"{bucket_url}/1", state(mesh24))  # the path is usable again, at once
    assert_tree_equal(mp.load(f"{bucket_url}/1"), state(mesh24))
    assert "1.milepost-lease" not in objects(bucket_url)


def test_objects_no_save_left_are_never_deleted(bucket_url: str) -> None:
    from milepost import workers as _paths

    (_paths.as_path(f"{bucket_url}/1") / "notes.txt").write_bytes(b"mine")
    for overwrite in (False, True):
        with pytest.raises(mp.CheckpointExistsError, match="not a committed checkpoint"):
            mp.save(f"{bucket_url}/1", {"x": np.arange(3)}, overwrite=overwrite)
    assert objects(bucket_url) == ["1/notes.txt"]


def test_checkpointer_with_retention(bucket_url: str, mesh24: jax.sharding.Mesh) -> None:
    from milepost.training import Checkpointer, KeepLatest

    with Checkpointer(bucket_url, keep=KeepLatest(n=2)) as ckpt:
        for step in range(5):
            ckpt.save(step, state(mesh24, step))
        ckpt.wait()
        assert ckpt.steps == [3, 4] and ckpt.latest == 4
    assert sorted({n.split("/")[0] for n in objects(bucket_url)}) == ["3", "4"]
    with Checkpointer(bucket_url, read_only=True) as reader:
        assert reader.steps == [3, 4]
        assert_tree_equal(reader.load(), state(mesh24, 4))


def test_no_local_side_effects(
    tmp_path: Path, mesh24: jax.sharding.Mesh, s3_endpoint: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a user: s3:// and gs:// paths were written as local folders ('./s3:/bucket')."""
    from etils import epath

    monkeypatch.chdir(tmp_path)
    bucket = new_s3_bucket(s3_endpoint[0])
    mp.save(f"s3://{bucket}/a", {"x": np.arange(3)})
    mp.save(epath.Path(f"s3://{bucket}/b"), {"x": np.arange(3)})
    assert_tree_equal(mp.load(epath.Path(f"s3://{bucket}/b")), {"x": np.arange(3)})
    assert list(tmp_path.iterdir()) == [] and not Path("/s3").exists()
    for bad in ("hdfs://cluster/ckpt", "ftp://host/x", "s3:///no-bucket"):
        with pytest.raises(
            mp.workers.UnknownStorageError, match="Nothing was written|names no bucket"
        ):
            mp.save(bad, {"x": 1})
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------
# One writer per path (S3: moto checks conditional writes; fake-gcs-server does not)
# ------------------------------------------------------------------------------------------


def test_a_second_writer_is_refused_and_a_dead_ones_lease_expires(s3_endpoint: Any) -> None:
    url = f"s3://{new_s3_bucket(s3_endpoint[0])}/run/1"
    holder = _subproc.popen_module("tests._lease_holder", url)
    assert holder.stdout is not None
    try:
        assert holder.stdout.readline().strip() == "holding"
        with pytest.raises(
            mp.CheckpointExistsError, match=r"process \d+ on host .* is writing it now"
        ):
            mp.save(url, {"x": np.arange(3)})
        holder.send_signal(signal.SIGKILL)  # dies mid-save: its lease is no longer renewed
        holder.wait(60)
        with pytest.raises(mp.CheckpointNotFoundError):
            mp.load(url)  # what it wrote is not visible
        wait_out_lease(url)  # its lease expires
        mp.save(url, {"x": np.arange(5)})  # takes over, removes the leftovers, commits
        assert_tree_equal(mp.load(url), {"x": np.arange(5)})
    finally:
        holder.kill()
        holder.wait(60)


def test_a_checkpointer_removes_a_dead_writers_leftovers(s3_endpoint: Any) -> None:
    from milepost.training import Checkpointer

    url = f"s3://{new_s3_bucket(s3_endpoint[0])}/run"
    holder = _subproc.popen_module("tests._lease_holder", f"{url}/7")
    assert holder.stdout is not None
    try:
        assert holder.stdout.readline().strip() == "holding"
        with Checkpointer(url) as ckpt:  # the writer lives: its step is left alone
            assert ckpt.steps == []
        assert any(n.startswith("7/") for n in objects(url))
        holder.send_signal(signal.SIGKILL)
        holder.wait(60)
        wait_out_lease(f"{url}/7")
        with Checkpointer(url) as ckpt:
            assert ckpt.steps == []
        assert objects(url) == []
    finally:
        holder.kill()
        holder.wait(60)


def test_s3_requests_grow_with_files_not_chunks(
    s3_endpoint: Any, mesh24: jax.sharding.Mesh
) -> None:
    endpoint, log = s3_endpoint
    bucket = new_s3_bucket(endpoint)
    counts = {}
    for chunk_bytes in (None, 1024):  # 8 shards, or 8 x 32 inner chunks of 1 KiB
        value = {
            "w": put(
                np.arange(256 * 128, dtype=np.float32).reshape(256, 128), mesh24, P("data", "model")
            )
        }
        before = log.count()
        with mp.Context(
            saving=mp.SaveOptions(chunk_byte_size=chunk_bytes, ocdbt_writers_per_host=1)
        ):
            mp.save(f"s3://{bucket}/{chunk_bytes}", value)
        saved = log.count() - before
        before = log.count()
        assert_tree_equal(mp.load(f"s3://{bucket}/{chunk_bytes}"), value)
        counts[chunk_bytes] = (saved, log.count() - before)
    (save_few, load_few), (save_many, load_many) = counts[None], counts[1024]
    assert save_many <= save_few + 4, counts  # 32x the chunks, the same files
    assert load_many <= load_few + 8, counts
    assert os.environ["AWS_ENDPOINT_URL"] == endpoint


def test_s3_loads_of_many_small_arrays_coalesce_their_reads(
    s3_endpoint: Any, mesh24: jax.sharding.Mesh
) -> None:
    endpoint, log = s3_endpoint
    bucket = new_s3_bucket(endpoint)
    loads = {}
    for n in (8, 64):  # each array: 8 shards of 2 KiB, all in the hosts' few data files
        value = {
            f"w{i}": put(np.full((64, 64), i, np.float32), mesh24, P("data", "model"))
            for i in range(n)
        }
        mp.save(f"s3://{bucket}/{n}", value)
        before = log.count()
        assert_tree_equal(mp.load(f"s3://{bucket}/{n}"), value)
        loads[n] = log.count() - before
    assert loads[64] <= loads[8] + 24, loads  # 8x the shards (448 more), a handful more requests


def test_a_slow_retention_delete_never_stalls_saves(
    s3_endpoint: Any, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from milepost.training import Checkpointer, KeepLatest, _tier

    url = f"s3://{new_s3_bucket(s3_endpoint[0])}/run"
    gate, deleting = threading.Event(), threading.Event()
    real = _tier.Tier.delete

    def slow_delete(self: Any, steps: list[int]) -> list[int]:
        deleting.set()
        assert gate.wait(60)
        return real(self, steps)

    monkeypatch.setattr(_tier.Tier, "delete", slow_delete)
    with Checkpointer(url, keep=KeepLatest(n=1)) as ckpt:
        ckpt.save(0, state(mesh24, 0))
        ckpt.save(1, state(mesh24, 1))
        assert deleting.wait(60)  # retention is stuck deleting step 0
        for step in range(2, 5):  # saves go on, and commit
            ckpt.save(step, state(mesh24, step))
        deadline = time.monotonic() + 60
        while ckpt.latest != 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ckpt.latest == 4 and "0/commit_success.txt" in objects(url)
        gate.set()
        ckpt.wait()
        assert ckpt.steps == [4]
    assert sorted({n.split("/")[0] for n in objects(url)}) == ["4"]


def test_a_load_asks_for_each_small_object_once(
    s3_endpoint: Any, mesh24: jax.sharding.Mesh
) -> None:
    """Under throttling every request costs a back-off: a load, a metadata call and a verify
    list the checkpoint once and read each metadata object once, and a save reads back each
    file it wrote once. Only the commit marker and
    ``_CHECKPOINT_METADATA`` are asked twice: when the call starts and once it read everything
    (whether the checkpoint was replaced meanwhile). Before: 7 listings, 6 HEADs of the marker
    and 8 requests for ``_CHECKPOINT_METADATA`` in one load."""
    import collections
    import re

    endpoint, log = s3_endpoint
    url = f"s3://{new_s3_bucket(endpoint)}/run/1"
    mp.save(url, {**state(mesh24), "note": "hi"})
    calls = {"save": lambda u: mp.save(f"{u}-again", {**state(mesh24), "note": "hi"})}
    calls |= {"load": mp.load, "metadata": mp.metadata, "verify": mp.verify}
    for name, call in calls.items():
        before = len(log.lines)
        call(url)
        asked = collections.Counter(
            m.group(1)
            for line in log.lines[before:]
            if (m := re.search(r'"(?:GET|HEAD) (\S+) HTTP', line)) is not None
        )
        listings = {k: n for k, n in asked.items() if "list-type=2" in k}
        # (a save lists its path before and after taking the lease, its per-process databases
        # to merge them, the folder of what it wrote to confirm its databases' manifests before
        # the merge and every file the merged view references after it, and what it wrote at
        # the commit)
        assert sum(listings.values()) <= (6 if name == "save" else 1), (name, listings)
        for key, n in asked.items():
            if "/d/" in key or "list-type=2" in key or key.endswith("manifest.ocdbt"):
                continue  # the OCDBT database: TensorStore's reads, per open of the view
            twice = key.endswith(".milepost-lease") or (  # looked for, then read back
                name != "save" and key.endswith(("commit_success.txt", "_CHECKPOINT_METADATA"))
            )
            assert n <= (2 if twice else 1), (name, key, n, dict(asked))


# ------------------------------------------------------------------------------------------
# Damaged data read from a bucket
# ------------------------------------------------------------------------------------------


def test_a_flipped_byte_in_a_chunk_in_a_bucket_is_caught(
    bucket_url: str, mesh24: jax.sharding.Mesh
) -> None:
    """A byte of one shard's data flipped in the store (read, changed, written back): a load is
    a CorruptCheckpointError naming the array, the chunk and where it was read, never other
    values; the rest still loads, and verify reports the chunk."""
    import tensorstore as ts

    from milepost import workers as _paths
    from tests.test_integrity import ocdbt_value

    want = state(mesh24)
    url = f"{bucket_url}/1"
    mp.save(url, want)
    folder = _paths.as_path(url) / "state"
    kv = ts.KvStore.open(_paths.kvstore(folder), context=_paths.context_for(folder)).result()
    file, offset, length = ocdbt_value(kv, "params.w/c/1/2")
    data = bytearray(kv.read(file).result().value)
    data[offset + length // 2] ^= 0x01
    kv.write(file, bytes(data)).result()
    with pytest.raises(mp.CorruptCheckpointError) as info:
        mp.load(url)
    error = info.value
    assert error.array == "params.w" and error.chunk == (1, 2), error
    assert error.path is not None and str(folder) in error.path, error
    assert "fails its checksum" in str(error), error
    rest = mp.load(url, {"host": np.zeros(300, np.int64), "step": 0}, partial=True)
    assert_tree_equal(rest, {"host": want["host"], "step": 10})
    report = mp.verify(url)
    assert not report.ok and any(
        "'params.w'" in p and "(1, 2)" in p and "fails its checksum" in p for p in report.problems
    ), report
