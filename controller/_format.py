"""The files of the on-disk format (Orbax v1 names) and durable writes of small files."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from milepost._errors import CheckpointNotFoundError, CorruptCheckpointError

CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
COMMIT_MARKER = "commit_success.txt"
ORBAX_MARKER = "orbax.checkpoint"
TREE_METADATA = "_METADATA"
SHARDING = "_sharding"
STRINGS = "_strings.json"
ARRAY_METADATAS = "array_metadatas"
MILEPOST_INFO = "_milepost.json"
"""Types Orbax's metadata has no word for (NumPy vs Python scalars). Orbax ignores the file."""
TMP_SUFFIX = ".orbax-checkpoint-tmp"

PYTREE_HANDLER_TYPESTR = "orbax.checkpoint.experimental.v1._src.handlers.pytree_handler.PyTreeHandler"
JSON_HANDLER_TYPESTR = "orbax.checkpoint.experimental.v1._src.handlers.json_handler.JsonHandler"


def write_file(path: Path, data: bytes | str) -> None:
    """Write ``path`` and fsync it (the directory is synced once at commit)."""
    raw = data.encode() if isinstance(data, str) else data
    with open(path, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())


def write_json(path: Path, obj: Any) -> None:
    write_file(path, json.dumps(obj))


def read_json(path: Path, what: str) -> Any:
    """The JSON in ``path``: a missing file is a :class:`CheckpointNotFoundError`, one that is
    not UTF-8 JSON a :class:`CorruptCheckpointError`, both naming the file."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError as e:
        raise CheckpointNotFoundError(
            f"{what} {path} is missing: {path.parent} is not a complete checkpoint. "
            "Pass the path of a committed checkpoint (a directory with commit_success.txt)."
        ) from e
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise CorruptCheckpointError(
            f"{what} {path} is not UTF-8 text (byte {e.start}); the checkpoint is damaged. "
            "Load an earlier checkpoint, or re-save this one."
        ) from e
    except json.JSONDecodeError as e:
        raise CorruptCheckpointError(
            f"{what} {path} is truncated or not JSON ({e.msg} at char {e.pos}); the checkpoint is damaged. "
            "Load an earlier checkpoint, or re-save this one."
        ) from e


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    """Like :func:`read_json`, for files that must hold a JSON object."""
    value = read_json(path, what)
    if not isinstance(value, dict):
        raise CorruptCheckpointError(
            f"{what} {path} is not a JSON object (it holds a {type(value).__name__}); the checkpoint is damaged. "
            "Load an earlier checkpoint."
        )
    return value


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


def is_checkpoint(path: Path) -> bool:
    """A committed checkpoint: a directory with its metadata, and not a temporary one."""
    return (
        path.is_dir()
        and not path.name.endswith(TMP_SUFFIX)
        and (path / CHECKPOINT_METADATA).is_file()
        and ((path / COMMIT_MARKER).is_file() or (path / ORBAX_MARKER).exists())
    )


def require_checkpoint(path: Path) -> None:
    if not path.exists():
        raise CheckpointNotFoundError(f"no checkpoint at {path}: the path does not exist. Check the path or the step.")
    if not path.is_dir():
        raise CheckpointNotFoundError(f"{path} is a file, not a checkpoint directory. Pass the checkpoint's directory.")
    if path.name.endswith(TMP_SUFFIX):
        raise CheckpointNotFoundError(
            f"{path} is the temporary directory of an unfinished save, not a committed checkpoint; it cannot be loaded."
        )
    if not (path / CHECKPOINT_METADATA).exists():
        raise CheckpointNotFoundError(
            f"{path} is not a checkpoint: it has no {CHECKPOINT_METADATA}. "
            "Pass the checkpoint directory itself (e.g. root/<step>), not its parent or a checkpointable folder."
        )
