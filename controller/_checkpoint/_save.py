"""Saving a whole checkpoint: take the path, stage every checkpointable (the blocking part),
then wait for the writes and commit (in the background for ``save_async``).

Waiting only waits: every checkpointable's writes are durable before the commit begins. The
commit (``_commit``, on the primary) writes each tree's format files, merges its databases,
reads it back, writes the checkpoint's own files and checksums, the commit marker last, and
publishes it: renamed into place on a local disk, visible by its marker on an object store.
Every controller process takes the primary's outcome of each step, so all of them succeed or
all raise the same error.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent import futures
from typing import Any

import jax

from milepost import _hosts, _options, _progress, workers
from milepost._checkpoint._background import SAVES
from milepost._checkpoint._calls import SaveCall, WrittenTree, as_pending
from milepost._checkpoint._commit import commit
from milepost._checkpoint._handle import Handle
from milepost._checkpoint._handlers import holds_no_tree, resolve_for_save
from milepost._checkpoint._pytree_save import PendingTree
from milepost._errors import InvalidKeyError, SaveCancelledError, SaveInProgressError
from milepost._storage import LEASE_SUFFIX, NEW_MARKER, LocalWorkspace, for_path
from milepost.colocated import HostGroup
from milepost.workers import ObjectPath, StoragePath, as_path
from milepost.workers import format as fmt

_in_flight: set[StoragePath] = set()
_cleaning: dict[StoragePath, futures.Future[None]] = {}
"""Failed saves that ran out of time, still waiting in the background for their writes to
stop before they remove what they wrote (and release the path)."""
_in_flight_lock = threading.Lock()


def saves_in_flight(under: StoragePath) -> set[str]:
    """Names of the entries of folder ``under`` that a save of this process is writing now (or a
    failed one is cleaning up)."""
    with _in_flight_lock:
        return {p.name for p in (*_in_flight, *_cleaning) if p.parent == under}


def _wait_for_cleanup(final: StoragePath) -> None:
    """A new save of a path whose last save failed out of time waits until that one's writes
    stopped and it removed them (at most as long as the storage may take to give up)."""
    with _in_flight_lock:
        cleaning = _cleaning.get(final)
    if cleaning is None:
        return
    limit = workers.storage_budget_secs() + 30.0
    try:
        cleaning.result(timeout=limit)
    except futures.TimeoutError:
        raise SaveInProgressError(
            f"the last save to {final} failed, and its writes had still not stopped after "
            f"{limit:g}s (the storage does not answer them); save elsewhere, or later"
        ) from None
    except Exception:
        pass  # its own failure was reported; what it left is taken over by this save


class SaveHandle(Handle[StoragePath]):
    """The background part of a save. ``result()`` waits for the commit and re-raises its
    failure on your thread; ``add_done_callback(fn)`` calls ``fn(handle)`` when it ends
    (:func:`milepost.wait_for_saves` returns only after the callbacks ran); ``cancel()`` stops
    it before its commit, if it is not too late.

    >>> handle = milepost.save_async("/ckpt/200", state)
    >>> handle
    SaveHandle('/ckpt/200', running: 96.0 MiB of 512.0 MiB written, 0.3 s)
    >>> handle.result()              # waits for the commit; re-raises a failure
    >>> handle
    SaveHandle('/ckpt/200', committed: 512.0 MiB in 1.21 s (444 MB/s), blocking 0.118 s)
    """

    _doing = "save to"
    _moved = "written"
    _ended = "committed"

    def __init__(
        self,
        path: StoragePath,
        future: futures.Future[StoragePath],
        operation: _progress.Operation | None = None,
        cancel: Callable[[], bool] | None = None,
    ) -> None:
        super().__init__(path, future, operation)
        self._cancel = cancel

    def cancel(self) -> bool:
        """Cancel the save unless its commit has begun; never waits. Returns True if it is
        cancelled (now, or by an earlier call): it never commits, and once its writes in flight
        stop (they are not cut short: host jobs, TensorStore and a slice's hosts finish theirs)
        everything it wrote is removed, its temporary directory included (on an object store,
        its objects and its lease); then :meth:`result` raises
        :class:`~milepost.SaveCancelledError`, and the path can be saved again. Returns False
        if it is too late, as ``concurrent.futures.Future.cancel`` does: the save has ended
        (committed or failed, not cancelled), or it has begun to write its commit marker (then
        it ends as it would have). A blocking ``save``'s handle has ended. With several
        controller processes the primary's ``cancel()`` decides (every process's ``result()``
        then raises the same error); on the others it does nothing and returns False until the
        save ended cancelled."""
        if self._future.done():
            return isinstance(self._future.exception(), SaveCancelledError)
        return self._cancel is not None and self._cancel()

    def _state(self) -> str:
        if self._future.done() and isinstance(self._future.exception(), SaveCancelledError):
            return "cancelled: nothing of it was committed, and what it wrote was removed"
        return super()._state()


def check_name(name: str) -> None:
    if (why := fmt.unsafe_item_name(name)) is not None:
        raise InvalidKeyError(
            f"checkpointable name {name!r} is not a valid folder name ({why}; names are non-empty, "
            "have no '/', and do not start with '_'); rename it"
        )


def all_leaves(objs: Mapping[str, Any]) -> list[Any]:
    out: list[Any] = []
    for obj in objs.values():
        if holds_no_tree(obj):
            continue
        out.extend(
            jax.tree_util.tree_leaves(
                obj, is_leaf=lambda x: x is None or hasattr(x, "__milepost_host_group__")
            )
        )
    return out


def start_save(
    path: str | os.PathLike[str] | ObjectPath,
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
    final = as_path(path)
    if (
        fmt.is_temporary_name(final.name)
        or NEW_MARKER in final.name
        or final.name.endswith(LEASE_SUFFIX)
    ):
        raise ValueError(
            f"cannot save to {final}: names holding {fmt.TMP_SUFFIX!r} are temporary directories "
            "and are never loaded as checkpoints; choose another name"
        )
    if not objs:
        raise ValueError("nothing to save: pass at least one checkpointable")
    for name in objs:
        check_name(name)
    try:
        custom_json = json.dumps(dict(custom_metadata or {}))
        metrics_json = json.loads(json.dumps(dict(metrics or {})))
    except (TypeError, ValueError) as e:
        raise TypeError(f"custom_metadata and metrics must be JSON-serializable: {e}") from e
    handlers = {name: resolve_for_save(name, obj, options.handlers) for name, obj in objs.items()}
    group = _hosts.check_storage(_hosts.host_group_for(all_leaves(objs)), final)
    _wait_for_cleanup(final)
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
        job = SAVES.submit(str(final), save.finish, save.timeout, save.stop_at_exit)
        return SaveHandle(final, job, op, save.cancel)
    future: futures.Future[StoragePath] = futures.Future()
    future.set_result(save.finish())
    return SaveHandle(final, future, op)


class _Save:
    """One save of a checkpoint: its workspace (a locked temporary directory, or the path itself
    under a lease on object stores; owned by the primary), the pending writes of its
    checkpointables, and the commit."""

    def __init__(
        self,
        final: StoragePath,
        handlers: Mapping[str, Any],
        group: HostGroup,
        options: _options.Options,
        overwrite: bool,
        custom_json: str,
        metrics_json: Any,
    ) -> None:
        self.final = final
        saving = options.saving
        self.workspace = for_path(final, overwrite, saving.wait_for_writer_secs, saving.lease_secs)
        self.handlers = handlers
        self.group = group
        self.options = options
        self.timeout = options.async_.timeout_secs
        self.overwrite = overwrite
        self.custom_json = custom_json
        self.metrics_json = metrics_json
        self.pending: list[workers.PendingWrite[Any]] = []
        self.trees: list[WrittenTree] = []
        """What the pending writes handed to the commit once waited for (on the primary)."""
        self.op = _progress.Operation(
            "save", final, options.progress if group.is_primary() else None
        )
        """Bytes planned and written, times, and the progress bar (on the primary)."""
        self.prepared = False
        """True on the primary once it owns the workspace (until it committed or abandoned it)."""
        self.unsettled: list[workers.PendingWrite[Any]] = []
        """Writes still in flight when a wait ran out of time: settled in the background, and
        the workspace removed after them, so the caller hears of the timeout at once."""
        self.init_ns = 0
        self.clean = True
        """No write of the save failed: once they all ended, nothing of it can land later."""
        self._marking: bool | None = None
        """True once the primary is about to write the commit marker (the save commits, or
        fails), False once an interpreter exit or :meth:`cancel` abandoned it before then (it
        never writes the marker); whichever comes first holds."""
        self._cancelled = False
        """It was abandoned by :meth:`cancel` (``_marking`` is False)."""
        self._marking_lock = threading.Lock()
        self._settled: Exception | None = None
        """An error the commit raises as the save ends with it (not explained again)."""

    @property
    def local(self) -> bool:
        """A local folder's save (an object store's lease is checked at the commit only)."""
        return isinstance(self.workspace, LocalWorkspace)

    @property
    def tmp(self) -> StoragePath:
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
            _hosts.shared(group, f"prepare:{final}", self.prepare, timeout)
            prepared = True
            self.init_ns = time.time_ns()
            call = SaveCall(
                options=self.options,
                group=group,
                copy=copy,
                check=self.workspace.check if self.prepared and self.local else None,
            )
            self.trees = call.written  # filled by the parts' waits, for the commit
            failure: Exception | None = None
            try:
                for name, obj in objs.items():
                    part = as_pending(self.handlers[name].save(self.tmp / name, obj, call))
                    if part is not None:
                        self.pending.append(part)
            except Exception as e:
                failure = e
            # The primary may fail alone here (its own leaves, a stateful checkpointable).
            agree(group, f"staged:{final}", failure, timeout)
        except BaseException as e:
            self._settle_after(e, self.pending)
            if prepared:
                self._abandon(f"abandon-staged:{final}")
            raise

    # -- the background part ------------------------------------------------------------
    def finish(self) -> StoragePath:
        try:
            with self.op.active():
                self._finish()
        except BaseException as e:
            self.op.close(ok=False)
            if self._cancelled and isinstance(e, Exception):
                if not isinstance(e, SaveCancelledError):  # what cancel() promised
                    raise SaveCancelledError(self.final) from e
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
            deadline = time.monotonic() + timeout  # one timeout for all of the parts
            try:
                # Cancelled meanwhile or not, every write is waited for: none may land after the
                # workspace is removed, or it would recreate it. Waiting only waits: the trees
                # the parts put in SaveCall.written are committed after every part is durable.
                for part in self.pending:
                    part.wait(max(0.0, deadline - time.monotonic()))  # (trees: SaveCall.written)
                    done += 1
            except Exception as e:
                # The parts not finished may still write: let them land (or the storage give up
                # on them) before the workspace is removed, or they would recreate it.
                self._settle_after(e, self.pending[done:])
                # A write that failed because the workspace was removed from outside says so.
                own = isinstance(self.pending[done], PendingTree)  # milepost's own tree
                failure = self.workspace.explain(e, own) if self.prepared else e
                self.clean = False
            if failure is not None and self._cancelled:  # what cancel() promised
                cancelled = SaveCancelledError(final)
                cancelled.__cause__ = failure
                failure = cancelled
            # The primary commits, or reports why not; every process gets the same outcome.
            agree(group, f"commit:{final}", failure, timeout, then=self.commit)
        except BaseException:
            self._abandon(f"abandon-commit:{final}")
            raise
        finally:
            with _in_flight_lock:
                _in_flight.discard(final)

    def stop_at_exit(self) -> str | None:
        """An interpreter exit stops waiting for this save: None if it had not begun to write
        its commit marker (now it never does: nothing of it is committed), else why its outcome
        is still to come."""
        if not self.group.is_primary():
            return "the primary controller process decides whether it is committed"
        with self._marking_lock:
            if self._marking is None:
                self._marking = False
            marking = self._marking
        return "its commit marker is being written" if marking else None

    def cancel(self) -> bool:
        """Abandon the save unless it has begun to write its commit marker (see
        :meth:`SaveHandle.cancel`): True if it is abandoned by this call or an earlier one."""
        if not self.group.is_primary():
            return False
        with self._marking_lock:
            if self._marking is None:
                self._marking = False
                self._cancelled = True
            return self._cancelled

    def _mark(self) -> None:
        """Right before the commit marker: from here the save commits (or fails), unless an
        interpreter exit or :meth:`cancel` abandoned it first."""
        with self._marking_lock:
            if self._marking is None:
                self._marking = True
            marking = self._marking
        if not marking and self._cancelled:
            raise SaveCancelledError(self.final)
        if not marking:
            raise InterruptedError(
                f"the save to {self.final} was abandoned as the interpreter exited, before its "
                "commit: nothing of it was committed"
            )

    def _abandoned(self) -> None:
        """The commit's check after its tree phases: a save abandoned meanwhile (an exit or
        :meth:`cancel`) stops there, with no checksums for a commit never made."""
        if self._marking is False:
            try:
                self._mark()
            except Exception as e:
                self._settled = e
                raise

    def _trees_failed(self, error: Exception) -> Exception:
        """The error the save ends with when the commit's tree phases (a tree's format files,
        its merge) failed with ``error``: explained if the workspace was removed from outside,
        and a :class:`SaveCancelledError` (caused by it) if :meth:`cancel` abandoned the save."""
        self.clean = False
        failure = self.workspace.explain(error)
        if self._cancelled:  # what cancel() promised
            cancelled = SaveCancelledError(self.final)
            cancelled.__cause__ = failure
            failure = cancelled
        self._settled = failure
        return failure

    def commit(self) -> None:
        try:
            commit(
                self.tmp,
                self.final,
                self.handlers,
                self.init_ns,
                self.custom_json,
                self.metrics_json,
                self.workspace,
                self._mark,
                self.trees,
                self._abandoned,
                self._trees_failed,
            )
        except Exception as e:  # a write that failed because the workspace was removed says so
            if e is self._settled:
                raise
            explained = self.workspace.explain(e)
            if explained is e:
                raise
            raise explained from e
        self.prepared = False

    def _settle_after(self, error: BaseException, pending: list[workers.PendingWrite[Any]]) -> None:
        """After ``error``: let ``pending`` stop writing. Out of time with one controller, in
        the background (``unsettled``: the workspace goes after them), so the timeout is
        reported when it happens; otherwise now, bounded by the storage's request budget."""
        pending = [*pending, *getattr(error, "unsettled", [])]
        if isinstance(error, workers.StillWritingError) and (
            _hosts.controller_process(self.group)[1] == 1
        ):
            self.unsettled = pending
        else:
            workers.settle_all(pending)

    def _abandon(self, name: str) -> None:
        """Remove the workspace once every controller process has settled its own writes (a late
        write elsewhere would recreate it); a process that died is waited for at most
        ``min(timeout, 10s)``. The caller raises its error either way. Writes still in flight
        (``unsettled``) are waited for in the background, then the workspace is removed: a new
        save of the path in this process waits for that, one in another finds the lease live
        (or the temporary directory locked) until then."""
        with contextlib.suppress(Exception):
            self.group.barrier(name, min(self.timeout, 10.0))
        if not self.prepared:
            return
        self.prepared = False
        error = sys.exc_info()[1]
        if not self.unsettled:
            # A cancelled save whose every write ended as it should leaves nothing (its lease
            # included); another failure may leave writes the storage applies late, and so may
            # the other processes of a multi-controller job.
            clean = self._cancelled and self.clean
            clean = clean and _hosts.controller_process(self.group)[1] == 1
            left = self.workspace.abandon(clean=clean)
            if left is not None and error is not None:
                error.add_note(left)
            return
        unsettled, workspace, final = self.unsettled, self.workspace, self.final
        if error is not None:
            error.add_note(
                f"What the save wrote at {final} is removed once its writes stop (the storage "
                f"gives them up within {workers.storage_budget_secs():g} s); a new save of the "
                "path in this process waits for that."
            )

        def clean_up() -> None:
            try:
                workers.settle_all(unsettled)
                workspace.abandon()
            finally:
                with _in_flight_lock:
                    _cleaning.pop(final, None)

        with _in_flight_lock:
            _cleaning[final] = SAVES.submit(
                f"{final} (it failed; what it wrote is removed once its writes stop)",
                clean_up,
                workers.storage_budget_secs() + 30.0,
            )


def agree(
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

    _hosts.shared(group, name, outcome, timeout)
