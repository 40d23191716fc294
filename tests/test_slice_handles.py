"""Slice handles and the dispatch layer's accounting, without starting Ray."""

from __future__ import annotations

import gc
import pickle
from pathlib import Path

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost import _hosts as _dispatch
from milepost.colocated import RayHostGroup, SliceMesh, Traffic
from milepost.colocated._ray_group import pickled_size

IDS = [0, 1, 2048, 2049, 4096, 4097, 6144, 6145]  # 4 processes x 2 devices: not contiguous


class FakeGroup:
    def __init__(self) -> None:
        self.released: list[str] = []

    def release(self, array_id: str) -> None:
        self.released.append(array_id)


def test_mesh_and_sharding_map_by_device_id() -> None:
    group = FakeGroup()
    mesh = SliceMesh(group, {"data": 2, "model": 4}, IDS)
    sharding = mesh.sharding(P("data", "model"))
    assert sharding.device_ids == tuple(IDS) and sharding.spec == ("data", "model")
    assert sharding.shard_shape((8, 16)) == (4, 4)
    assert sharding.__milepost_host_group__ is group
    assert sharding == mesh.sharding(P("data", "model")) and sharding != mesh.sharding(P("model"))
    assert sharding != SliceMesh(FakeGroup(), {"data": 2, "model": 4}, IDS).sharding(
        P("data", "model")
    )
    with pytest.raises(ValueError, match="has 6 devices but the slice has 8"):
        SliceMesh(group, {"a": 6}, IDS)
    with pytest.raises(ValueError, match=r"names axes \['batch'\]"):
        mesh.sharding(P("batch"))


def test_remote_array_is_a_handle_freed_on_drop() -> None:
    group = FakeGroup()
    spec = SliceMesh(group, {"x": 8}, IDS).sharding(P("x")).milepost_spec
    x = mp.RemoteArray(group, "abc.0", (16, 4), "float32", spec)
    assert (x.shape, x.dtype, x.ndim, x.size, x.nbytes) == ((16, 4), np.float32, 2, 64, 256)
    assert x.__milepost_host_group__ is group and x.sharding.__milepost_host_group__ is group
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(x)
    del x
    gc.collect()
    assert group.released == ["abc.0"]


def test_dispatch_picks_the_slice_from_handles_and_abstract_shardings() -> None:
    g1, g2 = FakeGroup(), FakeGroup()
    s1 = SliceMesh(g1, {"x": 8}, IDS).sharding(P("x"))
    a = mp.RemoteArray(g1, "a.0", (8,), np.float32, s1.milepost_spec)
    b = mp.RemoteArray(g2, "b.0", (8,), np.float32, s1.milepost_spec)
    assert _dispatch.host_group_for([a, np.zeros(3), 1]) is g1
    with pytest.raises(ValueError, match="several slices"):
        _dispatch.host_group_for([a, b])
    assert _dispatch.host_group_for_abstract([0, mp.AbstractArray((8,), np.float32, s1)]) is g1


def test_pickled_size_counts_buffers_and_traffic_subtracts() -> None:
    big = np.zeros(1 << 20, np.uint8)
    assert pickled_size(big) >= 1 << 20
    assert pickled_size(("abc", [1, 2])) < 100
    t = Traffic(3, 100, 50) - Traffic(1, 40, 10)
    assert (t.messages, t.bytes_to_hosts, t.bytes_from_hosts, t.total_bytes) == (2, 60, 40, 100)


def test_group_owner_map_and_device_checks() -> None:
    idents = [{"node": f"n{i}" * 8, "ip": "127.0.0.1", "pid": 100 + i} for i in range(4)]
    group = RayHostGroup(
        [object()] * 4, idents, [IDS[2 * i : 2 * i + 2] for i in range(4)], timeout_secs=5
    )
    assert [group.process_of_device(d) for d in IDS] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert list(group.processes()) == [0, 1, 2, 3] and group.is_primary()
    assert group.describe_host(2) == "host 2 (node n2n2n2n2n2n2, ip 127.0.0.1, pid 102)"
    with pytest.raises(ValueError, match="device 2 is not in this slice"):
        group.process_of_device(2)
    spec = mp.ShardingSpec.named((8,), ("x",), (0, 1, 2, 3, 4, 5, 6, 7), ("x",))
    with pytest.raises(
        ValueError, match=r"cannot load 'w'.*devices \[2, 3, 4, 5, 6, 7\] are not in this slice"
    ):
        group.check_devices(spec, "w")
    group.barrier("b", 1.0)
    assert group.broadcast("k", 7, 1.0) == 7


def test_a_hosts_wait_sent_with_its_plan_ends_when_staging_fails_or_never_runs(
    tmp_path: Path,
) -> None:
    """A slice sends each host's ``wait_save`` together with its ``start_save``: the wait (on
    the actor's wait threads) first waits for the staging, and ends at once when the staging
    failed, or when the controller abandoned a staging call that never ran; nothing stays."""
    from concurrent.futures import ThreadPoolExecutor

    from milepost.colocated._ray_host import HostActor, Ref

    host = HostActor(0, 1, 1)
    plan = mp.workers.SavePlan(
        store=mp.workers.StoreSpec(directory=str(tmp_path), use_ocdbt=True),
        process_index=0,
        tasks=(),
    )
    with ThreadPoolExecutor(2) as pool:
        waiting = pool.submit(host.wait_save, "t1", 60.0)  # sent first, arrives first
        with pytest.raises(KeyError, match="holds no array 'gone'"):
            host.start_save(plan, [Ref("gone")], "t1")
        with pytest.raises(RuntimeError, match="could not stage this save"):
            waiting.result(60)
        waiting = pool.submit(host.wait_save, "t2", 60.0)
        host.abandon_save("t2")  # its start_save was cancelled before it ran
        with pytest.raises(RuntimeError, match="could not stage this save"):
            waiting.result(60)
        assert host.start_save(plan, [], "t3") == "t3"
        assert isinstance(pool.submit(host.wait_save, "t3", 60.0).result(60), mp.workers.SaveAck)
        host.abandon_save("t3")  # after its staging ran (and its wait ended): nothing to do
    assert host.pending == {}
