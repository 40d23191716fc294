"""milepost.workers.format: the on-disk format, in one package.

What a checkpoint's files are and how they are encoded, for the hosts that write and read array
data and for the controller that writes and reads the rest: the files of a checkpoint (Orbax
v1's names) and what a folder holds whoever wrote it (milepost, Orbax v1 or v0: ``_layout``),
a pytree's format files (``_pytree``, ``_shardings``, ``_values``), the checksums of the files
that are not array data (``_file_checksums``) and of every chunk (``_checksum``, the writers'
tables in ``_chunk_tables``), OCDBT as milepost reads and writes it (``_ocdbt_*``), every
TensorStore spec (``_tensorstore``) and what milepost relies on of TensorStore beyond its API
(``_ts_internals``, ``_ts_errors``), the data files a save wrote confirmed (``_confirm``), and
the foreign codecs milepost reads (``_safetensors``, ``_msgpack``).

It builds on the engine's foundations (errors, paths, the runtime, messages) and on nothing of
the engine's save, load, jobs or peers, which use it.
"""

from milepost.workers.format import _checksum as chunk_checksums
from milepost.workers.format import _chunk_tables as chunk_tables
from milepost.workers.format import _safetensors as safetensors_format
from milepost.workers.format import _tensorstore as specs
from milepost.workers.format._checksum import Grid, crc32c, grid_indices, grid_key, parse_grid_key
from milepost.workers.format._chunk_tables import FORMAT as CHUNK_TABLES_FORMAT
from milepost.workers.format._chunk_tables import TABLE_PREFIX as CHUNK_TABLE_PREFIX
from milepost.workers.format._chunk_tables import ChunkTables, shard_key
from milepost.workers.format._chunk_tables import decode as decode_chunk_table
from milepost.workers.format._chunk_tables import encode as encode_chunk_table
from milepost.workers.format._chunk_tables import present as has_chunk_tables
from milepost.workers.format._confirm import confirm_files, lost_write, root_sizes
from milepost.workers.format._file_checksums import (
    Checksums,
    check_contained,
    parse_json,
    present,
    read_checked,
    read_json,
    read_json_object,
    verified,
    verifying,
)
from milepost.workers.format._files import (
    AGGREGATE,
    ARRAY_METADATAS,
    CHECKPOINT_METADATA,
    CHECKSUMS,
    COMMIT_MARKER,
    GRAIN_HANDLER_TYPESTR,
    JSON_HANDLER_TYPESTR,
    MILEPOST_INFO,
    OCDBT_MANIFEST,
    ORBAX_MARKER,
    OWNER_FILE,
    PYTREE_HANDLER_TYPESTR,
    SHARDING,
    STATEFUL_HANDLER_TYPESTR,
    STRINGS,
    TMP_SUFFIX,
    TREE_METADATA,
    data_state_file,
    fsync_dir,
    fsync_tree,
    is_temporary_name,
    write_file,
    write_json,
)
from milepost.workers.format._layout import (
    DEFAULT_ITEM,
    JSON_HANDLERS,
    PYTREE_HANDLERS,
    Item,
    checkpointables,
    is_committed,
    is_committed_by_own_files,
    is_foreign_unfinished,
    listed_items,
    main_tree,
    read_checkpoint_metadata,
    require_checkpoint,
    unsafe_item_name,
    writer_of,
)
from milepost.workers.format._msgpack import flat_leaves as msgpack_leaves
from milepost.workers.format._msgpack import is_msgpack_tree
from milepost.workers.format._msgpack import read_leaves as read_msgpack_leaves
from milepost.workers.format._msgpack import read_tree as read_msgpack
from milepost.workers.format._msgpack import read_tree_bytes as read_msgpack_bytes
from milepost.workers.format._ocdbt_format import note_fallback
from milepost.workers.format._ocdbt_index import Prefixes, Values, find_values, parse_value
from milepost.workers.format._ocdbt_merge import write_database
from milepost.workers.format._pytree import Keys, SavedLeaf, TreeFiles, read_tree, write_tree
from milepost.workers.format._safetensors import CODES as SAFETENSORS_CODES
from milepost.workers.format._safetensors import INDEX_FILE as SAFETENSORS_INDEX
from milepost.workers.format._safetensors import Tensor, numpy_dtype
from milepost.workers.format._safetensors import header_bytes as safetensors_header
from milepost.workers.format._safetensors import read_header as read_safetensors_header
from milepost.workers.format._tensorstore import (
    PROCESS_PREFIX,
    ZARR3_DTYPES,
    header_chunks,
    header_dtype_name,
    header_key,
    header_shape,
    merge_ocdbt,
    new_context,
    ocdbt_kvstore,
    process_dir_name,
    read_array_headers,
    read_kvstore,
)
from milepost.workers.format._ts_errors import from_tensorstore
from milepost.workers.format._ts_internals import (
    FileRange,
    index_entries,
    index_size,
    ocdbt_values,
    unread_file,
    value_range,
)
from milepost.workers.format._values import KEY_DICT, KEY_SEQUENCE, ValueType, unsafe_part

__all__ = [
    "AGGREGATE",
    "ARRAY_METADATAS",
    "CHECKPOINT_METADATA",
    "CHECKSUMS",
    "CHUNK_TABLES_FORMAT",
    "CHUNK_TABLE_PREFIX",
    "COMMIT_MARKER",
    "DEFAULT_ITEM",
    "GRAIN_HANDLER_TYPESTR",
    "JSON_HANDLERS",
    "JSON_HANDLER_TYPESTR",
    "KEY_DICT",
    "KEY_SEQUENCE",
    "MILEPOST_INFO",
    "OCDBT_MANIFEST",
    "ORBAX_MARKER",
    "OWNER_FILE",
    "PROCESS_PREFIX",
    "PYTREE_HANDLERS",
    "PYTREE_HANDLER_TYPESTR",
    "SAFETENSORS_CODES",
    "SAFETENSORS_INDEX",
    "SHARDING",
    "STATEFUL_HANDLER_TYPESTR",
    "STRINGS",
    "TMP_SUFFIX",
    "TREE_METADATA",
    "ZARR3_DTYPES",
    "Checksums",
    "ChunkTables",
    "FileRange",
    "Grid",
    "Item",
    "Keys",
    "Prefixes",
    "SavedLeaf",
    "Tensor",
    "TreeFiles",
    "ValueType",
    "Values",
    "check_contained",
    "checkpointables",
    "chunk_checksums",
    "chunk_tables",
    "confirm_files",
    "crc32c",
    "data_state_file",
    "decode_chunk_table",
    "encode_chunk_table",
    "find_values",
    "from_tensorstore",
    "fsync_dir",
    "fsync_tree",
    "grid_indices",
    "grid_key",
    "has_chunk_tables",
    "header_chunks",
    "header_dtype_name",
    "header_key",
    "header_shape",
    "index_entries",
    "index_size",
    "is_committed",
    "is_committed_by_own_files",
    "is_foreign_unfinished",
    "is_msgpack_tree",
    "is_temporary_name",
    "listed_items",
    "lost_write",
    "main_tree",
    "merge_ocdbt",
    "msgpack_leaves",
    "new_context",
    "note_fallback",
    "numpy_dtype",
    "ocdbt_kvstore",
    "ocdbt_values",
    "parse_grid_key",
    "parse_json",
    "parse_value",
    "present",
    "process_dir_name",
    "read_array_headers",
    "read_checked",
    "read_checkpoint_metadata",
    "read_json",
    "read_json_object",
    "read_kvstore",
    "read_msgpack",
    "read_msgpack_bytes",
    "read_msgpack_leaves",
    "read_safetensors_header",
    "read_tree",
    "require_checkpoint",
    "root_sizes",
    "safetensors_format",
    "safetensors_header",
    "shard_key",
    "specs",
    "unread_file",
    "unsafe_item_name",
    "unsafe_part",
    "value_range",
    "verified",
    "verifying",
    "write_database",
    "write_file",
    "write_json",
    "write_tree",
    "writer_of",
]
