"""Where bytes go: milepost.io_stats per host, and what it proves about load-and-broadcast,
replica-parallel saving and subchunked resharded loads (bounds are byte counts, never times)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost.workers import _iostats
from tests import _mc
from tests._helpers import assert_tree_equal

BROADCAST = mp.LoadOptions(load_and_broadcast=True, replica_axis="data")
META = 64 << 10
"""Bytes of metadata (manifests, B-tree nodes, headers) a host may read besides array data."""


def special_values() -> dict[str, np.ndarray]:
    """Arrays whose bits must survive exactly: signed zeros and NaN payloads, bfloat16, bool."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((64, 256)).astype(np.float32)
    w[0, :4] = [-0.0, 0.0, np.inf, -np.inf]
    w.view(np.uint32)[1, :3] = [
        0x7FC00001,
        0xFFC12345,
        0x7F800001,
    ]  # NaNs with payloads (one signalling)
    return {
        "w": w,
        "h": rng.standard_normal((32, 128)).astype(ml_dtypes.bfloat16),
        "m": rng.standard_normal((16, 64)) > 0,
        "i": rng.integers(-(2**31), 2**31 - 1, (32, 64), dtype=np.int32),
    }


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# ------------------------------------------------------------------------------------------
# Options and one process
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"load_and_broadcast": True}, ValueError, "needs the mesh axis.*replica_axis='data'"),
        ({"replica_axis": "data"}, ValueError, "does nothing without load_and_broadcast=True"),
        (
            {"load_and_broadcast": 1, "replica_axis": "data"},
            TypeError,
            "load_and_broadcast must be True or False",
        ),
        (
            {"load_and_broadcast": True, "replica_axis": ""},
            TypeError,
            "replica_axis must be a mesh axis name",
        ),
        (
            {"load_and_broadcast": True, "replica_axis": ("data",)},
            TypeError,
            "replica_axis must be a mesh axis name",
        ),
    ],
)
def test_load_and_broadcast_options_are_checked(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        mp.LoadOptions(**kwargs)


def test_io_stats_in_one_process_count_a_save_and_a_load(
    mesh24: jax.sharding.Mesh, tmp_path: Path
) -> None:
    x = jax.device_put(
        np.arange(512 * 512, dtype=np.float32).reshape(512, 512),
        NamedSharding(mesh24, P("data", "model")),
    )
    before = mp.io_stats()
    assert len(before.hosts) == 1 and before.controller is None
    mp.save(tmp_path / "c", {"x": x})
    saved = mp.io_stats() - before
    assert x.nbytes <= saved.bytes_written <= x.nbytes + META and saved.write_requests >= 1
    before = mp.io_stats()
    data_before = _iostats.COUNTERS.values()["read_requests"]
    loaded = mp.load(tmp_path / "c")
    got = mp.io_stats() - before
    data_requests = _iostats.COUNTERS.values()["read_requests"] - data_before
    assert np.array_equal(np.asarray(loaded["x"]), np.asarray(x))
    assert x.nbytes <= got.bytes_read <= x.nbytes + META  # direct reads: each shard once
    # at most one request per shard (the data's requests: the direct reads' preadv calls; the
    # others are TensorStore's reads of the manifest and B-tree): shards lying back to back in
    # one data file (where the writes happened to put them) are read with one preadv
    assert 1 <= data_requests <= 8 and data_requests < got.read_requests
    assert got.bytes_written == 0 and got.bytes_between_hosts == 0
    assert "read" in str(got) and "received" in str(got)


def test_load_and_broadcast_changes_nothing_in_one_process(
    mesh24: jax.sharding.Mesh, tmp_path: Path
) -> None:
    values = special_values()
    mp.save(
        tmp_path / "c",
        {k: jax.device_put(v, NamedSharding(mesh24, P(None, "model"))) for k, v in values.items()},
    )
    abstract = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh24, P(None, "model")))
        for k, v in values.items()
    }
    before = mp.io_stats()
    plain = mp.load(tmp_path / "c", abstract)
    plain_stats = mp.io_stats() - before
    with mp.Context(loading=BROADCAST):
        before = mp.io_stats()
        broadcast = mp.load(tmp_path / "c", abstract)
        broadcast_stats = mp.io_stats() - before
        other = jax.make_mesh((8,), ("m",))
        with pytest.raises(
            ValueError,
            match=r"array 'w' is loaded onto a mesh with axes \('m',\), which has no axis 'data'",
        ):
            mp.load(
                tmp_path / "c",
                {
                    **abstract,
                    "w": jax.ShapeDtypeStruct(
                        (64, 256), np.float32, sharding=NamedSharding(other, P())
                    ),
                },
            )
    for k, v in values.items():
        assert (
            same_bits(np.asarray(broadcast[k]), v) and broadcast[k].sharding == abstract[k].sharding
        ), k
        assert same_bits(np.asarray(plain[k]), v), k
    # each distinct box read once either way (metadata reads vary by a few KiB from load to load)
    nbytes = sum(v.nbytes for v in values.values())
    for stats in (plain_stats, broadcast_stats):
        assert nbytes <= stats.bytes_read <= nbytes + META and stats.bytes_between_hosts == 0


# ------------------------------------------------------------------------------------------
# A slice: 4 hosts x 2 devices, replicas along 'data' on different hosts
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def slice42(ray_runtime: Any) -> Any:
    with mp.Slice.start(hosts=4, devices_per_host=2) as s:
        yield s


def per_host(stats: mp.IoStats, field: str) -> list[int]:
    return [getattr(h, field) for h in stats.hosts]


def test_replica_parallel_saving_balances_the_bytes_written(
    slice42: mp.Slice, tmp_path: Path
) -> None:
    mesh = slice42.mesh({"data": 2, "model": 4})
    rng = np.random.default_rng(0)
    # shards of 2 MiB (2 replicas each) and an 8 MiB array on all 8 devices: cut into pieces
    # of 1 MiB, the write floor
    values = {f"w{i}": rng.standard_normal((1024, 2048)).astype(np.float32) for i in range(4)}
    values["full"] = rng.standard_normal((2048, 1024)).astype(np.float32)
    shardings = {k: mesh.sharding(P(None, "model")) for k in values}
    shardings["full"] = mesh.sharding(P())
    tree = slice42.put(values, shardings)
    nbytes = sum(v.nbytes for v in values.values())
    written = {}
    for parallel in (True, False):
        with mp.Context(saving=mp.SaveOptions(replica_parallel=parallel)):
            before = mp.io_stats(slice=slice42)
            mp.save(tmp_path / f"c{parallel}", tree)
            written[parallel] = per_host(mp.io_stats(slice=slice42) - before, "bytes_written")
    assert nbytes <= sum(written[True]) <= nbytes + 4 * META
    assert max(written[True]) / min(written[True]) <= 1.1, written[
        True
    ]  # every replica writes its part
    assert max(written[False][2:]) <= META, written[
        False
    ]  # without: replica 0's hosts (0 and 1) write it all


def test_small_replicated_arrays_are_one_write_each_spread_over_the_hosts(
    slice42: mp.Slice, tmp_path: Path
) -> None:
    """Below the write floor a replicated array is not cut into a write per replica (before: a
    16 KiB array on 8 devices became 8 writes of 2 KiB, 8 chunks and 8 checksum entries): it is
    one write, by one of its replicas in turn, so the arrays of a tree spread over the hosts."""
    mesh = slice42.mesh({"data": 2, "model": 4})
    values = {f"a{i}": np.full((64, 64), i, np.float32) for i in range(16)}
    tree = slice42.put(values, {k: mesh.sharding(P()) for k in values})
    before = mp.io_stats(slice=slice42)
    mp.save(tmp_path / "c", tree)
    written = per_host(mp.io_stats(slice=slice42) - before, "bytes_written")
    assert all(w >= 16 * 1024 for w in written), written  # every host wrote whole arrays
    meta = mp.metadata(tmp_path / "c")
    for name, value in values.items():
        assert meta.tree[name].write_shape == value.shape, meta.tree[name]  # one write
    abstract = {
        k: mp.AbstractArray(v.shape, v.dtype, mesh.sharding(P())) for k, v in values.items()
    }
    assert_tree_equal(slice42.fetch(mp.load(tmp_path / "c", abstract)), values)


def test_load_and_broadcast_reads_the_checkpoint_once_on_a_slice(
    slice42: mp.Slice, tmp_path: Path
) -> None:
    mesh = slice42.mesh({"data": 2, "model": 4})  # data 0: hosts 0 and 1; data 1: hosts 2 and 3
    values = special_values()
    mp.save(
        tmp_path / "c", slice42.put(values, {k: mesh.sharding(P("data", "model")) for k in values})
    )
    nbytes = sum(v.nbytes for v in values.values())
    abstract = {
        k: mp.AbstractArray(v.shape, v.dtype, mesh.sharding(P(None, "model")))
        for k, v in values.items()
    }

    before, traffic = mp.io_stats(slice=slice42), slice42.traffic()
    plain = mp.load(tmp_path / "c", abstract)
    plain_stats = mp.io_stats(slice=slice42) - before
    with mp.Context(loading=BROADCAST):
        before, traffic = mp.io_stats(slice=slice42), slice42.traffic()
        loaded = mp.load(tmp_path / "c", abstract)
        stats = mp.io_stats(slice=slice42) - before
        moved = slice42.traffic() - traffic

    # every replica reads its own boxes without it; with it, storage is read once
    assert 2 * nbytes <= plain_stats.bytes_read <= 2 * nbytes + 4 * META
    assert nbytes <= stats.bytes_read <= nbytes + 4 * META, stats
    assert all(b <= META for b in per_host(stats, "bytes_read")[2:]), (
        stats
    )  # replica 1's hosts read metadata only
    # each device of replica 1 received its shard once, from another host; nothing through the
    # controller
    assert stats.bytes_between_hosts == nbytes and per_host(stats, "bytes_received") == [
        0,
        0,
        nbytes // 2,
        nbytes // 2,
    ]
    assert moved.total_bytes < 64 << 10, moved
    got = slice42.fetch(loaded)
    for k, v in values.items():
        assert same_bits(got[k], v), k
        assert loaded[k].sharding == abstract[k].sharding and loaded[k].dtype == v.dtype, k
    assert all(
        same_bits(a, b)
        for a, b in zip(jax.tree.leaves(slice42.fetch(plain)), jax.tree.leaves(got), strict=True)
    )

    # replicas on the same host (data is the inner axis): read once there, nothing to broadcast
    inner = slice42.mesh({"model": 4, "data": 2})
    with mp.Context(loading=BROADCAST):
        before = mp.io_stats(slice=slice42)
        local = mp.load(
            tmp_path / "c",
            {
                k: mp.AbstractArray(v.shape, v.dtype, inner.sharding(P(None, "model")))
                for k, v in values.items()
            },
        )
        stats = mp.io_stats(slice=slice42) - before
    assert stats.bytes_between_hosts == 0 and nbytes <= stats.bytes_read <= nbytes + 4 * META
    assert same_bits(slice42.fetch(local["w"]), values["w"])


def test_a_failed_read_with_load_and_broadcast_leaves_the_slice_usable(
    slice42: mp.Slice, tmp_path: Path
) -> None:
    mesh = slice42.mesh({"data": 2, "model": 4})
    rng = np.random.default_rng(1)
    values = {f"w{i}": rng.standard_normal((64, 512)).astype(np.float32) for i in range(3)}
    tree = slice42.put(values, {k: mesh.sharding(P("data", "model")) for k in values})
    mp.save(tmp_path / "bad", tree)
    mp.save(tmp_path / "good", tree)
    for data in (tmp_path / "bad" / "state").glob(
        "ocdbt.process_0*/d/*"
    ):  # chunks host 0 wrote, and reads back
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 3] ^= 0x01
        data.write_bytes(bytes(raw))
    abstract = {
        k: mp.AbstractArray(v.shape, v.dtype, mesh.sharding(P(None, "model")))
        for k, v in values.items()
    }
    with mp.Context(loading=BROADCAST, async_=mp.AsyncOptions(timeout_secs=60)):
        with pytest.raises(mp.CorruptCheckpointError) as failed:
            mp.load(tmp_path / "bad", abstract)
        assert isinstance(failed.value.__cause__, mp.HostError)  # which host found it
        assert str(failed.value.__cause__).startswith("host 0 "), failed.value.__cause__
        assert slice42.healthy
        # the other hosts finished their collectives: the next load runs at once, exactly
        loaded = mp.load(tmp_path / "good", abstract)
    assert all(same_bits(slice42.fetch(loaded[k]), v) for k, v in values.items())


def test_a_resharded_load_of_a_subchunked_checkpoint_reads_what_it_needs(
    slice42: mp.Slice, tmp_path: Path
) -> None:
    """Saved sharded (2, 4), loaded sharded (8, 1): each target shard spans four saved shards and
    keeps a quarter of each. With inner chunks of a quarter shard the hosts read what they need."""
    mesh = slice42.mesh({"data": 2, "model": 4})
    rng = np.random.default_rng(2)
    values = {
        f"w{i}": rng.standard_normal((512, 1024)).astype(np.float32) for i in range(2)
    }  # 2 MiB each
    tree = slice42.put(values, {k: mesh.sharding(P("data", "model")) for k in values})
    # shards of 256 x 256 floats in inner chunks of 16 x 256 (16 KiB bands of rows): a target
    # shard's 64 rows cover the chunks it touches whole, so checking them needs no other bytes
    with mp.Context(saving=mp.SaveOptions(chunk_byte_size=16 << 10)):
        mp.save(tmp_path / "c", tree)
    assert mp.metadata(tmp_path / "c").tree["w0"].chunk_shape == (16, 256)
    rows = slice42.mesh({"x": 8})
    abstract = {
        k: mp.AbstractArray(v.shape, v.dtype, rows.sharding(P("x"))) for k, v in values.items()
    }
    before = mp.io_stats(slice=slice42)
    loaded = mp.load(tmp_path / "c", abstract)
    stats = mp.io_stats(slice=slice42) - before
    needed = sum(v.nbytes for v in values.values())
    assert stats.bytes_read <= 1.05 * needed, (
        f"read {stats.bytes_read / needed:.3f}x the bytes needed"
    )
    assert all(np.array_equal(slice42.fetch(loaded[k]), v) for k, v in values.items())


# ------------------------------------------------------------------------------------------
# Multi-controller: 2 processes x 4 devices
# ------------------------------------------------------------------------------------------


def test_load_and_broadcast_in_a_multi_controller_job(tmp_path: Path) -> None:
    results = _mc.launch("broadcast", 2, 4, str(tmp_path), module="tests._mc_broadcast")
    outs = []
    for r in results:
        assert r.returncode == 0 and "exception" not in r.out, (r.out.get("exception"), r.stderr)
        outs.append(r.out)
    nbytes = outs[0]["nbytes"]
    assert outs[0]["stats"] == outs[1]["stats"]  # every process gets every process's counters
    plain, broadcast = outs[0]["stats"]["plain"], outs[0]["stats"]["broadcast"]
    assert 2 * nbytes <= sum(plain["read"]) <= 2 * nbytes + 2 * META
    assert nbytes <= broadcast["read"][0] <= nbytes + META and broadcast["read"][1] <= META
    assert broadcast["sent"] == [nbytes, 0] and broadcast["received"] == [0, nbytes]
    assert all(o["exact"] for o in outs)
