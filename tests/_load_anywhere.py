"""A process with fewer devices loading checkpoints without an abstract tree, for
tests/test_load_anywhere.py.

Run as a script: ``python -m tests._load_anywhere PATHS NPZ`` (PATHS: a JSON object of tag ->
checkpoint path). It loads each, saves every array's values in NPZ (by ``tag/leaf path``), and
prints ``RESULT`` and a JSON object: each array's sharding as described here, and per tag
(``tag:log``) the milepost log lines that say where it placed what (``loading ...``).
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import jax
import numpy as np

import milepost as mp


class Keep(logging.Handler):
    """Keeps every message logged to it."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def described(x: jax.Array) -> dict[str, Any]:
    s = x.sharding
    if isinstance(s, jax.sharding.NamedSharding):
        return {
            "mesh": dict(s.mesh.shape),
            "spec": [list(e) if isinstance(e, tuple) else e for e in s.spec],
            "ids": [d.id for d in s.mesh.devices.flat],
            "memory": s.memory_kind,
        }
    return {"device": next(iter(s.device_set)).id}


def data(x: jax.Array) -> np.ndarray:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x).astype(np.float32) if x.dtype.name == "bfloat16" else np.asarray(x)


def main(paths: dict[str, str], npz: str) -> None:
    keep = Keep()
    logging.getLogger("milepost").addHandler(keep)
    logging.getLogger("milepost").setLevel(logging.INFO)
    out: dict[str, Any] = {}
    arrays: dict[str, np.ndarray] = {}
    for tag, path in paths.items():
        loaded = mp.load(path)
        for keys, x in jax.tree_util.tree_flatten_with_path(loaded)[0]:
            name = tag + "/" + "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keys)
            if isinstance(x, jax.Array):
                out[name] = described(x)
                arrays[name] = data(x)
        out[tag + ":log"] = [line for line in keep.lines if line.startswith("loading ")]
        keep.lines.clear()
    np.savez(npz, **arrays)  # type: ignore[arg-type]
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), sys.argv[2])
