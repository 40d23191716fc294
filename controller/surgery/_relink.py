"""A surgery that only renames or reorders stored leaves moves no array bytes.

The source's per-process OCDBT databases are rebuilt in the output: their data files are hard
links to the source's (OCDBT never changes a data file once written), their manifests copies;
inside each copy the arrays' keys are renamed (``copy_range_to`` within one database copies
index entries, not data), then the root view is merged and the format files written from the
source's, renamed. The source is never modified. Anything else (another storage than local
files, a new sharding, names that collide) takes the general path, and so does a surgery that
drops a stored array: the shared data files would still hold its bytes, and a checkpoint pruned
of its optimizer state to be shared must not carry it. The databases are walked again when they
are linked (a symlink or anything but a file found then is refused: nothing outside the source
is linked or copied)."""

from __future__ import annotations

import logging
import os
import shutil
import stat
from pathlib import Path
from typing import Any

import tensorstore as ts

from milepost import _checkpoint, _tree, workers
from milepost._errors import CorruptCheckpointError
from milepost._tree import storage_name_of
from milepost.surgery._lazy import LazyArray, Source, nest
from milepost.workers import format as fmt

log = logging.getLogger("milepost.surgery")


_ARRAYS = (_tree.ValueType.JAX_ARRAY, _tree.ValueType.NP_ARRAY)
"""Stored leaves a drop must not leave behind (scalars are written anew by every surgery)."""


def plan(arrays: dict[str, LazyArray], shardings_given: bool) -> tuple[Any, dict[str, str]] | None:
    """(the source checkpoint, {old storage name: new path}) when the output is stored leaves of
    one local OCDBT checkpoint, kept as they are; else None."""
    sources = {name: x.expr for name, x in arrays.items() if isinstance(x.expr, Source)}
    if shardings_given or not arrays or len(sources) != len(arrays):
        return None
    checkpoints = {id(s.checkpoint): s.checkpoint for s in sources.values()}
    if len(checkpoints) != 1:
        return None
    (ck,) = checkpoints.values()
    if (
        workers.in_object_store(ck.folder)
        or not ck.files.use_ocdbt
        or ck.files.zarr_format != 3
        or ck.files.key_impls
    ):
        return None
    renames: dict[str, str] = {}
    for new, source in sources.items():
        old = source.name
        if old in renames:  # one stored leaf under two names: a copy, not a rename
            return None
        renames[old] = new
    if any(
        leaf.value_type in _ARRAYS and name not in renames for name, leaf in ck.files.leaves.items()
    ):
        return None  # a stored array is dropped: its bytes must not stay in the output's files
    stored = {storage_name_of(n) for n in renames.values()}
    if len(stored) != len(renames):
        return None  # two paths, one storage name: the general path says which
    moved_away = set(ck.files.leaves) - {o for o, n in renames.items() if o == storage_name_of(n)}
    if stored & moved_away:
        return None  # a new name another stored key still holds until it is renamed itself
    return ck, renames


def link_databases(ck: Any, renames: dict[str, str], directory: Path) -> None:
    """On the primary: the source's databases in ``directory``, renamed (no data copied)."""
    renames = {old: storage_name_of(path) for old, path in renames.items()}
    source = Path(ck.folder)
    databases = sorted(p for p in source.iterdir() if p.name.startswith(fmt.PROCESS_PREFIX))
    context = fmt.new_context(directory)
    for db in databases:
        _check_plain(db)
        if not db.is_dir():
            continue
        target = directory / db.name
        for dirpath, dirs, files in os.walk(db):
            here = Path(dirpath)
            rel = here.relative_to(db)
            (target / rel).mkdir(parents=True, exist_ok=True)
            for f in [*dirs, *files]:
                _check_plain(here / f)
            for f in files:
                # (never through a link: one put here after the checks is linked or copied as a
                # link)
                if rel.parts[:1] == ("d",):
                    os.link(
                        here / f, target / rel / f, follow_symlinks=False
                    )  # data files: immutable, shared
                else:
                    shutil.copyfile(
                        here / f, target / rel / f, follow_symlinks=False
                    )  # the manifest: rewritten below
        kv = ts.KvStore.open(fmt.ocdbt_kvstore(target), context=context).result()
        present = {k.decode().split("/", 1)[0] for k in kv.list().result()}
        tables = fmt.CHUNK_TABLE_PREFIX.split("/", 1)[0]
        if tables in present:  # the chunk checksum table, its arrays renamed
            present.discard(tables)
            _rename_table(kv, db.name, renames)
        for old in sorted(present):
            new = renames.get(old)
            if new == old:
                continue
            if new is not None:
                (kv / f"{old}/").experimental_copy_range_to(kv / f"{new}/").result()
            kv.delete_range(ts.KvStore.KeyRange(f"{old}/", f"{old}0")).result()  # '0' follows '/'


def _rename_table(kv: Any, database: str, renames: dict[str, str]) -> None:
    """Rewrite a linked database's chunk checksum table under the arrays' new names."""
    key = fmt.CHUNK_TABLE_PREFIX + database
    read = kv.read(key).result()
    if read.state != "value":
        raise CorruptCheckpointError(
            f"the database {database} of the source has no chunk checksum table ({key!r}); the "
            "source checkpoint is damaged. Load an earlier checkpoint."
        )
    table = fmt.decode_chunk_table(database, bytes(read.value), f"{database}, key {key!r}")
    renamed = {
        renames[name]: sorted(chunks.items()) for name, chunks in table.items() if name in renames
    }
    kv.write(key, fmt.encode_chunk_table(database, renamed)).result()


def _check_plain(path: Path) -> None:
    """Refuse a symlink, or anything but a file or folder, in a database being linked: the
    source changed since it was opened, and what it points at is not the source's."""
    st = os.lstat(path)
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        raise CorruptCheckpointError(
            f"{path} is a symlink or not a regular file: the source checkpoint changed "
            "since it was opened, and surgery links and copies nothing from outside it. "
            "Open the source again (it is checked then)"
        )


def finish(
    ck: Any,
    renames: dict[str, str],
    order: list[str],
    files: _checkpoint.TreeSavePlan,
    acks: list[workers.SaveAck],
    directory: Path,
) -> _checkpoint.WrittenTree:
    """On the primary: the tree for the commit, which writes its format files (the renamed
    arrays' from the source's) and its root view."""
    src = ck.files
    keyed = {leaf.name: leaf for leaf in _tree.flatten(nest(dict.fromkeys(renames.values(), 0)))[0]}
    written = []
    for old, path in renames.items():
        new = storage_name_of(path)
        saved = src.leaves[old]
        files.leaves[new] = fmt.SavedLeaf.of(keyed[new], saved.value_type, saved.write_shape)
        if old in src.shardings:
            files.shardings[new] = src.shardings[old]
        meta = ck.leaf_meta[old]
        written.append(
            workers.WrittenArray(
                name=new,
                write_shape=tuple(meta.write_shape or ()),
                chunk_shape=tuple(meta.chunk_shape or ()),
                chunk_crc32c=tuple(sorted(src.chunk_crc32c.get(old, {}).items())),
            )
        )
    acks = [
        *acks,
        workers.SaveAck(
            process_index=0,
            bytes_written=0,
            arrays=tuple(written),
            # (the linked databases' tables, renamed: link_databases)
            chunk_tables=("linked",) if src.chunk_tables else (),
        ),
    ]
    stored_order = [storage_name_of(n) for n in order]
    files.leaves = {n: files.leaves[n] for n in stored_order if n in files.leaves}
    log.info(
        "relinked %d arrays of %s into %s (no array bytes moved)", len(renames), ck.path, directory
    )
    return _checkpoint.WrittenTree(directory, files.files, acks)
