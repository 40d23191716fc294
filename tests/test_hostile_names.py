"""Names from hostile files: a checkpoint whose leaf names, metric names and values and custom
metadata hold terminal escapes, C1 controls, DEL, bidirectional overrides, rich markup and
'.'s. The real ``milepost`` command (a subprocess), reprs, notebook HTML, log lines and error
messages show them as visible escapes, never raw; ``stats``, ``diff`` and surgery address every
one of them."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import pkgutil
import re
import shutil
import subprocess
import sys
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import milepost as mp
from milepost import surgery as ms
from milepost import workers
from milepost.training import Checkpointer

SCRIPT = Path(sys.executable).with_name("milepost")
ENTRY = [str(SCRIPT)] if SCRIPT.exists() else [shutil.which("milepost") or "milepost"]

CLEAR = "\x1b[2J\x1b[H\x1b[32mOK: checkpoint verified\x1b[8m"
"""Clears the screen, homes the cursor, prints a green verdict, hides what follows."""
C1 = "\x9b31mred\x7f"  # CSI as one C1 byte, then DEL
BIDI = "\u202egnp.exe\u2066x\u2069\u200e\u061c"  # shows as 'exe.png'; and a '.' in the key
MARKUP = "[bold red]x :smile:"
NEWLINE = "x\nchecked: sound"
READABLE = "中文é"
DOTTED = "a.b"

SHOWN_CLEAR = r"\x1b[2J\x1b[H\x1b[32mOK: checkpoint verified\x1b[8m"
SHOWN_BIDI = r"\u202egnp\.exe\u2066x\u2069\u200e\u061c"  # (a path: its '.' escaped too)

RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2066-\u2069]")
"""What must never reach a terminal (newlines between lines aside)."""


def clean(text: str) -> str:
    """``text``, asserted free of raw control and bidirectional characters."""
    found = RAW.findall(text)
    assert not found, (found, text)
    return text


def run(*args: str) -> tuple[int, str, str]:
    """The command in a subprocess; its output bytes must be UTF-8 (no lone surrogates)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run([*ENTRY, *args], capture_output=True, timeout=120, env=env)
    assert b"\x1b" not in done.stdout + done.stderr
    return done.returncode, done.stdout.decode(), done.stderr.decode()


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hostile")
    params = {
        CLEAR: np.arange(3, dtype=np.float32),
        C1: np.ones(2, np.float32),
        BIDI: np.full(2, 3, np.float32),
        MARKUP: np.zeros(1, np.float32),
        NEWLINE: np.ones(1, np.float32),
        READABLE: np.arange(2, dtype=np.int32),
        DOTTED: np.arange(4, dtype=np.float32),
    }
    mp.save_checkpointables(
        root / "ckpt",
        {"state": {"params": params}},
        custom_metadata={CLEAR: CLEAR + BIDI, "run": MARKUP},
        metrics={CLEAR: C1, "loss\u202e": 0.5},
    )
    with Checkpointer(root / "run") as ckptr:
        ckptr.save(1, {"w": np.ones(2, np.float32)}, metrics={CLEAR: CLEAR, C1: 1.5}, force=True)
    return root


# ------------------------------------------------------------------------------------------
# The escaping itself
# ------------------------------------------------------------------------------------------


def test_printable_escapes_what_repr_escapes_and_keeps_readable_text() -> None:
    for code in [*range(0x20), 0x7F, *range(0x80, 0xA0), 0x202A, 0x202E, 0x2066, 0x2069]:
        shown = workers.printable(f"a{chr(code)}b")
        assert chr(code) not in shown and shown.startswith("a\\") and shown.endswith("b")
    for char in ("\u200e", "\u200f", "\u061c", "\u2028", "\u2029", "\ue000", "\udcff", "\xa0"):
        assert workers.printable(char) == ascii(char)[1:-1], unicodedata.name(char, "?")
    assert workers.printable("\U000e0041") == "\\U000e0041"  # a tag character (Cf)
    assert workers.printable(READABLE + " ok [x]\\") == READABLE + " ok [x]\\"
    assert workers.printable(CLEAR) == SHOWN_CLEAR
    text = CLEAR + BIDI + NEWLINE + C1 + "\udcff\U000e0041\t\r"
    shown = workers.printable(text)
    assert workers.printable(shown) == shown  # idempotent: escaped twice shows the same
    assert workers.from_printable(shown) == text
    assert workers.printable("a\nb\x1b", newlines=True) == "a\nb\\x1b"
    assert workers.html_text("<b>\x1b</b>") == "&lt;b&gt;\\x1b&lt;/b&gt;"


# ------------------------------------------------------------------------------------------
# The command, as a user runs it
# ------------------------------------------------------------------------------------------


def test_inspect_shows_escapes(hostile: Path) -> None:
    code, out, err = run("inspect", str(hostile / "ckpt"))
    assert code == 0, err
    clean(out)
    for shown in (SHOWN_CLEAR, SHOWN_BIDI, r"\x9b31mred\x7f", r"x\nchecked: sound"):
        assert "params." + shown in out, (shown, out)
    assert f"params.{READABLE}" in out and "params.a\\.b" in out and MARKUP in out
    assert "\\u001b[2J" in out and "\\u202e" in out  # custom metadata and metrics, as JSON
    assert "\U0001f604" not in out  # no emoji code read


def test_ls_shows_escaped_metric_names_and_values(hostile: Path) -> None:
    code, out, err = run("ls", str(hostile / "run"))
    assert code == 0, err
    clean(out)
    assert out.count(SHOWN_CLEAR) == 2 and r"\x9b31mred\x7f" in out  # column and cell


def test_stats_and_diff_escape_and_address_every_name(hostile: Path) -> None:
    ckpt = str(hostile / "ckpt")
    leaves = ("--leaf", "params.a\\.b", "--leaf", "params." + SHOWN_CLEAR)
    code, out, err = run("stats", ckpt, *leaves, "--item", "st\\x61te")  # (--item decoded too)
    assert code == 0, err
    rows = [line.split()[0] for line in clean(out).splitlines()[2:]]
    assert rows == [f"params.{SHOWN_CLEAR.split()[0]}", "params.a\\.b"], out
    code, out, err = run(
        "diff",
        ckpt,
        ckpt,
        "--where",
        r"\x1b\[2J|\u202e",  # a regular expression: its escapes match the characters
        "--leaf",
        "params.a.b",  # a storage name
        "--leaf",
        r"params.x\nchecked: sound",  # a path as printed
    )
    assert code == 0, err
    assert "equal" in clean(out) and SHOWN_CLEAR in out and SHOWN_BIDI in out
    assert "params.a\\.b" in out and r"params.x\nchecked: sound" in out
    assert r"\x9b31m" not in out  # only what was chosen
    code, out, err = run("stats", ckpt, "--leaf", "nothing")
    assert code == 2 and clean(err).count("\n") == 1, err  # one line, the leaves escaped
    assert SHOWN_CLEAR in err and "x\\nchecked: sound" in err


def test_verify_and_error_lines_are_escaped(tmp_path: Path) -> None:
    with mp.Context(saving=mp.SaveOptions(use_ocdbt=False)):
        mp.save(tmp_path / "z", {CLEAR: np.arange(1000, dtype=np.float32)})
    (chunk,) = [p for p in (tmp_path / "z").rglob("*") if p.is_file() and p.parent.name == "c"]
    data = bytearray(chunk.read_bytes())
    data[10] ^= 0xFF
    chunk.write_bytes(bytes(data))
    code, out, err = run("verify", str(tmp_path / "z"))
    assert code == 1 and "\\x1b[2J" in clean(out), (out, err)
    code, out, err = run("stats", str(tmp_path / "z"), "--no-progress")
    assert code == 1 and "\\x1b[2J" in clean(err) and err.count("\n") == 1, err


# ------------------------------------------------------------------------------------------
# Reprs, notebook views, logs, errors
# ------------------------------------------------------------------------------------------


def test_reprs_and_html_escape_names(hostile: Path) -> None:
    meta = mp.metadata(hostile / "ckpt")
    leaf = meta.tree["params"][CLEAR]
    for text in (repr(leaf), leaf._repr_html_(), repr(meta), meta._repr_html_()):
        clean(text)
        assert SHOWN_CLEAR in text
    assert SHOWN_BIDI in repr(meta) and SHOWN_BIDI in meta._repr_html_()
    with Checkpointer(hostile / "run", read_only=True) as ckptr:
        for text in (repr(ckptr), ckptr._repr_html_()):
            assert SHOWN_CLEAR in clean(text)
    ck = ms.open(hostile / "ckpt")
    table = ms.stats(ck.tree, where=r"\x1b")
    found = ms.diff(ck.tree, ms.drop(ck.tree, "\u202e"))
    for text in (repr(ck), ck._repr_html_(), str(table), table._repr_html_(), str(found)):
        assert SHOWN_CLEAR in clean(text)
    assert SHOWN_BIDI in clean(str(found)) and SHOWN_BIDI in clean(found._repr_html_())
    assert "\x1b" not in repr(ck.tree["params"][CLEAR])


def test_handle_repr_escapes_its_path_and_error(tmp_path: Path) -> None:
    where = tmp_path / f"out{CLEAR}"
    handle = mp.save_async(where, {"w": np.ones(2, np.float32)})
    handle.result()
    for text in (repr(handle), handle._repr_html_()):
        assert "\\x1b[2J" in clean(text)


def test_log_lines_escape_names(
    hostile: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="milepost"), Checkpointer(tmp_path / "r") as ckptr:
        ckptr.save(3, {"w": np.ones(2, np.float32)}, metrics={CLEAR: 1.0}, force=True)
    saved = [r for r in caplog.records if "saved step 3" in r.getMessage()]
    assert saved and SHOWN_CLEAR in clean(saved[0].getMessage())
    # (formatted by a formatter of our own: Ray, once imported, formats captured lines with tabs)
    lines = logging.Formatter("%(levelname)s %(name)s: %(message)s")
    assert SHOWN_CLEAR in clean("\n".join(lines.format(r) for r in caplog.records))
    record = logging.LogRecord("milepost", logging.INFO, __file__, 1, "%s %d %r", None, None)
    record.args = (CLEAR, 7, BIDI)
    workers.PrintableLogs().filter(record)
    assert clean(record.getMessage()).startswith(SHOWN_CLEAR + " 7 '")


def test_every_milepost_logger_escapes() -> None:
    for found in pkgutil.walk_packages(mp.__path__, "milepost."):  # every module's logger
        if not found.name.endswith("__main__"):  # (which runs the command)
            with contextlib.suppress(ImportError):  # (one needing an optional package: ray)
                importlib.import_module(found.name)
    loggers: dict[str, Any] = {}
    for name, module in list(sys.modules.items()):
        if name.startswith("milepost"):
            for value in vars(module).values():
                if isinstance(value, logging.Logger) and value.name.startswith("milepost"):
                    loggers[value.name] = value
    assert "milepost" in loggers and "milepost.surgery" in loggers
    for name, logger in loggers.items():
        assert any(isinstance(f, workers.PrintableLogs) for f in logger.filters), name
        assert name in workers.LOGGERS, name


def test_corrupt_checkpoint_error_message_is_printable() -> None:
    error = workers.CorruptCheckpointError(f"array {CLEAR} is damaged", array=CLEAR)
    assert SHOWN_CLEAR in clean(str(error)) and error.array == CLEAR


# ------------------------------------------------------------------------------------------
# Surgery addresses every saved name, and writes it back
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("relink", [True, False])
def test_surgery_writes_dotted_and_hostile_keys_back(
    hostile: Path, tmp_path: Path, relink: bool
) -> None:
    ck = ms.open(hostile / "ckpt")
    assert "params.a\\.b" in ck.arrays and "params." + BIDI.replace(".", "\\.") in ck.arrays
    out = ms.write(tmp_path / "out", ck.tree, relink=relink)
    back = mp.load(out)["params"]
    assert set(back) == set(mp.load(hostile / "ckpt")["params"])
    np.testing.assert_array_equal(back[DOTTED], np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(back[CLEAR], np.arange(3, dtype=np.float32))
    renamed = ms.rename(ck.tree, {r"^params\.a\\\.b$": r"params.c\.d"})
    assert "c.d" in mp.load(ms.write(tmp_path / "renamed", renamed))["params"]


def test_stats_and_diff_take_paths_or_storage_names(hostile: Path) -> None:
    tree = ms.open(hostile / "ckpt").tree
    by_path = ms.stats(tree, leaves=["params.a\\.b"])
    by_storage = ms.stats(tree, leaves=["params.a.b"])
    assert by_path.rows == by_storage.rows and by_path["params.a\\.b"]["max"] == 3.0
    assert ms.stats(tree, leaves=[f"params.{CLEAR}"])[f"params.{CLEAR}"]["max"] == 2.0
    found = ms.diff(tree, tree, leaves=[f"params.{BIDI}"])  # a storage name with a '.'
    assert found.equal and [r[0] for r in found.table.rows] == [
        "params." + BIDI.replace(".", "\\.")
    ]
    with pytest.raises(ValueError, match="no array is named"):
        ms.stats(tree, leaves=["params.a"])
    x = tree["params"][DOTTED]
    both = {"a.b": x, "a": {"b": x}}  # a surgery's tree may hold both; a path tells them apart
    assert [r[0] for r in ms.stats(both, leaves=["a.b"]).rows] == ["a.b"]
    assert [r[0] for r in ms.stats(both, leaves=["a\\.b"]).rows] == ["a\\.b"]
    clash = {"a.b": {"c": x}, "a": {"b.c": x}}  # one storage name, neither's path
    with pytest.raises(ValueError, match="storage name of"):
        ms.stats(clash, leaves=["a.b.c"])
