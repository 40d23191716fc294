"""The host jobs by name (:data:`JOBS`), and :func:`run_job`, which a host group calls on every
host (``HostGroup.run``): a new kind of work registers here instead of adding a method to every
host group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from milepost.workers import _iostats
from milepost.workers.jobs._copy import copy_files
from milepost.workers.jobs._export import export_safetensors
from milepost.workers.jobs._preview import read_box
from milepost.workers.jobs._verify import verify

JOBS: dict[str, Callable[[Any, int | str], Any]] = {
    "verify": verify,
    "export_safetensors": export_safetensors,
    "copy_files": copy_files,
    "read_box": read_box,
    "io_stats": _iostats.io_stats,
}


def run_job(job: str, plan: Any, process_index: int | str) -> Any:
    """Run the host job ``job`` (a name in :data:`JOBS`) on ``plan`` as this host; an unknown
    name is a ValueError naming the known ones."""
    try:
        fn = JOBS[job]
    except KeyError:
        raise ValueError(f"no host job {job!r} (known: {sorted(JOBS)})") from None
    return fn(plan, process_index)
