"""Multi-controller JAX on an object store: 2 real jax.distributed processes on localhost (they
inherit the S3 variables the fixture set) save into moto's S3 server and load back, run a
Checkpointer with retention there, and refuse memory://, all in one job (tests/_mc_worker.py,
scenario ``object_store``)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import milepost as mp
from tests import _mc
from tests._helpers import same_bits
from tests._object_stores import new_s3_bucket

# 2 processes x 4 devices: each checks 4 addressable shards of each of the 3 arrays.
SHARDS = 12


def test_two_processes_save_load_and_keep_steps_on_s3(s3_endpoint: tuple[str, Any]) -> None:
    from milepost import workers as _paths

    url = f"s3://{new_s3_bucket(s3_endpoint[0])}/mc"
    results = _mc.launch("object_store", 2, 4, url)
    for r in results:
        assert r.returncode == 0 and "exception" not in r.out, (
            f"process failed:\n{r.out.get('exception')}\n{r.stderr}"
        )
    outs = [r.out for r in results]
    assert [o["process"] for o in outs] == [0, 1]
    for o in outs:
        assert o["checked_same"] == o["checked_resharded"] == SHARDS, o
        assert o["ckpt_steps"] == [2, 3] and o["ckpt_latest"] == [3, 3, SHARDS], o
        for key in ("memory_save", "memory_load", "memory_checkpointer"):
            error = o[key]["error"]
            assert (
                error is not None
                and error.startswith("ValueError: memory://mc/")
                and "cannot reach it" in error
            ), (key, error)
    names = _paths.as_path(url).keys()
    assert sorted({n.split("/")[0] for n in names}) == ["c", "d", "run"]
    assert sorted({n.split("/")[1] for n in names if n.startswith("run/")}) == [
        "2",
        "3",
    ]  # retention deleted 0 and 1
    writers = {
        n.split("/")[2].split(".")[1] for n in names if n.startswith("c/state/ocdbt.process_")
    }
    assert writers == {
        "process_0",
        "process_1",
        "process_controller",
    }  # each process wrote its own shards
    assert not any("milepost-lease" in n for n in names)
    # and this process (the embedded mode, 8 local devices) reads what the two wrote
    mesh = jax.make_mesh((8,), ("z",))
    abstract: dict = {
        k: jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=NamedSharding(mesh, P("z")))
        for k, (shape, dtype) in _mc.SHAPES.items()
    }
    abstract.update(step=0, note="", host=np.zeros(5, np.int64))
    out = mp.load(f"{url}/c", abstract)
    for k, (shape, dtype) in _mc.SHAPES.items():
        assert same_bits(out[k], _mc.global_value(k, shape, dtype)), k
    assert out["step"] == 7 and out["note"] == "mc" and same_bits(out["host"], np.arange(5))
