"""The peer tier's node folder attacked as another user on the same machine would: folders they
own or may write to, links planted at every level, manifests that lie about their boxes; and
the runs a folder holds, listed and cleared (``milepost peers ls|clear``), never a live one.

Real folders and real modes. Another user is a folder given to uid 12345 with ``os.chown``
(these tests need root for that; they skip otherwise), and the ownership checks must refuse it.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import logging
import os
import pickle
import shutil
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from milepost import _cli
from milepost.training import (
    PeerRun,
    UnsafeFolderError,
    clear_peer_runs,
    list_peer_runs,
)
from milepost.workers import CorruptCheckpointError, peers

STRANGER = 12345


def _part(
    step: int = 1,
    owner: int = 0,
    token: str = "t",
    boxes: tuple[tuple[int, tuple[tuple[int, int], ...], int, int], ...] | None = None,
    dtypes: tuple[str, ...] = ("int16", "float32"),
    hosts: int = 2,
) -> tuple[peers.Part, np.ndarray]:
    """A part of 64 bytes: array 0 an int16 4x4 box, array 1 a float32 box of 8 (or ``boxes``),
    with every CRC32C right: only the layout can be wrong."""
    data = (np.arange(64, dtype=np.uint8) * 3 + owner).astype(np.uint8)
    staged = peers.Staged(
        step=step,
        owner=owner,
        token=token,
        hosts=hosts,
        dtypes=dtypes,
        boxes=list(boxes or ((0, ((0, 4), (0, 4)), 0, 32), (1, ((0, 8),), 32, 32))),
        data=data,
    )
    return staged.part(), data


def _needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a folder to another uid needs root")


@contextlib.contextmanager
def _umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


# -- the folder's name --------------------------------------------------------------------------
def test_user_and_node_placeholders_and_the_per_user_default() -> None:
    import pwd

    me = pwd.getpwuid(os.geteuid()).pw_name
    assert peers.user_name() == me
    root = peers.run_folder("/dev/shm/milepost-{user}/{node}", "run-1", "n0")
    assert root == Path(f"/dev/shm/milepost-{me}/n0/run-1")
    assert peers.DEFAULT_FOLDER == "/dev/shm/milepost-{user}"
    assert peers.tier_folder() == Path(f"/dev/shm/milepost-{me}")
    with pytest.raises(ValueError, match="node"):
        peers.tier_folder("/dev/shm/x-{node}")
    with pytest.raises(ValueError, match="absolute"):
        peers.tier_folder("relative/{user}")


# -- modes --------------------------------------------------------------------------------------
@pytest.mark.parametrize("mask", [0o000, 0o277])
def test_folders_are_0700_and_files_0600_whatever_the_umask(tmp_path: Path, mask: int) -> None:
    root = tmp_path / "shm" / "node" / "run"
    part, data = _part()
    with _umask(mask):
        peers.write(root, part, data)
        peers.write(root, *_part(2))
    for folder in (tmp_path / "shm", tmp_path / "shm" / "node", root, root / "step_1"):
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700, folder
    folder = peers.part_folder(root, 1, 0)
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    for name in ("data", "manifest.json"):
        assert stat.S_IMODE(os.stat(folder / name).st_mode) == 0o600
    got, back = peers.read(root, 1, 0, "t")
    assert got == part and np.array_equal(back, data)


def test_a_run_folder_made_by_a_plain_mkdir_is_made_private(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with _umask(0o022):
        root.mkdir()  # 0755, as `Path.mkdir` leaves it
    peers.make_run_folder(root)
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700


# -- folders of another user, or writable by others --------------------------------------------
def _everything_refuses(root: Path, path: Path, why: str) -> None:
    """Every use of the run folder ``root`` raises UnsafeFolderError naming ``path``."""
    part, data = _part()
    calls = {
        "write": lambda: peers.write(root, part, data),
        "listing": lambda: peers.listing(root),
        "read": lambda: peers.read(root, 1, 0, "t"),
        "prune": lambda: peers.prune(root, set()),
        "make": lambda: peers.make_run_folder(root),
        "remove": lambda: peers.remove_run(root),
    }
    for name, call in calls.items():
        with pytest.raises(UnsafeFolderError) as e:
            call()
        assert e.value.path == str(path), name
        assert why in e.value.reason and why in str(e.value), name
        assert "PeerTier(path=" in str(e.value)


def test_a_tier_folder_another_user_made_first_is_refused(tmp_path: Path) -> None:
    """The attack of issue #43: a stranger makes the tier folder first (0777) and plants a part
    with the victim's token and right CRC32Cs. Nothing is written there, nothing read."""
    _needs_root()
    tier = tmp_path / "milepost-victim"
    root = tier / "run"
    peers.write(root, *_part(token="victim"))  # (the planted part: right CRCs, right token)
    os.chmod(tier, 0o777)
    for path in (tier, root, root / "step_1", peers.part_folder(root, 1, 0)):
        os.chown(path, STRANGER, STRANGER)
    _everything_refuses(root, tier, f"owned by uid {STRANGER}")
    os.chmod(tier, 0o700)  # theirs, even when no one else may write to it
    _everything_refuses(root, tier, f"owned by uid {STRANGER}")


def test_a_run_or_step_folder_of_another_user_is_refused(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    _needs_root()
    root = tmp_path / "tier" / "run"
    peers.write(root, *_part())
    os.chown(root / "step_1", STRANGER, STRANGER)
    with pytest.raises(UnsafeFolderError, match=f"uid {STRANGER}") as e:
        peers.write(root, *_part())
    assert e.value.path == str(root / "step_1")
    with pytest.raises(UnsafeFolderError):
        peers.read(root, 1, 0, "t")
    with caplog.at_level(logging.WARNING, logger="milepost.peers"):
        assert peers.listing(root) == []
    assert f"uid {STRANGER}" in caplog.text
    os.chown(root, STRANGER, STRANGER)
    _everything_refuses(root, root, f"owned by uid {STRANGER}")


@pytest.mark.parametrize("level", ["tier", "run"])
@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_a_folder_others_may_write_to_is_refused(tmp_path: Path, level: str, mode: int) -> None:
    tier = tmp_path / "tier"
    root = tier / "run"
    peers.write(root, *_part())
    path = tier if level == "tier" else root
    os.chmod(path, mode)
    _everything_refuses(root, path, f"writable by its group or others (mode {mode:04o})")
    assert peers.part_folder(root, 1, 0).is_dir()  # untouched (not pruned, not removed)


def test_the_folders_above_root_or_mine_sticky_or_not_writable_by_others(
    tmp_path: Path,
) -> None:
    """Above the tier folder: /dev/shm-like (1777, sticky) is fine; writable by others without
    the sticky bit, or another user's, is refused; so is another user's link on the way."""
    above = tmp_path / "above"
    above.mkdir()
    root = above / "tier" / "run"
    os.chmod(above, 0o1777)
    peers.write(root, *_part())
    assert peers.listing(root)
    os.chmod(above, 0o777)
    _everything_refuses(root, above, "without the sticky bit")
    os.chmod(above, 0o755)
    assert peers.listing(root)
    link = tmp_path / "link"
    link.symlink_to(above)  # mine: followed (a system's /var/run -> /run is root's)
    linked = link / "tier" / "run"
    assert [h.step for h in peers.listing(linked)] == [1]
    if os.geteuid() != 0:
        return
    os.lchown(link, STRANGER, STRANGER)
    _everything_refuses(linked, link, f"symbolic link owned by uid {STRANGER}")
    os.chown(above, STRANGER, STRANGER)
    _everything_refuses(root, above, f"owned by uid {STRANGER} (neither root nor you")


def test_a_refusal_survives_pickling_with_its_fields(tmp_path: Path) -> None:
    tier = tmp_path / "tier"
    tier.mkdir(mode=0o700)
    os.chmod(tier, 0o777)
    with pytest.raises(UnsafeFolderError) as e:
        peers.write(tier / "run", *_part())
    assert isinstance(e.value, PermissionError)
    back = pickle.loads(pickle.dumps(e.value))  # (a Ray host's error reaches the controller)
    assert (type(back), back.path, back.reason, str(back)) == (
        UnsafeFolderError,
        str(tier),
        e.value.reason,
        str(e.value),
    )


# -- links planted at every level ---------------------------------------------------------------
@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """A file a planted link points at (think /etc/shadow): never read, never written."""
    path = tmp_path / "secret"
    path.write_bytes(b"root:secret-hash:" * 4)
    return path


def test_a_run_folder_that_is_a_link_is_refused_and_its_target_untouched(
    tmp_path: Path,
) -> None:
    elsewhere = tmp_path / "elsewhere"
    peers.write(elsewhere, *_part())
    peers.release_run(elsewhere)
    before = sorted(p.name for p in elsewhere.rglob("*"))
    tier = tmp_path / "tier"
    tier.mkdir()
    (tier / "run").symlink_to(elsewhere)
    _everything_refuses(tier / "run", tier / "run", "symbolic link")
    assert sorted(p.name for p in elsewhere.rglob("*")) == before


def test_a_step_that_is_a_link_is_never_written_through(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    root = tmp_path / "tier" / "run"
    root.mkdir(parents=True)
    (root / "step_1").symlink_to(elsewhere)
    with pytest.raises(UnsafeFolderError, match="symbolic link") as e:
        peers.write(root, *_part())
    assert e.value.path == str(root / "step_1")
    assert list(elsewhere.iterdir()) == []
    with caplog.at_level(logging.WARNING, logger="milepost.peers"):
        assert peers.listing(root) == []
        peers.prune(root, set())
    assert caplog.text.count("symbolic link") == 2
    assert (root / "step_1").is_symlink() and elsewhere.is_dir()


def test_a_part_that_is_a_link_is_not_read_and_is_replaced_not_followed(
    tmp_path: Path, caplog
) -> None:  # type: ignore[no-untyped-def]
    elsewhere = tmp_path / "elsewhere"
    peers.write(elsewhere, *_part(token="theirs"))
    root = tmp_path / "tier" / "run"
    (root / "step_1").mkdir(parents=True)
    (root / "step_1" / "owner_0").symlink_to(peers.part_folder(elsewhere, 1, 0))
    with caplog.at_level(logging.WARNING, logger="milepost.peers"):
        assert peers.listing(root) == []
    assert "symbolic link" in caplog.text
    with pytest.raises(UnsafeFolderError, match="symbolic link"):
        peers.read(root, 1, 0, "theirs")
    part, data = _part(token="mine")
    peers.write(root, part, data)  # the link is moved aside and removed, its target kept
    assert not peers.part_folder(root, 1, 0).is_symlink()
    assert peers.read(root, 1, 0, "mine")[0] == part
    assert [h.token for h in peers.listing(elsewhere)] == ["theirs"]
    assert sorted(p.name for p in (root / "step_1").iterdir()) == ["owner_0"]


@pytest.mark.parametrize("name", ["data", "manifest.json"])
def test_a_file_that_is_a_link_is_never_read(tmp_path: Path, secret: Path, name: str) -> None:
    root = tmp_path / "run"
    peers.write(root, *_part())
    target = peers.part_folder(root, 1, 0) / name
    if name == "data":  # a link to a file of the right size: its bytes would be returned
        secret.write_bytes(target.read_bytes()[::-1])
    target.unlink()
    target.symlink_to(secret)
    with pytest.raises(UnsafeFolderError, match="symbolic link") as e:
        peers.read(root, 1, 0, "t")
    assert e.value.path == str(target)
    if name == "manifest.json":
        assert peers.listing(root) == []


def test_a_fifo_in_place_of_the_data_is_refused_without_waiting(tmp_path: Path) -> None:
    root = tmp_path / "run"
    peers.write(root, *_part())
    data = peers.part_folder(root, 1, 0) / "data"
    data.unlink()
    os.mkfifo(data)
    with pytest.raises(UnsafeFolderError, match="not a plain file"):
        peers.read(root, 1, 0, "t")


def test_removal_never_follows_a_link(tmp_path: Path, secret: Path) -> None:
    keep = tmp_path / "keep"
    peers.write(keep, *_part())
    peers.release_run(keep)
    root = tmp_path / "tier" / "run"
    peers.write(root, *_part(2))
    (root / "step_1").symlink_to(keep / "step_1")
    (root / "step_2" / "owner_1").symlink_to(keep / "step_1" / "owner_0")
    (peers.part_folder(root, 2, 0) / "extra").symlink_to(secret)
    peers.prune(root, {2})  # step_1 (a link) is passed over
    assert (keep / "step_1" / "owner_0" / "data").exists()
    assert peers.remove_run(root) is True
    assert not root.exists() and (tmp_path / "tier").is_dir()
    assert peers.listing(keep) == [peers.Held(step=1, owner=0, token="t", nbytes=64)]
    assert secret.read_bytes() == b"root:secret-hash:" * 4


# -- manifests that lie -------------------------------------------------------------------------
LIES = {
    # array 1 claims array 0's bytes: the values would come back silently wrong
    "overlap": dict(boxes=((0, ((0, 4), (0, 4)), 0, 32), (1, ((0, 8),), 0, 32))),
    "outside": dict(boxes=((0, ((0, 4), (0, 4)), 0, 32), (1, ((0, 8),), 48, 32))),
    "negative offset": dict(boxes=((0, ((0, 4), (0, 4)), -32, 32), (1, ((0, 8),), 32, 32))),
    "wrong length": dict(dtypes=("float32", "float32")),  # 4x4 float32 is 64 bytes, not 32
    "unknown dtype": dict(dtypes=("object", "float32")),
    "record dtype": dict(dtypes=("V2", "float32")),
    "not canonical": dict(dtypes=("i2", "float32")),
    "reversed extent": dict(boxes=((0, ((4, 0), (0, 4)), 0, 32), (1, ((0, 8),), 32, 32))),
    "no such array": dict(boxes=((0, ((0, 4), (0, 4)), 0, 32), (2, ((0, 8),), 32, 32))),
    "repeated box": dict(
        boxes=((1, ((0, 8),), 0, 32), (1, ((0, 8),), 32, 32)), dtypes=("int16", "float32")
    ),
    "ranks differ": dict(boxes=((1, ((0, 8),), 0, 32), (1, ((0, 2), (0, 4)), 32, 32))),
    "owner not a host": dict(hosts=0),
}
WHY = {
    "overlap": "box 1 (array 1, ((0, 8),)) overlaps its box 0",
    "outside": "box 1 (array 1, ((0, 8),)) lies outside the data (bytes 48 to 80 of 64)",
    "negative offset": "box 0 (array 0, ((0, 4), (0, 4))) lies outside",
    "wrong length": "box 0 (array 0, ((0, 4), (0, 4))) says 32 bytes; its shape and dtype "
    "(float32) make 64",
    "unknown dtype": "array 0's dtype 'object' is not one milepost writes",
    "record dtype": "array 0's dtype 'V2' is not one milepost writes",
    "not canonical": "array 0's dtype 'i2' is not one milepost writes",
    "reversed extent": "box 0 (array 0, ((4, 0), (0, 4))) has a negative or reversed extent",
    "no such array": "box 1 (array 2, ((0, 8),)) is of an array it does not hold",
    "repeated box": "box 1 (array 1, ((0, 8),)) repeats another box",
    "ranks differ": "box 1 (array 1, ((0, 2), (0, 4))) has 2 dimensions",
    "owner not a host": "its owner 0 is not one of its 0 hosts",
}


@pytest.mark.parametrize("lie", sorted(LIES))
def test_a_manifest_whose_boxes_lie_is_refused_naming_the_box(tmp_path: Path, lie: str) -> None:
    part, data = _part(**LIES[lie])  # type: ignore[arg-type]
    assert part.nbytes == data.size  # sizes agree and every CRC32C is right: only the layout lies
    with pytest.raises(CorruptCheckpointError) as e:
        peers.check(part, data, "sent to host 1")  # a copy from a peer
    assert WHY[lie] in str(e.value) and e.value.path == "sent to host 1"
    root = tmp_path / "run"
    peers.write(root, part, data)
    assert peers.listing(root) == []  # never offered to a recovery
    for checked in (True, False):
        with pytest.raises(CorruptCheckpointError, match="it is not used"):
            peers.read(root, 1, 0, "t", checked=checked)


def test_a_true_manifest_of_every_kind_of_dtype_passes(tmp_path: Path) -> None:
    """bfloat16, float8, int4 (ml_dtypes), bool, complex and typed PRNG keys (uint32 words)."""
    boxes = (
        (0, ((0, 4),), 0, 8),  # bfloat16
        (1, ((0, 8),), 8, 8),  # float8_e4m3fn
        (2, ((0, 8),), 16, 8),  # int4 (a byte each)
        (3, ((0, 8),), 24, 8),  # bool
        (4, ((0, 2), (0, 2)), 32, 16),  # key<threefry2x32>: 2 keys of 2 words
        (5, ((0, 1),), 48, 16),  # complex128
        (6, ((0, 0),), 64, 0),  # an empty box
    )
    dtypes = ("bfloat16", "float8_e4m3fn", "int4", "bool", "key<threefry2x32>", "complex128")
    data = np.arange(64, dtype=np.uint8)
    staged = peers.Staged(
        step=1,
        owner=0,
        token="t",
        hosts=1,
        dtypes=(*dtypes, "float32"),
        boxes=list(boxes),
        data=data,
    )
    part = staged.part()
    peers.check(part, data, "here")
    peers.write(tmp_path / "run", part, data)
    assert [h.nbytes for h in peers.listing(tmp_path / "run")] == [64]


# -- the runs of a folder: listed, removed, cleared ---------------------------------------------
def _age(root: Path, secs: float) -> None:
    """Make the run ``root`` look unchanged for ``secs``."""
    when = os.stat(root).st_mtime - secs
    for path in (root, *root.iterdir()):
        os.utime(path, (when, when), follow_symlinks=False)


def test_list_shows_each_run_with_its_size_steps_age_and_whether_it_is_used(
    tmp_path: Path, caplog
) -> None:  # type: ignore[no-untyped-def]
    tier = tmp_path / "tier"
    big = np.arange(1 << 16, dtype=np.uint8)
    staged = peers.Staged(
        step=7,
        owner=0,
        token="t",
        hosts=1,
        dtypes=("uint8",),
        boxes=[(0, ((0, 1 << 16),), 0, 1 << 16)],
        data=big,
    )
    peers.write(tier / "run-big", staged.part(), big)
    peers.write(tier / "run-old", *_part(3))
    peers.write(tier / "run-old", *_part(4))
    peers.release_run(tier / "run-old")
    _age(tier / "run-old", 7200)
    (tier / "stray-link").symlink_to(tmp_path)
    with caplog.at_level(logging.WARNING, logger="milepost.peers"):
        runs = list_peer_runs(tier)
    assert "'stray-link'" in caplog.text
    assert [r.name for r in runs] == ["run-old", "run-big"]  # oldest change first
    old, new = runs
    manifests = sum(os.path.getsize(p) for p in tier.rglob("manifest.json") if "run-old" in str(p))
    assert (old.steps, old.newest_step, old.live, old.nbytes) == ((3, 4), 4, False, 128 + manifests)
    assert 7200 <= old.age_secs < 7200 + 3600 and old.path == tier / "run-old"
    assert new.live and new.steps == (7,) and new.nbytes > 1 << 16 and new.age_secs < 3600
    assert list_peer_runs(tmp_path / "nothing-here") == []
    assert isinstance(old, PeerRun)


def test_clear_removes_only_stale_runs_never_a_live_one(tmp_path: Path) -> None:
    tier = tmp_path / "tier"
    for run in ("live-old", "stale-old", "stale-new"):
        peers.write(tier / run, *_part())
    for run in ("stale-old", "stale-new"):
        peers.release_run(tier / run)
    for run in ("live-old", "stale-old"):
        _age(tier / run, 3 * 86400)
    assert [r.name for r in clear_peer_runs(tier, older_than_secs=86400, dry_run=True)] == [
        "stale-old"
    ]
    assert sorted(p.name for p in tier.iterdir()) == ["live-old", "stale-new", "stale-old"]
    assert [r.name for r in clear_peer_runs(tier, older_than_secs=86400)] == ["stale-old"]
    assert [r.name for r in clear_peer_runs(tier, older_than_secs=0)] == ["stale-new"]
    assert sorted(p.name for p in tier.iterdir()) == ["live-old"]  # held by this process
    assert clear_peer_runs(tier, older_than_secs=0) == []
    peers.release_run(tier / "live-old")
    assert [r.name for r in clear_peer_runs(tier, older_than_secs=0)] == ["live-old"]
    with pytest.raises(ValueError, match="older_than_secs"):
        clear_peer_runs(tier, older_than_secs=-1)


def test_a_run_another_process_holds_is_live_and_the_last_process_removes_it(
    tmp_path: Path,
) -> None:
    """Two processes of one run on a node: the first to close leaves the folder to the other;
    a clear never takes it while either holds it."""
    root = tmp_path / "tier" / "run"
    peers.write(root, *_part())
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from milepost.workers import peers; "
            "print(len(peers.listing(Path(sys.argv[1]))), flush=True); sys.stdin.read()",
            str(root),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "1"
        assert peers.remove_run(root) is False  # the other process still holds it
        assert root.is_dir()
        (run,) = list_peer_runs(root.parent)
        assert run.live
        assert clear_peer_runs(root.parent, older_than_secs=0) == []
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(60)
    assert not list_peer_runs(root.parent)[0].live  # its process ended: it let go
    assert peers.remove_run(root) is True and not root.exists()
    assert peers.remove_run(root) is True  # (nothing there)


def test_a_run_removed_under_a_writer_is_made_again_and_held_again(tmp_path: Path) -> None:
    root = tmp_path / "tier" / "run"
    peers.write(root, *_part(1))
    shutil.rmtree(root)  # by hand (or a node's folder lost)
    peers.write(root, *_part(2))
    (run,) = list_peer_runs(root.parent)
    assert run.live and run.steps == (2,)


def test_a_writer_waits_for_a_clear_then_makes_a_fresh_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lock protocol: while a clear holds a run (its exclusive lock), a writer is not let
    in; once the clear removed it, the writer makes the run again and holds the new one."""
    root = tmp_path / "tier" / "run"
    peers.write(root, *_part(1))
    peers.release_run(root)
    blocked = threading.Event()
    flock = fcntl.flock

    def watched(fd: int, op: int) -> None:
        try:
            flock(fd, op)
        except BlockingIOError:
            if op & fcntl.LOCK_SH:
                blocked.set()
            raise

    monkeypatch.setattr(peers._folder.fcntl, "flock", watched)
    clearing = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(clearing, fcntl.LOCK_EX)  # what a clear holds while it removes the run
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            peers.write(root, *_part(2))
        except BaseException as e:  # (re-raised below)
            errors.append(e)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        assert blocked.wait(60)  # the writer is kept out
        shutil.rmtree(root)  # the clear removes the run
    finally:
        os.close(clearing)  # and lets go
        thread.join(60)
    assert not errors and not thread.is_alive()
    assert [h.step for h in peers.listing(root)] == [2]  # a fresh run, with the new part only
    (run,) = list_peer_runs(root.parent)
    assert run.live


# -- the command --------------------------------------------------------------------------------
def _cli_run(
    capsys: pytest.CaptureFixture[str], *args: str, answer: str | None = None
) -> tuple[int, str, str]:
    stdin = sys.stdin
    if answer is not None:
        sys.stdin = io.StringIO(answer)
    try:
        code = _cli.main(list(args))
    finally:
        sys.stdin = stdin
    out = capsys.readouterr()
    return code, out.out, out.err


def test_peers_ls_and_clear_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tier = tmp_path / "tier"
    odd = "x\x1b[2Jy\nz[bold]"  # a name that would clear a terminal, break a line, mark up
    for run in ("run-live", "run-stale", odd):
        peers.write(tier / run, *_part())
    for run in ("run-stale", odd):
        peers.release_run(tier / run)
        _age(tier / run, 2 * 3600)
    code, out, _ = _cli_run(capsys, "peers", "ls", str(tier))
    assert code == _cli.OK
    assert "3 runs" in out and "1 in use" in out and "in use" in out
    assert "x\\x1b[2Jy\\nz[bold]" in out and "\x1b" not in out
    assert "B " in out and "2 h 0 min" in out
    listed = json.loads(_cli_run(capsys, "peers", "ls", str(tier), "--json")[1])
    assert {r["name"]: r["live"] for r in listed} == {
        "run-live": True,
        "run-stale": False,
        odd: False,
    }
    code, out, _ = _cli_run(capsys, "peers", "clear", str(tier), "--older-than", "1h", answer="n\n")
    assert code == _cli.OK and "2 stale runs" in out and "nothing removed" in out
    code, _, err = _cli_run(capsys, "peers", "clear", str(tier), "--older-than", "1h", answer="")
    assert code == _cli.USAGE and "pass --yes" in err
    assert len(list(tier.iterdir())) == 3
    code, out, _ = _cli_run(capsys, "peers", "clear", str(tier), "--older-than", "3h", "--yes")
    assert code == _cli.OK and "no stale run" in out
    code, out, _ = _cli_run(
        capsys, "peers", "clear", str(tier), "--older-than", "90m", answer="y\n"
    )
    assert code == _cli.OK and "removed 2 runs" in out
    assert [p.name for p in tier.iterdir()] == ["run-live"]
    code, _, err = _cli_run(capsys, "peers", "clear", str(tier), "--older-than", "soon")
    assert code == _cli.USAGE and "90s, 30m, 1h or 2d" in err
    os.chmod(tier, 0o777)
    code, _, err = _cli_run(capsys, "peers", "ls", str(tier))
    assert code == _cli.FAILED and "UnsafeFolderError" in err and "writable" in err
    os.chmod(tier, 0o700)
