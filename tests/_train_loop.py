"""A small deterministic training loop used by the resume and crash tests.

Run as a script: ``python -m tests._train_loop ROOT STEPS [--every N]``; it resumes from the
latest committed step under ROOT, prints ``saved <step>`` after each save call and ``done`` with
a digest of the parameters at the end.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from milepost.training import Checkpointer, FixedInterval, KeepLatest

SHAPE = (256, 128)


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
        return lambda: (directory / "position.json").write_text(json.dumps({"position": position}))

    def load(self, directory: Path) -> None:
        self.position = json.loads((directory / "position.json").read_text())["position"]


def initial_state(mesh: jax.sharding.Mesh) -> dict[str, Any]:
    s = NamedSharding(mesh, P("data", "model"))
    w = jax.device_put(np.linspace(-1, 1, SHAPE[0] * SHAPE[1], dtype=np.float32).reshape(SHAPE), s)
    return {
        "params": {"w": w},
        "opt": {"momentum": jax.device_put(np.zeros(SHAPE, np.float32), s)},
        "step": 0,
        "rng": jax.device_put(jax.random.key_data(jax.random.key(0)), NamedSharding(mesh, P())),
    }


@jax.jit
def train_step(state: dict[str, Any], batch: jax.Array) -> dict[str, Any]:
    key, sub = jax.random.split(jax.random.wrap_key_data(state["rng"]))
    grad = 0.01 * state["params"]["w"] + batch + 1e-3 * jax.random.normal(sub, SHAPE)
    momentum = 0.9 * state["opt"]["momentum"] + grad
    return {
        "params": {"w": state["params"]["w"] - 0.01 * momentum},
        "opt": {"momentum": momentum},
        "step": state["step"] + 1,
        "rng": jax.random.key_data(key),
    }


def digest(state: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(state):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()


def abstract_like(state: dict[str, Any]) -> dict[str, Any]:
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x, state
    )


def run(root: str, steps: int, every: int = 1, on_save: Callable[[int], None] | None = None) -> dict[str, Any]:
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    state = initial_state(mesh)
    data = DataIterator()
    with Checkpointer(root, save_policy=FixedInterval(interval=every), keep=KeepLatest(n=2)) as ckpt:
        if ckpt.latest is not None:
            loaded = ckpt.load_checkpointables(None, {"state": abstract_like(state), "data": data})
            state = loaded["state"]
        while state["step"] < steps:
            state = train_step(state, jnp.asarray(data.next()))
            state["step"] = int(state["step"])
            if ckpt.save_checkpointables(state["step"], {"state": state, "data": data}):
                if on_save:
                    on_save(state["step"])
    return state


def state_at(step: int) -> dict[str, Any]:
    """The state after ``step`` steps of an uninterrupted run (no checkpoints)."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    state = initial_state(mesh)
    data = DataIterator()
    while state["step"] < step:
        state = train_step(state, jnp.asarray(data.next()))
        state["step"] = int(state["step"])
    return state


if __name__ == "__main__":
    every = int(sys.argv[sys.argv.index("--every") + 1]) if "--every" in sys.argv else 1
    final = run(sys.argv[1], int(sys.argv[2]), every, on_save=lambda s: print(f"saved {s}", flush=True))
    print(f"done {digest(final)}", flush=True)
