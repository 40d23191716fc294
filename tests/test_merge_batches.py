"""The commit's merge with TensorStore, in key ranges (issue 26): with many databases the root
view is built a range of keys at a time, so the merge's memory is that of one range; every key
lands once. (The commit writes the root view itself first, ``format._ocdbt_merge``; this path is
what it falls back to for databases it does not read.)"""

from __future__ import annotations

import itertools
from pathlib import Path

import jax
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost.workers.format import _tensorstore as tsu
from milepost.workers.format._ocdbt_format import FormatError
from tests._helpers import abstract_of, assert_tree_equal, put


def keys_of(path: Path) -> list[bytes]:
    return sorted(ts.KvStore.open(tsu.ocdbt_kvstore(str(path / "state"))).result().list().result())


@pytest.mark.parametrize("writers", [1, 3])
def test_a_merge_in_key_ranges_gives_the_same_root_view(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch, writers: int
) -> None:
    rng = np.random.default_rng(7)
    state = {
        f"layer{i:02d}": {
            "w": put(rng.standard_normal((32, 64), dtype=np.float32), mesh24, P("data", "model")),
            "b": put(rng.standard_normal((64,), dtype=np.float32), mesh24, P()),
        }
        for i in range(12)
    }
    options = mp.SaveOptions(ocdbt_writers_per_host=writers)
    with mp.Context(saving=options):
        mp.save(tmp_path / "one", state)
    ranges: list[tuple[bytes, bytes]] = []
    real = ts.KvStore.KeyRange

    def key_range(low: bytes, high: bytes) -> object:
        ranges.append((low, high))
        return real(low, high)

    def refuse(*args: object) -> None:
        raise FormatError("(the test asks for TensorStore's merge)")

    monkeypatch.setattr(tsu._ocdbt_merge, "write_root", refuse)
    monkeypatch.setattr(tsu, "MERGE_BATCH_KEYS", 16)  # a handful of keys per range
    monkeypatch.setattr(tsu.ts.KvStore, "KeyRange", key_range)
    with mp.Context(saving=options):
        mp.save(tmp_path / "ranges", state)
    monkeypatch.undo()
    assert len(ranges) > 4, ranges
    # the ranges cut the key space in order, from the first key to the last
    assert ranges[0][0] == b"" and ranges[-1][1] == b""
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in itertools.pairwise(ranges))
    assert keys_of(tmp_path / "ranges") == keys_of(tmp_path / "one")
    for path in ("one", "ranges"):
        assert_tree_equal(mp.load(tmp_path / path, abstract_of(state)), state)
    assert mp.verify(tmp_path / "ranges").ok
