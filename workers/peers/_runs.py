"""The runs a node's peer tier folder holds: listed with what they hold, removed when their run
ends, cleared when stale.

A run's folder stays in the node's memory until it is removed: by ``Checkpointer.close()`` (each
process of the run, through :func:`remove_run`), or here. A process that uses a run's folder
holds it (a shared ``flock`` on the folder, taken when it first writes or lists it; see
``_folder``): a held run is *live* and is never removed; a process that ends lets go of it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from milepost.workers import check
from milepost.workers.peers import _folder

log = logging.getLogger("milepost.peers")

DEFAULT_FOLDER = "/dev/shm/milepost-{user}"
"""The peer tier's folder on each node unless told otherwise: one per user (``{user}`` becomes
the user name of each host's process), in node-local memory."""
_STEP_PREFIX = "step_"
_MAX_DEPTH = 4  # run / step / part / file


@dataclass(frozen=True, kw_only=True)
class PeerRun:
    """A run's folder in a node's peer tier folder, as :func:`list_peer_runs` finds it."""

    name: str
    """The folder's name (``run-`` and a hash of the run's root); print it escaped: it comes
    from a folder's listing."""
    path: Path
    """The run's folder in the node's memory."""
    nbytes: int
    """Bytes of its files: what it holds in the node's memory."""
    steps: tuple[int, ...]
    """The steps of which it holds a part, oldest first."""
    modified: float
    """When a part was last written or a step removed (seconds since the epoch)."""
    age_secs: float
    """Seconds since ``modified``, when listed."""
    live: bool
    """Whether a process holds it (a run using it on this node): a live run is never cleared."""

    @property
    def newest_step(self) -> int | None:
        """The newest step it holds a part of (None: none)."""
        return self.steps[-1] if self.steps else None


def tier_folder(folder: str | os.PathLike[str] | None = None) -> Path:
    """A node's peer tier folder: ``folder`` (default :data:`DEFAULT_FOLDER`) with ``{user}``
    replaced by this process's user name; it must be absolute and hold no ``{node}``."""
    text = os.fspath(folder) if folder is not None else DEFAULT_FOLDER
    check.text(text, "folder")
    expanded = _folder.expand(text)
    if "{node}" in expanded or not os.path.isabs(expanded):
        raise ValueError(
            f"peer tier folder {text!r}: give the absolute folder of this node (with the node's "
            "name in place of {node}), as PeerTier(path=...) names it on this node"
        )
    return Path(expanded)


def remove_run(root: Path) -> bool:
    """Remove this node's folder of a run (``root``: its ``run_folder``) with all it holds, never
    following a link in it; this process lets go of it first. True when it is gone (removed now,
    or not there); False when another process still holds it (another process of the same run
    on this node: the last one to call this removes it). An UnsafeFolderError when the folder or
    one above it is not this user's to use."""
    _folder.release(root)
    with _folder.run_dir(root, create=False) as opened:
        if opened is None or opened.run is None:
            return True
        if not _folder.lock(opened.run, fcntl.LOCK_EX, None):
            log.info("peer tier: %s is in use by another process; it removes it", root)
            return False
        _folder.remove(opened.tier, root.name, root)
        log.info("peer tier: removed %s", root)
        return True


def release_run(root: Path) -> None:
    """This process no longer holds the run folder ``root``, which stays (for a restarted
    process to recover from); a later ``write`` or ``listing`` holds it again."""
    _folder.release(root)


def list_peer_runs(folder: str | os.PathLike[str] | None = None) -> list[PeerRun]:
    """The runs in this node's peer tier folder (default ``/dev/shm/milepost-{user}``, with
    ``{user}`` replaced by your user name), oldest change first: each one's size in memory, the
    steps it holds, its age and whether a process still uses it. Nothing is changed. Empty when
    the folder does not exist; an UnsafeFolderError when it is not yours (another user's, one
    others may write to, or a link)."""
    return _runs(tier_folder(folder), None, dry_run=True)


def clear_peer_runs(
    folder: str | os.PathLike[str] | None = None,
    *,
    older_than_secs: float,
    dry_run: bool = False,
) -> list[PeerRun]:
    """Remove the stale runs of this node's peer tier folder (default as
    :func:`list_peer_runs`): each run no process holds (its job ended or was killed) and that
    has not changed for ``older_than_secs`` (0: every run no process holds). A run a process
    holds is never removed. Returns the runs removed (with ``dry_run``: those it would remove,
    removing nothing). A run kept for a restarted controller to recover from is stale too once
    its processes end: clear with an age that spares it."""
    check.seconds(older_than_secs, "older_than_secs", zero=True)
    check.flag(dry_run, "dry_run")
    return _runs(tier_folder(folder), float(older_than_secs), dry_run=dry_run)


def _runs(tier: Path, older_than: float | None, *, dry_run: bool) -> list[PeerRun]:
    """Every run (``older_than`` None), or the stale ones, removed unless ``dry_run``."""
    fd = _folder.open_tier(tier, create=False)
    if fd is None:
        return []
    out: list[PeerRun] = []
    try:
        for entry in sorted(_folder.entries(fd), key=lambda e: e.name):
            if entry.is_symlink() or not entry.is_dir(follow_symlinks=False):
                log.warning("peer tier: passed over %r in %s: not a folder", entry.name, tier)
                continue
            try:
                run = _folder.open_dir(
                    fd, entry.name, tier / entry.name, create=False, tighten=False
                )
            except _folder.UnsafeFolderError as e:
                log.warning("peer tier: passed over a run: %s", e)
                continue
            if run is None:
                continue
            try:
                found = _run(fd, run, tier / entry.name, older_than, dry_run=dry_run)
            finally:
                os.close(run)
            if found is not None:
                out.append(found)
    finally:
        os.close(fd)
    return sorted(out, key=lambda r: r.modified)


def _run(
    tier: int, run: int, path: Path, older_than: float | None, *, dry_run: bool
) -> PeerRun | None:
    """One run (the folder ``run`` in ``tier``), removed if stale and asked to; None when it is
    not listed (live or recent, when clearing)."""
    free = _folder.lock(run, fcntl.LOCK_EX, None)  # (released when ``run`` is closed)
    steps, modified = _steps(run)
    found = PeerRun(
        name=path.name,
        path=path,
        nbytes=_size(run, 1),
        steps=steps,
        modified=modified,
        age_secs=max(0.0, time.time() - modified),
        live=not free,
    )
    if older_than is None:
        return found
    if not free or found.age_secs < older_than:
        return None
    if not dry_run:
        _folder.remove(tier, path.name, path)  # (under the exclusive lock: no process holds it)
        log.info("peer tier: cleared %s (%d bytes, steps %s)", path, found.nbytes, list(steps))
    return found


def _steps(run: int) -> tuple[tuple[int, ...], float]:
    """The steps of which the run folder ``run`` holds a part, and when it last changed."""
    modified = os.fstat(run).st_mtime
    steps = []
    for entry in _folder.entries(run):
        if not entry.name.startswith(_STEP_PREFIX) or not entry.is_dir(follow_symlinks=False):
            continue
        modified = max(modified, entry.stat(follow_symlinks=False).st_mtime)
        try:
            fd = _folder.open_dir(run, entry.name, entry.name, create=False, tighten=False)
        except OSError:
            continue
        if fd is None:
            continue
        try:
            held = any(e.name.startswith("owner_") for e in _folder.entries(fd))
        finally:
            os.close(fd)
        number = entry.name[len(_STEP_PREFIX) :]
        if held and number.isdigit():
            steps.append(int(number))
    return tuple(sorted(steps)), modified


def _size(fd: int, depth: int) -> int:
    """Bytes of the files under the folder ``fd`` (links not followed; deeper than a run's
    layout: not counted)."""
    total = 0
    for entry in _folder.entries(fd):
        st = entry.stat(follow_symlinks=False)
        if stat.S_ISREG(st.st_mode):
            total += st.st_size
        elif stat.S_ISDIR(st.st_mode) and depth < _MAX_DEPTH:
            try:
                inner = os.open(
                    entry.name,
                    os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                    dir_fd=fd,
                )
            except OSError:
                continue
            try:
                total += _size(inner, depth + 1)
            finally:
                os.close(inner)
    return total
