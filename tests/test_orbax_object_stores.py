"""Orbax v1 and milepost read each other's checkpoints in object stores, against real servers on
127.0.0.1 (fake-gcs-server, moto's S3 server).

- gs://: Orbax 0.12 saves in place and commits by its marker (``commit_success.txt`` last), with
  TensorStore's gcs driver for the arrays and etils.epath -> fsspec -> gcsfs for its small files.
  Both directions are tested on the emulator.
- s3://: Orbax 0.12 cannot write or read s3:// at all (it builds TensorStore specs for gs:// only
  and sends every other path to the local ``file`` driver). That milepost's S3 checkpoints are in
  Orbax's format is shown by copying the objects of one down to a folder and loading it there.
"""

from __future__ import annotations

import importlib
import json
import os
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import milepost as mp
from tests._helpers import assert_tree_equal, put
from tests._object_stores import new_gcs_bucket, new_s3_bucket

ocp = pytest.importorskip("orbax.checkpoint.experimental.v1")
pytestmark = [
    pytest.mark.filterwarnings("ignore:Sharding info not provided when restoring"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


def make_state(mesh: jax.sharding.Mesh, k: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(100 + k)
    return {
        "params": {
            "w": put(rng.standard_normal((64, 32), dtype=np.float32), mesh, P("data", "model")),
            "v": put(
                rng.standard_normal((16, 8), dtype=np.float32).astype(jax.numpy.bfloat16),
                mesh,
                P("model"),
            ),
            "r": put(rng.integers(-9, 9, (6, 5), dtype=np.int32), mesh, P()),
        },
        "host": {"f64": rng.standard_normal((5, 3)), "i16": np.arange(7, dtype=np.int16) * (k + 1)},
        "step": 40 + k,
        "lr": 0.125,
    }


def resharded(state: dict[str, Any]) -> dict[str, Any]:
    """An abstract tree for ``state`` on another mesh."""
    other = jax.make_mesh((4, 2), ("x", "y"))
    specs = {"w": P(None, "x"), "v": P("x"), "r": P("y")}
    return {
        "params": {
            k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(other, specs[k]))
            for k, a in state["params"].items()
        },
        "host": state["host"],
        "step": 0,
        "lr": 0.0,
    }


def assert_orbax_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Exact values after an Orbax load (which may give back NumPy scalars for Python ones)."""
    for k, w in want["params"].items():
        assert isinstance(got["params"][k], jax.Array)
        g = np.asarray(got["params"][k])
        assert g.dtype == w.dtype and np.array_equal(
            g.view(np.uint8), np.asarray(w).view(np.uint8)
        ), k
    for k, w in want["host"].items():
        assert got["host"][k].dtype == w.dtype and np.array_equal(got["host"][k], w), k
    assert int(got["step"]) == want["step"] and float(got["lr"]) == want["lr"]


# ------------------------------------------------------------------------------------- gs://


def gcs_objects(endpoint: str, url: str) -> list[str]:
    """The object names below ``url`` (gs://bucket/prefix), asked of the emulator directly."""
    bucket, _, prefix = url.removeprefix("gs://").partition("/")
    query = urllib.parse.urlencode({"prefix": prefix.rstrip("/") + "/"})
    with urllib.request.urlopen(f"{endpoint}/storage/v1/b/{bucket}/o?{query}", timeout=10) as r:
        items = json.load(r).get("items", [])
    return sorted(o["name"].removeprefix(prefix.rstrip("/") + "/") for o in items)


@pytest.fixture
def orbax_gcs(gcs_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Points Orbax's small-file I/O (etils.epath -> fsspec -> gcsfs) at the emulator; TensorStore
    already goes there through TENSORSTORE_GCS_HTTP_URL (set by ``gcs_endpoint``). Yields a fresh
    bucket's URL. Everything is undone afterwards, including the filesystem instances that etils
    and fsspec cache (their options are fixed when they are made)."""
    settings = {"endpoint_url": gcs_endpoint, "token": "anon", "use_listings_cache": False}
    # gcsfs reads this when it is imported: its default class asks the storage-control gRPC API
    # for each bucket's layout, which the emulator does not serve (a 60 s timeout per bucket).
    monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    monkeypatch.setenv("FSSPEC_GCS", json.dumps(settings))
    monkeypatch.setenv(
        "STORAGE_EMULATOR_HOST", gcs_endpoint
    )  # google-cloud-storage clients (Orbax's step code)
    pytest.importorskip("gcsfs")
    import fsspec.config
    import gcsfs.core
    from etils.epath import backend

    # fsspec reads FSSPEC_* once, when it is imported, and keeps the class it first found for a
    # protocol: both may predate this test, so set the options and the plain class directly.
    for protocol in ("gcs", "gs"):
        monkeypatch.setitem(fsspec.config.conf, protocol, dict(settings))
        monkeypatch.setitem(
            importlib.import_module("fsspec.registry")._registry, protocol, gcsfs.core.GCSFileSystem
        )

    def forget_filesystems() -> None:
        backend.fsspec_backend._get_filesystem.cache_clear()
        gcsfs.core.GCSFileSystem.clear_instance_cache()

    forget_filesystems()
    try:
        yield f"gs://{new_gcs_bucket(gcs_endpoint)}"
    finally:
        forget_filesystems()


def test_milepost_reads_orbax_on_gcs(
    orbax_gcs: str, gcs_endpoint: str, mesh24: jax.sharding.Mesh
) -> None:
    state = make_state(mesh24)
    path = f"{orbax_gcs}/orbax/1"
    ocp.save(path, state)
    written = gcs_objects(gcs_endpoint, path)  # in place (no temporary directory), marker included
    assert {
        "commit_success.txt",
        "_CHECKPOINT_METADATA",
        "state/_METADATA",
        "state/manifest.ocdbt",
    } <= set(written)
    assert not any("_milepost" in n for n in written)
    assert_tree_equal(mp.load(path), state)  # saved shardings, exact values, Python scalars
    abstract = resharded(state)
    got = mp.load(path, abstract)
    assert_tree_equal(got, state, check_sharding=False)
    assert all(got["params"][k].sharding == a.sharding for k, a in abstract["params"].items())
    meta = mp.metadata(path)
    assert (
        meta.tree["params"]["w"].shape == (64, 32)
        and meta.tree["params"]["v"].dtype == jax.numpy.bfloat16
    )
    assert meta.tree["params"]["w"].sharding.to_jax() == state["params"]["w"].sharding
    assert meta.commit_timestamp_nsecs


def test_milepost_checkpointer_reads_orbax_training_steps(
    orbax_gcs: str, gcs_endpoint: str, mesh24: jax.sharding.Mesh
) -> None:
    root = f"{orbax_gcs}/train"
    with ocp.training.Checkpointer(root) as theirs:
        for step in (1, 2):
            theirs.save_pytree(step, make_state(mesh24, step))
    assert {"1/commit_success.txt", "2/commit_success.txt"} <= set(gcs_objects(gcs_endpoint, root))
    with mp.training.Checkpointer(root, read_only=True) as ours:
        assert ours.steps == [1, 2] and ours.latest == 2
        assert_tree_equal(ours.load(), make_state(mesh24, 2))
        assert_tree_equal(ours.load(1), make_state(mesh24, 1))
        assert ours.metadata(1).tree["host"]["i16"].shape == (7,)


def test_orbax_reads_milepost_on_gcs(
    orbax_gcs: str, gcs_endpoint: str, mesh24: jax.sharding.Mesh
) -> None:
    state = make_state(mesh24)
    path = f"{orbax_gcs}/milepost/1"
    mp.save(path, state)
    assert "commit_success.txt" in gcs_objects(gcs_endpoint, path)
    assert ocp.is_orbax_checkpoint(path)
    assert_orbax_equal(ocp.load(path), state)
    abstract = resharded(state)
    got = ocp.load(path, abstract)
    assert_orbax_equal(got, state)
    assert got["params"]["w"].sharding == abstract["params"]["w"].sharding


def test_orbax_reads_milepost_checkpointer_steps_on_gcs(
    orbax_gcs: str, mesh24: jax.sharding.Mesh
) -> None:
    root = f"{orbax_gcs}/train"
    with mp.training.Checkpointer(root) as ours:
        for step in (3, 4):
            ours.save(step, make_state(mesh24, step))
    with ocp.training.Checkpointer(root) as theirs:
        assert [c.step for c in theirs.checkpoints] == [3, 4]
        assert_orbax_equal(theirs.load_pytree(4), make_state(mesh24, 4))


# ------------------------------------------------------------------------------------- s3://


def test_milepost_s3_checkpoint_is_orbax_format(
    s3_endpoint: tuple[str, Any], mesh24: jax.sharding.Mesh, tmp_path: Path
) -> None:
    """Orbax cannot reach S3, so the bucket's objects are copied to a folder, as they are, and
    Orbax loads that folder."""
    import boto3

    endpoint, _ = s3_endpoint
    bucket = new_s3_bucket(endpoint)
    state = make_state(mesh24)
    mp.save(f"s3://{bucket}/run/7", state)
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    keys = [
        o["Key"]
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="run/7/")
        for o in page.get("Contents", [])
    ]
    assert "run/7/commit_success.txt" in keys and "run/7/state/manifest.ocdbt" in keys
    for key in keys:
        local = tmp_path / "7" / key.removeprefix("run/7/")
        local.parent.mkdir(parents=True, exist_ok=True)
        s3.download_file(bucket, key, os.fspath(local))
    assert ocp.is_orbax_checkpoint(tmp_path / "7")
    assert_orbax_equal(ocp.load(tmp_path / "7"), state)
    assert_orbax_equal(ocp.load(tmp_path / "7", resharded(state)), state)
