"""The commit of a save: what makes the data its hosts wrote a checkpoint. It runs on the
process that commits (the primary controller process), once every write of the save is durable:
the save waits for its writes first, and waiting only waits (``_save._Save._finish``). Its
phases, in order, each a function below:

1. :func:`tree_files`: each pytree's format files (``_METADATA``, ``_sharding``,
   ``_milepost.json``, ``_strings.json``, ``array_metadatas/``), from the hosts' acks.
2. :func:`merge`: each pytree's per-process OCDBT databases referenced from one root view
   (``milepost.workers.merge_ocdbt``, the format's merge; called only here), every data file
   it references confirmed there; plain zarr3 folders: their chunk files confirmed. Only once
   every host's writes are durable: the merge reads each database's manifest and B-tree as
   they are then, and a database still being written would be merged without its last keys.
3. Abandoned? A save cancelled, or given up by an interpreter exit, before its commit stops
   here: nothing more is written for a commit never made (no checksums, no marker). (Asked
   before phase 1 too: one abandoned before its commit began does not merge for nothing.)
4. :func:`own_files`: the checkpoint's own files (``_CHECKPOINT_METADATA``, the Orbax
   marker file), once the workspace is checked to be still this save's.
5. :func:`read_back`: on an object store, each pytree read back through its root view, and the
   files it must have to load listed. Before the checksums and the marker: a store may
   acknowledge a write it did not keep, and a commit must not vouch for it.
6. :func:`checksums`: ``_milepost_checksums.json``, every file but array chunks (they carry
   their own). After every file it lists was written, so it lists them all.
7. :func:`marker`: the commit marker, last of the files: from ``mark()``, right before it, the
   save commits or fails; an exit or a cancel can no longer abandon it.
8. :func:`publish`: the marker, the checksums and what they must list read back, then the
   checkpoint made visible (the rename into place on a local disk; on an object store the
   marker already is). After the marker, so a checkpoint is never visible without it.
"""

from __future__ import annotations

import errno
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from milepost import workers
from milepost._checkpoint._calls import WrittenTree
from milepost._checkpoint._handlers import PyTreeHandler
from milepost._checkpoint._pytree_load import array_headers
from milepost._storage import LocalWorkspace, ObjectWorkspace
from milepost._tree import ValueType
from milepost.workers import StoragePath, is_local
from milepost.workers import format as fmt

PROCESS = fmt.PROCESS_PREFIX


def _go_on() -> None:
    return None


def _as_is(error: Exception) -> Exception:
    return error


def commit(
    tmp: StoragePath,
    final: StoragePath,
    handlers: Mapping[str, Any],
    init_ns: int,
    custom_json: str,
    metrics: Any,
    workspace: LocalWorkspace | ObjectWorkspace,
    mark: Callable[[], None],
    trees: Sequence[WrittenTree] = (),
    abandoned: Callable[[], None] = _go_on,
    trees_failed: Callable[[Exception], Exception] = _as_is,
) -> None:
    """Commit the save written into ``tmp`` (its workspace) as the checkpoint ``final``: the
    phases of the module's docstring, in that order. ``trees``: the pytrees written, whose
    format files and merge are the commit's first phases; a failure there is raised as
    ``trees_failed(error)`` makes it. ``abandoned()`` raises if the save was abandoned before
    its commit (phase 3); ``mark()``, right before the marker, raises if it was abandoned and
    otherwise makes that impossible from then on. The workspace is checked to be still this
    save's after the tree metadata, before the marker and at the rename. (Every argument is
    passed by position: tests wrap this function with ``fn(tmp, final, *rest)``.)"""
    abandoned()
    try:
        for tree in trees:
            tree_files(tree)
        for tree in trees:
            merge(tree)
    except Exception as e:
        failure = trees_failed(e)
        if failure is e:
            raise
        raise failure from failure.__cause__
    abandoned()
    workspace.check("after the tree metadata", record=tmp)  # every write has landed
    own_files(tmp, handlers, init_ns, custom_json, metrics)
    # Reading back and checksumming ask the store for one listing and each file once (and write
    # nothing while its answers are remembered: the checksums are written after).
    with workers.reading_once():
        needed = read_back(tmp, final, handlers)
        sums = checksums(tmp)
    sums.write()
    workspace.check("before the commit marker", record=tmp)
    marker(tmp, final, mark)
    publish(workspace, sums, needed)


# ------------------------------------------------------------------------------------------
# The phases
# ------------------------------------------------------------------------------------------


def tree_files(tree: WrittenTree) -> None:
    """Phase 1: the format files of one pytree, from its writers' acks."""
    platform = jax.devices()[0].platform if jax.device_count() else "cpu"
    fmt.write_tree(tree.directory, tree.files, tree.acks, platform)


def merge(tree: WrittenTree) -> None:
    """Phase 2: every data file the tree needs is confirmed there, whole (one listing per
    folder), or :class:`~milepost.workers.LostWriteError` names one that is not: the hosts'
    databases' manifests before the merge, what the root view references by the merge
    (``milepost.workers.merge_ocdbt``, looked up when called), and plain zarr3 chunk files."""
    if tree.files.use_ocdbt:
        confirm_databases(tree.directory, tree.acks)
        fmt.merge_ocdbt(tree.directory)  # (looked up here: tests hold a save at it)
    else:
        fmt.confirm_files(tree.directory, _chunk_files(tree.acks))


def confirm_databases(directory: StoragePath, acks: list[workers.SaveAck]) -> None:
    """The manifest of every database the hosts say they wrote chunks into is there, before
    the merge (one whose manifest was lost would merge as an empty database): a listing of its
    own, as the merge's readers are TensorStore's and any caller's (tests wrap it)."""
    databases = {d for ack in acks for d in ack.chunk_tables}
    manifests = [f"{d}/{fmt.OCDBT_MANIFEST}" for d in databases if d.startswith(PROCESS)]
    fmt.confirm_files(directory, dict.fromkeys(sorted(manifests), 1))


def _chunk_files(acks: list[workers.SaveAck]) -> dict[str, int]:
    """Plain zarr3 folders: each chunk file (shard) the hosts wrote, with its bytes as the host
    reported them, else (compressed) at least its index's (16 a chunk, a CRC32C: at its end)."""
    out: dict[str, int] = {}
    for ack in acks:
        for array in ack.arrays:
            shape = zip(array.write_shape, array.chunk_shape, strict=True)
            per_shard = [w // c if c else 1 for w, c in shape]
            size = array.shard_bytes or 16 * math.prod(per_shard) + 4
            for grid, _ in array.chunk_crc32c:
                shard = [i // n for i, n in zip(grid, per_shard, strict=True)]
                out[f"{array.name}/{'/'.join(['c', *map(str, shard)])}"] = size
    return out


def own_files(
    tmp: StoragePath,
    handlers: Mapping[str, Any],
    init_ns: int,
    custom_json: str,
    metrics: Any,
) -> None:
    """Phase 4: the checkpoint's own files (which handler wrote each checkpointable, the
    metrics, the times, the custom metadata)."""
    fmt.write_file(tmp / fmt.ORBAX_MARKER, b"")
    fmt.write_json(
        tmp / fmt.CHECKPOINT_METADATA,
        {
            "item_handlers": {name: h.typestr for name, h in handlers.items()},
            "metrics": metrics,
            "performance_metrics": {},
            "init_timestamp_nsecs": init_ns,
            "commit_timestamp_nsecs": time.time_ns(),
            "custom_metadata": json.loads(custom_json),
        },
    )


def read_back(tmp: StoragePath, final: StoragePath, handlers: Mapping[str, Any]) -> list[str]:
    """Phase 5: the files (relative to ``tmp``) the checkpoint must have to load, which
    :func:`publish` confirms are listed by the checksums. On an object store, which may
    acknowledge a write it did not keep, each pytree is read back through its root view first
    (:func:`confirm_written`), or the save fails with :class:`~milepost.workers.LostWriteError`;
    local files are fsynced."""
    needed = [fmt.CHECKPOINT_METADATA, fmt.ORBAX_MARKER]
    if is_local(tmp):
        return needed
    tmp.keys()
    try:
        for name, h in handlers.items():
            if isinstance(h, PyTreeHandler):
                needed += [f"{name}/{f}" for f in confirm_written(tmp / name)]
    except (OSError, ValueError) as e:
        raise workers.LostWriteError(
            errno.EIO,
            f"the save to {final} does not read back ({type(e).__name__}: {e}); the "
            "storage may have dropped a write it acknowledged. Nothing was committed, "
            "and what this save wrote is removed. Save again, and check the storage path",
            str(final),
            path=str(final),
        ) from e
    return needed


def confirm_written(directory: StoragePath) -> list[str]:
    """The files (relative to ``directory``) a saved tree must have to load (``_METADATA``, and
    by what it records ``_milepost.json``, ``_strings.json``, the OCDBT manifest); and every
    array's header read through the root view, so the manifest and B-tree the merge wrote are
    there. For stores that may drop a write."""
    files = fmt.read_tree(directory)
    vts = [leaf.value_type for leaf in files.leaves.values()]
    arrays = [n for n, leaf in files.leaves.items() if leaf.value_type.is_array]
    needed = [fmt.TREE_METADATA]
    if arrays:
        needed += [fmt.MILEPOST_INFO] + ([fmt.OCDBT_MANIFEST] if files.use_ocdbt else [])
    if ValueType.JAX_ARRAY in vts:  # _sharding only if it was written (it may be left out)
        needed += [f for f in files.sharding_files or (fmt.SHARDING,) if f not in needed]
    if ValueType.STRING in vts:
        needed.append(fmt.STRINGS)
    if arrays:
        array_headers(directory, files, arrays)  # a missing manifest or node is an error
    return needed


def checksums(tmp: StoragePath) -> fmt.Checksums:
    """Phase 6: ``_milepost_checksums.json``, of every file but array chunks (they carry
    theirs), computed (the caller writes it once its reads are done)."""
    return fmt.Checksums.compute(tmp)


def marker(tmp: StoragePath, final: StoragePath, mark: Callable[[], None]) -> None:
    """Phase 7: the commit marker, last; ``mark()`` right before it (it raises if the save was
    abandoned, and from then on no exit or cancel can abandon it)."""
    mark()
    fmt.write_file(tmp / fmt.COMMIT_MARKER, f"Checkpoint commit was successful to {final}")


def publish(
    workspace: LocalWorkspace | ObjectWorkspace, sums: fmt.Checksums, needed: list[str]
) -> None:
    """Phase 8: the marker, the checksums and what they must list are read back, or the save
    fails and is removed (the marker first); then the checkpoint is made visible."""
    workspace.confirm(sums, needed)
    workspace.publish()
