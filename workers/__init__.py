"""milepost.workers: what runs inside a host process, and what every layer shares.

The host engine (``start_save``, ``load``, the host jobs), the small frozen messages a
controller sends it and the acks it returns; under it the foundations the other layers use
too: errors about a checkpoint's contents, storage paths, the runtime that owns every thread,
argument checks, progress counting, byte counters and text views. The on-disk format is the
package ``milepost.workers.format``, which the engine and the controller both use.

This package imports neither ``milepost`` (the controller) nor ``milepost.colocated``.
"""

from milepost.workers import _check as check
from milepost.workers import _declared as declared
from milepost.workers import _progress as progress
from milepost.workers._errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    HostMemoryError,
    LostWriteError,
    MissingDevicesError,
    StillWritingError,
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
from milepost.workers._paths import (
    NO_VALUE,
    STORAGE_ENV_VARS,
    ObjectPath,
    StoragePath,
    UnknownStorageError,
    as_path,
    context_for,
    fresh_reads,
    in_object_store,
    is_local,
    kvstore,
    reading_once,
    storage_environment,
)
from milepost.workers._pending import Done, PendingWrite, settle_all
from milepost.workers._requests import StorageOptions, configure_storage
from milepost.workers._requests import budget_secs as storage_budget_secs
from milepost.workers._runtime import RUNTIME, Pool, Runtime
from milepost.workers._sharding import ShardingSpec
from milepost.workers._staging_budget import AdaptiveStagingBudget
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
    "JOBS",
    "LOGGERS",
    "MAX_HTML_ROWS",
    "NO_VALUE",
    "RUNTIME",
    "STORAGE_ENV_VARS",
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
    "UnknownStorageError",
    "VerifyAck",
    "VerifyPlan",
    "VerifyTask",
    "WrittenArray",
    "as_path",
    "check",
    "configure_storage",
    "context_for",
    "declared",
    "dtype_name",
    "dtype_of",
    "fresh_reads",
    "from_printable",
    "html_fields",
    "html_table",
    "html_text",
    "human_bytes",
    "in_object_store",
    "io_snapshot",
    "is_key",
    "is_local",
    "key_impl_name",
    "key_words",
    "kvstore",
    "load",
    "parallel_copy",
    "printable",
    "progress",
    "reading_once",
    "run_job",
    "settle_all",
    "shape_str",
    "sharding_str",
    "start_save",
    "storage_budget_secs",
    "storage_environment",
    "verify",
]
