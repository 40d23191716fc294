"""milepost.surgery: every operation exactly against a NumPy reference, written as an ordinary
checkpoint (loaded by milepost and by Orbax), planned before anything moves (bad surgery fails
with nothing written), streamed in groups under a memory budget; previews read only the chunks
they need."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost import surgery as ms
from tests._helpers import put, same_bits

LAYERS = 3


def values() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {
        "params": {
            **{
                f"layer{i}": {
                    "w": rng.standard_normal((16, 32), dtype=np.float32),
                    "b": np.arange(32, dtype=np.float32) + i,
                }
                for i in range(LAYERS)
            },
            "q": rng.standard_normal((16, 8), dtype=np.float32),
            "k": rng.standard_normal((16, 8), dtype=np.float32),
            "v": rng.standard_normal((16, 8), dtype=np.float32),
        },
        "opt_state": {"mu": rng.standard_normal((16, 32), dtype=np.float32), "count": np.int32(3)},
    }


def on_devices(tree: dict[str, Any], mesh: jax.sharding.Mesh) -> dict[str, Any]:
    def place(x: Any) -> Any:
        if isinstance(x, np.ndarray) and x.ndim == 2:
            return put(x, mesh, P("data", "model"))
        if isinstance(x, np.ndarray):
            return put(x, mesh, P())
        return x

    return jax.tree.map(place, tree)


@pytest.fixture
def source(tmp_path: Path, mesh24: jax.sharding.Mesh) -> tuple[Path, dict[str, Any]]:
    want = values()
    mp.save(tmp_path / "src", {**on_devices(want, mesh24), "step": 100, "note": "run"})
    return tmp_path / "src", want


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_open_is_lazy_and_previews_read_only_their_chunks(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 256), dtype=np.float32)
    with mp.Context(
        saving=mp.SaveOptions(chunk_byte_size=4096)
    ):  # chunks of 1024 values: 16 of them
        mp.save(
            tmp_path / "src", {"w": put(w, mesh24, P("data", "model")), "step": 3, "note": "hi"}
        )
    ck = ms.open(tmp_path / "src")
    assert ck.tree["step"] == 3 and ck.tree["note"] == "hi"
    assert isinstance(ck.tree["w"], ms.LazyArray) and ck.tree["w"].shape == (64, 256)
    assert "w" in repr(ck) and "(64, 256)" in repr(ck) and "<table>" in ck._repr_html_()
    from milepost.workers.format import _checksum

    checked: list[int] = []
    real = _checksum.region_crc32c
    monkeypatch.setattr(
        _checksum,
        "region_crc32c",
        lambda data, box, chunk: (checked.append(data.size), real(data, box, chunk))[1],
    )
    got = np.asarray(ck.tree["w"][:4, 8:16])
    assert same_bits(got, w[:4, 8:16])
    assert checked == [1024], "only the one chunk holding the box is read and checked"
    assert same_bits(np.asarray(ck.tree["w"][5, -3:]), w[5, -3:])
    assert same_bits(np.asarray(ck.tree["w"].T[:2, :3]), w.T[:2, :3])  # more than a box: computed


def test_rename_drop_cast_stack_and_write(
    source: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    path, want = source
    ck = ms.open(path)
    t = ms.rename(ck.tree, {r"^params\.(.*)": r"model.\1", r"^opt_state\..*": None})
    t = ms.cast(t, jnp.bfloat16, where=r"\.w$")
    t = ms.stack(t, r"^model\.layer(\d+)\.(.*)$", r"model.layers.\2")
    out = ms.write(tmp_path / "out", t)
    got = mp.load(out)
    layers = [want["params"][f"layer{i}"] for i in range(LAYERS)]
    assert same_bits(
        got["model"]["layers"]["w"], np.stack([x["w"] for x in layers]).astype(ml_dtypes.bfloat16)
    )
    assert same_bits(got["model"]["layers"]["b"], np.stack([x["b"] for x in layers]))
    for k in "qkv":
        assert same_bits(got["model"][k], want["params"][k])
    assert got["step"] == 100 and got["note"] == "run" and "opt_state" not in got
    meta = mp.metadata(out)
    assert meta.custom_metadata["milepost.surgery"]["sources"] == [str(path)]
    assert set(meta.custom_metadata["milepost.surgery"]["operations"]) == {
        "rename",
        "cast",
        "stack",
    }
    assert mp.verify(out).ok


def test_unstack_concat_split_reshape_and_transpose(
    source: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    path, want = source
    t = ms.open(path).tree
    t = ms.stack(t, r"^params\.layer(\d+)\.w$", r"params.stacked")
    t = ms.unstack(t, r"^params\.stacked$", r"again.layer{i}")
    t = ms.concat(t, ["params.q", "params.k", "params.v"], "params.qkv", axis=1)
    t = ms.split(t, "params.qkv", {"params.q2": 8, "params.kv": 16}, axis=1)
    t = ms.select(t, r"^again\.", r"^params\.(q2|kv)$")
    t["params"]["kv_t"] = t["params"]["kv"].T.reshape(32, 8)
    got = mp.load(ms.write(tmp_path / "out", t))
    for i in range(LAYERS):
        assert same_bits(got["again"][f"layer{i}"], want["params"][f"layer{i}"]["w"])
    p = want["params"]
    qkv = np.concatenate([p["q"], p["k"], p["v"]], axis=1)
    assert same_bits(got["params"]["q2"], qkv[:, :8]) and same_bits(got["params"]["kv"], qkv[:, 8:])
    assert same_bits(got["params"]["kv_t"], qkv[:, 8:].T.reshape(32, 8))


def test_map_merges_a_lora_adapter_and_average_makes_a_soup(
    source: tuple[Path, dict[str, Any]], tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    path, want = source
    rng = np.random.default_rng(5)
    lora = {
        f"layer{i}": {
            "a": rng.standard_normal((16, 4), dtype=np.float32),
            "b": rng.standard_normal((4, 32), dtype=np.float32),
        }
        for i in range(LAYERS)
    }
    mp.save(tmp_path / "lora", {"lora": jax.tree.map(lambda x: put(x, mesh24, P()), lora)})
    base = ms.select(ms.open(path).tree, r"^params\.layer\d+\.w$")
    adapter = ms.open(tmp_path / "lora").tree
    a = ms.rename(ms.select(adapter, r"\.a$"), {r"^lora\.(layer\d+)\.a$": r"params.\1.w"})
    b = ms.rename(ms.select(adapter, r"\.b$"), {r"^lora\.(layer\d+)\.b$": r"params.\1.w"})

    def merge(w: Any, a: Any, b: Any) -> Any:
        return w + 0.5 * jnp.dot(a, b, precision="highest")

    merged = ms.map(merge, base, a, b)
    got = mp.load(ms.write(tmp_path / "merged", merged))
    # The reference: the same function, jitted on the same placement (a float32 dot's rounding
    # depends on how XLA blocks it, so no other reference is bit-exact).
    auto = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    for i in range(LAYERS):
        w = put(want["params"][f"layer{i}"]["w"], auto, P("data", "model"))
        a_, b_ = (put(lora[f"layer{i}"][k], auto, P()) for k in "ab")
        expected = jax.jit(merge, out_shardings=w.sharding)(w, a_, b_)
        assert same_bits(got["params"][f"layer{i}"]["w"], expected)
        close = want["params"][f"layer{i}"]["w"] + 0.5 * (
            lora[f"layer{i}"]["a"].astype(np.float64) @ lora[f"layer{i}"]["b"]
        )
        assert np.allclose(got["params"][f"layer{i}"]["w"], close, rtol=1e-6, atol=1e-6)

    # Three checkpoints of small integers and weights that are powers of two: every sum is
    # exact, so the soup equals the NumPy reference bit for bit whatever order XLA adds in.
    soups, trees = [], []
    for k in range(3):
        tree = jax.tree.map(lambda x, k=k: np.round(x * 8) + k, values())
        trees.append(tree)
        mp.save(tmp_path / f"s{k}", on_devices(tree, mesh24))
        soups.append(ms.open(tmp_path / f"s{k}").tree)
    weights = (0.5, 0.25, 0.25)
    soup = mp.load(
        ms.write(tmp_path / "soup", ms.average(*soups, weights=weights, where=r"^params\."))
    )
    for i in range(LAYERS):
        ref = sum(
            np.float32(wt) * t["params"][f"layer{i}"]["w"]
            for wt, t in zip(weights, trees, strict=True)
        )
        assert same_bits(soup["params"][f"layer{i}"]["w"], ref.astype(np.float32))
    assert same_bits(
        soup["opt_state"]["mu"], trees[0]["opt_state"]["mu"]
    )  # not averaged (where=): the first tree's


def test_a_surgery_loads_straight_onto_devices(
    source: tuple[Path, dict[str, Any]], mesh24: jax.sharding.Mesh
) -> None:
    path, want = source
    t = ms.cast(ms.select(ms.open(path).tree, r"^params\.layer0\."), jnp.bfloat16)
    other = NamedSharding(jax.make_mesh((8,), ("x",)), P(None, "x"))
    got = mp.load(
        t,
        {"params": {"layer0": {"w": jax.ShapeDtypeStruct((16, 32), jnp.bfloat16, sharding=other)}}},
    )
    assert (
        isinstance(got["params"]["layer0"]["w"], jax.Array)
        and got["params"]["layer0"]["w"].sharding == other
    )
    assert same_bits(
        got["params"]["layer0"]["w"], want["params"]["layer0"]["w"].astype(ml_dtypes.bfloat16)
    )


def test_stats_and_diff(source: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path, want = source
    ck = ms.open(path)
    table = ms.stats(ck.tree, where=r"^params\.layer0\.w$")
    w = want["params"]["layer0"]["w"]
    row = table["params.layer0.w"]
    assert row["min"] == float(w.min()) and row["max"] == float(w.max()) and row["nan"] == 0
    assert abs(row["mean"] - float(w.mean())) < 1e-5 and abs(row["std"] - float(w.std())) < 1e-5
    assert "params.layer0.w" in str(table) and "<table>" in table._repr_html_()
    assert ms.diff(ck.tree, ms.open(path).tree).equal
    changed = ms.map(lambda x: x.at[0, 0].add(2.0), ck.tree, where=r"^params\.layer2\.w$")
    ms.write(tmp_path / "changed", ms.drop(changed, r"^opt_state\.mu$"))
    d = ms.diff(ck.tree, ms.open(tmp_path / "changed").tree)
    assert not d.equal and d.only_a == ("opt_state.mu",) and d.only_b == ()
    assert d.different == ("params.layer2.w",) and d.table["params.layer2.w"]["max_abs_diff"] == 2.0


def test_orbax_reads_what_surgery_wrote(
    source: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    from orbax.checkpoint.experimental import v1 as ocp

    path, want = source
    t = ms.cast(
        ms.rename(ms.open(path).tree, {r"^opt_state\..*": None}), jnp.bfloat16, where=r"\.w$"
    )
    out = ms.write(tmp_path / "out", t)
    got = ocp.load_pytree(out)
    assert same_bits(
        got["params"]["layer1"]["w"], want["params"]["layer1"]["w"].astype(ml_dtypes.bfloat16)
    )
    assert same_bits(got["params"]["q"], want["params"]["q"])


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (lambda t: ms.rename(t, {r"^nothing": "x"}), "matches no leaf"),
        (lambda t: ms.rename(t, {r"^params\.layer\d\.w$": "same"}), "would both be named 'same'"),
        (lambda t: ms.cast(t, "not-a-dtype"), "not a dtype"),
        (lambda t: ms.cast(t, np.complex64, where="nothing"), "matches no leaf"),
        (lambda t: ms.stack(t, r"^params\.(q|k)$", "qk"), "must be an integer index"),
        (
            lambda t: ms.stack(
                ms.rename(t, {r"^params\.q$": "x.1", r"^params\.layer0\.w$": "x.2"}),
                r"^x\.(\d)$",
                "xs",
            ),
            "differ in shape",
        ),
        (
            lambda t: ms.map(lambda a, b: a @ b, t, t, where=r"^params\.layer0\.w$"),
            "map of 'params.layer0.w' fails",
        ),
        (lambda t: ms.concat(t, ["params.q", "params.layer0.b"], "x"), "concat of 'x' fails"),
        (lambda t: ms.split(t, "params.q", {"a": 3, "b": 3}, axis=1), "add up to 6"),
    ],
)
def test_bad_surgery_fails_before_anything_is_written(
    source: tuple[Path, dict[str, Any]], tmp_path: Path, plan: Any, message: str
) -> None:
    path, _ = source
    with pytest.raises(
        (ValueError, TypeError), match=re.escape(message) if "\\" not in message else message
    ):
        ms.write(tmp_path / "out", plan(ms.open(path).tree))
    assert listing(tmp_path) == ["src"]


def test_not_a_checkpoint_and_foreign_arrays_are_refused(
    tmp_path: Path, source: tuple[Path, dict[str, Any]]
) -> None:
    with pytest.raises(mp.CheckpointNotFoundError):
        ms.open(tmp_path / "missing")
    t = ms.open(source[0]).tree
    t["extra"] = np.zeros(3)
    with pytest.raises(TypeError, match="not lazy arrays"):
        ms.write(tmp_path / "out", t)
    assert listing(tmp_path) == ["src"]


def test_groups_stream_under_the_memory_budget(
    tmp_path: Path, mesh24: jax.sharding.Mesh, caplog: pytest.LogCaptureFixture
) -> None:
    """Eight 4 MiB leaves under a 6 MiB budget: written in groups (one OCDBT database per
    group and host), every leaf exact."""
    rng = np.random.default_rng(2)
    big = {f"w{i}": rng.standard_normal((1024, 1024), dtype=np.float32) for i in range(8)}
    mp.save(tmp_path / "src", {k: put(v, mesh24, P("data", "model")) for k, v in big.items()})
    t = ms.cast(ms.open(tmp_path / "src").tree, jnp.bfloat16)
    from milepost.surgery import _run

    seen: list[list[str]] = []
    real = _run.groups
    with pytest.MonkeyPatch.context() as m:
        m.setattr(_run, "groups", lambda *a: (lambda g: (seen.extend(g), g)[1])(real(*a)))
        with caplog.at_level("INFO", logger="milepost.surgery"):
            out = ms.write(tmp_path / "out", t, memory_budget_bytes=6 << 20)
            ms.write(tmp_path / "tiny", ms.select(t, "^w0$"), memory_budget_bytes=1 << 20)
    assert len(seen) >= 4 + 1 and all(len(g) <= 2 for g in seen[:-1]), seen
    assert any("more than a group may hold" in r.getMessage() for r in caplog.records)
    dbs = [p.name for p in (out / "state").iterdir() if p.name.startswith("ocdbt.process_0")]
    assert len(dbs) >= 4, dbs
    got = mp.load(out)
    for k, v in big.items():
        assert same_bits(got[k], v.astype(ml_dtypes.bfloat16)), k
    # One array_metadatas file for the host, listing the arrays of every group (not the last one's).
    import json

    (listed,) = [json.loads(p.read_text()) for p in (out / "state" / "array_metadatas").iterdir()]
    assert sorted(e["array_metadata"]["param_name"] for e in listed["array_metadatas"]) == sorted(
        big
    )


def test_a_rename_only_surgery_moves_no_array_bytes(
    source: tuple[Path, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from orbax.checkpoint.experimental import v1 as ocp

    from milepost.surgery import _run

    path, want = source
    monkeypatch.setattr(
        _run, "compute", lambda *a: pytest.fail("a rename-only surgery computed arrays")
    )
    t = ms.rename(ms.open(path).tree, {r"^params\.(.*)": r"model.\1"})
    out = ms.write(tmp_path / "out", t)
    monkeypatch.undo()
    got = mp.load(out)
    assert sorted(got) == ["model", "note", "opt_state", "step"] and "v" in got["model"]
    for i in range(LAYERS):
        assert same_bits(got["model"][f"layer{i}"]["w"], want["params"][f"layer{i}"]["w"])
    assert same_bits(got["opt_state"]["count"], want["opt_state"]["count"]) and got["step"] == 100
    linked = [p for p in _data_files(out) if p.stat().st_nlink > 1]
    assert linked and sum(p.stat().st_size for p in linked) >= sum(
        v["w"].nbytes for k, v in want["params"].items() if k.startswith("layer")
    )
    assert mp.verify(out).ok and mp.verify(path).ok  # the source is untouched
    assert same_bits(mp.load(path)["params"]["layer0"]["w"], want["params"]["layer0"]["w"])
    assert same_bits(ocp.load_pytree(out)["model"]["q"], want["params"]["q"])
    # Every relinked chunk is still checked, against its writer's table under the new names.
    info = json.loads((out / "state" / "_milepost.json").read_text())
    assert info.get("chunk_crc32c_tables") == 1, info
    # (the chunks inline in the B-tree are recorded, under the arrays' new names)
    assert not [n for n in info.get("chunk_crc32c", {}) if n.startswith("params.")], info
    from milepost.workers.load import _reader

    checked: list[str] = []
    real = _reader.Checked.want

    def spy(self: Any, grid: Any, value: Any = None) -> Any:
        found = real(self, grid, value)
        assert found >= 0, (self.name, grid)  # (from a table, or recorded: inline chunks)
        checked.append(self.name)
        return found

    monkeypatch.setattr(_reader.Checked, "want", spy)
    mp.load(out)
    assert {f"model.layer{i}.w" for i in range(LAYERS)} <= set(checked), checked


def test_dropped_arrays_leave_no_bytes_in_the_output(
    source: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """Pruning a checkpoint (its optimizer state, say) to share it: the dropped arrays' bytes
    are not in the output's files, so a drop is written anew instead of relinked."""
    path, want = source
    t = ms.rename(ms.open(path).tree, {r"^params\.(.*)": r"model.\1", r"^opt_state\.mu$": None})
    out = ms.write(tmp_path / "out", ms.drop(t, r"^model\.v$"))
    got = mp.load(out)
    assert (
        sorted(got) == ["model", "note", "opt_state", "step"]
        and "v" not in got["model"]
        and "mu" not in got["opt_state"]
    )
    assert same_bits(got["model"]["layer0"]["w"], want["params"]["layer0"]["w"])
    stored = b"".join(p.read_bytes() for p in _data_files(out))
    for dropped in (np.asarray(want["params"]["v"]), np.asarray(want["opt_state"]["mu"])):
        assert dropped.nbytes >= 256 and dropped.tobytes()[:256] not in stored, (
            "a dropped array's bytes are in the output"
        )
    assert not [p for p in _data_files(out) if p.stat().st_nlink > 1]
    assert mp.verify(out).ok and mp.verify(path).ok


def test_a_symlink_planted_in_the_source_after_open_is_not_followed(
    source: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    import shutil

    path, _ = source
    src = tmp_path / "planted"
    shutil.copytree(path, src)
    t = ms.rename(ms.open(src).tree, {r"^params\.(.*)": r"model.\1"})  # checked here, clean
    outside = tmp_path / "outside"
    (outside / "d").mkdir(parents=True)
    (outside / "d" / "secret").write_bytes(b"not the checkpoint's")
    (src / "state" / "ocdbt.process_7").symlink_to(outside, target_is_directory=True)
    with pytest.raises(mp.CorruptCheckpointError, match="ocdbt.process_7"):
        ms.write(tmp_path / "out", t)
    assert not (tmp_path / "out").exists()
    assert os.stat(outside / "d" / "secret").st_nlink == 1


def _data_files(ckpt: Path) -> list[Path]:
    return [
        p
        for p in (ckpt / "state").rglob("*")
        if p.is_file()
        and p.parent.name == "d"
        and p.parent.parent.name.startswith("ocdbt.process_")
    ]


def test_programs_are_shared_only_when_they_compute_the_same(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    mp.save(
        tmp_path / "src",
        {"i": put(np.arange(64, dtype=np.int32).reshape(8, 8), mesh24, P("data", "model"))},
    )
    tree = ms.open(tmp_path / "src").tree

    def scaled(c: Any) -> Any:
        return lambda x: x * c  # one code object; what differs is the constant it closes over

    by_int = mp.load(ms.map(scaled(3), tree))["i"]
    by_float = mp.load(ms.map(scaled(3.0), tree))["i"]
    by_bool = mp.load(ms.map(scaled(True), tree))["i"]
    assert by_int.dtype == np.int32 and by_float.dtype == np.float32 and by_bool.dtype == np.int32
    assert same_bits(by_int, np.arange(64, dtype=np.int32).reshape(8, 8) * 3)
    assert same_bits(by_float, np.arange(64, dtype=np.float32).reshape(8, 8) * 3)
    assert same_bits(by_bool, np.arange(64, dtype=np.int32).reshape(8, 8))


def test_peak_memory_stays_within_the_budget(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    from tests import _subproc

    proc = subprocess.run(
        [sys.executable, "-m", "tests._memory_peaks", "surgery", str(tmp_path)],
        cwd=_subproc.ROOT,
        env=_subproc.env(8),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    growth = json.loads(proc.stdout.strip().splitlines()[-1])["growth"]
    budget, largest, checkpoint = 64 << 20, 32 << 20, 256 << 20
    assert growth < 2 * (budget + largest), (
        f"peak RSS grew {growth >> 20} MiB for a {budget >> 20} MiB budget"
    )
    assert growth < checkpoint * 0.75, "the surgery held most of the checkpoint at once"
    got = mp.load(tmp_path / "big-out")
    assert same_bits(got["w5"], np.full((2048, 4096), 5, ml_dtypes.bfloat16))


@pytest.mark.parametrize("chunking", [256, None], ids=["subchunked", "one-chunk-per-shard"])
def test_rechunking_rewrites_every_array(
    source: tuple[Path, dict[str, Any]], tmp_path: Path, chunking: int | None
) -> None:
    """A chunking asked for (a number of bytes, or None: one chunk per shard) rewrites every
    array; only the default ("auto") keeps stored leaves as they are (relinked)."""
    path, want = source
    with mp.Context(saving=mp.SaveOptions(chunk_byte_size=chunking)):
        out = ms.write(tmp_path / "out", ms.open(path).tree)
    meta = mp.metadata(out)
    w = meta.tree["params"]["layer0"]["w"]
    if chunking is None:
        assert w.write_shape == w.chunk_shape == (8, 8)
    else:
        assert w.write_shape == (8, 8) and np.prod(w.chunk_shape) * 4 <= 256  # subchunked shards
    assert same_bits(mp.load(out)["params"]["layer0"]["w"], want["params"]["layer0"]["w"])
    linked = [p for p in (out / "state").rglob("*") if p.is_file() and p.stat().st_nlink > 1]
    assert not linked, "re-chunking must rewrite, not relink"


def test_the_same_surgery_in_a_multi_controller_job(tmp_path: Path) -> None:
    from tests import _mc

    outs = _mc.launch("run", 2, 4, str(tmp_path), module="tests._mc_surgery")
    for r in outs:
        assert r.returncode == 0 and "exception" not in r.out, (
            f"{r.out.get('exception')}\n{r.stderr}"
        )
        assert r.out["exact"] == 8 and r.out["step"] == 5 and r.out["equal"], r.out
        assert r.out["preview"] == [float(x) for x in (np.arange(64, 67) * 3 - 7)], r.out


def test_diff_of_values_that_are_not_arrays() -> None:
    a = {"step": 10, "run": "a", "lr": 0.5, "seen": np.int64(7)}
    d = ms.diff(a, {"step": 10, "run": "b", "lr": 0.25, "seen": np.int64(7)})
    assert d.different == ("run", "lr")
    assert d.table["step"]["max_abs_diff"] == 0.0 and d.table["seen"]["max_abs_diff"] == 0.0
    assert d.table["lr"]["max_abs_diff"] == 0.25 and math.isnan(d.table["run"]["max_abs_diff"])
    assert "nan" not in str(ms.diff(a, dict(a)).table)


def test_one_notation_for_a_sharding(
    tmp_path: Path, mesh24: jax.sharding.Mesh, capsys: pytest.CaptureFixture[str]
) -> None:
    """A saved sharding reads the same in mp.metadata, ms.open's table, a LazyArray, stats, and
    milepost inspect: ``P('data', 'model') on {data: 2, model: 4}``."""
    from milepost import _cli

    w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    mp.save(
        tmp_path / "c", {"w": put(w, mesh24, P("data", "model")), "n": np.arange(3, dtype=np.int32)}
    )
    text = "P('data', 'model') on {data: 2, model: 4}"
    assert mp.metadata(tmp_path / "c").tree["w"].sharding.describe() == text
    assert f"sharding={text}" in repr(mp.metadata(tmp_path / "c").tree["w"])
    ck = ms.open(tmp_path / "c")
    assert f"sharding={text}" in repr(ck.tree["w"]) and text in repr(ck)
    assert ms.stats(ck.tree)["w"]["sharding"] == text
    assert _cli.main(["inspect", str(tmp_path / "c")]) == 0
    assert text in capsys.readouterr().out
