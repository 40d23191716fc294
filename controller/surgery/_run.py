"""Running a surgery: groups of output leaves, each read by the hosts, computed jitted where
the data is, and written, then freed before the next group.

The output leaves are cut into groups whose bytes per host (inputs and outputs) fit the memory
budget; a leaf larger than the budget is a group of its own (and the log says so). For each
group the hosts load the stored leaves it needs (only those, resharded as planned), one jitted
function computes every output of the group on the devices, and the outputs are written into
the checkpoint being made, each group into OCDBT databases of its own; the format files and
the merged root view are written once, at the end, by the same commit as any save.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from milepost import _checkpoint, _hosts, _options, workers
from milepost._tree import ValueType, storage_name_of
from milepost.surgery import _lazy, _relink
from milepost.surgery._lazy import LazyArray, Op, Source, flat, nest
from milepost.surgery._placement import Placement, fits
from milepost.workers import ObjectPath, ShardingSpec, StoragePath, as_path, check, is_local
from milepost.workers import format as fmt
from milepost.workers import progress as progress_sink

log = logging.getLogger("milepost.surgery")

DEFAULT_BUDGET = 1 << 30


class _Counted:
    """A progress sink for a whole surgery, whose total (every input read and every output
    written) is known up front: the estimates of its group loads and writes are not added
    again, and each host's ack of a group adds to what that host did before."""

    def __init__(self, op: Any) -> None:
        self.op = op

    def expect(self, nbytes: int) -> None:
        pass

    def add(self, nbytes: int) -> None:
        self.op.add(nbytes)

    def acked(self, host: Any, nbytes: int) -> None:
        self.op.add(nbytes)


def counted(outputs: Mapping[str, LazyArray], *, written: bool) -> Any:
    """Count a surgery's progress into the current operation (a save's, or one opened by
    ``stats``/``diff``): the bytes of its inputs, and of its outputs when they are written."""
    op = progress_sink.current()
    if op is None:
        return contextlib.nullcontext()
    inputs = {
        (id(source_of(s).checkpoint), source_of(s).name): s.nbytes
        for x in outputs.values()
        for s in sources_of(x)
    }
    op.expect(sum(inputs.values()) + (sum(x.nbytes for x in outputs.values()) if written else 0))
    return progress_sink.reporting(_Counted(op))


# ------------------------------------------------------------------------------------------
# Expressions to one function
# ------------------------------------------------------------------------------------------


@dataclass
class Program:
    """The outputs of one group as one function of the stored leaves it reads."""

    fn: Callable[..., list[Any]]
    sources: list[tuple[Source, LazyArray]]
    """Each input: the stored leaf, and a lazy array of it (shape, dtype, preferred sharding)."""


def compile_outputs(outputs: list[LazyArray]) -> Program:
    index: dict[int, int] = {}
    sources: list[tuple[Source, LazyArray]] = []

    def node(x: LazyArray) -> Any:
        if isinstance(x.expr, Source):
            key = id(x.expr)
            if key not in index:
                index[key] = len(sources)
                sources.append((x.expr, x))
            return index[key]
        assert isinstance(x.expr, Op)
        return (x.expr.fn, tuple(node(i) for i in x.expr.inputs))

    nodes = tuple(node(x) for x in outputs)
    signature = _signature(nodes)
    fn = _programs.get(signature) if signature is not None else None
    if fn is None:
        fn = _program(nodes)
        if signature is not None:
            _programs[signature] = fn
    return Program(fn, sources)


def _program(nodes: tuple[Any, ...]) -> Callable[..., list[Any]]:
    def run(*inputs: Any) -> list[Any]:
        def ev(n: Any) -> Any:
            if isinstance(n, int):
                return inputs[n]
            fn, kids = n
            return fn(*(ev(k) for k in kids))

        return [ev(n) for n in nodes]

    return run


_programs: dict[Any, Callable[..., list[Any]]] = {}
"""One Python function per program structure: groups doing the same thing to leaves of the same
shapes hit jax.jit's cache (its key is the function) instead of compiling again. Bounded below."""
_PROGRAMS_KEPT = 256


def _signature(nodes: Any) -> Any:
    """What makes two programs the same computation: each operation's code and the values it
    closes over, and the wiring; None when a value cannot be compared (never shared then)."""

    def of(n: Any) -> Any:
        if isinstance(n, int):
            return n
        fn, kids = n
        code = getattr(fn, "__code__", None)
        if code is None:
            return None
        # (each value with its type: 1 and 1.0 differ)
        typed = lambda values: tuple((type(v), v) for v in values or ())  # noqa: E731
        cells = typed(c.cell_contents for c in (fn.__closure__ or ()))
        key = (code, typed(fn.__defaults__), cells, tuple(of(k) for k in kids))
        try:
            hash(key)
        except TypeError:
            return None
        return None if None in key[3] else key

    key = tuple(of(n) for n in nodes)
    if None in key:
        return None
    if len(_programs) >= _PROGRAMS_KEPT:
        _programs.clear()
    return key


def placement_of(leaves: list[LazyArray]) -> Placement:
    places = {source_of(s).checkpoint.placement for leaf in leaves for s in sources_of(leaf)}
    if len(places) > 1:
        raise ValueError(
            "the surgery mixes checkpoints opened on different hosts "
            f"({', '.join(p.describe() for p in places)}); open "
            "every source with the same slice= (or none)"
        )
    return next(iter(places)) if places else Placement()


def sources_of(x: LazyArray) -> list[LazyArray]:
    if isinstance(x.expr, Source):
        return [x]
    return [s for i in x.expr.inputs for s in sources_of(i)]


def source_of(x: LazyArray) -> Source:
    """The stored leaf that ``x``, one of :func:`sources_of`, is."""
    assert isinstance(x.expr, Source)
    return x.expr


def load_inputs(program: Program, placement: Placement) -> list[Any]:
    """The stored leaves ``program`` reads, loaded by the hosts with their planned shardings."""
    by_checkpoint: dict[int, tuple[Any, dict[str, Any]]] = {}
    for source, lazy in program.sources:
        spec = placement.spec_for(lazy.sharding, lazy.shape)
        ck = source.checkpoint
        by_checkpoint.setdefault(id(ck), (ck, {}))[1][source.path] = placement.abstract(
            lazy.shape, lazy.dtype, spec
        )
    loaded: dict[tuple[int, str], Any] = {}
    for key, (ck, wanted) in by_checkpoint.items():
        got = _checkpoint.load_checkpointables(ck.path, {ck.item: nest(wanted)}, partial=True)[
            ck.item
        ]
        for name, value in flat(got).items():
            if name in wanted:
                loaded[(key, name)] = value
    return [loaded[(id(s.checkpoint), s.path)] for s, _ in program.sources]


def compute(
    outputs: dict[str, LazyArray], placement: Placement, specs: Mapping[str, ShardingSpec]
) -> dict[str, Any]:
    """Every output computed on the devices, placed with ``specs``."""
    if not outputs:
        return {}
    names = list(outputs)
    program = compile_outputs([outputs[n] for n in names])
    inputs = load_inputs(program, placement)
    values = placement.run(program.fn, inputs, [specs[n] for n in names])
    del inputs
    return dict(zip(names, values, strict=True))


# ------------------------------------------------------------------------------------------
# Groups under a budget
# ------------------------------------------------------------------------------------------


def groups(
    outputs: dict[str, LazyArray],
    specs: Mapping[str, ShardingSpec],
    placement: Placement,
    budget: int,
) -> list[list[str]]:
    out: list[list[str]] = []
    current: list[str] = []
    held = 0
    seen: set[int] = set()
    for name, x in outputs.items():
        cost = placement.bytes_per_host(x.shape, x.dtype, specs[name])
        new_sources = {id(s.expr): s for s in sources_of(x)}
        extra = sum(
            placement.bytes_per_host(s.shape, s.dtype, placement.spec_for(s.sharding, s.shape))
            for k, s in new_sources.items()
            if k not in seen
        )
        if current and held + cost + extra > budget:
            out.append(current)
            current, held, seen = [], 0, set()
            extra = sum(
                placement.bytes_per_host(s.shape, s.dtype, placement.spec_for(s.sharding, s.shape))
                for s in new_sources.values()
            )
        if not current and cost + extra > budget:
            log.info(
                "leaf %r needs %.1f MiB per host, more than a group may hold (%.1f "
                "MiB: half the memory budget, as a group is computed while the "
                "previous one is written); it is processed on its own",
                name,
                (cost + extra) / 2**20,
                budget / 2**20,
            )
        current.append(name)
        held += cost + extra
        seen.update(new_sources)
    if current:
        out.append(current)
    return out


def output_specs(
    outputs: dict[str, LazyArray], placement: Placement, shardings: Any
) -> dict[str, ShardingSpec]:
    """Where each output goes: ``shardings`` (None, one sharding for all, or ``{regex:
    sharding}``, first match), else the sharding the operations suggest, else spread over every
    device."""
    import re

    out = {}
    for name, x in outputs.items():
        chosen: Any = None
        if isinstance(shardings, Mapping):
            for pattern, sharding in shardings.items():
                if re.search(pattern, name):
                    chosen = sharding
                    break
        elif shardings is not None:
            chosen = shardings
        if chosen is not None:
            spec = _checkpoint.sharding_spec(chosen)
            if spec is None or not placement.usable(spec, x.shape):
                raise ValueError(
                    f"the sharding given for {name!r} ({chosen!r}) cannot hold an array of "
                    f"shape {x.shape} on {placement.describe()}"
                )
            out[name] = spec
        else:
            out[name] = placement.spec_for(x.sharding, x.shape)
    return out


# ------------------------------------------------------------------------------------------
# Writing: a checkpointable handler that streams the groups
# ------------------------------------------------------------------------------------------


@dataclass
class Job:
    """A surgery's output tree, to be written by :class:`SurgeryHandler`."""

    arrays: dict[str, LazyArray]
    values: dict[str, Any]
    placement: Placement
    specs: dict[str, ShardingSpec]
    budget: int
    order: list[str] = field(default_factory=list)
    """Every leaf path of the output tree, in its order."""
    shardings_given: bool = False
    relink: bool = True
    """Stored leaves only renamed or reordered (none dropped) may be relinked rather than
    rewritten."""
    written: dict[str, int] = field(default_factory=dict)
    """Groups written and bytes computed (for the caller's report)."""

    @property
    def __milepost_host_group__(self) -> Any:  # the save runs on the surgery's hosts
        return self.placement.group if self.placement.slice is not None else None

    def write(
        self, directory: StoragePath, call: _checkpoint.SaveCall
    ) -> _checkpoint.WrittenTree | None:
        """Write every group; on the primary, hand the tree to the commit (its format files and
        root view are the commit's)."""
        options = call.options.saving
        # Stored leaves kept as stored (no SaveOptions asking for another chunking or
        # compression: the default chunking, "auto", keeps what is stored) are relinked; anything
        # else is rewritten.
        keep_layout = (
            options.use_ocdbt and options.compression is None and options.chunk_byte_size == "auto"
        )
        fast = (
            _relink.plan(self.arrays, self.shardings_given)
            if is_local(directory) and keep_layout and self.relink
            else None
        )
        if fast is not None:
            assert is_local(directory)  # (relinked only on local disks: above)
            ck, renames = fast
            timeout = call.options.async_.timeout_secs
            _hosts.shared(
                call.group,
                f"surgery-link:{directory}",
                lambda: _relink.link_databases(ck, renames, directory),
                timeout,
            )
            files = _checkpoint.TreeSavePlan(options)
            acks: list[workers.SaveAck] = []
            if self.values:
                planned = _checkpoint.plan_tree(nest(self.values), options, call.group)
                pending = _checkpoint.stage_tree(
                    planned, directory, call, first_writer=1 << 16, finish=False
                )
                pending.wait()
                acks.extend(pending.acks)
                for name in ("leaves", "shardings", "strings", "python_types", "key_impls"):
                    getattr(files, name).update(getattr(planned, name))
            self.written["groups"] = 0
            if call.group.is_primary():
                tree = _relink.finish(ck, renames, self.order, files, acks, directory)
                call.written.append(tree)  # for the commit
                return tree
            return None
        with counted(self.arrays, written=True):
            return self._write_groups(directory, call)

    def _write_groups(
        self, directory: StoragePath, call: _checkpoint.SaveCall
    ) -> _checkpoint.WrittenTree | None:
        options = call.options.saving
        step = _options.max_writers(options)
        files = _checkpoint.TreeSavePlan(options)
        acks: list[workers.SaveAck] = []
        # Group g is computed while group g - 1 is written: the two share the budget.
        parts = groups(self.arrays, self.specs, self.placement, self.budget // 2) or [[]]
        writing: tuple[Any, Any, Any] | None = None  # (pending write, its plan, its arrays)

        def finish_writing() -> None:
            nonlocal writing
            if writing is None:
                return
            pending, planned, _ = writing
            try:
                pending.wait()
            finally:
                writing = None
            acks.extend(pending.acks)
            for name in ("leaves", "shardings", "strings", "python_types", "key_impls"):
                getattr(files, name).update(getattr(planned, name))

        try:
            for g, names in enumerate(parts):
                values = compute({n: self.arrays[n] for n in names}, self.placement, self.specs)
                if g == 0:
                    values.update(self.values)
                finish_writing()
                planned = _checkpoint.plan_tree(nest(values), options, call.group)
                writing = (
                    _checkpoint.stage_tree(
                        planned, directory, call, first_writer=g * step, finish=False
                    ),
                    planned,
                    values,
                )
                del values, planned
                log.debug("group %d of %d computed, being written: %s", g + 1, len(parts), names)
            finish_writing()
        except BaseException:
            if writing is not None:
                writing[0].settle()
            raise
        if not self.shardings_given:
            self._record_as_sources(files)
        stored_order = [storage_name_of(n) for n in self.order]
        files.leaves = {n: files.leaves[n] for n in stored_order if n in files.leaves}
        self.written["groups"] = len(parts)
        if call.group.is_primary():
            tree = _checkpoint.WrittenTree(directory, files.files, acks)
            call.written.append(tree)
            return tree
        return None

    def _record_as_sources(self, files: Any) -> None:
        """Record each array as its sources were saved, not as it was computed here: the
        sharding its operations suggest (a stored leaf's: its saved one, axis types and memory
        kind too) where it fits the array's shape, though the array was computed on other
        devices (fewer: ``milepost convert`` in a process of one CPU device), so that a load
        without an abstract tree places it as the source was; and an array of stored NumPy
        arrays only, with no sharding, as a NumPy array. Typed PRNG keys are left as written."""
        for name, x in self.arrays.items():
            stored = storage_name_of(name)
            if stored not in files.leaves or stored in files.key_impls:
                continue
            if x.sharding is None and all(
                _stored_type(s) is ValueType.NP_ARRAY for s in sources_of(x)
            ):
                files.shardings.pop(stored, None)
                files.leaves[stored] = dataclasses.replace(
                    files.leaves[stored],
                    value_type=ValueType.NP_ARRAY,
                    raw_value_type=str(ValueType.NP_ARRAY),
                    write_shape=None,
                )
            elif x.sharding is not None and fits(x.sharding, x.shape):
                files.shardings[stored] = x.sharding


def _stored_type(x: LazyArray) -> ValueType | None:
    """The value type a stored leaf (one of :func:`sources_of`) was saved as."""
    source = source_of(x)
    meta = source.checkpoint.leaf_meta.get(source.name)
    return meta.value_type if meta is not None else None


class SurgeryHandler:
    """Writes a :class:`Job` in the PyTree layout (so it loads, in milepost and Orbax, as any
    PyTree checkpointable)."""

    typestr = fmt.PYTREE_HANDLER_TYPESTR

    def is_handleable(self, obj: Any) -> bool:
        return isinstance(obj, Job)

    def save(self, directory: StoragePath, obj: Any, call: _checkpoint.SaveCall) -> Any:
        return _checkpoint.Deferred(lambda: obj.write(directory, call))

    def load(self, directory: StoragePath, abstract: Any, call: _checkpoint.LoadCall) -> Any:
        return _checkpoint.PyTreeHandler().load(directory, abstract, call)

    def metadata(self, directory: StoragePath) -> Any:
        return _checkpoint.PyTreeHandler().metadata(directory)


def split_tree(tree: Any) -> tuple[dict[str, LazyArray], dict[str, Any]]:
    leaves = flat(tree)
    arrays = {n: v for n, v in leaves.items() if isinstance(v, LazyArray)}
    others = {n: v for n, v in leaves.items() if not isinstance(v, LazyArray)}
    bad = [n for n, v in others.items() if hasattr(v, "shape") and not isinstance(v, np.generic)]
    if bad:
        raise TypeError(
            f"{bad[:5]} are arrays, not lazy arrays of opened checkpoints; a surgery's tree holds "
            "LazyArrays, strings and scalars (save in-memory arrays with milepost.save)"
        )
    return arrays, others


def provenance(arrays: dict[str, LazyArray]) -> dict[str, Any]:
    sources = sorted(
        {f"{source_of(s).checkpoint.path}" for x in arrays.values() for s in sources_of(x)}
    )
    operations = list(dict.fromkeys(h for x in arrays.values() for h in x.history))
    return {"sources": sources, "operations": operations}


def write(
    path: str | os.PathLike[str] | ObjectPath,
    tree: Any,
    *,
    shardings: Any = None,
    memory_budget_bytes: int | None = None,
    overwrite: bool = False,
    item: str = "state",
    custom_metadata: Mapping[str, Any] | None = None,
    relink: bool = True,
) -> StoragePath:
    """Write the surgery ``tree`` as a committed checkpoint at ``path`` (Orbax-readable), group
    by group: each host holds at most ``memory_budget_bytes`` (default 1 GiB) of inputs and
    outputs at once. ``shardings``: where the outputs go (None: as the operations suggest, else
    spread over every device; one sharding for all; or ``{regex: sharding}``). Its
    ``custom_metadata`` records the sources and the operations (``milepost.surgery``). Without
    ``shardings``, each array records the sharding its operations suggest (a stored leaf's saved
    one) where it fits its shape, even when computed on fewer devices than that names: loaded
    without an abstract tree, it is placed as the source was.

    A tree of every stored array of one checkpoint, only renamed or reordered, is written
    without moving array bytes (local files: the data files are hard-linked, and keep their
    chunking and compression); ``relink=False`` rewrites them instead. A tree that drops a
    stored array is rewritten: the shared data files would still hold the dropped bytes. To
    re-chunk or compress, write inside
    ``milepost.Context(saving=SaveOptions(chunk_byte_size=..., compression=...))`` (a number of
    bytes, or None for one chunk per shard; the default ``"auto"`` keeps what is stored): every
    array is then rewritten (e.g. adding subchunking for a new topology, one group at a time).

    >>> ms.write("gs://out/1000", t)
    """
    return write_items(
        path,
        {item: tree},
        shardings=shardings,
        memory_budget_bytes=memory_budget_bytes,
        overwrite=overwrite,
        custom_metadata=custom_metadata,
        relink=relink,
    )


def write_items(
    path: str | os.PathLike[str] | ObjectPath,
    trees: Mapping[str, Any],
    *,
    shardings: Any = None,
    memory_budget_bytes: int | None = None,
    overwrite: bool = False,
    custom_metadata: Mapping[str, Any] | None = None,
    relink: bool = True,
) -> StoragePath:
    """:func:`write` of several surgery trees, one checkpointable each, in one checkpoint."""
    check.integer(
        memory_budget_bytes,
        "memory_budget_bytes",
        minimum=1,
        optional=True,
        error=ValueError,
        expect="a positive int",
    )
    check.flag(relink, "relink")
    jobs: dict[str, Job] = {}
    every: dict[str, LazyArray] = {}
    for item, tree in trees.items():
        arrays, values = split_tree(tree)
        placement = placement_of(list(arrays.values()))
        _hosts.check_storage(placement.group, as_path(path))
        specs = output_specs(arrays, placement, shardings)
        jobs[item] = Job(
            arrays,
            values,
            placement,
            specs,
            memory_budget_bytes or DEFAULT_BUDGET,
            order=list(flat(tree)),
            shardings_given=shardings is not None,
            relink=relink,
        )
        every.update({f"{item}/{n}": x for n, x in arrays.items()})
    meta = {**dict(custom_metadata or {}), "milepost.surgery": provenance(every)}
    with _options.Context(handlers=(SurgeryHandler(),)):
        return _checkpoint.start_save(
            path, jobs, overwrite=overwrite, custom_metadata=meta, metrics=None, asynchronous=False
        ).result()


def materialize(tree: Any, abstract: Any = None) -> Any:
    """The surgery ``tree`` computed onto devices (a slice's, for checkpoints opened on one):
    jax arrays or RemoteArrays, placed as ``abstract``'s shardings say (else as ``write``
    would). Everything is held at once: for what does not fit, ``write`` it and load parts.
    """
    arrays, values = split_tree(tree)
    placement = placement_of(list(arrays.values()))
    shardings: Any = None
    if abstract is not None:
        wanted = flat(abstract)
        unknown = [n for n in wanted if n not in arrays and n not in values]
        if unknown:
            raise ValueError(
                f"the abstract tree names {unknown[:5]}, which the surgery's tree lacks"
            )
        shardings = {
            f"^{_escape(n)}$": s
            for n, a in wanted.items()
            if (s := getattr(a, "sharding", None)) is not None
        }
    specs = output_specs(arrays, placement, shardings)
    return nest({**compute(arrays, placement, specs), **values})


def _escape(name: str) -> str:
    return re.escape(name)


# ------------------------------------------------------------------------------------------
# A look at values
# ------------------------------------------------------------------------------------------


def _box(
    x: LazyArray,
) -> tuple[Source, LazyArray, tuple[tuple[int, int], ...], tuple[int, ...]] | None:
    """A stored leaf and the box of it a plain slice ``x`` is (with the int-indexed axes to
    drop); None when ``x`` is more than that."""
    if isinstance(x.expr, Source):
        return x.expr, x, tuple((0, n) for n in x.shape), ()
    if x.expr.name != "getitem":
        return None
    base = x.expr.inputs[0]
    source = base.expr
    if not isinstance(source, Source):
        return None
    index = x.expr.params
    box, drop = [], []
    for d, part in enumerate(index):
        if d >= base.ndim or part is None or part is Ellipsis:
            return None
        if isinstance(part, slice):
            start, stop, stride = part.indices(base.shape[d])
            if stride != 1:
                return None
            box.append((start, max(start, stop)))
        else:
            i = int(part) + (base.shape[d] if int(part) < 0 else 0)
            box.append((i, i + 1))
            drop.append(d)
    box.extend((0, n) for n in base.shape[len(index) :])
    return source, base, tuple(box), tuple(drop)


def to_numpy(x: LazyArray) -> np.ndarray:
    """``x``'s values on the controller. A plain slice of a stored leaf reads only the chunks it
    touches (checked against their checksums), on a host that can see the storage."""
    found = _box(x)
    if found is None:
        (value,) = flat(materialize({"x": x})).values()
        return placement_of([x]).fetch([value])[0]
    source, _, box, drop = found
    ck = source.checkpoint
    plan = workers.BoxPlan(
        store=ck.files.store(ck.folder),
        name=source.name,
        box=box,
        checksums=_checkpoint.recorded_checksums(ck.files, source.name),
        chunk_tables=ck.files.chunk_tables,
    )
    group = ck.placement.group
    timeout = _options.current().async_.timeout_secs
    if ck.placement.slice is not None:
        (data,) = group.run("read_box", {group.processes()[0]: plan}, timeout)
    else:
        data = _hosts.shared(
            group,
            f"surgery-preview:{ck.path}:{source.name}:{box}",
            lambda: workers.run_job("read_box", plan, "controller"),
            timeout,
        )
    return np.squeeze(data, axis=drop) if drop else data


_lazy.set_reader(to_numpy)  # np.asarray(lazy array) reads through this engine
