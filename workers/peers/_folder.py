"""A node's folder of the peer tier, opened safely on a machine other users share.

The rules, checked at every open on the folder's file descriptor (never on a name checked
first and opened after):

- **Above the tier folder** (``/dev/shm`` for ``/dev/shm/milepost-alice``), the path is resolved
  once (a system's links such as ``/var/run -> /run`` are followed; a link owned by another
  user is refused), and every folder on it must be owned by root or by this user, and not
  writable by its group or others unless it has the sticky bit. ``/dev/shm`` and ``/tmp``
  (``1777``: sticky) are fine: in them no one renames or removes what another user made. The
  owner of a folder above, or anyone who may write to it without the sticky bit, could rename
  the tier folder aside and put their own in its place.
- **The tier folder and everything below** (the run's folder, its steps, its parts, their files)
  must be this user's own and not writable by its group or others, and is never a symbolic
  link: each is opened relative to its parent's descriptor with ``O_NOFOLLOW``, so a link
  planted anywhere is refused (or passed over with a log line by a listing), never followed,
  never written through. Folders milepost creates are 0700 and files 0600, whatever the umask;
  a run folder it finds with wider modes is made 0700.

A folder that breaks a rule raises :class:`UnsafeFolderError` (a ``PermissionError``) naming it
and why. A run folder is held, while a process uses it, by a shared ``flock`` on the folder
itself (no lock file: the folder holds the run's steps only); a process that removes a run takes
the exclusive lock first, so a run some process holds is never removed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import pwd
import re
import shutil
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("milepost.peers")

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
"""A name the peer tier puts in a path (a run, a node, a user)."""
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_HOLD_TIMEOUT_SECS = 60.0


class UnsafeFolderError(PermissionError):
    """A folder of the peer tier that another user could change, or a symbolic link in it:
    not used. ``path`` is the folder (or the link), ``reason`` why it was refused.

    A ``PermissionError``: the folder's owner or modes are wrong for this user, as when the
    system refuses access; code that caught the ``PermissionError`` of a folder another user
    made keeps catching this."""

    def __init__(self, message: str, *, path: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.path = path
        self.reason = reason


def refuse(path: str | Path, reason: str) -> UnsafeFolderError:
    return UnsafeFolderError(
        f"the peer tier does not use {path}: {reason}. Pass PeerTier(path=...) a folder of "
        "your own, not writable by others (e.g. /dev/shm/milepost-{user}: {user} becomes your "
        "user name)",
        path=str(path),
        reason=reason,
    )


def user_name() -> str:
    """This process's user name (of its effective uid), or the uid where it has no name or one
    that could not name a folder."""
    uid = os.geteuid()
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)
    return name if NAME.fullmatch(name) and name not in (".", "..") else str(uid)


def expand(folder: str, node: str | None = None) -> str:
    """``folder`` with ``{user}`` replaced by :func:`user_name`, and ``{node}`` by ``node``
    (when given)."""
    folder = folder.replace("{user}", user_name())
    return folder if node is None else folder.replace("{node}", node)


# -- checks -------------------------------------------------------------------------------------
def _mode(st: os.stat_result) -> str:
    return f"mode {stat.S_IMODE(st.st_mode):04o}"


def _check_above(fd: int, where: str) -> None:
    st = os.fstat(fd)
    if st.st_uid not in (0, os.geteuid()):
        raise refuse(
            where,
            f"it is owned by uid {st.st_uid} (neither root nor you, uid {os.geteuid()}), who "
            "could swap what it holds",
        )
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise refuse(
            where,
            f"it is writable by its group or others without the sticky bit ({_mode(st)}): "
            "they could swap what it holds",
        )


def _check_own(fd: int, where: str, *, tighten: bool) -> None:
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        raise refuse(where, f"it is owned by uid {st.st_uid}, not by you (uid {os.geteuid()})")
    if st.st_mode & 0o022:
        raise refuse(where, f"it is writable by its group or others ({_mode(st)})")
    if tighten and st.st_mode & 0o077:
        os.fchmod(fd, 0o700)


def _check_links(path: Path) -> None:
    """No link on ``path`` (before it is resolved) is another user's."""
    here = Path(path.anchor)
    for name in path.parts[1:]:
        here = here / name
        try:
            st = os.lstat(here)
        except OSError:
            return
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in (0, os.geteuid()):
            raise refuse(here, f"it is a symbolic link owned by uid {st.st_uid}")


def _what_is(parent: int, name: str) -> str:
    """Why ``name`` in the folder ``parent`` did not open as a folder."""
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except OSError:
        return "it is not a folder"
    return "it is a symbolic link" if stat.S_ISLNK(st.st_mode) else "it is not a folder"


# -- opening ------------------------------------------------------------------------------------
def open_dir(
    parent: int, name: str, where: str | Path, *, create: bool, tighten: bool = True
) -> int | None:
    """The folder ``name`` in the folder ``parent`` (a descriptor), this user's own and not a
    link (None when it does not exist and not ``create``; created 0700 when ``create``)."""
    made = False
    for _ in range(2):
        try:
            fd = os.open(name, _DIR, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                return None
            with contextlib.suppress(FileExistsError):  # (made meanwhile: opened and checked)
                os.mkdir(name, 0o700, dir_fd=parent)
                made = True
            continue
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise refuse(where, _what_is(parent, name)) from None
            raise
        try:
            _check_own(fd, str(where), tighten=tighten)
            if made:
                os.fchmod(fd, 0o700)  # (mkdir's mode is cut by the umask)
        except BaseException:
            os.close(fd)
            raise
        return fd
    raise FileNotFoundError(errno.ENOENT, "removed while it was being created", str(where))


def open_tier(tier: Path, *, create: bool) -> int | None:
    """The tier folder (a descriptor), checked with every folder above it (None when it does
    not exist and not ``create``; it and the folders missing above it are created 0700)."""
    tier = Path(os.path.abspath(tier))
    if tier.parent == tier:
        raise refuse(tier, "it is the root of the file system")
    _check_links(tier.parent)
    parent = Path(os.path.realpath(tier.parent))
    fd = os.open("/", _DIR)
    try:
        _check_above(fd, "/")
        here = Path("/")
        for name in parent.parts[1:]:
            here = here / name
            try:
                inner = os.open(name, _DIR, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    return None
                made = open_dir(fd, name, here, create=True, tighten=False)
                assert made is not None
                inner = made
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):  # (it changed since it was resolved)
                    raise refuse(here, _what_is(fd, name)) from None
                raise
            os.close(fd)
            fd = inner
            _check_above(fd, str(here))
        return open_dir(fd, tier.name, tier, create=create, tighten=False)
    finally:
        os.close(fd)


def open_file(parent: int, name: str, where: str | Path) -> int:
    """A file of this user's in the folder ``parent``, opened to read, never through a link."""
    try:
        fd = os.open(
            name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent
        )
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise refuse(where, "it is a symbolic link") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        what = "not a plain file" if not stat.S_ISREG(st.st_mode) else f"owned by uid {st.st_uid}"
        raise refuse(where, f"it is {what}")
    return fd


def create_file(parent: int, name: str, data: memoryview | bytes) -> None:
    """A new file ``name`` (0600) in the folder ``parent`` holding ``data``, synced."""
    fd = os.open(
        name,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o600,
        dir_fd=parent,
    )
    with os.fdopen(fd, "wb") as f:
        os.fchmod(fd, 0o600)
        f.write(data)
        f.flush()
        os.fsync(fd)


def remove(parent: int, name: str, where: str | Path) -> None:
    """Remove ``name`` from the folder ``parent``: a folder with all it holds, without
    following a link in it; a link or a file itself (never what a link names)."""
    st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=parent)
    else:
        if stat.S_ISLNK(st.st_mode):
            log.warning("peer tier: removed a symbolic link %r (not what it names)", str(where))
        os.unlink(name, dir_fd=parent)


def entries(fd: int) -> list[os.DirEntry[str]]:
    """What the folder ``fd`` holds (nothing is followed)."""
    with os.scandir(fd) as found:
        return list(found)


# -- a run's folder, held while used ------------------------------------------------------------
_held: dict[str, tuple[int, int, int]] = {}
"""Run folder -> (descriptor holding its shared lock, st_dev, st_ino)."""
_held_lock = threading.Lock()


def lock(fd: int, kind: int, deadline: float | None) -> bool:
    """Take ``flock`` ``kind`` on ``fd``; None ``deadline``: only if free now (False if not);
    else waiting until ``deadline`` (a TimeoutError then)."""
    while True:
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if deadline is None:
                return False
            if time.monotonic() > deadline:
                raise TimeoutError(
                    "a peer tier run folder stayed locked by another process (a `milepost "
                    f"peers clear` removing it?) for {_HOLD_TIMEOUT_SECS:g}s"
                ) from None
            time.sleep(0.01)


def _hold(key: str, run_fd: int, deadline: float) -> bool:
    """This process holds the run folder ``run_fd`` (once per folder); False when it was
    removed before the lock was taken (the caller opens it again)."""
    st = os.fstat(run_fd)
    with _held_lock:
        found = _held.get(key)
        if found is not None and found[1:] == (st.st_dev, st.st_ino):
            return True
    fd = os.dup(run_fd)
    try:
        lock(fd, fcntl.LOCK_SH, deadline)
        if os.fstat(fd).st_nlink == 0:
            os.close(fd)
            return False
    except BaseException:
        os.close(fd)
        raise
    with _held_lock:
        old = _held.pop(key, None)
        _held[key] = (fd, st.st_dev, st.st_ino)
    if old is not None:
        os.close(old[0])
    return True


def release(root: Path) -> None:
    """This process no longer holds the run folder ``root`` (a process that ends lets go of
    it too)."""
    with _held_lock:
        found = _held.pop(str(root), None)
    if found is not None:
        os.close(found[0])


def held(root: Path) -> bool:
    """Whether this process holds the run folder ``root``."""
    with _held_lock:
        return str(root) in _held


class Opened:
    """A run's tier folder and run folder, open (``run`` None: no such run)."""

    def __init__(self, tier: int, run: int | None) -> None:
        self.tier = tier
        self.run = run

    def close(self) -> None:
        if self.run is not None:
            os.close(self.run)
        os.close(self.tier)


@contextlib.contextmanager
def run_dir(root: Path, *, create: bool, hold: bool = False) -> Iterator[Opened | None]:
    """The run folder ``root`` (``<tier folder>/<run>``) and its tier folder, checked (None:
    the tier folder does not exist and not ``create``; ``.run`` None: the run folder does
    not). ``hold``: this process holds the run folder (see :func:`release`)."""
    deadline = time.monotonic() + _HOLD_TIMEOUT_SECS
    while True:
        tier = open_tier(root.parent, create=create)
        if tier is None:
            opened = None
            break
        try:
            run = open_dir(tier, root.name, root, create=create)
        except BaseException:
            os.close(tier)
            raise
        opened = Opened(tier, run)
        try:
            if run is None or not hold or _hold(str(root), run, deadline):
                break
        except BaseException:
            opened.close()
            raise
        opened.close()  # removed meanwhile: made again
    try:
        yield opened
    finally:
        if opened is not None:
            opened.close()
