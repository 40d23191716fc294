"""Jobs a host runs for the controller besides saving and loading: each takes a small plan and
returns a small ack, never array bytes. A host group runs one by name on every host
(``HostGroup.run``); a new kind of work registers here instead of adding a method to every
host group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from milepost.workers import _copy, _engine, _export, _iostats, _preview

JOBS: dict[str, Callable[[Any, int | str], Any]] = {
    "verify": _engine.verify,
    "export_safetensors": _export.export_safetensors,
    "copy_files": _copy.copy_files,
    "read_box": _preview.read_box,
    "io_stats": _iostats.io_stats,
}


def run_job(job: str, plan: Any, process_index: int | str) -> Any:
    try:
        fn = JOBS[job]
    except KeyError:
        raise ValueError(f"no host job {job!r} (known: {sorted(JOBS)})") from None
    return fn(plan, process_index)
