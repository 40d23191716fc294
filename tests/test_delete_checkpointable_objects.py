"""Deleting one checkpointable of a checkpoint in an object store (s3:// on moto's server, gs://
on fake-gcs-server, memory://): under the path's lease, the commit marker removed first and
written last; a reader sees the checkpoint whole with it, nothing, or whole without it; a
failure puts it back or leaves what a later call finishes."""

from __future__ import annotations

import threading
from typing import Any

import jax
import pytest

import milepost as mp
from milepost import _storage
from milepost._checkpoint import _drop
from milepost._storage import _workspace
from milepost.training import Checkpointer
from milepost.workers import as_path
from tests._object_stores import new_s3_bucket
from tests.test_delete_checkpointable import check_rest, parts

ALL = {"state", "extra", "dataset"}


def keys(url: str) -> list[str]:
    return as_path(url).keys()


def snapshot(url: str) -> dict[str, bytes]:
    return {k: (as_path(url) / k).read_bytes() for k in keys(url)}


def test_delete_a_checkpointable_in_an_object_store(
    bucket_url: str, mesh24: jax.sharding.Mesh
) -> None:
    path = f"{bucket_url}/ckpt"
    mp.save_checkpointables(path, parts(mesh24), metrics={"loss": 0.5}, custom_metadata={"a": 1})
    before = mp.metadata(path)
    mp.delete_checkpointable(path, "extra")
    assert keys(path) and not any(k.startswith("extra/") for k in keys(path))
    assert all(k.startswith("ckpt/") for k in keys(bucket_url))  # its lease released
    check_rest(path, {"state", "dataset"})  # type: ignore[arg-type]
    after = mp.metadata(path)
    assert (after.commit_timestamp_nsecs, after.init_timestamp_nsecs) == (
        before.commit_timestamp_nsecs,
        before.init_timestamp_nsecs,
    )
    assert after.metrics == {"loss": 0.5} and after.custom_metadata == {"a": 1}
    with pytest.raises(mp.CheckpointableNotFoundError, match="'dataset', 'state'"):
        mp.delete_checkpointable(path, "extra")
    mp.delete_checkpointable(path, "dataset")
    check_rest(path, {"state"})  # type: ignore[arg-type]
    with pytest.raises(mp.LastCheckpointableError):
        mp.delete_checkpointable(path, "state")
    assert all(k.startswith("ckpt/") for k in keys(bucket_url))


def test_a_checkpointer_deletes_a_checkpointable_of_a_step_in_an_object_store(
    mesh24: jax.sharding.Mesh,
) -> None:
    root = "memory://drop-steps/run"
    with Checkpointer(root) as ckpt:
        ckpt.save_checkpointables(1, parts(mesh24), metrics={"loss": 1.0})
        ckpt.wait()
        ckpt.delete_checkpointable(1, "dataset")
        assert set(ckpt.load_checkpointables(1)) == {"state", "extra"}
        assert ckpt.steps == [1] and ckpt.metadata(1).metrics == {"loss": 1.0}
    check_rest(f"{root}/1", {"state", "extra"})  # type: ignore[arg-type]


def test_a_holder_of_the_lease_is_refused_or_waited_for(
    s3_endpoint: Any, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = f"s3://{new_s3_bucket(s3_endpoint[0])}/ckpt"
    mp.save_checkpointables(path, parts(mesh24))
    before = snapshot(path)
    holder = _storage.ObjectWorkspace(as_path(path), overwrite=True, wait_secs=0, lease_secs=60)
    holder.hold()  # as a save of the path in another process
    assert holder.lease is not None
    held = holder.lease.save_id
    try:
        with pytest.raises(mp.CheckpointExistsError, match="is writing it now") as refused:
            mp.delete_checkpointable(path, "extra")
        assert "changed nothing" in "".join(refused.value.__notes__)
        assert snapshot(path) == before
        waiting = threading.Event()
        real = _workspace.read_lease

        def spy(where: Any) -> Any:
            found = real(where)
            if found[0] is not None and found[0].save_id == held:
                waiting.set()  # the deletion found the holder's live lease
            return found

        monkeypatch.setattr(_workspace, "read_lease", spy)
        failures: list[BaseException] = []

        def delete() -> None:
            try:
                with mp.Context(saving=mp.SaveOptions(wait_for_writer_secs=120)):
                    mp.delete_checkpointable(path, "extra")
            except BaseException as e:
                failures.append(e)

        deleting = threading.Thread(target=delete)
        deleting.start()
        assert waiting.wait(60)
        assert snapshot(path) == before  # it waits, changing nothing
    finally:
        holder.release()
    deleting.join(120)
    assert not deleting.is_alive() and failures == []
    check_rest(path, {"state", "dataset"})  # type: ignore[arg-type]


def test_a_reader_sees_it_whole_with_nothing_or_whole_without(
    mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = "memory://drop-readers/ckpt"
    mp.save_checkpointables(path, parts(mesh24))
    seen: list[str] = []

    def look() -> None:
        try:
            loaded = mp.load_checkpointables(path)
        except mp.CheckpointNotFoundError:
            seen.append("nothing")
            return
        report = mp.verify(path)
        assert report.ok, str(report)
        seen.append("with" if set(loaded) == ALL else "without")
        check_rest(path, set(loaded))  # type: ignore[arg-type]

    for phase in ("_write_new", "_delete_objects", "_mark"):
        real = getattr(_drop, phase)

        def observed(*args: Any, _real: Any = real) -> Any:
            look()
            out = _real(*args)
            look()
            return out

        monkeypatch.setattr(_drop, phase, observed)
    look()
    mp.delete_checkpointable(path, "extra")
    look()
    assert seen == ["with"] + ["nothing"] * 5 + ["without"] * 2


def fail_once(monkeypatch: pytest.MonkeyPatch, owner: Any, attr: str, then: int = 0) -> None:
    """``owner.attr`` raises the first time it is called, and the ``then`` times after that."""
    real = getattr(owner, attr)
    calls = {"n": 0}

    def flaky(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] <= 1 + then:
            raise OSError(f"injected in {attr}")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, attr, flaky)


@pytest.mark.parametrize(
    "phase",
    ["metadata", "checksums", "metadata+undo", "checksums+undo", "objects", "marker"],
)
def test_a_failure_after_the_marker_was_removed(
    mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch, phase: str
) -> None:
    path = f"memory://drop-fail-{phase.replace('+', '-')}/ckpt"
    lease = f"{path}{_storage.LEASE_SUFFIX}"
    mp.save_checkpointables(path, parts(mesh24))
    before = snapshot(path)
    if phase.startswith("metadata"):
        # the new metadata's write fails, and (+undo) so does putting the old one back
        fail_once(monkeypatch, _drop, "_write_confirmed", then=int("undo" in phase))
    elif phase.startswith("checksums"):
        fail_once(monkeypatch, _drop.fmt.Checksums, "write")
        if "undo" in phase:  # putting the metadata back fails
            real_confirmed = _drop._write_confirmed
            calls = {"n": 0}

            def confirmed(*args: Any) -> None:
                calls["n"] += 1
                if calls["n"] == 2:
                    raise OSError("injected in putting back")
                real_confirmed(*args)

            monkeypatch.setattr(_drop, "_write_confirmed", confirmed)
    elif phase == "objects":

        def half(folder: Any) -> None:  # some objects gone, then the storage fails
            (folder / sorted(folder.keys())[0]).unlink()
            raise OSError("injected in deleting the objects")

        monkeypatch.setattr(_drop, "_delete_objects", half)
    else:
        fail_once(monkeypatch, _drop, "_mark")
    with pytest.raises(OSError, match="injected") as failed:
        mp.delete_checkpointable(path, "extra")
    notes = "".join(failed.value.__notes__)
    monkeypatch.undo()
    if phase in ("metadata", "checksums"):  # put back as it was
        assert "put back as it was" in notes
        assert snapshot(path) == before and not as_path(lease).exists()
        check_rest(path, ALL)  # type: ignore[arg-type]
    else:  # no checkpoint loads meanwhile; the next call for it finishes the deletion
        assert "again to finish" in notes and as_path(lease).exists()
        with pytest.raises(mp.CheckpointNotFoundError, match="no commit marker"):
            mp.load_checkpointables(path)
        assert not _storage.remove_abandoned_objects(as_path(path))  # a cleanup leaves it
        with pytest.raises(mp.CheckpointExistsError, match="did not finish"):
            mp.delete_checkpointable(path, "dataset")  # another deletion first finishes it
    mp.delete_checkpointable(path, "extra")
    check_rest(path, {"state", "dataset"})  # type: ignore[arg-type]
    assert not any(k.startswith("extra/") for k in keys(path)) and not as_path(lease).exists()


def test_a_failed_saves_leftover_is_not_a_checkpoint_and_keeps_its_lease(
    bucket_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save that failed leaves its lease, expired, to cover its writes that land late; a
    deletion on that path finds no checkpoint and leaves the lease as it was (before: it took
    the lease over and removed it, and the next save refused the path's unowned objects)."""
    import numpy as np

    path = f"{bucket_url}/ckpt"

    def failing_merge(directory: Any) -> None:
        raise OSError(5, "the merge failed")

    monkeypatch.setattr(mp.workers.format, "merge_ocdbt", failing_merge)
    with pytest.raises(OSError, match="the merge failed"):
        mp.save(path, {"x": np.arange(10)})
    monkeypatch.undo()
    lease = f"{bucket_url}/ckpt{_storage.LEASE_SUFFIX}"
    before = as_path(lease).read_bytes()
    assert before  # the failed save's, expired
    with pytest.raises(mp.CheckpointNotFoundError):
        mp.delete_checkpointable(path, "state")
    assert as_path(lease).read_bytes() == before
    mp.save(path, {"x": np.arange(3)})  # the next save takes it over, as ever
    assert np.array_equal(mp.load(path)["x"], np.arange(3))
