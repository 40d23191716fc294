"""Loading whole checkpoints and their metadata: find the checkpointables, hand each to its
handler, and make sure every byte came from the one checkpoint that was there when the load
started (a load racing an overwrite or a deletion raises ``CheckpointReplacedError``)."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax

from milepost import _hosts, _options, _views, workers
from milepost._checkpoint._calls import LoadCall
from milepost._checkpoint._handlers import (
    JsonHandler,
    PyTreeHandler,
    holds_no_tree,
    resolve_for_load,
)
from milepost._errors import CheckpointNotFoundError, CheckpointReplacedError
from milepost.workers import ObjectPath, StoragePath, as_path, is_local
from milepost.workers import format as fmt


@workers.reading_once()  # each small object of an object store read once per call
def load_checkpointables(
    path: str | os.PathLike[str] | ObjectPath,
    abstracts: Mapping[str, Any] | None,
    *,
    partial: bool = False,
    default_pytree: bool = False,
) -> dict[str, Any]:
    """Load the named checkpointables (all when None). ``default_pytree``: ``abstracts`` holds
    one entry (its key is not read), for the checkpoint's main pytree."""
    options = _options.current()
    root = as_path(path)
    leaves: list[Any] = []
    for a in (abstracts or {}).values():
        if a is not None and not holds_no_tree(a):
            leaves.extend(
                jax.tree_util.tree_leaves(
                    a, is_leaf=lambda x: hasattr(x, "__milepost_host_group__")
                )
            )
    group = _hosts.check_storage(_hosts.host_group_for_abstract(leaves), root)
    timeout = options.async_.timeout_secs
    meta, items, identity, checksums = _hosts.shared(
        group, f"ckpt-meta:{root}", lambda: read_checkpointables(root), timeout
    )
    if default_pytree:
        assert abstracts is not None
        (main,) = abstracts.values()
        abstracts = {fmt.main_tree(root, items): main}
    wanted = dict(abstracts) if abstracts is not None else {n: None for n in items}
    unknown = [n for n in wanted if n not in items]
    gone = [n for n in unknown if n in fmt.listed_items(root, meta)]
    if gone:
        raise CheckpointNotFoundError(
            f"checkpoint {root} lists the checkpointable(s) {gone} in "
            f"{fmt.CHECKPOINT_METADATA}, but their folders are missing: the checkpoint is damaged. "
            f"Load the others (it has {sorted(items)}), or an earlier checkpoint"
        )
    if unknown:
        raise KeyError(
            f"checkpoint {root} has no checkpointable(s) {unknown}; it has {sorted(items)}"
        )
    call = LoadCall(options=options, group=group, partial=partial)
    out: dict[str, Any] = {}
    # Objects restored in place (data iterators, stateful objects) last, and only once every
    # other part loaded and the checkpoint is known not to have been replaced meanwhile: a load
    # that fails, or ends in CheckpointReplacedError, leaves them as they were.
    in_place = [n for n, a in wanted.items() if hasattr(a, "set_state") or hasattr(a, "load")]
    restores: list[tuple[str, Callable[[], Any], bool]] = []
    with _replaced_on_error(root, identity), fmt.verifying(checksums):
        for name in [n for n in wanted if n not in in_place] + in_place:
            abstract = wanted[name]
            handler = resolve_for_load(name, items[name].handler, abstract, options.handlers)
            folder = items[name].folder
            _hosts.shared(
                group,
                f"check-files:{folder}",
                functools.partial(_check_own_files, folder, handler, checksums),
                timeout,
            )
            if name not in in_place:
                out[name] = handler.load(folder, abstract, call)
            elif hasattr(handler, "prepare"):  # reads now, restores once the check passed
                restores.append((name, handler.prepare(folder, abstract, call), False))
            else:  # an object that reads its folder itself: after the check, checked again
                restores.append(
                    (name, functools.partial(handler.load, folder, abstract, call), True)
                )
    # Every byte came from the checkpoint that was there when the load started, or it was
    # replaced (an overwrite, a deletion) meanwhile and the result may mix two: refuse it.
    _check_unchanged(group, root, identity, timeout)
    if restores:
        with _replaced_on_error(root, identity), fmt.verifying(checksums):
            for name, restore, _ in restores:
                out[name] = restore()
        if any(reads for _, _, reads in restores):
            _check_unchanged(group, root, identity, timeout, "after restoring in place")
    return {name: out[name] for name in wanted}


@contextlib.contextmanager
def _replaced_on_error(root: StoragePath, identity: tuple[Any, ...]) -> Iterator[None]:
    """A failure inside is CheckpointReplacedError when the checkpoint changed meanwhile (this
    process's own look: the other processes may not be here)."""
    try:
        yield
    except Exception as e:
        if _identity(root, fresh=True) != identity:
            raise _replaced(root) from e
        raise


def _check_unchanged(
    group: Any,
    root: StoragePath,
    identity: tuple[Any, ...],
    timeout: float,
    when: str = "",
) -> None:
    def changed() -> bool:
        return _identity(root, fresh=True) != identity

    if _hosts.shared(group, f"ckpt-changed:{root}{when}", changed, timeout):
        raise _replaced(root)


def _check_own_files(folder: StoragePath, handler: Any, checksums: fmt.Checksums | None) -> None:
    """A handler that reads its files itself (not the built-in pytree or JSON ones, which check
    what they read) gets its folder only once every committed file in it is checked."""
    if checksums is not None and not isinstance(handler, PyTreeHandler | JsonHandler):
        checksums.check_folder(folder)


@contextlib.contextmanager
def unchanged(root: StoragePath, *, after: bool = True) -> Iterator[None]:
    """Raise CheckpointReplacedError if the checkpoint at ``root`` was replaced or deleted while
    the block ran (whatever the block raised then: it may have read parts of two checkpoints).
    ``after=False``: only when the block raised (the caller checks once it is done)."""
    identity = _identity(root)
    try:
        yield
    except Exception as e:
        if _identity(root, fresh=True) != identity:
            raise _replaced(root) from e
        raise
    if after and _identity(root, fresh=True) != identity:
        raise _replaced(root)


def read_checkpointables(
    root: StoragePath,
) -> tuple[dict[str, Any], dict[str, fmt.Item], tuple[Any, ...], fmt.Checksums | None]:
    fmt.require_checkpoint(root)
    fmt.check_contained(root)  # before any file is opened (a FIFO would block the open forever)
    identity = _identity(root)
    with unchanged(root, after=False):  # every caller checks once it read what it needs
        checksums = fmt.Checksums.read(root)
        with fmt.verifying(checksums):
            meta = fmt.read_checkpoint_metadata(root)
    return meta, fmt.checkpointables(root, meta), identity, checksums


def _identity(root: StoragePath, *, fresh: bool = False) -> tuple[Any, ...]:
    """What changes when the checkpoint at ``root`` is replaced: its folder and its commit
    (``fresh``: asked of the storage again, not answered by what this call has read)."""
    if fresh:
        with workers.fresh_reads():
            return _identity(root)
    try:
        if is_local(root):
            st = os.stat(root)
            where: tuple[Any, ...] = (st.st_dev, st.st_ino)
            if not (
                root / fmt.CHECKPOINT_METADATA
            ).is_file():  # (opening a FIFO would wait forever)
                return (*where, "no metadata file")
        else:  # object stores: the generation of the commit marker, which every save writes anew
            where = ((root / fmt.COMMIT_MARKER).generation(),)
        meta = workers.declared.loads(
            (root / fmt.CHECKPOINT_METADATA).read_bytes(), str(root), "it", user_data=True
        )
        stamps = (
            (meta.get("init_timestamp_nsecs"), meta.get("commit_timestamp_nsecs"))
            if isinstance(meta, dict)
            else ()
        )
    except (OSError, ValueError):
        return ("unreadable",)
    return (*where, *stamps)


def _replaced(root: StoragePath) -> CheckpointReplacedError:
    return CheckpointReplacedError(
        f"the checkpoint at {root} was replaced or deleted while it was being loaded (an "
        "overwrite, or retention, in another process), so what was read may mix two "
        "checkpoints and was discarded. Load it again"
    )


class CheckpointMetadata:
    """What ``milepost.metadata`` returns: the tree and the checkpoint-level facts.

    ``tree`` is the main pytree (``state``, or the only one) with a :class:`LeafMetadata` per
    leaf; ``checkpointables`` has every checkpointable's metadata by name (None for one that
    cannot be described: ``unreadable`` says why; only the main tree's failure fails the call);
    ``custom_metadata``, ``metrics`` and the timestamps come from the checkpoint's
    ``_CHECKPOINT_METADATA``. Its ``repr`` (and its table in a notebook) lists every leaf with
    its bytes.

    >>> meta = milepost.metadata("/ckpt/100")
    >>> meta.tree["params"]["w"].shape, meta.nbytes, meta.custom_metadata
    """

    def __init__(
        self,
        path: StoragePath,
        meta: dict[str, Any],
        checkpointables: dict[str, Any],
        tree_name: str | None,
        unreadable: dict[str, str] | None = None,
    ) -> None:
        self.path = path
        """The checkpoint's folder."""
        self.checkpointables = checkpointables
        self.unreadable: dict[str, str] = dict(unreadable or {})
        """Why a checkpointable could not be described (its handler is unknown here, its files
        are damaged or gone), by name; its entry in ``checkpointables`` is None."""
        self.tree: Any = checkpointables.get(tree_name) if tree_name else None
        self.custom_metadata: dict[str, Any] = meta.get("custom_metadata") or {}
        self.metrics: dict[str, Any] = meta.get("metrics") or {}
        self.init_timestamp_nsecs: int | None = meta.get("init_timestamp_nsecs")
        """When the save started (nanoseconds since the epoch), if recorded."""
        self.commit_timestamp_nsecs: int | None = meta.get("commit_timestamp_nsecs")
        """When the save committed (nanoseconds since the epoch), if recorded."""
        handlers = meta.get("item_handlers") or {}
        self.item_handlers: dict[str, str] = (
            handlers if isinstance(handlers, dict) else {fmt.DEFAULT_ITEM: handlers}
        )
        """The typestr of the handler that saved each checkpointable, by name."""

    def leaves(self, checkpointable: str | None = None) -> list[Any]:
        """Every :class:`LeafMetadata` of the main tree (or of the pytree ``checkpointable``),
        in tree order."""
        tree = self.tree if checkpointable is None else self.checkpointables[checkpointable]
        return _views.flat_leaves(tree)

    @property
    def nbytes(self) -> int:
        """Bytes of every array of every pytree checkpointable."""
        return sum(
            _views.totals(_views.flat_leaves(part))[2] for part in self.checkpointables.values()
        )

    def _facts(self) -> dict[str, str]:
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
        for name, why in self.unreadable.items():
            facts[f"not described: {name}"] = why
        facts["custom_metadata"] = _views.short_json(self.custom_metadata)
        if self.metrics:
            facts["metrics"] = _views.short_json(self.metrics)
        return facts

    def _tables(self) -> list[tuple[str, list[tuple[str, ...]]]]:
        """(title, rows) per pytree checkpointable (each leaf named by its path)."""
        out = []
        for name, part in self.checkpointables.items():
            paths = _views.leaf_paths(part)
            if paths:
                n, arrays, nbytes = _views.totals([leaf for _, leaf in paths])
                out.append(
                    (
                        f"{name}: {n} leaves, {arrays} arrays, {_views.human_bytes(nbytes)}",
                        [_views.leaf_row(leaf, path) for path, leaf in paths],
                    )
                )
        return out

    def __repr__(self) -> str:
        lines = [f"CheckpointMetadata({str(self.path)!r})"]
        lines += [
            f"  {_views.printable(k)}: {_views.printable(v)}"
            for k, v in self._facts().items()
            if k != "path"
        ]
        text = "\n".join(lines)
        for title, rows in self._tables():
            text += "\n" + _views.text_table(_views.LEAF_COLUMNS, rows, title=title)
        return text

    def _repr_html_(self) -> str:
        out = _views.html_fields("CheckpointMetadata", self._facts())
        for title, rows in self._tables():
            out += _views.html_table(_views.LEAF_COLUMNS, rows, title=title)
        return out


@workers.reading_once()
def metadata(path: str | os.PathLike[str] | ObjectPath) -> CheckpointMetadata:
    options = _options.current()
    root = as_path(path)
    group = _hosts.check_storage(_hosts.host_group_for([]), root)

    def read() -> CheckpointMetadata:
        with unchanged(root):
            meta, items, _, checksums = read_checkpointables(root)
            try:
                tree_name: str | None = fmt.main_tree(root, items)
            except CheckpointNotFoundError:
                tree_name = None
            parts: dict[str, Any] = {}
            unreadable: dict[str, str] = {}
            failures: list[Exception] = []
            with fmt.verifying(checksums):
                for name, item in items.items():
                    try:
                        handler = resolve_for_load(name, item.handler, None, options.handlers)
                        _check_own_files(item.folder, handler, checksums)
                        parts[name] = handler.metadata(item.folder)
                    except (TypeError, ValueError, OSError) as e:
                        if name == tree_name or isinstance(e, CheckpointReplacedError):
                            raise  # the main tree is what the call is for
                        parts[name] = None
                        unreadable[name] = f"{type(e).__name__}: {e}"
                        failures.append(e)
            if items and len(failures) == len(items):
                raise failures[0]  # nothing could be described: say why, as for one tree
            for name in fmt.listed_items(root, meta).keys() - items.keys():
                unreadable[name] = (
                    f"listed in {fmt.CHECKPOINT_METADATA}, but its folder {root / name} is missing"
                )
        return CheckpointMetadata(root, meta, parts, tree_name, unreadable)

    return _hosts.shared(group, f"metadata:{root}", read, options.async_.timeout_secs)
