"""What a tree's metadata records of each leaf (Orbax's ``_METADATA``): its key types and
value types, and the rule that keeps every stored name inside its folder."""

from __future__ import annotations

import enum
from typing import Any

KEY_SEQUENCE = 1
KEY_DICT = 2


class ValueType(enum.StrEnum):
    """A leaf's ``value_type`` in Orbax's ``_METADATA`` (the same strings)."""

    JAX_ARRAY = "jax.Array"
    NP_ARRAY = "np.ndarray"
    SCALAR = "scalar"
    STRING = "string"
    PLACEHOLDER = "placeholder"
    NONE = "None"
    DICT = "Dict"
    LIST = "List"
    TUPLE = "Tuple"
    NAMED_TUPLE = "NamedTuple"
    UNKNOWN = "Unknown"
    """Also stands for a value type this version does not know (a custom Orbax type handler)."""

    @classmethod
    def parse(cls, text: Any) -> ValueType:
        try:
            return cls(text)
        except ValueError:
            return cls.UNKNOWN

    @property
    def is_array(self) -> bool:
        """Stored as a zarr3 array (a scalar is a 0-d one)."""
        return self in (ValueType.JAX_ARRAY, ValueType.NP_ARRAY, ValueType.SCALAR)

    @property
    def is_empty(self) -> bool:
        """None or an empty container: nothing is stored but the type."""
        return self in _EMPTY_VALUES

    def empty_value(self) -> Any:
        """The value an empty leaf of this type loads as."""
        return _EMPTY_VALUES[self]()


_EMPTY_VALUES: dict[ValueType, Any] = {
    ValueType.NONE: lambda: None,
    ValueType.DICT: dict,
    ValueType.LIST: list,
    ValueType.TUPLE: tuple,
    ValueType.NAMED_TUPLE: tuple,
}


def unsafe_part(part: Any) -> str | None:
    """Why ``part`` cannot be one part of a storage name (None: it can). The same rules hold for
    keys being saved and keys read from a checkpoint, so no name ever leaves its folder."""
    if not isinstance(part, str):
        return f"it is a {type(part).__name__}, not a string"
    if part == "":
        return "it is empty"
    if part in (".", "..") or "/" in part or "\\" in part or "\x00" in part:
        return "it contains a path separator or NUL, or is '.' or '..'"
    return None
