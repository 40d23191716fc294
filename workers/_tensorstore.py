"""TensorStore specs for the on-disk layout (zarr3 arrays, optionally inside OCDBT)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import tensorstore as ts

from milepost.workers._messages import ArraySpec, StoreSpec

PROCESS_PREFIX = "ocdbt.process_"
OCDBT_CONFIG = {
    # Small values (zarr.json, scalars) inline in the B-tree, array chunks in data files.
    "max_inline_value_bytes": 1024,
    "max_decoded_node_bytes": 100_000_000,
    # One writer per database: the single-file manifest is enough and cheapest.
    "manifest_kind": "single",
}


def new_context(file_io_concurrency: int = 64) -> ts.Context:
    return ts.Context({"file_io_concurrency": {"limit": file_io_concurrency}})


def _file(path: str) -> dict[str, Any]:
    return {"driver": "file", "path": path.rstrip("/") + "/"}


def process_dir_name(process_index: int | str, writer: int = 0) -> str:
    return f"{PROCESS_PREFIX}{process_index}" + (f".{writer}" if writer else "")


def write_kvstore(store: StoreSpec, process_index: int | str, writer: int = 0) -> dict[str, Any]:
    """The kvstore a host's writer writes into: its own OCDBT database, or the plain folder."""
    if not store.use_ocdbt:
        return _file(store.directory)
    base = os.path.join(store.directory, process_dir_name(process_index, writer))
    return {"driver": "ocdbt", "base": _file(base), "config": OCDBT_CONFIG}


def read_kvstore(store: StoreSpec) -> dict[str, Any]:
    """The kvstore a reader sees: the merged root OCDBT view, or the plain folder."""
    if not store.use_ocdbt:
        return _file(store.directory)
    return {"driver": "ocdbt", "base": _file(store.directory)}


def merge_kvstore(store: StoreSpec) -> dict[str, Any]:
    return {"driver": "ocdbt", "base": _file(store.directory), "config": OCDBT_CONFIG}


def _array_kvstore(kvstore: dict[str, Any], name: str) -> dict[str, Any]:
    """The kvstore of one array: a key prefix inside OCDBT, a sub-folder of a plain folder."""
    if kvstore["driver"] == "file":
        return {**kvstore, "path": kvstore["path"] + name + "/"}
    return {**kvstore, "path": name + "/"}


ZARR3_DTYPES = frozenset(
    {
        "bool", "int2", "int4", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "float4_e2m1fn", "float8_e3m4", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e4m3b11fnuz", "float8_e5m2",
        "float8_e5m2fnuz", "float8_e8m0fnu", "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
    }
)
"""NumPy dtype names that TensorStore's zarr3 driver can store."""


def zarr_dtype(dtype: np.dtype | str) -> str:
    name = np.dtype(dtype).name
    return "bool" if name == "bool" else name


def create_spec(kvstore: dict[str, Any], spec: ArraySpec) -> dict[str, Any]:
    inner: list[dict[str, Any]] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if spec.compression == "zstd":
        inner.append({"name": "zstd", "configuration": {"level": 3, "checksum": False}})
    elif spec.compression is not None:
        raise ValueError(f"unknown compression {spec.compression!r}; use None or 'zstd'")
    return {
        "driver": "zarr3",
        "kvstore": _array_kvstore(kvstore, spec.name),
        # Orbax reads with fill_missing_data_reads=False: every chunk must exist, zeros included.
        "store_data_equal_to_fill_value": True,
        "metadata": {
            "shape": list(spec.shape),
            "data_type": zarr_dtype(spec.dtype),
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(spec.write_shape)}},
            "chunk_key_encoding": {"name": "default"},
            "codecs": [
                {
                    "name": "sharding_indexed",
                    "configuration": {
                        "chunk_shape": list(spec.chunk_shape),
                        "codecs": inner,
                        "index_codecs": [
                            {"name": "bytes", "configuration": {"endian": "little"}},
                            {"name": "crc32c"},
                        ],
                    },
                }
            ],
        },
    }


def open_spec(kvstore: dict[str, Any], name: str, fill_missing: bool = False) -> dict[str, Any]:
    return {
        "driver": "zarr3",
        "kvstore": _array_kvstore(kvstore, name),
        "recheck_cached_data": False,
        "recheck_cached_metadata": False,
        "fill_missing_data_reads": fill_missing,
    }


def box_to_slices(box: tuple[tuple[int, int], ...]) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)
