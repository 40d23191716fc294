"""Every object a user looks at says what it holds: reprs and notebook tables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost.colocated import Traffic
from milepost.training import Checkpointer, KeepLatest
from milepost.workers import ShardingSpec
from tests._helpers import gate_merge


def _state(mesh: jax.sharding.Mesh) -> dict[str, Any]:
    return {
        "params": {
            "w": jax.device_put(
                np.ones((64, 32), np.float32), NamedSharding(mesh, P("data", "model"))
            ),
            "b": np.zeros(5, np.int8),
        },
        "step": 3,
        "run": "demo",
    }


def test_checkpoint_metadata_shows_every_leaf(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    mp.save(tmp_path / "c", _state(mesh24), custom_metadata={"owner": "me"})
    meta = mp.metadata(tmp_path / "c")
    text = repr(meta)
    assert text.startswith(f"CheckpointMetadata({str(tmp_path / 'c')!r})")
    for needle in (
        "committed:",
        "checkpointables: state (PyTreeHandler)",
        'custom_metadata: {"owner": "me"}',
        "state: 4 leaves, 3 arrays, 8.0 KiB",
        "params.w",
        "jax.Array",
        "(64, 32)",
        "float32",
        "P('data', 'model') on {data: 2, model: 4}",
        "(32, 8)",
        "8.0 KiB",
        "params.b",
        "int8",
        "5 B",
        "run",
        "string",
        "step",
        "int64",
    ):
        assert needle in text, (needle, text)
    assert meta.nbytes == 64 * 32 * 4 + 5 + 8
    assert [leaf.name for leaf in meta.leaves()] == ["params.b", "params.w", "run", "step"]
    page = meta._repr_html_()
    assert (
        page.count("<tr>") >= 4 + 5
        and "params.w" in page
        and "P(&#x27;data&#x27;, &#x27;model&#x27;)" in page
    )


def test_leaf_metadata_says_type_shape_bytes_and_layout(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    mp.save(tmp_path / "c", _state(mesh24), custom_metadata={"owner": "me"})
    tree = mp.metadata(tmp_path / "c").tree
    w = tree["params"]["w"]
    assert w.nbytes == 64 * 32 * 4
    assert repr(w) == (
        "LeafMetadata('params.w': jax.Array float32(64, 32), 8.0 KiB, "
        "sharding=P('data', 'model') on {data: 2, model: 4}, "
        "write_shape=(32, 8))"
    )
    assert repr(tree["run"]) == "LeafMetadata('run': string)" and tree["run"].nbytes is None
    assert "params.w" in w._repr_html_()


def test_save_handle_says_how_far_it_got(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mesh24: jax.sharding.Mesh
) -> None:
    gate = gate_merge(monkeypatch)
    handle = mp.save_async(tmp_path / "c", _state(mesh24))
    assert repr(handle).startswith(f"SaveHandle({str(tmp_path / 'c')!r}, running: ")
    assert "of 8.0 KiB written" in repr(handle)
    gate.set()
    handle.result(timeout=60)
    assert "committed: 8.0 KiB in" in repr(handle) and " s, blocking" in repr(handle)
    assert "B/s" not in repr(handle)  # no rate under 1 MiB
    assert "committed" in handle._repr_html_()


class _FakeSliceGroup:
    """What a Slice's views read of its host group (no Ray needed)."""

    hosts = 2
    healthy = True
    device_ids_by_host = [[0, 1], [2048, 2049]]
    device_ids = [0, 1, 2048, 2049]

    def identities(self) -> list[dict[str, Any]]:
        return [
            {"node": "a" * 20, "ip": "10.0.0.1", "pid": 11},
            {"node": "b" * 20, "ip": "10.0.0.2", "pid": 22},
        ]

    def traffic(self) -> Traffic:
        return Traffic(messages=3, bytes_to_hosts=1000, bytes_from_hosts=24)

    def release(self, array_id: str) -> None:
        pass


def test_slice_and_remote_array_show_hosts_devices_and_sharding() -> None:
    group = _FakeSliceGroup()
    s = mp.Slice(group, None, mp.SliceOptions())  # type: ignore[arg-type]
    assert repr(s) == (
        "Slice(2 hosts x 2 devices each, healthy; host 0: 10.0.0.1 pid 11, devices [0, 1]; "
        "host 1: 10.0.0.2 pid 22, devices [2048, 2049])"
    )
    page = s._repr_html_()
    assert "2048, 2049" in page and "10.0.0.2" in page and "3 messages" in page
    spec = ShardingSpec.named((2, 2), ("data", "model"), (0, 1, 2048, 2049), ("data",))
    x = mp.RemoteArray(group, "id-1", (64, 32), "float32", spec)
    assert repr(x) == (
        "RemoteArray(float32(64, 32), 8.0 KiB, sharding=P('data') on {data: 2, model: 2}, "
        "shard shape (32, 32))"
    )
    assert "2048" in x._repr_html_() and "id-1" in x._repr_html_()


def test_checkpointer_shows_its_steps(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "root", local=tmp_path / "fast", keep=KeepLatest(n=3)) as ckpt:
        for step in range(3):
            ckpt.save(step, {"x": np.arange(3)}, metrics={"loss": 1.0 / (step + 1), "acc": step})
        ckpt.wait()
        text = repr(ckpt)
        assert text.startswith(
            f"Checkpointer({str(tmp_path / 'root')!r}, local={str(tmp_path / 'fast')!r}): "
            "3 steps, latest 2"
        )
        assert "keep=KeepLatest(n=3)" in text and "local_keep=KeepLatest(n=2)" in text
        header, *rows = text.splitlines()[1:]
        assert header.split() == ["step", "tier", "state", "acc", "loss"]
        lines = [r.split() for r in rows if r and r[0].isdigit()]
        assert lines[0][:3] == ["0", "durable", "committed"] and lines[0][-1] == "1"
        assert (
            lines[2][:5] == ["2", "local", "+", "durable", "committed"]
            and lines[2][-1] == "0.333333"
        )
        page = ckpt._repr_html_()
        assert "<th style='text-align:left'>loss</th>" in page and "local + durable" in page


def test_checkpointer_shows_a_step_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = gate_merge(monkeypatch)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(5, {"x": np.arange(3)})
        rows = [line.split() for line in repr(ckpt).splitlines()[3:]]
        assert rows == [["5", "-", "saving"]], repr(ckpt)
        gate.set()


def test_every_public_name_has_a_docstring() -> None:
    import inspect

    import milepost.safetensors
    import milepost.surgery
    import milepost.training

    missing = []
    for module in (mp, milepost.training, milepost.surgery, milepost.safetensors):
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.ismodule(obj) or obj is mp.PLACEHOLDER:
                continue
            doc = inspect.getdoc(obj) or ""
            if not doc.strip() or doc.startswith(
                f"{name}("
            ):  # absent, or a dataclass's generated signature
                missing.append(f"{module.__name__}.{name}")
    assert not missing, missing
    assert len((inspect.getdoc(mp.save) or "").splitlines()) > 5
