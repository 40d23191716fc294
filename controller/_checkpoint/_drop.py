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
way. The timestamps and metrics of the checkpoint are kept. Object stores have no rename, so
there it is refused (``NotImplementedError``).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import zlib
from pathlib import Path
from typing import Any

from milepost import _format as fmt
from milepost import _hosts, _options, _storage, workers
from milepost._errors import (
    CheckpointableNotFoundError,
    CheckpointExistsError,
    LastCheckpointableError,
)
from milepost.workers import ObjectPath, as_path

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


def drop_checkpointable(final: Path | ObjectPath, name: str) -> None:
    """:func:`delete_checkpointable` in this process alone (a caller that is the primary)."""
    if not isinstance(name, str):
        raise TypeError(f"the checkpointable's name must be a str, got {type(name).__name__}")
    if not isinstance(final, Path):
        raise NotImplementedError(
            f"deleting one checkpointable of {final} is not supported on object stores (they "
            "have no atomic rename); load the checkpointables to keep and save them as a new "
            "checkpoint (milepost.load_checkpointables, milepost.save_checkpointables)"
        )
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


def _check_deletable(final: Path, name: str, names: list[str], meta: dict[str, Any]) -> None:
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
    gone = f"{name}/"
    files = {k: v for k, v in old.files.items() if not k.startswith(gone)}
    files[fmt.CHECKPOINT_METADATA] = (len(raw), workers.crc32c(raw))
    crc32 = None
    if old.crc32 is not None:
        crc32 = {k: v for k, v in old.crc32.items() if not k.startswith(gone)}
        crc32[fmt.CHECKPOINT_METADATA] = zlib.crc32(raw) & 0xFFFFFFFF
    fmt.Checksums(tmp, files, crc32).write()


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
