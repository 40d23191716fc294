"""Flax msgpack checkpoints (``flax.serialization.to_bytes`` files such as model hubs'
``flax_model.msgpack``, and ``flax.training.checkpoints``' ``checkpoint_<step>``) loaded as
trees: the controller walks the file's structure (``milepost.workers.read_msgpack``, which
skips the arrays' bytes), and every host reads only the byte ranges its devices need, as for
safetensors. Nothing in the file is executed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from milepost import _checkpoint, _safetensors, _tree
from milepost._tree import ValueType
from milepost.workers import format as fmt


def is_msgpack(path: Path) -> bool:
    """A file that Flax wrote with msgpack (the name a hub or Flax gives it, and a msgpack map
    inside)."""
    name = path.name
    flax_name = name.endswith(".msgpack") or (
        name.startswith("checkpoint_") and name.removeprefix("checkpoint_").isdigit()
    )
    return flax_name and path.is_file() and fmt.is_msgpack_tree(str(path))


def flat(path: Path) -> _safetensors.Found:
    """Arrays and values of the msgpack file ``path`` by leaf name (key paths joined by '.')."""
    tensors: dict[str, fmt.Tensor] = {}
    plain: dict[str, Any] = {}
    for name, leaf in fmt.read_msgpack_leaves(str(path)).items():
        if isinstance(leaf, fmt.Tensor):
            tensors[name] = fmt.Tensor(leaf.path, name, leaf.dtype, leaf.shape, leaf.offset)
        else:
            plain[name] = leaf
    return tensors, plain


def load(path: Path, abstract: Any, partial: bool) -> Any:
    """The tree of the msgpack file ``path``, shaped and placed as ``abstract`` says (leaf names:
    key paths joined by '.', list items by their index), or with no abstract tree as nested
    dicts of NumPy arrays and values (as ``flax.serialization.msgpack_restore`` gives)."""
    return _safetensors.load_tensors(
        path,
        lambda: flat(path),
        abstract,
        partial,
        kind="a msgpack file",
    )


def metadata(path: Path) -> _checkpoint.CheckpointMetadata:
    """What ``milepost.metadata`` says of a msgpack file: every leaf's shape and dtype (arrays),
    or its kind; no array bytes are read. The tree is the one checkpointable, ``default``."""
    entries: list[tuple[tuple[tuple[str, int], ...], Any]] = []
    for name, leaf in fmt.read_msgpack_leaves(str(path)).items():
        keys = tuple((part, _tree.KEY_DICT) for part in name.split("."))
        described: Any
        if isinstance(leaf, fmt.Tensor):
            described = _checkpoint.LeafMetadata(
                name=name,
                value_type=ValueType.NP_ARRAY,
                shape=leaf.shape,
                dtype=fmt.numpy_dtype(leaf.dtype),
            )
        elif isinstance(leaf, dict | list):
            described = leaf  # an empty container
        elif leaf is None:
            described = None
        elif isinstance(leaf, str | bytes):
            described = _checkpoint.LeafMetadata(name=name, value_type=ValueType.STRING)
        else:
            described = _checkpoint.LeafMetadata(
                name=name, value_type=ValueType.SCALAR, shape=(), dtype=np.asarray(leaf).dtype
            )
        entries.append((keys, described))
    tree = _tree.build_nested(entries)
    return _checkpoint.CheckpointMetadata(path, {}, {"default": tree}, "default")
