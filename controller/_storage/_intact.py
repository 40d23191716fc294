"""Whether a local save's temporary directory still holds what the save wrote.

Another program may delete the directory while a save runs (a cleanup job's ``rm -rf``). Such a
deletion seldom ends cleanly: the save keeps writing, TensorStore makes again the folders it
writes into, and ``rm -rf`` fails to remove a folder in which a file appeared after it listed
it. What is left at the temporary path is then the save's own directory with files missing, or a
new one holding only what was written since. Three cheap checks tell each case from the
directory the save made, at every stage of the commit:

- The directory and each checkpointable folder are held open from the moment the save makes
  them, so their inodes cannot be reused: the path naming another inode, or none, means the
  folder was replaced or removed.
- The owner file is in the directory from its first moment until just before the rename: any
  ``rm -rf`` that walked the directory removed it, even one that failed to remove the folders.
- From when a tree's writes landed, and from the start of the commit, each file seen in the
  directory is recorded and must stay, through the rename, with the files the commit writes:
  a deletion under way when the owner file was checked, or one of single files.

The rename itself cannot name the directory by its inode: right after it, the final path is
checked to hold the directory the save made, with every file recorded.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable
from pathlib import Path

from milepost.workers import format as fmt


def _ids(path: Path) -> tuple[int, int]:
    st = os.stat(path, follow_symlinks=False)
    return st.st_dev, st.st_ino


def _files(root: Path) -> set[str]:
    """Every file below ``root`` but the owner file, as paths relative to it."""
    out: set[str] = set()
    for dirpath, _dirs, names in os.walk(root):
        here = Path(dirpath).relative_to(root)
        out.update((here / name).as_posix() for name in names)
    out.discard(fmt.OWNER_FILE)
    return out


class Intact:
    """The checks of one save's temporary directory ``tmp`` (made, locked and holding its owner
    file) and its checkpointable folders ``names``. :meth:`close` lets go of the folders."""

    def __init__(self, tmp: Path, names: Iterable[str]) -> None:
        self.tmp = tmp
        self._held: dict[str, int] = {}
        """Open folders by their path relative to the directory ("" for itself)."""
        try:
            for name in ["", *names]:
                flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
                self._held[name] = os.open(tmp / name, flags)
            self._owner: tuple[int, int] | None = _ids(tmp / fmt.OWNER_FILE)
        except BaseException:
            self.close()
            raise
        self._recorded: set[str] = set()

    def problem(self, root: Path | None = None, record: Path | None = None) -> str | None:
        """What shows that the directory at ``root`` (the temporary path, or the final one once
        renamed) is not, or no longer holds, what the save made; None if nothing does.
        ``record`` (the directory, or a folder in it whose writes all landed): every file below
        it now must stay from here on."""
        root = self.tmp if root is None else root
        for name, fd in self._held.items():
            where = root / name
            try:
                held = os.fstat(fd)  # ESTALE on NFS once another client removed it
                now = os.stat(where, follow_symlinks=False)
            except OSError as e:
                if not isinstance(e, FileNotFoundError | NotADirectoryError) and (
                    e.errno != errno.ESTALE
                ):
                    raise
                return f"{where} is gone"
            if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
                return f"{where} is another folder than the one this save made"
        if self._owner is not None:
            try:
                there = _ids(root / fmt.OWNER_FILE) == self._owner
            except FileNotFoundError:
                there = False
            if not there:
                return f"its owner file {fmt.OWNER_FILE}, there since the save began, is gone"
        present = _files(root) if self._recorded or record == root else set()
        missing = self._recorded - present
        if missing:
            names = ", ".join(sorted(missing)[:5]) + (", ..." if len(missing) > 5 else "")
            return f"{len(missing)} of the files it wrote are gone ({names})"
        if record is not None:
            found = present if record == root else _files(record)
            below = record.relative_to(self.tmp)
            self._recorded |= {(below / name).as_posix() for name in found}
        return None

    def expect(self, names: Iterable[str]) -> None:
        """The files ``names`` (relative to the directory) the save wrote must stay."""
        self._recorded.update(names)

    def drop_owner(self) -> str | None:
        """Just before the rename: remove the owner file (not part of a checkpoint). Its removal
        succeeding shows it was still there; if it was not, what shows it (as ``problem``)."""
        if self._owner is None:
            return None
        self._owner = None
        try:
            os.unlink(self.tmp / fmt.OWNER_FILE)
        except FileNotFoundError:
            return f"its owner file {fmt.OWNER_FILE}, there since the save began, is gone"
        return None

    def holds(self, path: Path) -> bool:
        """Whether ``path`` names the directory this save made."""
        fd = self._held.get("")
        if fd is None:
            return False
        held = os.fstat(fd)
        try:
            return _ids(path) == (held.st_dev, held.st_ino)
        except FileNotFoundError:
            return False

    def vanished(self, error: BaseException) -> str | None:
        """What of the directory ``error`` (or an error it was raised from) found missing, for an
        error of a step that reads only what the save wrote or listed: the save removes nothing
        in it while it runs, so another program did (this tells it even while that program is
        still at work, before the other checks can)."""
        for _ in range(8):
            if isinstance(error, FileNotFoundError) and error.filename:
                path = Path(os.fsdecode(error.filename))
                if path == self.tmp or self.tmp in path.parents:
                    return f"{'something in ' if os.path.lexists(path) else ''}{path} is gone"
            cause = error.__cause__ or error.__context__
            if cause is None:
                return None
            error = cause
        return None

    def close(self) -> None:
        while self._held:
            os.close(self._held.popitem()[1])
