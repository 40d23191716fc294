"""The Checkpointer in a multi-controller JAX job: ``launch`` starts N processes on localhost,
each running this module (``python -m tests._training_mc SCENARIO INDEX COUNT PORT ROOT``),
and returns the JSON line each printed."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from tests import _mc

ROOT = Path(__file__).resolve().parents[1]
SHAPE = (16, 32)


def launch(
    scenario: str, root: Path, processes: int = 2, devices: int = 4, timeout: float = 240
) -> list[dict]:
    outs = []
    for r in _mc.launch(
        scenario, processes, devices, str(root), timeout=timeout, module="tests._training_mc"
    ):
        assert r.returncode == 0 and "exception" not in r.out, (
            f"process failed:\n{r.out.get('exception')}\n{r.stderr}"
        )
        outs.append(r.out)
    return outs


def value(step: int) -> Any:
    import numpy as np

    return (np.arange(SHAPE[0] * SHAPE[1], dtype=np.float32).reshape(SHAPE) + 1000 * step).astype(
        np.float32
    )


def main(scenario: str, index: int, count: int, port: int, root: str) -> dict:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=count, process_id=index)
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from milepost.training import AnyOf, Checkpointer, FixedInterval, KeepLatest, Preemption

    mesh = jax.make_mesh((2, len(jax.devices()) // 2), ("data", "model"))
    sharding = NamedSharding(mesh, P("data", "model"))

    def state(step: int) -> dict:
        g = value(step)
        return {
            "w": jax.make_array_from_callback(SHAPE, sharding, lambda idx: g[idx]),
            "step": step,
        }

    def exact(tree: dict, step: int) -> int:
        n = 0
        for shard in tree["w"].addressable_shards:
            assert np.array_equal(np.asarray(shard.data), value(step)[shard.index]), (
                step,
                shard.index,
            )
            n += 1
        assert tree["step"] == step
        return n

    out: dict[str, Any] = {"process": index}
    if scenario == "user_signal":
        # the primary alone gets SIGUSR1 before step 6: every process saves step 6
        policy = AnyOf(FixedInterval(interval=4), Preemption(signals=(signal.SIGUSR1,)))
        with Checkpointer(root, save_policy=policy, keep=KeepLatest(n=2)) as ckpt:
            saved = []
            for step in range(10):
                if step == 6 and index == 0:
                    signal.raise_signal(signal.SIGUSR1)
                if ckpt.save(step, state(step), metrics={"loss": float(step)}):
                    saved.append(step)
            ckpt.wait()
            out.update(saved=saved, steps=ckpt.steps, preempted=ckpt.preempted)
        with Checkpointer(root, keep=KeepLatest(n=2)) as again:  # resume
            out["latest"] = again.latest
            out["exact"] = exact(
                again.load(
                    None,
                    {"w": jax.ShapeDtypeStruct(SHAPE, np.float32, sharding=sharding), "step": 0},
                ),
                again.latest,
            )
            again.delete(6)
            out["after_delete"] = again.steps
        out["on_disk"] = sorted(os.listdir(root))
    elif scenario == "sigterm":
        # only the last process is told (SIGTERM): JAX's preemption service makes every process
        # save at the same step, and stop there
        policy = AnyOf(FixedInterval(interval=1000), Preemption())
        with Checkpointer(root, save_policy=policy) as ckpt:
            saved, stopped = [], None
            for step in range(1, 3000):
                if step == 3 and index == count - 1:
                    os.kill(os.getpid(), signal.SIGTERM)
                if ckpt.save(step, state(step)):
                    saved.append(step)
                if ckpt.preempted:
                    stopped = step
                    break
                time.sleep(0.005)
            ckpt.wait()
            out.update(saved=saved, stopped=stopped, steps=ckpt.steps)
            if ckpt.latest is not None:
                out["exact"] = exact(ckpt.load(), ckpt.latest)
    elif scenario == "tiered":
        # a local tier: every process commits locally, then all mirror together to root
        local = f"{root}-local"
        with Checkpointer(
            root, local=local, keep=KeepLatest(n=3), local_keep=KeepLatest(n=1)
        ) as ckpt:
            for step in range(4):
                ckpt.save(step, state(step))
            ckpt.wait()
            out.update(steps=ckpt.steps, durable=ckpt.durable_steps, exact=exact(ckpt.load(), 3))
        with Checkpointer(root, read_only=True) as durable:
            out["exact_durable"] = exact(durable.load(1), 1)
        out["on_disk"] = sorted(os.listdir(root))
        out["local_on_disk"] = sorted(os.listdir(local))
    elif scenario == "data_iter":
        # every process feeds its own shard of the data: each saves and restores its own
        # iterator with the step (process_<i>-of-<n>.json)
        import grain

        def batches() -> Any:
            data = grain.MapDataset.range(64).shuffle(seed=7).batch(2)
            shard = data[index::count]
            return iter(shard.to_iter_dataset(grain.ReadOptions(num_threads=0)))

        it = batches()
        with Checkpointer(root) as ckpt:
            for step in range(3):
                next(it)
                ckpt.save(step, state(step), data_iter=it)
            ckpt.wait()
        expected = [next(it).tolist() for _ in range(4)]  # the uninterrupted run goes on
        with Checkpointer(root) as again:
            fresh = batches()
            abstract = {"w": jax.ShapeDtypeStruct(SHAPE, np.float32, sharding=sharding), "step": 0}
            out["exact"] = exact(again.load(None, abstract, data_iter=fresh), 2)
            out["resumed"] = [next(fresh).tolist() for _ in range(4)]
        out["expected"] = expected
        out["files"] = sorted(os.listdir(Path(root) / "2" / "data_iter"))
    elif scenario in ("peers_save", "peers_recover"):
        # a peer tier: two processes per node (n0, n1), each part copied to the other node
        import milepost as mp
        from milepost.training import PeerTier

        tier = PeerTier(
            copies=1, path=f"{root}-shm/{{node}}", node=f"n{index // 2}", keep_on_close=True
        )
        with Checkpointer(root, save_policy=FixedInterval(interval=2), peers=tier) as ckpt:
            if scenario == "peers_save":
                for step in (1, 2, 3):
                    ckpt.save(step, state(step))
                ckpt.wait()
                out["steps"] = ckpt.steps
            else:  # the job restarted, node n1 replaced (its folder gone)
                abstract = {
                    "w": jax.ShapeDtypeStruct(SHAPE, np.float32, sharding=sharding),
                    "step": 0,
                }
                r = ckpt.recover(abstract_state=abstract)
                out.update(step=r.step, tier=r.tier, moved=r.bytes_by_source, notes=list(r.notes))
                out["exact"] = exact(r.state, r.step)
                stats = mp.io_stats()  # this job's counters: the recovery's bytes only
                out["io"] = [stats.bytes_read, [h.bytes_received for h in stats.hosts]]
                ckpt.save(4, state(4))  # and the tier goes on
                ckpt.wait()
    else:
        raise ValueError(f"unknown scenario {scenario}")
    return out


if __name__ == "__main__":
    scenario, index, count, port, root = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        int(sys.argv[4]),
        sys.argv[5],
    )
    try:
        result = main(scenario, index, count, port, root)
    except Exception:
        result = {"process": index, "exception": traceback.format_exc()}
    print(json.dumps(result), flush=True)
