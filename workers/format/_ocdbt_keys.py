"""OCDBT keys as rows: the keys of a node, stored as prefix-coded columns (each key as the bytes
it shares with the key before and its own bytes after them), made into the rows of a NUL-padded
``uint8`` matrix and back, with NumPy (:mod:`._ocdbt_format` reads and writes the columns)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np

from milepost.workers._runtime import Pool

BLOCK = 1 << 20
"""Entries a pass over columns as long as a merge's keys takes at a time when it needs
temporaries: at 8 M keys a temporary as long as the keys is 32-64 MB, which the allocator maps
afresh every time (above glibc's 32 MB), and whose first touches cost what its work does."""


def padded(items: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """``items`` as the rows of a NUL-padded uint8 matrix, and their lengths."""
    lengths = np.array([len(b) for b in items], np.int64)
    width = int(lengths.max()) if len(items) else 0
    flat = np.frombuffer(b"".join(b.ljust(width, b"\0") for b in items), np.uint8)
    return flat.reshape(len(items), width), lengths


def shared_prefixes(rows: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """How many bytes each row of a NUL-padded matrix shares with the next one."""
    if len(rows) < 2:
        return np.zeros(0, np.int64)
    differ = np.concatenate([rows[1:] != rows[:-1], np.ones((len(rows) - 1, 1), bool)], axis=1)
    first = np.argmax(differ, axis=1)
    return np.minimum(first, np.minimum(lengths[1:], lengths[:-1]))


def rebuild_keys(
    prefix: np.ndarray,
    suffix: np.ndarray,
    raw: np.ndarray,
    pool: Pool | None = None,
    width: int | None = None,
) -> np.ndarray:
    """The keys (NUL-padded rows) of the key columns of one or more leaves one after another:
    each key's own bytes go in place, then each byte it shares with the key before is taken
    from the row that wrote that column last (the nearest one above, as a shared prefix is
    never longer than the key before), a slab of columns at a time. With a ``pool``, parts
    that start at a leaf's first key (which shares nothing) are rebuilt side by side, one per
    thread (NumPy lets go of the GIL). At 4,096 hosts x 2,000 arrays (8.2 M keys of 29
    bytes), 1.1 s on two threads, against 1.8-2.2 s copying by one index per byte."""
    n = len(prefix)
    if width is None:  # (else rows of ``width`` bytes: longer keys cut, see long_keys)
        width = int((prefix + suffix).max()) if n else 0
    keys = np.zeros((n, width), np.uint8)
    threads = (pool.max_threads or 1) if pool is not None else 1
    firsts = np.flatnonzero(prefix == 0)
    nearest = np.searchsorted(firsts, np.arange(1, threads) * n // threads)
    cuts = sorted({0, n, *firsts[nearest[nearest < len(firsts)]].tolist()})
    parts = [
        (lo, hi, at)
        for (lo, hi), at in zip(
            itertools.pairwise(cuts), raw_starts(suffix, np.array(cuts[:-1])).tolist(), strict=True
        )
    ]
    if pool is None or len(parts) == 1:
        for part in parts:
            _rebuild(keys, prefix, suffix, raw, *part)
    else:
        pool.map(lambda part: _rebuild(keys, prefix, suffix, raw, *part), parts)
    return keys


def raw_starts(suffix: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Where the own bytes of each of ``rows`` (increasing) start in the key bytes column: the
    sum of the suffix lengths before it. Summed in blocks of ``BLOCK`` rows: no column of sums
    as long as the keys (at 8 M keys, 64 MB of fresh memory for a few offsets), and no
    ``np.add.reduceat`` casting to 64 bits (0.15-0.19 s a call at 8 M keys, against 0.01-0.03)."""
    out = np.empty(len(rows), np.int64)
    total = done = 0  # (the sum before the block; the rows placed)
    for lo in range(0, len(suffix), BLOCK):
        if done == len(rows):
            break
        block = suffix[lo : lo + BLOCK]
        upto = int(np.searchsorted(rows, lo + len(block)))
        if upto == done:
            total += int(block.sum(dtype=np.int64))
            continue
        sums = np.cumsum(block, dtype=np.int64)
        at = rows[done:upto] - lo
        out[done:upto] = total + np.where(at > 0, sums[at - 1], 0)
        total += int(sums[-1])
        done = upto
    return out


def long_keys(
    keys: np.ndarray,
    prefix: np.ndarray,
    suffix: np.ndarray,
    raw: np.ndarray,
    place: Callable[[np.ndarray], np.ndarray] | None = None,
) -> dict[int, bytes]:
    """Every key longer than the rows of ``keys`` (:func:`rebuild_keys` with a ``width``), whole,
    by row (in the columns' order; ``place``: where a row of theirs is in ``keys``, if not
    there). A key shares with the one before at most that one's length: what it shares lies in
    that one's row, or (past the width) in that one's whole key, made just before."""
    width = keys.shape[1]
    rows = np.concatenate(
        [
            np.flatnonzero(prefix[lo : lo + BLOCK] + suffix[lo : lo + BLOCK] > width) + lo
            for lo in range(0, len(prefix), BLOCK)
        ]
        or [np.zeros(0, np.int64)]
    )
    if not len(rows):
        return {}
    above = np.maximum(rows - 1, 0)
    above = (place(above) if place is not None else above).tolist()
    out: dict[int, bytes] = {}
    starts = raw_starts(suffix, rows).tolist()
    for i, at, row in zip(rows.tolist(), starts, above, strict=True):
        p = int(prefix[i])
        head = out[i - 1][:p] if p > width else keys[row, :p].tobytes() if p else b""
        out[i] = head + raw[at : at + suffix[i]].tobytes()
    return out


def _rebuild(
    keys: np.ndarray,
    prefix: np.ndarray,
    suffix: np.ndarray,
    raw: np.ndarray,
    start: int,
    end: int,
    raw_at: int,
) -> None:
    """Rows ``start`` to ``end`` of :func:`rebuild_keys` (``start``: a key that shares nothing,
    whose own bytes are at ``raw_at`` in ``raw``)."""
    width = keys.shape[1]
    flat = keys.reshape(-1)
    block = 1 << 13  # (a block's index vector stays in cache)
    for lo in range(start, end, block):
        hi = min(end, lo + block)
        p, s = prefix[lo:hi], suffix[lo:hi]
        total = int(s.sum())
        # each own byte's place: its row's start plus its column (prefix + index within)
        starts = np.arange(lo, hi, dtype=np.int64) * width + p
        at = np.repeat(starts - (np.cumsum(s) - s), s) + np.arange(total)
        own = raw[raw_at : raw_at + total]
        raw_at += total
        if np.any(p + s > width):  # (keys cut at the width: their bytes past it dropped)
            within = at - np.repeat(np.arange(lo, hi, dtype=np.int64) * width, s) < width
            at, own = at[within], own[within]
        flat[at] = own
    # A row owns its columns from its shared prefix on (past its end: zeros); a column before
    # it is the one of the nearest row above that owns it. Between two of the shared prefix
    # lengths that occur, a and the next, every column has the same owners (the nearest row
    # whose prefix is at most a): one slab of columns is copied per length (a handful, as
    # keys share their leading path parts), not one index per byte; in blocks of rows, whose
    # temporaries stay in cache, each level's owner carried from the block before.
    levels = _levels(np.unique(prefix[start:end]).tolist(), width)
    owners = [start] * len(levels)  # (row ``start`` shares nothing: it owns every column)
    block = 1 << 16
    for lo in range(start, end, block):
        hi = min(end, lo + block)
        p = prefix[lo:hi]
        near = np.arange(lo, hi, dtype=np.int64)
        for j, (a, b) in enumerate(levels):
            owner = np.where(p <= a, near, owners[j])
            np.maximum.accumulate(owner, out=owner)
            owners[j] = int(owner[-1])
            keys[lo:hi, a:b] = keys[owner, a:b]


def _levels(shared: list[int], width: int) -> list[tuple[int, int]]:
    """The slabs of columns a rebuild copies: from each of the shared prefix lengths that occur
    (sorted) to the next (the last to ``width``), within the width."""
    levels = [(a, min(b, width)) for a, b in zip(shared, [*shared[1:], width], strict=True)]
    return [(a, b) for a, b in levels if a < b]


class RankMajor:
    """The rows of several sources, each sorted and stored one after another (``sizes``
    rows each, "source order"), laid out rank by rank: every source's first row, then every
    source's second row, and so on (the sources longest first, in their order among equals).

    The sources of a merge are the hosts' databases, and they hold the same kinds of keys: at
    4,096 hosts x 2,000 arrays each host holds one chunk of every array, so the rows of one
    rank are one array's chunks and this layout is sorted but for a few places per array.
    Sorted in source order, the same keys are 4,096 runs that interleave everywhere: a merge
    sort of them takes log2(4,096) passes over every key, and each row it compares, and every
    gather by the order after it, is a row 2,000 rows from the last. Laid out by rank, the
    sort takes a pass and every gather stays among neighbouring rows (docs/performance.md).
    The keys are made rank by rank (:meth:`rebuild`), the other columns laid out after
    (:meth:`lay_out`)."""

    def __init__(self, sizes: Sequence[int]) -> None:
        sizes_ = np.asarray(sizes, np.int64)
        self.n = int(sizes_.sum())
        self._source_firsts = np.cumsum(sizes_) - sizes_
        by_size = np.argsort(-sizes_, kind="stable")
        self._by_size = by_size
        self._sizes = sizes_[by_size]  # (longest first)
        self._firsts = self._source_firsts[by_size]  # (each source's first row, longest first)
        self._slot = np.empty(len(sizes_), np.int64)  # (each source's place within a rank)
        self._slot[by_size] = np.arange(len(sizes_))
        longest = int(sizes_.max()) if len(sizes_) else 0
        having = len(sizes_) - np.searchsorted(np.sort(sizes_), np.arange(longest), "right")
        self._starts = np.concatenate([[0], np.cumsum(having)])  # (each rank's first place)

    def rows(self, places: np.ndarray) -> np.ndarray:
        """The source-order row laid at each of ``places``."""
        rank = np.searchsorted(self._starts, places, "right") - 1
        return self._firsts[places - self._starts[rank]] + rank

    def places(self, rows: np.ndarray) -> np.ndarray:
        """Where each of the source-order ``rows`` is laid."""
        source = np.searchsorted(self._source_firsts, rows, "right") - 1  # (skips empty ones)
        return self._starts[rows - self._source_firsts[source]] + self._slot[source]

    def nearly_sorted(self, laid: np.ndarray, samples: int = 1 << 16) -> bool:
        """Whether ``laid`` (fixed-width bytes, laid out by rank) is sorted but for at most one
        place in 16 of a sample of neighbouring places. (Sources of disjoint keys laid out by
        rank are not: their sort is cheaper in source order.)"""
        if self.n < 2:
            return True
        places = np.arange(1, self.n, max(1, self.n // samples))
        return int(np.count_nonzero(laid[places] < laid[places - 1])) * 16 <= len(places)

    def rebuild(
        self,
        prefix: np.ndarray,
        suffix: np.ndarray,
        raw: np.ndarray,
        width: int,
        pool: Pool | None = None,
    ) -> np.ndarray:
        """:func:`rebuild_keys` of the sources' prefix-coded key columns (in source order),
        its rows laid out by rank: each key's shared prefix is its source's key before, one
        rank up. The sources are split among the threads; each goes through the ranks a block
        at a time, each source's own bytes placed, then its shared columns copied from the
        nearest key above in its source that owns them (carried from block to block)."""
        keys = np.zeros((self.n, width), np.uint8)
        if not self.n:
            return keys
        levels = _levels(np.flatnonzero(np.bincount(prefix, minlength=1)).tolist(), width)
        # where each source's own bytes start in ``raw`` (by slot; empty sources: anywhere)
        firsts = np.minimum(self._source_firsts, self.n - 1)
        bytes_at = raw_starts(suffix, firsts)[self._by_size]
        threads = (pool.max_threads or 1) if pool is not None else 1
        # (each thread's sources, as many keys each: the sources' keys before each slot)
        before = np.concatenate([[0], np.cumsum(self._sizes)])
        cuts = np.searchsorted(before, np.arange(threads + 1) * self.n // threads).tolist()
        cuts[-1] = len(self._sizes)
        parts = list(itertools.pairwise(cuts))
        jobs = self._jobs()

        def part(span: tuple[int, int]) -> None:
            lo, hi = span
            owners = [np.arange(lo, hi) for _ in levels]  # (rank 0's keys own every column)
            for first, end in jobs:
                count = int(self._starts[first + 1] - self._starts[first])  # (sources)
                top = min(hi, count)
                if top <= lo:
                    continue
                # (source, rank): each source's keys of the block, as its columns hold them
                rows = self._firsts[lo:top, None] + np.arange(first, end)
                places = self._starts[first:end] + np.arange(lo, top)[:, None]
                p, s = prefix[rows].astype(np.int64), suffix[rows].astype(np.int64)
                ends = np.cumsum(s, axis=1)
                _place_own(keys, raw, places, p, s, bytes_at[lo:top, None] + ends - s)
                bytes_at[lo:top] += ends[:, -1]
                # (rank, source): the block's rows of this part, rank by rank, and the place
                # of the nearest key above in each one's source whose own bytes hold a level
                block = keys[self._starts[first] : self._starts[end]]
                block = block.reshape(end - first, count, width)[:, lo:top]
                p, places = p.T, places.T
                for j, (a, b) in enumerate(levels):
                    owner = np.where(p <= a, places, -1)
                    np.maximum(owner[0], owners[j][: top - lo], out=owner[0])
                    np.maximum.accumulate(owner, axis=0, out=owner)
                    owners[j][: top - lo] = owner[-1]
                    block[:, :, a:b] = keys[owner, a:b]

        if pool is None or threads == 1:
            part(parts[0])
        else:
            pool.map(part, parts)
        return keys

    def _jobs(self) -> list[tuple[int, int]]:
        """Blocks of ranks (first, end) that as many sources have, ~``_LAY_BLOCK`` rows each."""
        jobs = []
        having = np.diff(self._starts)
        edges = np.flatnonzero(np.diff(having)) + 1
        for lo, hi in itertools.pairwise([0, *edges.tolist(), len(having)]):
            step = max(1, _LAY_BLOCK // int(having[lo]))
            jobs += [(r, min(r + step, hi)) for r in range(lo, hi, step)]
        return jobs

    def lay_out(self, columns: list[np.ndarray], pool: Pool | None = None) -> list[np.ndarray]:
        """``columns`` (rows in source order) laid out by rank. Each is copied in turn and
        dropped from ``columns`` (the memory is one column's besides them), a few ranks at a
        time (side by side with a ``pool``): each source's rows of those ranks read one after
        another, and laid rank by rank in a block that stays in cache. (Gathered place by
        place, every row read is one of another source's, and at 4,096 hosts every read
        misses the TLB: the keys' rows 0.8 s against 0.3 s at 8.2 M keys.)"""
        jobs = self._jobs()
        out = []
        while columns:
            column = columns.pop(0)
            laid = np.empty_like(column)

            def lay(
                job: tuple[int, int], column: np.ndarray = column, laid: np.ndarray = laid
            ) -> None:
                first, end = job
                count = int(self._starts[first + 1] - self._starts[first])  # (sources)
                rows = self._firsts[:count, None] + np.arange(first, end)  # (source, rank)
                block = laid[self._starts[first] : self._starts[end]]
                block = block.reshape(end - first, count, *column.shape[1:])
                block[:] = column[rows].swapaxes(0, 1)

            if pool is None:
                for job in jobs:
                    lay(job)
            else:
                pool.map(lay, jobs)
            del column, lay  # (the column's last references)
            out.append(laid)
        return out


_LAY_BLOCK = 1 << 16  # (rows a job of RankMajor's rebuild or lay_out takes: they stay in cache)


def _place_own(
    keys: np.ndarray,
    raw: np.ndarray,
    places: np.ndarray,
    prefix: np.ndarray,
    suffix: np.ndarray,
    at: np.ndarray,
) -> None:
    """Put the own bytes of the keys laid at ``places`` (their ``suffix`` bytes at ``at`` in
    ``raw``) after their shared ``prefix``, in their rows of ``keys`` (cut at its width)."""
    width = keys.shape[1]
    s = suffix.ravel()
    total = int(s.sum())
    if not total:
        return
    before = np.cumsum(s) - s
    spread = np.arange(total) - np.repeat(before, s)  # (each byte's index within its key)
    into = np.repeat((places * width + prefix).ravel(), s) + spread
    take = np.repeat(at.ravel(), s) + spread
    if np.any(prefix + suffix > width):  # (keys cut at the width: their bytes past it dropped)
        within = np.repeat(prefix.ravel(), s) + spread < width
        into, take = into[within], take[within]
    keys.reshape(-1)[into] = raw[take]
