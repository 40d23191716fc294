"""Where each chunk of a checkpoint lies: the data file, offset and length of its shard value.

A load finds its arrays' chunks once, before reading: one B-tree walk of the checkpoint's root
OCDBT view (:func:`milepost.workers.format.find_values`: its nodes decoded as NumPy columns, or,
what that decoder does not read, TensorStore's ``ocdbt.dump``, said once at WARNING with the
reason). A value naming a file outside the checkpoint is a :class:`CorruptCheckpointError`, and
that file is never opened. What is found is kept here, looked up per box.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import numpy as np

from milepost.workers._messages import StoreSpec
from milepost.workers.format import FileRange, Prefixes, Values, find_values

_DICT_KEYS = 1 << 17
"""Indexes of up to this many keys are kept as a dict (~0.2 us a lookup); larger ones as NumPy
columns (a few us a lookup, a lookup per box: :meth:`Locator.locate_many`), whose memory is a
fifth of a dict's."""


class Locator:
    """Finds the file range that holds a key's value in a checkpoint's store."""

    def __init__(self, store: StoreSpec) -> None:
        self.directory = store.directory
        self.use_ocdbt = store.use_ocdbt
        self._found: list[Values] = []  # (from the NumPy walk)
        self._values: dict[str, FileRange] = {}  # (from TensorStore's walk)
        self._indexed: set[str] = set()
        self._first: dict[str, tuple[str, int]] = {}

    def index(self, names: Iterable[str]) -> None:
        """Learn the value locations of every chunk of these arrays (one B-tree walk)."""
        prefixes = sorted({n + "/" for n in names} - self._indexed)
        if not prefixes or not self.use_ocdbt:
            return
        wanted = Prefixes(p.encode() for p in prefixes)
        found = find_values(self.directory, wanted)
        if isinstance(found, Values):
            self._learn(found, wanted.sorted)
        else:  # (TensorStore's walk: keyed file ranges)
            self._walk(found)
        self._indexed.update(prefixes)

    def _learn(self, found: Values, prefixes: list[bytes]) -> None:
        paths = [os.path.join(self.directory, p) for p in found.paths]
        if len(found) <= _DICT_KEYS:  # (a dict: the cheapest lookups, one key at a time)
            for key, f, offset, length in found.rows():
                self._values[key.decode()] = FileRange(paths[f], offset, length)
        else:
            self._found.append(found)
        files = found.column("files")
        # Each array's first value in (file, offset) order: the keys come grouped by array.
        groups, offsets = found.column("groups"), found.column("offsets")
        if not len(groups):
            return
        by_rank = sorted(range(len(paths)), key=paths.__getitem__)
        rank = np.empty(len(paths), np.int64)
        rank[by_rank] = np.arange(len(paths))
        span = int(offsets.max()) + 1
        if len(paths) * span < 2**62:  # (one int64 orders (file, offset))
            where = rank[files] * span + offsets
            starts = np.flatnonzero(np.r_[True, groups[1:] != groups[:-1]])
            least = np.minimum.reduceat(where, starts)
            for g, w in zip(groups[starts].tolist(), least.tolist(), strict=True):
                at = (paths[by_rank[w // span]], w % span)
                self._note_first(prefixes[g][:-1].decode(), at)
        else:
            for g, f, o in zip(groups.tolist(), files.tolist(), offsets.tolist(), strict=True):
                self._note_first(prefixes[g][:-1].decode(), (paths[f], o))

    def _walk(self, found: list[tuple[bytes, FileRange]]) -> None:
        for key, value in found:
            name = key.decode()
            self._values[name] = value
            self._note_first(name.rsplit("/c", 1)[0], (value.path, value.offset))

    def _note_first(self, array: str, at: tuple[str, int]) -> None:
        first = self._first.get(array)
        if first is None or at < first:
            self._first[array] = at

    def first_location(self, name: str) -> tuple[str, int] | None:
        """The file and offset of the array's first stored value (None: not indexed, or no
        value in a data file): reading arrays in this order reads each file front to back."""
        return self._first.get(name)

    def locate(self, key: str) -> FileRange | None:
        return self.locate_many([key])[0]

    def locate_many(self, keys: Sequence[str]) -> list[FileRange | None]:
        """:meth:`locate` of every key (a box's chunks): one lookup for them all."""
        if not self.use_ocdbt:
            return [self._file(key) for key in keys]
        out = [self._values.get(key) for key in keys]
        for found in self._found:
            missing = [i for i, value in enumerate(out) if value is None]
            if not missing:
                break
            got = found.find([keys[i].encode() for i in missing])
            for i, at in zip(missing, got, strict=True):
                if at is not None:
                    path, offset, length = at
                    out[i] = FileRange(os.path.join(self.directory, path), offset, length)
        return out

    def _file(self, key: str) -> FileRange | None:
        path = os.path.join(self.directory, key)
        try:
            return FileRange(path=path, offset=0, length=os.path.getsize(path))
        except OSError:
            return None
