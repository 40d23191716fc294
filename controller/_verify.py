"""``milepost.verify``: check a whole checkpoint without loading it anywhere.

The controller checks the files (every file but array chunks against its recorded size and
CRC32C), the metadata (it parses, its names are safe, every array it lists has a header, every
string leaf is there, every chunk of every array has a recorded checksum) and hands each host a
share of the chunks, which the host reads and checks against their recorded checksums. Nothing
is raised for what is damaged: the report lists it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

from milepost import _checkpoint, _hosts, _options, _progress, workers
from milepost._errors import CheckpointNotFoundError
from milepost._tree import ValueType
from milepost.colocated import Slice
from milepost.workers import ObjectPath, StoragePath, as_path
from milepost.workers import format as fmt


@dataclass(frozen=True)
class VerifyReport:
    """What ``milepost.verify`` checked and what it found wrong; true when sound."""

    path: StoragePath
    """The checkpoint checked."""
    problems: tuple[str, ...]
    """Each thing found wrong, one line each; empty when sound."""
    files_checked: int = 0
    """Files whose checksums were checked."""
    arrays_checked: int = 0
    """Arrays whose chunks were read and checked."""
    chunks_checked: int = 0
    """Chunks read and checked."""
    bytes_read: int = 0
    """Bytes read to check them."""
    notes: tuple[str, ...] = field(default=())
    """What could not be checked, and why (e.g. no checksums recorded by the writer)."""

    @property
    def ok(self) -> bool:
        """True when no problem was found (the report is true then, too)."""
        return not self.problems

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        head = (
            f"{self.path}: {'sound' if self.ok else f'{len(self.problems)} problem(s)'} — "
            f"{self.files_checked} files, {self.arrays_checked} arrays, {self.chunks_checked} "
            f"chunks ({self.bytes_read / 2**20:.1f} MiB) checked"
        )
        return "\n".join(  # one line each, escaped: problems name what a hostile file holds
            [
                workers.printable(head),
                *(f"  problem: {workers.printable(p)}" for p in self.problems),
                *(f"  note: {workers.printable(n)}" for n in self.notes),
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


def _plan(root: StoragePath, processes: Any, options: _options.Options) -> _Planned:
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


SHARED_BYTES = 64 << 20
"""An array of at least this many bytes is checked by every host, each a share of its stored
shards; a smaller one by one host (the one given the fewest bytes so far)."""


def _plan_tree(
    directory: StoragePath, processes: Any, options: _options.Options, out: _Planned
) -> None:
    try:
        files = fmt.read_tree(directory)
        arrays = [  # (what Orbax kept in its msgpack file was read, and is sound, already)
            n
            for n, leaf in files.leaves.items()
            if leaf.value_type.is_array and n not in files.aggregated
        ]
        damaged: dict[str, Exception] = {}
        headers = _checkpoint.array_headers(directory, files, arrays, damaged=damaged)
    except (ValueError, CheckpointNotFoundError) as e:
        out.problems.append(str(e))
        return
    out.problems.extend(str(e) for e in damaged.values())  # (as load refuses them)
    for name, leaf in files.leaves.items():
        if (
            leaf.value_type is ValueType.STRING
            and name not in files.strings
            and name not in files.aggregated
        ):
            out.problems.append(f"string leaf {name!r} is missing from {directory / fmt.STRINGS}")
    unchecked: list[str] = []
    given = dict.fromkeys(processes, 0)  # (bytes each host checks)
    tasks: dict[Any, list[workers.VerifyTask]] = {p: [] for p in processes}
    store = files.store(directory)
    for name in (n for n in arrays if n not in damaged):
        out.arrays += 1
        shape, dtype = _checkpoint.header_shape_dtype(headers[name])
        inner, _ = fmt.header_chunks(headers[name])
        nbytes = math.prod(shape) * dtype.itemsize  # (declared.zarr_header: under 2**63)
        out.nbytes += nbytes
        recorded = files.chunk_crc32c.get(name)
        if recorded is None:
            if not files.chunk_tables:  # (else the hosts check each against its writer's table)
                unchecked.append(name)
        elif not files.chunk_tables:  # (with the tables it records only inline chunks)
            _unrecorded(name, shape, inner, recorded, out)
        task = workers.VerifyTask(
            store=store,
            name=name,
            expected=None if recorded is None else tuple(recorded.items()),
            fill_missing=files.fill_missing,
            chunk_tables=files.chunk_tables,
        )
        _assign(task, nbytes, tasks, given)
    if unchecked:
        out.notes.append(
            f"{len(unchecked)} array(s) in {directory.name} have no recorded chunk "
            f"checksums (written by Orbax or an older milepost; e.g. {unchecked[0]!r}): "
            "their chunks were read but cannot be verified"
        )
    for process, mine in tasks.items():
        previous = out.plans.get(process)
        out.plans[process] = workers.VerifyPlan(
            tasks=(previous.tasks if previous is not None else ()) + tuple(mine),
            memory_budget_bytes=options.loading.memory_budget_bytes,
        )


def _assign(
    task: workers.VerifyTask,
    nbytes: int,
    tasks: dict[Any, list[workers.VerifyTask]],
    given: dict[Any, int],
) -> None:
    """Give an array of ``nbytes`` to the hosts: a share to each if it is large, else whole to
    the host given the fewest bytes so far."""
    hosts = list(tasks)
    if nbytes >= SHARED_BYTES and len(hosts) > 1:
        for k, p in enumerate(hosts):
            tasks[p].append(dataclasses.replace(task, share=(k, len(hosts))))
            given[p] += nbytes // len(hosts)
        return
    p = min(hosts, key=given.__getitem__)
    tasks[p].append(task)
    given[p] += nbytes


def _unrecorded(
    name: str,
    shape: tuple[int, ...],
    chunk: tuple[int, ...],
    recorded: dict[tuple[int, ...], int],
    out: _Planned,
) -> None:
    """Report the chunks of the array's grid that ``recorded`` (``_milepost.json``'s checksums)
    lacks: counted, the first found by walking the grid no further than the entries there are
    (the grid a header declares may be far larger than what was written)."""
    grid = tuple(-(-n // c) for n, c in zip(shape, chunk, strict=True))
    total = 0 if 0 in shape else math.prod(grid)
    inside = sum(all(i < g for i, g in zip(at, grid, strict=False)) for at in recorded)
    if total <= inside:
        return
    first = next(g for g in fmt.grid_indices(grid) if g not in recorded)
    out.problems.append(
        f"array {name!r}: {total - inside} of its {total} chunks have no recorded checksum "
        f"(first: {first}); the checkpoint's {fmt.MILEPOST_INFO} is damaged or incomplete"
    )
