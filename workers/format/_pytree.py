"""The files of a pytree checkpointable (Orbax v1 names): written by the commit, read by a load.

::

    <checkpointable>/_METADATA                    the tree: each leaf's key path and value type
                     _sharding                    base64(leaf name) -> JSON of its NamedSharding
                                                  (Orbax's form; left out when it would be large)
                     _strings.json                the string leaves
                     _milepost.json               each mesh once and each array's PartitionSpec;
                                                  Python/NumPy types of scalars; that the chunks'
                                                  checksums are in their writers' tables (Orbax
                                                  ignores it)
                     array_metadatas/process_0    write and chunk shape per array (each listed once)

Array data lives beside them, in the per-process OCDBT stores and the merged root view
(``milepost.workers`` owns those).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from milepost.workers import _declared as declared
from milepost.workers._errors import CorruptCheckpointError
from milepost.workers._messages import SaveAck, StoreSpec, WrittenArray
from milepost.workers._paths import StoragePath
from milepost.workers._sharding import ShardingSpec
from milepost.workers.format._checksum import grid_key
from milepost.workers.format._chunk_tables import FORMAT as CHUNK_TABLES_FORMAT
from milepost.workers.format._chunk_tables import present as has_chunk_tables
from milepost.workers.format._file_checksums import present, read_json, read_json_object
from milepost.workers.format._files import (
    AGGREGATE,
    ARRAY_METADATAS,
    MILEPOST_INFO,
    OCDBT_MANIFEST,
    SHARDING,
    STRINGS,
    TREE_METADATA,
    write_json,
)
from milepost.workers.format._msgpack import flat_leaves as msgpack_leaves
from milepost.workers.format._msgpack import read_tree_bytes as read_msgpack_bytes
from milepost.workers.format._shardings import read_shardings, write_shardings
from milepost.workers.format._values import KEY_SEQUENCE, ValueType, unsafe_part

Keys = tuple[tuple[str, int], ...]
"""A leaf's key path: ``(key, key_type)`` per level, as in Orbax's ``key_metadata``."""


class _Named(Protocol):
    """A leaf as the tree's flattening names it (``milepost._tree.Leaf``)."""

    @property
    def name(self) -> str: ...
    @property
    def keys(self) -> tuple[tuple[str, int], ...]: ...


@dataclass(frozen=True)
class SavedLeaf:
    """One entry of ``_METADATA``."""

    name: str
    """Storage name: the key path's parts joined by '.'."""
    keys: Keys
    value_type: ValueType
    raw_value_type: str
    """The value type as written (differs from ``value_type`` only for unknown types)."""
    write_shape: tuple[int, ...] | None = None

    @property
    def tuple_key(self) -> str:
        """The key of this leaf in ``tree_metadata``: ``str`` of the tuple of parts."""
        return str(tuple(k for k, _ in self.keys))

    @staticmethod
    def of(
        leaf: _Named, value_type: ValueType, write_shape: tuple[int, ...] | None = None
    ) -> SavedLeaf:
        return SavedLeaf(leaf.name, leaf.keys, value_type, str(value_type), write_shape)


@dataclass(frozen=True)
class TreeFiles:
    """What the format files of one pytree checkpointable say."""

    leaves: dict[str, SavedLeaf]
    """By storage name, in the tree's order."""
    use_ocdbt: bool
    zarr_format: int = 3
    """2 for Orbax v0's default layout (``use_zarr3`` false); milepost writes 3."""
    shardings: dict[str, ShardingSpec] = field(default_factory=dict)
    strings: dict[str, str] = field(default_factory=dict)
    python_types: dict[str, str] = field(default_factory=dict)
    """Scalars' Python or NumPy type names (``int``, ``np.float32``...), and ``tuple`` for empty
    tuples: what Orbax's metadata has no word for."""
    key_impls: dict[str, str] = field(default_factory=dict)
    """Typed PRNG key leaves: their implementation ('threefry2x32'...). Stored as key data."""
    chunk_crc32c: dict[str, dict[tuple[int, ...], int]] = field(default_factory=dict)
    """Per array, the CRC32C of each chunk's values by chunk-grid index, as the hosts that wrote
    them computed it (``_milepost.json``): arrays of plain zarr3 folders, and of checkpoints
    written before the chunk checksum tables."""
    chunk_tables: bool = False
    """The other arrays' chunk checksums are in the tables their writers put in their OCDBT
    databases (``_chunk_tables``), which the hosts read; every chunk is stored."""
    aggregated: dict[str, Any] = field(default_factory=dict)
    """Leaves whose values Orbax's PyTree handler kept in its msgpack ``checkpoint`` file
    (``SaveArgs(aggregate=True)``, and older defaults), by name; the others are placeholders
    there."""
    orbax_sharding_max_bytes: int = 256 * 1024
    """Writing: ``_sharding`` (Orbax's form, every device id of the mesh per array) is written
    when it comes to at most this many bytes (``SaveOptions.orbax_sharding_max_bytes``)."""
    sharding_files: tuple[str, ...] = ()
    """Reading: the files that record the shardings: ``_milepost.json`` (read), and
    ``_sharding`` when the compact form says it was written too; for checkpoints without the
    compact form (Orbax's, older milepost's), ``_sharding`` if it is there."""
    fill_missing: bool = False
    """True for checkpoints written without every chunk (``store_array_data_equal_to_fill_value``
    false): a missing chunk then means zeros. Milepost and Orbax 0.12 write every chunk, so a
    missing one is lost data and reading it fails."""

    def store(self, directory: StoragePath) -> StoreSpec:
        return StoreSpec(
            directory=str(directory), use_ocdbt=self.use_ocdbt, zarr_format=self.zarr_format
        )


# ------------------------------------------------------------------------------------------
# Writing (the commit)
# ------------------------------------------------------------------------------------------


def write_tree(
    directory: StoragePath, files: TreeFiles, acks: Sequence[SaveAck], platform: str
) -> None:
    """Write every format file of ``files``; ``array_metadatas/`` comes from the hosts' acks."""
    tree_metadata: dict[str, Any] = {}
    for leaf in files.leaves.values():
        value_metadata: dict[str, Any] = {
            "value_type": leaf.raw_value_type,
            "skip_deserialize": leaf.value_type.is_empty,
        }
        if leaf.value_type is ValueType.JAX_ARRAY and leaf.write_shape is not None:
            value_metadata["write_shape"] = list(leaf.write_shape)
        tree_metadata[leaf.tuple_key] = {
            "key_metadata": [{"key": k, "key_type": t} for k, t in leaf.keys],
            "value_metadata": value_metadata,
        }
    write_json(
        directory / TREE_METADATA,
        {
            "tree_metadata": tree_metadata,
            "use_ocdbt": files.use_ocdbt,
            "use_zarr3": True,
            "store_array_data_equal_to_fill_value": not files.fill_missing,
            "custom_metadata": None,
        },
    )
    compact = (
        write_shardings(directory, files.shardings, platform, files.orbax_sharding_max_bytes)
        if files.shardings
        else None
    )
    if files.strings:
        write_json(directory / STRINGS, files.strings)
    checksums: dict[str, dict[str, int]] = {}
    grid_keys: dict[tuple[int, ...], str] = {}
    for ack in acks:
        for written in ack.arrays:
            if not written.chunk_crc32c:
                continue  # (in its writer's chunk checksum table, or an array without chunks)
            mine = checksums.setdefault(written.name, {})
            for grid, crc in written.chunk_crc32c:
                key = grid_keys.get(grid)
                if key is None:
                    key = grid_keys[grid] = grid_key(grid)
                mine[key] = crc
    info: dict[str, Any] = {}
    if compact is not None:
        info["shardings"] = compact
    if files.python_types:
        info["python_types"] = files.python_types
    if files.key_impls:
        info["random_key_impl"] = files.key_impls
    if checksums:
        info["chunk_crc32c"] = checksums
    if any(ack.chunk_tables for ack in acks) or files.chunk_tables:
        info["chunk_crc32c_tables"] = CHUNK_TABLES_FORMAT
    if info:
        write_json(directory / MILEPOST_INFO, info)
    _write_array_metadatas(directory / ARRAY_METADATAS, acks)


def _write_array_metadatas(folder: StoragePath, acks: Sequence[SaveAck]) -> None:
    """``array_metadatas/process_0``: every array the hosts wrote, each listed once.

    Orbax writes one file per process, each listing every array (all of its processes write a
    shard of every array, and its save checks that the files agree). Its readers use one file:
    a restore reads the folder and takes the first file it finds
    (``jax_array_handlers._wrap_random_key_data``), Pathways and Orbax's own commit read
    ``process_0``. Milepost's commit runs in one process, as Orbax's does on Pathways: one file,
    ``process_0``, whatever hosts wrote the arrays, so the file is O(arrays), not O(arrays x
    hosts). (Checkpoints from before list every array once per host; readers take either.)
    """
    arrays: dict[str, WrittenArray] = {}
    for ack in acks:
        if isinstance(ack.process_index, int):  # not the controller's own leaves (NumPy arrays)
            for a in ack.arrays:
                arrays.setdefault(a.name, a)
    folder.mkdir(exist_ok=True)
    if not arrays:
        return
    write_json(
        folder / "process_0",
        {
            "array_metadatas": [
                {
                    "array_metadata": {
                        "param_name": a.name,
                        "write_shape": list(a.write_shape),
                        "chunk_shape": list(a.chunk_shape),
                        "ext_metadata": {"random_key_impl": a.random_key_impl}
                        if a.random_key_impl
                        else None,
                    }
                }
                for a in arrays.values()
            ]
        },
    )


# ------------------------------------------------------------------------------------------
# Reading
# ------------------------------------------------------------------------------------------


def read_tree(directory: StoragePath) -> TreeFiles:
    """The format files in ``directory``; any of them malformed is a
    :class:`CorruptCheckpointError` naming the files."""
    try:
        return _read(directory)
    except CorruptCheckpointError:
        raise
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise CorruptCheckpointError(
            f"the metadata files in {directory} ({TREE_METADATA}, {SHARDING}, "
            f"{STRINGS}, {MILEPOST_INFO}) do not have the expected form "
            f"({type(e).__name__}: {e}); the checkpoint is damaged. Load an earlier checkpoint."
        ) from e


def _read(directory: StoragePath) -> TreeFiles:
    meta = read_json(directory / TREE_METADATA, "tree metadata")
    if not isinstance(meta, dict) or not isinstance(meta.get("tree_metadata"), dict):
        raise CorruptCheckpointError(
            f"{directory / TREE_METADATA} has no 'tree_metadata'; "
            "the checkpoint is damaged or not a pytree"
        )
    leaves = _leaves(directory / TREE_METADATA, meta["tree_metadata"])
    info = (
        read_json_object(directory / MILEPOST_INFO, "milepost info")
        if present(directory / MILEPOST_INFO)
        else {}
    )
    shardings, sharding_files = read_shardings(directory, info)
    strings = (
        declared.strings(
            read_json_object(directory / STRINGS, "string leaves"),
            str(directory / STRINGS),
            "the string leaves",
        )
        if present(directory / STRINGS)
        else {}
    )
    checksums = _chunk_checksums(directory / MILEPOST_INFO, info.get("chunk_crc32c", {}))
    for part in ("python_types", "random_key_impl"):
        if part in info:
            declared.strings(info[part], str(directory / MILEPOST_INFO), part)
    for name, kind in info.get("python_types", {}).items():
        if kind.startswith("np.") and kind[3:] not in declared.ZARR3_DTYPES:
            raise declared.bad(
                str(directory / MILEPOST_INFO),
                f"python_types[{declared.shown(name)}]",
                f"is {declared.shown(kind)}, not a NumPy scalar type milepost saves",
            )
    tables = info.get("chunk_crc32c_tables")
    if tables is not None and tables != CHUNK_TABLES_FORMAT:
        raise ValueError(
            f"chunk_crc32c_tables is {tables!r}: a format this milepost does not know (it reads "
            f"{CHUNK_TABLES_FORMAT}); upgrade milepost to load this checkpoint"
        )
    tables = tables is not None
    use_ocdbt = (
        bool(meta["use_ocdbt"]) if "use_ocdbt" in meta else present(directory / OCDBT_MANIFEST)
    )
    if not use_ocdbt:  # (each array a folder named after its leaf)
        for name, leaf in leaves.items():
            if leaf.value_type.is_array:
                declared.folder_name(name, str(directory / TREE_METADATA), "an array's name")
    if not tables and use_ocdbt and present(directory / OCDBT_MANIFEST):
        # A milepost checkpoint's databases hold checksum tables that _milepost.json does not
        # mention (edited, or crafted): its chunks are checked against them all the same.
        tables = has_chunk_tables(StoreSpec(directory=str(directory), use_ocdbt=True))
    if "random_key_impl" in info:
        key_impls = {str(k): str(v) for k, v in info["random_key_impl"].items()}
    else:  # written by Orbax: the implementations are only in array_metadatas/
        key_impls = _key_impls_of_array_metadatas(
            directory, [n for n, leaf in leaves.items() if leaf.value_type is ValueType.JAX_ARRAY]
        )
    return TreeFiles(
        leaves=leaves,
        # Orbax before 0.6 did not record it: an OCDBT tree has its manifest at the top
        use_ocdbt=use_ocdbt,
        zarr_format=3 if meta.get("use_zarr3", False) else 2,
        shardings=shardings,
        sharding_files=sharding_files,
        strings=strings,
        python_types=info.get("python_types", {}),
        key_impls=key_impls,
        chunk_crc32c=checksums,
        chunk_tables=tables,
        aggregated=_aggregated(directory, leaves),
        # Checkpoints with chunk checksum tables store every chunk, whatever _METADATA says.
        fill_missing=not meta.get("store_array_data_equal_to_fill_value", False) and not tables,
    )


def _leaves(path: StoragePath, tree_metadata: dict[str, Any]) -> dict[str, SavedLeaf]:
    """The leaves ``_METADATA`` (at ``path``) lists, by storage name: each key a string or an
    integer that is safe as part of a storage name, each name within
    :mod:`milepost.declared`'s bounds, no name twice and no leaf inside another."""
    where = str(path)
    leaves: dict[str, SavedLeaf] = {}
    for entry, item in tree_metadata.items():
        field = f"the entry {declared.shown(entry)}"
        item = declared.mapping(item, where, field)
        listed = item["key_metadata"]
        if not isinstance(listed, list) or len(listed) > declared.MAX_NAME_PARTS:
            raise declared.bad(
                where,
                f"{field}'s key_metadata",
                f"is not a list of at most {declared.MAX_NAME_PARTS} keys",
            )
        keys = tuple(_key(where, field, k) for k in listed)
        value = declared.mapping(item["value_metadata"], where, f"{field}'s value_metadata")
        raw = value["value_type"]
        write_shape = value.get("write_shape")
        name = ".".join(k for k, _ in keys) if keys else "_root"
        declared.name(name, where, f"{field}'s name")
        if name in leaves:
            raise declared.bad(where, f"{field}'s name", f"{name!r} names two leaves")
        leaves[name] = SavedLeaf(
            name,
            keys,
            ValueType.parse(raw),
            str(raw),
            declared.shape(write_shape, where, f"{field}'s write_shape") if write_shape else None,
        )
    clash = declared.conflict_of_paths(tuple(k for k, _ in s.keys) for s in leaves.values())
    if clash is not None:
        raise declared.bad(
            where, "tree_metadata", f"holds the leaf {clash[0]} and the leaf {clash[1]} inside it"
        )
    return leaves


def _key(where: str, field: str, entry: Any) -> tuple[str, int]:
    """One entry of a leaf's ``key_metadata``: its key (an integer as a string) and key type."""
    entry = declared.mapping(entry, where, f"{field}'s key_metadata")
    key = entry["key"]
    if isinstance(key, int) and not isinstance(key, bool):
        key = str(key)
    if (why := unsafe_part(key)) is not None:
        raise CorruptCheckpointError(
            f"{where} names a leaf with the key {declared.shown(key)} ({field}), which "
            f"cannot be a storage name ({why}); the checkpoint is damaged or crafted, and "
            "nothing was read from it",
            path=where,
            field="key_metadata",
        )
    key_type = declared.integer(entry["key_type"], where, f"{field}'s key_type")
    if key_type == KEY_SEQUENCE and not (key.isascii() and key.isdigit()):
        raise declared.bad(
            where,
            f"{field}'s key_metadata",
            f"gives the key {declared.shown(key)} as a list index",
        )
    return key, key_type


def _chunk_checksums(path: StoragePath, recorded: Any) -> dict[str, dict[tuple[int, ...], int]]:
    """``"chunk_crc32c"`` of ``_milepost.json`` (at ``path``): per array, each chunk's grid
    index and CRC32C."""
    where = str(path)
    grids: dict[str, tuple[int, ...]] = {}  # the same grid keys recur in every array
    out: dict[str, dict[tuple[int, ...], int]] = {}
    for name, chunks in declared.mapping(recorded, where, "chunk_crc32c").items():
        field = f"chunk_crc32c[{declared.shown(name)}]"
        mine = out[name] = {}
        for key, crc in declared.mapping(chunks, where, field).items():
            found = grids.get(key)
            if found is None:
                found = grids[key] = declared.grid_key(key, where, field)
            mine[found] = declared.integer(crc, where, field, maximum=2**32 - 1)
    return out


PLACEHOLDER_PREFIX = "PLACEHOLDER://"
"""How Orbax's aggregate file marks a leaf whose value lies elsewhere."""


def _aggregated(directory: StoragePath, leaves: dict[str, SavedLeaf]) -> dict[str, Any]:
    """The values Orbax's msgpack ``checkpoint`` file holds (small: scalars, and arrays saved
    with ``aggregate``), by leaf name; placeholders left out. Each must be of the kind
    ``_METADATA`` records for its leaf: a file that says otherwise is damaged."""
    if not present(directory / AGGREGATE):
        return {}
    path = directory / AGGREGATE
    raw = path.read_bytes()
    found = msgpack_leaves(read_msgpack_bytes(raw, str(path)), str(path), len(raw))
    out: dict[str, Any] = {}
    for name, value in found.items():
        if isinstance(value, str) and value.startswith(PLACEHOLDER_PREFIX):
            continue
        saved = leaves.get(name)
        if saved is None:
            continue  # not a leaf of the tree _METADATA describes: never returned
        if not _fits(saved.value_type, value):
            raise CorruptCheckpointError(
                f"{path} holds a {type(value).__name__} for the leaf {name!r}, which "
                f"{directory / TREE_METADATA} records as {saved.raw_value_type!r}; the "
                "checkpoint is damaged. Load an earlier checkpoint."
            )
        out[name] = value
    return out


def _fits(value_type: ValueType, value: Any) -> bool:
    """``value`` (as the msgpack file holds it) is of the kind ``value_type`` says."""
    if value_type is ValueType.SCALAR:
        return isinstance(value, int | float | complex | np.generic) or (
            isinstance(value, np.ndarray) and value.ndim == 0
        )
    if value_type is ValueType.STRING:
        return isinstance(value, str)
    if value_type in (ValueType.NP_ARRAY, ValueType.JAX_ARRAY):
        return isinstance(value, np.ndarray | np.generic | int | float | complex)
    if value_type.is_empty:
        return value is None or (isinstance(value, dict | list) and not value)
    return value_type is ValueType.UNKNOWN


def _key_impls_of_array_metadatas(directory: StoragePath, arrays: list[str]) -> dict[str, str]:
    """Typed-key implementations recorded in ``array_metadatas/process_<i>`` (``ext_metadata``),
    reading process files only until every array was seen (Orbax lists every array in each,
    milepost every array once in ``process_0``)."""
    folder = directory / ARRAY_METADATAS
    if not arrays or not folder.is_dir():
        return {}
    out: dict[str, str] = {}
    unseen = set(arrays)
    files: list[StoragePath] = sorted(folder.glob("process_*"), key=lambda p: (len(p.name), p.name))
    for path in files:
        for entry in read_json_object(path, "array metadata").get("array_metadatas", []):
            meta = entry["array_metadata"]
            unseen.discard(meta["param_name"])
            impl = (meta.get("ext_metadata") or {}).get("random_key_impl")
            if impl is not None:
                out[str(meta["param_name"])] = str(impl)
        if not unseen:
            break
    return out
