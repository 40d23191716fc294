"""Host job: copy files of a checkpoint from one place to another (a local tier to durable
storage, a bucket to a local disk), each host the files the controller assigned to it (the
ones it wrote). Bytes go from storage to storage through the host; never to the controller.

Local to local is a kernel copy (``copy_file_range``/``sendfile`` under ``shutil.copyfile``),
fsynced; anything involving an object store goes through TensorStore's kvstores, a few files at
a time, each read whole and written whole (one request each way).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from milepost.workers._errors import CorruptCheckpointError
from milepost.workers._iostats import count_read, count_write
from milepost.workers._paths import StoragePath, as_path, context_for, is_local, kvstore
from milepost.workers._runtime import RUNTIME

COPY_THREADS = 4
"""Files copied at once per host: enough to overlap requests to an object store, few enough
that at most this many files are held in memory."""


@dataclass(frozen=True, kw_only=True)
class CopyPlan:
    source: str
    """A folder (a path or URL)."""
    target: str
    names: tuple[str, ...]
    """Files relative to ``source``, '/'-separated; each written to the same name under
    ``target``."""
    timeout_secs: float
    """The copy stops (TimeoutError) once this long has passed; files in progress finish."""


@dataclass(frozen=True, kw_only=True)
class CopyAck:
    process_index: int | str
    files: int
    bytes_copied: int


def copy_files(plan: CopyPlan, process_index: int | str = 0) -> CopyAck:
    source, target = as_path(plan.source), as_path(plan.target)
    deadline = time.monotonic() + plan.timeout_secs
    if is_local(source) and is_local(target):
        copy_one = _local_copier(source, target)
    else:
        copy_one = _kvstore_copier(source, target)

    for name in plan.names:
        parts = name.split("/")
        if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ValueError(
                f"cannot copy {name!r}: a file of a checkpoint is a relative path without '..'"
            )

    def run(name: str) -> int:
        _behind()
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"host {process_index} did not finish copying {plan.source} to {plan.target} "
                f"within {plan.timeout_secs:g}s (stopped before {name})"
            )
        return copy_one(name)

    with RUNTIME.scoped("copy-files", COPY_THREADS) as pool:
        sizes = pool.map(run, plan.names)
    return CopyAck(process_index=process_index, files=len(sizes), bytes_copied=sum(sizes))


def _behind() -> None:
    """Copies run behind the work that waits (a training step's save, its loads): the copying
    threads (this call's own) get the lowest CPU priority, and with it the lowest I/O priority
    of their class."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def _local_copier(source: Path, target: Path) -> Any:
    def copy(name: str) -> int:
        src, dst = os.path.join(source, name), os.path.join(target, name)
        if os.path.islink(src):
            raise CorruptCheckpointError(
                f"{src} is a symbolic link; a checkpoint holds only files, so it is not copied"
            )
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copyfile(src, dst)
        with open(dst, "rb") as f:
            os.fsync(f.fileno())
        size = os.path.getsize(dst)
        count_read(size)
        count_write(size)
        return size

    return copy


def _kvstore_copier(source: StoragePath, target: StoragePath) -> Any:
    import tensorstore as ts

    src = ts.KvStore.open(kvstore(source), context=context_for(source)).result()
    dst = ts.KvStore.open(kvstore(target), context=context_for(target)).result()

    def copy(name: str) -> int:
        got = src.read(name).result()
        if got.state != "value":
            raise FileNotFoundError(
                f"{source / name} disappeared while it was being copied to {target / name}"
            )
        value = bytes(got.value)
        dst.write(name, value).result()
        return len(value)

    return copy
