"""The Checkpointer on a single-controller Ray slice: the same code, arrays stay on the hosts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost.training import Checkpointer, FixedInterval, KeepLatest

pytestmark = pytest.mark.usefixtures("ray_runtime")


def test_a_training_loop_on_a_slice_saves_keeps_and_resumes(tmp_path: Path) -> None:
    values = {s: np.arange(32 * 16, dtype=np.float32).reshape(32, 16) + 1000 * s for s in range(6)}
    root = tmp_path / "run"
    with mp.Slice.start(hosts=2, devices_per_host=2) as s:
        mesh = s.mesh({"data": 2, "model": 2})
        sharding = mesh.sharding(P("data", "model"))
        with Checkpointer(
            root, save_policy=FixedInterval(interval=2), keep=KeepLatest(n=2)
        ) as ckpt:
            for step in range(6):
                state: dict[str, Any] = {"w": s.put(values[step], sharding), "step": step}
                ckpt.save_checkpointables(step, {"state": state, "data": {"position": step}})
            ckpt.wait()
            assert ckpt.steps == [2, 4] and sorted(p.name for p in root.iterdir()) == ["2", "4"]
        with Checkpointer(root) as again:
            abstract = {
                "w": mp.AbstractArray((32, 16), np.float32, mesh.sharding(P("model"))),
                "step": 0,
            }
            out = again.load_checkpointables(None, {"state": abstract, "data": None})
            assert isinstance(out["state"]["w"], mp.RemoteArray) and out["state"]["step"] == 4
            assert np.array_equal(s.fetch(out["state"]["w"]), values[4]) and out["data"] == {
                "position": 4
            }
