"""safetensors, the format open models are shared in: loading a file or an HF-style folder onto
any mesh, and exporting a checkpoint to one.

Loading: the controller reads the headers (small), matches tensor names to the abstract tree's
leaf names (key path parts joined by '.'), and every host reads only the byte ranges its devices
need. Exporting: the controller plans every file (which tensors, their offsets) from metadata;
the hosts read the tensors from the checkpoint and write the files. Bytes never pass through
the controller, except for a load with no abstract tree (NumPy arrays on the controller).
"""

from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from milepost import _checkpoint, _hosts, _options, _progress, _tree, workers
from milepost._errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointReplacedError,
    StructureMismatchError,
)
from milepost._tree import PLACEHOLDER
from milepost.colocated import HostGroup, Slice
from milepost.workers import ObjectPath, StoragePath, as_path, check
from milepost.workers import format as fmt
from milepost.workers import progress as workers_progress

SUFFIX = ".safetensors"


def is_safetensors(path: Path) -> bool:
    """A ``.safetensors`` file, or a folder of them (with an index, or without any checkpoint
    metadata)."""
    if path.is_file():
        return path.name.endswith(SUFFIX)
    if not path.is_dir():
        return False
    if (path / fmt.SAFETENSORS_INDEX).is_file():
        return True
    return not (path / fmt.CHECKPOINT_METADATA).exists() and any(
        p.name.endswith(SUFFIX) for p in path.iterdir()
    )


def read_tensors(path: Path) -> dict[str, fmt.Tensor]:
    """Every tensor of a file or folder, by name (an index's ``weight_map`` says which file)."""
    if path.is_file():
        files = [path]
    elif (path / fmt.SAFETENSORS_INDEX).is_file():
        index = fmt.read_json_object(path / fmt.SAFETENSORS_INDEX, "safetensors index")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise StructureMismatchError(
                f"{path / fmt.SAFETENSORS_INDEX} has no 'weight_map'; it is not an HF index"
            )
        names = sorted(set(weight_map.values()))
        for name in names:
            if not isinstance(name, str) or _tree.unsafe_part(name) is not None:
                raise StructureMismatchError(
                    f"{path / fmt.SAFETENSORS_INDEX} names the file "
                    f"{name!r}, which is not a file of {path}"
                )
        files = [path / n for n in names]
    else:
        files = sorted(p for p in path.iterdir() if p.name.endswith(SUFFIX))
    out: dict[str, fmt.Tensor] = {}
    for file in files:
        if not file.is_file():
            raise CheckpointNotFoundError(
                f"{file} is missing (listed in {path / fmt.SAFETENSORS_INDEX})"
            )
        tensors, _ = fmt.read_safetensors_header(str(file))
        for name, tensor in tensors.items():
            if name in out:
                raise StructureMismatchError(
                    f"tensor {name!r} is in both {out[name].path} and {file}"
                )
            out[name] = tensor
    return out


# ------------------------------------------------------------------------------------------
# Load
# ------------------------------------------------------------------------------------------


def load(path: Path, abstract: Any, partial: bool) -> Any:
    """The tensors of ``path`` as the tree ``abstract`` describes (names: key paths joined by
    '.'), or, with no abstract tree, as NumPy arrays in a nested dict split at the '.'s."""
    return load_tensors(path, lambda: (read_tensors(path), {}), abstract, partial)


Found = tuple[dict[str, fmt.Tensor], dict[str, Any]]
"""What a file holds by leaf name: arrays (where their bytes lie), and values read already."""


def load_tensors(
    path: Path, read: Callable[[], Found], abstract: Any, partial: bool, *, kind: str = "the file"
) -> Any:
    """The leaves ``read()`` finds in the file(s) at ``path`` (run once, on the primary), as the
    tree ``abstract`` describes, or, with no abstract tree, NumPy arrays and values in nested
    dicts split at the '.'s. Every host reads only the byte ranges of the arrays its devices
    need."""
    options = _options.current()
    timeout = options.async_.timeout_secs
    leaves: list[Any] = (
        []
        if abstract is None
        else jax.tree_util.tree_leaves(
            abstract, is_leaf=lambda x: hasattr(x, "__milepost_host_group__")
        )
    )
    group = _hosts.check_storage(_hosts.host_group_for_abstract(leaves), path)
    before = _identity(path)
    tensors, plain = _hosts.shared(group, f"tensors:{path}", read, timeout)
    held = [*tensors, *plain]
    if abstract is None:
        clash = workers.declared.conflict(held)
        if clash is not None:
            raise StructureMismatchError(
                f"{path} holds both {clash[0]!r} and {clash[1]!r}, so its names (key paths "
                "joined by '.') do not nest into one tree; pass an abstract tree that names "
                "the leaves to load (partial=True loads some of them)"
            )
        targets = [
            (tuple((part, _tree.KEY_DICT) for part in name.split(".")), name, None) for name in held
        ]
        treedef = None
    else:
        flat, treedef = _tree.flatten(abstract)
        targets = [(leaf.keys, leaf.name, leaf.value) for leaf in flat]
        missing = [
            leaf.name
            for leaf in flat
            if leaf.name not in tensors and leaf.name not in plain and leaf.value is not PLACEHOLDER
        ]
        if missing:
            raise StructureMismatchError(
                f"the abstract tree asks for {missing[:5]}, which {path} does "
                f"not hold (it holds {sorted(held)[:8]}...); the names in {kind} "
                "must be the leaves' key paths joined by '.'"
            )
        extra = sorted(set(held) - {leaf.name for leaf in flat})
        if extra and not partial:
            raise StructureMismatchError(
                f"{path} holds leaves the abstract tree lacks: {extra[:5]}; pass "
                "partial=True to load only the leaves you give"
            )
    targets_of_arrays = [(keys, name, abst) for keys, name, abst in targets if name in tensors]
    values = _arrays(path, tensors, targets_of_arrays, group, options, timeout)
    if _identity(path) != before:  # the hosts may have read another file than the one planned
        raise CheckpointReplacedError(
            f"{path} was replaced or changed while it was being loaded, so what was read may mix "
            "two versions of it and was discarded. Load it again"
        )
    for _, name, abst in targets:
        if name in plain and abst is not PLACEHOLDER:
            values[name] = _tree.value_as_abstract(plain[name], abst, name, str(path))
    if treedef is None:
        return _tree.build_nested([(keys, values[name]) for keys, name, _ in targets])
    return _tree.unflatten(
        treedef, [PLACEHOLDER if abst is PLACEHOLDER else values[name] for _, name, abst in targets]
    )


def _identity(path: Path) -> tuple[Any, ...]:
    """What changes when the file at ``path`` (or a file of the folder) is replaced or written."""
    files = [path] if not path.is_dir() else sorted(p for p in path.iterdir() if p.is_file())
    out: list[tuple[Any, ...]] = []
    for f in files:
        try:
            st = f.stat()
        except OSError:
            out.append((f.name, None))
            continue
        out.append((f.name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


def _arrays(
    path: Path,
    tensors: dict[str, fmt.Tensor],
    targets: list[tuple[Any, str, Any]],
    group: Any,
    options: Any,
    timeout: float | None,
) -> dict[str, Any]:
    device_tasks: list[workers.LoadTask] = []
    host_tasks: list[workers.LoadTask] = []
    for _, name, abst in targets:
        if abst is PLACEHOLDER:
            continue
        task = _task(tensors[name], name, abst, group)
        (host_tasks if task.sharding is None else device_tasks).append(task)
    device_tasks = _checkpoint.mark_replicas(
        device_tasks, options.loading, group
    )  # load-and-broadcast
    store = workers.StoreSpec(directory=str(path if path.is_dir() else path.parent))
    workers_progress.expect(
        _progress.read_bytes(device_tasks, group) + _progress.read_bytes(host_tasks, group)
    )

    def plan_of(tasks: list[workers.LoadTask]) -> workers.LoadPlan:
        return workers.LoadPlan(
            store=store, tasks=tuple(tasks), memory_budget_bytes=options.loading.memory_budget_bytes
        )

    values: dict[str, Any] = {}
    with workers.RUNTIME.scoped("controller-load", 1) as pool:
        own = (
            pool.submit(
                _hosts.controller_host().load,
                {_hosts.CONTROLLER: plan_of(host_tasks)},
                timeout,
            )
            if host_tasks
            else None
        )
        if device_tasks:
            loaded = group.load({p: plan_of(device_tasks) for p in group.processes()}, timeout)
            values.update(zip((t.name for t in device_tasks), loaded.arrays, strict=True))
        if own is not None:
            values.update(
                zip((t.name for t in host_tasks), own.result(timeout).arrays, strict=True)
            )
    return values


def _task(tensor: fmt.Tensor, name: str, abstract: Any, group: Any) -> workers.LoadTask:
    dtype, sharding = np.dtype(tensor.dtype), None
    if abstract is not None:
        if tuple(abstract.shape) != tensor.shape:
            raise StructureMismatchError(
                f"leaf {name!r}: the abstract tree says shape "
                f"{tuple(abstract.shape)} but the file holds {tensor.shape}"
            )
        dtype = np.dtype(abstract.dtype)
        if not isinstance(abstract, np.ndarray):
            sharding = getattr(abstract, "sharding", None)
            if sharding is None:
                raise StructureMismatchError(
                    f"leaf {name!r} has no sharding in the abstract tree; give one (safetensors "
                    "files record none), or an np.ndarray leaf to load it into host memory"
                )
            sharding = getattr(sharding, "milepost_spec", None) or _checkpoint.concrete_sharding(
                sharding, group, name
            )
    return workers.LoadTask(
        name=name, shape=tensor.shape, dtype=dtype.name, sharding=sharding, tensor=tensor
    )


# ------------------------------------------------------------------------------------------
# Export
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExportSummary:
    """What ``export`` wrote."""

    path: Path
    """The folder the shards were written to."""
    files: tuple[str, ...]
    """The shard files written, by name (the index beside them is not among them)."""
    tensors: int
    """Tensors written."""
    total_bytes: int
    """Bytes of tensor data written."""
    skipped: tuple[str, ...]
    """Leaves that are not tensors (strings, empty containers), left out."""


def export(
    checkpoint: str | os.PathLike[str] | ObjectPath,
    out_dir: str | os.PathLike[str],
    *,
    max_shard_bytes: int = 5 << 30,
    subtree: str | None = None,
    metadata: Mapping[str, str] | None = None,
    overwrite: bool = False,
    slice: Slice | None = None,
) -> ExportSummary:
    """Write the arrays of ``checkpoint`` (its main tree, or the part under ``subtree``, e.g.
    ``"params"``) as HF-style safetensors shards plus ``model.safetensors.index.json`` in
    ``out_dir``. Tensor names are the leaves' key paths joined by '.' (without the subtree).

    Each file holds tensors in tree order up to ``max_shard_bytes`` (a larger tensor gets a file
    of its own). The hosts (of ``slice``, or this process, or every process of a multi-controller
    job) read the tensors from the checkpoint and write the files; the folder appears whole (it is
    written beside and renamed into place). ``metadata`` goes to every file's ``__metadata__``
    (default ``{"format": "pt"}``, what PyTorch loaders expect).

    >>> milepost.safetensors.export("/ckpt/1000", "/export/model", subtree="params")
    """
    check.integer(
        max_shard_bytes, "max_shard_bytes", minimum=1, error=ValueError, expect="a positive int"
    )
    meta_strings = _metadata_strings(metadata)
    options = _options.current()
    timeout = options.async_.timeout_secs
    root, out = as_path(checkpoint), Path(out_dir).absolute()
    group = _hosts.check_storage(
        slice.group if slice is not None else _hosts.host_group_for([]), root
    )
    staging = out.with_name(f"{out.name}.milepost-export-tmp")
    planned = _hosts.shared(
        group,
        f"export-plan:{out}",
        lambda: _plan(
            root,
            out,
            staging,
            subtree,
            max_shard_bytes,
            meta_strings,
            overwrite,
            group.processes(),
            options,
        ),
        timeout,
    )
    acks = _write_files(group, planned, staging, timeout)
    return _hosts.shared(
        group,
        f"export-commit:{out}",
        lambda: _commit(planned, acks, staging, out, overwrite),
        timeout,
    )


def _metadata_strings(metadata: Mapping[str, str] | None) -> dict[str, str]:
    """The ``__metadata__`` every file gets: ``metadata``, checked to be strings to strings (all
    the format stores), or ``{"format": "pt"}``."""
    meta_strings = dict(metadata) if metadata is not None else {"format": "pt"}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta_strings.items()):
        raise TypeError(
            "metadata must map strings to strings (the safetensors format stores nothing else)"
        )
    return meta_strings


def _write_files(
    group: HostGroup, planned: _ExportPlanned, staging: Path, timeout: float
) -> list[workers.ExportAck]:
    """The hosts write their files into ``staging``; if any fails, the primary removes the
    staging folder before the error goes up (nothing half-written is left beside ``out``)."""
    try:
        return group.run("export_safetensors", planned.plans, timeout)
    except BaseException:
        if group.is_primary():
            shutil.rmtree(staging, ignore_errors=True)
        raise


def _commit(
    planned: _ExportPlanned,
    acks: list[workers.ExportAck],
    staging: Path,
    out: Path,
    overwrite: bool,
) -> ExportSummary:
    """On the primary, in order: confirm every file the hosts wrote is in ``staging``, whole (one
    listing); write the index; fsync the folder (a failure so far removes ``staging``: nothing is
    exported); only then replace ``out`` (if ``overwrite``) and rename ``staging`` into place, so
    that ``out`` is always either the old folder or the whole new one."""
    try:
        fmt.confirm_files(staging, _file_sizes(planned.plans, staging), "the export")
        fmt.write_json(
            staging / fmt.SAFETENSORS_INDEX,
            {"metadata": {"total_size": planned.total}, "weight_map": planned.weight_map},
        )
        fmt.fsync_dir(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if out.exists() and overwrite:
        shutil.rmtree(out)
    os.rename(staging, out)
    fmt.fsync_dir(out.parent)
    written = {Path(f).name for ack in acks for f in ack.files}
    return ExportSummary(
        out, tuple(sorted(written)), len(planned.weight_map), planned.total, planned.skipped
    )


@dataclass
class _ExportPlanned:
    plans: dict[Any, workers.ExportPlan]
    weight_map: dict[str, str]
    total: int
    skipped: tuple[str, ...]


_Tensors = list[tuple[str, workers.LoadTask]]


def _plan(
    root: StoragePath,
    out: Path,
    staging: Path,
    subtree: str | None,
    max_bytes: int,
    metadata: dict[str, str],
    overwrite: bool,
    processes: Any,
    options: _options.Options,
) -> _ExportPlanned:
    """The export's plan, made on the primary from metadata alone. Every check (``out`` free,
    the leaves exportable) runs before ``staging`` is made, so a refused export leaves nothing
    on disk; the files are then named, packed and dealt to the hosts in turn."""
    if out.exists() and not overwrite:
        raise CheckpointExistsError(
            f"{out} exists; pass overwrite=True to replace it, or choose another folder"
        )
    meta = fmt.read_checkpoint_metadata(root)
    items = fmt.checkpointables(root, meta)
    directory = items[fmt.main_tree(root, items)].folder
    files = fmt.read_tree(directory)
    prefix = f"{subtree}." if subtree else ""
    chosen, skipped = _chosen_leaves(root, files, subtree, prefix)
    tensors = _tensor_tasks(directory, files, chosen, prefix)
    groups = _pack(tensors, max_bytes)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    by_host, weight_map = _deal_files(groups, staging, metadata, processes)
    store = files.store(directory)
    plans = {
        p: workers.ExportPlan(
            store=store,
            files=tuple(fs),
            fill_missing=files.fill_missing,
            memory_budget_bytes=options.loading.memory_budget_bytes,
        )
        for p, fs in by_host.items()
    }
    return _ExportPlanned(plans, weight_map, sum(_nbytes(task) for _, task in tensors), skipped)


def _chosen_leaves(
    root: StoragePath, files: fmt.TreeFiles, subtree: str | None, prefix: str
) -> tuple[list[str], tuple[str, ...]]:
    """The array leaves under ``prefix`` (exported) and the other leaves there (skipped, named in
    the summary); a ``subtree`` with no arrays is an error."""
    chosen = [
        n for n, leaf in files.leaves.items() if leaf.value_type.is_array and n.startswith(prefix)
    ]
    skipped = tuple(
        n
        for n, leaf in files.leaves.items()
        if not leaf.value_type.is_array and n.startswith(prefix)
    )
    if subtree and not chosen:
        raise StructureMismatchError(
            f"{root} has no arrays under {subtree!r} (its leaves: {list(files.leaves)[:8]}...)"
        )
    return chosen, skipped


def _tensor_tasks(
    directory: StoragePath, files: fmt.TreeFiles, chosen: list[str], prefix: str
) -> _Tensors:
    """A whole-array read for each chosen leaf, named without ``prefix``, in tree order; a leaf
    safetensors cannot hold (PRNG keys, an unsupported dtype) is refused, naming it."""
    headers = _checkpoint.array_headers(directory, files, chosen)
    tensors: _Tensors = []
    for name in chosen:
        if name in files.key_impls:
            raise StructureMismatchError(
                f"leaf {name!r} holds PRNG keys, which safetensors "
                "cannot store; export a subtree without it"
            )
        shape, dtype = _checkpoint.header_shape_dtype(headers[name])
        if dtype.name not in fmt.SAFETENSORS_CODES:
            raise StructureMismatchError(
                f"leaf {name!r} has dtype {dtype.name}, which safetensors cannot store (it stores "
                f"{', '.join(sorted(fmt.SAFETENSORS_CODES))}); cast it before exporting"
            )
        task = workers.LoadTask(
            name=name,
            shape=shape,
            dtype=dtype.name,
            sharding=None,
            checksums=_checkpoint.recorded_checksums(files, name),
            chunk_tables=files.chunk_tables,
        )
        tensors.append((name[len(prefix) :], task))
    return tensors


def _pack(tensors: _Tensors, max_bytes: int) -> list[_Tensors]:
    """The tensors in tree order, cut into files of at most ``max_bytes`` (a larger tensor gets a
    file of its own)."""
    groups: list[_Tensors] = []
    size = 0
    for entry in tensors:
        nbytes = _nbytes(entry[1])
        if not groups or (size + nbytes > max_bytes and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += nbytes
    return groups


def _deal_files(
    groups: list[_Tensors], staging: Path, metadata: dict[str, str], processes: Any
) -> tuple[dict[Any, list[workers.ExportFile]], dict[str, str]]:
    """Each file named ``model-k-of-n``, its header built, and dealt to the hosts in turn; with
    the index's ``weight_map`` (tensor name -> file)."""
    count = len(groups)
    weight_map: dict[str, str] = {}
    by_host: dict[Any, list[workers.ExportFile]] = {p: [] for p in processes}
    turn = itertools.cycle(list(processes))
    for k, group in enumerate(groups):
        name = f"model-{k + 1:05d}-of-{count:05d}.safetensors"
        header = fmt.safetensors_header(
            [(t, task.dtype, task.shape, _nbytes(task)) for t, task in group], metadata
        )
        by_host[next(turn)].append(
            workers.ExportFile(
                path=str(staging / name), header=header, tensors=tuple(task for _, task in group)
            )
        )
        weight_map.update((t, name) for t, _ in group)
    return by_host, weight_map


def _nbytes(task: workers.LoadTask) -> int:
    return int(np.prod(task.shape, dtype=np.int64)) * np.dtype(task.dtype).itemsize


def _file_sizes(plans: dict[Any, workers.ExportPlan], staging: Path) -> dict[str, int]:
    """Each file of the export (from ``staging``) with its bytes: its header, its tensors."""
    return {
        Path(f.path).relative_to(staging).as_posix(): len(f.header)
        + sum(_nbytes(t) for t in f.tensors)
        for plan in plans.values()
        for f in plan.files
    }
