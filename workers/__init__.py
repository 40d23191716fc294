"""milepost.workers: the per-host engine and the messages it accepts.

This package runs inside host processes; it imports neither ``milepost`` (the controller) nor
``milepost.colocated``.
"""

from milepost.workers._checksum import crc32c, grid_key, parse_grid_key
from milepost.workers._copy import CopyAck, CopyPlan
from milepost.workers._engine import PendingSave, load, start_save, verify
from milepost.workers._errors import CheckpointNotFoundError, CorruptCheckpointError
from milepost.workers._export import ExportAck, ExportFile, ExportPlan
from milepost.workers._jobs import JOBS, run_job
from milepost.workers._keys import dtype_name, dtype_of, is_key, key_words
from milepost.workers._keys import impl_name as key_impl_name
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
from milepost.workers._pending import Done, PendingWrite, settle_all
from milepost.workers._preview import BoxPlan
from milepost.workers._safetensors import CODES as SAFETENSORS_CODES
from milepost.workers._safetensors import INDEX_FILE as SAFETENSORS_INDEX
from milepost.workers._safetensors import Tensor
from milepost.workers._safetensors import header_bytes as safetensors_header
from milepost.workers._safetensors import read_header as read_safetensors_header
from milepost.workers._sharding import ShardingSpec
from milepost.workers._storage import Location, UnknownStorageError
from milepost.workers._tensorstore import (
    PROCESS_PREFIX,
    ZARR3_DTYPES,
    header_chunks,
    header_dtype_name,
    header_key,
    header_shape,
    merge_ocdbt,
    process_dir_name,
    read_array_headers,
    read_kvstore,
)

__all__ = [
    "JOBS",
    "PROCESS_PREFIX",
    "SAFETENSORS_CODES",
    "SAFETENSORS_INDEX",
    "ZARR3_DTYPES",
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
    "Index",
    "LoadAck",
    "LoadPlan",
    "LoadTask",
    "Location",
    "PendingSave",
    "PendingWrite",
    "Region",
    "SaveAck",
    "SavePlan",
    "SaveTask",
    "ShardingSpec",
    "StoreSpec",
    "Tensor",
    "UnknownStorageError",
    "VerifyAck",
    "VerifyPlan",
    "VerifyTask",
    "WrittenArray",
    "crc32c",
    "dtype_name",
    "dtype_of",
    "grid_key",
    "header_chunks",
    "header_dtype_name",
    "header_key",
    "header_shape",
    "is_key",
    "key_impl_name",
    "key_words",
    "load",
    "merge_ocdbt",
    "parse_grid_key",
    "process_dir_name",
    "read_array_headers",
    "read_kvstore",
    "read_safetensors_header",
    "run_job",
    "safetensors_header",
    "settle_all",
    "start_save",
    "verify",
]
