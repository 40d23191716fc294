"""A host's part of the peer tier: copy its shards of a step to host memory, and build arrays
back from a part (its own, or a peer's copy).

Staging is the blocking part of a peer save: every distinct box this host's devices hold is
copied into one buffer of host memory. The CRC32Cs, the write to the node's folder and the
copies to the peers run afterwards, behind the training step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from milepost.workers._keys import dtype_name, dtype_of, from_data, is_key, key_words, to_data
from milepost.workers._memory import host_views, parallel_copy
from milepost.workers._messages import Index
from milepost.workers._sharding import ShardingSpec
from milepost.workers.format import crc32c
from milepost.workers.peers._store import Box, Part, box_view


@dataclass(frozen=True, kw_only=True)
class ArrayRecord:
    """What the controller keeps of one saved array, to rebuild it: its global shape, dtype
    (``dtype_name``: ``key<impl>`` for typed keys) and sharding."""

    shape: tuple[int, ...]
    dtype: str
    sharding: ShardingSpec


@dataclass
class Staged:
    """This host's shards of one step, copied: the boxes (CRC32C not yet computed) and their
    bytes, one after another."""

    step: int
    owner: int
    token: str
    hosts: int
    dtypes: tuple[str, ...]
    boxes: list[tuple[int, Index, int, int]]
    """``(array, index, offset, nbytes)`` of every distinct box."""
    data: np.ndarray
    leaves: tuple[tuple[int, Any], ...] = ()

    def part(self) -> Part:
        """The part's manifest, with every box's CRC32C (computed here, off the caller's
        step)."""
        return Part(
            step=self.step,
            owner=self.owner,
            token=self.token,
            hosts=self.hosts,
            dtypes=self.dtypes,
            boxes=tuple(
                Box(
                    array=a,
                    index=index,
                    offset=offset,
                    nbytes=n,
                    crc32c=crc32c(self.data[offset : offset + n]),
                )
                for a, index, offset, n in self.boxes
            ),
            leaves=self.leaves,
        )


def _index(index: tuple[slice, ...], shape: tuple[int, ...]) -> Index:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


def stage(
    arrays: Sequence[Any],
    *,
    step: int,
    owner: int,
    token: str,
    hosts: int,
    leaves: tuple[tuple[int, Any], ...] = (),
    reuse: np.ndarray | None = None,
) -> Staged:
    """Copy every distinct box this process's devices hold of ``arrays`` (global ``jax.Array``s)
    into one buffer: the caller may change or donate its arrays once this returns. ``reuse``:
    the buffer of an earlier step whose part and copies are written, taken when its size fits
    (a training loop keeps the same tree: its pages are already backed)."""
    pieces: list[tuple[int, Index, Any]] = []
    dtypes = []
    for k, array in enumerate(arrays):
        dtypes.append(dtype_name(array.dtype))
        data = to_data(array) if is_key(array.dtype) else array
        seen: set[Index] = set()
        for shard in data.addressable_shards:
            index = _index(shard.index, tuple(data.shape))
            if index not in seen:
                seen.add(index)
                pieces.append((k, index, shard.data))
    boxes: list[tuple[int, Index, int, int]] = []
    offset = 0
    for k, index, shard in pieces:
        n = math.prod(hi - lo for lo, hi in index) * shard.dtype.itemsize
        boxes.append((k, index, offset, n))
        offset += n
    buffer = reuse if reuse is not None and reuse.nbytes == offset else np.empty(offset, np.uint8)
    pairs = []
    sources = host_views([shard for _, _, shard in pieces])  # (off CPU: every copy started)
    for src, (_, _, start, n) in zip(sources, boxes, strict=True):
        pairs.append((buffer[start : start + n].view(src.dtype).reshape(src.shape), src))
    parallel_copy(pairs)
    return Staged(
        step=step,
        owner=owner,
        token=token,
        hosts=hosts,
        dtypes=tuple(dtypes),
        boxes=boxes,
        data=buffer,
        leaves=leaves,
    )


def restore(part: Part, data: np.ndarray, records: Sequence[ArrayRecord]) -> list[Any]:
    """The global arrays of ``records`` on this process's devices, from a checked part of this
    process's boxes (the slice has the topology the part was saved on)."""
    import jax

    if len(part.dtypes) != len(records):
        raise ValueError(
            f"the peer tier's part of step {part.step} holds {len(part.dtypes)} arrays, the "
            f"saved tree has {len(records)}; recover with the tree the step was saved with"
        )
    by_array: list[dict[Index, np.ndarray]] = [{} for _ in records]
    for box in part.boxes:
        record = records[box.array]
        stored = np.uint32 if record.dtype.startswith("key<") else np.dtype(dtype_of(record.dtype))
        by_array[box.array][box.index] = box_view(data, box, stored)
    out = []
    for k, (record, boxes) in enumerate(zip(records, by_array, strict=True)):
        if part.dtypes[k] != record.dtype:
            raise ValueError(
                f"array {k} of the peer tier's step {part.step} is {part.dtypes[k]}, the saved "
                f"tree says {record.dtype}"
            )
        key_impl = record.dtype[4:-1] if record.dtype.startswith("key<") else None
        shape = tuple(record.shape)
        sharding = record.sharding
        if key_impl is not None:
            shape = (*shape, *key_words(key_impl))

        def piece(
            index: tuple[slice, ...] | None,
            shape: tuple[int, ...] = shape,
            boxes: dict[Index, np.ndarray] = boxes,
            k: int = k,
        ) -> np.ndarray:
            assert index is not None
            box = _index(index, shape)
            try:
                return boxes[box]
            except KeyError:
                raise ValueError(
                    f"the peer tier's part of step {part.step} (host {part.owner}) lacks box "
                    f"{box} of array {k}: it was saved on another topology"
                ) from None

        array = jax.make_array_from_callback(shape, sharding.to_jax(), piece)
        out.append(from_data(array, key_impl) if key_impl is not None else array)
    return out


def record_of(array: Any, sharding: ShardingSpec) -> ArrayRecord:
    return ArrayRecord(shape=tuple(array.shape), dtype=dtype_name(array.dtype), sharding=sharding)
