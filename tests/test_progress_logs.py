"""Progress bars (off by default, bytes advancing when on, per-host acks in a slice) and the log
lines of saves, loads, verifies and the Checkpointer."""

from __future__ import annotations

import io
import logging
import re
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost import _progress
from milepost.training import Checkpointer, KeepLatest, Preemption
from milepost.workers import SaveAck
from milepost.workers import _progress as sink
from tests._helpers import tensorstore_writes_only


class Terminal(io.StringIO):
    """A captured stream that says it is a terminal, so the bar is redrawn in place."""

    def isatty(self) -> bool:
        return True


def _state(mesh: jax.sharding.Mesh, arrays: int = 8, rows: int = 512) -> dict:
    sharding = NamedSharding(mesh, P("data", "model"))
    return {
        "params": {
            f"w{i}": jax.device_put(np.full((rows, 1024), i, np.float32), sharding)
            for i in range(arrays)
        },
        "step": 7,
        "note": "x",
    }


def _frames(text: str) -> list[tuple[float, float]]:
    """Every ``done/total MiB`` a bar drew, in order."""
    return [(float(a), float(b)) for a, b in re.findall(r"([\d.]+)/([\d.]+) MiB", text)]


def _advancing(frames: list[tuple[float, float]], total_mib: float) -> None:
    done = [d for d, _ in frames]
    assert len(set(done)) >= 3, frames  # it moved, not just 0 and done
    assert done == sorted(done), frames
    assert done[-1] == total_mib and frames[-1][1] == total_mib, frames


def test_save_load_verify_bars_show_bytes_advancing(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    state = _state(mesh24)  # 16 MiB in 8 arrays of 64 chunks each
    for kind in ("save", "load", "verify"):
        stream = Terminal()
        with mp.Context(progress=mp.ProgressOptions(file=stream, delay_secs=0, refresh_secs=0)):
            if kind == "save":
                # (shards written by TensorStore, each counted once durable: small ones are
                # packed, one write for all, counted at once: test_a_packed_save_counts_its_bytes)
                with tensorstore_writes_only():
                    mp.save_async(tmp_path / "c", state).result()
            elif kind == "load":
                mp.load(tmp_path / "c")
            else:
                assert mp.verify(tmp_path / "c").ok
        text = stream.getvalue()
        assert f"{kind} c" in text, text[-500:]
        _advancing(_frames(text), 16.0)


def test_surgery_bars_count_every_byte_read_and_written_from_the_start(
    tmp_path: Path, mesh24: jax.sharding.Mesh
) -> None:
    from milepost import surgery as ms

    mp.save(tmp_path / "c", _state(mesh24))  # 16 MiB of float32
    stream = Terminal()
    with mp.Context(progress=mp.ProgressOptions(file=stream, delay_secs=0, refresh_secs=0)):
        ms.write(
            tmp_path / "half",
            ms.cast(ms.open(tmp_path / "c").tree, np.float16),
            memory_budget_bytes=4 << 20,
        )
    frames = _frames(stream.getvalue())
    assert {t for _, t in frames} == {24.0}, (
        frames
    )  # 16 MiB read + 8 MiB written, known before the first group
    _advancing(frames, 24.0)
    stream = Terminal()
    with mp.Context(progress=mp.ProgressOptions(file=stream, delay_secs=0, refresh_secs=0)):
        ms.stats(ms.open(tmp_path / "c").tree, memory_budget_bytes=4 << 20)
    assert "stats c" in stream.getvalue()
    _advancing(_frames(stream.getvalue()), 16.0)


def test_progress_is_off_by_default_and_waits_for_its_delay(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    mp.save(tmp_path / "a", {"x": np.arange(1000)})
    mp.load(tmp_path / "a")
    assert capfd.readouterr().err == ""
    stream = Terminal()
    with mp.Context(progress=mp.ProgressOptions(file=stream, delay_secs=60)):
        mp.save(tmp_path / "b", {"x": np.arange(1000)})
    assert stream.getvalue() == ""  # quicker than its delay: nothing drawn
    with mp.Context(progress=True), mp.Context(progress=False):
        mp.save(tmp_path / "c", {"x": np.arange(1000)})
    assert capfd.readouterr().err == ""


def test_a_file_gets_only_the_final_line(tmp_path: Path, mesh24: jax.sharding.Mesh) -> None:
    stream = io.StringIO()  # not a terminal: no redrawing
    with mp.Context(progress=mp.ProgressOptions(file=stream, delay_secs=0, refresh_secs=0)):
        mp.save(tmp_path / "c", _state(mesh24, arrays=2))
    assert _frames(stream.getvalue()) == [(4.0, 4.0)], stream.getvalue()


def test_progress_options_are_checked() -> None:
    with pytest.raises(ValueError, match="delay_secs"):
        mp.ProgressOptions(delay_secs=-1)
    with pytest.raises(TypeError, match="refresh_secs"):
        mp.ProgressOptions(refresh_secs="fast")
    with pytest.raises(TypeError, match="text stream"):
        mp.ProgressOptions(file=3)
    with pytest.raises(TypeError, match="progress"):
        mp.Context(progress="yes")  # type: ignore[arg-type]


def test_a_slice_counts_each_host_as_its_ack_arrives() -> None:
    """The controller of a slice has no engine of its own for the hosts' bytes: a host group
    reports each host's ack (SaveAck.bytes_written, LoadAck.bytes_read) as it arrives."""
    op = _progress.Operation("save", Path("/x/c"), None)
    op.expect(300)
    with op.active():
        sink.acked(0, SaveAck(process_index=0, bytes_written=100, arrays=()))
        assert op.done == 100
        sink.acked(1, SaveAck(process_index=1, bytes_written=120, arrays=()))
        sink.acked(
            1, SaveAck(process_index=1, bytes_written=120, arrays=())
        )  # the same host again: not twice
        sink.acked(2, "a token, not an ack")
    assert op.done == 220
    sink.acked(3, SaveAck(process_index=3, bytes_written=80, arrays=()))  # no sink outside: ignored
    op.close(ok=True)
    assert op.done == 300 and "300 B in" in op.summary()


def test_rates_in_units_that_read() -> None:
    """A rate in GB/s down to 1 GB/s, then MB/s; none for operations under 1 MiB."""
    assert _progress.rate_str(1.28e9) == "1.28 GB/s" and _progress.rate_str(85.3e6) == "85.3 MB/s"
    assert _progress.rate_str(2.5e5) == "0.25 MB/s"
    small = _progress.Operation("save", Path("/x/c"), None)
    small.expect(8 << 10)
    small.close(ok=True)
    assert re.fullmatch(r"8\.0 KiB in [\d.]+ s", small.summary()), small.summary()
    large = _progress.Operation("load", Path("/x/c"), None)
    large.expect(4 << 20)
    large.close(ok=True)
    assert re.fullmatch(r"4\.0 MiB in [\d.]+ s \([\d.]+ [GM]B/s\)", large.summary())


def test_log_lines_at_info(
    tmp_path: Path, mesh24: jax.sharding.Mesh, caplog: pytest.LogCaptureFixture
) -> None:
    state = _state(mesh24, arrays=2)
    with caplog.at_level(logging.INFO, logger="milepost"):
        mp.save(tmp_path / "a", state)
        mp.save_async(tmp_path / "b", state).result()
        mp.load(tmp_path / "a")
        mp.verify(tmp_path / "b")
    lines = [r.getMessage() for r in caplog.records if r.name == "milepost"]
    pattern = r"{} {}: 4\.0 MiB in [\d.]+ s \([\d.]+ [GM]B/s\)"
    assert re.fullmatch(
        pattern.format("saved", re.escape(str(tmp_path / "a"))) + r", blocking [\d.]+ s", lines[0]
    ), lines
    assert re.fullmatch(
        pattern.format("saved", re.escape(str(tmp_path / "b"))) + r", blocking [\d.]+ s", lines[1]
    ), lines
    assert re.fullmatch(pattern.format("loaded", re.escape(str(tmp_path / "a"))), lines[2]), lines
    assert re.fullmatch(pattern.format("verified", re.escape(str(tmp_path / "b"))), lines[3]), lines
    assert len(lines) == 4
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="milepost"):
        mp.save(tmp_path / "c", state)
        mp.load(tmp_path / "c")
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any(m.startswith("save plan for") and "2 arrays on 1 hosts" in m for m in debug), debug
    assert any(m.startswith("load plan for") and "2 arrays read by 1 hosts" in m for m in debug), (
        debug
    )


def test_checkpointer_logs_its_decisions(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="milepost.training"):
        with Checkpointer(tmp_path, save_policy=Preemption(), keep=KeepLatest(n=1)) as ckpt:
            assert ckpt.save(0, {"x": np.arange(3)}, force=True)
            ckpt.wait()
            assert not ckpt.save(1, {"x": np.arange(3)})
            ckpt.preempt()
            assert ckpt.save(2, {"x": np.arange(3)}, metrics={"loss": 0.5})
            ckpt.wait()
    messages = [r.getMessage() for r in caplog.records if r.name == "milepost.training"]
    assert f"saved step 0 to {tmp_path}" in messages
    assert any(m.startswith("skipped step 1: the save policy") for m in messages), messages
    assert any(m.startswith("preempted: saving step 2") for m in messages), messages
    assert f"saved step 2 to {tmp_path} (loss=0.5)" in messages
    assert any(m.startswith("deleted steps [0] of") and "KeepLatest(n=1)" in m for m in messages), (
        messages
    )
    assert not any("milepost" in m.split(" ")[0] for m in messages), (
        messages
    )  # no logger name in the text
