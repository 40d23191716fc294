"""milepost: checkpoints for JAX from a single controller, Ray worker hosts, or every process.

>>> import milepost as mp
>>> mp.save("/ckpt/100", state)
>>> restored = mp.load("/ckpt/100", abstract_state)
"""

from milepost import safetensors, training
from milepost._api import (
    load,
    load_async,
    load_checkpointables,
    load_checkpointables_async,
    metadata,
    save,
    save_async,
    save_checkpointables,
    save_checkpointables_async,
)
from milepost._checkpoint import (
    CheckpointableHandler,
    CheckpointMetadata,
    DataIterator,
    DataIteratorHandler,
    JsonHandler,
    LeafMetadata,
    LoadHandle,
    PyTreeHandler,
    SaveHandle,
    StatefulCheckpointable,
    register_handler,
    wait_for_saves,
)
from milepost._copy import CopyReport, copy
from milepost._errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointReplacedError,
    CorruptCheckpointError,
    HostError,
    HostMemoryError,
    InvalidKeyError,
    LostWriteError,
    MissingDevicesError,
    RayNotInstalledError,
    SaveInProgressError,
    StructureMismatchError,
    TemporaryDirectoryRemovedError,
    UnsupportedLeafError,
)
from milepost._iostats import HostIoStats, IoStats, io_stats
from milepost._options import AsyncOptions, Context, LoadOptions, ProgressOptions, SaveOptions
from milepost._tree import PLACEHOLDER
from milepost._verify import VerifyReport, verify
from milepost.colocated import AbstractArray, RemoteArray, Slice, SliceOptions
from milepost.workers import PendingWrite, ShardingSpec, StorageOptions, configure_storage

__all__ = [
    "PLACEHOLDER",
    "AbstractArray",
    "AsyncOptions",
    "CheckpointExistsError",
    "CheckpointMetadata",
    "CheckpointNotFoundError",
    "CheckpointReplacedError",
    "CheckpointableHandler",
    "Context",
    "CopyReport",
    "CorruptCheckpointError",
    "DataIterator",
    "DataIteratorHandler",
    "HostError",
    "HostIoStats",
    "HostMemoryError",
    "InvalidKeyError",
    "IoStats",
    "JsonHandler",
    "LeafMetadata",
    "LoadHandle",
    "LoadOptions",
    "LostWriteError",
    "MissingDevicesError",
    "PendingWrite",
    "ProgressOptions",
    "PyTreeHandler",
    "RayNotInstalledError",
    "RemoteArray",
    "SaveHandle",
    "SaveInProgressError",
    "SaveOptions",
    "ShardingSpec",
    "Slice",
    "SliceOptions",
    "StatefulCheckpointable",
    "StorageOptions",
    "StructureMismatchError",
    "TemporaryDirectoryRemovedError",
    "UnsupportedLeafError",
    "VerifyReport",
    "configure_storage",
    "copy",
    "io_stats",
    "load",
    "load_async",
    "load_checkpointables",
    "load_checkpointables_async",
    "metadata",
    "register_handler",
    "safetensors",
    "save",
    "save_async",
    "save_checkpointables",
    "save_checkpointables_async",
    "training",
    "verify",
    "wait_for_saves",
]
