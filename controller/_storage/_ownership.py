"""Who may write a checkpoint path: one save at a time, across processes and hosts.

A save's temporary directory (``<path>.orbax-checkpoint-tmp``) carries its owner: the saving
process holds an exclusive ``flock`` on the directory from the moment it appears until the save
committed it or removed it, and ``.milepost-owner`` inside names the process (host, pid, save
id, start time). The directory is made under another name, locked, then renamed into place
(``RENAME_NOREPLACE``), so it is never visible unlocked. Hence:

- a second writer of the same path finds the directory locked and gets a
  :class:`CheckpointExistsError` naming the first (or waits for it, if asked); it never touches
  the first one's directory;
- a temporary directory that can be locked was left by a writer that is gone (the kernel drops
  a dead process's locks), so whoever locks it may remove it;
- the lock moves with the directory when it is renamed to the final path, and ends when the
  owner closes it.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from milepost._errors import CheckpointExistsError
from milepost.workers import format as fmt

OWNER_FILE = fmt.OWNER_FILE
NEW_MARKER = ".milepost-new-"
"""Part of the name a temporary directory has while it is being made:
``.<path>.milepost-new-<host>-<pid>-<id>``."""
_GRACE_SECS = 60.0
"""How long a directory being made, with no owner file yet, is left alone when its maker's
liveness cannot be checked (another host)."""


def _host() -> str:
    return "".join(c if c.isalnum() else "_" for c in socket.gethostname())


@dataclass(frozen=True)
class Owner:
    host: str
    pid: int
    save_id: str
    since: float

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"process {self.pid} on host {self.host} (save {self.save_id}, started {started})"


def read_owner(directory: Path) -> Owner | None:
    try:
        data = json.loads((directory / OWNER_FILE).read_text())
        return Owner(
            str(data["host"]), int(data["pid"]), str(data["save_id"]), float(data["since"])
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


class Locked:
    """A directory this process holds the exclusive lock of."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __enter__(self) -> Locked:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def try_lock(directory: Path) -> Locked | None:
    """The lock of ``directory`` (not following a symlink) if nobody holds it now, else None;
    None too when it is not there (any more)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:  # a symlink: nobody's directory, nothing to lock
            return None
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise
    try:  # still the directory at that path (not removed or replaced meanwhile)?
        same = os.fstat(fd).st_ino == os.stat(directory, follow_symlinks=False).st_ino
    except FileNotFoundError:
        same = False
    if not same:
        os.close(fd)
        return None
    return Locked(directory, fd)


def _rename_noreplace(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``; FileExistsError if ``dst`` exists (atomically on Linux)."""
    if sys.platform == "linux":
        try:
            renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
        except (OSError, AttributeError):
            renameat2 = None
        if renameat2 is not None:
            at_fdcwd, rename_noreplace = -100, 1
            if (
                renameat2(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), rename_noreplace)
                == 0
            ):
                return
            err = ctypes.get_errno()
            if err in (errno.EEXIST, errno.ENOTEMPTY):
                raise FileExistsError(err, os.strerror(err), str(dst))
            if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise OSError(err, os.strerror(err), str(src), None, str(dst))
    if dst.exists() or dst.is_symlink():
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)


def remove_tree(path: Path) -> None:
    """Remove a directory tree, or a symlink itself (never what it points to)."""
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def create_locked(
    tmp: Path, *, wait_secs: float = 0.0, doing: str = "save to"
) -> tuple[Locked, Owner]:
    """Make the temporary directory ``tmp`` (its parent must exist), locked by this process from
    the moment it appears. A leftover of a writer that is gone is removed first; one whose
    writer lives is a CheckpointExistsError naming it, after waiting up to ``wait_secs``."""
    final = tmp.name.removesuffix(fmt.TMP_SUFFIX)
    owner = Owner(socket.gethostname(), os.getpid(), uuid.uuid4().hex[:12], time.time())
    deadline = time.monotonic() + wait_secs
    while True:
        new = tmp.with_name(f".{final}{NEW_MARKER}{_host()}-{owner.pid}-{owner.save_id}")
        new.mkdir()
        fd = os.open(new, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with open(new / OWNER_FILE, "w") as f:
                json.dump(asdict(owner), f)
            _rename_noreplace(new, tmp)
            return Locked(tmp, fd), owner
        except FileExistsError:
            os.close(fd)
            remove_tree(new)
        except BaseException:
            os.close(fd)
            remove_tree(new)
            raise
        # Someone's temporary directory is there: take it over if its writer is gone.
        leftover = try_lock(tmp)
        if leftover is not None:
            with leftover:
                remove_tree(tmp)
            continue
        if time.monotonic() >= deadline:
            holder = read_owner(tmp)
            who = holder.describe() if holder is not None else "another process"
            raise CheckpointExistsError(
                f"cannot {doing} {tmp.parent / final}: {who} is writing it now. Wait for that save "
                "to finish (or SaveOptions(wait_for_writer_secs=...)), or choose another path"
            ) from None
        time.sleep(0.05)


def _maker_may_live(path: Path) -> bool:
    """For a directory being made: whether its maker may still be between making and locking it
    (an instant in which nobody holds its lock)."""
    if (path / OWNER_FILE).exists():
        return False  # the maker had locked it: the lock tells
    host, _, rest = path.name.partition(NEW_MARKER)[2].rpartition("-")[0].rpartition("-")
    pid = rest if rest.isdigit() else ""
    if host == _host() and pid:
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    try:
        return time.time() - path.lstat().st_mtime < _GRACE_SECS
    except FileNotFoundError:
        return False


def remove_if_abandoned(path: Path) -> bool:
    """Remove ``path`` (a temporary directory, or one being made) if no live process holds its
    lock; True if it was removed."""
    if NEW_MARKER in path.name and _maker_may_live(path):
        return False
    locked = try_lock(path)
    if locked is None:
        return False
    with locked:
        remove_tree(path)
    return True
