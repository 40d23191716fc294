"""Save, load and inspect whole checkpoints: temporary directory, handlers, finalize, commit."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent import futures
from pathlib import Path
from typing import Any

import jax

from milepost import _background, _dispatch, _handlers, _options, workers
from milepost import _format as fmt
from milepost._errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
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
    failure on your thread; ``add_done_callback(fn)`` calls ``fn(handle)`` when it ends."""

    def __init__(self, path: Path, future: futures.Future[Path]) -> None:
        self.path = path
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> Path:
        try:
            return self._future.result(timeout)
        except futures.TimeoutError as e:
            raise TimeoutError(f"the save to {self.path} did not finish within {timeout}s; it is still running") from e

    def add_done_callback(self, fn: Callable[[SaveHandle], Any]) -> None:
        """Call ``fn(self)`` once the save committed or failed (at once if it already has), on
        the thread that finished it. Exceptions ``fn`` raises are logged, not raised."""
        self._future.add_done_callback(lambda _: fn(self))

    def __repr__(self) -> str:
        if not self._future.done():
            state = "running"
        elif self._future.exception() is None:
            state = "committed"
        else:
            error = self._future.exception()
            state = f"failed: {type(error).__name__}: {error}"
        return f"SaveHandle({str(self.path)!r}, {state})"


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name or name.startswith("_"):
        raise InvalidKeyError(
            f"checkpointable name {name!r} is not a valid folder name (non-empty, no '/', not starting with '_'); rename it"
        )


def _all_leaves(objs: Mapping[str, Any]) -> list[Any]:
    out: list[Any] = []
    for obj in objs.values():
        if isinstance(obj, _handlers.StatefulCheckpointable):
            continue
        out.extend(jax.tree_util.tree_leaves(obj, is_leaf=lambda x: x is None or hasattr(x, "__milepost_host_group__")))
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
    options = _options.current()
    final = Path(path).absolute()
    if final.name.endswith(fmt.TMP_SUFFIX):
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
    handlers = {name: _handlers.resolve_for_save(name, obj, options.handlers) for name, obj in objs.items()}
    group = _dispatch.host_group_for(_all_leaves(objs))
    timeout = options.async_.timeout_secs

    tmp = final.with_name(final.name + fmt.TMP_SUFFIX)
    with _in_flight_lock:
        if final in _in_flight:
            raise SaveInProgressError(f"another save to {final} is still in flight; wait for it (handle.result()) first")
        _in_flight.add(final)
    created = False
    prepared = False
    pending: list[workers.PendingWrite[Any]] = []

    def prepare() -> None:
        nonlocal created
        if final.exists():
            if not overwrite:
                raise CheckpointExistsError(
                    f"a checkpoint already exists at {final}; pass overwrite=True to replace it, or choose another path"
                )
            if not fmt.is_checkpoint(final):
                raise CheckpointExistsError(
                    f"{final} exists and is not a committed checkpoint; milepost will not overwrite it. Remove it or choose another path"
                )
        if final.parent.exists() and not final.parent.is_dir():
            raise NotADirectoryError(f"{final.parent} is a file; a checkpoint's parent must be a directory")
        created = True
        if tmp.exists():
            shutil.rmtree(tmp)  # left by a save that died: it was never committed
        tmp.mkdir(parents=True)
        for name in objs:
            (tmp / name).mkdir()

    try:
        # The primary checks for an existing checkpoint, then creates the temporary directory;
        # the other controller processes wait for its outcome, so none writes before the
        # directory exists, and all raise the same error.
        _dispatch.shared(group, f"prepare:{final}", prepare, timeout)
        prepared = True  # in every process: the primary created the temporary directory
        init_ns = time.time_ns()
        call = _handlers.SaveCall(options=options, group=group, copy=asynchronous)
        staging_failure: Exception | None = None
        try:
            for name, obj in objs.items():
                part = _handlers.as_pending(handlers[name].save(tmp / name, obj, call))
                if part is not None:
                    pending.append(part)
        except Exception as e:
            staging_failure = e
        # The primary may fail alone here (its own leaves, a stateful checkpointable).
        _agree(group, f"staged:{final}", staging_failure, timeout)
    except BaseException:
        workers.settle_all(pending, timeout)
        with _in_flight_lock:
            _in_flight.discard(final)
        if prepared:
            _abandon(group, f"abandon-staged:{final}", tmp, timeout)
        elif created:  # the primary failed while creating it
            shutil.rmtree(tmp, ignore_errors=True)
        raise

    def finalize() -> Path:
        try:
            failure: Exception | None = None
            done = 0
            try:
                for part in pending:
                    part.wait(timeout)
                    done += 1
            except Exception as e:
                failure = e
                # The parts not finished may still write: let them land before the temporary
                # directory is removed, or they would recreate it.
                workers.settle_all(pending[done:], timeout)

            def commit() -> None:
                _commit(tmp, final, handlers, init_ns, custom_json, metrics_json, overwrite)

            # The primary commits, or reports why not; every process gets the same outcome.
            _agree(group, f"commit:{final}", failure, timeout, then=commit)
            return final
        except BaseException:
            _abandon(group, f"abandon-commit:{final}", tmp, timeout)
            raise
        finally:
            with _in_flight_lock:
                _in_flight.discard(final)

    if asynchronous:
        return SaveHandle(final, _background.saves.submit(str(final), finalize, timeout))
    future: futures.Future[Path] = futures.Future()
    future.set_result(finalize())
    return SaveHandle(final, future)


def _agree(group: HostGroup, name: str, failure: Exception | None, timeout: float, then: Callable[[], None] | None = None) -> None:
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


def _abandon(group: HostGroup, name: str, tmp: Path, timeout: float) -> None:
    """Remove a failed save's temporary directory once every controller process has settled its
    own writes (a late write elsewhere would recreate it). A process that died is waited for at
    most ``min(timeout, 10s)``; the caller raises its error either way."""
    with contextlib.suppress(Exception):
        group.barrier(name, min(timeout, 10.0))
    if group.is_primary():
        shutil.rmtree(tmp, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    system or the file system cannot."""
    if sys.platform != "linux":
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _commit(
    tmp: Path,
    final: Path,
    handlers: Mapping[str, Any],
    init_ns: int,
    custom_json: str,
    metrics: Any,
    overwrite: bool,
) -> None:
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
    fmt.write_file(tmp / fmt.COMMIT_MARKER, f"Checkpoint commit was successful to {final}")
    fmt.fsync_tree(tmp)
    if overwrite and final.exists() and _exchange(tmp, final):
        # One atomic step: the final path holds the old checkpoint or the new one, never
        # nothing; the old one, now at the temporary path, is never loaded and is removed.
        fmt.fsync_dir(final.parent)
        shutil.rmtree(tmp, ignore_errors=True)
        return
    old = None
    if overwrite and final.exists():
        old = final.with_name(f"{final.name}.milepost-replaced-{os.getpid()}-{time.time_ns()}")
        os.rename(final, old)
    try:
        os.rename(tmp, final)
    except BaseException:
        if old is not None:
            os.rename(old, final)  # put the previous checkpoint back
        raise
    fmt.fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------------------------


def read_checkpoint_metadata(path: Path) -> dict[str, Any]:
    fmt.require_checkpoint(path)
    meta = fmt.read_json_object(path / fmt.CHECKPOINT_METADATA, "checkpoint metadata")
    if not fmt.is_checkpoint(path):
        raise CheckpointNotFoundError(
            f"{path} has no commit marker ({fmt.COMMIT_MARKER}): the save that wrote it did not finish. Load another checkpoint."
        )
    return meta


def _item_names(path: Path, meta: dict[str, Any]) -> dict[str, str | None]:
    raw = meta.get("item_handlers") or {}
    if not isinstance(raw, dict) or not all(isinstance(k, str) for k in raw):
        raise CorruptCheckpointError(
            f"'item_handlers' in {path / fmt.CHECKPOINT_METADATA} is not a mapping of checkpointable names to "
            f"handlers (got {type(raw).__name__}); the checkpoint is damaged or of an unsupported layout"
        )
    items = dict(raw)
    if not items:  # very old layouts: every folder is a checkpointable
        items = {p.name: None for p in path.iterdir() if p.is_dir()}
    return items


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
    root = Path(path).absolute()
    leaves: list[Any] = []
    for a in (abstracts or {}).values():
        if a is not None and not isinstance(a, _handlers.StatefulCheckpointable):
            leaves.extend(jax.tree_util.tree_leaves(a, is_leaf=lambda x: hasattr(x, "__milepost_host_group__")))
    group = _dispatch.host_group_for_abstract(leaves)
    timeout = options.async_.timeout_secs
    meta, items = _dispatch.shared(group, f"ckpt-meta:{root}", lambda: _read_items(root), timeout)
    if default_pytree:
        assert abstracts is not None
        abstracts = {default_pytree_name(root, meta): abstracts[None]}
    wanted = dict(abstracts) if abstracts is not None else {n: None for n in items}
    unknown = [n for n in wanted if n not in items]
    if unknown:
        raise KeyError(f"checkpoint {root} has no checkpointable(s) {unknown}; it has {sorted(items)}")
    call = _handlers.LoadCall(options=options, group=group, partial=partial)
    out = {}
    for name, abstract in wanted.items():
        handler = _handlers.resolve_for_load(name, items[name], abstract, options.handlers)
        out[name] = handler.load(root / name, abstract, call)
    return out


def _read_items(root: Path) -> tuple[dict[str, Any], dict[str, str | None]]:
    meta = read_checkpoint_metadata(root)
    return meta, _item_names(root, meta)


def default_pytree_name(path: Path, meta: dict[str, Any]) -> str:
    items = _item_names(path, meta)
    if "state" in items:
        return "state"
    trees = [n for n, t in items.items() if t is None or str(t).endswith("PyTreeHandler")]
    if len(trees) == 1:
        return trees[0]
    raise CheckpointNotFoundError(
        f"checkpoint {path} has no 'state' checkpointable (it has {sorted(items)}); use load_checkpointables"
    )


class CheckpointMetadata:
    """What ``milepost.metadata`` returns: the tree and the checkpoint-level facts."""

    def __init__(self, path: Path, meta: dict[str, Any], checkpointables: dict[str, Any], tree_name: str | None) -> None:
        self.path = path
        self.checkpointables = checkpointables
        self.tree = checkpointables.get(tree_name) if tree_name else None
        self.custom_metadata: dict[str, Any] = meta.get("custom_metadata") or {}
        self.metrics: dict[str, Any] = meta.get("metrics") or {}
        self.init_timestamp_nsecs: int | None = meta.get("init_timestamp_nsecs")
        self.commit_timestamp_nsecs: int | None = meta.get("commit_timestamp_nsecs")
        self.item_handlers: dict[str, str] = meta.get("item_handlers") or {}

    def __repr__(self) -> str:
        return (
            f"CheckpointMetadata(path={str(self.path)!r}, checkpointables={sorted(self.checkpointables)}, "
            f"custom_metadata={self.custom_metadata}, commit_timestamp_nsecs={self.commit_timestamp_nsecs})"
        )


def metadata(path: str | os.PathLike[str]) -> CheckpointMetadata:
    options = _options.current()
    root = Path(path).absolute()
    group = _dispatch.host_group_for([])

    def read() -> CheckpointMetadata:
        meta = read_checkpoint_metadata(root)
        items = _item_names(root, meta)
        parts = {}
        for name, typestr in items.items():
            handler = _handlers.resolve_for_load(name, typestr, None, options.handlers)
            parts[name] = handler.metadata(root / name)
        try:
            tree_name: str | None = default_pytree_name(root, meta)
        except CheckpointNotFoundError:
            tree_name = None
        return CheckpointMetadata(root, meta, parts, tree_name)

    return _dispatch.shared(group, f"metadata:{root}", read, options.async_.timeout_secs)
