"""Jobs a host runs for the controller besides saving and loading: each takes a small plan and
returns a small ack, never array bytes. A host group runs one by name on every host
(``HostGroup.run``); a new kind of work registers here instead of adding a method to every
host group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from milepost.workers import _iostats
from milepost.workers.jobs._copy import CopyAck, CopyPlan, copy_files
from milepost.workers.jobs._export import ExportAck, ExportFile, ExportPlan, export_safetensors
from milepost.workers.jobs._preview import BoxPlan, read_box
from milepost.workers.jobs._verify import verify

JOBS: dict[str, Callable[[Any, int | str], Any]] = {
    "verify": verify,
    "export_safetensors": export_safetensors,
    "copy_files": copy_files,
    "read_box": read_box,
    "io_stats": _iostats.io_stats,
}


def run_job(job: str, plan: Any, process_index: int | str) -> Any:
    try:
        fn = JOBS[job]
    except KeyError:
        raise ValueError(f"no host job {job!r} (known: {sorted(JOBS)})") from None
    return fn(plan, process_index)


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
