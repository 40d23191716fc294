"""Flattening trees into named leaves, and the checks that keep names safe on disk."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from milepost import workers
from milepost._errors import InvalidKeyError, StructureMismatchError
from milepost.workers.format import KEY_DICT, KEY_SEQUENCE, ValueType, unsafe_part

PLACEHOLDER = ...
"""A leaf of an abstract tree that is skipped on load (it comes back as ``...``): nothing of it
is read. E.g. ``mp.load(path, {"params": abstract_params, "opt_state": mp.PLACEHOLDER})``."""


def is_empty_node(x: Any) -> bool:
    return x is None or (isinstance(x, dict | list | tuple) and len(x) == 0)


def empty_value_type(x: Any) -> ValueType:
    if x is None:
        return ValueType.NONE
    if isinstance(x, dict):
        return ValueType.DICT
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return ValueType.NAMED_TUPLE
    if isinstance(x, tuple):
        return ValueType.TUPLE
    return ValueType.LIST


def _is_leaf(x: Any) -> bool:
    return is_empty_node(x) or x is PLACEHOLDER


@dataclass(frozen=True)
class Leaf:
    name: str
    """Storage name: key path parts joined by '.'."""
    keys: tuple[tuple[str, int], ...]
    """(key, key_type) per level, as in Orbax's ``key_metadata``."""
    value: Any

    @property
    def tuple_key(self) -> str:
        """The key of this leaf in Orbax's ``tree_metadata``: ``str`` of the tuple of parts."""
        return str(tuple(k for k, _ in self.keys))


def path_of(parts: Iterable[str]) -> str:
    r"""A leaf's path: its keys joined by '.', a '.' or '\' inside a key written ``\.`` or
    ``\\`` (``{"a.b": {"c": x}}`` -> ``a\.b.c``). For keys without either (every key of most
    trees), the storage name; unlike the storage name, it tells ``{"a.b": x}`` from
    ``{"a": {"b": x}}``, and :func:`path_parts` gives the keys back. How surgery, ``stats``,
    ``diff`` and the command's tables name leaves."""
    return ".".join(p.replace("\\", "\\\\").replace(".", "\\.") for p in parts)


def path_parts(path: str) -> list[str]:
    r"""The keys of a leaf's :func:`path_of` (``a\.b.c`` -> ``['a.b', 'c']``); a '\' before
    anything but '.' or '\' is kept as it is."""
    parts: list[str] = []
    part: list[str] = []
    i = 0
    while i < len(path):
        c = path[i]
        if c == "\\" and path[i + 1 : i + 2] in (".", "\\"):
            part.append(path[i + 1])
            i += 2
            continue
        if c == ".":
            parts.append("".join(part))
            part = []
        else:
            part.append(c)
        i += 1
    parts.append("".join(part))
    return parts


def storage_name_of(path: str) -> str:
    """The storage name of the leaf at ``path`` (:func:`path_of`): its keys joined by '.'."""
    return path if "\\" not in path else ".".join(path_parts(path))


def _key_part(entry: Any) -> tuple[str, int]:
    if isinstance(entry, jax.tree_util.DictKey):
        return str(entry.key), KEY_DICT
    if isinstance(entry, jax.tree_util.GetAttrKey):
        return str(entry.name), KEY_DICT
    if isinstance(entry, jax.tree_util.SequenceKey):
        return str(entry.idx), KEY_SEQUENCE
    if isinstance(entry, jax.tree_util.FlattenedIndexKey):
        return str(entry.key), KEY_SEQUENCE
    return str(entry), KEY_DICT


def _check_part(part: str, path: tuple[str, ...]) -> None:
    where = "/".join(path) or "<root>"
    why = unsafe_part(part)
    if why == "it is empty":
        raise InvalidKeyError(
            f"tree key at {where!r} is empty; empty keys "
            "cannot name a stored array. Rename the key."
        )
    if why is not None:
        raise InvalidKeyError(
            f"tree key {part!r} at {where!r} is not safe as a storage name ({why}); "
            "rename the key, e.g. replace '/' with '_'."
        )


def flatten(tree: Any) -> tuple[list[Leaf], Any]:
    """Leaves with their storage names, and the treedef (None and empty containers are leaves)."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_leaf)
    leaves: list[Leaf] = []
    seen: dict[str, str] = {}
    for path, value in pairs:
        keys = tuple(_key_part(e) for e in path)
        parts = tuple(k for k, _ in keys)
        for i, part in enumerate(parts):
            _check_part(part, parts[:i])
        name = ".".join(parts) if parts else "_root"
        if (why := workers.declared.name_problem(name)) is not None:
            raise InvalidKeyError(
                f"the leaf {name[:60]!r}... cannot be stored: its storage name (its keys joined "
                f"by '.') {why[3:]}, and milepost reads no longer names back; shorten its keys "
                "or nest the tree less deeply."
            )
        if name in seen:
            raise InvalidKeyError(
                f"tree keys {seen[name]!r} and {parts!r} both map to the storage name {name!r} "
                "(parts are joined by '.'); rename one of them."
            )
        seen[name] = str(parts)
        leaves.append(Leaf(name=name, keys=keys, value=value))
    return leaves, treedef


def unflatten(treedef: Any, values: list[Any]) -> Any:
    return jax.tree_util.tree_unflatten(treedef, values)


def build_nested(entries: list[tuple[tuple[tuple[str, int], ...], Any]]) -> Any:
    """Rebuild a tree of dicts and lists from ``(key_metadata, value)`` pairs (no abstract tree)."""
    if len(entries) == 1 and not entries[0][0]:
        return entries[0][1]
    root: dict[str, Any] = {}
    kinds: dict[int, int] = {}
    for keys, value in entries:
        node = root
        for i, (key, key_type) in enumerate(keys):
            kinds[id(node)] = key_type
            if i == len(keys) - 1:
                node[key] = value
            else:
                node = node.setdefault(key, {})
    return _listify(root, kinds)


def _listify(node: Any, kinds: dict[int, int]) -> Any:
    if not isinstance(node, dict):
        return node
    kind = kinds.get(id(node), KEY_DICT)
    children = {k: _listify(v, kinds) for k, v in node.items()}
    if kind == KEY_SEQUENCE:
        return [children[k] for k in sorted(children, key=int)]
    return children


def value_as_abstract(value: Any, abstract: Any, name: str, where: str) -> Any:
    """A value a file holds as such (a scalar, a string, a small array), shaped as its abstract
    leaf: an array leaf gets an array of its dtype, on its sharding; a scalar leaf a scalar of
    its type. ``where`` names the file in the error when the shapes differ."""
    if abstract is None or isinstance(value, str):
        return value
    if isinstance(abstract, bool | int | float | complex):
        return type(abstract)(np.asarray(value).item())
    if not (hasattr(abstract, "shape") and hasattr(abstract, "dtype")):
        return value
    out = np.asarray(value, dtype=np.dtype(abstract.dtype))
    if tuple(out.shape) != tuple(abstract.shape):
        raise StructureMismatchError(
            f"leaf {name!r}: the abstract tree says shape {tuple(abstract.shape)} but {where} "
            f"holds {out.shape}"
        )
    if isinstance(abstract, np.generic):
        return out[()]
    sharding = None if isinstance(abstract, np.ndarray) else getattr(abstract, "sharding", None)
    return out if sharding is None else jax.device_put(out, sharding)
