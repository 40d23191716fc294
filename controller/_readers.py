"""What ``milepost.load`` and ``milepost.metadata`` accept, as one registry of readers, asked in
order: a ``milepost.surgery`` tree, a safetensors file or folder of shards, a Flax msgpack file,
and a checkpoint folder (milepost's, Orbax v1's or Orbax v0's: which one, and where its
checkpointables are, the format package's layout module tells, ``milepost.workers.format``).

A reader's ``accepts`` is a cheap look (a type, a name, a file's first bytes), never a read of
array data; the first reader that accepts a source reads it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from milepost import _checkpoint, _msgpack, _safetensors, surgery
from milepost._checkpoint import CheckpointMetadata
from milepost.workers import ObjectPath

STATE = "state"
"""The checkpointable ``milepost.load`` reads of a checkpoint folder (else its only pytree)."""


@dataclass(frozen=True, kw_only=True)
class Reader:
    """One kind of source ``milepost.load`` reads."""

    name: str
    """What the source is, as messages name it."""
    accepts: Callable[[Any], bool]
    """Whether a source (what the caller passed, a path already made a path) is of this kind."""
    load: Callable[[Any, Any, bool], Any]
    """``(source, abstract_state, partial)``: the tree read."""
    metadata: Callable[[Any], CheckpointMetadata] | None = None
    """The source described without reading array data (None: ``milepost.metadata`` reads
    checkpoint folders only)."""


def _is_path(source: Any) -> bool:
    return isinstance(source, str | os.PathLike | ObjectPath)


def _local(accepts: Callable[[Path], bool]) -> Callable[[Any], bool]:
    """``accepts`` asked of local paths only (the foreign formats are read from local files)."""
    return lambda source: isinstance(source, Path) and accepts(source)


def _load_checkpoint(path: Any, abstract_state: Any, partial: bool) -> Any:
    loaded = _checkpoint.load_checkpointables(
        path, {STATE: abstract_state}, partial=partial, default_pytree=True
    )
    (value,) = loaded.values()
    return value


READERS: tuple[Reader, ...] = (
    Reader(
        name="a milepost.surgery tree",
        accepts=lambda source: isinstance(source, dict | list | tuple),
        load=lambda tree, abstract_state, partial: surgery.materialize(tree, abstract_state),
    ),
    Reader(
        name="safetensors",
        accepts=_local(_safetensors.is_safetensors),
        load=_safetensors.load,
    ),
    Reader(
        name="Flax msgpack",
        accepts=_local(_msgpack.is_msgpack),
        load=_msgpack.load,
        metadata=_msgpack.metadata,
    ),
    Reader(
        name="a checkpoint (milepost, Orbax v1 or Orbax v0)",
        accepts=_is_path,
        load=_load_checkpoint,
        metadata=_checkpoint.metadata,
    ),
)


def reader_for(source: Any) -> Reader:
    """The first reader that accepts ``source``; ``TypeError`` when none does."""
    for reader in READERS:
        if reader.accepts(source):
            return reader
    raise TypeError(
        f"milepost.load takes the path of a checkpoint (a str or os.PathLike) or a tree "
        f"from milepost.surgery, got a {type(source).__name__}"
    )


def describer_for(source: Any) -> Callable[[Any], CheckpointMetadata]:
    """How ``milepost.metadata`` describes ``source``: the first reader that accepts it and
    describes, else a checkpoint folder's description (which says what a path that is none
    holds, and what milepost reads)."""
    for reader in READERS:
        if reader.metadata is not None and reader.accepts(source):
            return reader.metadata
    return _checkpoint.metadata
