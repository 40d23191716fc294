"""A place where a Checkpointer keeps its steps: a folder per step (``<step>``, or the names
Orbax's step name formats give: see :mod:`._naming`), in a local folder or under an
object-store prefix. The durable root is one; the optional local tier another.

Only the primary lists and deletes. A step counts once it is committed; what an unfinished
save or deletion left is removed only when no live process owns it (its lock, or in an object
store its lease), so a save running in another process is never touched. Only names of a
naming the tier knows (plain, its own, its committed steps') are ever removed.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from milepost import _checkpoint, _storage
from milepost.training._errors import StepBusyError, StepNamingError
from milepost.training._naming import PLAIN, StepNaming, is_leftover_name, parse, step_of
from milepost.workers import ObjectPath, StoragePath, in_object_store, is_local
from milepost.workers import format as fmt

log = logging.getLogger("milepost.training")

DELETING_SUFFIX = ".milepost-deleting"


def known_prefixes(committed: set[str], naming: StepNaming = PLAIN) -> set[str | None]:
    """The prefixes whose folders are steps of a root holding the ``committed`` step names:
    none (plain), ``naming``'s, and theirs."""
    found = {p[0] for p in map(parse, committed) if p is not None}
    return {None, naming.prefix} | found


def is_leftover_of_step(name: str, prefixes: set[str | None]) -> bool:
    """``<step name>.orbax-checkpoint-tmp[...]`` or ``<step name>.milepost-deleting``."""
    return is_leftover_name(name, (fmt.TMP_SUFFIX, DELETING_SUFFIX), prefixes)


def is_step_of(name: str, prefixes: set[str | None]) -> bool:
    found = parse(name)
    return found is not None and found[0] in prefixes


def tier_at(path: StoragePath, lease_secs: float) -> Tier:
    """The tier in the folder ``path``: a :class:`LocalTier` or an :class:`ObjectTier`."""
    return LocalTier(path, lease_secs) if is_local(path) else ObjectTier(path, lease_secs)


class Tier:
    """What every tier does the same way (its steps' names, listing their metadata); how a
    local folder and an object store list, clean up and delete are its two subclasses'."""

    path: StoragePath

    def __init__(self, path: StoragePath, lease_secs: float) -> None:
        self.path = path
        self.lease_secs = lease_secs
        self.naming = PLAIN
        """How new steps are named (the Checkpointer sets it from its options or the root)."""
        self.names: dict[int, str] = {}
        """Committed step -> its folder's name, as last listed (a step not there: ``naming``)."""
        self.times: dict[int, int] = {}
        """Committed step -> its commit time (``commit_timestamp_nsecs``), as last listed."""

    def __str__(self) -> str:
        return str(self.path)

    def step(self, step: int) -> StoragePath:
        return self.path / self.names.get(step, self.naming.name(step))

    # -- listing ------------------------------------------------------------------------
    def open(self, read_only: bool) -> dict[int, dict[str, Any]]:
        """On the primary: make the folder, clean what unfinished saves left (unless
        ``read_only``) and list the committed steps with their metrics."""
        if self.path.exists() and not self.path.is_dir():
            raise NotADirectoryError(
                f"checkpoint root {self.path} is a file; "
                "pass a directory (it is created if missing)"
            )
        if not read_only:
            self.path.mkdir(parents=True, exist_ok=True)
            self.remove_uncommitted()
        return self.scan()

    def committed_names(self) -> set[str]:
        """Names of the committed step folders (of any naming)."""
        raise NotImplementedError

    def entries(self) -> dict[int, list[tuple[StoragePath, str]]]:
        """step -> [(folder, what)]: committed steps, and what unfinished saves or deletions
        left (``milepost ls``)."""
        raise NotImplementedError

    def remove_uncommitted(self) -> None:
        """Remove what saves and deletions that did not finish left behind: a step's temporary
        directory (or one being made), an uncommitted step folder, a half-deleted step. Each
        only if no live process holds its lock (its lease, in an object store): a save in
        progress, in any process, does."""
        raise NotImplementedError

    def delete(self, steps: list[int]) -> list[int]:
        """Delete committed steps; one another process holds is skipped (with a warning).
        Returns the steps deleted."""
        return self._delete(steps)

    def _delete(self, steps: list[int]) -> list[int]:
        raise NotImplementedError

    def delete_one(self, step: int) -> None:
        """Delete the committed ``step``; StepBusyError if another process holds it."""
        raise NotImplementedError

    def _has_metadata(self, step_folder: StoragePath) -> bool:
        """Whether to read the step's ``_CHECKPOINT_METADATA`` (absent from steps written
        before Orbax wrote that file)."""
        return True

    def scan(self) -> dict[int, dict[str, Any]]:
        """The committed steps with their metrics; ``names`` says their folders.
        StepNamingError if two folders hold one step."""
        names: dict[int, str] = {}
        for name in sorted(self.committed_names()):
            step = step_of(name)
            assert step is not None
            if step in names:
                raise StepNamingError(
                    self.path,
                    (names[step], name),
                    f"step {step} is in two folders of {self.path}: {names[step]!r} and "
                    f"{name!r}; move one of them out of the root (or delete it)",
                )
            names[step] = name
        out: dict[int, dict[str, Any]] = {}
        times: dict[int, int] = {}
        for step, name in names.items():
            p = self.path / name
            try:
                meta = (
                    fmt.read_json(
                        p / fmt.CHECKPOINT_METADATA, "checkpoint metadata", user_data=True
                    )
                    if self._has_metadata(p)
                    else {}  # a step from before Orbax wrote that file
                )
            except (FileNotFoundError, ValueError) as e:
                log.warning("ignoring step %s: %s", p.name, e)
                continue
            metrics = meta.get("metrics") if isinstance(meta, dict) else None
            out[step] = dict(metrics) if isinstance(metrics, dict) else {}
            stamp = meta.get("commit_timestamp_nsecs") if isinstance(meta, dict) else None
            if isinstance(stamp, int) and not isinstance(stamp, bool):
                times[step] = stamp
        self.names = {step: names[step] for step in out}
        self.times = times
        return out


class LocalTier(Tier):
    """A tier in a local folder: steps listed by the folder's entries, held by their locks."""

    path: Path

    def committed_names(self) -> set[str]:
        if not self.path.exists():
            return set()
        return {
            p.name
            for p in self.path.iterdir()
            if step_of(p.name) is not None and fmt.is_committed(p)
        }

    def entries(self) -> dict[int, list[tuple[StoragePath, str]]]:
        out: dict[int, list[tuple[StoragePath, str]]] = {}
        committed = self.committed_names()
        ours = known_prefixes(committed)
        for p in sorted(self.path.iterdir()):
            name = p.name
            if is_step_of(name, ours) and p.is_dir():
                out.setdefault(_number(name), []).append(
                    (p, "committed" if name in committed else "uncommitted")
                )
            elif is_leftover_of_step(name, ours):
                what = "being deleted" if DELETING_SUFFIX in name else "unfinished save"
                out.setdefault(_number(name.partition(".")[0]), []).append((p, what))
        return out

    def _has_metadata(self, step_folder: StoragePath) -> bool:
        return (step_folder / fmt.CHECKPOINT_METADATA).exists()

    def remove_uncommitted(self) -> None:
        busy = _checkpoint.saves_in_flight(self.path)  # saves of this process: not leftovers
        ours = known_prefixes(self.committed_names(), self.naming)
        for p in sorted(self.path.iterdir()):
            name = p.name
            partial = (
                is_step_of(name, ours)
                and p.is_dir()
                and not p.is_symlink()
                and not fmt.is_committed(p)
            )
            if partial and fmt.is_foreign_unfinished(p):
                log.warning("left %s alone: another program's save that has not finished", p)
                continue
            making = (
                name.startswith(".")
                and _storage.NEW_MARKER in name
                and is_step_of(name[1:].partition(".")[0], ours)
            )
            leftover = is_leftover_of_step(name, ours) and (p.is_dir() or p.is_symlink())
            if not (partial or making or leftover):
                continue
            if name.lstrip(".").partition(".")[0] in busy:
                continue
            if _storage.remove_abandoned_folder(p):
                log.warning("removed %s, left by a save or deletion that did not finish", p)
            else:
                log.info("left %s alone: a live process holds it", p)

    def _delete(self, steps: list[int]) -> list[int]:
        deleted = []
        for step in steps:
            try:
                self.delete_one(step)
            except StepBusyError as e:
                log.warning("retention skipped step %s: %s", step, e)
                continue
            deleted.append(step)
        return deleted

    def delete_one(self, step: int) -> None:
        path = self.step(step)
        assert is_local(path)  # (a step of a local folder)
        if not path.exists():
            self.names.pop(step, None)
            return
        lock = _storage.try_lock(path)
        if lock is None:
            raise StepBusyError(
                f"step {step} in {self.path} is held by another "
                "process (being committed); it was not deleted"
            )
        with lock:
            # Rename first: a crash mid-delete leaves a name that is never listed, not half a step.
            trash = path.with_name(path.name + DELETING_SUFFIX)
            if trash.exists():
                _storage.remove_tree(trash)
            os.rename(path, trash)
            _storage.remove_tree(trash)
        self.names.pop(step, None)


class ObjectTier(Tier):
    """A tier under an object-store prefix: steps listed by one listing of its keys, each
    save's and deletion's ownership a lease object."""

    path: ObjectPath

    def committed_names(self) -> set[str]:
        if not self.path.exists():
            return set()
        return self.listing()[0]

    def listing(self) -> tuple[set[str], set[str]]:
        """(committed step names, every step folder name), from one listing."""
        committed, folders, _ = self._listing()
        return committed, folders

    def entries(self) -> dict[int, list[tuple[StoragePath, str]]]:
        out: dict[int, list[tuple[StoragePath, str]]] = {}
        committed, folders = self.listing()
        ours = known_prefixes(committed)
        for name in sorted(folders, key=_number):
            if is_step_of(name, ours):
                out.setdefault(_number(name), []).append(
                    (self.path / name, "committed" if name in committed else "uncommitted")
                )
        return out

    def _listing(self) -> tuple[set[str], set[str], set[str]]:
        """(committed step names, step folder names, names of steps with a lease object)."""
        committed, folders, leased = set(), set(), set()
        for key in self.path.keys():
            head, _, rest = key.partition("/")
            if rest and step_of(head) is not None:
                folders.add(head)
                if rest == fmt.COMMIT_MARKER:
                    committed.add(head)
            elif not rest and head.endswith(_storage.LEASE_SUFFIX):
                name = head.removesuffix(_storage.LEASE_SUFFIX)
                if step_of(name) is not None:
                    leased.add(name)
        return committed, folders, leased

    def remove_uncommitted(self) -> None:
        busy = _checkpoint.saves_in_flight(self.path)  # saves of this process: not leftovers
        committed, folders, leased = self._listing()
        ours = known_prefixes(committed, self.naming)
        folders = {name for name in folders if is_step_of(name, ours)}
        leased = {name for name in leased if is_step_of(name, ours)}
        for name in sorted(leased - folders - busy):  # a failed save's, expired: no debris
            if _storage.remove_expired_lease(self.path / name):
                log.info("removed the expired lease of %s", self.path / name)
        for name in sorted(folders - committed - busy):
            if _storage.remove_abandoned_objects(self.path / name, self.lease_secs):
                log.warning(
                    "removed %s, left by a save or deletion that did not finish",
                    self.path / name,
                )
            else:
                log.info("left %s alone: a live save owns it", self.path / name)

    def delete_one(self, step: int) -> None:
        if self._delete([step]) != [step]:
            raise StepBusyError(
                f"step {step} in {self.path} is being written "
                "by another process; it was not deleted"
            )

    def _delete(self, steps: list[int]) -> list[int]:
        """Delete committed steps, all at once. Under each step's lease, the commit marker
        goes first (the step stops being loadable), then every key, in parallel; a step
        another save owns is skipped."""
        owned: list[tuple[int, _storage.ObjectWorkspace]] = []
        for step in steps:
            path = self.step(step)
            assert in_object_store(path)  # (a step of a tier in an object store)
            workspace = _storage.ObjectWorkspace(
                path, overwrite=True, wait_secs=0.0, lease_secs=self.lease_secs
            )
            try:
                workspace.acquire()
            except FileExistsError as e:
                log.warning("step %s not deleted: %s", step, e)
                continue
            owned.append((step, workspace))
        try:
            for _, workspace in owned:
                (workspace.final / fmt.COMMIT_MARKER).unlink(missing_ok=True)
            deletions = [workspace.final.delete_tree() for _, workspace in owned]
            for deletion in deletions:
                deletion.result()
        finally:
            for _, workspace in owned:
                workspace.release()
        for step, _ in owned:
            self.names.pop(step, None)
        return [step for step, _ in owned]


def _number(name: str) -> int:
    """The step a step folder's (or its leftover's) name says."""
    step = step_of(name)
    assert step is not None
    return step
