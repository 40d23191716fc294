"""Single-controller slices on Ray: handles on the controller, every byte on the hosts."""

from __future__ import annotations

import gc
import json
import threading
import time
from pathlib import Path
from typing import Any

import cloudpickle
import jax
import jax.numpy as jnp
import numpy as np
import psutil
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost import workers

pytestmark = pytest.mark.usefixtures("ray_runtime")


def host_values(n_arrays: int, rows: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {f"w{i}": rng.standard_normal((rows, 256), dtype=np.float32) for i in range(n_arrays)}


@pytest.fixture(scope="module")
def slice42() -> Any:
    with mp.Slice.start(hosts=4, devices_per_host=2) as s:
        yield s


@pytest.fixture(scope="module")
def saved_from_slice(
    slice42: mp.Slice, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, np.ndarray]]:
    mesh = slice42.mesh({"data": 2, "model": 4})
    values = host_values(4, 64)
    values["b"] = np.arange(32, dtype=np.float32)
    shardings = {k: mesh.sharding(P("data", "model")) for k in values}
    shardings["b"] = mesh.sharding(P())
    tree = slice42.put(values, shardings)
    path = tmp_path_factory.mktemp("slice") / "ckpt"
    mp.save(path, {"params": tree, "step": 5, "note": "slice", "host": np.arange(3)})
    return path, values


def abstract_on(mesh: Any, values: dict[str, np.ndarray], make: Any) -> dict[str, Any]:
    return {
        "params": {
            k: make(
                v.shape,
                v.dtype,
                mesh,
                P(None, mesh.axis_names[0]) if v.ndim == 2 else P(mesh.axis_names[0]),
            )
            for k, v in values.items()
        },
        "step": 0,
        "note": "",
        "host": np.zeros(3, np.int64),
    }


def test_programming_model_and_handles(slice42: mp.Slice) -> None:
    ids = slice42.device_ids
    assert (
        len(ids) == 8 and ids[:2] == [0, 1] and ids[2] != 2
    )  # not contiguous across hosts: mapped by id
    mesh = slice42.mesh({"data": 2, "model": 4})
    x = np.arange(32 * 16, dtype=np.float32).reshape(32, 16)
    tree = slice42.put({"x": x}, {"x": mesh.sharding(P("data", "model"))})
    assert isinstance(tree["x"], mp.RemoteArray) and tree["x"].shape == (32, 16)
    out = slice42.run(lambda t, k: {"y": t["x"] * k, "s": t["x"].sum()}, tree, 3.0)
    assert np.array_equal(slice42.fetch(out["y"]), x * 3) and float(
        slice42.fetch(out["s"])
    ) == float(x.sum())
    col = mesh.sharding(P(None, "model"))
    moved = slice42.run(lambda a: a + 1, tree["x"], out_shardings=col)
    assert moved.sharding == col and np.array_equal(slice42.fetch(moved), x + 1)
    del moved
    held = slice42.group.all("held", doing="counting")
    del out, tree
    gc.collect()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and slice42.group.all("held", doing="counting") != [
        h - 3 for h in held
    ]:
        time.sleep(0.1)
    assert slice42.group.all("held", doing="counting") == [h - 3 for h in held], (
        "dropped handles are freed on the hosts"
    )
    with pytest.raises(ValueError, match="has 6 devices but the slice has 8"):
        slice42.mesh({"a": 6})
    # put sends each host only its devices' shards; replicated data reaches every host
    big = np.arange(256 * 256, dtype=np.int32).reshape(256, 256)
    before = slice42.traffic()
    sharded = slice42.put(big, mesh.sharding(P("data", "model")))
    sent = (slice42.traffic() - before).bytes_to_hosts
    assert big.nbytes <= sent <= big.nbytes + 8192, sent
    before = slice42.traffic()
    replicated = slice42.put({"b": big, "s": np.float32(2.5)}, mesh.sharding(P()))
    assert (slice42.traffic() - before).bytes_to_hosts >= 4 * big.nbytes
    assert np.array_equal(slice42.fetch(sharded), big) and np.array_equal(
        slice42.fetch(replicated["b"]), big
    )
    assert slice42.fetch(replicated["s"]) == np.float32(2.5) and replicated["s"].shape == ()
    with pytest.raises(ValueError, match="cuts a dimension of size 6 into 4 parts"):
        slice42.put(np.arange(6.0, dtype=np.float32), mesh.sharding(P("model")))


def _traces_so_far(x: Any) -> Any:
    import builtins

    return x * 0 + getattr(builtins, "_milepost_test_traces", 0)


def _counts_its_traces(x: Any) -> Any:
    import builtins

    builtins._milepost_test_traces = getattr(builtins, "_milepost_test_traces", 0) + 1  # type: ignore[attr-defined]
    return x + 1


def test_run_reuses_the_compiled_function_and_reports_tracer_errors(slice42: mp.Slice) -> None:
    mesh = slice42.mesh({"data": 2, "model": 4})
    x = slice42.put(np.zeros((8, 8), np.float32), mesh.sharding(P("data", "model")))
    for _ in range(3):
        y = slice42.run(_counts_its_traces, x)
    assert np.array_equal(slice42.fetch(y), np.ones((8, 8), np.float32))
    assert np.all(slice42.fetch(slice42.run(_traces_so_far, x)) == 1), (
        "the same function sent again was traced again"
    )
    # An error JAX raises on a host (its types do not unpickle) arrives as its builtin base, named.
    with pytest.raises(
        mp.HostError, match="failed while running <lambda>: TypeError: ConcretizationTypeError"
    ):
        slice42.run(lambda a, n: jnp.arange(n) + a[0, 0], x, 3)
    assert np.array_equal(
        slice42.fetch(slice42.run(lambda a: a * 2, y)), 2 * np.ones((8, 8), np.float32)
    )


def test_save_moves_no_array_bytes_through_the_controller(
    slice42: mp.Slice, tmp_path: Path
) -> None:
    mesh = slice42.mesh({"data": 2, "model": 4})
    per_array = {}
    for rows in (64, 4096):  # 64 KiB and 4 MiB arrays: controller traffic must not grow with size
        values = host_values(8, rows)
        tree = slice42.put(values, {k: mesh.sharding(P("data", "model")) for k in values})
        before = slice42.traffic()
        mp.save(tmp_path / f"c{rows}", tree)
        abstract = {
            k: mp.AbstractArray(v.shape, v.dtype, mesh.sharding(P("model")))
            for k, v in values.items()
        }
        loaded = mp.load(tmp_path / f"c{rows}", abstract)
        moved = slice42.traffic() - before
        assert moved.messages > 0 and moved.bytes_from_hosts > 0  # the counters see both directions
        per_array[rows] = moved.total_bytes / len(values)
        assert np.array_equal(slice42.fetch(loaded["w3"]), values["w3"])
    assert per_array[4096] <= 4096, (
        f"{per_array[4096]:.0f} bytes per array passed through the controller"
    )
    assert per_array[4096] <= per_array[64] * 1.1 + 64


def test_save_messages_grow_with_hosts_not_arrays(slice42: mp.Slice, tmp_path: Path) -> None:
    """A save sends each host one plan (every array of it) and one wait, whatever the number of
    arrays: 20 and 200 small arrays cost the same controller<->host messages. Bytes grow with
    the arrays' metadata only (the plans' task lists, the acks' chunk checksums)."""
    mesh = slice42.mesh({"data": 2, "model": 4})
    moved = {}
    for n in (20, 200):
        values = host_values(n, 16)  # 16 KiB arrays
        tree = slice42.put(values, {k: mesh.sharding(P("data", "model")) for k in values})
        gc.collect()
        slice42.group.all(
            "held", doing="counting"
        )  # sends any pending releases of dropped handles now
        before = slice42.traffic()
        mp.save(tmp_path / f"c{n}", tree)
        moved[n] = slice42.traffic() - before
        restored = mp.load(
            tmp_path / f"c{n}",
            {k: mp.AbstractArray(v.shape, v.dtype, mesh.sharding(P())) for k, v in values.items()},
        )
        assert np.array_equal(slice42.fetch(restored[f"w{n - 1}"]), values[f"w{n - 1}"])
    assert moved[20].messages == moved[200].messages == 2 * slice42.hosts, (
        moved
    )  # start_save + wait_save per host
    per_array = (moved[200].total_bytes - moved[20].total_bytes) / 180
    assert 0 < per_array < 4096, (
        f"{per_array:.0f} bytes per array of metadata through the controller"
    )
    assert moved[200].total_bytes < 16 * 1024 * 200 / 4, (
        "array bytes must not pass through the controller"
    )


def _saves_pending(s: mp.Slice) -> list[int]:
    import ray

    return ray.get(
        [a.__ray_call__.remote(lambda host: len(host.pending)) for a in s.group._actors], timeout=30
    )


def test_a_staging_failure_on_one_host_is_named_and_leaves_nothing(
    slice42: mp.Slice, tmp_path: Path
) -> None:
    """Each host's wait for its writes is sent with its plan: a host whose staging fails still
    answers its wait at once, the hosts that staged settle, and nothing is left behind."""
    import ray

    mesh = slice42.mesh({"data": 2, "model": 4})
    values = host_values(4, 64)
    tree = slice42.put(values, {k: mesh.sharding(P("data", "model")) for k in values})
    ray.get(
        slice42.group._actors[2].release.remote([tree["w1"].id]), timeout=30
    )  # gone on host 2 only
    before = slice42.traffic()
    with pytest.raises(
        mp.HostError,
        match=(
            r"host 2 \(node .* pid \d+\) failed while copying its shards to host memory: "
            r"KeyError"
        ),
    ):
        mp.save(tmp_path / "c", tree)
    # plans and waits, and for each host still staging when host 2 failed, a note to wake its wait
    # if need be
    assert (
        2 * slice42.hosts <= slice42.traffic().messages - before.messages <= 3 * slice42.hosts - 1
    )
    assert list(tmp_path.iterdir()) == [] and slice42.healthy
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _saves_pending(slice42) != [0] * slice42.hosts:
        time.sleep(0.05)
    assert _saves_pending(slice42) == [0] * slice42.hosts, (
        "every host's wait ended and forgot the save"
    )
    del tree["w1"]
    mp.save(tmp_path / "d", tree)  # the slice still saves
    restored = mp.load(
        tmp_path / "d",
        {
            k: mp.AbstractArray(v.shape, v.dtype, mesh.sharding(P()))
            for k, v in values.items()
            if k != "w1"
        },
    )
    assert np.array_equal(slice42.fetch(restored["w3"]), values["w3"])
    assert _saves_pending(slice42) == [0] * slice42.hosts


def test_each_array_header_is_written_by_one_host(slice42: mp.Slice, tmp_path: Path) -> None:
    """Every host writes its chunks, but only one writes an array's zarr.json: the commit merges
    one header per array, not one per host (and the merged view still has them all)."""
    import tensorstore as ts

    mesh = slice42.mesh({"data": 2, "model": 4})
    values = host_values(6, 16)
    tree = slice42.put(
        values, {k: mesh.sharding(P("data", "model") if k != "w5" else P()) for k in values}
    )
    mp.save(tmp_path / "c", tree)
    mp.save(tmp_path / "again", tree)
    # every host's packed data files named by one token a save, a new one for each save
    tokens = [
        {f.name.split(".")[0] for f in (tmp_path / c / "state").glob("ocdbt.process_*.p/d/*")}
        for c in ("c", "again")
    ]
    assert len(list((tmp_path / "c" / "state").glob("ocdbt.process_*.p"))) == slice42.hosts
    assert [len(t) for t in tokens] == [1, 1] and tokens[0] != tokens[1], tokens
    headers: dict[str, int] = {}
    chunks = 0
    tables: list[str] = []
    holding: list[str] = []  # the databases that hold chunks
    dbs = sorted((tmp_path / "c" / "state").glob("ocdbt.process_*"))
    assert len({db.name.split(".")[1] for db in dbs}) == slice42.hosts
    for db in dbs:
        kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{db}/"}).result()
        for key in (k.decode() for k in kv.list().result()):
            if key.endswith("/zarr.json"):
                headers[key] = headers.get(key, 0) + 1
            elif key.startswith(workers.format.CHUNK_TABLE_PREFIX):
                tables.append(key)
            else:
                chunks += 1
                holding.append(db.name)
    assert headers == {f"w{i}/zarr.json": 1 for i in range(6)}, headers
    # and one chunk checksum table per database that holds chunks
    want = sorted(workers.format.CHUNK_TABLE_PREFIX + name for name in set(holding))
    assert sorted(tables) == want, tables
    # 8 shards each; the replicated w5 (1 KiB, under the write floor) is one write by a replica
    assert chunks == 5 * 8 + 1
    loaded = mp.load(
        tmp_path / "c",
        {k: mp.AbstractArray(v.shape, v.dtype, mesh.sharding(P())) for k, v in values.items()},
    )
    assert all(np.array_equal(slice42.fetch(loaded[k]), v) for k, v in values.items())


def test_reshard_across_topologies(
    saved_from_slice: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    path, values = saved_from_slice

    def check(loaded: dict[str, Any], fetch: Any) -> None:
        for k, v in values.items():
            assert np.array_equal(fetch(loaded["params"][k]), v), k
        assert (
            loaded["step"] == 5
            and loaded["note"] == "slice"
            and np.array_equal(loaded["host"], np.arange(3))
        )

    # 2 hosts x 4 devices, another mesh and PartitionSpec
    with mp.Slice.start(hosts=2, devices_per_host=4) as s24:
        mesh = s24.mesh({"x": 4, "y": 2})
        loaded = mp.load(
            path,
            abstract_on(
                mesh, values, lambda sh, dt, m, spec: mp.AbstractArray(sh, dt, m.sharding(spec))
            ),
        )
        assert loaded["params"]["w0"].sharding.milepost_spec.spec == (None, "x")
        check(loaded, s24.fetch)
        # and an embedded-mode checkpoint loads onto a slice
        local_mesh = jax.make_mesh((8,), ("z",))
        mp.save(
            tmp_path / "embedded",
            {
                "params": {
                    k: jax.device_put(v, NamedSharding(local_mesh, P("z")))
                    for k, v in values.items()
                },
                "step": 5,
                "note": "slice",
                "host": np.arange(3),
            },
        )
        check(
            mp.load(
                tmp_path / "embedded",
                abstract_on(
                    mesh, values, lambda sh, dt, m, spec: mp.AbstractArray(sh, dt, m.sharding(spec))
                ),
            ),
            s24.fetch,
        )
    # 8 hosts x 1 device
    with mp.Slice.start(hosts=8, devices_per_host=1) as s81:
        mesh = s81.mesh({"x": 8})
        check(
            mp.load(
                path,
                abstract_on(
                    mesh, values, lambda sh, dt, m, spec: mp.AbstractArray(sh, dt, m.sharding(spec))
                ),
            ),
            s81.fetch,
        )
    # the embedded mode on 8 local devices
    local = jax.make_mesh((4, 2), ("x", "y"))
    check(
        mp.load(
            path,
            abstract_on(
                local,
                values,
                lambda sh, dt, m, spec: jax.ShapeDtypeStruct(
                    sh, dt, sharding=NamedSharding(m, spec)
                ),
            ),
        ),
        np.asarray,
    )
    # Orbax v1 in one process
    ocp = pytest.importorskip("orbax.checkpoint.experimental.v1")
    check(
        ocp.load(
            path,
            abstract_on(
                local,
                values,
                lambda sh, dt, m, spec: jax.ShapeDtypeStruct(
                    sh, dt, sharding=NamedSharding(m, spec)
                ),
            ),
        ),
        np.asarray,
    )


def test_metadata_and_checkpointables_on_a_slice(
    slice42: mp.Slice, saved_from_slice: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    path, values = saved_from_slice
    meta = mp.metadata(path)
    assert meta.tree["params"]["w0"].shape == values["w0"].shape
    assert meta.tree["params"]["w0"].sharding.device_ids == tuple(slice42.device_ids)
    mesh = slice42.mesh({"data": 2, "model": 4})
    params = slice42.put({"w": values["w0"]}, {"w": mesh.sharding(P("data"))})
    with mp.training.Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save_checkpointables(0, {"params": params, "data": {"position": 3}})
        ckpt.wait()
        out = ckpt.load_checkpointables(
            0,
            {
                "params": {
                    "w": mp.AbstractArray(values["w0"].shape, np.float32, mesh.sharding(P()))
                },
                "data": None,
            },
        )
    assert np.array_equal(slice42.fetch(out["params"]["w"]), values["w0"]) and out["data"] == {
        "position": 3
    }


def test_verify_spreads_the_chunks_over_the_hosts(slice42: mp.Slice, tmp_path: Path) -> None:
    mesh = slice42.mesh({"data": 2, "model": 4})
    values = host_values(4, 256)
    path = tmp_path / "c"
    mp.save(
        path,
        {
            "params": slice42.put(values, {k: mesh.sharding(P("data", "model")) for k in values}),
            "n": np.arange(300),
        },
    )
    before = slice42.traffic()
    report = mp.verify(path, slice=slice42)
    moved = slice42.traffic() - before
    assert report.ok, report
    assert (
        report.chunks_checked == 4 * 8 + 1
        and report.bytes_read == sum(v.nbytes for v in values.values()) + 300 * 8
    )
    assert (
        moved.messages <= 2 * slice42.hosts and moved.total_bytes < 64 * 1024
    )  # plans and acks (and handle releases), never data
    # a flipped byte in one chunk: found by the host that read it, named in the report
    data = max(
        (f for f in (path / "state").rglob("d/*") if f.is_file()), key=lambda f: f.stat().st_size
    )
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    damaged = mp.verify(path, slice=slice42)
    assert not damaged.ok and any(
        "fails its checksum" in p and "params.w" in p for p in damaged.problems
    ), damaged


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "tensorstore"])
def test_a_flipped_byte_in_a_chunk_is_caught_on_the_host_that_reads_it(
    slice42: mp.Slice,
    saved_from_slice: tuple[Path, dict[str, np.ndarray]],
    tmp_path: Path,
    direct: bool,
) -> None:
    """A byte of one shard's data flipped on disk: the host that reads the chunk checks it, and
    the load on the controller is a CorruptCheckpointError naming the array, the chunk and the
    file, never other values."""
    import shutil

    from tests.test_integrity import chunk_value, flip

    path, values = saved_from_slice
    ckpt = Path(shutil.copytree(path, tmp_path / "c", symlinks=True))
    file, offset, length = chunk_value(ckpt, "params.w1/c/1/2")
    flip(file, offset + length // 2)
    mesh = slice42.mesh({"data": 2, "model": 4})
    abstract = abstract_on(
        mesh, values, lambda sh, dt, m, spec: mp.AbstractArray(sh, dt, m.sharding(spec))
    )
    with (
        mp.Context(loading=mp.LoadOptions(direct_reads=direct)),
        pytest.raises(mp.CorruptCheckpointError) as info,
    ):
        mp.load(ckpt, abstract)
    error = info.value
    assert error.array == "params.w1" and error.chunk == (1, 2), error
    assert error.path is not None and str(ckpt / "state") in error.path, error
    assert "fails its checksum" in str(error), error
    assert slice42.healthy  # a damaged checkpoint is not a failed host
    rest = mp.load(ckpt, {"params": {"w0": abstract["params"]["w0"]}}, partial=True)
    assert np.array_equal(slice42.fetch(rest["params"]["w0"]), values["w0"])


def test_safetensors_export_and_load_on_a_slice(slice42: mp.Slice, tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    import milepost.safetensors

    mesh = slice42.mesh({"data": 2, "model": 4})
    values = host_values(6, 512)  # 6 x 512 KiB
    mp.save(
        tmp_path / "c",
        {"params": slice42.put(values, {k: mesh.sharding(P("data", "model")) for k in values})},
    )
    before = slice42.traffic()
    summary = milepost.safetensors.export(
        tmp_path / "c", tmp_path / "out", subtree="params", max_shard_bytes=1 << 20, slice=slice42
    )
    moved = slice42.traffic() - before
    assert (
        len(summary.files) == 3 and moved.total_bytes < 64 * 1024
    )  # the hosts wrote the files: plans and acks here
    got = {}
    for f in summary.files:
        got.update(load_file(str(tmp_path / "out" / f)))
    assert sorted(got) == sorted(values) and all(
        np.array_equal(got[k], v) for k, v in values.items()
    )
    before = slice42.traffic()
    back = mp.load(
        tmp_path / "out",
        {
            k: mp.AbstractArray(v.shape, v.dtype, mesh.sharding(P("model")))
            for k, v in values.items()
        },
    )
    assert (
        slice42.traffic() - before
    ).total_bytes < 64 * 1024  # each host read its rows from the files
    assert np.array_equal(slice42.fetch(back["w3"]), values["w3"])


def test_a_checkpoint_without_chunk_checksums_loads_onto_a_slice(
    slice42: mp.Slice, tmp_path: Path
) -> None:
    """Orbax's checkpoints record no chunk checksums: every host gets the same plan, pickled
    once into the object store and sent to each host by reference."""
    ocp = pytest.importorskip("orbax.checkpoint.experimental.v1")
    values = host_values(3, 16)
    local = jax.make_mesh((2, 4), ("data", "model"))
    ocp.save(
        tmp_path / "o",
        {k: jax.device_put(v, NamedSharding(local, P("data"))) for k, v in values.items()},
    )
    mesh = slice42.mesh({"data": 2, "model": 4})
    before = slice42.traffic()
    got = mp.load(
        tmp_path / "o",
        {
            k: mp.AbstractArray(v.shape, v.dtype, mesh.sharding(P("model")))
            for k, v in values.items()
        },
    )
    moved = slice42.traffic() - before
    for k, v in values.items():
        assert np.array_equal(slice42.fetch(got[k]), v), k
    assert moved.messages >= slice42.hosts and moved.bytes_to_hosts > 0


def test_typed_prng_keys_on_a_slice(slice42: mp.Slice, tmp_path: Path) -> None:
    mesh = slice42.mesh({"data": 2, "model": 4})
    keys = slice42.run(
        lambda: {
            "batch": jax.random.split(jax.random.key(3), 16),
            "rbg": jax.random.key(1, impl="rbg"),
        },
        out_shardings={"batch": mesh.sharding(P(("data", "model"))), "rbg": mesh.sharding(P())},
    )
    assert keys["batch"].dtype == jax.random.key(0).dtype and keys["batch"].shape == (16,)
    mp.save(tmp_path / "c", keys)
    want = {"batch": jax.random.split(jax.random.key(3), 16), "rbg": jax.random.key(1, impl="rbg")}
    # Four hosts wrote each array: one array_metadatas file lists each once, with its key impl
    folder = tmp_path / "c" / "state" / "array_metadatas"
    assert [p.name for p in folder.iterdir()] == ["process_0"]
    listed = json.loads((folder / "process_0").read_text())["array_metadatas"]
    assert sorted(
        (e["array_metadata"]["param_name"], e["array_metadata"]["ext_metadata"]["random_key_impl"])
        for e in listed
    ) == [("batch", "threefry2x32"), ("rbg", "rbg")]
    ocp = pytest.importorskip("orbax.checkpoint.experimental.v1")
    here = NamedSharding(jax.make_mesh((8,), ("x",)), P())
    restored = ocp.load(  # Orbax gives keys back from that one file
        tmp_path / "c",
        {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=here) for k, v in want.items()},
    )
    for k, v in want.items():
        assert restored[k].dtype == v.dtype and np.array_equal(
            jax.random.key_data(restored[k]), jax.random.key_data(v)
        ), k
    local = mp.load(
        tmp_path / "c",
        {
            k: jax.ShapeDtypeStruct(
                v.shape, v.dtype, sharding=NamedSharding(jax.make_mesh((8,), ("x",)), P())
            )
            for k, v in want.items()
        },
    )
    for k, v in want.items():  # written by the hosts, read back in this process
        assert local[k].dtype == v.dtype and np.array_equal(
            jax.random.key_data(local[k]), jax.random.key_data(v)
        ), k
    back = mp.load(
        tmp_path / "c",
        {"batch": mp.AbstractArray((16,), keys["batch"].dtype, mesh.sharding(P("model")))},
        partial=True,
    )
    assert back["batch"].dtype == keys["batch"].dtype and back[
        "batch"
    ].sharding.milepost_spec.spec == ("model",)
    data = slice42.run(jax.random.key_data, back["batch"])  # still keys on the hosts
    assert np.array_equal(slice42.fetch(data), jax.random.key_data(want["batch"]))


def test_a_host_killed_mid_save_is_reported_by_name(tmp_path: Path, ray_runtime: Any) -> None:
    with mp.Slice.start(hosts=2, devices_per_host=1, options=mp.SliceOptions(timeout_secs=30)) as s:
        mesh = s.mesh({"x": 2})
        values = host_values(4, 1 << 14)  # 64 MiB
        tree = s.put(values, {k: mesh.sharding(P("x")) for k in values})
        handle = mp.save_async(tmp_path / "c", tree)
        ray_runtime.kill(s.group._actors[1])
        t0 = time.monotonic()
        with pytest.raises(mp.HostError, match=r"host 1 \(node .* pid \d+\) died") as died:
            handle.result(120)
        assert time.monotonic() - t0 < 60
        assert died.value.hosts == (1,)
        assert not (tmp_path / "c").exists() and list(tmp_path.iterdir()) == []
        assert not s.healthy
        with pytest.raises(mp.HostError, match="unhealthy") as unhealthy:
            mp.save(tmp_path / "d", tree)
        assert unhealthy.value.hosts == ()  # (the slice as a whole)
    with mp.Slice.start(hosts=2, devices_per_host=1) as fresh:  # a new slice works
        mesh = fresh.mesh({"x": 2})
        t = fresh.put({"a": np.arange(8.0)}, {"a": mesh.sharding(P("x"))})
        mp.save(tmp_path / "e", t)
        assert np.array_equal(
            fresh.fetch(
                mp.load(
                    tmp_path / "e", {"a": mp.AbstractArray((8,), np.float32, mesh.sharding(P()))}
                )["a"]
            ),
            np.arange(8.0),
        )

        # a host that hangs (busy in a 60 s call) is reported within the configured time
        def stall() -> Any:
            time.sleep(60)
            return jax.numpy.zeros(())

        fresh.group._actors[1].run.remote(cloudpickle.dumps(stall), (), {}, "stall", None)
        t0 = time.monotonic()
        with (
            mp.Context(async_=mp.AsyncOptions(timeout_secs=3)),
            pytest.raises(
                mp.HostError, match=r"host 1 \(node .* pid \d+\) did not answer within 3s"
            ) as hung,
        ):
            mp.save(tmp_path / "f", t)
        assert time.monotonic() - t0 < 30
        assert hung.value.hosts == (1,)
        assert not fresh.healthy and sorted(p.name for p in tmp_path.iterdir()) == ["e"]


@pytest.mark.slow
def test_a_host_dead_or_hung_during_load_is_reported_by_name(
    tmp_path: Path, ray_runtime: Any
) -> None:
    def stall() -> Any:
        time.sleep(60)
        return jax.numpy.zeros(())

    for failure, expected in (
        ("kill", r"host 1 \(node .* pid \d+\) died while reading"),
        ("hang", r"host 1 \(node .* pid \d+\) did not answer within 3s while reading"),
    ):
        with mp.Slice.start(hosts=2, devices_per_host=1) as s:
            mesh = s.mesh({"x": 2})
            mp.save(tmp_path / failure, s.put({"a": np.arange(8.0)}, {"a": mesh.sharding(P("x"))}))
            if failure == "kill":
                ray_runtime.kill(s.group._actors[1])
            else:
                s.group._actors[1].run.remote(cloudpickle.dumps(stall), (), {}, "stall", None)
            t0 = time.monotonic()
            with (
                mp.Context(async_=mp.AsyncOptions(timeout_secs=3)),
                pytest.raises(mp.HostError, match=expected),
            ):
                mp.load(
                    tmp_path / failure,
                    {"a": mp.AbstractArray((8,), np.float32, mesh.sharding(P()))},
                )
            assert time.monotonic() - t0 < 30 and not s.healthy


def _controller_rss_growth(s: mp.Slice, path: Path, gib: float) -> tuple[int, int, float]:
    """Save then load ``gib`` GiB made on the hosts; the controller's peak RSS growth during the
    save and during save+load, and the controller<->host bytes per array."""
    mesh = s.mesh({"data": 2, "model": 4})
    rows = int(gib * 2**30 / 8 / 4 / 4096)
    # the data is made on the hosts (slice.run), never on the controller
    sharding = mesh.sharding(P("data", "model"))
    tree = {
        f"w{i}": s.run(
            lambda i=i: jax.random.normal(jax.random.key(i), (rows, 4096), np.float32),
            out_shardings=sharding,
        )
        for i in range(8)
    }
    assert tree["w0"].sharding == sharding
    proc = psutil.Process()
    peak = [proc.memory_info().rss]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.01)

    base = proc.memory_info().rss
    before = s.traffic()
    t = threading.Thread(target=sample)
    t.start()
    mp.save(path, tree)
    save_peak = peak[0] - base
    loaded = mp.load(
        path,
        {k: mp.AbstractArray(v.shape, v.dtype, mesh.sharding(P("model"))) for k, v in tree.items()},
    )
    stop.set()
    t.join()
    moved = s.traffic() - before
    assert set(loaded) == set(tree)
    return save_peak, peak[0] - base, moved.total_bytes / len(tree)


def test_controller_memory_stays_flat(slice42: mp.Slice, tmp_path: Path) -> None:
    save_growth, total_growth, per_array = _controller_rss_growth(slice42, tmp_path / "c", 0.25)
    assert save_growth < 100 << 20 and total_growth < 100 << 20, (save_growth, total_growth)
    assert per_array <= 4096, (
        f"{per_array:.0f} bytes per 32 MiB array passed through the controller"
    )


@pytest.mark.slow
def test_controller_memory_two_gib(slice42: mp.Slice, tmp_path: Path) -> None:
    save_growth, total_growth, per_array = _controller_rss_growth(slice42, tmp_path / "c", 2.0)
    assert save_growth < 100 << 20 and total_growth < 100 << 20, (save_growth, total_growth)
    # The default 1 MiB bands give a 256 MiB array 256 chunks, and each chunk's checksum passes
    # the controller once from the saving host and once to each of the 2 hosts that read it
    # (P('model') is replicated over 'data'): ~20 pickled bytes each, never the data.
    chunks = 256
    assert per_array <= 4096 + 24 * 3 * chunks, (
        f"{per_array:.0f} bytes per 256 MiB array passed through the controller"
    )


def test_a_flax_msgpack_file_loads_on_a_slice(slice42: mp.Slice, tmp_path: Path) -> None:
    serialization = pytest.importorskip("flax.serialization")
    mesh = slice42.mesh({"data": 2, "model": 4})
    values = host_values(3, 512)  # 3 x 512 KiB
    path = tmp_path / "flax_model.msgpack"
    path.write_bytes(serialization.to_bytes({"params": values, "step": 9}))
    abstract = {
        "params": {
            k: mp.AbstractArray(v.shape, v.dtype, mesh.sharding(P("data", "model")))
            for k, v in values.items()
        },
        "step": 0,
    }
    before = slice42.traffic()
    back = mp.load(path, abstract)
    # the controller walked the structure; each host read its rows of the file
    assert (slice42.traffic() - before).total_bytes < 64 * 1024
    assert back["step"] == 9
    assert all(np.array_equal(slice42.fetch(back["params"][k]), v) for k, v in values.items())


_QUIET_START = """
import warnings
warnings.simplefilter("default")
import jax
jax.devices()  # JAX's backends up: its os.fork() warning is armed
import milepost as mp
with mp.Slice.start(hosts=1, devices_per_host=1) as s:
    assert len(s.device_ids) == 1
print("started")
"""


def test_starting_a_slice_prints_no_ray_or_jax_notice(tmp_path: Path) -> None:
    """Slice.start's own ray.init, after JAX is up, in a fresh process: neither Ray's token
    authentication notice nor JAX's os.fork() deadlock warning."""
    import os
    import subprocess
    import sys

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS", "XLA_FLAGS")
    }
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run(
        [sys.executable, "-c", _QUIET_START],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0 and "started" in done.stdout, done.stderr
    assert "Token authentication" not in done.stderr, done.stderr
    assert "os.fork()" not in done.stderr, done.stderr
