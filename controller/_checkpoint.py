"""Save, load and inspect whole checkpoints: temporary directory, handlers, finalize, commit."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent import futures
from pathlib import Path
from typing import Any

import jax

from milepost import _background, _dispatch, _handlers, _layout, _options, _ownership, workers
from milepost import _format as fmt
from milepost._errors import (
    CheckpointExistsError,
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
    """Validate, prepare the temporary directory, stage every checkpointable (the blocking
    part), and finish in the background (``asynchronous``) or before returning."""
    options = _options.current()
    final = Path(path).absolute()
    if final.name.endswith(fmt.TMP_SUFFIX) or _ownership.NEW_MARKER in final.name:
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
    with _in_flight_lock:
        if final in _in_flight:
            raise SaveInProgressError(f"another save to {final} is still in flight; wait for it (handle.result()) first")
        _in_flight.add(final)
    save = _Save(final, handlers, group, options, overwrite, custom_json, metrics_json)
    try:
        save.stage(objs, copy=asynchronous)
    except BaseException:
        with _in_flight_lock:
            _in_flight.discard(final)
        raise
    if asynchronous:
        return SaveHandle(final, _background.saves.submit(str(final), save.finish, save.timeout))
    future: futures.Future[Path] = futures.Future()
    future.set_result(save.finish())
    return SaveHandle(final, future)


class _Save:
    """One save of a checkpoint: its temporary directory, its writer lock (on the primary), the
    pending writes of its checkpointables, and the commit."""

    def __init__(
        self,
        final: Path,
        handlers: Mapping[str, Any],
        group: HostGroup,
        options: _options.Options,
        overwrite: bool,
        custom_json: str,
        metrics_json: Any,
    ) -> None:
        self.final = final
        self.tmp = final.with_name(final.name + fmt.TMP_SUFFIX)
        self.handlers = handlers
        self.group = group
        self.options = options
        self.timeout = options.async_.timeout_secs
        self.overwrite = overwrite
        self.custom_json = custom_json
        self.metrics_json = metrics_json
        self.pending: list[workers.PendingWrite[Any]] = []
        self.lock: _ownership.Locked | None = None
        """The lock of the temporary directory, held by the primary from the moment it exists
        until it is committed or removed."""
        self.identity: dict[str, tuple[int, int]] = {}
        """(device, inode) of the temporary directory and its checkpointable folders, as created:
        the commit publishes only a directory that is still the one this save made."""
        self.init_ns = 0

    # -- the blocking part --------------------------------------------------------------
    def prepare(self) -> None:
        """On the primary: check the path, take the writer lock, create the temporary directory."""
        final, tmp = self.final, self.tmp
        if final.parent.exists() and not final.parent.is_dir():
            raise NotADirectoryError(f"{final.parent} is a file; a checkpoint's parent must be a directory")
        self._check_final()
        final.parent.mkdir(parents=True, exist_ok=True)
        # Locked from the moment it appears; a leftover of a dead writer is removed first.
        self.lock, _ = _ownership.create_locked(tmp, wait_secs=self.options.saving.wait_for_writer_secs)
        try:
            self._check_final()  # another writer may have committed while we waited
            for name in self.handlers:
                (tmp / name).mkdir()
            self.identity = {"": _inode(tmp), **{name: _inode(tmp / name) for name in self.handlers}}
        except BaseException:
            remove_tree(tmp)
            self._release()
            raise

    def _check_final(self) -> None:
        final = self.final
        if final.exists() or final.is_symlink():
            if not self.overwrite:
                raise CheckpointExistsError(
                    f"a checkpoint already exists at {final}; pass overwrite=True to replace it, or choose another path"
                )
            if not _layout.is_committed(final) or final.is_symlink():
                raise CheckpointExistsError(
                    f"{final} exists and is not a committed checkpoint; milepost will not overwrite it. Remove it or choose another path"
                )

    def stage(self, objs: Mapping[str, Any], copy: bool) -> None:
        group, final, timeout = self.group, self.final, self.timeout
        prepared = False
        try:
            # The primary checks the path, then creates the temporary directory; the other
            # controller processes wait for its outcome, so none writes before the directory
            # exists, and all raise the same error.
            _dispatch.shared(group, f"prepare:{final}", self.prepare, timeout)
            prepared = True
            self.init_ns = time.time_ns()
            call = _handlers.SaveCall(options=self.options, group=group, copy=copy)
            failure: Exception | None = None
            try:
                for name, obj in objs.items():
                    part = _handlers.as_pending(self.handlers[name].save(self.tmp / name, obj, call))
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
    def finish(self) -> Path:
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
                # The parts not finished may still write: let them land before the temporary
                # directory is removed, or they would recreate it.
                workers.settle_all(self.pending[done:], timeout)
            # The primary commits, or reports why not; every process gets the same outcome.
            _agree(group, f"commit:{final}", failure, timeout, then=self.commit)
            return final
        except BaseException:
            self._abandon(f"abandon-commit:{final}")
            raise
        finally:
            with _in_flight_lock:
                _in_flight.discard(final)

    def commit(self) -> None:
        _commit(
            self.tmp, self.final, self.handlers, self.init_ns, self.custom_json, self.metrics_json, self.overwrite,
            self.identity,
        )
        self._release()  # on failure, _abandon releases it after removing the directory

    def _abandon(self, name: str) -> None:
        """Remove the temporary directory once every controller process has settled its own
        writes (a late write elsewhere would recreate it); a process that died is waited for at
        most ``min(timeout, 10s)``. The caller raises its error either way."""
        with contextlib.suppress(Exception):
            self.group.barrier(name, min(self.timeout, 10.0))
        if self.group.is_primary() and self.lock is not None:
            remove_tree(self.tmp)
        self._release()

    def _release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def _inode(path: Path) -> tuple[int, int]:
    st = os.stat(path, follow_symlinks=False)
    return st.st_dev, st.st_ino


remove_tree = _ownership.remove_tree


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


def _renameat2(a: Path, b: Path, flag: int) -> bool:
    """Linux ``renameat2`` with ``flag``; False where the system or the file system lacks it."""
    if sys.platform != "linux":
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), flag) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories atomically (``RENAME_EXCHANGE``); False where unsupported."""
    return _renameat2(a, b, 2)


def _rename_new(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``, failing if anything is at ``final`` (``RENAME_NOREPLACE``;
    elsewhere a check just before the rename)."""
    try:
        if _renameat2(tmp, final, 1):
            return
    except FileExistsError:
        raise CheckpointExistsError(
            f"a checkpoint appeared at {final} while this save ran (written by another program); nothing was "
            "replaced. Pass overwrite=True to replace it, or choose another path"
        ) from None
    if final.exists() or final.is_symlink():
        raise CheckpointExistsError(f"a checkpoint appeared at {final} while this save ran; nothing was replaced")
    os.rename(tmp, final)


def _check_identity(tmp: Path, identity: Mapping[str, tuple[int, int]]) -> None:
    """The temporary directory and its checkpointable folders must be the ones this save made:
    removed or replaced from outside, the checkpoint would be incomplete."""
    for name, expected in identity.items():
        where = tmp / name if name else tmp
        try:
            same = _inode(where) == expected
        except FileNotFoundError:
            same = False
        if not same:
            raise OSError(
                errno.ESTALE,
                f"{where} was removed or replaced by someone else while this save ran, so its contents cannot be "
                f"trusted; nothing was committed to {tmp.name.removesuffix(fmt.TMP_SUFFIX)}. Save again",
                str(where),
            )


def _commit(
    tmp: Path,
    final: Path,
    handlers: Mapping[str, Any],
    init_ns: int,
    custom_json: str,
    metrics: Any,
    overwrite: bool,
    identity: Mapping[str, tuple[int, int]],
) -> None:
    _check_identity(tmp, identity)
    _ownership.drop_owner_file(tmp)
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
    fmt.write_file(tmp / fmt.COMMIT_MARKER, f"Checkpoint commit was successful to {final}")
    fmt.fsync_tree(tmp)
    _check_identity(tmp, identity)
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
        _rename_new(tmp, final)
    except BaseException:
        if old is not None:
            os.rename(old, final)  # put the previous checkpoint back
        raise
    fmt.fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


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
    root = Path(path).absolute()
    leaves: list[Any] = []
    for a in (abstracts or {}).values():
        if a is not None and not isinstance(a, _handlers.StatefulCheckpointable):
            leaves.extend(jax.tree_util.tree_leaves(a, is_leaf=lambda x: hasattr(x, "__milepost_host_group__")))
    group = _dispatch.host_group_for_abstract(leaves)
    timeout = options.async_.timeout_secs
    _, items, identity, checksums = _dispatch.shared(group, f"ckpt-meta:{root}", lambda: _read_items(root), timeout)
    if default_pytree:
        assert abstracts is not None
        abstracts = {_layout.main_tree(root, items): abstracts[None]}
    wanted = dict(abstracts) if abstracts is not None else {n: None for n in items}
    unknown = [n for n in wanted if n not in items]
    if unknown:
        raise KeyError(f"checkpoint {root} has no checkpointable(s) {unknown}; it has {sorted(items)}")
    call = _handlers.LoadCall(options=options, group=group, partial=partial)
    out = {}
    try:
        with fmt.verifying(checksums):
            for name, abstract in wanted.items():
                handler = _handlers.resolve_for_load(name, items[name].handler, abstract, options.handlers)
                folder = items[name].folder
                _dispatch.shared(group, f"check-files:{folder}", functools.partial(_check_own_files, folder, handler, checksums), timeout)
                out[name] = handler.load(folder, abstract, call)
    except Exception as e:
        if _identity(root) != identity:  # local: the other processes may not be here
            raise _replaced(root) from e
        raise
    # Every byte came from the checkpoint that was there when the load started, or it was
    # replaced (an overwrite, a deletion) meanwhile and the result may mix two: refuse it.
    if _dispatch.shared(group, f"ckpt-changed:{root}", lambda: _identity(root) != identity, timeout):
        raise _replaced(root)
    return out


def _check_own_files(folder: Path, handler: Any, checksums: fmt.Checksums | None) -> None:
    """A handler that reads its files itself (not the built-in pytree or JSON ones, which check
    what they read) gets its folder only once every committed file in it is checked."""
    if checksums is not None and not isinstance(handler, _handlers.PyTreeHandler | _handlers.JsonHandler):
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


def _read_items(root: Path) -> tuple[dict[str, Any], dict[str, _layout.Item], tuple[Any, ...], fmt.Checksums | None]:
    identity = _identity(root)
    with _unchanged(root):
        _layout.require(root)
        fmt.check_contained(root)
        checksums = fmt.Checksums.read(root)
        with fmt.verifying(checksums):
            meta = read_checkpoint_metadata(root)
    return meta, _layout.items(root, meta), identity, checksums


def _identity(root: Path) -> tuple[Any, ...]:
    """What changes when the checkpoint at ``root`` is replaced: its folder and its commit."""
    try:
        st = os.stat(root)
        meta = json.loads((root / fmt.CHECKPOINT_METADATA).read_bytes())
        stamps = (meta.get("init_timestamp_nsecs"), meta.get("commit_timestamp_nsecs")) if isinstance(meta, dict) else ()
    except (OSError, ValueError):
        return ("unreadable",)
    return (st.st_dev, st.st_ino, *stamps)


def _replaced(root: Path) -> CheckpointReplacedError:
    return CheckpointReplacedError(
        f"the checkpoint at {root} was replaced or deleted while it was being loaded (an overwrite, or retention, in "
        "another process), so what was read may mix two checkpoints and was discarded. Load it again"
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
        handlers = meta.get("item_handlers") or {}
        self.item_handlers: dict[str, str] = handlers if isinstance(handlers, dict) else {_layout.DEFAULT_ITEM: handlers}

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
