"""Checkpointable handlers: how one named part of a checkpoint is saved and loaded.

A checkpoint holds several checkpointables, each in its own folder (``state``, ``dataset``...).
A handler turns one object into files in its folder. Resolution order for saving: handlers of
the current ``Context``, then globally registered ones (newest first), then the built-ins
(``StatefulCheckpointable`` objects, then PyTrees). Loading picks the handler recorded in the
checkpoint's metadata.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from milepost import _dispatch, _layout, _pytree_load, _pytree_save
from milepost import _format as fmt
from milepost._options import Options
from milepost.colocated import HostGroup
from milepost.workers import PendingWrite


@dataclass(frozen=True)
class SaveCall:
    """What a handler gets to know about the save it is part of."""

    options: Options
    group: HostGroup
    copy: bool
    """Stage a copy of the data before returning (``save_async``); False: a blocking save, the
    caller's buffers stay untouched until the commit."""


@dataclass(frozen=True)
class LoadCall:
    """What a handler gets to know about the load it is part of."""

    options: Options
    group: HostGroup
    partial: bool = False


class Deferred:
    """A background part that writes nothing until waited for: ``wait`` runs ``fn`` once (a
    second ``wait`` returns or raises the same); ``settle`` has nothing in flight to wait for."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn: Callable[[], Any] | None = fn
        self._lock = threading.Lock()
        self._outcome: tuple[bool, Any] | None = None

    def wait(self, timeout: float | None = None) -> Any:
        with self._lock:
            if self._outcome is None:
                assert self._fn is not None
                try:
                    self._outcome = (True, self._fn())
                except BaseException as e:
                    self._outcome = (False, e)
                self._fn = None
        ok, value = self._outcome
        if not ok:
            raise value
        return value

    def settle(self, timeout: float | None = None) -> None:
        return None


def as_pending(part: PendingWrite[Any] | Callable[[], Any] | None) -> PendingWrite[Any] | None:
    """A handler's (or a stateful checkpointable's) background part as a pending write: plain
    callables, the simple form user code may return, become :class:`Deferred`."""
    if part is None or isinstance(part, PendingWrite):
        return part
    if callable(part):
        return Deferred(part)
    raise TypeError(
        f"a checkpointable's save returned {type(part).__name__}; it must return None, a callable to run in the "
        "background, or a PendingWrite (wait(timeout) and settle(timeout))"
    )


@runtime_checkable
class CheckpointableHandler(Protocol):
    typestr: str
    """Recorded in ``_CHECKPOINT_METADATA`` to find this handler again when loading."""

    def is_handleable(self, obj: Any) -> bool: ...

    def save(
        self, directory: Path, obj: Any, call: SaveCall
    ) -> PendingWrite[Any] | Callable[[], Any] | None:
        """Do the blocking part (validate, snapshot or stage the data) and return what is left
        to run in the background, if anything: a :class:`~milepost.workers.PendingWrite` for
        writes already in flight, or a callable that writes when the save's background part
        runs it. ``directory`` exists; write only inside it."""
        ...

    def load(self, directory: Path, abstract: Any, call: LoadCall) -> Any: ...

    def metadata(self, directory: Path) -> Any: ...


@runtime_checkable
class StatefulCheckpointable(Protocol):
    """An object that saves and restores itself (a data iterator's position, an RNG...)."""

    def save(self, directory: Path) -> Callable[[], None] | None:
        """Write (or snapshot) own state into ``directory``; may return a background part."""
        ...

    def load(self, directory: Path) -> None:
        """Restore own state from ``directory`` in place."""
        ...


class PyTreeHandler:
    """A tree of arrays, scalars and strings in the Orbax v1 PyTree layout."""

    typestr = fmt.PYTREE_HANDLER_TYPESTR

    def is_handleable(self, obj: Any) -> bool:
        return not isinstance(obj, StatefulCheckpointable)

    def save(self, directory: Path, obj: Any, call: SaveCall) -> _pytree_save.PendingTree:
        planned = _pytree_save.plan(obj, call.options.saving, call.group)
        return _pytree_save.start(planned, directory, call)

    def load(self, directory: Path, abstract: Any, call: LoadCall) -> Any:
        return _pytree_load.load(directory, abstract, call)

    def metadata(self, directory: Path) -> Any:
        return _pytree_load.metadata(directory)


class JsonHandler:
    """A JSON-serializable object in ``data.json`` (Orbax's JsonHandler layout)."""

    typestr = fmt.JSON_HANDLER_TYPESTR
    filename = "data.json"

    def is_handleable(self, obj: Any) -> bool:
        try:
            json.dumps(obj)
        except (TypeError, ValueError):
            return False
        return True

    def save(self, directory: Path, obj: Any, call: SaveCall) -> Deferred | None:
        try:
            text = json.dumps(obj)  # snapshot now: the caller may mutate obj after we return
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"JsonHandler: the object is not JSON-serializable ({e}); use the PyTree handler"
            ) from e
        if not call.group.is_primary():
            return None
        return Deferred(lambda: fmt.write_file(directory / self.filename, text))

    def load(self, directory: Path, abstract: Any, call: LoadCall) -> Any:
        # read once, on the primary, for every controller process
        timeout = call.options.async_.timeout_secs
        return _dispatch.shared(
            call.group, f"json:{directory}", lambda: self._read(directory), timeout
        )

    def _read(self, directory: Path) -> Any:
        for name in (self.filename, "metadata"):
            if (directory / name).exists():
                return fmt.read_json(directory / name, "JSON checkpointable")
        raise FileNotFoundError(
            f"{directory} has no {self.filename}: it was not saved by a JSON handler"
        )

    def metadata(self, directory: Path) -> Any:
        return self._read(directory)


class StatefulHandler:
    typestr = "milepost.StatefulCheckpointable"

    def is_handleable(self, obj: Any) -> bool:
        return isinstance(obj, StatefulCheckpointable)

    def save(self, directory: Path, obj: Any, call: SaveCall) -> PendingWrite[Any] | None:
        if not call.group.is_primary():
            return None
        return as_pending(obj.save(directory))

    def load(self, directory: Path, abstract: Any, call: LoadCall) -> Any:
        if abstract is None or not isinstance(abstract, StatefulCheckpointable):
            raise TypeError(
                f"{directory.name!r} was saved by a StatefulCheckpointable; pass the object to restore into as its "
                "abstract value (load_checkpointables(path, {name: obj}))"
            )
        abstract.load(directory)
        return abstract

    def metadata(self, directory: Path) -> Any:
        return None


_BUILTINS: tuple[Any, ...] = (StatefulHandler(), PyTreeHandler(), JsonHandler())
_registry: list[tuple[Any, str | None]] = []
_lock = threading.Lock()


def register_handler(handler: CheckpointableHandler, *, name: str | None = None) -> None:
    """Register ``handler`` globally, for every checkpointable or only the one called ``name``.

    A handler (the :class:`CheckpointableHandler` protocol: ``typestr``, ``is_handleable``,
    ``save``, ``load``, ``metadata``) writes and reads one checkpointable's folder; the newest
    registration that can handle an object wins, before the built-in ones. To use a handler for
    one call only, pass it in ``Context(handlers=(...))`` instead.

    >>> mp.register_handler(MyTokenizerHandler(), name="tokenizer")
    """
    if not isinstance(handler, CheckpointableHandler):
        raise TypeError(
            f"{handler!r} is not a CheckpointableHandler (it needs typestr, is_handleable, save, load, metadata)"
        )
    with _lock:
        _registry.insert(0, (handler, name))


def _candidates(context_handlers: tuple[Any, ...]) -> list[tuple[Any, str | None]]:
    scoped = [
        (h if not isinstance(h, tuple) else h[0], None if not isinstance(h, tuple) else h[1])
        for h in context_handlers
    ]
    with _lock:
        return scoped + list(_registry) + [(h, None) for h in _BUILTINS]


def resolve_for_save(name: str, obj: Any, context_handlers: tuple[Any, ...]) -> Any:
    for handler, only in _candidates(context_handlers):
        if (only is None or only == name) and handler.is_handleable(obj):
            return handler
    raise TypeError(
        f"no checkpointable handler can save {name!r} (a {type(obj).__name__}); register one with "
        "milepost.register_handler(handler, name=...) or pass it in milepost.Context(handlers=[...])"
    )


def resolve_for_load(
    name: str, typestr: str | None, abstract: Any, context_handlers: tuple[Any, ...]
) -> Any:
    candidates = _candidates(context_handlers)
    for handler, only in candidates:
        if (only is None or only == name) and typestr is not None and handler.typestr == typestr:
            return handler
    if abstract is not None:
        for handler, only in candidates:
            if (only is None or only == name) and handler.is_handleable(abstract):
                return handler
    if typestr is None or typestr.endswith(_layout.PYTREE_HANDLERS):
        return _BUILTINS[1]
    if typestr.endswith(_layout.JSON_HANDLERS):
        return _BUILTINS[2]
    if typestr.startswith("orbax."):
        raise TypeError(
            f"checkpointable {name!r} was saved by the Orbax handler {typestr!r}, which milepost does not read (it reads "
            "Orbax's PyTree, Standard and Json checkpointables); load that part with Orbax, or register a milepost "
            "handler for it with milepost.register_handler"
        )
    raise TypeError(
        f"checkpointable {name!r} was saved by handler {typestr!r}, which is not registered here; register it "
        "with milepost.register_handler before loading"
    )
