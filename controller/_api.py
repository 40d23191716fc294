"""The public functions: save, load, metadata, and their checkpointable variants."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from milepost import _checkpoint, _hosts, _progress, _readers
from milepost._checkpoint import CheckpointMetadata, LoadHandle, SaveHandle
from milepost.workers import ObjectPath, StoragePath, as_path

PathLike = str | os.PathLike[str] | ObjectPath
STATE = _readers.STATE


def save(
    path: PathLike,
    state: Any,
    *,
    overwrite: bool = False,
    custom_metadata: Mapping[str, Any] | None = None,
) -> StoragePath:
    """Save a tree of arrays, scalars and strings to ``path``; returns once it is committed.

    ``state`` is any pytree (dicts, lists, tuples, dataclasses registered with JAX) of
    ``jax.Array`` (sharded or not; typed PRNG keys too), NumPy arrays, Python/NumPy scalars and
    strings. Every host writes the shards it owns (one replica of each, split among replicas);
    the checkpoint appears at ``path`` all at once, or not at all (a crash leaves only a
    temporary folder that the next save cleans up). ``path``: a local folder, ``gs://``,
    ``s3://`` or ``memory://``. An existing checkpoint is an error unless ``overwrite=True``.
    ``custom_metadata``: JSON you get back from :func:`metadata`. How it writes (layout,
    compression, subchunking) comes from ``SaveOptions`` in a :class:`Context`.

    >>> mp.save("/ckpt/1000", {"params": params, "step": 1000})
    >>> with mp.Context(saving=mp.SaveOptions(chunk_byte_size=4 << 20)):
    ...     mp.save("/ckpt/1000", state, overwrite=True)
    """
    return save_checkpointables(
        path, {STATE: state}, overwrite=overwrite, custom_metadata=custom_metadata
    )


def save_async(
    path: PathLike,
    state: Any,
    *,
    overwrite: bool = False,
    custom_metadata: Mapping[str, Any] | None = None,
) -> SaveHandle:
    """Like :func:`save`, but returns as soon as every array is copied to host memory.

    After it returns you may delete, donate or overwrite your arrays; the checkpoint holds their
    values from the time of the call. ``handle.result()`` waits for the commit and re-raises a
    failure of the background part.
    """
    return save_checkpointables_async(
        path, {STATE: state}, overwrite=overwrite, custom_metadata=custom_metadata
    )


def save_checkpointables(
    path: PathLike,
    checkpointables: Mapping[str, Any],
    *,
    overwrite: bool = False,
    custom_metadata: Mapping[str, Any] | None = None,
    metrics: Mapping[str, Any] | None = None,
) -> StoragePath:
    """Save several separable checkpointables, each in its own folder of one checkpoint.

    Each value of ``checkpointables`` goes to a handler (a pytree, a JSON-able value, a
    :class:`StatefulCheckpointable`, or one you registered) and to the folder of its name; load
    any of them alone later with :func:`load_checkpointables`. ``metrics`` (numbers) are stored
    with the checkpoint, as Orbax does, for the Checkpointer's best-step policies.

    >>> mp.save_checkpointables("/ckpt/1000", {"state": state, "dataset": {"position": 1234}},
    ...                         metrics={"loss": 0.25})
    """
    return _checkpoint.start_save(
        path,
        checkpointables,
        overwrite=overwrite,
        custom_metadata=custom_metadata,
        metrics=metrics,
        asynchronous=False,
    ).result()


def save_checkpointables_async(
    path: PathLike,
    checkpointables: Mapping[str, Any],
    *,
    overwrite: bool = False,
    custom_metadata: Mapping[str, Any] | None = None,
    metrics: Mapping[str, Any] | None = None,
) -> SaveHandle:
    """Like :func:`save_checkpointables`, but returns as soon as every array is copied to host
    memory (see :func:`save_async`); ``handle.result()`` waits for the commit.

    >>> handle = milepost.save_checkpointables_async(
    ...     path, {"state": state, "dataset": {"position": 7}}
    ... )
    >>> handle.result()
    """
    return _checkpoint.start_save(
        path,
        checkpointables,
        overwrite=overwrite,
        custom_metadata=custom_metadata,
        metrics=metrics,
        asynchronous=True,
    )


def load(path: PathLike, abstract_state: Any = None, *, partial: bool = False) -> Any:
    """Load the tree saved at ``path``.

    ``abstract_state`` (optional) gives the structure and, per leaf, the target shape, dtype and
    sharding (``jax.ShapeDtypeStruct``, a concrete array, ...); loading reshards and casts to it.
    ``PLACEHOLDER`` leaves are skipped. ``partial=True`` loads only the leaves the abstract tree
    names. Without an abstract tree the saved shardings are used, placed on the devices here when
    the saved ones are not all here (the saved mesh over them, cut to fit; said in a log line).

    ``path`` may also be a ``.safetensors`` file or a folder of HF-style shards: tensor names are
    matched to the leaves' key paths joined by '.', and each host reads only the byte ranges its
    devices need. So may a Flax msgpack file (``flax_model.msgpack``, ``checkpoint_<step>``):
    names as for safetensors, list items by their index. Orbax v0 checkpoints (CheckpointManager
    steps, Standard/PyTree checkpointers) load too. ``path`` may also be a tree from
    ``milepost.surgery``: it is computed onto the devices (see ``surgery.materialize``).
    """
    if not isinstance(path, str | os.PathLike | ObjectPath):
        return _readers.reader_for(path).load(path, abstract_state, partial)
    where = as_path(path)
    with _progress.operation("load", where, primary=_primary()):
        return _readers.reader_for(where).load(where, abstract_state, partial)


def _primary() -> bool:
    """Whether this process shows progress and logs loads (not the other processes of a
    multi-controller job)."""
    return _hosts.host_group_for([]).is_primary()


def delete_checkpointable(path: PathLike, name: str) -> None:
    """Delete the checkpointable ``name`` (e.g. ``"dataset"``) of the committed checkpoint at
    ``path``, atomically: a reader sees the checkpoint with it or without it, never in between;
    the rest still loads, and verifies, exactly as before. Timestamps, metrics and custom
    metadata are kept.

    Its files go. On a local disk the others are hard-linked into a new folder swapped in with
    one rename (copied where hard links cannot be made). In an object store it holds the path's
    lease as a save does, removes the commit marker, writes the new metadata and checksums,
    deletes the checkpointable's objects and writes the marker again: meanwhile the path holds
    no loadable checkpoint, never a mix; a failure puts the checkpoint back, or says to call
    this again to finish. Raises :class:`CheckpointableNotFoundError` (its message lists the
    checkpointables there are), :class:`LastCheckpointableError` for the only one (delete the
    checkpoint instead), and :class:`CheckpointExistsError` while a save of the path (or a
    deletion of it) holds it.
    With several controller processes, call it in every process; the primary does it.

    >>> milepost.delete_checkpointable("/ckpt/300", "dataset")
    """
    _checkpoint.delete_checkpointable(path, name)


def load_checkpointables(
    path: PathLike, checkpointables: Mapping[str, Any] | None = None, *, partial: bool = False
) -> dict[str, Any]:
    """Load the named checkpointables (all when None); the others are not read.

    >>> parts = milepost.load_checkpointables(
    ...     "/ckpt/300", {"state": abstract_state, "dataset": None}
    ... )
    >>> parts["dataset"]          # {'position': 1234}
    """
    with _progress.operation("load", as_path(path), primary=_primary()):
        return _checkpoint.load_checkpointables(path, checkpointables, partial=partial)


def load_async(
    path: PathLike, abstract_state: Any = None, *, partial: bool = False
) -> LoadHandle[Any]:
    """Like :func:`load`, but returns a :class:`LoadHandle` at once and reads in the
    background, so that a job compiles its step while its checkpoint is read.
    ``handle.result()`` waits and returns the tree, or re-raises the load's failure on your
    thread.

    Checked before it returns, on your thread: the path (``TypeError``, ``ValueError``) and
    that it exists (:class:`CheckpointNotFoundError`); the rest (a damaged chunk, a tree that
    does not match) is raised by ``result()``. The load uses the options of the
    :class:`Context` in force at the call; leave ``abstract_state`` unchanged until it ends.
    A process's background loads run one after another, in the order they were asked for, on
    one milepost thread; in a multi-controller job every process calls ``load_async`` in the
    same order (as every milepost call), starts no other load of the same path before its
    ``result()``, and, with ``LoadOptions(load_and_broadcast=True)``, runs no computation
    across processes until then (the load's collectives would meet it). An interpreter exit
    waits for a load in flight at most ``AsyncOptions.timeout_secs``.

    >>> handle = mp.load_async("/ckpt/1000", abstract_state)
    >>> step = jax.jit(train_step).lower(abstract_state, batch).compile()  # while it reads
    >>> state = handle.result()
    """
    where = _load_path(path, "load_async")
    return _checkpoint.start_load(where, lambda: load(where, abstract_state, partial=partial))


def load_checkpointables_async(
    path: PathLike, checkpointables: Mapping[str, Any] | None = None, *, partial: bool = False
) -> LoadHandle[dict[str, Any]]:
    """Like :func:`load_checkpointables`, but in the background (see :func:`load_async`);
    ``handle.result()`` returns the checkpointables by name.

    >>> handle = milepost.load_checkpointables_async("/ckpt/300", {"state": abstract_state})
    >>> parts = handle.result()
    """
    where = _load_path(path, "load_checkpointables_async")
    return _checkpoint.start_load(
        where, lambda: load_checkpointables(where, checkpointables, partial=partial)
    )


def _load_path(path: Any, call: str) -> StoragePath:
    """``path`` of a background load, checked on the caller's thread."""
    if not isinstance(path, str | os.PathLike | ObjectPath):
        surgery = " (a milepost.surgery tree loads with milepost.load)"
        raise TypeError(
            f"milepost.{call} takes the path of a checkpoint (a str or os.PathLike), got a "
            f"{type(path).__name__}{surgery if isinstance(path, dict | list | tuple) else ''}"
        )
    return as_path(path)


def metadata(path: PathLike) -> CheckpointMetadata:
    """Shapes, dtypes, shardings and chunking of every array, and the checkpoint's custom
    metadata and timestamps, without reading array data. A Flax msgpack file is described
    too (its one tree, ``default``)."""
    where = as_path(path) if isinstance(path, str | os.PathLike) else path
    return _readers.describer_for(where)(where)
