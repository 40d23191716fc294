"""Storage that misbehaves, through a fault-injecting proxy in front of the real S3 server
(tests/_faulty_proxy.py): a lost reply is not a conflict. And paths that are not paths are
refused before anything is written."""

from __future__ import annotations

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
from tests._faulty_proxy import FaultyProxy, faulty_proxy
from tests._helpers import assert_tree_equal, gate_merge
from tests._object_stores import new_s3_bucket, s3_endpoint  # noqa: F401  (a fixture)


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
            BackgroundSaveError, match=r"(?s)(acknowledged writes of|does not read back)"
        ) as failed:
            ckpt.save(2, tree(2), force=True)
        assert isinstance(failed.value.__cause__, OSError)
        assert rule.hits >= 1
        rule.left = 0
        assert ckpt.steps == [1]
        assert_tree_equal(ckpt.load(), tree(1))
        ckpt.save(2, tree(2), force=True)  # the path is not blocked
        assert ckpt.steps == [1, 2]
        assert_tree_equal(ckpt.load(2), tree(2))
    proxy.fail("PUT", "/3/commit_success.txt", "drop-write")
    with pytest.raises(OSError, match="acknowledged writes"):
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
