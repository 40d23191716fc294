"""What a checkpoint directory holds, whoever wrote it: milepost and Orbax v1, or Orbax v0.

- **v1** (milepost, ``orbax.checkpoint.experimental.v1``): ``_CHECKPOINT_METADATA`` whose
  ``item_handlers`` maps checkpointable names to handlers, one folder per checkpointable, the
  ``orbax.checkpoint`` marker, and ``commit_success.txt`` once committed.
- **v0** (``CheckpointManager`` steps, ``StandardCheckpointer``, ``PyTreeCheckpointer``,
  ``Composite``): ``item_handlers`` is a dict (Manager and Composite: folders such as
  ``default/``) or one handler's name (single checkpointers: the checkpoint's own folder is the
  item), no marker; very old ones have no ``_CHECKPOINT_METADATA`` at all, just ``_METADATA``.
  Orbax wrote them with an atomic rename, so a v0 checkpoint without a commit marker is whole.

milepost reads every one of these and writes v1 only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from milepost._errors import CheckpointNotFoundError, CorruptCheckpointError
from milepost._format._checksums import read_json_object
from milepost._format._files import (
    CHECKPOINT_METADATA,
    CHECKSUMS,
    COMMIT_MARKER,
    ORBAX_MARKER,
    TMP_SUFFIX,
    TREE_METADATA,
)
from milepost._tree import unsafe_part
from milepost.workers import ObjectPath

DEFAULT_ITEM = "default"
"""The name of a v0 checkpoint's single checkpointable (``CheckpointManager`` uses it too)."""

PYTREE_HANDLERS = ("PyTreeHandler", "PyTreeCheckpointHandler", "StandardCheckpointHandler")
JSON_HANDLERS = ("JsonHandler", "JsonCheckpointHandler")


@dataclass(frozen=True)
class Item:
    """One checkpointable: its handler as recorded (None: not recorded) and its folder."""

    name: str
    handler: str | None
    folder: Path | ObjectPath

    @property
    def is_pytree(self) -> bool:
        return self.handler is None or self.handler.endswith(PYTREE_HANDLERS)


def unsafe_item_name(name: Any) -> str | None:
    """Why ``name`` cannot name a checkpointable's folder (None: it can); the same rules for
    names being saved and names read from a checkpoint."""
    why = unsafe_part(name)
    if why is None and name.startswith(("_", ".")):
        why = "it starts with '_' or '.', which mark metadata and hidden files"
    return why


def _written_by_v0(path: Path | ObjectPath) -> bool:
    """Orbax v0 wrote it (it names v0 handlers and has no v1 marker), so it was renamed into place
    whole even without a commit marker (older v0 wrote none on local disks)."""
    if (path / ORBAX_MARKER).exists() or (path / CHECKSUMS).exists():
        return False
    try:
        handlers = json.loads((path / CHECKPOINT_METADATA).read_bytes()).get("item_handlers")
    except (OSError, ValueError, AttributeError):
        return False
    names = (
        [handlers]
        if isinstance(handlers, str)
        else list(handlers.values())
        if isinstance(handlers, dict)
        else []
    )
    return bool(names) and all(
        isinstance(n, str) and n.startswith(_V0_HANDLER_PREFIX) for n in names
    )


_V0_HANDLER_PREFIX = "orbax.checkpoint._src.handlers."


def writer_of(path: Path | ObjectPath) -> str:
    """Who wrote the checkpoint at ``path``, as far as its files tell: ``"Orbax v0"``,
    ``"milepost (Orbax v1 layout)"`` or ``"Orbax v1"``."""
    if _is_bare_v0(path) or _written_by_v0(path):
        return "Orbax v0"
    if (path / CHECKSUMS).exists():
        return "milepost (Orbax v1 layout)"
    return "Orbax v1"


def is_committed(path: Path | ObjectPath) -> bool:
    """A checkpoint whose save finished: one with its commit marker, or one Orbax v0 wrote
    (renamed into place whole). Temporary directories never are."""
    if not path.is_dir() or path.name.endswith(TMP_SUFFIX):
        return False
    if (path / CHECKPOINT_METADATA).is_file():
        return (path / COMMIT_MARKER).is_file() or _written_by_v0(path)
    return _is_bare_v0(path)


def _is_bare_v0(path: Path | ObjectPath) -> bool:
    """A v0 single-item checkpoint from before ``_CHECKPOINT_METADATA``: ``_METADATA`` in the
    folder itself, which is not a checkpointable folder of a checkpoint."""
    return (path / TREE_METADATA).is_file() and not (path.parent / CHECKPOINT_METADATA).is_file()


def require_checkpoint(path: Path | ObjectPath) -> None:
    """Raise CheckpointNotFoundError, saying what is there and what milepost reads, unless
    ``path`` is a committed checkpoint."""
    if not path.exists():
        raise CheckpointNotFoundError(
            f"no checkpoint at {path}: the path does not exist. Check the path or the step."
        )
    if not path.is_dir():
        raise CheckpointNotFoundError(
            f"{path} is a file, not a checkpoint directory. Pass the checkpoint's directory."
        )
    if path.name.endswith(TMP_SUFFIX):
        raise CheckpointNotFoundError(
            f"{path} is the temporary directory of an unfinished save, not a "
            "committed checkpoint; it cannot be loaded."
        )
    if (path / CHECKPOINT_METADATA).exists():
        if not is_committed(path):
            raise CheckpointNotFoundError(
                f"{path} has no commit marker ({COMMIT_MARKER}): the save that wrote it "
                "did not finish. Load another checkpoint."
            )
        return
    if _is_bare_v0(path):
        return
    if (path / TREE_METADATA).is_file():
        raise CheckpointNotFoundError(
            f"{path} is not a checkpoint but a checkpointable folder of the checkpoint "
            f"{path.parent}; pass {path.parent} (and load_checkpointables for this part)."
        )
    found = sorted(p.name for p in path.iterdir())[:8]
    raise CheckpointNotFoundError(
        f"{path} is not a checkpoint: it has no {CHECKPOINT_METADATA} (it holds "
        f"{found or 'nothing'}). milepost reads milepost and Orbax v1 checkpoints, Orbax v0 ones "
        "(CheckpointManager steps, Standard/PyTree checkpointers) and safetensors. Pass the "
        "checkpoint directory itself (e.g. root/<step>), not its parent or a checkpointable folder."
    )


def checkpointables(path: Path | ObjectPath, meta: dict[str, Any] | None) -> dict[str, Item]:
    """The checkpointables of the checkpoint at ``path`` (``meta``: its ``_CHECKPOINT_METADATA``,
    None when it has none), every name checked like a name being saved."""
    raw = (meta or {}).get("item_handlers")
    where = path / CHECKPOINT_METADATA
    if isinstance(raw, str):  # a v0 single checkpointer: the checkpoint's folder is the item
        return {DEFAULT_ITEM: Item(DEFAULT_ITEM, raw, path)}
    if raw and not isinstance(raw, dict):
        raise CorruptCheckpointError(
            f"'item_handlers' in {where} is not a mapping of checkpointable names to handlers (got "
            f"{type(raw).__name__}); the checkpoint is damaged or of an unsupported layout"
        )
    out: dict[str, Item] = {}
    for name, handler in (raw or {}).items():
        if (why := unsafe_item_name(name)) is not None:
            raise CorruptCheckpointError(
                f"'item_handlers' in {where} names the checkpointable {name!r}, "
                f"which cannot be a folder name ({why}); the checkpoint is damaged "
                "or crafted, and nothing was read from it"
            )
        out[name] = Item(name, handler if isinstance(handler, str) else None, path / name)
    if out:
        return out
    if (path / TREE_METADATA).is_file():  # very old v0: the folder is the item
        return {DEFAULT_ITEM: Item(DEFAULT_ITEM, None, path)}
    entries: list[Path | ObjectPath] = [*path.iterdir()]
    return {
        p.name: Item(p.name, None, p)
        for p in sorted(entries)
        if p.is_dir() and unsafe_item_name(p.name) is None
    }


def read_checkpoint_metadata(path: Path | ObjectPath) -> dict[str, Any]:
    """``_CHECKPOINT_METADATA`` of a committed checkpoint (``{}`` for a bare v0 one)."""
    require_checkpoint(path)
    if not (path / CHECKPOINT_METADATA).exists():
        return {}
    return read_json_object(path / CHECKPOINT_METADATA, "checkpoint metadata")


def main_tree(path: Path | ObjectPath, found: dict[str, Item]) -> str:
    """The checkpointable ``milepost.load`` reads: ``state``, else the only pytree."""
    if "state" in found:
        return "state"
    trees = [name for name, item in found.items() if item.is_pytree]
    if len(trees) == 1:
        return trees[0]
    raise CheckpointNotFoundError(
        f"checkpoint {path} has no 'state' checkpointable (it "
        f"has {sorted(found)}); use load_checkpointables"
    )
