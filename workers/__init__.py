"""milepost.workers: the per-host engine and the messages it accepts.

This package runs inside host processes; it imports neither ``milepost`` (the controller) nor
``milepost.colocated``.
"""

from milepost.workers._engine import PendingSave, load, start_save
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
)
from milepost.workers._sharding import ShardingSpec
from milepost.workers._tensorstore import (
    PROCESS_PREFIX,
    ZARR3_DTYPES,
    merge_kvstore,
    process_dir_name,
    read_kvstore,
)

__all__ = [
    "PROCESS_PREFIX",
    "ZARR3_DTYPES",
    "ArraySpec",
    "Index",
    "LoadAck",
    "LoadPlan",
    "LoadTask",
    "PendingSave",
    "Region",
    "SaveAck",
    "SavePlan",
    "SaveTask",
    "ShardingSpec",
    "StoreSpec",
    "load",
    "merge_kvstore",
    "process_dir_name",
    "read_kvstore",
    "start_save",
]
