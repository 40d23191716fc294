"""A slice across the nodes of a real multi-node Ray cluster on this machine (four raylets, one
host each): save, load and surgery exact; a node removed while a save writes is a HostError
naming its host, and nothing is committed.

The tests' bodies run in the cluster's process, its driver (``tests/_cluster.py``, the
``ray_cluster`` fixture): the session's Ray runtime is not touched.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import psutil
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost import surgery as ms
from milepost.workers.format import COMMIT_MARKER
from tests._cluster import ClusterProcess, HeldWrites, LocalCluster, report, reported
from tests._helpers import same_bits

pytest.importorskip("ray")


def layers(rows: int) -> dict[str, np.ndarray]:
    """Integer-valued float32 layers (exact in bfloat16 too) and an int32 counter."""
    rng = np.random.default_rng(rows)
    out = {
        f"layer{i}": np.round(rng.standard_normal((rows, 256), dtype=np.float32) * 8)
        for i in range(3)
    }
    out["count"] = np.arange(rows * 8, dtype=np.int32).reshape(rows, 8)
    return out


def _milepost_file(host: Any) -> str:
    import milepost

    return str(milepost.__file__)


def _log(t0: float, what: str) -> None:
    print(f"[{time.monotonic() - t0:5.1f}s] {what}", flush=True)


def _across_four_nodes(cluster: LocalCluster, tmp: str) -> None:
    import ray

    t0 = time.monotonic()
    with cluster.slice(devices_per_host=2) as s:
        _log(t0, "slice of 4 hosts started")
        nodes = [ident["node"] for ident in s.host_identities()]
        assert sorted(nodes) == sorted(cluster.node_ids), (
            f"one host per node: the hosts are on {nodes}, the nodes are {cluster.node_ids}"
        )
        # the hosts run the milepost this driver runs (a worktree's, say)
        where = ray.get(
            [a.__ray_call__.remote(_milepost_file) for a in s.group._actors], timeout=60
        )
        assert where == [mp.__file__] * 4, (where, mp.__file__)

        mesh = s.mesh({"data": 2, "model": 4})
        values = layers(64)
        shardings = {k: mesh.sharding(P("data", "model")) for k in values}
        shardings["count"] = mesh.sharding(P("data"))  # replicated over 'model'
        tree = s.put(values, shardings)
        path = Path(tmp) / "c"
        mp.save(path, {"params": tree, "step": 7, "note": "four nodes"})
        _log(t0, "saved")
        databases = {db.name.split(".")[1] for db in (path / "state").glob("ocdbt.process_*")}
        assert {f"process_{i}" for i in range(4)} <= databases, (
            f"every node's host wrote its shards: {sorted(databases)}"
        )

        def abstract(sharding_of: Any) -> dict[str, Any]:
            return {
                "params": {
                    k: mp.AbstractArray(v.shape, v.dtype, sharding_of(k)) for k, v in values.items()
                },
                "step": 0,
                "note": "",
            }

        # back exact, with the shardings it was saved with
        back = mp.load(path, abstract(shardings.__getitem__))
        assert back["step"] == 7 and back["note"] == "four nodes"
        for k, v in values.items():
            assert back["params"][k].sharding == shardings[k], k
            assert same_bits(s.fetch(back["params"][k]), v), k
        # resharded onto another mesh of the slice
        other = s.mesh({"x": 4, "y": 2})
        moved = mp.load(path, abstract(lambda k: other.sharding(P("y", "x"))))
        for k, v in values.items():
            assert moved["params"][k].sharding.milepost_spec.spec == ("y", "x"), k
            assert same_bits(s.fetch(moved["params"][k]), v), k
        # and onto this driver's 8 local devices (the embedded mode)
        local = jax.make_mesh((2, 4), ("a", "b"))
        here = mp.load(
            path,
            {
                "params": {
                    k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(local, P("b")))
                    for k, v in values.items()
                },
                "step": 0,
                "note": "",
            },
        )
        assert all(same_bits(here["params"][k], v) for k, v in values.items())
        _log(t0, "loaded three ways")

        # surgery on the hosts: rename, cast, stack, written by the four of them
        ck = ms.open(path, slice=s)
        t = ms.rename(ck.tree, {r"^params\.(layer\d+)$": r"model.\1", r"^params\.count$": None})
        t = ms.stack(ms.cast(t, jnp.bfloat16), r"^model\.layer(\d+)$", "model.layers")
        out = ms.write(Path(tmp) / "out", t)
        got = mp.load(
            out,
            {
                "model": {
                    "layers": mp.AbstractArray(
                        (3, 64, 256), ml_dtypes.bfloat16, mesh.sharding(P(None, "data", "model"))
                    )
                },
                "step": 0,
                "note": "",
            },
        )
        assert isinstance(got["model"]["layers"], mp.RemoteArray) and got["step"] == 7
        want = np.stack([values[f"layer{i}"] for i in range(3)]).astype(ml_dtypes.bfloat16)
        assert same_bits(s.fetch(got["model"]["layers"]), want)
        _log(t0, "surgery written and loaded")
        report(
            nodes=len(set(nodes)),
            writers=sorted(d for d in databases if d != "process_controller"),  # (the hosts')
            loaded={"step": back["step"], "note": back["note"]},
            surgery=sorted(got["model"]),
        )


def test_a_slice_across_four_nodes_saves_loads_and_edits_exactly(
    ray_cluster: ClusterProcess, tmp_path: Path
) -> None:
    """One host per raylet (STRICT_SPREAD placed them on four different nodes); a sharded tree
    saved by the four, loaded back exact (as saved, onto another mesh, onto local devices), and
    a surgery (rename, cast, stack) run on the hosts, exact."""
    output = ray_cluster.run(_across_four_nodes, str(tmp_path))
    print(output)
    assert reported(output) == {
        "nodes": 4,  # one host on each
        "writers": [f"process_{i}" for i in range(4)],
        "loaded": {"step": 7, "note": "four nodes"},  # (its arrays exact, three ways)
        "surgery": ["layers"],  # (exact)
    }


def _node_removed_mid_save(cluster: LocalCluster, tmp: str) -> None:
    t0 = time.monotonic()
    path = Path(tmp) / "c"
    values = layers(256)
    with cluster.slice(devices_per_host=2) as s:
        _log(t0, "slice of 4 hosts started")
        idents = s.host_identities()
        # a host on a worker node (the head runs this driver), not host 0 (whose process
        # coordinates the hosts' jax.distributed runtime)
        victim = next(i for i in range(1, 4) if idents[i]["node"] != cluster.head.node_id)
        node = cluster.node_of(idents[victim]["node"])
        mesh = s.mesh({"data": 2, "model": 4})
        tree = s.put(values, {k: mesh.sharding(P("data", "model")) for k in values})
        held = HeldWrites(s)
        with mp.Context(async_=mp.AsyncOptions(timeout_secs=60)):
            handle = mp.save_async(path, tree)
        held.wait_held()  # every host staged its shards; none has written them
        _log(t0, "save staged, its writes held on every host")
        removed = time.monotonic()
        cluster.remove_node(node)
        psutil.Process(idents[victim]["pid"]).wait(30)  # the host went with its node
        _log(t0, f"removed node {node.node_id[:12]} (host {victim})")
        held.release([i for i in range(4) if i != victim])
        with pytest.raises(mp.HostError) as info:
            handle.result(120)
        _log(t0, f"save failed {time.monotonic() - removed:.1f}s after the removal: {info.value}")
        ident = idents[victim]
        assert re.search(
            rf"host {victim} \(node {ident['node'][:12]}, ip [\d.]+, pid {ident['pid']}\) died "
            r"while writing its checkpoint shards",
            str(info.value),
        ), info.value
        assert not s.healthy and s.group.failed_hosts == {victim}
        # nothing committed, nothing left behind
        assert not path.exists() and sorted(p.name for p in Path(tmp).iterdir()) == [], sorted(
            Path(tmp).iterdir()
        )
        with pytest.raises(mp.CheckpointNotFoundError):
            mp.load(path)
        failed = {
            "victim": victim,
            "error_hosts": list(info.value.hosts),
            "failed_hosts": sorted(s.group.failed_hosts),
            "left": sorted(p.name for p in Path(tmp).iterdir()),
        }
    # a fresh slice on a replacement node saves, at the failed path and elsewhere
    cluster.add_node()
    with cluster.slice(devices_per_host=2) as fresh:
        _log(t0, "fresh slice of 4 hosts started")
        assert sorted(i["node"] for i in fresh.host_identities()) == sorted(cluster.node_ids)
        mesh = fresh.mesh({"data": 2, "model": 4})
        tree = fresh.put(values, {k: mesh.sharding(P("data", "model")) for k in values})
        for target in (path, Path(tmp) / "after"):
            mp.save(target, tree)
            assert (target / COMMIT_MARKER).is_file()
            back = mp.load(
                target,
                {
                    k: mp.AbstractArray(v.shape, v.dtype, mesh.sharding(P("model")))
                    for k, v in values.items()
                },
            )
            assert all(same_bits(fresh.fetch(back[k]), v) for k, v in values.items())
        _log(t0, "fresh slice saved and loaded")
        report(**failed, committed=sorted(p.name for p in Path(tmp).iterdir()))


def test_a_node_removed_mid_save_is_a_host_error_and_nothing_is_committed(
    ray_cluster: ClusterProcess, tmp_path: Path
) -> None:
    """The save's writes are held on every host (an event, not a sleep); a node is removed
    (its raylet, and the host on it, gone); the other hosts' writes then land. The save fails
    with a HostError naming the removed node's host, the path holds nothing (no checkpoint, no
    temporary folder), and a fresh slice on a replacement node saves and loads exactly."""
    output = ray_cluster.run(_node_removed_mid_save, str(tmp_path))
    print(output)
    found = reported(output)
    victim = found["victim"]
    assert victim in (1, 2, 3), found
    assert found == {
        "victim": victim,
        "error_hosts": [victim],  # the HostError names the removed node's host
        "failed_hosts": [victim],
        "left": [],  # nothing committed, nothing left behind
        "committed": ["after", "c"],  # by a fresh slice, at the failed path too
    }
