"""The files of the on-disk format (Orbax v1 names) and durable writes of small files."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from milepost.workers._paths import StoragePath, is_local

CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
COMMIT_MARKER = "commit_success.txt"
ORBAX_MARKER = "orbax.checkpoint"
TREE_METADATA = "_METADATA"
OCDBT_MANIFEST = "manifest.ocdbt"
AGGREGATE = "checkpoint"
"""The msgpack file of Orbax's PyTree handler: the whole tree before ``_METADATA`` existed, the
leaves saved in it (``aggregate``, and scalars) after."""
SHARDING = "_sharding"
STRINGS = "_strings.json"
ARRAY_METADATAS = "array_metadatas"
MILEPOST_INFO = "_milepost.json"
"""Types Orbax's metadata has no word for (NumPy vs Python scalars). Orbax ignores the file."""
TMP_SUFFIX = ".orbax-checkpoint-tmp"
"""milepost's temporary directories end with it; Orbax's end with it or with it and ``-<time>``."""
OWNER_FILE = ".milepost-owner"
"""Who is writing a local save's temporary directory; there from its first moment until just
before the rename, never part of a checkpoint."""
CHECKSUMS = "_milepost_checksums.json"
"""Size and CRC32C of every file but array chunks, written at commit. Orbax ignores the file."""

PYTREE_HANDLER_TYPESTR = (
    "orbax.checkpoint.experimental.v1._src.handlers.pytree_handler.PyTreeHandler"
)
JSON_HANDLER_TYPESTR = "orbax.checkpoint.experimental.v1._src.handlers.json_handler.JsonHandler"
STATEFUL_HANDLER_TYPESTR = (
    "orbax.checkpoint.experimental.v1._src.handlers.stateful_checkpointable_handler."
    "StatefulCheckpointableHandler"
)
"""What Orbax v1 records for a checkpointable that saves itself, such as a Grain iterator."""
GRAIN_HANDLER_TYPESTR = "grain._src.python.checkpoint.handler.CheckpointHandler"
"""What Orbax's CheckpointManager records for a Grain iterator saved with Grain's handler."""


def data_state_file(index: int, count: int) -> str:
    """The file of process ``index`` of ``count`` in a data iterator's folder (Grain's name)."""
    return f"process_{index}-of-{count}.json"


def is_temporary_name(name: str) -> bool:
    """A name an unfinished save uses (every Orbax release's and milepost's): any name holding
    ``.orbax-checkpoint-tmp``, which is how Orbax itself tells them."""
    return TMP_SUFFIX in name


def write_file(path: StoragePath, data: bytes | str) -> None:
    """Write ``path`` and fsync it (the directory is synced once at commit); in an object store
    the write is durable when it returns."""
    raw = data.encode() if isinstance(data, str) else data
    if is_local(path):
        with open(path, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        return
    path.write_bytes(raw)


def write_json(path: StoragePath, obj: Any) -> None:
    write_file(path, json.dumps(obj))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every directory below ``root`` (files were synced by their writers)."""
    for dirpath, _dirnames, _files in os.walk(root):
        fsync_dir(Path(dirpath))
