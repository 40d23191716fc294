"""What a checkpoint or a training root holds, as plain records (what ``milepost inspect`` and
``milepost ls`` print, and their ``--json``). Only metadata is read, never array data."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from milepost import _api, _layout, _paths, _safetensors, _views
from milepost import _format as fmt
from milepost import _pytree_format as tree_format
from milepost._errors import CheckpointNotFoundError
from milepost.training import _tier


def layout_name(path: Any) -> str:
    """Who wrote the checkpoint at ``path``, as far as its files tell."""
    if _layout._is_bare_v0(path) or _layout._written_by_v0(path):
        return "Orbax v0"
    if (path / fmt.CHECKSUMS).exists():
        return "milepost (Orbax v1 layout)"
    return "Orbax v1"


def _storage(folder: Any) -> str:
    with contextlib.suppress(Exception):
        files = tree_format.read(folder)
        zarr = files.store(folder).zarr_format
        return f"{'OCDBT' if files.use_ocdbt else 'plain folders'}, zarr{zarr}"
    return ""


def _totals(leaves: list[Any]) -> dict[str, int]:
    n, arrays, nbytes = _views.totals(leaves)
    return {"leaves": n, "arrays": arrays, "bytes": nbytes}


def describe(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A checkpoint (milepost, Orbax v1 or v0, plain zarr3 or OCDBT, any storage) or a
    safetensors file or folder: its format, timestamps, custom metadata, metrics and, per
    checkpointable, its leaves with their totals."""
    where = _paths.as_path(path)
    if isinstance(where, Path) and _safetensors.is_safetensors(where):
        return _describe_safetensors(where)
    meta = _api.metadata(where)
    out: dict[str, Any] = {
        "path": str(where),
        "format": layout_name(where),
        "committed": _views.timestamp_str(meta.commit_timestamp_nsecs) or None,
        "commit_timestamp_nsecs": meta.commit_timestamp_nsecs,
        "init_timestamp_nsecs": meta.init_timestamp_nsecs,
        "custom_metadata": meta.custom_metadata,
        "metrics": meta.metrics,
        "checkpointables": {},
    }
    everything: list[Any] = []
    items = _layout.items(where, _layout.read_metadata(where))
    for name, part in meta.checkpointables.items():
        handler = meta.item_handlers.get(name) or (items[name].handler if name in items else None)
        entry: dict[str, Any] = {"handler": handler}
        leaves = _views.flat_leaves(part)
        if leaves or (name in items and items[name].is_pytree):
            entry["storage"] = _storage(items[name].folder) if name in items else ""
            entry["leaves"] = [_views.leaf_record(leaf) for leaf in leaves]
            entry["totals"] = _totals(leaves)
            everything += leaves
        else:
            entry["value"] = part
        out["checkpointables"][name] = entry
    out["totals"] = _totals(everything)
    return out


def _describe_safetensors(path: Path) -> dict[str, Any]:
    tensors = _safetensors.read_tensors(path)
    leaves = []
    for name, t in tensors.items():
        leaves.append(
            {
                "path": name,
                "type": "tensor",
                "shape": list(t.shape),
                "dtype": str(t.dtype),
                "sharding": None,
                "write_shape": None,
                "chunk_shape": None,
                "bytes": int(t.nbytes),
                "file": os.path.basename(str(t.path)),
            }
        )
    files = sorted({leaf["file"] for leaf in leaves})
    totals = {
        "leaves": len(leaves),
        "arrays": len(leaves),
        "bytes": sum(leaf["bytes"] for leaf in leaves),
    }
    return {
        "path": str(path),
        "format": "safetensors" + (f" ({len(files)} files)" if path.is_dir() else ""),
        "committed": None,
        "commit_timestamp_nsecs": None,
        "init_timestamp_nsecs": None,
        "custom_metadata": {},
        "metrics": {},
        "checkpointables": {
            "tensors": {
                "handler": "safetensors",
                "storage": ", ".join(files),
                "leaves": leaves,
                "totals": totals,
            }
        },
        "totals": totals,
    }


# ------------------------------------------------------------------------------------------
# A training root's steps
# ------------------------------------------------------------------------------------------


def _size(path: Any) -> int | None:
    """Bytes of every file under a local folder (None on object stores, where listing sizes
    would mean one request per object)."""
    if not isinstance(path, Path):
        return None
    total = 0
    for folder, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_size
    return total


def _entries(root: Any) -> dict[int, list[tuple[Any, str]]]:
    """step -> [(folder, what)]: committed steps, and what unfinished saves or deletions left."""
    out: dict[int, list[tuple[Any, str]]] = {}
    if not root.exists():
        return out
    if isinstance(root, Path):
        for p in sorted(root.iterdir()):
            name = p.name
            if _tier.is_step_name(name) and p.is_dir():
                out.setdefault(int(name), []).append(
                    (p, "committed" if _layout.is_committed(p) else "uncommitted")
                )
            elif _tier._leftover_of_step(name):
                what = "being deleted" if _tier.DELETING_SUFFIX in name else "unfinished save"
                out.setdefault(int(name.partition(".")[0]), []).append((p, what))
        return out
    committed, folders = _tier.Tier(root, 60.0)._listing()
    for name in sorted(folders, key=int):
        out.setdefault(int(name), []).append(
            (root / name, "committed" if name in committed else "uncommitted")
        )
    return out


def list_steps(
    root: str | os.PathLike[str], local: str | os.PathLike[str] | None = None
) -> list[dict[str, Any]]:
    """Every step folder of a training root (and of its local tier): committed or not, which
    tier holds it, its size, commit time and metrics. Oldest first; nothing is written."""
    tiers = [("durable", _paths.as_path(root))]
    if local is not None:
        tiers.insert(0, ("local", _paths.as_path(local)))
    if not tiers[-1][1].exists() and (local is None or not tiers[0][1].exists()):
        raise CheckpointNotFoundError(
            f"no training root at {tiers[-1][1]}: the folder does not exist. Check the path."
        )
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
                        meta = _layout.read_metadata(path)
                    stamp = meta.get("commit_timestamp_nsecs")
                    row["commit_timestamp_nsecs"] = stamp
                    row["committed"] = _views.timestamp_str(stamp) or None
                    row["metrics"] = meta.get("metrics") or row["metrics"]
                size = _size(path)
                if size is not None:
                    row["bytes"] = max(row["bytes"] or 0, size)
    return [rows[s] for s in sorted(rows)]
