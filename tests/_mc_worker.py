"""One process of a multi-controller test job (see tests/_mc.py). Prints one JSON line.

    python -m tests._mc_worker <scenario> <index> <count> <port> <root> [args...]

Several checks share one job because starting a jax.distributed job is the slow part. Every
check records its outcome in the printed dict, so the test can compare processes.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

SCENARIO, INDEX, COUNT, PORT = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
ARGS = sys.argv[5:]

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{PORT}", num_processes=COUNT, process_id=INDEX)

from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import milepost as mp  # noqa: E402
from milepost import workers  # noqa: E402
from milepost._checkpoint import _save as _checkpoint  # noqa: E402
from milepost.colocated import MultiControllerHostGroup, set_primary_process  # noqa: E402
from tests._mc import SHAPES, global_value  # noqa: E402


def make_tree(mesh: jax.sharding.Mesh) -> dict:
    specs = {"w": P("data", "model"), "b": P("model"), "r": P()}
    tree: dict = {}
    for k, (shape, dtype) in SHAPES.items():
        g = global_value(k, shape, dtype)
        s = NamedSharding(mesh, specs[k])
        tree[k] = jax.make_array_from_callback(shape, s, lambda idx, g=g: g[idx])
    tree["step"] = 7
    tree["note"] = "mc"
    tree["host"] = np.arange(5)
    return tree


def check(tree: dict, expect_sharding: dict | None = None) -> int:
    """Compare every addressable shard with the global value; returns how many were checked."""
    n = 0
    for k, (shape, dtype) in SHAPES.items():
        g = global_value(k, shape, dtype)
        arr = tree[k]
        assert arr.shape == shape and arr.dtype == np.dtype(dtype), (k, arr.shape, arr.dtype)
        if expect_sharding is not None:
            assert arr.sharding == expect_sharding[k], (k, arr.sharding, expect_sharding[k])
        for shard in arr.addressable_shards:
            assert np.array_equal(np.asarray(shard.data), g[shard.index]), (k, shard.index)
            n += 1
    assert tree["step"] == 7 and tree["note"] == "mc" and np.array_equal(tree["host"], np.arange(5))
    return n


def mesh_a() -> jax.sharding.Mesh:
    return jax.make_mesh((2, len(jax.devices()) // 2), ("data", "model"))


def mesh_b() -> jax.sharding.Mesh:
    return jax.make_mesh((len(jax.devices()) // 2, 2), ("x", "y"))


def resharded_abstract(mesh: jax.sharding.Mesh) -> dict:
    specs = {
        "w": P(None, mesh.axis_names[0]),
        "b": P(mesh.axis_names[-1]),
        "r": P(mesh.axis_names[0]),
    }
    out: dict = {
        k: jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=NamedSharding(mesh, specs[k]))
        for k, (shape, dtype) in SHAPES.items()
    }
    out.update(step=0, note="", host=np.zeros(5, np.int64))
    return out


def outcome(fn: Callable[[], Any]) -> dict:
    """Run ``fn``; its error type and message (or None), the hosts a HostError is about, and
    how long it took."""
    t0 = time.monotonic()
    hosts = None
    try:
        fn()
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
        if isinstance(e, mp.HostError):
            hosts = list(e.hosts)
    return {"error": error, "hosts": hosts, "seconds": round(time.monotonic() - t0, 2)}


def inject(
    obj: Any, attr: str, when: Callable[..., bool], exc: BaseException
) -> Callable[[], None]:
    """Make ``obj.attr`` raise ``exc`` when ``when(*args)`` holds; returns the undo."""
    real = getattr(obj, attr)

    def patched(*args: Any, **kwargs: Any) -> Any:
        if when(*args, **kwargs):
            raise exc
        return real(*args, **kwargs)

    setattr(obj, attr, patched)
    return lambda: setattr(obj, attr, real)


class FailingIterator:
    """A stateful checkpointable whose save fails (only the primary calls it)."""

    def save(self, directory: Any) -> None:
        raise ValueError("injected stateful failure")

    def load(self, directory: Any) -> None:
        pass


def load_each(out: dict, paths: list[str]) -> None:
    """Load every path resharded, every load started at once (``load_async``: each process runs
    them one after another in call order, so their barriers meet), then check each."""
    handles = [(path, mp.load_async(path, resharded_abstract(mesh_b()))) for path in paths]
    for path, handle in handles:
        out[f"checked_{os.path.basename(path)}"] = check(handle.result(120))


def two_save(root: str, embedded: str) -> dict:
    """2 processes: save (async) and load resharded; Orbax v1 saves, milepost loads; plain zarr3."""
    import orbax.checkpoint.experimental.v1 as ocp

    out: dict = {}
    tree = make_tree(mesh_a())
    doomed = make_tree(mesh_a())
    handle = mp.save_async(os.path.join(root, "c"), doomed)
    for k in SHAPES:  # every process has staged its shards once save_async returns
        doomed[k].delete()
    handle.result(120)
    out["checked_c"] = check(mp.load(os.path.join(root, "c"), resharded_abstract(mesh_b())))
    ocp.save_pytree(os.path.join(root, "orbax"), tree)
    out["checked_orbax"] = check(mp.load(os.path.join(root, "orbax"), resharded_abstract(mesh_b())))
    with mp.Context(saving=mp.SaveOptions(use_ocdbt=False)):
        mp.save(os.path.join(root, "plain"), tree)
    out["checked_plain"] = check(mp.load(os.path.join(root, "plain"), resharded_abstract(mesh_b())))
    load_each(out, [embedded])
    # every coordination key milepost set is gone (once every process is past its last call)
    from jax._src import distributed

    distributed.global_state.client.wait_at_barrier("leak-check", 60_000)
    out["leftover_keys"] = [
        k for k, _ in distributed.global_state.client.key_value_dir_get("milepost/")
    ]
    return out


def four(root: str, embedded: str, *others: str) -> dict:
    """4 processes: save and load resharded, load what others saved, and agree on every error."""
    out: dict = {}
    tree = make_tree(mesh_a())
    a, b = os.path.join(root, "a"), os.path.join(root, "b")
    mp.save(a, tree, custom_metadata={"procs": COUNT})
    mp.save_async(b, tree).result(120)
    out["meta_procs"] = mp.metadata(a).custom_metadata["procs"]
    out["meta_shape"] = list(mp.metadata(a).tree["w"].shape)
    report = mp.verify(
        a
    )  # collective: every process checks its share, every process gets the report
    out["verify"] = [report.ok, report.chunks_checked, list(report.problems)]
    want = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(11), 8)))
    keys = jax.random.wrap_key_data(
        jax.make_array_from_callback(
            (8, 2), NamedSharding(mesh_a(), P("data")), lambda idx: want[idx]
        )
    )
    mp.save(os.path.join(root, "keys"), {"k": keys})
    back = jax.random.key_data(mp.load(os.path.join(root, "keys"))["k"])
    out["keys"] = [
        str(mp.metadata(os.path.join(root, "keys")).tree["k"].dtype),
        all(np.array_equal(np.asarray(s.data), want[s.index]) for s in back.addressable_shards),
    ]
    out["checked_same"] = check(mp.load(a), {k: tree[k].sharding for k in SHAPES})
    out["checked_resharded"] = check(mp.load(b, resharded_abstract(mesh_b())))
    load_each(out, [embedded, *others])

    # several checkpointables: a JSON one (read once, on the primary) and a zero-size array
    multi = os.path.join(root, "multi")
    empty = jax.make_array_from_callback(
        (0, 4), NamedSharding(mesh_a(), P()), lambda idx: np.zeros((0, 4), np.float32)
    )
    mp.save_checkpointables(
        multi, {"state": tree, "config": {"lr": 0.5, "name": "mc"}, "empty": {"z": empty}}
    )
    loaded = mp.load_checkpointables(multi)
    out["json"] = loaded["config"]
    out["empty_shape"] = list(loaded["empty"]["z"].shape)
    out["checked_multi"] = check(loaded["state"], {k: tree[k].sharding for k in SHAPES})

    # two saves in flight at once, then consecutive saves to one path: their barriers stay apart
    handles = [mp.save_async(os.path.join(root, f"concurrent{i}"), tree) for i in range(2)]
    out["concurrent"] = [
        str(h.result(120)) == os.path.join(root, f"concurrent{i}") for i, h in enumerate(handles)
    ]
    for _ in range(2):
        mp.save(os.path.join(root, "again"), tree, overwrite=True)
    out["checked_again"] = check(mp.load(os.path.join(root, "again"), resharded_abstract(mesh_b())))
    with mp.training.Checkpointer(os.path.join(root, "run")) as ckpt:
        for step in range(3):
            ckpt.save(step, tree)
        ckpt.wait()
        out["ckpt_steps"] = ckpt.steps

    # every process gets the same error, and nothing is committed
    out["exists"] = outcome(lambda: mp.save(a, tree))
    os.makedirs(os.path.join(root, "not_a_ckpt"), exist_ok=True)
    out["not_a_ckpt"] = outcome(
        lambda: mp.save(os.path.join(root, "not_a_ckpt"), tree, overwrite=True)
    )
    out["missing"] = outcome(lambda: mp.load(os.path.join(root, "nowhere")))
    out["missing_meta"] = outcome(lambda: mp.metadata(os.path.join(root, "nowhere")))
    out["mismatch"] = outcome(lambda: mp.load(a, {"w": jax.ShapeDtypeStruct((3, 3), np.float32)}))
    failing = os.path.join(root, "stage_fails")
    undo = inject(
        workers,
        "start_save",
        lambda plan, *_: INDEX == 2 and plan.store.directory.startswith(failing),
        RuntimeError("injected staging failure"),
    )
    out["stage_fails"] = outcome(lambda: mp.save(failing, tree))
    undo()
    failing = os.path.join(root, "commit_fails")
    undo = inject(
        _checkpoint,
        "commit",
        lambda tmp, final, *_: str(final) == failing,
        OSError("injected commit failure"),
    )
    out["commit_fails"] = outcome(lambda: mp.save(failing, tree))
    undo()
    # failures of the primary alone reach the others at once
    failing = os.path.join(root, "controller_stage_fails")
    undo = inject(
        workers,
        "start_save",
        lambda plan, *_: (
            plan.process_index == "controller" and plan.store.directory.startswith(failing)
        ),
        RuntimeError("injected controller staging failure"),
    )
    out["controller_stage_fails"] = outcome(lambda: mp.save(failing, tree))
    undo()
    failing = os.path.join(root, "controller_write_fails")
    undo = inject(
        workers.PendingSave,
        "wait",
        lambda self, *_, **__: (
            self._plan.process_index == "controller"
            and self._plan.store.directory.startswith(failing)
        ),
        OSError("injected controller write failure"),
    )
    out["controller_write_fails"] = outcome(lambda: mp.save(failing, tree))
    undo()
    out["stateful_fails"] = outcome(
        lambda: mp.save_checkpointables(
            os.path.join(root, "stateful_fails"), {"state": tree, "it": FailingIterator()}
        )
    )
    undo = inject(
        workers,
        "load",
        lambda plan, *_: INDEX == 3 and any(t.name == "w" for t in plan.tasks),
        ValueError("injected read failure"),
    )
    out["load_fails"] = outcome(lambda: mp.load(a, resharded_abstract(mesh_b())))
    undo()
    out["committed"] = sorted(p for p in os.listdir(root) if not p.startswith("."))
    out["after_failures"] = check(mp.load(b, resharded_abstract(mesh_b())))  # the job still works

    # another primary: the last process writes metadata and commits
    set_primary_process(COUNT - 1)
    group = mp._hosts.host_group_for([])
    assert isinstance(group, MultiControllerHostGroup)
    out["is_primary"] = group.is_primary()
    mp.save(os.path.join(root, "last_primary"), tree)
    out["checked_last_primary"] = check(
        mp.load(os.path.join(root, "last_primary"), resharded_abstract(mesh_b()))
    )
    set_primary_process(0)
    return out


def die(root: str, victim: str, primary: str, timeout: str) -> dict:
    """Process ``victim`` is killed while its shards are being written; the others must fail."""
    set_primary_process(int(primary))
    tree = make_tree(mesh_a())
    if INDEX == int(victim):

        def wait_then_die(self: Any, timeout: float | None = None) -> Any:
            print(json.dumps({"process": INDEX, "died": True}), flush=True)
            os.kill(os.getpid(), 9)

        workers.PendingSave.wait = wait_then_die  # type: ignore[method-assign]
    with mp.Context(async_=mp.AsyncOptions(timeout_secs=float(timeout))):
        out = outcome(lambda: mp.save(os.path.join(root, "dead"), tree))
    out["committed"] = os.path.exists(os.path.join(root, "dead"))
    print(json.dumps(out), flush=True)
    os._exit(0)  # the job is broken: skip jax.distributed's shutdown barrier


def absent(root: str, timeout: str) -> dict:
    """Only process 0 calls save (a common mistake): it must fail, naming the others, in time."""
    tree = make_tree(mesh_a())
    out: dict = {}
    if INDEX == 0:
        with mp.Context(async_=mp.AsyncOptions(timeout_secs=float(timeout))):
            out = outcome(lambda: mp.save(os.path.join(root, "lonely"), tree))
        out["committed"] = os.path.exists(os.path.join(root, "lonely"))
    return out


def object_store(url: str) -> dict:
    """2 processes, a bucket: save (sync and async) and load resharded, a Checkpointer with
    retention; memory:// is refused (the other process cannot reach this one's memory)."""
    from milepost.training import Checkpointer, KeepLatest

    out: dict = {}
    tree = make_tree(mesh_a())
    mp.save(f"{url}/c", tree)
    out["checked_same"] = check(mp.load(f"{url}/c"), {k: tree[k].sharding for k in SHAPES})
    mp.save_async(f"{url}/d", tree).result(120)
    out["checked_resharded"] = check(mp.load(f"{url}/d", resharded_abstract(mesh_b())))
    with Checkpointer(f"{url}/run", keep=KeepLatest(n=2)) as ckpt:
        for step in range(4):
            ckpt.save_checkpointables(step, {"state": tree, "data": {"step": step}})
        ckpt.wait()
        out["ckpt_steps"] = ckpt.steps
    with Checkpointer(f"{url}/run", read_only=True) as reader:
        latest = reader.load_checkpointables(
            None, {"state": resharded_abstract(mesh_b()), "data": None}
        )
        out["ckpt_latest"] = [reader.latest, latest["data"]["step"], check(latest["state"])]
    out["memory_save"] = outcome(lambda: mp.save("memory://mc/1", tree))
    out["memory_load"] = outcome(lambda: mp.load("memory://mc/1", resharded_abstract(mesh_b())))
    out["memory_checkpointer"] = outcome(lambda: Checkpointer("memory://mc/run"))
    return out


def damaged(path: str) -> dict:
    """Load a checkpoint whose chunk w/c/1/2 has a flipped byte (one process reads that chunk):
    what each process raised, as data."""
    abstract = {
        "w": jax.ShapeDtypeStruct(
            (64, 128), np.float32, sharding=NamedSharding(mesh_a(), P("data", "model"))
        )
    }
    try:
        mp.load(path, abstract, partial=True)
    except Exception as e:
        chunk = getattr(e, "chunk", None)
        return {
            "damaged": {
                "type": type(e).__name__,
                "corrupt": isinstance(e, mp.CorruptCheckpointError),
                "array": getattr(e, "array", None),
                "chunk": list(chunk) if chunk is not None else None,
                "path": getattr(e, "path", None),
                "message": str(e),
            }
        }
    return {"damaged": None}


SCENARIOS: dict[str, Callable[..., dict]] = {
    "two_save": two_save,
    "four": four,
    "load": lambda root, *paths: _load(paths),
    "load_and_damaged": lambda root, damaged_path, *paths: {
        **_load(paths),
        **damaged(damaged_path),
    },
    "die": die,
    "absent": absent,
    "object_store": object_store,
}


def _load(paths: tuple[str, ...]) -> dict:
    out: dict = {}
    load_each(out, list(paths))
    return out


def main() -> dict:
    out: dict = {
        "process": INDEX,
        "global_devices": len(jax.devices()),
        "device_ids": [d.id for d in jax.local_devices()],
    }
    out.update(SCENARIOS[SCENARIO](*ARGS))
    return out


if __name__ == "__main__":
    try:
        result = main()
    except Exception:
        result = {"process": INDEX, "exception": traceback.format_exc()}
    print(json.dumps(result), flush=True)
    jax.distributed.shutdown()
