"""Data iterators as checkpointables: an object with ``get_state()`` and ``set_state()`` (a Grain
iterator, or one of your own) saved in the layout Orbax writes for it.

The checkpointable's folder holds one file per controller process, ``process_<i>-of-<n>.json``:
the iterator's state as JSON text. When ``get_state()`` returns bytes (a Grain ``DataLoader``
iterator: UTF-8 JSON) the file holds them as they are; when it returns a JSON value (a Grain
dataset iterator: a dict) the file holds ``json.dumps(state, indent=4)``. Either way it is byte
for byte what Grain's Orbax handler and a Grain iterator's own ``save`` write. Restoring calls
``set_state`` with the same kind the target's ``get_state`` returns: the file's bytes, or its
parsed JSON.

milepost records Orbax v1's typestr for the part (its ``StatefulCheckpointableHandler``), so
Orbax v1 loads it given the iterator, and so does a ``CheckpointManager`` given Grain's
``CheckpointRestore``; milepost reads that and Grain's own typestr, which a
``CheckpointManager`` records.

In a multi-controller job every process saves and restores its own iterator (its own file); with
one controller (embedded, or a Ray slice) the iterator lives on the controller: process 0 of 1.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from milepost import _hosts
from milepost._checkpoint._calls import LoadCall, SaveCall
from milepost._errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StructureMismatchError,
)
from milepost.colocated import HostGroup
from milepost.workers import PendingWrite, StoragePath
from milepost.workers import format as fmt

_STATE_FILE = re.compile(r"process_(\d+)-of-(\d+)\.json")
WHAT = "data iterator state"


@runtime_checkable
class DataIterator(Protocol):
    """An object whose position is ``get_state()`` (bytes of JSON text, or a JSON value) and is
    restored in place by ``set_state(state)``: a Grain iterator, or your own."""

    def get_state(self) -> Any:
        """The current position: bytes of UTF-8 JSON text, or a JSON-serializable value."""
        ...

    def set_state(self, state: Any) -> None:
        """Continue from ``state``, as ``get_state`` returned it."""
        ...


def state_text(obj: Any, name: str) -> bytes:
    """``obj.get_state()`` as the bytes of its file: a snapshot, the caller may go on."""
    state = obj.get_state()
    if isinstance(state, bytes | bytearray | memoryview):
        raw = bytes(state)
        try:
            json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise ValueError(
                f"data iterator {name!r}: get_state() returned bytes that are not UTF-8 JSON text "
                f"({e}); its state is saved as a JSON file (the layout Orbax and Grain use). "
                "Return the state as bytes of JSON text or as a JSON value"
            ) from e
        return raw
    try:
        return json.dumps(state, indent=4).encode()
    except (TypeError, ValueError, RecursionError) as e:
        raise TypeError(
            f"data iterator {name!r}: get_state() returned a {type(state).__name__} that is not "
            f"JSON-serializable ({e}); its state is saved as a JSON file (the layout Orbax and "
            "Grain use). Return bytes of JSON text or a JSON value (dicts, lists, strings, "
            "numbers), or register a handler of your own for it with milepost.register_handler"
        ) from e


class _StateWrite:
    """The background part of one process's save: write its file, then meet the other
    controller processes, so that the primary commits only once every file is there (it
    checks)."""

    def __init__(
        self,
        directory: StoragePath,
        raw: bytes,
        group: HostGroup,
        timeout: float,
    ) -> None:
        self.directory = directory
        self.raw = raw
        self.group = group
        self.timeout = timeout
        self.index, self.count = _hosts.controller_process(group)
        self._lock = threading.Lock()
        self._outcome: BaseException | bool | None = False  # False: not run yet

    def _run(self, write: bool, timeout: float | None) -> BaseException | None:
        error: BaseException | None = None
        if write:
            try:
                name = fmt.data_state_file(self.index, self.count)
                fmt.write_file(self.directory / name, self.raw)
            except Exception as e:
                error = e
        # Every process waits for its parts in the same order, or settles them after a failure:
        # both arrive here.
        self.group.barrier(f"data-iter:{self.directory}", timeout or self.timeout)
        if error is None and write and self.group.is_primary():
            # every process's file, read back (a store may drop a write it acknowledged)
            names = {p.name for p in self.directory.iterdir()}
            missing = [
                i for i in range(self.count) if fmt.data_state_file(i, self.count) not in names
            ]
            if missing:
                error = CheckpointNotFoundError(
                    f"processes {missing[:8]} did not write their data iterator state, or the "
                    f"storage did not keep it ({fmt.data_state_file(missing[0], self.count)} in "
                    f"{self.directory}); their logs say why. The step was not committed: save it "
                    "again"
                )
        return error

    def wait(self, timeout: float | None = None) -> None:
        with self._lock:
            if self._outcome is False:
                self._outcome = self._run(True, timeout)
            outcome = self._outcome
        if isinstance(outcome, BaseException):
            raise outcome

    def settle(self, timeout: float | None = None) -> None:
        """A failed save: write nothing, but meet the other processes that wait for theirs."""
        with self._lock:
            if self._outcome is False:
                try:
                    self._outcome = self._run(False, timeout)
                except Exception as e:
                    self._outcome = e


class DataIteratorHandler:
    """A :class:`DataIterator` as one JSON file per controller process (Orbax's Grain layout)."""

    typestr = fmt.STATEFUL_HANDLER_TYPESTR
    """The typestr it records: Orbax v1's stateful-checkpointable handler's."""
    typestrs = (fmt.STATEFUL_HANDLER_TYPESTR, fmt.GRAIN_HANDLER_TYPESTR)
    """Every typestr this handler reads: Orbax v1's, and Grain's handler's (CheckpointManager)."""

    def is_handleable(self, obj: Any) -> bool:
        """Whether ``obj`` is a :class:`DataIterator` (it saves through ``get_state``)."""
        return isinstance(obj, DataIterator)

    def save(self, directory: StoragePath, obj: Any, call: SaveCall) -> PendingWrite[None]:
        """Take the iterator's state now, in the blocking part; write it in the background, one
        JSON file per controller process."""
        raw = state_text(obj, directory.name)
        return _StateWrite(directory, raw, call.group, call.options.async_.timeout_secs)

    def load(self, directory: StoragePath, abstract: Any, call: LoadCall) -> Any:
        """Restore the saved state into ``abstract``, the iterator to restore, in place; a
        TypeError says what to pass when it is not one."""
        return self.prepare(directory, abstract, call)()

    def prepare(self, directory: StoragePath, abstract: Any, call: LoadCall) -> Callable[[], Any]:
        """Read and check this process's state file now; the function returned restores the
        iterator in place (the loader calls it once the whole checkpoint is known good)."""
        if not isinstance(abstract, DataIterator):
            raise TypeError(
                f"{directory.name!r} holds a data iterator's state, restored in place: pass the "
                "iterator to restore into as its abstract value, e.g. "
                f"load_checkpointables(path, {{{directory.name!r}: iterator, ...}}) or "
                f"Checkpointer.load(step, abstract_state, data_iter=iterator) (got "
                f"{'None' if abstract is None else type(abstract).__name__})"
            )
        index, count = _hosts.controller_process(call.group)
        timeout = call.options.async_.timeout_secs
        _hosts.shared(
            call.group, f"data-iter:{directory}", lambda: _check_files(directory, count), timeout
        )
        path = directory / fmt.data_state_file(index, count)
        if path.is_dir():
            raise CorruptCheckpointError(
                f"{WHAT} {path} is a folder, not a file; the checkpoint is damaged or crafted. "
                "Load an earlier checkpoint"
            )
        raw = fmt.read_checked(path, WHAT)
        value = fmt.parse_json(path, raw, WHAT, user_data=True)

        def restore() -> Any:
            try:
                abstract.set_state(raw if isinstance(abstract.get_state(), bytes) else value)
            except Exception as e:
                raise StructureMismatchError(
                    f"the iterator passed for {directory.name!r} could not take the state saved "
                    f"in {path} ({type(e).__name__}: {e}); pass an iterator of the kind that was "
                    "saved (the same dataset and pipeline). It may be left partly restored: make "
                    "a new one"
                ) from e
            return abstract

        return restore

    def metadata(self, directory: StoragePath) -> Any:
        """How many processes saved their iterator's state (one file each)."""
        counts = sorted(_saved_counts(directory))
        return {"processes": counts[0] if len(counts) == 1 else counts}


def _check_files(directory: StoragePath, count: int) -> None:
    """On the primary, before any process reads: the folder has the file of every one of the
    ``count`` processes, or say why not (saved by a job of another size, or damaged)."""
    names = _names(directory)
    counts = sorted(_saved_counts(directory, names))
    missing = [i for i in range(count) if fmt.data_state_file(i, count) not in names]
    if not missing:
        return
    if counts and count not in counts and counts[0] > 0:
        saved = counts[0]
        raise StructureMismatchError(
            f"{directory} holds the data iterator states of a job of {saved} process"
            f"{'es' if saved != 1 else ''} ({fmt.data_state_file(0, saved)}...), and this job has "
            f"{count}: each process restores its own iterator. Resume with {saved} process"
            f"{'es' if saved != 1 else ''}, or load without the iterator (leave it out of "
            "load_checkpointables, or drop data_iter=) and position the new iterators yourself"
        )
    raise CheckpointNotFoundError(
        f"{WHAT} {directory / fmt.data_state_file(missing[0], count)} is missing"
        f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}: the checkpoint is "
        "damaged or incomplete. Load an earlier checkpoint"
    )


def _names(directory: StoragePath) -> set[str]:
    try:
        return {p.name for p in directory.iterdir()}
    except FileNotFoundError:
        return set()


def _saved_counts(directory: StoragePath, names: set[str] | None = None) -> set[int]:
    """The process counts of the state files in ``directory`` (one, unless damaged)."""
    found = _names(directory) if names is None else names
    return {int(m[2]) for n in found if (m := _STATE_FILE.fullmatch(n))}
