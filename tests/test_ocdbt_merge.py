"""The commit's root OCDBT view, written directly (``workers.format._ocdbt_merge``, issue 26): what
TensorStore reads of it is exactly what the per-process databases hold, whatever the shape of
their B-trees and of the root's; what the writer does not read falls back to TensorStore's merge
with nothing written; a database naming a file outside its folder is refused, never opened."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost.workers._errors import CorruptCheckpointError
from milepost.workers._runtime import RUNTIME
from milepost.workers.format import _ocdbt_format as fmt
from milepost.workers.format import _ocdbt_keys, _ocdbt_merge
from milepost.workers.format import _tensorstore as tsu
from tests._helpers import abstract_of, assert_tree_equal, put, warnings_logged


def database(folder: Path, batches: list[dict[bytes, bytes]], node_bytes: int = 0) -> None:
    """An OCDBT database as a host writes one (each batch one commit: one version)."""
    config = dict(tsu.OCDBT_CONFIG)
    if node_bytes:
        config["max_decoded_node_bytes"] = node_bytes
    kv = ts.KvStore.open(
        {"driver": "ocdbt", "base": f"file://{folder}/", "config": config}
    ).result()
    for batch in batches:
        txn = ts.Transaction()
        for key, value in batch.items():
            kv.with_transaction(txn)[key] = value
        txn.commit_async().result()


def hosts(root: Path, n: int, arrays: int, seed: int, node_bytes: int = 0) -> dict[bytes, bytes]:
    """``n`` hosts' databases under ``root``, each with a chunk of every array (values of 1 B to
    3 KB: some inline in the B-tree, most in data files) in three commits; host 0 also every
    array's header. Returns every key and value."""
    rng = np.random.default_rng(seed)
    every: dict[bytes, bytes] = {}
    for h in range(n):
        batches: list[dict[bytes, bytes]] = [{}, {}, {}]
        for a in range(arrays):
            key = f"params/layer_{a:03d}.kernel/c/{h}/{a % 3}".encode()
            batches[a % 3][key] = rng.bytes(int(rng.integers(1, 3000)))
            if h == 0:
                batches[0][f"params/layer_{a:03d}.kernel/zarr.json".encode()] = b'{"a": %d}' % a
        database(root / f"ocdbt.process_{h}", batches, node_bytes)
        for batch in batches:
            every.update(batch)
    return every


def root_files(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if not p.name.startswith("ocdbt.process_"))


def read_root(root: Path) -> dict[bytes, bytes]:
    kv = ts.KvStore.open(tsu.ocdbt_kvstore(str(root))).result()
    return {key: kv[key] for key in kv.list().result()}


@pytest.mark.parametrize(
    ("host_node_bytes", "root_node_bytes", "arity"),
    [
        (0, 8_000_000, 4096),  # one leaf per host, one root leaf
        (3_000, 8_000_000, 4096),  # hosts' trees with interior nodes
        (3_000, 6_000, 3),  # a root of many leaves under interior levels
    ],
)
def test_the_root_view_holds_every_key_and_value_of_every_database(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    host_node_bytes: int,
    root_node_bytes: int,
    arity: int,
) -> None:
    every = hosts(tmp_path, 6, 120, seed=host_node_bytes + arity, node_bytes=host_node_bytes)
    monkeypatch.setattr(_ocdbt_merge, "_ARITY", arity)
    config = {**tsu.ROOT_OCDBT_CONFIG, "max_decoded_node_bytes": root_node_bytes}
    _ocdbt_merge.write_root(tmp_path, [f"ocdbt.process_{h}" for h in range(6)], config)
    assert read_root(tmp_path) == every
    dump = ts.ocdbt.dump(ts.KvStore.open(f"file://{tmp_path}/").result()).result()
    (version,) = dump["versions"]
    assert version["root"]["statistics"]["num_keys"] == len(every)
    assert (version["root_height"] > 1) == (arity == 3)
    # (milepost's own decoder reads what it wrote: frames that state their decoded size)
    mine = fmt.decode_manifest((tmp_path / "manifest.ocdbt").read_bytes(), "root")
    assert mine.height == version["root_height"] and mine.node is not None
    # a range read walks the interior nodes to the right leaves
    kv = ts.KvStore.open(tsu.ocdbt_kvstore(str(tmp_path))).result()
    low, high = b"params/layer_050", b"params/layer_060"
    assert sorted(kv.list(ts.KvStore.KeyRange(low, high)).result()) == sorted(
        k for k in every if low <= k < high
    )


def test_a_leaf_larger_than_the_node_limit_is_split(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    every = hosts(tmp_path, 3, 60, seed=11)
    monkeypatch.setattr(_ocdbt_merge, "_cuts", lambda m, node_bytes: [0, len(m.order)])
    config = {**tsu.ROOT_OCDBT_CONFIG, "max_decoded_node_bytes": 4_000}
    _ocdbt_merge.write_root(tmp_path, [f"ocdbt.process_{h}" for h in range(3)], config)
    assert read_root(tmp_path) == every
    dump = ts.ocdbt.dump(ts.KvStore.open(f"file://{tmp_path}/").result()).result()
    (version,) = dump["versions"]
    assert version["root_height"] >= 1  # (one leaf asked for, several written)


def test_root_leaves_stay_near_a_mebibyte_and_a_written_database_names_its_files_short(
    tmp_path: Path,
) -> None:
    """Every read through the root (TensorStore's, Orbax's) decodes a whole leaf: the root's
    leaves are ~1 MiB decoded (8x the data file table they repeat, when that is larger), while
    a host's database, read whole by the merge only, is one leaf; its data files are named by
    one short token, so each root leaf's table stays small."""
    names = [f"ocdbt.process_{p}.p" for p in range(4)]
    for p, name in enumerate(names):
        keys = [f"a{k:05d}/c/{p}/0" for k in range(40_000)]
        data = b"".join(k.to_bytes(4, "little") for k in range(40_000))
        _ocdbt_merge.write_database(
            tmp_path / name, [(keys, [4] * len(keys), data)], {**tsu.OCDBT_CONFIG}
        )
        (data_file, _) = sorted(p.name for p in (tmp_path / name / "d").iterdir())
        assert len(data_file) == len("0123abcd.0000")
    _ocdbt_merge.write_root(tmp_path, names, tsu.ROOT_OCDBT_CONFIG)
    kv = ts.KvStore.open(f"file://{tmp_path}/").result()
    hosts = _ocdbt_merge._load_sources(kv, names, tmp_path)
    assert [len(h.leaves) for h in hosts] == [1, 1, 1, 1]
    (root,) = _ocdbt_merge._load_sources(
        ts.KvStore.open(f"file://{tmp_path.parent}/").result(), [tmp_path.name], tmp_path.parent
    )
    sizes = [leaf.size for leaf in root.leaves]
    assert len(sizes) >= 2 and max(sizes) < 1.25 * 2**20, sizes
    view = ts.KvStore.open(tsu.ocdbt_kvstore(str(tmp_path))).result()
    assert view.read("a31415/c/2/0").result().value == (31415).to_bytes(4, "little")


@pytest.mark.parametrize("by_rank", [True, False])
def test_keys_longer_than_the_rows_are_kept_whole_and_sorted_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, by_rank: bool
) -> None:
    """The merge's rows are as wide as all keys but the longest few (a save's longest keys are
    its tables'): those are cut in the rows, kept whole apart, and put in their place among
    keys that share their cut bytes, shorter keys (a key exactly the cut's length) first; the
    keys made rank by rank or in source order."""
    rng = np.random.default_rng(5)
    every: dict[bytes, bytes] = {}
    names = []
    for h in range(4):
        batch = {f"w/c/{h}/{a}".encode(): rng.bytes(40) for a in range(60)}
        batch[f".milepost/chunk_crc32c/ocdbt.process_{h}.p".encode()] = rng.bytes(50)
        batch[f"w/c/{h}/0/and/a/much/longer/name/{h}".encode()] = rng.bytes(30)
        # cut to the same row, in the databases' order the reverse of the keys'
        batch[f"w/c/long/{9 - h}/name".encode()] = rng.bytes(30)
        if h == 3:
            batch[b"w/c/long"] = rng.bytes(10)  # exactly the cut: before every key it starts
        if h == 0:
            batch[b".milepost/chunk_crc32c/ocdb"] = rng.bytes(20)  # a cut key's own length
            batch[b"zz/the/last/and/longest/key/of/all"] = rng.bytes(20)
        database(tmp_path / f"ocdbt.process_{h}", [batch])
        names.append(f"ocdbt.process_{h}")
        every.update(batch)
    widths: list[int] = []
    real = _ocdbt_keys.RankMajor.rebuild

    def rebuild(self: _ocdbt_keys.RankMajor, *args: Any) -> np.ndarray:
        widths.append(args[3])
        return real(self, *args)

    monkeypatch.setattr(_ocdbt_keys.RankMajor, "rebuild", rebuild)
    monkeypatch.setattr(_ocdbt_keys.RankMajor, "nearly_sorted", lambda *_: by_rank)
    monkeypatch.setattr(_ocdbt_merge, "_RANK_SOURCES", 1)
    monkeypatch.setattr(_ocdbt_merge, "_LONG_KEYS", 0.1)
    config = {**tsu.ROOT_OCDBT_CONFIG, "max_decoded_node_bytes": 2_000}  # several leaves
    _ocdbt_merge.write_root(tmp_path, names, config)
    assert widths == [8], widths  # ("w/c/1/38": the longest keys but the few)
    kv = ts.KvStore.open(tsu.ocdbt_kvstore(str(tmp_path))).result()
    assert read_root(tmp_path) == every  # (each key found by its point read: in its place)
    ranges = [(b".milepost/", b".milepost0"), (b"w/c/0/0", b"w/c/0/1"), (b"w/c/long/7", b"x")]
    for low, high in ranges:
        found = kv.list(ts.KvStore.KeyRange(low, high)).result()
        assert sorted(found) == sorted(k for k in every if low <= k < high), (low, high)


@pytest.mark.parametrize("n", [1 << 16, (1 << 16) + 7])
def test_rows_sorted_in_two_halves_sort_as_numpy_sorts_them(n: int) -> None:
    rng = np.random.default_rng(n)
    # short rows from a small alphabet: many ties, and rows that are prefixes of others
    rows = rng.integers(97, 100, size=(n, 5), dtype=np.uint8)
    rows[rng.random(n) < 0.3, 3:] = 0
    view = rows.view("S5").ravel()
    with RUNTIME.scoped("test-sort", 2) as pool:
        got = _ocdbt_merge.sort_rows(view, pool)
    assert np.array_equal(got, np.argsort(view, kind="stable"))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("width", [None, 6])
def test_prefix_coded_keys_rebuild_as_written(threads: int, width: int | None) -> None:
    rng = np.random.default_rng(threads * 10 + (width or 0))
    # several leaves' worth of sorted keys from a small alphabet: shared prefixes of every
    # length, keys that are prefixes of the next, runs longer than a rebuild block
    leaves = []
    for size in [1, 9000, 3, 20000, 700]:
        words = {bytes(rng.integers(97, 100, rng.integers(1, 12), np.uint8)) for _ in range(size)}
        leaves.append(sorted(words))
    keys = [k for leaf in leaves for k in leaf]
    prefix, suffix, raw = [], [], bytearray()
    for leaf in leaves:
        for i, k in enumerate(leaf):
            before = leaf[i - 1] if i else b""
            pairs = enumerate(zip(before, k, strict=False))
            shared = next((j for j, (x, y) in pairs if x != y), min(len(before), len(k)))
            prefix.append(shared)
            suffix.append(len(k) - shared)
            raw += k[shared:]
    with RUNTIME.scoped("test-rebuild", threads) as pool:
        rows = _ocdbt_keys.rebuild_keys(
            np.array(prefix, np.int32),
            np.array(suffix, np.int32),
            np.frombuffer(bytes(raw), np.uint8),
            pool,
            width,
        )
    cut = width or max(map(len, keys))
    assert rows.shape == (len(keys), cut)
    assert [bytes(r).rstrip(b"\0") for r in rows] == [k[:cut] for k in keys]


@pytest.mark.parametrize("block", [7, 1 << 20])
def test_raw_starts_are_the_sums_before_each_row(
    monkeypatch: pytest.MonkeyPatch, block: int
) -> None:
    # (summed in blocks: rows at a block's first and last entries, blocks with no row, a
    # block of several)
    monkeypatch.setattr(_ocdbt_keys, "BLOCK", block)
    suffix = np.random.default_rng(3).integers(0, 50, 100, np.int32)
    before = np.concatenate([[0], np.cumsum(suffix, dtype=np.int64)])
    for rows in [[], [0], [99], [6, 7, 13, 14, 15, 60, 61, 99], list(range(100))]:
        got = _ocdbt_keys.raw_starts(suffix, np.array(rows, np.int64))
        assert got.tolist() == before[rows].tolist()


def rank_major_by_hand(sizes: list[int]) -> list[int]:
    """The source-order rows, rank by rank (sources longest first, in order among equals)."""
    firsts = np.cumsum([0, *sizes])[:-1].tolist()
    by_size = sorted(range(len(sizes)), key=lambda s: -sizes[s])
    return [firsts[s] + r for r in range(max(sizes)) for s in by_size if r < sizes[s]]


@pytest.mark.parametrize(
    "sizes",
    [[5], [3, 3, 3], [2, 0, 7, 7, 1, 0, 4], [0, 9, 2], [1] * 40 + [70, 3]],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_laid_out_by_rank(
    monkeypatch: pytest.MonkeyPatch, sizes: list[int], threads: int
) -> None:
    """Sources of any sizes (empty ones, ranks fewer sources have), laid rank by rank: the
    layout's rows and places are each other's inverse, and its columns (keys' rows and
    numbers) are the source-order columns gathered in that order, whatever the jobs' size."""
    monkeypatch.setattr(_ocdbt_keys, "_LAY_BLOCK", 4)  # (jobs of a rank or two: many)
    layout = _ocdbt_keys.RankMajor(sizes)
    n = sum(sizes)
    expected = rank_major_by_hand(sizes)
    assert layout.rows(np.arange(n)).tolist() == expected
    assert layout.places(np.array(expected, np.int64)).tolist() == list(range(n))
    rng = np.random.default_rng(n)
    keys = rng.integers(0, 255, (n, 5), np.uint8)
    numbers = rng.integers(0, 2**32, n, np.uint64)
    with RUNTIME.scoped("test-lay", threads) as pool:
        laid = layout.lay_out([keys.copy(), numbers.copy()], pool if threads > 1 else None)
    assert np.array_equal(laid[0], keys[expected])
    assert np.array_equal(laid[1], numbers[expected])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("block", [4, 1 << 16])
def test_keys_rebuilt_rank_by_rank_are_the_source_order_keys_laid_out(
    monkeypatch: pytest.MonkeyPatch, threads: int, block: int
) -> None:
    """Sources of several leaves each (every leaf's keys prefix-coded from its first), empty
    sources, sizes that leave ranks to fewer sources; rows as wide as every key or cut: the
    keys made rank by rank are those made in source order, laid out by rank."""
    monkeypatch.setattr(_ocdbt_keys, "_LAY_BLOCK", block)
    rng = np.random.default_rng(threads * 7 + block)
    for sizes in [[0, 700, 3, 700, 0, 1200], [1], [5, 5, 5, 5, 4, 900]]:
        prefix, suffix, raw, keys = [], [], bytearray(), []
        for size in sizes:
            while size:
                count = min(size, int(rng.integers(1, 400)))  # (a leaf)
                words: set[bytes] = set()
                while len(words) < count:
                    words.add(bytes(rng.integers(97, 100, rng.integers(1, 14), np.uint8)))
                before = b""
                for word in sorted(words):
                    pairs = enumerate(zip(before, word, strict=False))
                    shared = next(
                        (j for j, (x, y) in pairs if x != y), min(map(len, [before, word]))
                    )
                    prefix.append(shared)
                    suffix.append(len(word) - shared)
                    raw += word[shared:]
                    keys.append(word)
                    before = word
                size -= count
        columns = (
            np.array(prefix, np.int32),
            np.array(suffix, np.int32),
            np.frombuffer(bytes(raw), np.uint8),
        )
        layout = _ocdbt_keys.RankMajor(sizes)
        for width in [max(map(len, keys)), 6]:
            with RUNTIME.scoped("test-rank-rebuild", threads) as pool:
                got = layout.rebuild(*columns, width, pool if threads > 1 else None)
            want = _ocdbt_keys.rebuild_keys(*columns, None, width)
            assert np.array_equal(got, want[rank_major_by_hand(sizes)]), (sizes, width)


def test_only_sources_of_alike_keys_are_laid_out_by_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hosts that each hold a chunk of every array are laid out by rank before the sort (then
    nearly sorted); hosts of disjoint arrays are not (laid by rank, their keys would be
    shuffled): their keys are made again in source order; nor are a few hosts' keys. The root
    view holds every key either way."""
    laid: list[int] = []
    again: list[int] = []
    real, real_rebuild = _ocdbt_keys.RankMajor.lay_out, _ocdbt_merge.rebuild_keys

    def spy(self: _ocdbt_keys.RankMajor, *args: Any) -> list[np.ndarray]:
        laid.append(self.n)
        return real(self, *args)

    def rebuild(prefix: np.ndarray, *args: Any) -> np.ndarray:
        again.append(len(prefix))
        return real_rebuild(prefix, *args)

    monkeypatch.setattr(_ocdbt_keys.RankMajor, "lay_out", spy)
    monkeypatch.setattr(_ocdbt_merge, "rebuild_keys", rebuild)
    rng = np.random.default_rng(8)
    cases = [
        ("alike", "a{a:03d}/c/{h}", 9),
        ("disjoint", "h{h}/a{a:03d}", 9),
        ("few", "a{a}/{h}", 7),
    ]
    for case, key, count in cases:
        root = tmp_path / case
        every: dict[bytes, bytes] = {}
        for h in range(count):
            batch = {key.format(a=a, h=h).encode(): rng.bytes(20) for a in range(300)}
            database(root / f"ocdbt.process_{h}", [batch])
            every.update(batch)
        names = [f"ocdbt.process_{h}" for h in range(count)]
        _ocdbt_merge.write_root(root, names, tsu.ROOT_OCDBT_CONFIG)
        assert read_root(root) == every
    # (by rank: the alike hosts' keys; in source order: the disjoint ones' again, and the keys
    # of fewer hosts than _RANK_SOURCES, never laid out by rank)
    assert laid == [2700] and again == [2700, 2100], (laid, again)


def test_uleb128_columns_round_trip() -> None:
    values = np.array([0, 1, 127, 128, 300, 2**32 - 1, 2**32, 2**63 - 1, 2**64 - 1], np.uint64)
    encoded = fmt.encode_varints(values)
    assert encoded[:5].tolist() == [0, 1, 127, 0x80, 0x01]
    padded = np.concatenate([np.array([9, 9], np.uint8), encoded, np.array([5], np.uint8)])
    got, end = fmt.read_varints(padded, 2, len(values))
    assert got.tolist() == values.tolist() and end == 2 + len(encoded)
    with pytest.raises(fmt.FormatError, match="runs past the end"):
        fmt.read_varints(encoded[:-1], 0, len(values))
    with pytest.raises(fmt.FormatError, match="longer than 10 bytes"):
        fmt.read_varints(np.array([0x80] * 10 + [1], np.uint8), 0, 1)
    # columns of numbers of every size mixed, as one at a time writes them
    rng = np.random.default_rng(7)
    for n in [1, 2, 5, 300]:
        bits = rng.integers(0, 64, n)
        column = (rng.integers(0, 2**63, n, dtype=np.uint64) * 2 + 1) >> bits.astype(np.uint64)
        column[rng.random(n) < 0.2] = 0
        one_at_a_time = b"".join(fmt.varint(int(v)) for v in column)
        assert fmt.encode_varints(column).tobytes() == one_at_a_time
        assert int(fmt.varint_sizes(column).sum()) == len(one_at_a_time)
        got, end = fmt.read_varints(np.frombuffer(one_at_a_time + b"\xff\x01", np.uint8), 0, n)
        assert got.tolist() == column.tolist() and end == len(one_at_a_time)


def test_a_key_in_two_databases_falls_back_to_tensorstore_with_nothing_written(
    tmp_path: Path,
) -> None:
    database(tmp_path / "ocdbt.process_0", [{b"a/zarr.json": b"{}", b"a/c/0": b"x" * 2000}])
    database(tmp_path / "ocdbt.process_1", [{b"a/zarr.json": b"{}", b"a/c/1": b"y" * 2000}])
    with pytest.raises(fmt.FormatError, match="more than one database"):
        _ocdbt_merge.write_root(
            tmp_path, ["ocdbt.process_0", "ocdbt.process_1"], tsu.ROOT_OCDBT_CONFIG
        )
    assert root_files(tmp_path) == []
    tsu.merge_ocdbt(tmp_path)  # TensorStore's merge: one of the two (equal) headers
    assert read_root(tmp_path) == {
        b"a/zarr.json": b"{}",
        b"a/c/0": b"x" * 2000,
        b"a/c/1": b"y" * 2000,
    }


def test_the_merge_says_once_with_its_reason_that_tensorstore_merges_instead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fallback is loud: one WARNING per process and kind of reason, naming the reason."""
    from milepost.workers.format import _ocdbt_format

    monkeypatch.setattr(_ocdbt_format, "_fell_back", set())  # (as in a fresh process)
    key = f"a{os.urandom(6).hex()}/zarr.json".encode()
    for folder in ("one", "two"):
        database(tmp_path / folder / "ocdbt.process_0", [{key: b"{}", b"a/c/0": b"x" * 2000}])
        database(tmp_path / folder / "ocdbt.process_1", [{key: b"{}", b"a/c/1": b"y" * 2000}])
    with warnings_logged() as lines:
        tsu.merge_ocdbt(tmp_path / "one")
        tsu.merge_ocdbt(tmp_path / "two")  # (the same reason: not said again)
    said = [line for line in lines if "fell back" in line]
    assert len(said) == 1, lines
    assert "OCDBT merge fell back to TensorStore's copy_range_to" in said[0]
    assert f"the key {key!r} is in more than one database" in said[0]
    for folder in ("one", "two"):
        assert read_root(tmp_path / folder)[key] == b"{}"


def test_a_damaged_database_writes_nothing(tmp_path: Path) -> None:
    hosts(tmp_path, 2, 40, seed=3)
    manifest = tmp_path / "ocdbt.process_1" / "manifest.ocdbt"
    node = fmt.decode_manifest(manifest.read_bytes(), "host 1").node
    assert node is not None
    with open(tmp_path / "ocdbt.process_1" / node.path, "r+b") as f:
        f.seek(node.offset + node.length // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(fmt.FormatError, match="CRC32C"):
        _ocdbt_merge.write_root(
            tmp_path, ["ocdbt.process_0", "ocdbt.process_1"], tsu.ROOT_OCDBT_CONFIG
        )
    assert root_files(tmp_path) == []
    with pytest.raises(ValueError):  # TensorStore finds it damaged too: no root view
        tsu.merge_ocdbt(tmp_path)
    assert "manifest.ocdbt" not in root_files(tmp_path)


def crafted(folder: Path, node_path: str, value_path: str) -> None:
    """A database whose manifest puts its root node at ``node_path`` and whose one value lies
    in ``value_path`` (paths as its B-tree says them, from its folder)."""
    (folder / "d").mkdir(parents=True)
    leaf, _ = fmt.encode_leaf(
        np.frombuffer(b"a/c/0", np.uint8)[None, :],
        np.array([5]),
        np.array([4], np.uint64),
        np.array([0]),
        np.array([0], np.uint64),
        b"",
        fmt.write_file_table([value_path]),
        None,
    )
    (folder / "d" / "node").write_bytes(leaf)
    write_manifest(folder, node_path, len(leaf))


def write_manifest(
    folder: Path, node_path: str, node_length: int, height: int = 0, entries: int = 1
) -> None:
    """A one-version manifest whose B-tree root is the node at ``node_path`` (a leaf, or at
    ``height``), over ``entries`` values of 4 bytes."""
    manifest = fmt.encode_manifest(
        uuid=bytes(16),
        config={
            "max_inline_value_bytes": 1024,
            "max_decoded_node_bytes": 8_000_000,
            "version_tree_arity_log2": 4,
        },
        generation=1,
        height=height,
        root=fmt.Ref(node_path, 0, node_length, ""),
        stats=(entries, node_length, 4 * entries),
        commit_ns=1,
        level=None,
    )
    (folder / "manifest.ocdbt").write_bytes(manifest)


@pytest.mark.parametrize(
    ("node_path", "value_path"),
    [("d/node", "../../outside"), ("../../outside", "d/v"), ("d/node", "/etc/hostname")],
)
def test_a_database_naming_a_file_outside_its_folder_is_refused(
    tmp_path: Path, node_path: str, value_path: str
) -> None:
    checkpoint = tmp_path / "ckpt"
    (tmp_path / "outside").write_bytes(b"secret")
    crafted(checkpoint / "ocdbt.process_0", node_path, value_path)
    if node_path == "d/node":  # the crafted database is well-formed: TensorStore reads it
        kv = ts.KvStore.open(tsu.ocdbt_kvstore(str(checkpoint / "ocdbt.process_0"))).result()
        assert kv.list().result() == [b"a/c/0"]
    with pytest.raises(CorruptCheckpointError, match="outside its folder"):
        tsu.merge_ocdbt(checkpoint)  # (no fall back to TensorStore's merge)
    assert root_files(checkpoint) == []


@pytest.mark.parametrize("where", ["disk", "memory"])
def test_a_save_writes_its_root_view_directly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mesh24: jax.sharding.Mesh, where: str
) -> None:
    """A save's own databases are what the direct writer reads: no fall back, on a disk or in
    an object store (memory://, through the store's shared context)."""
    outcomes: list[str] = []
    real = _ocdbt_merge.write_root

    def spy(*args: Any) -> None:
        try:
            real(*args)
        except fmt.FormatError as e:
            outcomes.append(f"fell back: {e}")
            raise
        outcomes.append("direct")

    monkeypatch.setattr(_ocdbt_merge, "write_root", spy)
    rng = np.random.default_rng(5)
    state = {
        "w": put(rng.standard_normal((16, 64), dtype=np.float32), mesh24, P("data", "model")),
        "b": put(rng.standard_normal((64,), dtype=np.float32), mesh24, P()),
    }
    path = str(tmp_path / "ckpt") if where == "disk" else f"memory://direct-{os.getpid()}/ckpt"
    mp.save(path, state)
    assert outcomes == ["direct"]
    assert_tree_equal(mp.load(path, abstract_of(state)), state)


def test_a_node_claiming_more_than_a_reader_takes_is_refused_not_allocated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Crafted bytes never size what the merge allocates: a node that says it holds 2**30
    entries, or decodes to more than the bound, stops the direct writer with nothing written."""
    folder = tmp_path / "ocdbt.process_0"
    crafted(folder, "d/node", "d/v")
    claim = fmt.frame(bytes([0]) + fmt.write_file_table([]) + fmt.varint(2**30), fmt.BTREE_MAGIC, 3)
    (folder / "d" / "node").write_bytes(claim)
    write_manifest(folder, "d/node", len(claim))
    with pytest.raises(fmt.FormatError, match="of 1073741824 entries"):
        _ocdbt_merge.write_root(tmp_path, ["ocdbt.process_0"], tsu.ROOT_OCDBT_CONFIG)
    assert root_files(tmp_path) == []

    other = tmp_path / "other"
    hosts(other, 2, 40, seed=9)
    monkeypatch.setattr(fmt, "MAX_NODE_BYTES", 1_000)
    with pytest.raises(fmt.FormatError, match="more than 1000 bytes decoded"):
        _ocdbt_merge.write_root(
            other, ["ocdbt.process_0", "ocdbt.process_1"], tsu.ROOT_OCDBT_CONFIG
        )
    assert root_files(other) == []


def one_leaf(
    folder: Path, values: list[tuple[bytes, int, int]], inline: tuple[bytes, bytes]
) -> None:
    """A database of one leaf: ``values`` (key, offset, length) in ``d/v``, and one ``inline``
    (key, value), sorted after them."""
    (folder / "d").mkdir(parents=True)
    rows, key_lengths = _ocdbt_keys.padded([k for k, _, _ in values] + [inline[0]])
    leaf, _ = fmt.encode_leaf(
        rows,
        key_lengths,
        np.array([n for _, _, n in values] + [len(inline[1])], np.uint64),
        np.array([0] * len(values) + [-1]),
        np.array([o for _, o, _ in values] + [0], np.uint64),
        inline[1],
        fmt.write_file_table(["d/v"]),
        None,
    )
    (folder / "d" / "node").write_bytes(leaf)
    write_manifest(folder, "d/node", len(leaf), entries=len(values) + 1)


def test_offsets_and_lengths_past_32_bits_are_kept_whole(tmp_path: Path) -> None:
    """The merge holds lengths and offsets in 32 bits until a database's need more: a value 4
    GiB long at 5 GiB into its file, after a database whose values fit, and the inline values
    after them (their offsets are places in the merge's inline bytes) reach the root exactly."""
    one_leaf(tmp_path / "ocdbt.process_0", [(b"a/c/1", 11, 4)], (b"a/zarr.json", b"{0}"))
    one_leaf(
        tmp_path / "ocdbt.process_1",
        [(b"a/c/0", 5 << 32, (1 << 32) + 7), (b"a/c/2", 3, 9)],
        (b"b/zarr.json", b"{1}"),
    )
    _ocdbt_merge.write_root(tmp_path, ["ocdbt.process_0", "ocdbt.process_1"], tsu.ROOT_OCDBT_CONFIG)

    root = fmt.decode_manifest((tmp_path / "manifest.ocdbt").read_bytes(), "root")
    assert root.node is not None and root.height == 0
    data = (tmp_path / root.node.path).read_bytes()[root.node.offset :][: root.node.length]
    e = fmt.decode_node(data, root.node, "root")
    assert isinstance(e, fmt.Entries)
    keys = _ocdbt_keys.rebuild_keys(e.key_prefix, e.key_suffix, e.key_bytes)
    columns = zip(keys, e.key_prefix + e.key_suffix, e.files, e.offsets, e.lengths, strict=True)
    got = {
        bytes(k[:n]): (e.paths[f] if f >= 0 else None, int(o), int(v)) for k, n, f, o, v in columns
    }
    assert got == {
        b"a/c/0": ("ocdbt.process_1/d/v", 5 << 32, (1 << 32) + 7),
        b"a/c/1": ("ocdbt.process_0/d/v", 11, 4),
        b"a/c/2": ("ocdbt.process_1/d/v", 3, 9),
        b"a/zarr.json": (None, 0, 3),
        b"b/zarr.json": (None, 0, 3),
    }
    kv = ts.KvStore.open(tsu.ocdbt_kvstore(str(tmp_path))).result()
    assert kv[b"a/zarr.json"] == b"{0}" and kv[b"b/zarr.json"] == b"{1}"
