"""Checkpointable handlers: how one named part of a checkpoint is saved and loaded.

A checkpoint holds several checkpointables, each in its own folder (``state``, ``dataset``...).
A handler turns one object into files in its folder. Resolution order for saving: handlers of
the current ``Context``, then globally registered ones (newest first), then the built-ins
(``StatefulCheckpointable`` objects, data iterators such as Grain's, then PyTrees). Loading picks
the handler recorded in the checkpoint's metadata.
"""

from __future__ import annotations

import inspect
import json
import threading
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from milepost import _hosts
from milepost._checkpoint import _pytree_load, _pytree_save
from milepost._checkpoint._calls import Deferred, LoadCall, SaveCall, as_pending
from milepost._checkpoint._data_iterator import DataIterator, DataIteratorHandler
from milepost.workers import PendingWrite, StoragePath
from milepost.workers import format as fmt


@runtime_checkable
class CheckpointableHandler(Protocol):
    """How one named part of a checkpoint (a checkpointable) becomes files in its folder, and
    back. Implement it for an object milepost does not save itself (a tokenizer, a data
    loader's state in a format of its own), then :func:`milepost.register_handler` it, or pass
    it for some calls in ``milepost.Context(handlers=[...])``.

    The calls, in order:

    - saving: ``is_handleable(obj)`` picks the handler; ``save(directory, obj, call)`` runs in
      the blocking part of the save, in the checkpoint's temporary folder (``directory`` exists;
      write only inside it): validate, snapshot or stage ``obj`` (the caller may change it once
      the save returns), and return the rest to run in the background, if anything. Whatever
      it returns is waited for before the commit; a failure anywhere removes the folder, after
      waiting for the writes still in flight. In a multi-controller job ``save`` runs in every
      process (``call.group.is_primary()`` tells the one that writes shared files).
    - loading: the handler whose ``typestr`` the checkpoint recorded (else the first whose
      ``is_handleable(abstract)`` is true) gets ``load(directory, abstract, call)``: return the
      object, shaped as ``abstract`` (the caller's template, or None). Before it is called, every
      file in ``directory`` is checked against the checksums recorded at the commit.
    - ``metadata(directory)``: what ``milepost.metadata`` shows of the part, without reading
      its bulk data (None if there is nothing to say).

    >>> class TextHandler:
    ...     typestr = "my_project.TextHandler"
    ...     def is_handleable(self, obj): return isinstance(obj, str)
    ...     def save(self, directory, obj, call):
    ...         return lambda: (directory / "text.txt").write_text(obj)  # in the background
    ...     def load(self, directory, abstract, call): return (directory / "text.txt").read_text()
    ...     def metadata(self, directory): return None
    >>> milepost.register_handler(TextHandler(), name="notes")
    """

    typestr: str
    """Recorded in ``_CHECKPOINT_METADATA`` to find this handler again when loading."""

    def is_handleable(self, obj: Any) -> bool:
        """Whether this handler saves ``obj`` (or, when loading, fits the abstract value)."""
        ...

    def save(
        self, directory: StoragePath, obj: Any, call: SaveCall
    ) -> PendingWrite[Any] | Callable[[], Any] | None:
        """Do the blocking part (validate, snapshot or stage the data) and return what is left
        to run in the background, if anything: a :class:`~milepost.workers.PendingWrite` for
        writes already in flight, or a callable that writes when the save's background part
        runs it. ``directory`` exists; write only inside it."""
        ...

    def load(self, directory: StoragePath, abstract: Any, call: LoadCall) -> Any:
        """The object saved in ``directory``, shaped as ``abstract`` (None: as saved)."""
        ...

    def metadata(self, directory: StoragePath) -> Any:
        """What the part holds, without reading its bulk data (None: nothing to say)."""
        ...


@runtime_checkable
class StatefulCheckpointable(Protocol):
    """An object that saves and restores itself (a data iterator's position, an RNG...)."""

    def save(self, directory: StoragePath) -> Callable[[], None] | None:
        """Write (or snapshot) own state into ``directory``; may return a background part."""
        ...

    def load(self, directory: StoragePath) -> None:
        """Restore own state from ``directory`` in place."""
        ...


def saves_itself(obj: Any) -> bool:
    """Whether ``obj`` is a :class:`StatefulCheckpointable` milepost runs: its ``save`` and
    ``load`` are plain methods. Orbax v1's protocol has the same names as coroutines (a Grain
    iterator has both kinds: milepost saves it through ``get_state``/``set_state``)."""
    return (
        isinstance(obj, StatefulCheckpointable)
        and not inspect.iscoroutinefunction(obj.save)
        and not inspect.iscoroutinefunction(obj.load)
    )


def holds_no_tree(obj: Any) -> bool:
    """Whether ``obj`` is saved whole by its handler, not as a tree of leaves (so its leaves
    take no part in choosing the host group)."""
    return isinstance(obj, StatefulCheckpointable | DataIterator)


class PyTreeHandler:
    """A tree of arrays, scalars and strings in the Orbax v1 PyTree layout."""

    typestr = fmt.PYTREE_HANDLER_TYPESTR
    """The typestr it records: Orbax v1's PyTree handler's."""

    def is_handleable(self, obj: Any) -> bool:
        """Every object but a :class:`StatefulCheckpointable`: the handler of last resort."""
        return not isinstance(obj, StatefulCheckpointable)

    def save(self, directory: StoragePath, obj: Any, call: SaveCall) -> PendingWrite[Any]:
        """Plan the tree's writes over its host group and stage them; the hosts write in the
        background (its ``wait`` hands the commit what the tree's format files record)."""
        planned = _pytree_save.plan_tree(obj, call.options.saving, call.group)
        return _pytree_save.stage_tree(planned, directory, call)

    def load(self, directory: StoragePath, abstract: Any, call: LoadCall) -> Any:
        """The tree, shaped and sharded as ``abstract`` (None: as saved)."""
        return _pytree_load.load(directory, abstract, call)

    def metadata(self, directory: StoragePath) -> Any:
        """The tree of :class:`LeafMetadata`, read from the checkpoint's metadata files only."""
        return _pytree_load.tree_metadata(directory)


class JsonHandler:
    """A JSON-serializable object in ``data.json`` (Orbax's JsonHandler layout)."""

    typestr = fmt.JSON_HANDLER_TYPESTR
    """The typestr it records: Orbax v1's JSON handler's."""
    filename = "data.json"
    """The file it writes in the checkpointable's folder."""

    def is_handleable(self, obj: Any) -> bool:
        """Whether ``json.dumps`` takes ``obj``."""
        try:
            json.dumps(obj)
        except (TypeError, ValueError):
            return False
        return True

    def save(self, directory: StoragePath, obj: Any, call: SaveCall) -> PendingWrite[Any] | None:
        """Serialize ``obj`` now (later changes to it are not saved); the primary process writes
        it in the background."""
        try:
            text = json.dumps(obj)  # snapshot now: the caller may mutate obj after we return
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"JsonHandler: the object is not JSON-serializable ({e}); use the PyTree handler"
            ) from e
        if not call.group.is_primary():
            return None
        return Deferred(lambda: fmt.write_file(directory / self.filename, text))

    def load(self, directory: StoragePath, abstract: Any, call: LoadCall) -> Any:
        """The saved object, read once on the primary and shared with every controller process."""
        # read once, on the primary, for every controller process
        timeout = call.options.async_.timeout_secs
        return _hosts.shared(
            call.group, f"json:{directory}", lambda: self._read(directory), timeout
        )

    def _read(self, directory: StoragePath) -> Any:
        for name in (self.filename, "metadata"):
            if (directory / name).exists():
                return fmt.read_json(directory / name, "JSON checkpointable", user_data=True)
        raise FileNotFoundError(
            f"{directory} has no {self.filename}: it was not saved by a JSON handler"
        )

    def metadata(self, directory: StoragePath) -> Any:
        """The saved object itself, read from its file."""
        return self._read(directory)


class StatefulHandler:
    typestr = "milepost.StatefulCheckpointable"

    def is_handleable(self, obj: Any) -> bool:
        return saves_itself(obj)

    def save(self, directory: StoragePath, obj: Any, call: SaveCall) -> PendingWrite[Any] | None:
        if not call.group.is_primary():
            return None
        return as_pending(obj.save(directory))

    def load(self, directory: StoragePath, abstract: Any, call: LoadCall) -> Any:
        if abstract is None or not saves_itself(abstract):
            raise TypeError(
                f"{directory.name!r} was saved by a StatefulCheckpointable; pass the object to "
                "restore into as its abstract value (load_checkpointables(path, {name: obj}))"
            )
        abstract.load(directory)
        return abstract

    def metadata(self, directory: StoragePath) -> Any:
        return None


_BUILTINS: tuple[Any, ...] = (
    StatefulHandler(),
    DataIteratorHandler(),
    PyTreeHandler(),
    JsonHandler(),
)
_PYTREE, _JSON = _BUILTINS[2], _BUILTINS[3]
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
            f"{handler!r} is not a CheckpointableHandler (it needs "
            "typestr, is_handleable, save, load, metadata)"
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
        f"no checkpointable handler can save {name!r} (a {type(obj).__name__}); "
        "register one with milepost.register_handler(handler, name=...) or pass "
        "it in milepost.Context(handlers=[...])"
    )


def resolve_for_load(
    name: str, typestr: str | None, abstract: Any, context_handlers: tuple[Any, ...]
) -> Any:
    candidates = _candidates(context_handlers)
    for handler, only in candidates:
        if (
            (only is None or only == name)
            and typestr is not None
            and typestr in getattr(handler, "typestrs", (handler.typestr,))
        ):
            return handler
    if abstract is not None:
        for handler, only in candidates:
            if (only is None or only == name) and handler.is_handleable(abstract):
                return handler
    if typestr is None or typestr.endswith(fmt.PYTREE_HANDLERS):
        return _PYTREE
    if typestr.endswith(fmt.JSON_HANDLERS):
        return _JSON
    if typestr.startswith("orbax."):
        raise TypeError(
            f"checkpointable {name!r} was saved by the Orbax handler {typestr!r}, which milepost "
            "does not read (it reads Orbax's PyTree, Standard and Json checkpointables, and data "
            "iterators such as Grain's given the iterator to restore into); load that "
            "part with Orbax, or register a milepost handler for it with milepost.register_handler"
        )
    raise TypeError(
        f"checkpointable {name!r} was saved by handler {typestr!r}, which is not registered here; "
        "register it with milepost.register_handler before loading"
    )
