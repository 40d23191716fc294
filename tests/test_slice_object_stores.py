"""Ray slices on object stores (moto's S3 server, fake-gcs-server, on 127.0.0.1): the hosts get
the controller's storage environment, write and read their own shards in the bucket, and no
array byte passes through the controller. ``memory://`` is refused: the hosts cannot reach it."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost import workers as _storage
from milepost.colocated import _actors
from tests._helpers import same_bits
from tests._object_stores import new_gcs_bucket, new_s3_bucket

pytestmark = [
    pytest.mark.usefixtures("ray_runtime"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


@pytest.fixture(scope="module")
def new_url(s3_endpoint: tuple[str, Any], gcs_endpoint: str) -> Callable[[str], str]:
    """A fresh, empty location in a new bucket of the given scheme ('s3' or 'gs')."""

    def make(scheme: str) -> str:
        bucket = new_s3_bucket(s3_endpoint[0]) if scheme == "s3" else new_gcs_bucket(gcs_endpoint)
        return f"{scheme}://{bucket}/run"

    return make


@pytest.fixture(scope="module")
def slice22(ray_runtime: Any, new_url: Callable[[str], str]) -> Iterator[mp.Slice]:
    """Started once both servers' variables are set in this process. Ray's workers inherit the
    environment Ray started with, which may predate them: the hosts must get them forwarded."""
    with mp.Slice.start(
        hosts=2, devices_per_host=2, options=mp.SliceOptions(timeout_secs=120)
    ) as s:
        yield s


def objects(url: str) -> list[str]:
    from milepost import workers as _paths

    return _paths.as_path(url).keys()


def host_values() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {
        "w": rng.standard_normal((32, 64), dtype=np.float32),
        "e": (rng.standard_normal((16, 8)) * 100).astype(ml_dtypes.bfloat16),
        "i": rng.integers(-(2**31), 2**31 - 1, (8, 4), dtype=np.int32),
        "b": np.arange(64, dtype=np.float32) - 0.5,
    }


def on_slice(s: mp.Slice, values: dict[str, np.ndarray]) -> dict[str, mp.RemoteArray]:
    mesh = s.mesh({"data": 2, "model": 2})
    specs = {"w": P("data", "model"), "e": P("model"), "i": P(None, "data"), "b": P()}
    return s.put(values, {k: mesh.sharding(specs.get(k, P("data", "model"))) for k in values})


def resharded(s: mp.Slice, values: dict[str, np.ndarray]) -> dict[str, mp.AbstractArray]:
    mesh = s.mesh({"x": 4})
    return {
        k: mp.AbstractArray(
            v.shape, v.dtype, mesh.sharding(P(None, "x") if v.ndim == 2 else P("x"))
        )
        for k, v in values.items()
    }


def assert_fetched_equal(s: mp.Slice, got: dict[str, Any], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert isinstance(got[k], mp.RemoteArray), k
        fetched = s.fetch(got[k])
        assert same_bits(fetched, v), f"{k}: {fetched} != {v}"


# ------------------------------------------------------------------------------------------
# The hosts' environment
# ------------------------------------------------------------------------------------------


def test_the_hosts_get_the_controllers_storage_variables(slice22: mp.Slice) -> None:
    import ray

    sent = _storage.storage_environment()
    assert {"AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "TENSORSTORE_GCS_HTTP_URL"} <= set(sent)

    def seen(actor: Any) -> tuple[dict[str, str], dict[str, str]]:
        env_vars = ray.get_runtime_context().runtime_env.get("env_vars", {})
        return env_vars, {k: os.environ[k] for k in _storage.STORAGE_ENV_VARS if k in os.environ}

    for env_vars, environ in ray.get(
        [a.__ray_call__.remote(seen) for a in slice22.group._actors], timeout=60
    ):
        assert {
            k: v for k, v in env_vars.items() if k in _storage.STORAGE_ENV_VARS
        } == sent  # forwarded, only those set
        assert {k: environ[k] for k in sent} == sent


def test_forwarding_is_an_option(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _storage.STORAGE_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_REGION", "eu-test-1")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "127.0.0.1:1")
    monkeypatch.setenv("UNRELATED_SECRET", "x")
    fake = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    assert _actors.actor_env(2, mp.SliceOptions()) == {
        "AWS_REGION": "eu-test-1",
        "STORAGE_EMULATOR_HOST": "127.0.0.1:1",
        **fake,
    }
    assert _actors.actor_env(2, mp.SliceOptions(forward_storage_env=False)) == fake
    assert _actors.actor_env(None, mp.SliceOptions()) == {
        "AWS_REGION": "eu-test-1",
        "STORAGE_EMULATOR_HOST": "127.0.0.1:1",
    }
    with pytest.raises(TypeError, match="forward_storage_env must be True or False"):
        mp.SliceOptions(forward_storage_env="yes")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------
# Checkpoints of slice arrays in buckets
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_round_trip_on_the_slice(
    slice22: mp.Slice, new_url: Callable[[str], str], scheme: str
) -> None:
    url, values = new_url(scheme), host_values()
    mp.save(f"{url}/1", {"params": on_slice(slice22, values), "step": 3, "host": np.arange(7)})
    names = objects(f"{url}/1")
    assert "commit_success.txt" in names
    assert {n.split("/")[1] for n in names if n.startswith("state/ocdbt.process_")} >= {
        "ocdbt.process_0",
        "ocdbt.process_1",
    }
    abstract = {"params": resharded(slice22, values), "step": 0, "host": np.zeros(7, np.int64)}
    loaded = mp.load(f"{url}/1", abstract)
    assert loaded["step"] == 3 and same_bits(loaded["host"], np.arange(7))
    assert loaded["params"]["w"].sharding.milepost_spec.spec == (None, "x")
    assert_fetched_equal(slice22, loaded["params"], values)
    assert mp.metadata(f"{url}/1").tree["params"]["e"].dtype == np.dtype(ml_dtypes.bfloat16)
    if scheme == "s3":
        report = mp.verify(
            f"{url}/1", slice=slice22
        )  # the hosts read every chunk back from the bucket
        assert report.ok and report.chunks_checked > len(values), report
        handle = mp.save_async(f"{url}/2", on_slice(slice22, values))
        handle.result(120)
        assert_fetched_equal(slice22, mp.load(f"{url}/2", resharded(slice22, values)), values)


def test_array_bytes_never_pass_through_the_controller(
    slice22: mp.Slice, new_url: Callable[[str], str], s3_endpoint: tuple[str, Any]
) -> None:
    url, log = new_url("s3"), s3_endpoint[1]
    mesh = slice22.mesh({"data": 2, "model": 2})
    per_array, requests = {}, {}
    for rows in (
        64,
        2048,
    ):  # 64 KiB and 2 MiB arrays: the controller's traffic must not grow with size
        rng = np.random.default_rng(rows)
        values = {f"w{i}": rng.standard_normal((rows, 256), dtype=np.float32) for i in range(4)}
        tree = slice22.put(values, {k: mesh.sharding(P("data", "model")) for k in values})
        before, before_requests = slice22.traffic(), log.count()
        mp.save(f"{url}/{rows}", tree)
        loaded = mp.load(
            f"{url}/{rows}",
            {
                k: mp.AbstractArray(v.shape, v.dtype, mesh.sharding(P("model")))
                for k, v in values.items()
            },
        )
        moved = slice22.traffic() - before
        requests[rows] = log.count() - before_requests
        assert moved.messages > 0 and moved.bytes_from_hosts > 0
        per_array[rows] = moved.total_bytes / len(values)
        assert same_bits(slice22.fetch(loaded["w3"]), values["w3"])
    assert requests[64] > 0, "the S3 server saw the hosts' writes and reads"
    assert per_array[2048] <= 4096, (
        f"{per_array[2048]:.0f} bytes per array passed through the controller"
    )
    assert per_array[2048] <= per_array[64] * 1.1 + 64, per_array


def test_a_checkpointer_keeps_the_latest_steps(
    slice22: mp.Slice, new_url: Callable[[str], str]
) -> None:
    from milepost.training import Checkpointer, KeepLatest

    url = new_url("s3")
    mesh = slice22.mesh({"data": 2, "model": 2})
    values = {
        step: np.arange(32 * 16, dtype=np.float32).reshape(32, 16) + 1000 * step
        for step in range(5)
    }
    with Checkpointer(url, keep=KeepLatest(n=2)) as ckpt:
        for step in range(5):
            ckpt.save(
                step,
                {"w": slice22.put(values[step], mesh.sharding(P("data", "model"))), "step": step},
                metrics={"loss": float(-step)},
            )
        ckpt.wait()
        assert ckpt.steps == [3, 4] and ckpt.latest == 4
    assert sorted({n.split("/")[0] for n in objects(url)}) == ["3", "4"]
    with Checkpointer(url, read_only=True) as again:
        assert again.steps == [3, 4]
        out = again.load(
            None,
            {"w": mp.AbstractArray((32, 16), np.float32, mesh.sharding(P("model"))), "step": 0},
        )
        assert out["step"] == 4 and isinstance(out["w"], mp.RemoteArray)
        assert same_bits(slice22.fetch(out["w"]), values[4])


def test_memory_is_refused_with_a_slice(slice22: mp.Slice) -> None:
    from milepost.training import Checkpointer

    values = {"w": np.arange(16, dtype=np.float32).reshape(4, 4)}
    tree = on_slice(slice22, values)
    url = "memory://slice-refused/run"
    refused = pytest.raises(
        ValueError,
        match=r"is in memory, inside this process; the other processes of .* cannot reach it",
    )
    with refused:
        mp.save(f"{url}/1", tree)
    with refused:
        mp.save_async(f"{url}/1", tree)
    mp.save(f"{url}/local", {"w": np.arange(3)})  # memory:// itself works in this process
    with refused:
        mp.load(
            f"{url}/local",
            {"w": mp.AbstractArray((3,), np.int64, slice22.mesh({"x": 4}).sharding(P()))},
        )
    with refused:
        mp.verify(f"{url}/local", slice=slice22)
    with Checkpointer(f"{url}/steps") as ckpt, refused:
        ckpt.save(0, tree)
    assert objects(url) == [
        n for n in objects(url) if n.startswith("local/")
    ]  # nothing else was written


def test_the_hosts_mirror_their_own_files(
    slice22: mp.Slice, new_url: Callable[[str], str], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local tier on a slice: each host copies its own shards' files to the bucket (the
    controller only its metadata), for mp.copy and the Checkpointer's mirror alike."""
    from milepost import _copy
    from milepost.training import Checkpointer, KeepLatest

    url = new_url("s3")
    mesh = slice22.mesh({"data": 2, "model": 2})
    rng = np.random.default_rng(7)
    values = {
        f"w{i}": rng.standard_normal((512, 256), dtype=np.float32) for i in range(2)
    }  # 1 MiB in all
    tree = slice22.put(values, {k: mesh.sharding(P("data", "model")) for k in values})
    mp.save(tmp_path / "a", tree)
    before = slice22.traffic()
    report = mp.copy(tmp_path / "a", f"{url}/copied", slice=slice22)
    moved = slice22.traffic() - before
    assert sorted(report.by_host) == ["0", "1", "controller"]
    assert report.by_host["0"] + report.by_host["1"] >= 2**20 > 64 * report.by_host["controller"]
    assert moved.total_bytes < 16384, moved  # plans and acks, not bytes
    abstract = {
        k: mp.AbstractArray(v.shape, v.dtype, mesh.sharding(P("model"))) for k, v in values.items()
    }
    loaded = mp.load(f"{url}/copied", abstract)
    assert all(same_bits(slice22.fetch(loaded[k]), v) for k, v in values.items())
    mirrors: list[mp.CopyReport] = []
    real = _copy.copy_with
    monkeypatch.setattr(
        _copy, "copy_with", lambda *a, **k: (lambda r: (mirrors.append(r), r)[1])(real(*a, **k))
    )
    with Checkpointer(f"{url}/run", local=tmp_path / "local", local_keep=KeepLatest(n=1)) as ckpt:
        before = slice22.traffic()
        for step in range(3):
            ckpt.save(step, tree)
        ckpt.wait()
        moved = slice22.traffic() - before
        assert ckpt.durable_steps == [0, 1, 2] and ckpt.steps == [0, 1, 2]
    assert moved.total_bytes < 3 * 32768, (
        moved
    )  # three saves and three mirrors: plans and acks only
    assert len(mirrors) == 3 and all(r.by_host["0"] + r.by_host["1"] >= 2**20 for r in mirrors)
    assert sorted(p.name for p in (tmp_path / "local").iterdir()) == ["2"]
    loaded = mp.load(f"{url}/run/1", abstract)
    assert all(same_bits(slice22.fetch(loaded[k]), v) for k, v in values.items())
