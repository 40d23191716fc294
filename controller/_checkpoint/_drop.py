"""Deleting one checkpointable of a committed checkpoint, atomically.

The checkpoint is never edited in place: its files would change one at a time, and a reader
could find ``_CHECKPOINT_METADATA`` naming a folder that is gone, or a checksum that no longer
matches. Instead, as a save that overwrites does:

1. lock the checkpoint's folder (held by a deletion of it: CheckpointExistsError) and take its
   temporary directory (``<path>.orbax-checkpoint-tmp``, locked: a save of the path in flight,
   in any process, holds it);
2. fill the temporary directory with hard links to every file of the checkpoint but the
   checkpointable's (copies where the file system has no hard links), a new
   ``_CHECKPOINT_METADATA`` without it, the recorded checksums without its files (the
   metadata's computed again), and the commit marker last;
3. swap it with the checkpoint in one ``renameat2(RENAME_EXCHANGE)`` (where the system lacks it,
   two renames, the old one first) and remove the old folder.

A reader sees the whole old checkpoint or the whole new one. A crash before the swap leaves a
temporary directory that is never loaded and that the next save of the path (or a Checkpointer
opening the root) removes; after it, the old folder under the temporary name, removed the same
way. The timestamps and metrics of the checkpoint are kept.

Object stores have no rename; there a checkpoint is visible while its commit marker exists, and
one writer holds the path by its lease (``_storage.ObjectWorkspace``). So, as an overwrite does:

1. take the path's lease (a save or deletion holding it: CheckpointExistsError, or a wait of
   ``SaveOptions.wait_for_writer_secs``); its save id says it deletes this checkpointable;
2. remove the commit marker: the checkpoint is not loadable from here on;
3. write the new ``_CHECKPOINT_METADATA`` and checksums, and read them back;
4. delete the checkpointable's objects, and list that none is left;
5. write the commit marker (read back), and release the lease.

A reader sees the whole old checkpoint, none, or the whole new one: never a marker over
metadata or checksums that disagree, nor over half a checkpointable (a folder the metadata does
not list still counts as a checkpointable when it holds one's files, so its objects go before
the marker). A failure in 2-3 puts the old metadata, checksums and marker back. One in 4-5 (or
a failed undo) leaves the lease, expired: the next call for the same checkpointable takes it
over and finishes the deletion; a save of the path replaces it; a Checkpointer's cleanup
leaves it alone.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from milepost import _hosts, _options, _storage, workers
from milepost._errors import (
    CheckpointableNotFoundError,
    CheckpointExistsError,
    CorruptCheckpointError,
    LastCheckpointableError,
)
from milepost.workers import ObjectPath, StoragePath, as_path, in_object_store
from milepost.workers import format as fmt

log = logging.getLogger("milepost")

_REMADE = frozenset({fmt.CHECKPOINT_METADATA, fmt.CHECKSUMS, fmt.COMMIT_MARKER, fmt.OWNER_FILE})
"""Files of the checkpoint's own that the new folder gets anew (or, the owner file, never)."""


def delete_checkpointable(path: Any, name: str) -> None:
    """Delete the checkpointable ``name`` of the committed checkpoint at ``path`` (see the
    module's docstring); on the primary process, every process getting its outcome."""
    final = as_path(path)
    timeout = _options.current().async_.timeout_secs
    group = _hosts.check_storage(_hosts.host_group_for([]), final)
    what = f"delete-checkpointable:{final}:{name}"
    _hosts.shared(group, what, lambda: drop_checkpointable(final, name), timeout)


def drop_checkpointable(final: StoragePath, name: str) -> None:
    """:func:`delete_checkpointable` in this process alone (a caller that is the primary)."""
    if not isinstance(name, str):
        raise TypeError(f"the checkpointable's name must be a str, got {type(name).__name__}")
    if in_object_store(final):
        _drop_objects(final, name)
        log.info("deleted the checkpointable %r of %s", name, final)
        return
    fmt.require_checkpoint(final)
    lock = _storage.try_lock(final)
    if lock is None:
        raise CheckpointExistsError(
            f"{final} is held by another process (being deleted, or committed); nothing was "
            "changed: try again once it is done"
        )
    with lock:
        fmt.require_checkpoint(final)  # still there, now that it is held
        checksums = fmt.Checksums.read(final)
        with fmt.verifying(checksums):  # rewrite nothing damaged
            meta = fmt.read_checkpoint_metadata(final)
        names = sorted(fmt.checkpointables(final, meta))
        _check_deletable(final, name, names, meta)
        workspace = _storage.LocalWorkspace(final, overwrite=True, wait_secs=0.0)
        # a save of the path in flight, in any process, holds its temporary directory:
        # CheckpointExistsError naming it
        workspace.prepare([n for n in names if n != name])
        try:
            _fill(final, workspace.dir, name, meta, checksums)
            workspace.check("before the commit marker", record=workspace.dir)
            fmt.write_file(
                workspace.dir / fmt.COMMIT_MARKER, f"Checkpoint commit was successful to {final}"
            )
            workspace.publish()
        except BaseException:
            workspace.abandon()
            raise
    log.info("deleted the checkpointable %r of %s", name, final)


def _check_deletable(final: StoragePath, name: str, names: list[str], meta: dict[str, Any]) -> None:
    if name not in names:
        raise CheckpointableNotFoundError(
            final,
            name,
            tuple(names),
            f"{final} has no checkpointable {name!r}; its checkpointables are "
            f"{', '.join(map(repr, names))}",
        )
    if len(names) == 1:
        raise LastCheckpointableError(
            final,
            name,
            f"{name!r} is the only checkpointable of {final}; a checkpoint without any is none: "
            "delete the checkpoint (or the step: Checkpointer.delete(step)) instead",
        )
    if not isinstance(meta.get("item_handlers"), dict):
        raise LastCheckpointableError(
            final,
            name,
            f"{final} records its checkpointables in no item_handlers mapping (an Orbax "
            "checkpoint of one item, or older), so none of them can be deleted alone: delete "
            "the checkpoint instead, or save the ones to keep as a new checkpoint",
        )


def _fill(
    final: Path, tmp: Path, name: str, meta: dict[str, Any], old: fmt.Checksums | None
) -> None:
    """Everything of the new checkpoint but its commit marker, in ``tmp`` (``old``: the
    checkpoint's recorded checksums)."""
    for entry in os.scandir(final):
        if entry.name == name or entry.name in _REMADE:
            continue
        _link_tree(Path(entry.path), tmp / entry.name)
    handlers = {k: v for k, v in meta["item_handlers"].items() if k != name}
    fmt.write_json(tmp / fmt.CHECKPOINT_METADATA, {**meta, "item_handlers": handlers})
    if old is None:
        return  # written without checksums (by Orbax): none now either
    raw = (tmp / fmt.CHECKPOINT_METADATA).read_bytes()
    _without(old, tmp, name, raw).write()


def _without(old: fmt.Checksums, root: StoragePath, name: str, raw: bytes) -> fmt.Checksums:
    """The checksums ``old`` for ``root``, without the files of ``name`` and with the new
    ``_CHECKPOINT_METADATA`` (``raw``)."""
    gone = f"{name}/"
    files = {k: v for k, v in old.files.items() if not k.startswith(gone)}
    files[fmt.CHECKPOINT_METADATA] = (len(raw), fmt.crc32c(raw))
    crc32 = None
    if old.crc32 is not None:
        crc32 = {k: v for k, v in old.crc32.items() if not k.startswith(gone)}
        crc32[fmt.CHECKPOINT_METADATA] = zlib.crc32(raw) & 0xFFFFFFFF
    return fmt.Checksums(root, files, crc32)


def _link_tree(source: Path, target: Path) -> None:
    """``target`` made like ``source``: folders made, files hard-linked (copied where links
    cannot be made), symlinks made again with the same target."""
    if source.is_symlink():
        os.symlink(os.readlink(source), target)
    elif source.is_dir():
        target.mkdir(exist_ok=True)
        for entry in os.scandir(source):
            _link_tree(Path(entry.path), target / entry.name)
    else:
        try:
            os.link(source, target)
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                raise
            shutil.copy2(source, target)


# ------------------------------------------------------------------------------------------
# Object stores
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Found:
    """What the deletion found, to put back if it fails before any object of the checkpointable
    is deleted (``marker`` None: a deletion's leftover, not a checkpoint to put back)."""

    meta: bytes
    checksums: bytes | None
    marker: bytes | None


def _drop_objects(final: ObjectPath, name: str) -> None:
    """:func:`drop_checkpointable` in an object store (the module's docstring)."""
    saving = _options.current().saving
    workspace = _storage.ObjectWorkspace(
        final, overwrite=True, wait_secs=saving.wait_for_writer_secs, lease_secs=saving.lease_secs
    )
    _refuse_another_unfinished(workspace, name)
    left, _ = _storage.read_lease(workspace.lease_path)
    if left is None or not left.save_id.startswith(_purpose(name)):
        # Not a deletion of this name to finish: only a committed checkpoint, checked before the
        # lease is touched (a failed save's expired lease stays its own, covering its late
        # writes until the next save of the path takes it over).
        fmt.require_checkpoint(final)
    try:
        workspace.hold(_purpose(name))
    except CheckpointExistsError as e:
        e.add_note(
            f"Deleting the checkpointable {name!r} changed nothing of {final}: try again once "
            "that writer is done (or SaveOptions(wait_for_writer_secs=...) to wait for it)."
        )
        raise
    previous = workspace.taken_from
    resuming = previous is not None and previous.save_id.startswith(_purpose(name))
    try:
        try:
            resuming = resuming and not (final / fmt.COMMIT_MARKER).exists()
            meta, checksums, found = _read_found(final, name, resuming)
        except BaseException:
            if resuming:  # what it found stays for a later call (its lease says so)
                workspace.leave()
            raise
        _replace(workspace, final, name, meta, checksums, found)
    finally:
        workspace.release()


def _purpose(name: str) -> str:
    return f"{_storage.DELETING}{name!r} "


def _refuse_another_unfinished(workspace: _storage.ObjectWorkspace, name: str) -> None:
    """CheckpointExistsError when the path was left by an unfinished deletion of another
    checkpointable (expired lease, no marker): that deletion is to be finished first."""
    lease, _ = _storage.read_lease(workspace.lease_path)
    if (
        lease is None
        or not lease.save_id.startswith(_storage.DELETING)
        or lease.save_id.startswith(_purpose(name))
        or lease.expires >= time.time()
        or (workspace.final / fmt.COMMIT_MARKER).exists()
    ):
        return
    raise CheckpointExistsError(
        f"{workspace.final} was left by a deletion of one of its checkpointables that did not "
        f"finish ({lease.save_id}; no commit marker, so nothing loads from it); nothing was "
        "changed. Call milepost.delete_checkpointable on it for that checkpointable first to "
        "finish it, or save the path again to replace it"
    )


def _read_found(
    final: ObjectPath, name: str, resuming: bool
) -> tuple[dict[str, Any], fmt.Checksums | None, _Found]:
    """The checkpoint's metadata and checksums, checked, and what to put back on a failure.
    ``resuming``: what a deletion of ``name`` that did not finish left (its lease taken over, no
    commit marker), taken as it is, to be finished."""
    marker = final / fmt.COMMIT_MARKER
    where = final / fmt.CHECKPOINT_METADATA
    if not resuming:
        fmt.require_checkpoint(final)  # still there, now that it is held
        checksums = fmt.Checksums.read(final)
        with fmt.verifying(checksums):  # rewrite nothing damaged
            meta = fmt.read_checkpoint_metadata(final)
            _check_deletable(final, name, sorted(fmt.checkpointables(final, meta)), meta)
            raw = fmt.read_checked(where, "the checkpoint metadata")
        old_sums = None if checksums is None else (final / fmt.CHECKSUMS).read_bytes()
        return meta, checksums, _Found(raw, old_sums, marker.read_bytes())
    checksums = fmt.Checksums.read(final)
    raw = (final / fmt.CHECKPOINT_METADATA).read_bytes()
    meta = fmt.parse_json(where, raw, "the checkpoint metadata", user_data=True)
    handlers = meta.get("item_handlers") if isinstance(meta, dict) else None
    listed = isinstance(handlers, dict) and name in handlers
    gone = f"{name}/"
    if not isinstance(handlers, dict) or (
        checksums is not None
        and not checksums.matches(fmt.CHECKPOINT_METADATA, raw)
        and (listed or not any(k.startswith(gone) for k in checksums.files))
    ):
        raise CorruptCheckpointError(
            f"{final} was left by a deletion of its checkpointable {name!r} that did not "
            f"finish, but its {fmt.CHECKPOINT_METADATA} and {fmt.CHECKSUMS} are not what that "
            "deletion writes; nothing was changed. Load an earlier checkpoint, or save the path "
            "again"
        )
    if not listed:  # stopped after its new metadata: finish it
        return meta, checksums, _Found(raw, None, None)
    # stopped before: the checkpoint as it was, hidden (put back whole if this call fails)
    _check_deletable(final, name, sorted(fmt.checkpointables(final, meta)), meta)
    old_sums = None if checksums is None else (final / fmt.CHECKSUMS).read_bytes()
    return meta, checksums, _Found(raw, old_sums, _marker_text(final).encode())


def _marker_text(final: ObjectPath) -> str:
    return f"Checkpoint commit was successful to {final}"


def _replace(
    workspace: _storage.ObjectWorkspace,
    final: ObjectPath,
    name: str,
    meta: dict[str, Any],
    checksums: fmt.Checksums | None,
    found: _Found,
) -> None:
    """Hide the checkpoint, write its new metadata and checksums, delete the checkpointable's
    objects, and commit it again (the module's docstring: steps 2-5)."""
    workspace.check("before the commit marker is removed")
    (final / fmt.COMMIT_MARKER).unlink(missing_ok=True)
    try:
        _write_new(final, name, meta, checksums)
    except BaseException as e:
        _put_back(workspace, final, name, found, e)
        raise
    try:
        workspace.check("before the checkpointable's objects are deleted")
        _delete_objects(final / name)
        workspace.check("before the commit marker")
        _mark(final)
    except BaseException as e:
        workspace.leave()
        e.add_note(_unfinished(workspace, final, name))
        raise


def _write_new(
    final: ObjectPath, name: str, meta: dict[str, Any], checksums: fmt.Checksums | None
) -> None:
    """The metadata without ``name`` and the checksums without its files, each read back."""
    handlers = {k: v for k, v in meta["item_handlers"].items() if k != name}
    raw = json.dumps({**meta, "item_handlers": handlers}).encode()
    _write_confirmed(final / fmt.CHECKPOINT_METADATA, raw)
    if checksums is not None:
        new = _without(checksums, final, name, raw)
        new.write()
        kept = fmt.Checksums.read(final)
        if kept is None or (kept.files, kept.crc32) != (new.files, new.crc32):
            raise _lost(final / fmt.CHECKSUMS)


def _write_confirmed(path: ObjectPath, raw: bytes) -> None:
    fmt.write_file(path, raw)
    try:
        kept = path.read_bytes()
    except FileNotFoundError:
        kept = None
    if kept != raw:
        raise _lost(path)


def _lost(path: ObjectPath) -> workers.LostWriteError:
    return workers.LostWriteError(
        errno.EIO,
        f"the storage acknowledged the write of {path} but does not hold it now (a proxy or "
        "gateway that drops writes?)",
        str(path),
        path=str(path),
    )


def _delete_objects(folder: ObjectPath) -> None:
    """Delete every object below ``folder``, then list that none is left."""
    folder.delete_tree().result()
    left = folder.keys()
    if left:
        raise OSError(
            errno.EIO,
            f"{len(left)} objects below {folder} are still listed after deleting them "
            f"({left[0]}, ...)",
            str(folder),
        )


def _mark(final: ObjectPath) -> None:
    """Write the commit marker, and read it back."""
    _write_confirmed(final / fmt.COMMIT_MARKER, _marker_text(final).encode())


def _put_back(
    workspace: _storage.ObjectWorkspace,
    final: ObjectPath,
    name: str,
    found: _Found,
    error: BaseException,
) -> None:
    """After ``error``, before any object of ``name`` was deleted: the checkpoint as found (its
    metadata and checksums read back, then its marker); where that cannot be done, the lease
    left for the next call to finish the deletion. ``error`` gets a note saying which."""
    if found.marker is None:  # a deletion's leftover: nothing whole to put back
        workspace.leave()
        error.add_note(_unfinished(workspace, final, name))
        return
    try:
        workspace.check("before the checkpoint is put back")
    except OSError as e:  # another writer owns the path now: not ours to write
        error.add_note(f"{final} was left without its commit marker: {e}")
        return
    try:
        _write_confirmed(final / fmt.CHECKPOINT_METADATA, found.meta)
        if found.checksums is not None:
            _write_confirmed(final / fmt.CHECKSUMS, found.checksums)
        _write_confirmed(final / fmt.COMMIT_MARKER, found.marker)
    except Exception as e:
        with contextlib.suppress(Exception):  # no marker over what may not match it
            (final / fmt.COMMIT_MARKER).unlink(missing_ok=True)
        workspace.leave()
        error.add_note(
            f"Putting {final} back as it was failed too ({type(e).__name__}: {e}). "
            + _unfinished(workspace, final, name)
        )
        return
    error.add_note(f"{final} was put back as it was: nothing was deleted.")


def _unfinished(workspace: _storage.ObjectWorkspace, final: ObjectPath, name: str) -> str:
    return (
        f"Deleting the checkpointable {name!r} of {final} did not finish: {final} has no commit "
        f"marker, so no checkpoint loads from it meanwhile (its other checkpointables are "
        f"there; objects of {name!r} may be left). Call milepost.delete_checkpointable on it "
        f"for {name!r} again to finish (it takes over the lease {workspace.lease_path} this "
        "call left, expired), or save the path again to replace it."
    )
