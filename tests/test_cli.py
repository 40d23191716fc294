"""The ``milepost`` command through its console entry point (a subprocess, as a user runs it):
what it prints, its exit status, ``--json`` that parses; a few cases in-process (``main``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost import _cli
from milepost.training import Checkpointer

SCRIPT = Path(sys.executable).with_name("milepost")
ENTRY = [str(SCRIPT)] if SCRIPT.exists() else [shutil.which("milepost") or "milepost"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the demo sets its own devices
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run([*ENTRY, *args], capture_output=True, text=True, timeout=120, env=env)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    root = tmp_path_factory.mktemp("cli")
    state = {
        "params": {
            "kernel": jax.device_put(
                np.ones((256, 128), np.float32), NamedSharding(mesh, P("data", "model"))
            ),
            "bias": np.zeros(128, np.float16),
        },
        "step": 1000,
        "run": "cli-test",
    }
    mp.save_checkpointables(
        root / "ckpt",
        {"state": state, "dataset": {"position": 1234}},
        custom_metadata={"owner": "tests"},
        metrics={"loss": 0.25},
    )
    return root / "ckpt"


def test_help_lists_the_commands_and_the_exit_codes() -> None:
    out = run("--help")
    assert out.returncode == 0, out.stderr
    for word in (
        "inspect",
        "ls",
        "verify",
        "demo",
        "Exit status:",
        "3    nothing there",
        "--no-progress",
    ):
        assert word in out.stdout, (word, out.stdout)
    module = subprocess.run(
        [sys.executable, "-m", "milepost", "--version"], capture_output=True, text=True, timeout=120
    )
    assert module.returncode == 0 and "milepost, version" in module.stdout, module.stderr


def test_inspect_prints_the_tree(ckpt: Path) -> None:
    out = run("inspect", str(ckpt))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for needle in (
        str(ckpt),
        "format:          milepost (Orbax v1 layout)",
        "committed:",
        'custom metadata: {"owner": "tests"}',
        'metrics:         {"loss": 0.25}',
        "state (PyTreeHandler, OCDBT, zarr3)",
        "dataset (PyTreeHandler, OCDBT, zarr3)",
        "params.kernel",
        "(256, 128)",
        "float32",
        "P('data', 'model') on {data: 2, model: 4}",
        "(128, 32)",
        "128.0 KiB",
        "params.bias",
        "float16",
        "256 B",
        "run",
        "string",
        "step",
        "int64",
        "state: 4 leaves, 3 arrays, 128.3 KiB",
        "dataset: 1 leaves, 1 arrays, 8 B",
        "position",
        "total: 5 leaves, 4 arrays, 128.3 KiB",
    ):
        assert needle in text, (needle, text)
    assert out.stderr == ""


def test_inspect_json_parses(ckpt: Path) -> None:
    out = run("inspect", str(ckpt), "--json")
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout)
    assert record["custom_metadata"] == {"owner": "tests"} and record["metrics"] == {"loss": 0.25}
    state = record["checkpointables"]["state"]
    kernel = next(leaf for leaf in state["leaves"] if leaf["path"] == "params.kernel")
    assert kernel == {
        "path": "params.kernel",
        "type": "jax.Array",
        "shape": [256, 128],
        "dtype": "float32",
        "sharding": "P('data', 'model') on {data: 2, model: 4}",
        "write_shape": [128, 32],
        "chunk_shape": [128, 32],
        "bytes": 256 * 128 * 4,
    }
    assert state["totals"] == {"leaves": 4, "arrays": 3, "bytes": 256 * 128 * 4 + 128 * 2 + 8}
    assert record["totals"] == {"leaves": 5, "arrays": 4, "bytes": 256 * 128 * 4 + 128 * 2 + 8 + 8}
    assert [leaf["path"] for leaf in record["checkpointables"]["dataset"]["leaves"]] == ["position"]


def test_errors_are_one_line_with_an_exit_status(tmp_path: Path) -> None:
    missing = run("inspect", str(tmp_path / "nothing"))
    assert missing.returncode == _cli.NOT_FOUND and missing.stdout == ""
    (line,) = missing.stderr.strip().splitlines()
    assert (
        line.startswith("milepost: error: CheckpointNotFoundError: no checkpoint at")
        and "--debug" in line
    )
    debug = run("--debug", "inspect", str(tmp_path / "nothing"))
    assert (
        debug.returncode == _cli.NOT_FOUND and "Traceback (most recent call last)" in debug.stderr
    )
    assert run("inspect").returncode == _cli.USAGE
    scheme = run("ls", "ftp://bucket/run")
    assert scheme.returncode == _cli.USAGE and "gs://, s3:// and memory://" in scheme.stderr


def test_inspect_on_a_file_it_does_not_read_names_the_formats(tmp_path: Path) -> None:
    (tmp_path / "model.pkl").write_bytes(b"\x80\x04K\x01.")
    out = run("inspect", str(tmp_path / "model.pkl"))
    assert out.returncode == _cli.USAGE, out.stderr
    assert "format milepost does not read" in out.stderr and ".safetensors" in out.stderr
    assert "Orbax v0" in out.stderr and "directory" not in out.stderr, out.stderr


def test_demo_in_a_temporary_folder_says_it_is_removed() -> None:
    out = run("demo", "--devices", "2", "--size-mib", "1")
    assert out.returncode == 0, out.stderr
    printed = out.stdout
    where = next(line for line in printed.splitlines() if "checkpoint at " in line)
    assert "removed when the demo ends; --dir keeps it" in where, printed
    path = Path(where.split("checkpoint at ", 1)[1].split(" (", 1)[0])
    assert path.name == "ckpt_1000" and not path.parent.exists()


def test_verify_exit_status_says_sound_or_damaged(ckpt: Path, tmp_path: Path) -> None:
    good = run("verify", str(ckpt), "--json")
    assert good.returncode == _cli.OK, good.stderr
    assert json.loads(good.stdout)["ok"] is True
    damaged = tmp_path / "damaged"
    shutil.copytree(ckpt, damaged)
    data = max(
        (p for p in (damaged / "state").rglob("*") if p.is_file() and p.suffix != ".json"),
        key=lambda p: p.stat().st_size,
    )
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    bad = run("verify", str(damaged))
    assert bad.returncode == _cli.DAMAGED, (bad.stdout, bad.stderr)
    assert "1 problem(s)" in bad.stdout and "problem: " in bad.stdout


def test_ls_lists_steps_tiers_and_leftovers(tmp_path: Path) -> None:
    root, fast = tmp_path / "root", tmp_path / "fast"
    with Checkpointer(root, local=fast) as ckpt:
        for step in (100, 200, 300):
            ckpt.save(step, {"x": np.arange(1000)}, metrics={"loss": 1.0 / step})
    (root / "400.orbax-checkpoint-tmp").mkdir()  # what a killed save leaves
    out = run("ls", str(root), "--local", str(fast))
    assert out.returncode == 0, out.stderr
    lines = [line.split() for line in out.stdout.splitlines()]
    assert "3 committed steps, latest 300; 1 not committed (never loaded)" in out.stdout
    rows = {line[0]: line for line in lines if line and line[0].isdigit()}
    assert rows["100"][1:3] == ["committed", "durable"]
    assert (
        rows["300"][1:5] == ["committed", "local", "+", "durable"]
        and rows["300"][-1] == "0.00333333"
    )
    assert rows["400"][1:3] == ["unfinished", "save"]
    listed = json.loads(run("ls", str(root), "--json").stdout)
    assert [r["step"] for r in listed] == [100, 200, 300, 400]
    assert (
        listed[0]["metrics"] == {"loss": 0.01}
        and listed[0]["bytes"] > 8000
        and listed[0]["committed"]
    )
    assert listed[3]["state"] == "unfinished save"


def test_demo_checks_its_devices_and_its_folder(tmp_path: Path) -> None:
    for bad in ("1", "3"):
        out = run("demo", "--devices", bad, "--size-mib", "1")
        assert (
            out.returncode == _cli.USAGE
            and "--devices" in out.stderr
            and "even number >= 2" in out.stderr
        ), out.stderr
        assert "Traceback" not in out.stderr
    out = run("demo", "--devices", "4", "--size-mib", "8", "--dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "removed when the demo ends" not in out.stdout
    assert "values identical: True" in out.stdout and (tmp_path / "ckpt_1000").is_dir()
    again = run("demo", "--devices", "4", "--size-mib", "8", "--dir", str(tmp_path))
    assert again.returncode == _cli.USAGE and "--overwrite" in again.stderr
    assert (
        run(
            "demo", "--devices", "4", "--size-mib", "8", "--dir", str(tmp_path), "--overwrite"
        ).returncode
        == 0
    )


def test_main_in_process_reads_orbax_v0_and_safetensors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ocp = pytest.importorskip("orbax.checkpoint")
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    with ocp.StandardCheckpointer() as writer:
        writer.save(tmp_path / "v0", {"w": np.arange(12.0).reshape(3, 4)})
        writer.wait_until_finished()
    assert _cli.main(["inspect", str(tmp_path / "v0")]) == 0
    text = capsys.readouterr().out
    assert "format:          Orbax v0" in text and "(3, 4)" in text and "float64" in text
    safetensors_numpy.save_file(
        {"layer.w": np.ones((4, 8), np.float32)}, str(tmp_path / "m.safetensors")
    )
    assert _cli.main(["inspect", str(tmp_path / "m.safetensors"), "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["format"] == "safetensors" and record["checkpointables"]["tensors"]["leaves"][0][
        "shape"
    ] == [4, 8]


def test_stats_diff_and_convert(ckpt: Path, tmp_path: Path) -> None:
    stats = run("stats", str(ckpt), "--json")
    assert stats.returncode == 0, stats.stderr
    rows = {r["leaf"]: r for r in json.loads(stats.stdout)}
    assert (
        rows["params.kernel"]["min"] == 1.0
        and rows["params.kernel"]["std"] == 0.0
        and rows["params.bias"]["max"] == 0.0
    )
    table = run("stats", str(ckpt), "--where", "kernel$")
    assert (
        table.returncode == 0
        and "params.kernel" in table.stdout
        and "params.bias" not in table.stdout
    ), table.stderr

    # A conversion to plain zarr3 with subchunks: every array rewritten, the values the same.
    out = tmp_path / "zarr3"
    converted = run("convert", str(ckpt), str(out), "--to", "zarr3", "--chunk-bytes", "16384")
    assert converted.returncode == 0, converted.stderr
    record = json.loads(run("inspect", str(out), "--json").stdout)
    assert record["checkpointables"]["state"]["storage"] == "plain folders, zarr3"
    kernel = next(
        leaf
        for leaf in record["checkpointables"]["state"]["leaves"]
        if leaf["path"] == "params.kernel"
    )
    assert np.prod(kernel["chunk_shape"]) * 4 <= 16384 < np.prod(kernel["write_shape"]) * 4
    # The saved sharding kept, though the command's process had one CPU device.
    source = json.loads(run("inspect", str(ckpt), "--json").stdout)["checkpointables"]["state"]
    assert kernel["sharding"] == "P('data', 'model') on {data: 2, model: 4}"
    assert {leaf["path"]: leaf["sharding"] for leaf in source["leaves"]} == {
        leaf["path"]: leaf["sharding"] for leaf in record["checkpointables"]["state"]["leaves"]
    }
    assert mp.metadata(out).tree["params"]["kernel"].sharding == (
        mp.metadata(ckpt).tree["params"]["kernel"].sharding
    )
    assert mp.load(out)["params"]["kernel"].sharding == mp.load(ckpt)["params"]["kernel"].sharding
    assert (
        record["custom_metadata"]["owner"] == "tests"
        and record["custom_metadata"]["milepost.convert"]["to"] == "zarr3"
    )
    assert not any(p.is_symlink() for p in out.rglob("*"))
    same = run("diff", str(ckpt), str(out))
    assert same.returncode == 0 and "equal" in same.stdout, (same.stdout, same.stderr)
    restored = mp.load(
        out,
        {
            "params": {
                "kernel": jax.ShapeDtypeStruct((256, 128), np.float32),
                "bias": np.empty(128, np.float16),  # saved as a NumPy array, kept one
            },
            "step": 0,
            "run": "",
        },
    )
    np.testing.assert_array_equal(
        np.asarray(restored["params"]["kernel"]), np.ones((256, 128), np.float32)
    )
    refused = run("convert", str(ckpt), str(out))  # exists: refused without --overwrite
    assert refused.returncode == _cli.USAGE and "pass --overwrite" in refused.stderr
    assert "overwrite=True" not in refused.stderr, refused.stderr

    # Different values: exit status 1, the leaf named.
    other = tmp_path / "other"
    mp.save(
        other,
        {
            "params": {
                "kernel": np.ones((256, 128), np.float32) * 1.5,
                "bias": np.zeros(128, np.float16),
            },
            "step": 1000,
            "run": "cli-test",
        },
    )
    differ = run("diff", str(ckpt), str(other), "--json")
    assert differ.returncode == _cli.DAMAGED, differ.stderr
    found = json.loads(differ.stdout)
    assert found["equal"] is False
    assert {r["leaf"]: r["max_abs_diff"] for r in found["leaves"]}["params.kernel"] == 0.5

    # Safetensors export, read back by the safetensors package.
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    exported = run(
        "convert", str(ckpt), str(tmp_path / "st"), "--to", "safetensors", "--subtree", "params"
    )
    assert exported.returncode == 0, exported.stderr
    assert "ExportSummary" not in exported.stdout
    assert f"-> {tmp_path / 'st'}: 2 tensors, " in exported.stdout, exported.stdout
    again = run(
        "convert", str(ckpt), str(tmp_path / "st"), "--to", "safetensors", "--subtree", "params"
    )
    assert again.returncode == _cli.USAGE and "pass --overwrite" in again.stderr, again.stderr
    (shard,) = (tmp_path / "st").glob("*.safetensors")
    tensors = safetensors_numpy.load_file(str(shard))
    assert sorted(tensors) == ["bias", "kernel"] and np.array_equal(
        tensors["kernel"], np.ones((256, 128), np.float32)
    )
    bad = run(
        "convert", str(ckpt), str(tmp_path / "st2"), "--to", "safetensors", "--chunk-bytes", "10"
    )
    assert (
        bad.returncode == _cli.USAGE
        and "--chunk-bytes" in bad.stderr
        and not (tmp_path / "st2").exists()
    )
    for chunking in ("0", "x"):
        bad = run("convert", str(ckpt), str(tmp_path / "bad"), "--chunk-bytes", chunking)
        assert (
            bad.returncode == _cli.USAGE
            and "--chunk-bytes" in bad.stderr
            and not (tmp_path / "bad").exists()
        )
    # --chunk-bytes none: one chunk per shard; recorded as asked
    whole = run("convert", str(ckpt), str(tmp_path / "whole"), "--chunk-bytes", "none")
    assert whole.returncode == 0, whole.stderr
    record = json.loads(run("inspect", str(tmp_path / "whole"), "--json").stdout)
    kernel = next(
        leaf
        for leaf in record["checkpointables"]["state"]["leaves"]
        if leaf["path"] == "params.kernel"
    )
    assert kernel["chunk_shape"] == kernel["write_shape"]
    assert record["custom_metadata"]["milepost.convert"]["chunk_byte_size"] is None


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_inspect_ls_and_verify_on_object_stores(
    scheme: str, request: pytest.FixtureRequest
) -> None:
    from tests._object_stores import new_gcs_bucket, new_s3_bucket

    if scheme == "s3":
        endpoint, _ = request.getfixturevalue("s3_endpoint")
        root = f"s3://{new_s3_bucket(endpoint)}/run"
    else:
        root = f"gs://{new_gcs_bucket(request.getfixturevalue('gcs_endpoint'))}/run"
    with Checkpointer(root) as ckpt:
        ckpt.save(5, {"w": np.arange(64, dtype=np.float32).reshape(8, 8)}, metrics={"loss": 0.5})
    shown = run(
        "inspect", f"{root}/5", "--json"
    )  # the subprocess finds the endpoint in the environment
    assert shown.returncode == 0, shown.stderr
    (leaf,) = json.loads(shown.stdout)["checkpointables"]["state"]["leaves"]
    assert leaf["path"] == "w" and leaf["shape"] == [8, 8] and leaf["dtype"] == "float32"
    listed = json.loads(run("ls", root, "--json").stdout)
    assert [(r["step"], r["state"], r["metrics"]) for r in listed] == [
        (5, "committed", {"loss": 0.5})
    ]
    assert run("verify", f"{root}/5").returncode == _cli.OK
    assert run("inspect", f"{root}/6").returncode == _cli.NOT_FOUND
