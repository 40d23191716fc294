"""Typed PRNG keys (``jax.random.key``), stored the way Orbax stores them: as their key data
(``uint32``, with a trailing dimension: 2 words for threefry, 4 for rbg and unsafe_rbg) and the
name of their implementation (``random_key_impl`` in ``array_metadatas/``' ``ext_metadata``).

JAX is imported inside the functions: a host process imports this package before its JAX
environment is set.
"""

from __future__ import annotations

import functools
from typing import Any


def is_key(dtype: Any) -> bool:
    """Whether ``dtype`` is a typed PRNG key dtype (``key<fry>``, ``key<rbg>``...)."""
    import jax

    try:
        return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))
    except TypeError:
        return False


def impl_name(dtype: Any) -> str:
    """The implementation's name of a key dtype: 'threefry2x32', 'rbg' or 'unsafe_rbg'."""
    impl = getattr(dtype, "_impl", None)
    name = getattr(impl, "name", None)
    if not isinstance(name, str):
        raise TypeError(
            f"cannot tell the PRNG implementation of dtype {dtype}; "
            "this JAX version is not supported for keys"
        )
    return name


@functools.cache
def key_dtype(impl: str) -> Any:
    """The key dtype of implementation ``impl``."""
    import jax

    try:
        return jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(
            f"unknown PRNG key implementation {impl!r} ({e}); known: threefry2x32, rbg, unsafe_rbg"
        ) from e


@functools.cache
def key_words(impl: str) -> tuple[int, ...]:
    """The trailing shape of one key's data (``(2,)`` for threefry2x32)."""
    import jax

    return tuple(
        jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), key_dtype(impl))).shape
    )


def to_data(array: Any) -> Any:
    """A key array's data: a ``uint32`` array with the trailing key dimension, sharded alike."""
    import jax

    return jax.random.key_data(array)


def from_data(array: Any, impl: str) -> Any:
    """Key data back as a typed key array of ``impl``, sharded alike (without the key dimension)."""
    import jax

    return jax.random.wrap_key_data(array, impl=impl)


def dtype_name(dtype: Any) -> str:
    """A picklable name for any array dtype: NumPy's, or ``key<impl>`` for typed keys."""
    if is_key(dtype):
        return f"key<{impl_name(dtype)}>"
    import numpy as np

    return np.dtype(dtype).name


def dtype_of(name: Any) -> Any:
    """The dtype a :func:`dtype_name` names (NumPy dtypes and dtype objects pass through)."""
    if isinstance(name, str) and name.startswith("key<") and name.endswith(">"):
        return key_dtype(name[4:-1])
    import numpy as np

    return name if is_key(name) else np.dtype(name)
