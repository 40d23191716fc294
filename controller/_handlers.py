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

from milepost import _dispatch, _pytree
from milepost import _format as fmt


@dataclass(frozen=True)
class SaveCall:
    """What a handler gets to know about the save it is part of."""

    options: Any
    group: Any
    copy: bool


@dataclass(frozen=True)
class LoadCall:
    options: Any
    group: Any
    partial: bool = False


@runtime_checkable
class CheckpointableHandler(Protocol):
    typestr: str
    """Recorded in ``_CHECKPOINT_METADATA`` to find this handler again when loading."""

    def is_handleable(self, obj: Any) -> bool: ...

    def save(self, directory: Path, obj: Any, call: SaveCall) -> Callable[[], None] | None:
        """Do the blocking part (validate, snapshot or stage the data) and return what is left
        to run in the background, if anything. ``directory`` exists; write only inside it."""
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
    typestr = fmt.PYTREE_HANDLER_TYPESTR

    def is_handleable(self, obj: Any) -> bool:
        return not isinstance(obj, StatefulCheckpointable)

    def save(self, directory: Path, obj: Any, call: SaveCall) -> Callable[[], None]:
        return _pytree.PyTreeSave(obj, call).stage(directory, call.copy)

    def load(self, directory: Path, abstract: Any, call: LoadCall) -> Any:
        return _pytree.load(directory, abstract, call.partial, call)

    def metadata(self, directory: Path) -> Any:
        return _pytree.metadata(directory)


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

    def save(self, directory: Path, obj: Any, call: SaveCall) -> Callable[[], None]:
        try:
            text = json.dumps(obj)  # snapshot now: the caller may mutate obj after we return
        except (TypeError, ValueError) as e:
            raise TypeError(f"JsonHandler: the object is not JSON-serializable ({e}); use the PyTree handler") from e

        def finish() -> None:
            if call.group.is_primary():
                fmt.write_file(directory / self.filename, text)

        return finish

    def load(self, directory: Path, abstract: Any, call: LoadCall) -> Any:
        if call.group is not None:  # read once, on the primary, for every controller process
            timeout = call.options.async_.timeout_secs
            return _dispatch.shared(call.group, f"json:{directory}", lambda: self._read(directory), timeout)
        return self._read(directory)

    def _read(self, directory: Path) -> Any:
        for name in (self.filename, "metadata"):
            if (directory / name).exists():
                return fmt.read_json(directory / name, "JSON checkpointable")
        raise FileNotFoundError(f"{directory} has no {self.filename}: it was not saved by a JSON handler")

    def metadata(self, directory: Path) -> Any:
        return self.load(directory, None, LoadCall(options=None, group=None))


class StatefulHandler:
    typestr = "milepost.StatefulCheckpointable"

    def is_handleable(self, obj: Any) -> bool:
        return isinstance(obj, StatefulCheckpointable)

    def save(self, directory: Path, obj: Any, call: SaveCall) -> Callable[[], None] | None:
        if not call.group.is_primary():
            return None
        return obj.save(directory)

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
    """Register ``handler`` globally, for every checkpointable or only the one called ``name``."""
    if not isinstance(handler, CheckpointableHandler):
        raise TypeError(f"{handler!r} is not a CheckpointableHandler (it needs typestr, is_handleable, save, load, metadata)")
    with _lock:
        _registry.insert(0, (handler, name))


def _candidates(context_handlers: tuple[Any, ...]) -> list[tuple[Any, str | None]]:
    scoped = [(h if not isinstance(h, tuple) else h[0], None if not isinstance(h, tuple) else h[1]) for h in context_handlers]
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


def resolve_for_load(name: str, typestr: str | None, abstract: Any, context_handlers: tuple[Any, ...]) -> Any:
    candidates = _candidates(context_handlers)
    for handler, only in candidates:
        if (only is None or only == name) and typestr is not None and handler.typestr == typestr:
            return handler
    if abstract is not None:
        for handler, only in candidates:
            if (only is None or only == name) and handler.is_handleable(abstract):
                return handler
    if typestr is not None and typestr.endswith("PyTreeHandler"):
        return _BUILTINS[1]
    if typestr is not None and typestr.endswith("JsonHandler"):
        return _BUILTINS[2]
    raise TypeError(
        f"checkpointable {name!r} was saved by handler {typestr!r}, which is not registered here; register it "
        "with milepost.register_handler before loading"
    )
