"""``surgery.open``: a lazy view of a checkpoint (only its metadata is read)."""

from __future__ import annotations

import html
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from milepost import _checkpoint, _hosts, _options, workers
from milepost._checkpoint import LeafMetadata
from milepost._tree import PLACEHOLDER, ValueType
from milepost.colocated import Slice
from milepost.surgery._lazy import LazyArray, Source, flat, nest
from milepost.surgery._placement import Placement, fits
from milepost.workers import ObjectPath, StoragePath, as_path
from milepost.workers import format as fmt
from milepost.workers.format import TreeFiles


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """An opened checkpoint: ``tree`` holds a :class:`LazyArray` per array (strings and
    scalars as values); ``files`` what the loads and previews check against."""

    path: StoragePath
    """The checkpoint's folder."""
    item: str
    """The name of the checkpointable opened (the tree)."""
    folder: StoragePath
    """The checkpointable's folder."""
    files: TreeFiles
    placement: Placement
    """Where the arrays are computed: the slice or this process's devices."""
    tree: Any
    custom_metadata: dict[str, Any]
    """The custom metadata saved with the checkpoint."""
    leaf_meta: dict[str, LeafMetadata]
    """What ``milepost.metadata`` says of each stored array (write and chunk shapes), by its
    storage name."""

    @property
    def arrays(self) -> dict[str, LazyArray]:
        """Every lazy array in ``tree``, by its path."""
        return {k: v for k, v in flat(self.tree).items() if isinstance(v, LazyArray)}

    @property
    def nbytes(self) -> int:
        """Bytes of all its arrays."""
        return sum(a.nbytes for a in self.arrays.values())

    def rows(self) -> list[tuple[str, str, str, str, int]]:
        """(name, shape, dtype, sharding, bytes) of every leaf."""
        out = []
        for name, leaf in flat(self.tree).items():
            if isinstance(leaf, LazyArray):
                where = workers.sharding_str(leaf.sharding)
                out.append((name, str(leaf.shape), str(leaf.dtype), where, leaf.nbytes))
            else:
                out.append((name, "", type(leaf).__name__, repr(leaf)[:40], 0))
        return out

    def __repr__(self) -> str:
        rows = [(workers.printable(n), s, d, w, b) for n, s, d, w, b in self.rows()]
        width = max((len(r[0]) for r in rows), default=4)
        lines = [
            f"Checkpoint({str(self.path)!r}, item={self.item!r}, "
            f"{len(self.arrays)} arrays, {self.nbytes / 2**20:.1f} MiB)"
        ]
        lines += [
            f"  {n:<{width}}  {s:<16} {d:<10} {b / 2**20:>9.2f} MiB  {w}" for n, s, d, w, b in rows
        ]
        return workers.printable("\n".join(lines), newlines=True)

    def _repr_html_(self) -> str:
        cells = "".join(
            f"<tr><td><code>{workers.html_text(n)}</code></td><td>{html.escape(s)}</td>"
            f"<td>{html.escape(d)}</td><td>{workers.html_text(w)}</td>"
            f"<td style='text-align:right'>{b / 2**20:.2f} MiB</td></tr>"
            for n, s, d, w, b in self.rows()
        )
        return (
            f"<p><b>{workers.html_text(self.path)}</b> ({workers.html_text(self.item)}): "
            f"{len(self.arrays)} arrays, {self.nbytes / 2**20:.1f} MiB</p>"
            "<table><tr><th>leaf</th><th>shape</th><th>dtype</th><th>sharding</th>"
            f"<th>bytes</th></tr>{cells}</table>"
        )


def open(
    path: str | os.PathLike[str] | ObjectPath,
    *,
    slice: Slice | None = None,
    item: str | None = None,
) -> Checkpoint:
    """Open the checkpoint at ``path`` for surgery: a lazy view, nothing but metadata is read.

    ``slice``: a :class:`milepost.Slice` whose hosts will read, compute and write (default:
    this process's devices, or every process of a multi-controller job). ``item``: which
    checkpointable (default: the main tree, e.g. ``state``).

    >>> ck = milepost.surgery.open("/ckpt/1000")
    >>> np.asarray(ck.tree["params"]["w"][:4, :8])   # reads only the chunks of that box
    """
    placement = Placement(slice)
    root = as_path(path)
    _hosts.check_storage(placement.group, root)
    options = _options.current()

    def read() -> tuple[str, Any, fmt.TreeFiles, Any, dict[str, Any]]:
        with _checkpoint.unchanged(root):
            meta, items, _, checksums = _checkpoint.read_checkpointables(root)
            name = item if item is not None else fmt.main_tree(root, items)
            if name not in items:
                raise KeyError(
                    f"{root} has no checkpointable {name!r} (it has "
                    f"{sorted(items)}); pass item=one of those"
                )
            folder = items[name].folder
            with fmt.verifying(checksums):
                files = _checkpoint.read_tree_files(folder)
                described = _checkpoint.tree_metadata(folder)
        return name, folder, files, described, dict(meta.get("custom_metadata") or {})

    name, folder, files, described, custom = _hosts.shared(
        placement.group, f"surgery-open:{root}", read, options.async_.timeout_secs
    )
    described_leaves = flat(described)  # by path: the storage name is each LeafMetadata's name
    meta_by_name = {
        m.name: m for m in described_leaves.values() if isinstance(m, _checkpoint.LeafMetadata)
    }
    ck = Checkpoint(root, name, folder, files, placement, None, custom, meta_by_name)
    leaves: dict[str, Any] = {}
    scalars: dict[str, Any] = {}
    for path, leaf in described_leaves.items():
        if isinstance(leaf, _checkpoint.LeafMetadata) and leaf.value_type in (
            ValueType.JAX_ARRAY,
            ValueType.NP_ARRAY,
        ):
            # The saved sharding, even over devices not here (placement.spec_for places it
            # as it can): where the array would like to live, and what a write records.
            spec = leaf.sharding if fits(leaf.sharding, leaf.shape or ()) else None
            leaves[path] = LazyArray(
                Source(ck, leaf.name, path), leaf.shape or (), np.dtype(leaf.dtype), spec
            )
        elif isinstance(leaf, _checkpoint.LeafMetadata) and leaf.value_type is ValueType.STRING:
            leaves[path] = files.strings.get(leaf.name, "")
        elif isinstance(leaf, _checkpoint.LeafMetadata) and leaf.value_type is ValueType.SCALAR:
            scalars[path] = np.empty(leaf.shape or (), leaf.dtype)
            leaves[path] = None
        else:
            leaves[path] = leaf
    if scalars:  # tiny: read now, by the controller
        abstract = nest({n: scalars.get(n, PLACEHOLDER) for n in leaves})
        got = flat(_checkpoint.load_checkpointables(root, {name: abstract}, partial=True)[name])
        for n in scalars:
            stored = described_leaves[n].name
            leaves[n] = _checkpoint.to_scalar(
                np.asarray(got[n]), files.python_types.get(stored), None
            )
    object.__setattr__(ck, "tree", nest(leaves))
    return ck
