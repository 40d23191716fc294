"""Where a load finds its chunks (``workers.format._ocdbt_index``, ``workers.load._locator``, issue
26): the B-tree walk that decodes nodes as NumPy columns finds exactly what TensorStore's walk
finds, in trees of one leaf, of several levels with key prefixes, and in the root views
milepost's commit writes; what it does not read is walked by TensorStore; a value naming a file
outside the checkpoint is refused and that file never opened."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import tensorstore as ts

import milepost as mp
from milepost.workers._errors import CorruptCheckpointError
from milepost.workers.format import _ocdbt_format as fmt
from milepost.workers.format import _ocdbt_index
from milepost.workers.format import _tensorstore as tsu
from milepost.workers.format._ocdbt_index import Prefixes
from milepost.workers.format._ts_internals import ocdbt_values
from milepost.workers.load._locator import Locator
from tests._helpers import warnings_logged
from tests.test_ocdbt_merge import crafted, database, hosts, write_manifest


def numpy_walk(folder: Path, names: list[str]) -> dict[bytes, tuple[str, int, int]]:
    kv = ts.KvStore.open({"driver": "file", "path": f"{folder}/"}).result()
    wanted = Prefixes(f"{n}/".encode() for n in names).sorted
    found = _ocdbt_index.indirect_values(kv, wanted, str(folder))
    out = {}
    for part in found.parts:
        for i, key in enumerate(part.keys.tolist()):
            path = found.paths[part.files[i]]
            out[key] = (os.path.join(folder, path), int(part.offsets[i]), int(part.lengths[i]))
            assert found.find([key]) == [(path, part.offsets[i], part.lengths[i])]
            assert key.startswith(wanted[part.groups[i]])
    return out


def tensorstore_walk(folder: Path, names: list[str]) -> dict[bytes, tuple[str, int, int]]:
    wanted = Prefixes(f"{n}/".encode() for n in names)
    return {
        key: (value.path, value.offset, value.length)
        for key, value in ocdbt_values(str(folder), wanted)
    }


def assert_both_walks_agree(folder: Path, names: list[str]) -> int:
    mine, theirs = numpy_walk(folder, names), tensorstore_walk(folder, names)
    assert mine == theirs
    return len(mine)


ARRAYS = [f"params/layer_{a:03d}.kernel" for a in range(40)]


@pytest.mark.parametrize("node_bytes", [0, 2_000])
def test_a_hosts_database_walks_as_tensorstore_walks_it(tmp_path: Path, node_bytes: int) -> None:
    every = hosts(tmp_path, 1, len(ARRAYS), seed=1, node_bytes=node_bytes)
    folder = tmp_path / "ocdbt.process_0"
    if node_bytes:
        assert (
            ts.ocdbt.dump(ts.KvStore.open(f"file://{folder}/").result()).result()["versions"][-1][
                "root_height"
            ]
            > 0
        )
    assert assert_both_walks_agree(folder, ARRAYS) > 0
    for names in (ARRAYS[:1], ARRAYS[5:9], ARRAYS[::7], ["params/layer_0"], ["zzz"]):
        assert_both_walks_agree(folder, names)
    # every value the walk finds is the bytes the database holds under that key
    for key, (path, offset, length) in numpy_walk(folder, ARRAYS).items():
        with open(path, "rb") as f:
            f.seek(offset)
            assert f.read(length) == every[key]


@pytest.mark.parametrize(("root_node_bytes", "arity"), [(8_000_000, 4096), (6_000, 3)])
def test_a_root_view_walks_as_tensorstore_walks_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, root_node_bytes: int, arity: int
) -> None:
    """The commit's root view over several hosts (one leaf; many leaves under interior
    levels whose children carry subtree key prefixes)."""
    from milepost.workers.format import _ocdbt_merge

    monkeypatch.setattr(_ocdbt_merge, "_ARITY", arity)
    every = hosts(tmp_path, 5, len(ARRAYS), seed=2, node_bytes=3_000)
    config = {**tsu.ROOT_OCDBT_CONFIG, "max_decoded_node_bytes": root_node_bytes}
    names = sorted(p.name for p in tmp_path.iterdir())
    _ocdbt_merge.write_root(str(tmp_path), names, config)
    found = assert_both_walks_agree(tmp_path, ARRAYS)
    assert found == sum(1 for k, v in every.items() if b"/c/" in k and len(v) > 1024)
    for names in (ARRAYS[3:4], ARRAYS[10:30:3]):
        assert_both_walks_agree(tmp_path, names)


@pytest.mark.parametrize("dict_keys", [0, 1 << 17])
def test_a_load_finds_its_chunks_with_the_numpy_walk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dict_keys: int
) -> None:
    """A checkpoint milepost writes: the locator answers from NumPy columns (a large index:
    no key by key Python objects) or from a dict (a small one), one key or a box's keys at a
    time, and the file ranges hold the arrays' shard values."""
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from milepost.workers.load import _locator
    from tests._helpers import put

    monkeypatch.setattr(_locator, "_DICT_KEYS", dict_keys)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    state = {
        f"w{i}": put(np.full((64, 64), i, np.float32), mesh, P("data", "model")) for i in range(3)
    }
    mp.save(tmp_path / "c", state)
    directory = str(tmp_path / "c" / "state")
    locator = Locator(mp.workers.StoreSpec(directory=directory, use_ocdbt=True))
    locator.index(["w0", "w2"])
    if dict_keys:
        assert locator._values and not locator._found
    else:
        assert locator._found and not locator._values  # (the NumPy columns answer)
    got = {
        k.decode(): (v.path, v.offset, v.length)
        for k, v in ocdbt_values(directory, Prefixes([b"w0/", b"w2/"]))
    }
    assert len(got) == 16
    for key, (path, offset, length) in got.items():
        where = locator.locate(key)
        assert where is not None and (where.path, where.offset, where.length) == (
            path,
            offset,
            length,
        )
    asked = ["w1/c/0/0", *got, "w0/c/9/9", "", "w0/c/0/0\x00"]
    found = locator.locate_many(asked)
    assert [None if v is None else (v.path, v.offset, v.length) for v in found] == [
        None,
        *got.values(),
        None,
        None,
        None,
    ]
    for name in ("w0", "w2"):
        first = locator.first_location(name)
        assert first == min((p, o) for k, (p, o, _) in got.items() if k.startswith(f"{name}/"))


def test_a_numbered_manifest_is_walked_by_tensorstore(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from milepost.workers.format import _ocdbt_format

    monkeypatch.setattr(_ocdbt_format, "_fell_back", set())  # (the warning as in a fresh process)
    kv = ts.KvStore.open(
        {
            "driver": "ocdbt",
            "base": f"file://{tmp_path}/",
            "config": {**tsu.OCDBT_CONFIG, "manifest_kind": "numbered"},
        }
    ).result()
    value = os.urandom(2000)
    kv["a/c/0"] = value
    with pytest.raises(fmt.FormatError):
        numpy_walk(tmp_path, ["a"])
    with warnings_logged() as lines:
        locator = Locator(mp.workers.StoreSpec(directory=str(tmp_path), use_ocdbt=True))
        locator.index(["a"])
        again = Locator(mp.workers.StoreSpec(directory=str(tmp_path), use_ocdbt=True))
        again.index(["a"])  # (the same reason: said once)
    said = [line for line in lines if "fell back" in line]
    assert len(said) == 1, lines
    assert "OCDBT B-tree walk fell back to TensorStore's ocdbt.dump" in said[0]
    assert f"{tmp_path}: a numbered manifest" in said[0]
    where = locator.locate("a/c/0")
    assert where is not None and locator._values and not locator._found
    assert again.locate("a/c/0") == where
    with open(where.path, "rb") as f:
        f.seek(where.offset)
        assert f.read(where.length) == value


@pytest.mark.parametrize(
    ("node_path", "value_path"),
    [("d/node", "../../outside"), ("../../outside", "d/v"), ("d/node", "/etc/hostname")],
)
def test_a_value_outside_the_checkpoint_is_refused_unopened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, node_path: str, value_path: str
) -> None:
    checkpoint = tmp_path / "ckpt"
    (tmp_path / "outside").write_bytes(b"secret")
    crafted(checkpoint, node_path, value_path)
    opened: list[str] = []
    real_open = os.open

    def spy(path: str, *args: object, **kwargs: object) -> int:
        opened.append(str(path))
        return real_open(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", spy)
    locator = Locator(mp.workers.StoreSpec(directory=str(checkpoint), use_ocdbt=True))
    with pytest.raises(CorruptCheckpointError, match="outside"):
        locator.index(["a"])
    assert not any("outside" in p or p == "/etc/hostname" for p in opened)


def test_a_damaged_node_is_not_read_as_anything(tmp_path: Path) -> None:
    """Bytes flipped in the B-tree: the NumPy walk refuses them (CRC32C), and TensorStore's
    walk, which then runs, says the database is damaged; no range is handed out."""
    database(tmp_path, [{b"a/c/0": os.urandom(3000), b"a/c/1": os.urandom(3000)}])
    nodes = [p for p in (tmp_path / "d").iterdir()]
    for node in nodes:  # (the data file holds the values, then the leaf: flip in the leaf)
        data = bytearray(node.read_bytes())
        data[-10] ^= 0xFF
        node.write_bytes(bytes(data))
    with pytest.raises(fmt.FormatError):
        numpy_walk(tmp_path, ["a"])
    locator = Locator(mp.workers.StoreSpec(directory=str(tmp_path), use_ocdbt=True))
    with pytest.raises(ValueError):
        locator.index(["a"])
    assert locator.locate("a/c/0") is None


@pytest.mark.parametrize("spelling", ["d/node", "d/./node"])
def test_a_btree_reaching_one_node_twice_is_refused(tmp_path: Path, spelling: str) -> None:
    """A crafted interior node whose children all name one leaf (a version's B-tree never
    shares a node): the walk and the merge stop at the second visit instead of reading it again
    and again (a million children could name it)."""
    from milepost.workers.format import _ocdbt_merge

    folder = tmp_path / "ocdbt.process_0"
    crafted(folder, "d/node", "d/v")
    (folder / "d" / "v").write_bytes(b"abcd")
    leaf = (folder / "d" / "node").read_bytes()
    refs = [fmt.Ref("d/node", 0, len(leaf), ""), fmt.Ref(spelling, 0, len(leaf), "")]
    inner = fmt.encode_interior(1, [b"a/c/0", b"a/c/1"], refs, [(1, len(leaf), 4)] * 2, None)
    (folder / "d" / "inner").write_bytes(inner)
    write_manifest(folder, "d/inner", len(inner), height=1, entries=2)
    with pytest.raises(fmt.FormatError, match="twice"):
        numpy_walk(folder, ["a"])
    kv = ts.KvStore.open({"driver": "file", "path": f"{tmp_path}/"}).result()
    with pytest.raises(fmt.FormatError, match="twice"):
        _ocdbt_merge._load_sources(kv, ["ocdbt.process_0"], tmp_path)
