"""Save, load and inspect whole checkpoints: temporary directory, handlers, finalize, commit."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent import futures
from pathlib import Path
from typing import Any

import jax

from milepost import (
    _background,
    _dispatch,
    _handlers,
    _layout,
    _options,
    _ownership,
    _paths,
    _progress,
    _workspace,
    workers,
)
from milepost import _format as fmt
from milepost._errors import (
    CheckpointNotFoundError,
    CheckpointReplacedError,
    InvalidKeyError,
    SaveInProgressError,
)
from milepost.colocated import HostGroup

_in_flight: set[Path] = set()
_in_flight_lock = threading.Lock()


def saves_in_flight(under: Path) -> set[str]:
    """Names of the entries of folder ``under`` that a save of this process is writing now."""
    with _in_flight_lock:
        return {p.name for p in _in_flight if p.parent == under}


class SaveHandle:
    """The background part of a save. ``result()`` waits for the commit and re-raises its
    failure on your thread; ``add_done_callback(fn)`` calls ``fn(handle)`` when it ends.

    >>> handle = milepost.save_async("/ckpt/200", state)
    >>> handle                       # SaveHandle('/ckpt/200', running: 96.0 MiB of 512.0 MiB written, 0.3 s)
    >>> handle.result()              # waits for the commit; re-raises a failure
    >>> handle                       # SaveHandle('/ckpt/200', committed: 512.0 MiB in 1.21 s (0.44 GB/s), blocking 0.118 s)
    """

    def __init__(
        self, path: Path, future: futures.Future[Path], operation: _progress.Operation | None = None
    ) -> None:
        self.path = path
        self._future = future
        self._op = operation

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> Path:
        try:
            return self._future.result(timeout)
        except futures.TimeoutError as e:
            raise TimeoutError(
                f"the save to {self.path} did not finish within {timeout}s; it is still running"
            ) from e

    def add_done_callback(self, fn: Callable[[SaveHandle], Any]) -> None:
        """Call ``fn(self)`` once the save committed or failed (at once if it already has), on
        the thread that finished it. Exceptions ``fn`` raises are logged, not raised. As with
        ``concurrent.futures``, :meth:`result` may return while that thread still runs the
        callbacks; :func:`milepost.wait_for_saves` returns only after them."""
        self._future.add_done_callback(lambda _: fn(self))

    def _state(self) -> str:
        op = self._op
        if not self._future.done():
            if op is None:
                return "running"
            return f"running: {_progress.human_bytes(op.done)} of {_progress.human_bytes(op.total)} written, {op.seconds:.1f} s"
        error = self._future.exception()
        if error is None:
            return "committed" + (
                f": {op.summary()}" if op is not None and op.ended is not None else ""
            )
        return f"failed: {type(error).__name__}: {error}"

    def __repr__(self) -> str:
        return f"SaveHandle({str(self.path)!r}, {self._state()})"

    def _repr_html_(self) -> str:
        from milepost import _views

        return _views.html_fields("SaveHandle", {"path": str(self.path), "state": self._state()})


def _check_name(name: str) -> None:
    if (why := _layout.unsafe_item_name(name)) is not None:
        raise InvalidKeyError(
            f"checkpointable name {name!r} is not a valid folder name ({why}; names are non-empty, have no '/', and do "
            "not start with '_'); rename it"
        )


def _all_leaves(objs: Mapping[str, Any]) -> list[Any]:
    out: list[Any] = []
    for obj in objs.values():
        if isinstance(obj, _handlers.StatefulCheckpointable):
            continue
        out.extend(
            jax.tree_util.tree_leaves(
                obj, is_leaf=lambda x: x is None or hasattr(x, "__milepost_host_group__")
            )
        )
    return out


def start_save(
    path: str | os.PathLike[str],
    objs: Mapping[str, Any],
    *,
    overwrite: bool,
    custom_metadata: Mapping[str, Any] | None,
    metrics: Mapping[str, Any] | None = None,
    asynchronous: bool,
) -> SaveHandle:
    """Validate, prepare the temporary directory, stage every checkpointable (the blocking
    part), and finish in the background (``asynchronous``) or before returning."""
    options = _options.current()
    final = _paths.as_path(path)
    if (
        final.name.endswith(fmt.TMP_SUFFIX)
        or _ownership.NEW_MARKER in final.name
        or final.name.endswith(_workspace.LEASE_SUFFIX)
    ):
        raise ValueError(
            f"cannot save to {final}: names ending in {fmt.TMP_SUFFIX!r} are temporary directories and are never "
            "loaded as checkpoints; choose another name"
        )
    if not objs:
        raise ValueError("nothing to save: pass at least one checkpointable")
    for name in objs:
        _check_name(name)
    try:
        custom_json = json.dumps(dict(custom_metadata or {}))
        metrics_json = json.loads(json.dumps(dict(metrics or {})))
    except (TypeError, ValueError) as e:
        raise TypeError(f"custom_metadata and metrics must be JSON-serializable: {e}") from e
    handlers = {
        name: _handlers.resolve_for_save(name, obj, options.handlers) for name, obj in objs.items()
    }
    group = _dispatch.check_storage(_dispatch.host_group_for(_all_leaves(objs)), final)
    with _in_flight_lock:
        if final in _in_flight:
            raise SaveInProgressError(
                f"another save to {final} is still in flight; wait for it (handle.result()) first"
            )
        _in_flight.add(final)
    save = _Save(final, handlers, group, options, overwrite, custom_json, metrics_json)
    op = save.op
    try:
        with op.active():
            save.stage(objs, copy=asynchronous)
    except BaseException:
        op.close(ok=False)
        with _in_flight_lock:
            _in_flight.discard(final)
        raise
    if asynchronous:
        op.blocked()
        return SaveHandle(
            final, _background.saves.submit(str(final), save.finish, save.timeout), op
        )
    future: futures.Future[Any] = futures.Future()
    future.set_result(save.finish())
    return SaveHandle(final, future, op)


class _Save:
    """One save of a checkpoint: its workspace (a locked temporary directory, or the path itself
    under a lease on object stores; owned by the primary), the pending writes of its
    checkpointables, and the commit."""

    def __init__(
        self,
        final: Path | _paths.ObjectPath,
        handlers: Mapping[str, Any],
        group: HostGroup,
        options: _options.Options,
        overwrite: bool,
        custom_json: str,
        metrics_json: Any,
    ) -> None:
        self.final = final
        saving = options.saving
        self.workspace = _workspace.for_path(
            final, overwrite, saving.wait_for_writer_secs, saving.lease_secs
        )
        self.handlers = handlers
        self.group = group
        self.options = options
        self.timeout = options.async_.timeout_secs
        self.overwrite = overwrite
        self.custom_json = custom_json
        self.metrics_json = metrics_json
        self.pending: list[workers.PendingWrite[Any]] = []
        self.op = _progress.Operation(
            "save", final, options.progress if group.is_primary() else None
        )
        """Bytes planned and written, times, and the progress bar (on the primary)."""
        self.prepared = False
        """True on the primary once it owns the workspace (until it committed or abandoned it)."""
        self.init_ns = 0

    @property
    def tmp(self) -> Path | _paths.ObjectPath:
        """Where the checkpointables are written until the commit."""
        return self.workspace.dir

    # -- the blocking part --------------------------------------------------------------
    def prepare(self) -> None:
        """On the primary: check the path and take ownership of the workspace."""
        self.workspace.prepare(self.handlers)
        self.prepared = True

    def stage(self, objs: Mapping[str, Any], copy: bool) -> None:
        group, final, timeout = self.group, self.final, self.timeout
        prepared = False
        try:
            # The primary checks the path, then makes the workspace; the other controller
            # processes wait for its outcome, so none writes before it exists, and all raise the
            # same error.
            _dispatch.shared(group, f"prepare:{final}", self.prepare, timeout)
            prepared = True
            self.init_ns = time.time_ns()
            call = _handlers.SaveCall(options=self.options, group=group, copy=copy)
            failure: Exception | None = None
            try:
                for name, obj in objs.items():
                    part = _handlers.as_pending(
                        self.handlers[name].save(self.tmp / name, obj, call)
                    )
                    if part is not None:
                        self.pending.append(part)
            except Exception as e:
                failure = e
            # The primary may fail alone here (its own leaves, a stateful checkpointable).
            _agree(group, f"staged:{final}", failure, timeout)
        except BaseException:
            workers.settle_all(self.pending, timeout)
            if prepared:
                self._abandon(f"abandon-staged:{final}")
            raise

    # -- the background part ------------------------------------------------------------
    def finish(self) -> Path | _paths.ObjectPath:
        try:
            with self.op.active():
                self._finish()
        except BaseException:
            self.op.close(ok=False)
            raise
        if self.op.blocking_secs is None:
            self.op.blocked()  # a blocking save: the caller waited for all of it
        self.op.close(ok=True)
        if self.group.is_primary():
            self.op.log()
        return self.final

    def _finish(self) -> None:
        group, final, timeout = self.group, self.final, self.timeout
        try:
            failure: Exception | None = None
            done = 0
            try:
                for part in self.pending:
                    part.wait(timeout)
                    done += 1
            except Exception as e:
                failure = e
                # The parts not finished may still write: let them land before the workspace
                # is removed, or they would recreate it.
                workers.settle_all(self.pending[done:], timeout)
            # The primary commits, or reports why not; every process gets the same outcome.
            _agree(group, f"commit:{final}", failure, timeout, then=self.commit)
        except BaseException:
            self._abandon(f"abandon-commit:{final}")
            raise
        finally:
            with _in_flight_lock:
                _in_flight.discard(final)

    def commit(self) -> None:
        _commit(
            self.tmp,
            self.final,
            self.handlers,
            self.init_ns,
            self.custom_json,
            self.metrics_json,
            self.overwrite,
            self.workspace,
        )
        self.prepared = False

    def _abandon(self, name: str) -> None:
        """Remove the workspace once every controller process has settled its own writes (a late
        write elsewhere would recreate it); a process that died is waited for at most
        ``min(timeout, 10s)``. The caller raises its error either way."""
        with contextlib.suppress(Exception):
            self.group.barrier(name, min(self.timeout, 10.0))
        if self.prepared:
            self.prepared = False
            self.workspace.abandon()


def _agree(
    group: HostGroup,
    name: str,
    failure: Exception | None,
    timeout: float,
    then: Callable[[], None] | None = None,
) -> None:
    """Leave a step with the primary's outcome in every controller process (one controller:
    raise ``failure``, else run ``then``).

    The primary raises its ``failure`` or runs ``then``, and publishes the outcome. A process
    with a failure of its own (a failed sync, which the primary has too, or one the primary
    cannot know) takes the primary's outcome if it is there at once, so that every process's
    calls stay in step, and raises its own failure without waiting for a primary that may be
    gone.
    """
    if failure is not None and not group.is_primary():
        with contextlib.suppress(Exception):
            group.broadcast(name, None, min(timeout, 1.0))
        raise failure

    def outcome() -> None:
        if failure is not None:
            raise failure
        if then is not None:
            then()

    _dispatch.shared(group, name, outcome, timeout)


def _commit(
    tmp: Any,
    final: Any,
    handlers: Mapping[str, Any],
    init_ns: int,
    custom_json: str,
    metrics: Any,
    overwrite: bool,
    workspace: Any,
) -> None:
    """Write the checkpoint's own files into the workspace, the commit marker last, and make it
    visible (``workspace.publish``: the rename into place, or nothing more on object stores)."""
    workspace.check()
    fmt.write_file(tmp / fmt.ORBAX_MARKER, b"")
    fmt.write_json(
        tmp / fmt.CHECKPOINT_METADATA,
        {
            "item_handlers": {name: h.typestr for name, h in handlers.items()},
            "metrics": metrics,
            "performance_metrics": {},
            "init_timestamp_nsecs": init_ns,
            "commit_timestamp_nsecs": time.time_ns(),
            "custom_metadata": json.loads(custom_json),
        },
    )
    fmt.Checksums.compute(tmp).write()  # every file but array chunks, which carry their own
    workspace.check()
    fmt.write_file(tmp / fmt.COMMIT_MARKER, f"Checkpoint commit was successful to {final}")
    workspace.publish()


# ------------------------------------------------------------------------------------------


def read_checkpoint_metadata(path: Path) -> dict[str, Any]:
    return _layout.read_metadata(path)


def load_checkpointables(
    path: str | os.PathLike[str],
    abstracts: Mapping[str, Any] | None,
    *,
    partial: bool = False,
    default_pytree: bool = False,
) -> dict[str, Any]:
    """Load the named checkpointables (all when None). ``default_pytree``: ``abstracts`` holds
    one entry under the key None, meaning the checkpoint's main pytree."""
    options = _options.current()
    root = _paths.as_path(path)
    leaves: list[Any] = []
    for a in (abstracts or {}).values():
        if a is not None and not isinstance(a, _handlers.StatefulCheckpointable):
            leaves.extend(
                jax.tree_util.tree_leaves(
                    a, is_leaf=lambda x: hasattr(x, "__milepost_host_group__")
                )
            )
    group = _dispatch.check_storage(_dispatch.host_group_for_abstract(leaves), root)
    timeout = options.async_.timeout_secs
    _, items, identity, checksums = _dispatch.shared(
        group, f"ckpt-meta:{root}", lambda: _read_items(root), timeout
    )
    if default_pytree:
        assert abstracts is not None
        abstracts = {_layout.main_tree(root, items): abstracts[None]}
    wanted = dict(abstracts) if abstracts is not None else {n: None for n in items}
    unknown = [n for n in wanted if n not in items]
    if unknown:
        raise KeyError(
            f"checkpoint {root} has no checkpointable(s) {unknown}; it has {sorted(items)}"
        )
    call = _handlers.LoadCall(options=options, group=group, partial=partial)
    out = {}
    try:
        with fmt.verifying(checksums):
            for name, abstract in wanted.items():
                handler = _handlers.resolve_for_load(
                    name, items[name].handler, abstract, options.handlers
                )
                folder = items[name].folder
                _dispatch.shared(
                    group,
                    f"check-files:{folder}",
                    functools.partial(_check_own_files, folder, handler, checksums),
                    timeout,
                )
                out[name] = handler.load(folder, abstract, call)
    except Exception as e:
        if _identity(root) != identity:  # local: the other processes may not be here
            raise _replaced(root) from e
        raise
    # Every byte came from the checkpoint that was there when the load started, or it was
    # replaced (an overwrite, a deletion) meanwhile and the result may mix two: refuse it.
    if _dispatch.shared(
        group, f"ckpt-changed:{root}", lambda: _identity(root) != identity, timeout
    ):
        raise _replaced(root)
    return out


def _check_own_files(folder: Path, handler: Any, checksums: fmt.Checksums | None) -> None:
    """A handler that reads its files itself (not the built-in pytree or JSON ones, which check
    what they read) gets its folder only once every committed file in it is checked."""
    if checksums is not None and not isinstance(
        handler, _handlers.PyTreeHandler | _handlers.JsonHandler
    ):
        checksums.check_folder(folder)


@contextlib.contextmanager
def _unchanged(root: Path) -> Iterator[None]:
    """Raise CheckpointReplacedError if the checkpoint at ``root`` was replaced or deleted while
    the block ran (whatever the block raised then: it may have read parts of two checkpoints)."""
    identity = _identity(root)
    try:
        yield
    except Exception as e:
        if _identity(root) != identity:
            raise _replaced(root) from e
        raise
    if _identity(root) != identity:
        raise _replaced(root)


def _read_items(
    root: Path,
) -> tuple[dict[str, Any], dict[str, _layout.Item], tuple[Any, ...], fmt.Checksums | None]:
    _layout.require(root)
    fmt.check_contained(root)  # before any file is opened (a FIFO would block the open forever)
    identity = _identity(root)
    with _unchanged(root):
        checksums = fmt.Checksums.read(root)
        with fmt.verifying(checksums):
            meta = read_checkpoint_metadata(root)
    return meta, _layout.items(root, meta), identity, checksums


def _identity(root: Path) -> tuple[Any, ...]:
    """What changes when the checkpoint at ``root`` is replaced: its folder and its commit."""
    try:
        if isinstance(root, Path):
            st = os.stat(root)
            where: tuple[Any, ...] = (st.st_dev, st.st_ino)
            if not (
                root / fmt.CHECKPOINT_METADATA
            ).is_file():  # (opening a FIFO would wait forever)
                return (*where, "no metadata file")
        else:  # object stores: the generation of the commit marker, which every save writes anew
            where = ((root / fmt.COMMIT_MARKER).generation(),)
        meta = json.loads((root / fmt.CHECKPOINT_METADATA).read_bytes())
        stamps = (
            (meta.get("init_timestamp_nsecs"), meta.get("commit_timestamp_nsecs"))
            if isinstance(meta, dict)
            else ()
        )
    except (OSError, ValueError):
        return ("unreadable",)
    return (*where, *stamps)


def _replaced(root: Path) -> CheckpointReplacedError:
    return CheckpointReplacedError(
        f"the checkpoint at {root} was replaced or deleted while it was being loaded (an overwrite, or retention, in "
        "another process), so what was read may mix two checkpoints and was discarded. Load it again"
    )


class CheckpointMetadata:
    """What ``milepost.metadata`` returns: the tree and the checkpoint-level facts.

    ``tree`` is the main pytree (``state``, or the only one) with a :class:`LeafMetadata` per
    leaf; ``checkpointables`` has every checkpointable's metadata by name; ``custom_metadata``,
    ``metrics`` and the timestamps come from the checkpoint's ``_CHECKPOINT_METADATA``. Its
    ``repr`` (and its table in a notebook) lists every leaf with its bytes.

    >>> meta = milepost.metadata("/ckpt/100")
    >>> meta.tree["params"]["w"].shape, meta.nbytes, meta.custom_metadata
    """

    def __init__(
        self,
        path: Path,
        meta: dict[str, Any],
        checkpointables: dict[str, Any],
        tree_name: str | None,
    ) -> None:
        self.path = path
        self.checkpointables = checkpointables
        self.tree = checkpointables.get(tree_name) if tree_name else None
        self.custom_metadata: dict[str, Any] = meta.get("custom_metadata") or {}
        self.metrics: dict[str, Any] = meta.get("metrics") or {}
        self.init_timestamp_nsecs: int | None = meta.get("init_timestamp_nsecs")
        self.commit_timestamp_nsecs: int | None = meta.get("commit_timestamp_nsecs")
        handlers = meta.get("item_handlers") or {}
        self.item_handlers: dict[str, str] = (
            handlers if isinstance(handlers, dict) else {_layout.DEFAULT_ITEM: handlers}
        )

    def leaves(self, checkpointable: str | None = None) -> list[Any]:
        """Every :class:`LeafMetadata` of the main tree (or of the pytree ``checkpointable``),
        in tree order."""
        from milepost import _views

        tree = self.tree if checkpointable is None else self.checkpointables[checkpointable]
        return _views.flat_leaves(tree)

    @property
    def nbytes(self) -> int:
        """Bytes of every array of every pytree checkpointable."""
        from milepost import _views

        return sum(
            _views.totals(_views.flat_leaves(part))[2] for part in self.checkpointables.values()
        )

    def _facts(self) -> dict[str, str]:
        from milepost import _views

        facts = {"path": str(self.path)}
        if self.commit_timestamp_nsecs:
            facts["committed"] = _views.timestamp_str(self.commit_timestamp_nsecs)
            if self.init_timestamp_nsecs:
                facts["save took"] = (
                    f"{(self.commit_timestamp_nsecs - self.init_timestamp_nsecs) / 1e9:.2f} s"
                )
        facts["checkpointables"] = ", ".join(
            f"{n} ({self.item_handlers.get(n, '?').rpartition('.')[2]})"
            for n in self.checkpointables
        )
        facts["custom_metadata"] = _views.short_json(self.custom_metadata)
        if self.metrics:
            facts["metrics"] = _views.short_json(self.metrics)
        return facts

    def _tables(self) -> list[tuple[str, list[Any]]]:
        from milepost import _views

        out = []
        for name, part in self.checkpointables.items():
            leaves = _views.flat_leaves(part)
            if leaves:
                n, arrays, nbytes = _views.totals(leaves)
                out.append(
                    (f"{name}: {n} leaves, {arrays} arrays, {_views.human_bytes(nbytes)}", leaves)
                )
        return out

    def __repr__(self) -> str:
        from milepost import _views

        lines = [f"CheckpointMetadata({str(self.path)!r})"]
        lines += [f"  {k}: {v}" for k, v in self._facts().items() if k != "path"]
        text = "\n".join(lines)
        for title, leaves in self._tables():
            text += "\n" + _views.text_table(
                _views.LEAF_COLUMNS, [_views.leaf_row(leaf) for leaf in leaves], title=title
            )
        return text

    def _repr_html_(self) -> str:
        from milepost import _views

        out = _views.html_fields("CheckpointMetadata", self._facts())
        for title, leaves in self._tables():
            out += _views.html_table(
                _views.LEAF_COLUMNS, [_views.leaf_row(leaf) for leaf in leaves], title=title
            )
        return out


def metadata(path: str | os.PathLike[str]) -> CheckpointMetadata:
    options = _options.current()
    root = _paths.as_path(path)
    group = _dispatch.check_storage(_dispatch.host_group_for([]), root)

    def read() -> CheckpointMetadata:
        with _unchanged(root):
            meta, items, _, checksums = _read_items(root)
            parts = {}
            with fmt.verifying(checksums):
                for name, item in items.items():
                    handler = _handlers.resolve_for_load(name, item.handler, None, options.handlers)
                    _check_own_files(item.folder, handler, checksums)
                    parts[name] = handler.metadata(item.folder)
        try:
            tree_name: str | None = _layout.main_tree(root, items)
        except CheckpointNotFoundError:
            tree_name = None
        return CheckpointMetadata(root, meta, parts, tree_name)

    return _dispatch.shared(group, f"metadata:{root}", read, options.async_.timeout_secs)
