"""Jobs a host runs for the controller besides saving and loading: each takes a small plan and
returns a small ack, never array bytes. A host group runs one by name on every host
(``HostGroup.run``); a new kind of work registers in ``_registry.py`` instead of adding a method
to every host group."""

from __future__ import annotations

from milepost.workers.jobs._copy import CopyAck, CopyPlan, copy_files
from milepost.workers.jobs._export import ExportAck, ExportFile, ExportPlan, export_safetensors
from milepost.workers.jobs._preview import BoxPlan, read_box
from milepost.workers.jobs._registry import JOBS, run_job
from milepost.workers.jobs._verify import verify

__all__ = [
    "JOBS",
    "BoxPlan",
    "CopyAck",
    "CopyPlan",
    "ExportAck",
    "ExportFile",
    "ExportPlan",
    "copy_files",
    "export_safetensors",
    "read_box",
    "run_job",
    "verify",
]
