"""Whether every data file a save wrote is there, whole, before its commit calls it committed.

A store may acknowledge a write it did not keep (a proxy or gateway that answers a PUT it never
forwards), and another program may remove or cut a local file while a save runs. The commit
reads back the small files it writes; the data files are many and large, so they are confirmed
by listing, not read: each file the checkpoint references must be there, and at least as long
as the last byte it references in it.

- Local folders: one ``os.scandir`` per folder, each wanted file's size from its ``stat``.
- Object stores: one listing of the folder. TensorStore's listing gives keys, not sizes, so
  this confirms presence; an object is written whole, by one request, or not at all, so one
  that is there is as long as its write (a size per object would cost a request per file).

What must be there comes from what the save made: the root OCDBT view's references (each data
file up to the end of its last value, :func:`root_sizes` or the direct merge's columns), the
databases the hosts said they wrote, a plain zarr3 array's chunk files, a safetensors export's
files.
"""

from __future__ import annotations

import errno
import os
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts

from milepost.workers._errors import LostWriteError
from milepost.workers._paths import as_path, context_for, is_local, kvstore
from milepost.workers.format._ocdbt_format import FormatError, note_fallback
from milepost.workers.format._ocdbt_index import indirect_values
from milepost.workers.format._ts_internals import ocdbt_values


def confirm_files(directory: Any, sizes: Mapping[str, int], what: str = "the save") -> None:
    """Raise :class:`LostWriteError` naming a file of ``sizes`` (paths relative to
    ``directory``, each with the bytes it must at least hold) that is missing or shorter;
    ``what`` names what wrote them, for the message."""
    if not sizes:
        return
    where = as_path(directory)
    if is_local(where):
        found = _local_sizes(where, sizes)
    else:  # (presence only: see the module's docstring)
        listed = set(where.keys())
        found = {name: size for name, size in sizes.items() if name in listed}
    problems = sorted(n for n, size in sizes.items() if found.get(n, -1) < size)
    if not problems:
        return
    first = problems[0]
    more = f" (and {len(problems) - 1} more: {', '.join(problems[1:4])}" if problems[1:] else ""
    more += ", ..." if len(problems) > 4 else ""
    more += ")" if more else ""
    raise lost_write(str(where / first), sizes[first], found.get(first), what, more)


def lost_write(
    path: str, expected: int, found: int | None, what: str = "the save", more: str = ""
) -> LostWriteError:
    """The error for the file ``path`` that ``what`` wrote, found missing (``found`` None) or
    holding ``found`` of the ``expected`` bytes; ``more``: what else is, for the message."""
    state = (
        "is missing"
        if found is None
        else f"holds {found} bytes where the checkpoint needs at least {expected}"
    )
    return LostWriteError(
        errno.EIO,
        f"{what} wrote {path}, but it {state} before the commit{more}: the storage "
        "acknowledged a write it did not keep (a proxy or gateway that drops writes?), or "
        "another program removed or cut the file. Nothing was committed, and what the save "
        "wrote is removed. Save again, and check the storage path",
        path,
        path=path,
        expected_bytes=expected,
        found_bytes=found,
    )


def _local_sizes(root: Path, sizes: Mapping[str, int]) -> dict[str, int]:
    """The size of each regular file of ``sizes`` below ``root`` (missing ones left out): one
    listing per folder."""
    by_folder: dict[str, set[str]] = defaultdict(set)
    for name in sizes:
        folder, _, leaf = name.rpartition("/")
        by_folder[folder].add(leaf)
    found: dict[str, int] = {}
    for folder, wanted in by_folder.items():
        try:
            with os.scandir(os.path.join(root, folder) if folder else root) as listing:
                for entry in listing:
                    if entry.name in wanted and entry.is_file(follow_symlinks=False):
                        key = f"{folder}/{entry.name}" if folder else entry.name
                        found[key] = entry.stat(follow_symlinks=False).st_size
        except (FileNotFoundError, NotADirectoryError):
            pass  # (every file wanted in it is missing)
    return found


class _Everything:
    def match(self, key: bytes) -> bool:
        return True

    def overlaps(self, low: bytes, high: bytes | None) -> bool:
        return True


def root_sizes(directory: Any) -> dict[str, int]:
    """Every data file the OCDBT view in ``directory`` references (paths from it), each with
    the end of the last value it holds: one walk of its B-tree (for a view the commit's
    direct merge did not write, whose columns give this at no cost)."""
    where = as_path(directory)
    kv = ts.KvStore.open(kvstore(where), context=context_for(where)).result()
    ends: dict[str, int] = {}
    try:
        values = indirect_values(kv, [b""], str(where))
    except FormatError as e:  # (TensorStore walks what that decoder does not read)
        note_fallback("B-tree walk", "TensorStore's ocdbt.dump", e)
        for _, found in ocdbt_values("", _Everything(), base=kv):
            end = found.offset + found.length
            ends[found.path] = max(ends.get(found.path, 0), end)
        return ends
    files = values.column("files")
    last = np.zeros(len(values.paths) + 1, np.uint64)
    if len(files):
        end = values.column("offsets").astype(np.uint64) + values.column("lengths")
        np.maximum.at(last, files, end)
    return {path: int(last[i]) for i, path in enumerate(values.paths)}
