"""Where a save writes before it commits, and how the commit makes it visible.

- :class:`LocalWorkspace` (local folders): a temporary directory ``<path>.orbax-checkpoint-tmp``
  locked by the saving process (``_ownership``), renamed into place at the commit
  (``RENAME_NOREPLACE``; an overwrite is one atomic exchange), so the path always holds a whole
  checkpoint or nothing.
- :class:`ObjectWorkspace` (``gs://``, ``s3://``, ``memory://``: no rename): the checkpoint is
  written in place and becomes visible when its commit marker, written last, appears. A lease
  object ``<path>.milepost-lease`` (created with a write that succeeds only if it does not
  exist, renewed by a heartbeat) makes one writer own the path; a lease not renewed for
  ``lease_secs`` belongs to a writer that is gone and may be taken over. An overwrite first
  removes the old commit marker (the old checkpoint stops being loadable), then the old files,
  then writes the new one: for that while the path holds no loadable checkpoint, never a mix.
  Uncommitted objects at the path are removed only under a lease taken over from a save that is
  gone; objects no save left there are refused, never deleted.

The commit itself (``milepost._checkpoint``'s ``commit``) is the same for both: ``check`` that
the workspace is still this save's, write the checkpoint metadata and file checksums, the commit
marker, then ``publish``.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import json
import logging
import os
import shutil
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from milepost import workers
from milepost._errors import CheckpointExistsError, TemporaryDirectoryRemovedError
from milepost._storage import _ownership
from milepost._storage._intact import Intact
from milepost.workers import NO_VALUE, ObjectPath, StoragePath, is_local
from milepost.workers import format as fmt

LEASE_SUFFIX = ".milepost-lease"

DELETING = "delete-checkpointable "
"""How the lease of a deletion of one checkpointable names what it does: its save id starts so,
then the checkpointable's name (``repr``). Left expired by a deletion that could not finish, it
tells the next deletion of that checkpointable to finish it, and a Checkpointer's cleanup to
leave the path alone."""

log = logging.getLogger(__name__)


def for_path(
    final: StoragePath, overwrite: bool, wait_secs: float, lease_secs: float
) -> LocalWorkspace | ObjectWorkspace:
    if is_local(final):
        return LocalWorkspace(final, overwrite, wait_secs)
    return ObjectWorkspace(final, overwrite, wait_secs, lease_secs)


def check_final(final: Any, overwrite: bool) -> None:
    """Raise unless a save may write ``final``: nothing is there, or (``overwrite``) a committed
    checkpoint is; and no folder above it is a checkpoint (a checkpoint written inside another
    changes it, and goes with it when it is overwritten or deleted)."""
    # (Local paths: on an object store each level would cost requests.)
    for parent in final.resolve().parents if is_local(final) else ():
        if fmt.is_committed_by_own_files(parent) or fmt.is_temporary_name(parent.name):
            raise CheckpointExistsError(
                f"{final} is inside the checkpoint {parent}; milepost does not "
                "write a checkpoint into another one (it would change it, and be "
                "deleted with it). Choose a path outside it"
            )
    if final.exists() or final.is_symlink():
        if not overwrite:
            raise CheckpointExistsError(
                f"a checkpoint already exists at {final}; pass "
                "overwrite=True to replace it, or choose another path"
            )
        if not fmt.is_committed_by_own_files(final) or final.is_symlink():
            raise CheckpointExistsError(
                f"{final} exists and is not a committed checkpoint; milepost will not "
                "overwrite it. Remove it or choose another path"
            )


# ------------------------------------------------------------------------------------------
# Local folders
# ------------------------------------------------------------------------------------------


class LocalWorkspace:
    def __init__(self, final: Path, overwrite: bool, wait_secs: float) -> None:
        self.final = final
        self.dir = final.with_name(final.name + fmt.TMP_SUFFIX)
        self.overwrite = overwrite
        self.wait_secs = wait_secs
        self.lock: _ownership.Locked | None = None
        """The temporary directory's lock, held from the moment it exists until it is committed
        or removed."""
        self.intact: Intact | None = None
        """The checks that the temporary directory is still the one this save made, holding what
        it wrote (from ``prepare`` until it is committed or removed)."""

    def prepare(self, names: Iterable[str]) -> None:
        final, tmp = self.final, self.dir
        if final.parent.exists() and not final.parent.is_dir():
            raise NotADirectoryError(
                f"{final.parent} is a file; a checkpoint's parent must be a directory"
            )
        check_final(final, self.overwrite)
        final.parent.mkdir(parents=True, exist_ok=True)
        # Locked from the moment it appears; a leftover of a dead writer is removed first.
        self.lock, _ = _ownership.create_locked(tmp, wait_secs=self.wait_secs)
        try:
            check_final(final, self.overwrite)  # another writer may have committed while we waited
            names = list(names)
            for name in names:
                (tmp / name).mkdir()
            self.intact = Intact(tmp, names)
        except BaseException:
            _ownership.remove_tree(tmp)
            self.release()
            raise

    def check(self, stage: str = "before the commit", record: StoragePath | None = None) -> None:
        """Raise :class:`TemporaryDirectoryRemovedError` unless the temporary directory and its
        folders are the ones this save made, holding what it wrote: removed or replaced from
        outside, the checkpoint would be incomplete. ``stage`` says when (for the message);
        ``record`` (the directory, or a folder in it, once no write into it is in flight): every
        file below it now must stay until the rename."""
        if self.intact is None:
            return
        # (a local workspace's folders are local: the isinstance only narrows the type)
        problem = self.intact.problem(record=record if isinstance(record, Path) else None)
        if problem is not None:
            raise self._removed(problem, stage)

    def explain(self, error: Exception, own: bool = True) -> Exception:
        """The error a save that failed with ``error`` raises: a
        :class:`TemporaryDirectoryRemovedError` (caused by ``error``) when the temporary
        directory was removed or replaced from outside, which is then why it failed. ``own``:
        ``error`` comes from milepost's own steps, which read only what they wrote or listed,
        so a file of the directory it found missing is itself the evidence (not so for a
        custom handler's error)."""
        if self.intact is None or isinstance(error, TemporaryDirectoryRemovedError):
            return error
        try:
            problem = self.intact.problem() or (self.intact.vanished(error) if own else None)
        except OSError:
            return error
        if problem is None:
            return error
        removed = self._removed(problem, "after a write into it failed")
        removed.__cause__ = error
        return removed

    def _removed(
        self, problem: str, stage: str, outcome: str | None = None
    ) -> TemporaryDirectoryRemovedError:
        outcome = outcome or f"nothing was committed to {self.final}"
        return TemporaryDirectoryRemovedError(
            errno.ENOENT,
            f"the temporary directory {self.dir} was removed or replaced by another program "
            f"while this save ran ({problem}; seen {stage}), so it does not hold the whole "
            f"checkpoint; {outcome}. Stop whatever deletes it (a cleanup job, an rm -rf of "
            f"names ending in {fmt.TMP_SUFFIX}) while saves run, then save again",
            str(self.dir),
        )

    def confirm(self, checksums: Any, needed: Iterable[str]) -> None:
        """Local folders: written and fsynced files are kept (POSIX), nothing to read back; but
        every file the checksums list, the format files ``needed`` and the marker must still be
        there at the rename (one removed from outside since it was written is missing)."""
        if self.intact is not None:
            self.intact.expect([*checksums.files, *needed, fmt.CHECKSUMS, fmt.COMMIT_MARKER])

    def publish(self) -> None:
        tmp, final = self.dir, self.final
        fmt.fsync_tree(tmp)
        self.check("at the rename", record=tmp)
        problem = self.intact.drop_owner() if self.intact is not None else None
        if problem is not None:
            raise self._removed(problem, "at the rename")
        if self.overwrite and final.exists() and exchange(tmp, final):
            # One atomic step: the final path holds the old checkpoint or the new one, never
            # nothing; the old one, now at the temporary path, is never loaded and is removed.
            self._confirm_renamed(undo=lambda: exchange(tmp, final))
            fmt.fsync_dir(final.parent)
            shutil.rmtree(tmp, ignore_errors=True)
            self.release()
            return
        old = None
        if self.overwrite and final.exists():
            old = final.with_name(f"{final.name}.milepost-replaced-{os.getpid()}-{time.time_ns()}")
            os.rename(final, old)
        try:
            rename_new(tmp, final)
            self._confirm_renamed(undo=lambda: os.rename(final, tmp))
        except BaseException:
            if old is not None:
                os.rename(old, final)  # put the previous checkpoint back
            raise
        fmt.fsync_dir(final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        self.release()

    def _confirm_renamed(self, undo: Callable[[], object]) -> None:
        """Right after the rename (which names the directory by its path, not its inode): the
        final path must hold the directory this save made, with every file recorded. If it
        does not (replaced or emptied from outside after the last check), ``undo`` the rename
        and raise."""
        problem = self.intact.problem(self.final) if self.intact is not None else None
        if problem is None:  # published: nothing more to check
            if self.intact is not None:
                self.intact.close()
                self.intact = None
            return
        try:
            undo()
        except OSError as e:
            raise self._removed(
                problem,
                "right after the rename",
                f"the rename could not be undone ({e}): {self.final} is not a whole checkpoint, "
                "remove it",
            ) from e
        raise self._removed(problem, "right after the rename, which was undone")

    def abandon(self, clean: bool = False) -> None:
        """Remove the temporary directory (``clean``: every write into it ended; alike here,
        since a late write is taken care of by the directory's lock)."""
        if self.lock is not None:
            if self.intact is None or self.intact.holds(self.dir):
                _ownership.remove_tree(self.dir)
            else:  # what writes made there again after a removal, unless another save owns it
                _ownership.remove_if_abandoned(self.dir)
        self.release()

    def release(self) -> None:
        if self.intact is not None:
            self.intact.close()
            self.intact = None
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def renameat2(a: Path, b: Path, flag: int) -> bool:
    """Linux ``renameat2`` with ``flag``; False where the system or the file system lacks it."""
    if sys.platform != "linux":
        return False
    try:
        call = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    if call(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), flag) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def exchange(a: Path, b: Path) -> bool:
    """Swap two directories atomically (``RENAME_EXCHANGE``); False where unsupported."""
    return renameat2(a, b, 2)


def rename_new(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``, failing if anything is at ``final`` (``RENAME_NOREPLACE``;
    elsewhere a check just before the rename)."""
    try:
        if renameat2(tmp, final, 1):
            return
    except FileExistsError:
        raise CheckpointExistsError(
            f"a checkpoint appeared at {final} while this save ran (written by another program); "
            "nothing was replaced. Pass overwrite=True to replace it, or choose another path"
        ) from None
    if final.exists() or final.is_symlink():
        raise CheckpointExistsError(
            f"a checkpoint appeared at {final} while this save ran; nothing was replaced"
        )
    os.rename(tmp, final)


# ------------------------------------------------------------------------------------------
# Object stores
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Lease:
    host: str
    pid: int
    save_id: str
    since: float
    expires: float

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"process {self.pid} on host {self.host} (save {self.save_id}, started {started})"


def read_lease(path: ObjectPath) -> tuple[Lease | None, bytes | None]:
    """The lease at ``path`` and its generation (None, None when there is none; a lease that
    does not parse counts as expired)."""
    raw, generation = path.read_with_generation()
    if raw is None:
        return None, None
    try:
        return Lease(**json.loads(raw)), generation
    except (ValueError, TypeError):
        return Lease("?", 0, "?", 0.0, 0.0), generation


class ObjectWorkspace:
    def __init__(
        self, final: ObjectPath, overwrite: bool, wait_secs: float, lease_secs: float
    ) -> None:
        self.final = final
        self.dir = final
        self.overwrite = overwrite
        self.wait_secs = wait_secs
        self.lease_secs = lease_secs
        self.lease_path = final.with_name(final.name + LEASE_SUFFIX)
        self.lease: Lease | None = None
        self.generation: bytes | None = None
        self.took_over = False
        """The lease was taken over from a save that is gone (its leftovers may be removed)."""
        self.taken_from: Lease | None = None
        """The expired lease taken over (what the writer that is gone was doing)."""
        self._lost: str | None = None
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._lock = threading.Lock()

    # -- the lease ------------------------------------------------------------------------
    def _new_lease(self, save_id: str, since: float) -> bytes:
        self.lease = Lease(
            socket.gethostname(), os.getpid(), save_id, since, time.time() + self.lease_secs
        )
        return json.dumps(asdict(self.lease)).encode()

    def acquire(self, purpose: str = "") -> None:
        """Take the lease (waiting up to wait_secs for a live one to go); CheckpointExistsError
        if it does not. ``purpose``: the start of its save id (a deletion's: ``DELETING``)."""
        save_id, since = purpose + uuid.uuid4().hex[:12], time.time()
        deadline = time.monotonic() + self.wait_secs
        while True:
            current, generation = read_lease(self.lease_path)
            if current is None or current.expires < time.time():
                data = self._new_lease(save_id, since)
                got = self.lease_path.write_bytes(data, if_generation=generation or NO_VALUE)
                # The condition failing means a racing writer, or our own write whose reply was
                # lost (the client re-sent it; the server refused the repeat): then the lease
                # there is byte for byte ours.
                got = got or self._own_write(data)
                if got:  # read back: a store may acknowledge a write it does not keep
                    got = self._own_write(data)
                    if not got and self.lease_path.generation() is None:
                        raise OSError(
                            errno.EIO,
                            f"the storage acknowledged the lease {self.lease_path} but does not "
                            "hold it (a proxy or gateway that drops writes?); nothing was "
                            "written. Check the storage path and save again",
                            str(self.lease_path),
                        )
                if got:  # ours; if someone else raced us to it, look again
                    self.generation = got
                    self.took_over = current is not None
                    self.taken_from = current
                    return
                continue
            if time.monotonic() >= deadline:
                raise CheckpointExistsError(
                    f"cannot save to {self.final}: {current.describe()} is writing it "
                    "now (its lease runs until "
                    f"{time.strftime('%H:%M:%S', time.localtime(current.expires))}). "
                    "Wait for that save to finish (or "
                    "SaveOptions(wait_for_writer_secs=...)), or choose another path"
                )
            time.sleep(0.1)

    def _renew(self) -> None:
        with self._lock:
            if self._lost is not None or self.lease is None:
                return
            data = self._new_lease(self.lease.save_id, self.lease.since)
            got = self.lease_path.write_bytes(data, if_generation=self.generation)
            got = got or self._own_write(data)  # a renewal whose reply was lost is no takeover
            if got:
                self.generation = got
            else:
                self._lost = "another writer took over its lease (it was not renewed in time)"

    def _own_write(self, data: bytes) -> bytes:
        """The lease's generation if what is there is ``data``, this save's own write (its save
        id, process and expiry in it make it unique); ``b''`` otherwise."""
        raw, generation = self.lease_path.read_with_generation()
        return generation or b"" if raw == data else b""

    def _beat(self) -> None:
        while not self._stop.wait(self.lease_secs / 4):
            try:
                self._renew()
            except Exception as e:  # storage unreachable: the next check reports it
                with self._lock:
                    self._lost = (
                        self._lost or f"its lease could not be renewed ({type(e).__name__}: {e})"
                    )

    def hold(self, purpose: str = "") -> None:
        """Take the lease (:meth:`acquire`) and keep renewing it until :meth:`release`."""
        self.acquire(purpose)
        self._heartbeat = workers.RUNTIME.thread(
            f"lease:{self.final.name}", self._beat, stop=self._stop.set
        )

    def prepare(self, names: Iterable[str]) -> None:
        if fmt.is_committed(self.final):
            check_final(self.final, self.overwrite)
        self.hold()
        try:
            # Another writer may have committed while we waited. What is there now is a committed
            # checkpoint being overwritten, or what a save that is gone left (it left its expired
            # lease, which we took over); anything else is not ours to remove.
            with workers.reading_once():  # one listing answers both
                committed = fmt.is_committed(self.final)
                present = not committed and self.final.exists()
            if committed:
                check_final(self.final, self.overwrite)
            elif not self.took_over and present:
                raise CheckpointExistsError(
                    f"{self.final} holds objects but is not a committed "
                    "checkpoint, and no save left a lease there; milepost will not "
                    "overwrite it. Remove it or choose another path"
                )
            if committed or present:  # hide it first (no commit marker, no load), then remove it
                (self.final / fmt.COMMIT_MARKER).unlink(missing_ok=True)
                self.final.delete_tree().result()
        except BaseException:
            self.release()
            raise

    def check(self, stage: str = "", record: StoragePath | None = None) -> None:
        """The lease must still be this save's, with at least half its time left: renewed now,
        unless three quarters of it are left (written or renewed a moment ago: nobody may take
        it over before it expires)."""
        lease = self.lease
        if lease is None or lease.expires - time.time() < 0.75 * self.lease_secs:
            self._renew()
        with self._lock:
            if self._lost is not None:
                raise OSError(
                    errno.ESTALE,
                    f"the save to {self.final} lost its ownership: "
                    f"{self._lost}; nothing was committed. Save again",
                )

    def explain(self, error: Exception, own: bool = True) -> Exception:
        """``error`` itself (a lost lease is found by :meth:`check`)."""
        return error

    def confirm(self, checksums: Any, needed: Iterable[str]) -> None:
        """Read back what makes the checkpoint committed: the marker, the file checksums (whose
        own checksum proves them whole), and that they list every format file ``needed``. A
        store that acknowledged a write it did not keep fails the save here, before anything
        calls it committed (the marker, if it is there, is removed first)."""
        problems = []
        if not (self.final / fmt.COMMIT_MARKER).exists():
            problems.append(fmt.COMMIT_MARKER)
        try:
            kept = fmt.Checksums.read(self.final)
        except ValueError:
            kept = None
        if kept is None or kept.files != checksums.files:
            problems.append(fmt.CHECKSUMS)
        problems += [name for name in needed if name not in checksums.files]
        if problems:
            with contextlib.suppress(Exception):
                (self.final / fmt.COMMIT_MARKER).unlink(missing_ok=True)
            raise workers.LostWriteError(
                errno.EIO,
                f"the storage acknowledged writes of {problems} to {self.final} but does not "
                "hold them now (a proxy or gateway that drops writes?); nothing was committed, "
                "and what this save wrote is removed. Save again, and check the storage path",
                str(self.final),
                path=str(self.final / problems[0]),
            )

    def publish(self) -> None:
        self.release()

    def abandon(self, clean: bool = False) -> str | None:
        """A failed save: remove what it wrote, and leave its lease behind, expired. A write
        the storage applies after the save gave up on it (a request it answered too late)
        then lands under a lease of a save that is gone: the next save of the path takes the
        lease over and removes it, instead of refusing objects no save owns. ``clean`` (a
        cancelled save whose every write ended as it should: none can land late): the lease
        is removed too, once what it wrote is. Returns what was left where, for the save's
        error."""
        left = None
        if self.lease is not None and self._lost is None:
            left = (
                f"Left behind: the failed save's lease {self.lease_path}, expired; the next save "
                f"of {self.final} takes it over (with anything that lands there late)."
            )
            try:
                self.final.delete_tree().result()
            except Exception as e:
                left = (
                    f"Left behind: what the failed save wrote under {self.final} (removing it "
                    f"failed: {type(e).__name__}: {e}) and its lease {self.lease_path}, expired; "
                    "the next save of the path takes it over and removes them."
                )
                log.warning("%s", left)
                clean = False
            if clean:  # nothing can land late: release() removes the lease as well
                left = None
            else:
                self._expire()
        self.release()
        return left

    def leave(self) -> None:
        """Leave what is at the path as it is, and this writer's lease behind, expired (still
        saying what it was doing): whoever takes it over next finds both."""
        self._expire()
        self.release()

    def _expire(self) -> None:
        """Rewrite this save's lease as expired and keep it (``release`` then leaves it)."""
        self._stop.set()
        if self._heartbeat is not None and self._heartbeat is not threading.current_thread():
            self._heartbeat.join(timeout=5)
        with self._lock:
            if self.lease is None or self._lost is not None:
                return
            self.lease = dataclasses.replace(self.lease, expires=time.time())
            with contextlib.suppress(Exception):  # if not rewritten, it expires in lease_secs
                self.lease_path.write_bytes(
                    json.dumps(asdict(self.lease)).encode(), if_generation=self.generation
                )
            self._lost = "abandoned"

    def release(self) -> None:
        self._stop.set()
        if self._heartbeat is not None and self._heartbeat is not threading.current_thread():
            self._heartbeat.join(timeout=5)
        with self._lock:
            if self.lease is not None and self._lost is None and self.generation is not None:
                with contextlib.suppress(Exception):
                    self.lease_path.unlink(missing_ok=True, if_generation=self.generation)
            self.lease = None


def remove_expired_lease(path: ObjectPath) -> bool:
    """Remove the lease of checkpoint ``path`` if it expired (a failed save leaves its lease,
    expired, to cover writes landing late); True if removed. A live lease, or one renewed or
    taken over meanwhile (its generation changed), is left."""
    lease_path = path.with_name(path.name + LEASE_SUFFIX)
    current, generation = read_lease(lease_path)
    if current is None or generation is None or current.expires >= time.time():
        return False
    return bool(lease_path.unlink(missing_ok=True, if_generation=generation))


def remove_if_abandoned(path: ObjectPath, lease_secs: float = 60.0) -> bool:
    """Remove an uncommitted checkpoint folder in an object store if no live save owns it (no
    lease, or an expired one: taken over first, so no save starts meanwhile); True if removed.
    What a deletion of a checkpointable that could not finish left is not removed: the next
    deletion of that checkpointable finishes it (it holds the other checkpointables)."""
    current, _ = read_lease(path.with_name(path.name + LEASE_SUFFIX))
    if current is not None and current.save_id.startswith(DELETING):
        log.warning(
            "left %s alone: a deletion of one of its checkpointables did not finish (%s); call "
            "milepost.delete_checkpointable for it again to finish it",
            path,
            current.save_id,
        )
        return False
    workspace = ObjectWorkspace(path, overwrite=False, wait_secs=0.0, lease_secs=lease_secs)
    try:
        workspace.acquire()
    except CheckpointExistsError:
        return False
    try:
        if fmt.is_committed(path):
            return False
        path.delete_tree().result()
        return True
    finally:
        workspace.release()
