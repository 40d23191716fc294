"""The peer tier: a slice's steps kept in each node's memory folder and on peers, and a lost host
recovered from there (``Checkpointer(peers=PeerTier(...))``, ``Checkpointer.recover``).

The store's own tests run here; the recoveries run on a real multi-node Ray cluster
(``tests/_cluster.py``): a node removed with SIGKILL and its memory folder deleted with it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost.colocated._slice_peers import choose_peers
from milepost.training import Checkpointer, FixedInterval, PeerTier
from milepost.workers import CorruptCheckpointError, peers
from tests._cluster import ClusterProcess, HeldWrites, LocalCluster, report, reported


# -- the node folder ---------------------------------------------------------------------------
def _part(step: int, owner: int, token: str = "t") -> tuple[peers.Part, np.ndarray]:
    data = np.arange(64, dtype=np.uint8) + owner
    boxes = (
        peers.Box(array=0, index=((0, 4), (0, 4)), offset=0, nbytes=32, crc32c=0),
        peers.Box(array=1, index=((0, 8),), offset=32, nbytes=32, crc32c=0),
    )
    staged = peers.Staged(
        step=step,
        owner=owner,
        token=token,
        hosts=2,
        dtypes=("int16", "float32"),
        boxes=[(b.array, b.index, b.offset, b.nbytes) for b in boxes],
        data=data,
    )
    return staged.part(), data


def test_a_part_is_written_whole_listed_and_read_back_checked(tmp_path: Path) -> None:
    root = peers.run_folder(str(tmp_path / "{node}"), "run-a", "node1")
    assert root == tmp_path / "node1" / "run-a"
    part, data = _part(3, 1)
    peers.write(root, part, data)
    assert peers.listing(root) == [peers.Held(step=3, owner=1, token="t", nbytes=64)]
    got, back = peers.read(root, 3, 1, "t")
    assert got == part and np.array_equal(back, data)
    with pytest.raises(CorruptCheckpointError, match="another save"):
        peers.read(root, 3, 1, "other")


@pytest.mark.parametrize("damage", ["flip data", "truncate data", "flip manifest", "drop data"])
def test_a_damaged_part_is_refused(tmp_path: Path, damage: str) -> None:
    root = tmp_path / "run"
    part, data = _part(2, 0)
    peers.write(root, part, data)
    folder = peers.part_folder(root, 2, 0)
    if damage == "flip data":
        raw = bytearray((folder / "data").read_bytes())
        raw[40] ^= 1
        (folder / "data").write_bytes(bytes(raw))
    elif damage == "truncate data":
        (folder / "data").write_bytes((folder / "data").read_bytes()[:-1])
    elif damage == "flip manifest":
        raw = bytearray((folder / "manifest.json").read_bytes())
        raw[10] ^= 1
        (folder / "manifest.json").write_bytes(bytes(raw))
    else:
        (folder / "data").unlink()
    with pytest.raises((CorruptCheckpointError, FileNotFoundError)):
        peers.read(root, 2, 0, "t")
    if damage == "flip manifest":
        assert peers.listing(root) == []  # never offered to a recovery


def test_a_killed_write_leaves_nothing_that_is_listed_and_prune_removes_it(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    part, data = _part(5, 0)
    peers.write(root, part, data)
    leftover = root / "step_6" / ".tmp.owner_0.abc"  # what a SIGKILL mid-write leaves
    leftover.mkdir(parents=True)
    (leftover / "data").write_bytes(b"half")
    assert [h.step for h in peers.listing(root)] == [5]
    peers.prune(root, {5})
    assert sorted(p.name for p in root.iterdir()) == ["step_5"]
    peers.prune(root, set())
    assert list(root.iterdir()) == []


def test_a_crafted_node_folder_is_never_followed_out_of_it(tmp_path: Path) -> None:
    """Symlinked steps or parts are neither listed nor pruned through; names that are not a
    folder's are refused before any path is built."""
    root = tmp_path / "run"
    outside = tmp_path / "outside"
    peers.write(outside, *_part(1, 0))
    root.mkdir()
    (root / "step_1").symlink_to(outside / "step_1")
    (root / "step_2").mkdir()
    (root / "step_2" / "owner_0").symlink_to(outside / "step_1" / "owner_0")
    assert peers.listing(root) == []
    peers.prune(root, set())
    assert peers.listing(outside) == [peers.Held(step=1, owner=0, token="t", nbytes=64)]
    for node in ("../up", "a/b", "..", ""):
        with pytest.raises(ValueError, match="names a folder"):
            peers.run_folder(str(tmp_path / "{node}"), "run", node)


def test_a_manifest_that_lies_about_its_data_is_refused(tmp_path: Path) -> None:
    import dataclasses

    root = tmp_path / "run"
    part, data = _part(1, 0)
    far = dataclasses.replace(
        part, boxes=(dataclasses.replace(part.boxes[0], offset=1 << 40), *part.boxes[1:])
    )
    peers.write(root, far, data)  # a well-formed manifest, with a box beyond the data
    with pytest.raises(CorruptCheckpointError):
        peers.read(root, 1, 0, "t")
    longer = dataclasses.replace(part, boxes=(*part.boxes, part.boxes[0]))
    peers.write(root, longer, data)  # more bytes claimed than the data holds
    with pytest.raises(CorruptCheckpointError, match="holds 64 bytes"):
        peers.read(root, 1, 0, "t")


def test_a_part_of_a_step_saved_again_replaces_the_earlier_one(tmp_path: Path) -> None:
    root = tmp_path / "run"
    peers.write(root, *_part(4, 0, "first"))
    peers.write(root, *_part(4, 0, "second"))
    assert [h.token for h in peers.listing(root)] == ["second"]


def test_a_process_server_keeps_and_serves_parts_only_for_its_job(tmp_path: Path) -> None:
    """The multi-controller transport: a part put is checked and kept; a request without the
    job's secret is dropped; a damaged part is refused and nothing is written."""
    import dataclasses

    secret = b"s" * 16
    server = peers.PeerServer(tmp_path / "node", secret, host="127.0.0.1", timeout=10)
    address = ("127.0.0.1", server.port)
    try:
        part, data = _part(3, 1)
        peers.send_part(address, secret, part, data, 10, "process 1")
        got, back = peers.fetch_part(address, secret, 3, 1, "t", 10, "process 1")
        assert got == part and np.array_equal(back, data)
        with pytest.raises(ConnectionError, match="refused: FileNotFoundError"):
            peers.fetch_part(address, secret, 4, 1, "t", 10, "process 1")
        with pytest.raises(ConnectionError):  # dropped unanswered
            peers.send_part(address, b"x" * 16, *_part(5, 1), 10, "process 1")
        bad = dataclasses.replace(part, step=6)
        damaged = data.copy()
        damaged[3] ^= 1
        with pytest.raises(ConnectionError, match="CorruptCheckpointError"):
            peers.send_part(address, secret, bad, damaged, 10, "process 1")
        assert [h.step for h in peers.listing(tmp_path / "node")] == [3]
    finally:
        server.close()


def test_peers_are_on_other_nodes_and_never_together() -> None:
    assert choose_peers(["a", "b", "c", "d"], 1) == [[1], [2], [3], [0]]
    assert choose_peers(["a", "a"], 0) == [[], []]  # parts on their own nodes only
    assert choose_peers(["a", "a", "b", "b"], 1) == [[2], [2], [0], [0]]
    two = choose_peers(["a", "b", "c"], 2)
    assert two == [[1, 2], [2, 0], [0, 1]]
    with pytest.raises(ValueError, match="at least 2 nodes"):
        choose_peers(["a", "a"], 1)


def test_close_removes_the_runs_node_folder_unless_kept(tmp_path: Path) -> None:
    """A run leaves nothing in node memory once its Checkpointer closes; ``keep_on_close``
    keeps its folder for a restart (let go of: ``milepost peers clear`` may remove it)."""
    import jax

    w = jax.device_put(np.arange(64, dtype=np.float32))
    for keep in (False, True):
        shm = tmp_path / f"shm-{keep}"
        tier = PeerTier(copies=0, path=str(shm), node="here", keep_on_close=keep)
        policy = FixedInterval(interval=10)
        with Checkpointer(tmp_path / f"ckpt-{keep}", save_policy=policy, peers=tier) as ckpt:
            ckpt.save(1, {"w": w})
            ckpt.wait()
            (run_dir,) = shm.iterdir()
            assert [h.step for h in peers.listing(run_dir)] == [1]
            assert [r.live for r in peers.list_peer_runs(shm)] == [True]
        assert [p.name for p in shm.iterdir()] == ([run_dir.name] if keep else [])
        if keep:
            (run,) = peers.list_peer_runs(shm)
            assert (run.name, run.steps, run.live) == (run_dir.name, (1,), False), run


def test_peer_tier_options_are_checked() -> None:
    with pytest.raises(ValueError, match="absolute"):
        PeerTier(path="shm/x")
    with pytest.raises(ValueError, match="copies"):
        PeerTier(copies=-1)
    with pytest.raises(TypeError, match="every_n_steps"):
        PeerTier(every_n_steps="2")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="keep_on_close"):
        PeerTier(keep_on_close=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="read-only"):
        Checkpointer("/tmp/x-never-written", read_only=True, peers=PeerTier())


def test_one_process_recovers_its_state_from_its_node_folder_after_a_restart(
    tmp_path: Path,
) -> None:
    """One process (embedded), copies=0: its part stays in its node folder, which a new
    Checkpointer (a restarted process) finds again; copies=1 needs another node."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    sharding = NamedSharding(mesh, P("data", "model"))
    w = jax.device_put(np.arange(64 * 32, dtype=np.float32).reshape(64, 32), sharding)
    key = jax.random.key(7)
    tier = PeerTier(copies=0, path=str(tmp_path / "shm"), node="here", keep_on_close=True)
    with Checkpointer(tmp_path / "ckpt", save_policy=FixedInterval(interval=10), peers=tier) as c:
        for step in (1, 2, 3):
            c.save(step, {"w": w + step, "key": key, "step": step, "lr": 0.5})
        assert c.steps == []  # nothing durable: only node memory holds them
    abstract = {
        "w": jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=sharding),
        "key": jax.ShapeDtypeStruct((), key.dtype, sharding=key.sharding),
        "step": 0,
        "lr": 0.0,
    }
    with Checkpointer(tmp_path / "ckpt", peers=tier) as again:  # the restarted process
        r = again.recover(abstract_state=abstract)
    assert (r.step, r.tier, r.slice) == (3, "peers", None), r
    assert r.bytes_by_source == {"own node": 64 * 32 * 4 + 8, "peer": 0}
    assert np.array_equal(np.asarray(r.state["w"]), np.asarray(w + 3))
    assert r.state["w"].sharding == sharding
    assert np.array_equal(jax.random.key_data(r.state["key"]), jax.random.key_data(key))
    assert (r.state["step"], r.state["lr"]) == (3, 0.5)
    (run_dir,) = (tmp_path / "shm").iterdir()  # no {node} in the path: the run's folder
    held = peers.listing(run_dir)
    assert sorted(h.step for h in held) == [2, 3]  # the newest recoverable step and the last
    with Checkpointer(tmp_path / "ckpt", peers=PeerTier(path=str(tmp_path / "shm"))) as one:
        with pytest.raises(ValueError, match="at least 2 nodes"):
            one.save(4, {"w": w})
        with pytest.raises(TypeError, match="the Slice that lost a host"):
            one.recover(w)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="abstract_state"):
            one.recover()


# -- recovery on a multi-node cluster ----------------------------------------------------------
def _expected(step: int) -> dict[str, np.ndarray]:
    w = np.arange(48 * 64, dtype=np.float32).reshape(48, 64)
    b = np.arange(12 * 8, dtype=np.int32).reshape(12, 8)
    r = np.arange(6, dtype=np.float32)
    return {"w": w + step, "b": b + 2 * step, "r": r - step}


def _update(state: dict[str, Any]) -> dict[str, Any]:
    return {"w": state["w"] + 1, "b": state["b"] + 2, "r": state["r"] - 1}


def _shardings(s: Any) -> dict[str, Any]:
    mesh = s.mesh({"data": 3, "model": 2})
    return {
        "w": mesh.sharding(P("data", "model")),
        "b": mesh.sharding(P("data")),  # replicated over 'model'
        "r": mesh.sharding(P()),  # on every device
    }


def _lose(cluster: LocalCluster, s: Any, host: int, shm: Path) -> None:
    """SIGKILL the node of ``host`` and delete its memory folder (its RAM disk is gone)."""
    import shutil

    node_id = s.host_identities()[host]["node"]
    cluster.remove_node(cluster.node_of(node_id))
    shutil.rmtree(shm / node_id, ignore_errors=True)
    print(f"removed the node of host {host} ({node_id[:12]})", flush=True)


def _victim(cluster: LocalCluster, s: Any) -> int:
    """A host to lose: not host 0 (its process coordinates jax.distributed), and not on the
    head node (which runs this driver)."""
    nodes = [ident["node"] for ident in s.host_identities()]
    return next(i for i in (2, 1) if nodes[i] != cluster.head.node_id)


def _until_lost(s: Any, params: Any) -> None:
    """Train on until the slice reports the lost host (its processes take a moment to end)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            s.run(_update, params)
        except mp.HostError as e:
            print(f"the training step failed: {e}", flush=True)
            return
        time.sleep(0.2)
    raise AssertionError("the slice did not report its lost host within 60s")


def _check_state(s: Any, state: dict[str, Any], step: int) -> None:
    got = s.fetch({k: state["params"][k] for k in ("w", "b", "r")})
    for k, want in _expected(step).items():
        assert got[k].dtype == want.dtype and np.array_equal(got[k], want), k
    assert state["step"] == step


def _lose_a_node_between_steps(cluster: LocalCluster, tmp: str) -> None:
    shm = Path(tmp) / "shm"
    root = Path(tmp) / "ckpt"
    tier = PeerTier(every_n_steps=1, copies=1, path=str(shm / "{node}"))
    s = cluster.slice(devices_per_host=2, hosts=3)  # 3 of the 4 nodes: one spare
    try:
        with Checkpointer(root, save_policy=FixedInterval(interval=2), peers=tier) as ckpt:
            params = s.put(_expected(0), _shardings(s))
            for step in range(1, 6):
                params = s.run(_update, params)
                ckpt.save(step, {"params": params, "step": step})
            ckpt.wait()
            assert ckpt.steps == [2, 4]
            lost = _victim(cluster, s)
            part_bytes = sum(
                len(peers.read(peers.run_folder(str(shm / "{node}"), run, node), 5, lost, tok)[1])
                for run, node, tok in _part_of(shm, s, lost, 5)
            )
            _lose(cluster, s, lost, shm)
            _until_lost(s, params)
            t0 = time.monotonic()
            r = ckpt.recover(s)
            s = r.slice
            print(f"recovered {r} in {time.monotonic() - t0:.1f}s; notes {r.notes}", flush=True)
            assert (r.step, r.tier) == (5, "peers"), r
            assert r.bytes_by_source["peer"] == part_bytes, r.bytes_by_source
            assert r.bytes_by_source["own node"] == 2 * part_bytes  # 3 hosts, equal parts
            moved = mp.io_stats(slice=s)  # the new hosts' counters: the recovery's bytes only
            assert moved.bytes_read == 0, moved  # nothing from storage
            assert moved.bytes_between_hosts == part_bytes, moved  # the lost host's part only
            assert [h.bytes_received for h in moved.hosts] == [
                part_bytes if i == lost else 0 for i in range(3)
            ], moved
            _check_state(s, r.state, 5)
            params = r.state["params"]
            for step in range(6, 8):  # training goes on, and so does the tier
                params = s.run(_update, params)
                ckpt.save(step, {"params": params, "step": step})
            ckpt.wait()
            assert ckpt.steps == [2, 4, 6]
            _check_state(s, {"params": params, "step": 7}, 7)
            report(
                recovered=[r.step, r.tier],
                read_from_storage=moved.bytes_read,
                between_hosts=moved.bytes_between_hosts / part_bytes,
                stored=ckpt.steps,
            )
    finally:
        s.shutdown()


def _part_of(shm: Path, s: Any, owner: int, step: int) -> list[tuple[str, str, str]]:
    """(run, node, token) of the part of ``owner`` at ``step`` in its own node's folder."""
    node = s.host_identities()[owner]["node"]
    (run_dir,) = (shm / node).iterdir()
    held = [h for h in peers.listing(run_dir) if (h.step, h.owner) == (step, owner)]
    assert len(held) == 1, held
    return [(run_dir.name, node, held[0].token)]


def test_a_node_lost_between_steps_is_recovered_from_peers(
    ray_cluster: ClusterProcess, tmp_path: Path
) -> None:
    output = ray_cluster.run(_lose_a_node_between_steps, str(tmp_path))
    print(output)
    assert reported(output) == {
        "recovered": [5, "peers"],  # (exact)
        "read_from_storage": 0,
        "between_hosts": 1.0,  # the lost host's part, once
        "stored": [2, 4, 6],  # and training went on
    }


def _ready_standbys(s: Any, timeout: float = 120.0) -> set[int]:
    """The pids of the slice's standby hosts, once every one is warm."""
    import ray

    deadline = time.monotonic() + timeout
    actors = [a for have in s._standby._by_node.values() for a, _ in have]
    refs = [ref for have in s._standby._by_node.values() for _, ref in have]
    ray.get(refs, timeout=max(1.0, deadline - time.monotonic()))
    return {ray.get(a.identity.remote(), timeout=60)["pid"] for a in actors}


def _recover_from_standbys(cluster: LocalCluster, tmp: str) -> None:
    shm = Path(tmp) / "shm"
    tier = PeerTier(every_n_steps=1, copies=1, path=str(shm / "{node}"))
    s = cluster.slice(devices_per_host=2, hosts=3, standby_hosts=True)
    try:
        with Checkpointer(
            Path(tmp) / "ckpt", save_policy=FixedInterval(interval=2), peers=tier
        ) as ckpt:
            params = _train(s, ckpt, range(1, 4))
            ckpt.wait()
            standby = _ready_standbys(s)
            assert len(standby) == 4, standby  # one per host's node, one on the spare
            lost = _victim(cluster, s)
            _lose(cluster, s, lost, shm)
            _until_lost(s, params)
            t0 = time.monotonic()
            r = ckpt.recover(s)
            s = r.slice
            print(f"recovered from standbys: {r} in {time.monotonic() - t0:.1f}s", flush=True)
            assert (r.step, r.tier) == (3, "peers"), r
            pids = {ident["pid"] for ident in s.host_identities()}
            assert pids <= standby, (pids, standby)  # no host process was started
            _check_state(s, r.state, 3)
            params = _train(s, ckpt, range(4, 5), r.state["params"])
            ckpt.wait()
            _check_state(s, {"params": params, "step": 4}, 4)
            again = _ready_standbys(s)
            assert len(again) == 3  # topped up again: 3 host nodes, no spare left
            report(
                recovered=[r.step, r.tier],
                hosts_started=len(pids - standby),
                standbys=[len(standby), len(again)],
            )
    finally:
        s.shutdown()


def test_a_recovery_starts_the_new_slice_from_standby_hosts(
    ray_cluster: ClusterProcess, tmp_path: Path
) -> None:
    output = ray_cluster.run(_recover_from_standbys, str(tmp_path))
    print(output)
    assert reported(output) == {
        "recovered": [3, "peers"],  # (exact)
        "hosts_started": 0,  # the new slice's hosts were standbys
        "standbys": [4, 3],  # one per node, then topped up again without the spare
    }


# -- failures: during replication, a damaged copy, a process killed, every copy gone -------------
def _train(s: Any, ckpt: Checkpointer, steps: range, params: Any = None) -> Any:
    if params is None:
        params = s.put(_expected(0), _shardings(s))
    for step in steps:
        params = s.run(_update, params)
        ckpt.save(step, {"params": params, "step": step})
    return params


def _hold_copies(host: Any) -> None:
    """On a host: copies sent to it wait at a gate (before they are checked and written)."""
    import threading

    from milepost.workers import peers as host_peers

    gate, reached = threading.Event(), threading.Event()
    real = host_peers.check

    def held(*args: Any) -> Any:
        reached.set()
        gate.wait(120)
        return real(*args)

    host._test_copy_gate = (gate, reached)
    host_peers.check = held


def _copies_held(host: Any) -> bool:
    return bool(host._test_copy_gate[1].wait(60))


def _replication(cluster: LocalCluster, tmp: str, case: str) -> None:
    import ray

    shm = Path(tmp) / "shm"
    tier = PeerTier(every_n_steps=1, copies=1, path=str(shm / "{node}"))
    if case == "during recovery":
        cluster.add_node()  # two spares: one for the lost host, one for the next
    s = cluster.slice(devices_per_host=2, hosts=3)
    try:
        with Checkpointer(
            Path(tmp) / "ckpt", save_policy=FixedInterval(interval=2), peers=tier
        ) as ckpt:
            params = _train(s, ckpt, range(1, 6))
            ckpt.wait()  # step 5 is recoverable; step 4 is kept too
            lost, want, tier_name = _victim(cluster, s), 5, "peers"
            keeper = (lost + 1) % 3  # the host whose node keeps the copy of the lost one's part
            if case == "during replication":
                params = _train(s, ckpt, range(6, 7), params)
                ckpt.wait()
                actors = [s.group.actor(i) for i in range(3)]
                ray.get([a.__ray_call__.remote(_hold_copies) for a in actors], timeout=60)
                params = _train(s, ckpt, range(7, 8), params)  # step 7: copies held
                assert ray.get(actors[0].__ray_call__.remote(_copies_held), timeout=90)
                want = 6  # step 7's part of the lost host has no copy: its only one dies with it
            elif case == "damaged copy":
                (run_dir,) = (shm / s.host_identities()[keeper]["node"]).iterdir()
                data = peers.part_folder(run_dir, 5, lost) / "data"
                raw = bytearray(data.read_bytes())
                raw[len(raw) // 2] ^= 0x10
                data.write_bytes(bytes(raw))
                want = 4  # step 5 cannot be rebuilt: step 4 still is, from memory
            elif case == "every copy gone":
                import shutil

                shutil.rmtree(shm / s.host_identities()[keeper]["node"])  # the copy too
                want, tier_name = 4, "durable"
            elif case == "during a durable save":
                held = HeldWrites(s)
                params = _train(s, ckpt, range(6, 7), params)  # step 6: durable writes held
                held.wait_held()
                _until_kept(shm, s, 6)
                want = 6  # in memory on every node; never committed to the root
            elif case == "during recovery":
                _lose_once_more_during_the_restore(cluster, shm, lost)
            if case == "process killed":
                pid = s.host_identities()[lost]["pid"]
                import os
                import signal

                os.kill(pid, signal.SIGKILL)  # the node and its memory folder stay
            else:
                _lose(cluster, s, lost, shm)
            if case == "during a durable save":
                held.release([i for i in range(3) if i != lost])  # they land; the save fails
            _until_lost(s, params)
            r = ckpt.recover(s)
            s = r.slice
            print(f"{case}: {r}; notes {r.notes}", flush=True)
            assert (r.step, r.tier) == (want, tier_name), (r, r.notes)
            _check_state(s, r.state, want)
            if case == "process killed":
                assert r.bytes_by_source["peer"] == 0 and r.bytes_by_source["own node"] > 0
            if case == "damaged copy":
                assert any("CRC32C" in n for n in r.notes), r.notes
            if case == "every copy gone":
                assert any(f"no copy of the parts of hosts [{lost}]" in n for n in r.notes), r.notes
            if case == "during a durable save":
                assert ckpt.steps == [2, 4] and not (Path(tmp) / "ckpt" / "6").exists()
            if case == "during recovery":
                assert any("lost during the recovery" in n for n in r.notes), r.notes
            params = _train(s, ckpt, range(want + 1, want + 3), r.state["params"])
            ckpt.wait()
            _check_state(s, {"params": params, "step": want + 2}, want + 2)
            report(case=case, recovered=[r.step, r.tier], trained_to=want + 2)
    finally:
        s.shutdown()


def _until_kept(shm: Path, s: Any, step: int) -> None:
    """Until every host's part of ``step`` and its copy are in the node folders."""
    deadline = time.monotonic() + 60
    nodes = [ident["node"] for ident in s.host_identities()]
    while time.monotonic() < deadline:
        found = [
            (h.owner, node)
            for node in nodes
            for run_dir in (shm / node).iterdir()
            for h in peers.listing(run_dir)
            if h.step == step
        ]
        if len(found) == 2 * len(nodes):
            return
        time.sleep(0.1)
    raise AssertionError(f"step {step} was not kept on every node within 60s")


def _lose_once_more_during_the_restore(cluster: LocalCluster, shm: Path, lost: int) -> None:
    """The next recovery's first restore loses the node its replacement host was placed on."""
    import ray

    from milepost.colocated import SlicePeers

    real = SlicePeers.restore

    def restore(self: Any, *args: Any, **kwargs: Any) -> Any:
        SlicePeers.restore = real  # once
        victim = self.group.actor(lost)
        node_id = self.group.identities()[lost]["node"]
        cluster.remove_node(cluster.node_of(node_id))
        import shutil

        shutil.rmtree(shm / node_id, ignore_errors=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until Ray reports the host gone
            try:
                ray.get(victim.identity.remote(), timeout=2)
            except ray.exceptions.RayActorError:
                break
            except ray.exceptions.GetTimeoutError:
                pass
            time.sleep(0.2)
        print(f"lost the replacement host's node {node_id[:12]} during the recovery", flush=True)
        return real(self, *args, **kwargs)

    SlicePeers.restore = restore  # type: ignore[method-assign]


@pytest.mark.parametrize(
    "case",
    [
        "during replication",
        "damaged copy",
        "process killed",
        pytest.param("every copy gone", marks=pytest.mark.slow),
        pytest.param("during a durable save", marks=pytest.mark.slow),
        pytest.param("during recovery", marks=pytest.mark.slow),
    ],
)
def test_recovery_takes_the_newest_step_every_part_of_which_survives(
    ray_cluster: ClusterProcess, tmp_path: Path, case: str
) -> None:
    output = ray_cluster.run(_replication, str(tmp_path), case)
    print(output)
    step, tier = {
        "during replication": (6, "peers"),  # step 7's lost part had no copy yet
        "damaged copy": (4, "peers"),  # step 5's copy fails its CRC32C
        "process killed": (5, "peers"),  # its node's memory lives on
        "every copy gone": (4, "durable"),
        "during a durable save": (6, "peers"),  # never committed to the root
        "during recovery": (5, "peers"),
    }[case]
    assert reported(output) == {"case": case, "recovered": [step, tier], "trained_to": step + 2}


# -- a restarted controller: its hosts ended with it, the nodes and their folders live on --------
def _abstract(s: Any) -> dict[str, Any]:
    """The saved tree as a restarted controller gives it: abstract arrays on its new slice."""
    shardings = _shardings(s)
    params = {k: mp.AbstractArray(v.shape, v.dtype, shardings[k]) for k, v in _expected(0).items()}
    return {"params": params, "step": 0}


def _parts_of(shm: Path, step: int) -> dict[int, int]:
    """The bytes of each owner's part of ``step``, as the node folders hold it."""
    out: dict[int, int] = {}
    for run_dir in shm.glob("*/run-*"):
        for h in peers.listing(run_dir):
            if h.step == step:
                out[h.owner] = h.nbytes
        peers.release_run(run_dir)  # (a listing holds the run: its hosts remove it at close)
    return out


def test_a_restarted_controller_recovers_a_slice_from_node_memory(
    ray_runtime: Any, tmp_path: Path
) -> None:
    """A controller whose slice's hosts ended (a notebook kernel restarted) and a new
    Checkpointer of the same root: ``recover(abstract_state=...)`` on a new slice restores the
    newest step every part of which the node folders hold, from memory, and the leaves that
    are not arrays from the parts. On the session's one-node Ray runtime (copies=0); the
    cluster test below kills a real controller process."""
    root = tmp_path / "ckpt"
    tier = PeerTier(copies=0, path=str(tmp_path / "shm" / "{node}"))
    first = Checkpointer(root, save_policy=FixedInterval(interval=2), peers=tier)
    try:
        with mp.Slice.start(hosts=3, devices_per_host=2) as s:  # its hosts end with it
            params = s.put(_expected(0), _shardings(s))
            for step in (1, 2, 3):
                params = s.run(_update, params)
                first.save(step, {"params": params, "step": step})
            first.wait()
            assert first.steps == [2]
        with mp.Slice.start(hosts=3, devices_per_host=2) as new:
            with Checkpointer(root, save_policy=FixedInterval(interval=2), peers=tier) as again:
                r = again.recover(abstract_state=_abstract(new))
                assert (r.step, r.tier, r.slice) == (3, "peers", new), (r, r.notes)
                parts = _parts_of(tmp_path / "shm", 3)
                assert sorted(parts) == [0, 1, 2], parts
                assert r.bytes_by_source == {"own node": sum(parts.values()), "peer": 0}
                assert mp.io_stats(slice=new).bytes_read == 0  # nothing from storage
                _check_state(new, r.state, 3)  # and "step" from the parts
                params = _train(new, again, range(4, 5), r.state["params"])
                again.wait()
                _check_state(new, {"params": params, "step": 4}, 4)
                assert again.steps == [2, 4]
            assert not list((tmp_path / "shm").glob("*/run-*"))  # closed: nothing left in RAM
    finally:
        first.close()


_CONTROLLER = "@@controller@@"


def _controller_process(address: str, tmp: str) -> None:
    """A controller process of its own (run by the test below): a slice over 3 of the cluster's
    nodes trains steps 1-5 with the peer tier (2 and 4 also to the root), prints its hosts'
    pids, and waits to be killed."""
    import json
    import threading

    s = mp.Slice.connect(
        address=address,
        hosts=3,
        devices_per_host=2,
        options=mp.SliceOptions(start_timeout_secs=120.0, timeout_secs=120.0),
    )
    tier = PeerTier(every_n_steps=1, copies=1, path=str(Path(tmp) / "shm" / "{node}"))
    ckpt = Checkpointer(Path(tmp) / "ckpt", save_policy=FixedInterval(interval=2), peers=tier)
    _train(s, ckpt, range(1, 6))
    ckpt.wait()
    pids = [ident["pid"] for ident in s.host_identities()]
    print(_CONTROLLER + json.dumps({"pids": pids, "steps": ckpt.steps}), flush=True)
    threading.Event().wait(600)  # until killed


def _start_controller(cluster: LocalCluster, tmp: str) -> tuple[Any, dict[str, Any]]:
    """The controller process, once it has saved (its report), or an error with its output."""
    import json
    import queue
    import subprocess
    import sys
    import threading

    code = "import sys; from tests.test_peer_tier import _controller_process as c; c(*sys.argv[1:])"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, cluster.cluster.address, tmp],
        cwd=Path(__file__).resolve().parents[1],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + 180
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            line = None
        if line is None:
            proc.kill()
            raise AssertionError("the controller process did not save:\n" + "".join(seen[-60:]))
        if line.startswith(_CONTROLLER):
            return proc, json.loads(line[len(_CONTROLLER) :])
        seen.append(line)


def _until_ended(pids: list[int], timeout: float = 60.0) -> None:
    import psutil

    deadline = time.monotonic() + timeout
    while any(psutil.pid_exists(p) for p in pids):
        assert time.monotonic() < deadline, f"host processes {pids} outlived their controller"
        time.sleep(0.2)


def _restart_the_controller(cluster: LocalCluster, tmp: str) -> None:
    import os
    import signal

    proc, saved = _start_controller(cluster, tmp)
    assert saved["steps"] == [2, 4], saved
    os.kill(proc.pid, signal.SIGKILL)  # the kernel dies; its hosts end with it
    proc.wait(30)
    _until_ended(saved["pids"])
    print(f"controller {proc.pid} killed; its hosts {saved['pids']} ended", flush=True)
    shm = Path(tmp) / "shm"
    tier = PeerTier(every_n_steps=1, copies=1, path=str(shm / "{node}"))
    s = cluster.slice(devices_per_host=2, hosts=3)  # a new slice over the live nodes
    try:
        with Checkpointer(
            Path(tmp) / "ckpt", save_policy=FixedInterval(interval=2), peers=tier
        ) as ckpt:
            assert ckpt.steps == [2, 4]
            t0 = time.monotonic()
            r = ckpt.recover(abstract_state=_abstract(s))
            print(f"restarted: {r} in {time.monotonic() - t0:.1f}s; notes {r.notes}", flush=True)
            assert (r.step, r.tier, r.slice) == (5, "peers", s), (r, r.notes)
            parts = _parts_of(shm, 5)
            assert sorted(parts) == [0, 1, 2], parts
            assert sum(r.bytes_by_source.values()) == sum(parts.values()), r.bytes_by_source
            moved = mp.io_stats(slice=s)  # the new hosts' counters: the recovery's bytes only
            assert moved.bytes_read == 0, moved  # nothing from storage
            assert moved.bytes_between_hosts == r.bytes_by_source["peer"], moved
            _check_state(s, r.state, 5)
            params = _train(s, ckpt, range(6, 8), r.state["params"])  # and training goes on
            ckpt.wait()
            assert ckpt.steps == [2, 4, 6]
            _check_state(s, {"params": params, "step": 7}, 7)
            report(
                recovered=[r.step, r.tier],
                read_from_storage=moved.bytes_read,
                parts=sorted(parts),
                stored=ckpt.steps,
            )
    finally:
        s.shutdown()


@pytest.mark.slow
def test_a_controller_killed_and_restarted_recovers_from_node_memory(
    ray_cluster: ClusterProcess, tmp_path: Path
) -> None:
    output = ray_cluster.run(_restart_the_controller, str(tmp_path))
    print(output)
    assert reported(output) == {
        "recovered": [5, "peers"],  # (exact), onto the new slice
        "read_from_storage": 0,
        "parts": [0, 1, 2],  # every host's part, from the nodes' memory
        "stored": [2, 4, 6],  # and training went on
    }
