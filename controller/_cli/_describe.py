"""What a checkpoint or a training root holds, as plain records (what ``milepost inspect`` and
``milepost ls`` print, and their ``--json``). Only metadata is read, never array data."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from milepost import _api, _safetensors, _views
from milepost._cli._errors import CliError
from milepost.workers import ObjectPath, StoragePath, as_path, is_local
from milepost.workers import format as fmt


def _storage(folder: StoragePath) -> str:
    with contextlib.suppress(Exception):
        files = fmt.read_tree(folder)
        zarr = files.store(folder).zarr_format
        return f"{'OCDBT' if files.use_ocdbt else 'plain folders'}, zarr{zarr}"
    return ""


def _totals(leaves: list[Any]) -> dict[str, int]:
    n, arrays, nbytes = _views.totals(leaves)
    return {"leaves": n, "arrays": arrays, "bytes": nbytes}


def describe(path: str | os.PathLike[str] | ObjectPath) -> dict[str, Any]:
    """A checkpoint (milepost, Orbax v1 or v0, plain zarr3 or OCDBT, any storage) or a
    safetensors file or folder: its format, timestamps, custom metadata, metrics and, per
    checkpointable, its leaves with their totals."""
    where = as_path(path)
    if is_local(where) and _safetensors.is_safetensors(where):
        return _describe_safetensors(where)
    if is_local(where) and where.is_file():
        raise CliError(
            f"{where} is a file in a format milepost does not read: milepost reads checkpoint "
            "folders (milepost, Orbax v1, Orbax v0; OCDBT or plain zarr) and .safetensors files "
            "(or a folder of them)"
        )
    meta = _api.metadata(where)
    out: dict[str, Any] = {
        "path": str(where),
        "format": fmt.writer_of(where),
        "committed": _views.timestamp_str(meta.commit_timestamp_nsecs) or None,
        "commit_timestamp_nsecs": meta.commit_timestamp_nsecs,
        "init_timestamp_nsecs": meta.init_timestamp_nsecs,
        "custom_metadata": meta.custom_metadata,
        "metrics": meta.metrics,
        "checkpointables": {},
    }
    everything: list[Any] = []
    items = fmt.checkpointables(where, fmt.read_checkpoint_metadata(where))
    for name, part in meta.checkpointables.items():
        handler = meta.item_handlers.get(name) or (items[name].handler if name in items else None)
        entry: dict[str, Any] = {"handler": handler}
        paths = _views.leaf_paths(part)
        leaves = [leaf for _, leaf in paths]
        if leaves or (name in items and items[name].is_pytree):
            entry["storage"] = _storage(items[name].folder) if name in items else ""
            entry["leaves"] = [_views.leaf_record(leaf, path) for path, leaf in paths]
            entry["totals"] = _totals(leaves)
            everything += leaves
        else:
            entry["value"] = part
        out["checkpointables"][name] = entry
    out["totals"] = _totals(everything)
    return out


def _describe_safetensors(path: Path) -> dict[str, Any]:
    tensors = _safetensors.read_tensors(path)
    leaves: list[dict[str, Any]] = []
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
