"""A small deterministic training loop used by the resume and crash tests.

Run as a script: ``python -m tests._train_loop ROOT STEPS [--every N] [--kill-at PHASE:NTH:DELAY]``.
It resumes from the latest committed step under ROOT, prints ``saved <step>`` after each save
call and ``done <digest of the final state>`` at the end. ``--kill-at`` makes the process
SIGKILL itself ``DELAY`` seconds after the NTH time it reaches PHASE (see :data:`PHASES`).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import milepost.workers
from milepost._checkpoint import _save as _checkpoint_save
from milepost._storage import _workspace
from milepost.training import Checkpointer, FixedInterval, KeepLatest
from milepost.workers import format as fmt

SHAPE = (256, 128)

PHASES = ("d2h", "write", "merge", "commit", "renamed", "gc", "saved")
"""Where a kill can be aimed: entering the device-to-host copy; the hosts' background writes
just started; entering the OCDBT merge; entering the commit (metadata, marker, fsync, rename);
right after the rename that made a step visible; right after retention renamed a step away
(before removing it); and after ``save`` returned (training on while the step is written)."""


class DataIterator:
    """Batches derived from a position; saves and restores the position itself."""

    def __init__(self, position: int = 0) -> None:
        self.position = position

    def next(self) -> np.ndarray:
        batch = np.random.default_rng(self.position).standard_normal(SHAPE, dtype=np.float32)
        self.position += 1
        return batch

    def save(self, directory: Path) -> Callable[[], None]:
        position = self.position
        return lambda: fmt.write_json(directory / "position.json", {"position": position})

    def load(self, directory: Path) -> None:
        self.position = json.loads((directory / "position.json").read_text())["position"]


def initial_state(mesh: jax.sharding.Mesh) -> dict[str, Any]:
    s = NamedSharding(mesh, P("data", "model"))
    w = jax.device_put(np.linspace(-1, 1, SHAPE[0] * SHAPE[1], dtype=np.float32).reshape(SHAPE), s)
    return {
        "params": {
            "w": w,
            "b": jax.device_put(np.zeros(SHAPE[1], np.float32), NamedSharding(mesh, P("model"))),
        },
        "opt": {
            "momentum": {
                "w": jax.device_put(np.zeros(SHAPE, np.float32), s),
                "b": jax.device_put(
                    np.zeros(SHAPE[1], np.float32), NamedSharding(mesh, P("model"))
                ),
            }
        },
        "step": 0,
        "rng": jax.device_put(jax.random.key_data(jax.random.key(0)), NamedSharding(mesh, P())),
    }


@jax.jit
def _update(state: dict[str, Any], batch: jax.Array) -> dict[str, Any]:
    """Momentum SGD on a noisy quadratic (written by hand)."""
    key, sub = jax.random.split(jax.random.wrap_key_data(state["rng"]))
    params, momentum = state["params"], state["opt"]["momentum"]
    grads = {
        "w": 0.01 * params["w"] + batch + 1e-3 * jax.random.normal(sub, SHAPE),
        "b": 0.01 * params["b"] + batch.mean(axis=0),
    }
    momentum = jax.tree_util.tree_map(lambda m, g: 0.9 * m + g, momentum, grads)
    params = jax.tree_util.tree_map(lambda p, m: p - 0.01 * m, params, momentum)
    return {"params": params, "opt": {"momentum": momentum}, "rng": jax.random.key_data(key)}


def train_step(state: dict[str, Any], data: DataIterator) -> dict[str, Any]:
    new = _update({k: v for k, v in state.items() if k != "step"}, jnp.asarray(data.next()))
    new["step"] = state["step"] + 1
    return new


def digest(state: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(state):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()


def abstract_like(state: dict[str, Any]) -> dict[str, Any]:
    return jax.tree_util.tree_map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            if isinstance(x, jax.Array)
            else x
        ),
        state,
    )


def run(
    root: str | Path,
    steps: int,
    every: int = 1,
    on_save: Callable[[int], None] | None = None,
    interrupt_after: int | None = None,
) -> dict[str, Any]:
    """Train to ``steps`` saving every ``every`` steps, resuming from the latest checkpoint.
    ``interrupt_after=k`` raises KeyboardInterrupt after step k (an interruption)."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    state = initial_state(mesh)
    data = DataIterator()
    with Checkpointer(
        root, save_policy=FixedInterval(interval=every), keep=KeepLatest(n=2)
    ) as ckpt:
        if ckpt.latest is not None:
            state = ckpt.load_checkpointables(None, {"state": abstract_like(state), "data": data})[
                "state"
            ]
        while state["step"] < steps:
            state = train_step(state, data)
            if ckpt.save_checkpointables(state["step"], {"state": state, "data": data}) and on_save:
                on_save(state["step"])
            if interrupt_after is not None and state["step"] >= interrupt_after:
                raise KeyboardInterrupt(f"interrupted after step {state['step']}")
    return state


def state_at(step: int) -> dict[str, Any]:
    """The state after ``step`` steps of an uninterrupted run (no checkpoints)."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    state = initial_state(mesh)
    data = DataIterator()
    while state["step"] < step:
        state = train_step(state, data)
    return state


# -- kill points -------------------------------------------------------------------------------


def _kill(delay: float) -> None:
    if delay <= 0:
        os.kill(os.getpid(), signal.SIGKILL)
    timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL))
    timer.daemon = True
    timer.start()


def arm(phase: str, nth: int, delay: float) -> Callable[[int], None]:
    """Patch the save path so that the NTH arrival at ``phase`` SIGKILLs this process after
    ``delay`` seconds; returns the ``on_save`` callback (used by the "saved" phase)."""
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}; one of {PHASES}")
    seen = {p: 0 for p in PHASES}

    def reached(p: str) -> None:
        seen[p] += 1
        if p == phase and seen[p] == nth:
            _kill(delay)

    real_start, real_merge, real_commit, real_rename, real_rename_new = (
        milepost.workers.start_save,
        milepost.workers.format.merge_ocdbt,
        _checkpoint_save.commit,
        os.rename,
        _workspace.rename_new,
    )

    def start_save(*a: Any, **k: Any) -> Any:
        reached("d2h")
        pending = real_start(*a, **k)
        reached("write")
        return pending

    def merge(*a: Any, **k: Any) -> Any:
        reached("merge")
        return real_merge(*a, **k)

    def commit(*a: Any, **k: Any) -> Any:
        reached("commit")
        return real_commit(*a, **k)

    def rename(src: Any, dst: Any, *a: Any, **k: Any) -> None:
        real_rename(src, dst, *a, **k)
        if str(dst).endswith(".milepost-deleting"):
            reached("gc")

    def rename_new(src: Any, dst: Any) -> None:  # the commit's rename of the temporary directory
        real_rename_new(src, dst)
        reached("renamed")

    milepost.workers.start_save = start_save  # type: ignore[assignment]
    milepost.workers.format.merge_ocdbt = merge  # type: ignore[assignment]
    _checkpoint_save.commit = commit  # type: ignore[assignment]
    os.rename = rename  # type: ignore[assignment]
    _workspace.rename_new = rename_new  # type: ignore[assignment]
    return lambda step: reached("saved")


if __name__ == "__main__":
    argv = sys.argv[1:]
    every = int(argv[argv.index("--every") + 1]) if "--every" in argv else 1
    hook: Callable[[int], None] | None = None
    if "--kill-at" in argv:
        phase, nth, delay = argv[argv.index("--kill-at") + 1].split(":")
        hook = arm(phase, int(nth), float(delay))

    def on_save(step: int) -> None:
        print(f"saved {step}", flush=True)
        if hook:
            hook(step)

    final = run(argv[0], int(argv[1]), every, on_save=on_save)
    print(f"done {digest(final)}", flush=True)
