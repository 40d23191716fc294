"""milepost.workers: what runs inside a host process, and what every layer shares.

The host engine (``start_save``, ``load``, the host jobs), the small frozen messages a
controller sends it and the acks it returns; under it the foundations the other layers use
too: errors about a checkpoint's contents, storage paths, TensorStore specs, the runtime that
owns every thread, argument checks, progress counting, byte counters and text views.

This package imports neither ``milepost`` (the controller) nor ``milepost.colocated``.
"""

from milepost.workers import _check as check
from milepost.workers import _declared as declared
from milepost.workers import _progress as progress
from milepost.workers._checksum import crc32c, grid_indices, grid_key, parse_grid_key
from milepost.workers._chunk_tables import FORMAT as CHUNK_TABLES_FORMAT
from milepost.workers._chunk_tables import TABLE_PREFIX as CHUNK_TABLE_PREFIX
from milepost.workers._chunk_tables import decode as decode_chunk_table
from milepost.workers._chunk_tables import encode as encode_chunk_table
from milepost.workers._chunk_tables import present as has_chunk_tables
from milepost.workers._confirm import confirm_files
from milepost.workers._errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    HostMemoryError,
    LostWriteError,
    MissingDevicesError,
    StillWritingError,
    from_tensorstore,
)
from milepost.workers._iostats import HostIoStats
from milepost.workers._iostats import snapshot as io_snapshot
from milepost.workers._keys import dtype_name, dtype_of, is_key, key_words
from milepost.workers._keys import impl_name as key_impl_name
from milepost.workers._memory import parallel_copy
from milepost.workers._messages import (
    ArraySpec,
    Index,
    LoadAck,
    LoadPlan,
    LoadTask,
    Region,
    SaveAck,
    SavePlan,
    SaveTask,
    StoreSpec,
    VerifyAck,
    VerifyPlan,
    VerifyTask,
    WrittenArray,
)
from milepost.workers._msgpack import flat_leaves as msgpack_leaves
from milepost.workers._msgpack import is_msgpack_tree
from milepost.workers._msgpack import read_leaves as read_msgpack_leaves
from milepost.workers._msgpack import read_tree as read_msgpack
from milepost.workers._msgpack import read_tree_bytes as read_msgpack_bytes
from milepost.workers._paths import (
    NO_VALUE,
    STORAGE_ENV_VARS,
    ObjectPath,
    StoragePath,
    UnknownStorageError,
    as_path,
    context_for,
    fresh_reads,
    is_local,
    kvstore,
    reading_once,
    storage_environment,
)
from milepost.workers._pending import Done, PendingWrite, settle_all
from milepost.workers._requests import StorageOptions, configure_storage
from milepost.workers._requests import budget_secs as storage_budget_secs
from milepost.workers._runtime import RUNTIME, Pool, Runtime
from milepost.workers._safetensors import CODES as SAFETENSORS_CODES
from milepost.workers._safetensors import INDEX_FILE as SAFETENSORS_INDEX
from milepost.workers._safetensors import Tensor, numpy_dtype
from milepost.workers._safetensors import header_bytes as safetensors_header
from milepost.workers._safetensors import read_header as read_safetensors_header
from milepost.workers._sharding import ShardingSpec
from milepost.workers._staging_budget import AdaptiveStagingBudget
from milepost.workers._tensorstore import (
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
from milepost.workers._views import (
    LOGGERS,
    MAX_HTML_ROWS,
    PrintableLogs,
    from_printable,
    html_fields,
    html_table,
    html_text,
    human_bytes,
    printable,
    shape_str,
    sharding_str,
)
from milepost.workers.jobs import (
    JOBS,
    BoxPlan,
    CopyAck,
    CopyPlan,
    ExportAck,
    ExportFile,
    ExportPlan,
    run_job,
    verify,
)
from milepost.workers.load import load
from milepost.workers.save import PendingSave, start_save

__all__ = [
    "CHUNK_TABLES_FORMAT",
    "CHUNK_TABLE_PREFIX",
    "JOBS",
    "LOGGERS",
    "MAX_HTML_ROWS",
    "NO_VALUE",
    "PROCESS_PREFIX",
    "RUNTIME",
    "SAFETENSORS_CODES",
    "SAFETENSORS_INDEX",
    "STORAGE_ENV_VARS",
    "ZARR3_DTYPES",
    "AdaptiveStagingBudget",
    "ArraySpec",
    "BoxPlan",
    "CheckpointNotFoundError",
    "CopyAck",
    "CopyPlan",
    "CorruptCheckpointError",
    "Done",
    "ExportAck",
    "ExportFile",
    "ExportPlan",
    "HostIoStats",
    "HostMemoryError",
    "Index",
    "LoadAck",
    "LoadPlan",
    "LoadTask",
    "LostWriteError",
    "MissingDevicesError",
    "ObjectPath",
    "PendingSave",
    "PendingWrite",
    "Pool",
    "PrintableLogs",
    "Region",
    "Runtime",
    "SaveAck",
    "SavePlan",
    "SaveTask",
    "ShardingSpec",
    "StillWritingError",
    "StorageOptions",
    "StoragePath",
    "StoreSpec",
    "Tensor",
    "UnknownStorageError",
    "VerifyAck",
    "VerifyPlan",
    "VerifyTask",
    "WrittenArray",
    "as_path",
    "check",
    "configure_storage",
    "confirm_files",
    "context_for",
    "crc32c",
    "declared",
    "decode_chunk_table",
    "dtype_name",
    "dtype_of",
    "encode_chunk_table",
    "fresh_reads",
    "from_printable",
    "from_tensorstore",
    "grid_indices",
    "grid_key",
    "has_chunk_tables",
    "header_chunks",
    "header_dtype_name",
    "header_key",
    "header_shape",
    "html_fields",
    "html_table",
    "html_text",
    "human_bytes",
    "io_snapshot",
    "is_key",
    "is_local",
    "is_msgpack_tree",
    "key_impl_name",
    "key_words",
    "kvstore",
    "load",
    "merge_ocdbt",
    "msgpack_leaves",
    "new_context",
    "numpy_dtype",
    "ocdbt_kvstore",
    "parallel_copy",
    "parse_grid_key",
    "printable",
    "process_dir_name",
    "progress",
    "read_array_headers",
    "read_kvstore",
    "read_msgpack",
    "read_msgpack_bytes",
    "read_msgpack_leaves",
    "read_safetensors_header",
    "reading_once",
    "run_job",
    "safetensors_header",
    "settle_all",
    "shape_str",
    "sharding_str",
    "start_save",
    "storage_budget_secs",
    "storage_environment",
    "verify",
]
