"""What a checkpoint directory holds, whoever wrote it: milepost and Orbax v1, or Orbax v0.

- **v1** (milepost, ``orbax.checkpoint.experimental.v1``): ``_CHECKPOINT_METADATA`` whose
  ``item_handlers`` maps checkpointable names to handlers, one folder per checkpointable, the
  ``orbax.checkpoint`` marker, and ``commit_success.txt`` once committed (Orbax before 0.12.3:
  on local disks, no marker; the rename out of the temporary name was the commit).
- **v0** (``CheckpointManager`` steps, ``StandardCheckpointer``, ``PyTreeCheckpointer``,
  ``Composite``): ``item_handlers`` is a dict (Manager and Composite: folders such as
  ``default/``) or one handler's name (single checkpointers: the checkpoint's own folder is the
  item), no v1 marker. Older ones have no ``_CHECKPOINT_METADATA`` at all: a single
  checkpointer's folder holds ``_METADATA`` (and the msgpack ``checkpoint`` file, whose
  aggregated leaves are read too), a step holds its item folders. Some from 2024 have one
  holding only timestamps. (Orbax before 0.4 wrote only the msgpack file: not read.)

milepost reads every one of these and writes v1 only. The checkpointables are the folders that
exist; ``item_handlers`` says which handler wrote each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from milepost.workers import _declared as declared
from milepost.workers._errors import CheckpointNotFoundError, CorruptCheckpointError
from milepost.workers._paths import StoragePath, in_object_store, is_local
from milepost.workers.format._file_checksums import read_json_object
from milepost.workers.format._files import (
    CHECKPOINT_METADATA,
    CHECKSUMS,
    COMMIT_MARKER,
    JSON_HANDLER_TYPESTR,
    ORBAX_MARKER,
    PYTREE_HANDLER_TYPESTR,
    TREE_METADATA,
    is_temporary_name,
)
from milepost.workers.format._values import unsafe_part

DEFAULT_ITEM = "default"
"""The name of a v0 checkpoint's single checkpointable (``CheckpointManager`` uses it too)."""

PYTREE_HANDLERS = ("PyTreeHandler", "PyTreeCheckpointHandler", "StandardCheckpointHandler")
JSON_HANDLERS = ("JsonHandler", "JsonCheckpointHandler")


@dataclass(frozen=True)
class Item:
    """One checkpointable: its handler as recorded (None: not recorded) and its folder."""

    name: str
    handler: str | None
    folder: StoragePath

    @property
    def is_pytree(self) -> bool:
        return self.handler is not None and self.handler.endswith(PYTREE_HANDLERS)


def unsafe_item_name(name: Any) -> str | None:
    """Why ``name`` cannot name a checkpointable's folder (None: it can); the same rules for
    names being saved and names read from a checkpoint."""
    why = unsafe_part(name)
    if why is None and name.startswith(("_", ".")):
        why = "it starts with '_' or '.', which mark metadata and hidden files"
    return why


def writer_of(path: StoragePath) -> str:
    """Who wrote the checkpoint at ``path``, as far as its files tell: ``"Orbax v0"``,
    ``"milepost (Orbax v1 layout)"`` or ``"Orbax v1"``."""
    if (path / CHECKSUMS).exists():
        return "milepost (Orbax v1 layout)"
    if (path / ORBAX_MARKER).exists():
        return "Orbax v1"
    return "Orbax v0"


ITEM_FILES = (TREE_METADATA, "metadata", "data.json")
"""Files one of which every checkpointable folder Orbax or milepost writes holds: a tree's
``_METADATA``, a JSON item's ``metadata`` (Orbax v0) or ``data.json``. (Not the msgpack
``checkpoint`` file alone: TensorFlow names its index so, and Orbax since 0.5 writes
``_METADATA`` beside it.)"""


def folders_of(path: StoragePath) -> dict[str, frozenset[str]]:
    """The folders directly in ``path`` whose names can be checkpointables', each with the names
    of the files directly in it: one listing on an object store, one per folder locally."""
    out: dict[str, set[str]] = {}
    if is_local(path):
        for p in path.iterdir():
            if unsafe_item_name(p.name) is None and p.is_dir():
                out[p.name] = {f.name for f in p.iterdir() if f.is_file()}
    else:
        for key in path.keys():
            head, sep, rest = key.partition("/")
            if sep and unsafe_item_name(head) is None:
                files = out.setdefault(head, set())
                if "/" not in rest:
                    files.add(rest)
    return {name: frozenset(files) for name, files in out.items()}


def _is_item(files: frozenset[str]) -> bool:
    """A folder holding these files is a checkpointable's (``ITEM_FILES``)."""
    return any(name in files for name in ITEM_FILES)


_UNREADABLE = object()
"""``_CHECKPOINT_METADATA`` is there but cannot be read or parsed."""


def _own_metadata(path: StoragePath) -> Any:
    """``path``'s ``_CHECKPOINT_METADATA`` parsed (read once for every question asked of it):
    None when there is none, ``_UNREADABLE`` when it cannot be read."""
    if not (path / CHECKPOINT_METADATA).is_file():  # (never open a FIFO: it would block)
        return None
    try:
        raw = (path / CHECKPOINT_METADATA).read_bytes()
    except FileNotFoundError:
        return None
    except OSError:
        return _UNREADABLE
    try:
        return declared.loads(raw, str(path / CHECKPOINT_METADATA), "it", user_data=True)
    except ValueError:
        return _UNREADABLE


def _holds_checkpoint(path: StoragePath, meta: Any) -> bool:
    """``path`` holds a checkpoint's files (whether its save finished is another question):
    ``_CHECKPOINT_METADATA`` (``meta``) and something saved (its own tree's files, or a
    checkpointable's folder); or, from before that file existed, a tree's own files (a single
    checkpointer's folder) or folders of items (a CheckpointManager step, a Composite)."""
    if meta is not None:
        if (path / TREE_METADATA).is_file():
            return True
        listed = meta.get("item_handlers") if isinstance(meta, dict) else None
        return isinstance(listed, str) or any(
            (isinstance(listed, dict) and name in listed) or _is_item(files)
            for name, files in folders_of(path).items()
        )
    if _is_bare_v0(path):
        return True
    return _is_unlisted_composite(path)


def _is_unlisted_composite(path: StoragePath) -> bool:
    """A step of a CheckpointManager (or a Composite) from before ``_CHECKPOINT_METADATA``: no
    files of its own that a checkpoint or a checkpointable has, and item folders."""
    if any((path / name).exists() for name in (TREE_METADATA, CHECKSUMS, ORBAX_MARKER)):
        return False  # a tree's own folder, or a checkpoint of milepost or v1 (which have one)
    if is_local(path) and (path.parent / CHECKPOINT_METADATA).is_file():
        return False  # a checkpointable folder of a checkpoint, not a checkpoint
    folders = folders_of(path)
    # (a folder of a handler milepost does not know is an item too; a folder of steps is not)
    return any(_is_item(files) for files in folders.values()) and not any(
        CHECKPOINT_METADATA in files for files in folders.values()
    )


def is_committed(path: StoragePath) -> bool:
    """A checkpoint whose save finished, by the rule of the writer that wrote it:

    - never a temporary name (``<name>.orbax-checkpoint-tmp[-<time>]``: every Orbax release and
      milepost save into one and rename it into place when done);
    - with its commit marker (``commit_success.txt``) when milepost wrote it, when it lies in an
      object store (every writer writes the marker there, last), or when Orbax >= 0.12.3 did
      (it writes the marker before its rename, so its finished folders all have one);
    - else, on a local disk, a folder of checkpoint files that Orbax renamed into place: releases
      before 0.12.3 wrote no marker there, and a folder they had not finished still had its
      temporary name (or, in Orbax's commit-file mode, no commit time in its metadata).
    """
    if is_temporary_name(path.name) or not path.is_dir():
        return False
    if (path / COMMIT_MARKER).is_file():  # written last: everything else is there
        return (
            (path / CHECKPOINT_METADATA).is_file()
            or _is_bare_v0(path)
            or _is_unlisted_composite(path)
        )
    if in_object_store(path) or (path / CHECKSUMS).exists():
        return False  # an object store, or milepost's own: the marker is how they commit
    meta = _own_metadata(path)
    return _holds_checkpoint(path, meta) and not _commit_unrecorded(meta)


def is_foreign_unfinished(path: StoragePath) -> bool:
    """A local folder at a final name holding another program's checkpoint files whose save has
    not finished (Orbax's commit-file mode writes so): not loadable, and not milepost's to
    remove either (its writer may still be at work)."""
    if in_object_store(path) or is_temporary_name(path.name) or not path.is_dir():
        return False
    if (path / COMMIT_MARKER).is_file() or (path / CHECKSUMS).exists():
        return False
    meta = _own_metadata(path)
    return _holds_checkpoint(path, meta) and _commit_unrecorded(meta)


def _commit_unrecorded(meta: Any) -> bool:
    """``_CHECKPOINT_METADATA`` (``meta``) records the save's start but not its commit: every
    Orbax that writes the file fills ``commit_timestamp_nsecs`` when it finalizes, so a folder
    without it is a save killed before that (Orbax's commit-file mode saves at the final
    name). An unreadable one is not known to be finished."""
    if meta is _UNREADABLE:
        return True
    return (
        isinstance(meta, dict)
        and meta.get("init_timestamp_nsecs") is not None
        and meta.get("commit_timestamp_nsecs") is None
    )


def is_committed_by_own_files(path: StoragePath) -> bool:
    """A committed checkpoint that says so by files of its own (``_CHECKPOINT_METADATA``, or a
    single checkpointer's tree files), not only by the item folders it holds, which a folder
    of several checkpoints holds too. Saves decide by this what they may replace or write in."""
    own = (CHECKPOINT_METADATA, TREE_METADATA)
    return any((path / name).is_file() for name in own) and is_committed(path)


def _is_bare_v0(path: StoragePath) -> bool:
    """A v0 single-item checkpoint from before ``_CHECKPOINT_METADATA``: a tree's files in the
    folder itself, which is not a checkpointable folder of a checkpoint. (An item folder of a
    step from before that file is one too: Orbax's single checkpointers read it alone.)"""
    if not (path / TREE_METADATA).is_file():
        return False
    return not (path.parent / CHECKPOINT_METADATA).is_file()


def require_checkpoint(path: StoragePath) -> None:
    """Raise CheckpointNotFoundError, saying what is there and what milepost reads, unless
    ``path`` is a committed checkpoint."""
    if not path.exists():
        raise CheckpointNotFoundError(
            f"no checkpoint at {path}: the path does not exist. Check the path or the step."
        )
    if not path.is_dir():
        raise CheckpointNotFoundError(
            f"{path} is a file, not a checkpoint: a checkpoint is a folder (milepost's, Orbax "
            "v1 or v0). Pass a checkpoint's folder."
        )
    if is_temporary_name(path.name):
        raise CheckpointNotFoundError(
            f"{path} is the temporary directory of an unfinished save, not a "
            "committed checkpoint; it cannot be loaded."
        )
    if is_committed(path):
        return
    if _holds_checkpoint(path, _own_metadata(path)):
        why = (
            "milepost writes it last"
            if (path / CHECKSUMS).exists()
            else "in an object store every writer writes it last"
        )
        raise CheckpointNotFoundError(
            f"{path} has no commit marker ({COMMIT_MARKER}), and {why}: the save that wrote "
            "it did not finish. Load another checkpoint."
        )
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


def listed_items(path: StoragePath, meta: dict[str, Any] | None) -> dict[str, str | None]:
    """The checkpointables ``_CHECKPOINT_METADATA``'s ``item_handlers`` names, with the handler
    each was saved by (``meta``: that file, None when there is none). A single checkpointer's
    string is the one item ``default``. Every name is checked like a name being saved."""
    raw = (meta or {}).get("item_handlers")
    where = path / CHECKPOINT_METADATA
    if isinstance(raw, str):
        return {DEFAULT_ITEM: raw}
    if raw and not isinstance(raw, dict):
        raise CorruptCheckpointError(
            f"'item_handlers' in {where} is not a mapping of checkpointable names to handlers (got "
            f"{type(raw).__name__}); the checkpoint is damaged or of an unsupported layout"
        )
    out: dict[str, str | None] = {}
    for name, handler in (raw or {}).items():
        if (why := unsafe_item_name(name)) is not None:
            raise CorruptCheckpointError(
                f"'item_handlers' in {where} names the checkpointable {name!r}, "
                f"which cannot be a folder name ({why}); the checkpoint is damaged "
                "or crafted, and nothing was read from it"
            )
        out[name] = handler if isinstance(handler, str) else None
    return out


def checkpointables(path: StoragePath, meta: dict[str, Any] | None) -> dict[str, Item]:
    """The checkpointables of the checkpoint at ``path``: the folders that exist, each with the
    handler ``item_handlers`` recorded for it as a hint (a name listed there whose folder is
    gone is not one; a folder it does not list is one if it holds a checkpointable's files, or
    if the checkpoint lists none)."""
    hints = listed_items(path, meta)
    raw = (meta or {}).get("item_handlers")
    if isinstance(raw, str) or (
        not hints and (path / TREE_METADATA).is_file()
    ):  # a single checkpointer (or a very old one): the checkpoint's folder is the item
        return {
            DEFAULT_ITEM: Item(
                DEFAULT_ITEM, hints.get(DEFAULT_ITEM) or PYTREE_HANDLER_TYPESTR, path
            )
        }
    out: dict[str, Item] = {}
    for name, files in sorted(folders_of(path).items()):
        if name in hints or not hints or _is_item(files):
            out[name] = Item(name, hints.get(name) or _handler_of(files), path / name)
    return out


def _handler_of(files: frozenset[str]) -> str | None:
    """The handler whose files a folder holds, for checkpoints that do not record it (Orbax
    before ``item_handlers``): a tree's, or a JSON item's (``metadata`` in Orbax v0)."""
    if TREE_METADATA in files:
        return PYTREE_HANDLER_TYPESTR
    if "metadata" in files or "data.json" in files:
        return JSON_HANDLER_TYPESTR
    return None


def read_checkpoint_metadata(path: StoragePath) -> dict[str, Any]:
    """``_CHECKPOINT_METADATA`` of a committed checkpoint (``{}`` for a bare v0 one): its
    timestamps integers (or absent), its metrics and custom metadata objects (or absent)."""
    require_checkpoint(path)
    if not (path / CHECKPOINT_METADATA).exists():
        return {}
    where = path / CHECKPOINT_METADATA
    meta = read_json_object(where, "checkpoint metadata", user_data=True)
    for stamp in ("init_timestamp_nsecs", "commit_timestamp_nsecs"):
        if meta.get(stamp) is not None:
            declared.integer(meta[stamp], str(where), stamp)
    for part in ("metrics", "custom_metadata"):
        if meta.get(part) is not None:
            declared.mapping(meta[part], str(where), part)
    return meta


def main_tree(path: StoragePath, found: dict[str, Item]) -> str:
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
