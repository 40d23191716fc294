"""``milepost.verify``: check a whole checkpoint without loading it anywhere.

The controller checks the files (every file but array chunks against its recorded size and
CRC32C), the metadata (it parses, its names are safe, every array it lists has a header, every
string leaf is there, every chunk of every array has a recorded checksum) and hands each host a
share of the chunks, which the host reads and checks against their recorded checksums. Nothing
is raised for what is damaged: the report lists it.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from milepost import _checkpoint, _hosts, _options, _progress, workers
from milepost import _format as fmt
from milepost._errors import CheckpointNotFoundError
from milepost._tree import ValueType
from milepost.colocated import Slice
from milepost.workers import ObjectPath, as_path


@dataclass(frozen=True)
class VerifyReport:
    """What ``milepost.verify`` checked and what it found wrong; true when sound."""

    path: Path | ObjectPath
    problems: tuple[str, ...]
    files_checked: int = 0
    arrays_checked: int = 0
    chunks_checked: int = 0
    bytes_read: int = 0
    notes: tuple[str, ...] = field(default=())
    """What could not be checked, and why (e.g. no checksums recorded by the writer)."""

    @property
    def ok(self) -> bool:
        return not self.problems

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        head = (
            f"{self.path}: {'sound' if self.ok else f'{len(self.problems)} problem(s)'} — "
            f"{self.files_checked} files, {self.arrays_checked} arrays, {self.chunks_checked} "
            f"chunks ({self.bytes_read / 2**20:.1f} MiB) checked"
        )
        return "\n".join(
            [
                head,
                *(f"  problem: {p}" for p in self.problems),
                *(f"  note: {n}" for n in self.notes),
            ]
        )


@workers.reading_once()  # each small object of an object store read once per call
def verify(
    path: str | os.PathLike[str] | ObjectPath, *, slice: Slice | None = None
) -> VerifyReport:
    """Check the checkpoint at ``path`` whole: files, metadata and every chunk, spread over the
    hosts (``slice``: a :class:`milepost.Slice` whose hosts read; default: this process, or
    every process of a multi-controller job). Returns a :class:`VerifyReport`; raises only when
    ``path`` is not a checkpoint at all.

    >>> report = milepost.verify("/ckpt/100")
    >>> assert report.ok, report
    """
    options = _options.current()
    root = as_path(path)
    group = _hosts.check_storage(
        slice.group if slice is not None else _hosts.host_group_for([]), root
    )
    timeout = options.async_.timeout_secs
    with _progress.operation("verify", root, primary=group.is_primary()) as op:
        planned = _hosts.shared(
            group, f"verify-plan:{root}", lambda: _plan(root, group.processes(), options), timeout
        )
        op.expect(planned.nbytes)
        acks = group.run("verify", planned.plans, timeout) if planned.plans else []
    problems = [*planned.problems, *(p for ack in acks for p in ack.problems)]
    report = VerifyReport(
        path=root,
        problems=tuple(problems),
        files_checked=planned.files,
        arrays_checked=planned.arrays,
        chunks_checked=sum(a.chunks_checked for a in acks),
        bytes_read=sum(a.bytes_read for a in acks),
        notes=tuple(planned.notes),
    )
    return _hosts.shared(group, f"verify-report:{root}", lambda: report, timeout)


@dataclass
class _Planned:
    plans: dict[Any, workers.VerifyPlan] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    files: int = 0
    arrays: int = 0
    nbytes: int = 0
    """Bytes of every array's chunks (what the hosts read)."""


def _plan(root: Path | ObjectPath, processes: Any, options: _options.Options) -> _Planned:
    """On the primary: check files and metadata, and share out the chunks among ``processes``."""
    fmt.require_checkpoint(root)
    out = _Planned()
    try:
        fmt.check_contained(root)
    except ValueError as e:
        # Nothing more is read: the rest would read through a link out of the checkpoint, or
        # open a FIFO and wait forever.
        out.problems.append(str(e))
        return out

    try:
        checksums = fmt.Checksums.read(root)
    except ValueError as e:
        out.problems.append(str(e))
        checksums = None
    if checksums is None:
        out.notes.append(
            f"no {fmt.CHECKSUMS} (written by Orbax or an older "
            "milepost): files were checked for form only"
        )
    else:
        for name, (size, _) in sorted(checksums.files.items()):
            out.files += 1
            try:
                raw = (root / name).read_bytes()
            except OSError as e:
                out.problems.append(
                    f"{root / name} is listed in {fmt.CHECKSUMS} but cannot be read ({e})"
                )
                continue
            if not checksums.matches(name, raw):
                out.problems.append(
                    f"{root / name} is damaged or changed (size "
                    f"{len(raw)} vs {size}, or its checksums differ)"
                )
    # The files' checksums were checked above, each once: go on with what they hold, to check
    # the arrays too.
    try:
        meta = fmt.read_checkpoint_metadata(root)
        items = fmt.checkpointables(root, meta)
    except (ValueError, CheckpointNotFoundError) as e:
        out.problems.append(str(e))
        return out
    for item in items.values():
        if item.is_pytree:
            _plan_tree(item.folder, processes, options, out)
    return out


def _plan_tree(
    directory: Path | ObjectPath, processes: Any, options: _options.Options, out: _Planned
) -> None:
    try:
        files = fmt.read_tree(directory)
        arrays = [  # (what Orbax kept in its msgpack file was read, and is sound, already)
            n
            for n, leaf in files.leaves.items()
            if leaf.value_type.is_array and n not in files.aggregated
        ]
        headers = _checkpoint.array_headers(directory, files, arrays)
    except (ValueError, CheckpointNotFoundError) as e:
        out.problems.append(str(e))
        return
    for name, leaf in files.leaves.items():
        if (
            leaf.value_type is ValueType.STRING
            and name not in files.strings
            and name not in files.aggregated
        ):
            out.problems.append(f"string leaf {name!r} is missing from {directory / fmt.STRINGS}")
    unchecked: list[str] = []
    tasks: dict[Any, list[tuple[str, tuple[int, ...], int | None]]] = {p: [] for p in processes}
    turn = itertools.cycle(list(processes))
    for name in arrays:
        out.arrays += 1
        header = headers[name]
        try:
            shape = workers.header_shape(header)
            chunk, _ = workers.header_chunks(header)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            out.problems.append(f"the header of array {name!r} in {directory} is malformed ({e})")
            continue
        grid = [
            tuple(g)
            for g in itertools.product(
                *(range(math.ceil(n / c)) for n, c in zip(shape, chunk, strict=True))
            )
        ]
        with contextlib.suppress(KeyError, TypeError, ValueError):
            out.nbytes += math.prod(shape) * _checkpoint.header_shape_dtype(header)[1].itemsize
        if math.prod(shape) == 0:
            grid = []
        recorded = files.chunk_crc32c.get(name)
        if recorded is None:
            if not files.chunk_tables:  # (else the hosts check each against its writer's table)
                unchecked.append(name)
        elif not files.chunk_tables:  # (with the tables it records only inline chunks)
            missing = [g for g in grid if g not in recorded]
            if missing:
                out.problems.append(
                    f"array {name!r}: {len(missing)} of its {len(grid)} chunks have no "
                    f"recorded checksum (first: {missing[0]}); the checkpoint's "
                    f"{fmt.MILEPOST_INFO} is damaged or incomplete"
                )
        for g in grid:  # round robin, so every host reads about the same
            tasks[next(turn)].append((name, g, recorded.get(g) if recorded is not None else None))
    if unchecked:
        out.notes.append(
            f"{len(unchecked)} array(s) in {directory.name} have no recorded chunk "
            f"checksums (written by Orbax or an older milepost; e.g. {unchecked[0]!r}): "
            "their chunks were read but cannot be verified"
        )
    store = files.store(directory)
    for process, entries in tasks.items():
        by_array: dict[str, list[tuple[tuple[int, ...], int | None]]] = {}
        for name, g, crc in entries:
            by_array.setdefault(name, []).append((g, crc))
        mine = tuple(
            workers.VerifyTask(
                store=store,
                name=name,
                chunks=tuple(g for g, _ in chunks),
                expected=None
                if files.chunk_crc32c.get(name) is None
                else tuple((g, c) for g, c in chunks if c is not None),
                fill_missing=files.fill_missing,
                chunk_tables=files.chunk_tables,
            )
            for name, chunks in by_array.items()
        )
        previous = out.plans.get(process)
        out.plans[process] = workers.VerifyPlan(
            tasks=(previous.tasks if previous is not None else ()) + mine,
            memory_budget_bytes=options.loading.memory_budget_bytes,
        )
