"""Chunk checksums for host jobs that read a few arrays' chunks through TensorStore (verify, a
preview): each chunk's from its writer's table (:mod:`milepost.workers.format._chunk_tables`)."""

from __future__ import annotations

from typing import Any

from milepost.workers._messages import StoreSpec
from milepost.workers.format import ChunkTables, shard_key
from milepost.workers.load._locator import Locator


class ArrayChecks:
    """For jobs that read chunks of a few arrays through TensorStore (verify, a preview): the
    checksum each chunk must have, from its writer's table (one B-tree walk for the arrays)."""

    def __init__(self, store: StoreSpec, names: list[str], context: Any) -> None:
        self._locator = Locator(store)
        self._locator.index(names)
        self._tables = ChunkTables(store, context)

    def expected(
        self,
        name: str,
        grid: tuple[int, ...],
        chunk_shape: tuple[int, ...],
        shard_shape: tuple[int, ...],
    ) -> int:
        """As :meth:`ChunkTables.expected`, for chunk ``grid`` of ``name``; -1 for a chunk
        not in a data file (inline in the B-tree, which the commit records, or missing)."""
        key = shard_key(name, grid, chunk_shape, shard_shape)
        value = self._locator.locate(key)
        return -1 if value is None else self._tables.expected(name, grid, value)
