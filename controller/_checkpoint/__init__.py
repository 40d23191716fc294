"""Whole checkpoints: saving (stage, wait, then commit in the background: ``_commit``), loading
and metadata, the checkpointable handlers, and the pytree checkpointable (its save plan and its
load plan)."""

from milepost._checkpoint._background import wait_for_saves
from milepost._checkpoint._calls import Deferred, LoadCall, SaveCall, WrittenTree
from milepost._checkpoint._data_iterator import DataIterator, DataIteratorHandler
from milepost._checkpoint._drop import delete_checkpointable, drop_checkpointable
from milepost._checkpoint._handlers import (
    CheckpointableHandler,
    JsonHandler,
    PyTreeHandler,
    StatefulCheckpointable,
    register_handler,
)
from milepost._checkpoint._load import (
    CheckpointMetadata,
    load_checkpointables,
    metadata,
    read_checkpointables,
    unchanged,
)
from milepost._checkpoint._load_async import LoadHandle, start_load
from milepost._checkpoint._planning import (
    device_boxes,
    sharding_spec,
)
from milepost._checkpoint._pytree_load import (
    LeafMetadata,
    array_headers,
    concrete_sharding,
    header_shape_dtype,
    read_tree_files,
    recorded_checksums,
    to_scalar,
    tree_metadata,
)
from milepost._checkpoint._pytree_save import (
    CONTROLLER,
    TreeSavePlan,
    plan_tree,
    stage_tree,
)
from milepost._checkpoint._replicas import mark as mark_replicas
from milepost._checkpoint._save import SaveHandle, all_leaves, saves_in_flight, start_save

__all__ = [
    "CONTROLLER",
    "CheckpointMetadata",
    "CheckpointableHandler",
    "DataIterator",
    "DataIteratorHandler",
    "Deferred",
    "JsonHandler",
    "LeafMetadata",
    "LoadCall",
    "LoadHandle",
    "PyTreeHandler",
    "SaveCall",
    "SaveHandle",
    "StatefulCheckpointable",
    "TreeSavePlan",
    "WrittenTree",
    "all_leaves",
    "array_headers",
    "concrete_sharding",
    "delete_checkpointable",
    "device_boxes",
    "drop_checkpointable",
    "header_shape_dtype",
    "load_checkpointables",
    "mark_replicas",
    "metadata",
    "plan_tree",
    "read_checkpointables",
    "read_tree_files",
    "recorded_checksums",
    "register_handler",
    "saves_in_flight",
    "sharding_spec",
    "stage_tree",
    "start_load",
    "start_save",
    "to_scalar",
    "tree_metadata",
    "unchanged",
    "wait_for_saves",
]
