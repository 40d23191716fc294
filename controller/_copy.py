"""``milepost.copy``: copy a committed checkpoint to another place, committed there as a save
would be (the Checkpointer's mirror from its local tier to durable storage uses it).

The controller lists the source once and plans; each host copies the files it wrote (its own
``ocdbt.process_<i>`` databases), storage to storage, and the controller copies the rest (the
metadata, the merged manifest, its own leaves' database). The target is written through the
same workspace as a save (a locked temporary directory renamed into place, or in place under a
lease on object stores), and its commit marker is written last: a copy cut short is never a
checkpoint at the target.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from milepost import _hosts, _options, _storage, workers
from milepost._errors import CorruptCheckpointError
from milepost.colocated import HostGroup, Slice
from milepost.workers import ObjectPath, StoragePath, as_path, check, is_local
from milepost.workers import format as fmt


@dataclass(frozen=True)
class CopyReport:
    """What :func:`copy` did: the committed target, and the files and bytes each host copied."""

    path: StoragePath
    """The committed copy."""
    files: int
    """Files copied."""
    bytes_copied: int
    """Bytes copied, in all."""
    by_host: dict[str, int]
    """Bytes copied by each host ('controller': by the controller itself)."""


def copy(
    source: str | os.PathLike[str] | ObjectPath,
    target: str | os.PathLike[str] | ObjectPath,
    *,
    overwrite: bool = False,
    slice: Slice | None = None,
    timeout_secs: float | None = None,
) -> CopyReport:
    """Copy the committed checkpoint at ``source`` to ``target`` (local folders, ``gs://``,
    ``s3://``), which is committed like a save: whole or not at all. Each host copies the files
    it wrote (``slice``: a :class:`milepost.Slice` whose hosts copy; default: this process, or
    every process of a multi-controller job), so array bytes never pass through the controller.

    >>> milepost.copy("/local_ssd/ckpt/100", "gs://bucket/run/100")
    """
    check.flag(overwrite, "overwrite")
    if timeout_secs is not None:
        _options.AsyncOptions(timeout_secs=timeout_secs)  # the same checks, the same errors
    timeout = (
        float(timeout_secs) if timeout_secs is not None else _options.current().async_.timeout_secs
    )
    group = slice.group if slice is not None else _hosts.host_group_for([])
    return copy_with(
        group, source, target, overwrite=overwrite, timeout=timeout, options=_options.current()
    )


def copy_with(
    group: HostGroup,
    source: str | os.PathLike[str] | ObjectPath,
    target: str | os.PathLike[str] | ObjectPath,
    *,
    overwrite: bool,
    timeout: float,
    options: _options.Options,
    wait_for_writer_secs: float | None = None,
) -> CopyReport:
    """:func:`copy` by the hosts of ``group``, with ``options`` (snapshotted by the caller);
    ``wait_for_writer_secs`` (default: the options') for another writer of ``target`` to finish
    or (its lease) expire."""
    src, dst = as_path(source), as_path(target)
    _hosts.check_storage(_hosts.check_storage(group, src), dst)
    if str(src) == str(dst):
        raise ValueError(f"cannot copy {src} onto itself; name another target")
    names, items = _hosts.shared(group, f"copy-plan:{dst}", lambda: _list(src), timeout)
    saving = options.saving
    wait = saving.wait_for_writer_secs if wait_for_writer_secs is None else wait_for_writer_secs
    workspace = _storage.for_path(dst, overwrite, wait, saving.lease_secs)

    def prepare() -> None:
        workspace.prepare(items)

    _hosts.shared(group, f"copy-prepare:{dst}", prepare, timeout)
    try:
        by_host: dict[Any, list[str]] = {}
        for name in names:
            by_host.setdefault(_writer_of(name, group.processes()), []).append(name)
        plans = {
            host: workers.CopyPlan(
                source=str(src), target=str(workspace.dir), names=tuple(files), timeout_secs=timeout
            )
            for host, files in by_host.items()
        }
        own = plans.pop(_hosts.CONTROLLER, None)
        acks = list(group.run("copy_files", plans, timeout)) if plans else []

        def commit() -> None:
            if own is not None:
                acks.extend(
                    _hosts.controller_host().run("copy_files", {_hosts.CONTROLLER: own}, timeout)
                )
            workspace.check()
            fmt.write_file(
                workspace.dir / fmt.COMMIT_MARKER, f"Checkpoint commit was successful to {dst}"
            )
            workspace.publish()

        _hosts.shared(group, f"copy-commit:{dst}", commit, timeout)
    except BaseException:
        if group.is_primary():
            workspace.abandon()
        raise
    copied = {str(a.process_index): a.bytes_copied for a in acks}
    return CopyReport(
        path=dst,
        files=sum(a.files for a in acks),
        bytes_copied=sum(copied.values()),
        by_host=copied,
    )


def _list(src: StoragePath) -> tuple[list[str], list[str]]:
    """The files of the committed checkpoint ``src`` but its commit marker (relative names), and
    its checkpointable folders."""
    fmt.require_checkpoint(src)
    if is_local(src):  # (refusing symlinks, which object stores do not have)
        names: list[str] = []
        for dirpath, dirnames, filenames in os.walk(src):
            for entry in dirnames + filenames:
                if os.path.islink(os.path.join(dirpath, entry)):
                    raise CorruptCheckpointError(
                        f"{os.path.join(dirpath, entry)} is a symbolic link; a checkpoint holds "
                        "only files and folders, so it is not copied"
                    )
            names.extend(Path(dirpath, f).relative_to(src).as_posix() for f in filenames)
    else:
        names = src.keys()
    files = sorted(n for n in names if n != fmt.COMMIT_MARKER)
    items = sorted({n.split("/", 1)[0] for n in files if "/" in n})
    return files, items


def _writer_of(name: str, hosts: Any) -> Any:
    """The host that wrote ``name``: the one whose database folder holds it, else the controller."""
    parts = name.split("/")
    if len(parts) > 2 and parts[1].startswith(fmt.PROCESS_PREFIX):
        index = parts[1][len(fmt.PROCESS_PREFIX) :].split(".", 1)[0]
        if index.isdigit() and int(index) in hosts:
            return int(index)
    return _hosts.CONTROLLER
