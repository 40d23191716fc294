"""What a training root holds, step by step, read without opening a Checkpointer (what
``milepost ls`` prints): committed steps and what unfinished saves or deletions left, in the
durable root and in a local tier. Steps of every naming (``10``, ``000010``,
``checkpoint_000010``: see :mod:`._naming`) are listed; an uncommitted folder or a leftover only
when it is plain or of a prefix the committed steps have."""

from __future__ import annotations

import contextlib
import os
from typing import Any

from milepost import _views
from milepost._errors import CheckpointNotFoundError
from milepost.training._errors import NotATrainingRootError
from milepost.training._tier import tier_at
from milepost.workers import ObjectPath, as_path, in_object_store
from milepost.workers import format as fmt


def _size(path: Any) -> int | None:
    """Bytes of every file under a local folder (None on object stores, where listing sizes
    would mean one request per object)."""
    if in_object_store(path):
        return None
    total = 0
    for folder, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_size
    return total


def _entries(root: Any) -> dict[int, list[tuple[Any, str]]]:
    """step -> [(folder, what)]: committed steps, and what unfinished saves or deletions left."""
    if not root.exists():
        return {}
    return tier_at(root, 60.0).entries()


def _is_checkpoint(path: Any) -> bool:
    """One checkpoint (its own metadata files, or a commit marker), not a root of steps."""
    own = (fmt.CHECKPOINT_METADATA, fmt.TREE_METADATA, fmt.COMMIT_MARKER)
    return any((path / name).is_file() for name in own)


def list_steps(
    root: str | os.PathLike[str] | ObjectPath, local: str | os.PathLike[str] | None = None
) -> list[dict[str, Any]]:
    """Every step folder of a training root (and of its local tier): committed or not, which
    tier holds it, its size, commit time and metrics. Oldest first; nothing is written.
    Steps of every naming are listed (``10``, ``000010``, ``checkpoint_000010``), each row
    with its folders' paths. ``NotATrainingRootError`` if ``root`` is one checkpoint."""
    tiers = [("durable", as_path(root))]
    if local is not None:
        tiers.insert(0, ("local", as_path(local)))
    if not tiers[-1][1].exists() and (local is None or not tiers[0][1].exists()):
        raise CheckpointNotFoundError(
            f"no training root at {tiers[-1][1]}: the folder does not exist. Check the path."
        )
    for _, where in tiers:
        if where.exists() and _is_checkpoint(where):
            raise NotATrainingRootError(where)
    rows: dict[int, dict[str, Any]] = {}
    for tier, where in tiers:
        for step, found in _entries(where).items():
            for path, what in found:
                row = rows.setdefault(
                    step,
                    {
                        "step": step,
                        "state": what,
                        "tiers": [],
                        "paths": [],
                        "bytes": None,
                        "committed": None,
                        "commit_timestamp_nsecs": None,
                        "metrics": {},
                    },
                )
                row["tiers"].append(tier if what == "committed" else f"{tier} ({what})")
                row["paths"].append(str(path))
                if what == "committed":
                    row["state"] = "committed"
                    meta: dict[str, Any] = {}
                    with contextlib.suppress(Exception):
                        meta = fmt.read_checkpoint_metadata(path)
                    stamp = meta.get("commit_timestamp_nsecs")
                    row["commit_timestamp_nsecs"] = stamp
                    row["committed"] = _views.timestamp_str(stamp) or None
                    row["metrics"] = meta.get("metrics") or row["metrics"]
                size = _size(path)
                if size is not None:
                    row["bytes"] = max(row["bytes"] or 0, size)
    return [rows[s] for s in sorted(rows)]
