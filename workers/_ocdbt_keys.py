"""OCDBT keys as rows: the keys of a node, stored as prefix-coded columns (each key as the bytes
it shares with the key before and its own bytes after them), made into the rows of a NUL-padded
``uint8`` matrix and back, with NumPy (:mod:`._ocdbt_format` reads and writes the columns)."""

from __future__ import annotations

import itertools

import numpy as np

from milepost.workers._runtime import Pool


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
    raw_at = np.cumsum(suffix) - suffix
    threads = (pool.max_threads or 1) if pool is not None else 1
    firsts = np.flatnonzero(prefix == 0)
    nearest = np.searchsorted(firsts, np.arange(1, threads) * n // threads)
    cuts = sorted({0, n, *firsts[nearest[nearest < len(firsts)]].tolist()})
    parts = list(itertools.pairwise(cuts))
    if pool is None or len(parts) == 1:
        for lo, hi in parts:
            _rebuild(keys, prefix, suffix, raw, raw_at, lo, hi)
    else:
        pool.map(lambda part: _rebuild(keys, prefix, suffix, raw, raw_at, *part), parts)
    return keys


def long_keys(
    keys: np.ndarray, prefix: np.ndarray, suffix: np.ndarray, raw: np.ndarray
) -> dict[int, bytes]:
    """Every key longer than the rows of ``keys`` (:func:`rebuild_keys` with a ``width``), whole,
    by row. A key shares with the one before at most that one's length: what it shares lies in
    that one's row, or (past the width) in that one's whole key, made just before."""
    width = keys.shape[1]
    rows = np.flatnonzero(prefix + suffix > width)
    if not len(rows):
        return {}
    raw_at = np.cumsum(suffix, dtype=np.int64) - suffix
    out: dict[int, bytes] = {}
    for i in rows.tolist():
        p = int(prefix[i])
        head = out[i - 1][:p] if p > width else keys[i - 1, :p].tobytes() if p else b""
        out[i] = head + raw[raw_at[i] : raw_at[i] + suffix[i]].tobytes()
    return out


def _rebuild(
    keys: np.ndarray,
    prefix: np.ndarray,
    suffix: np.ndarray,
    raw: np.ndarray,
    raw_at: np.ndarray,
    start: int,
    end: int,
) -> None:
    """Rows ``start`` to ``end`` of :func:`rebuild_keys` (``start``: a key that shares nothing)."""
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
        own = raw[raw_at[lo] : raw_at[lo] + total]
        if np.any(p + s > width):  # (keys cut at the width: their bytes past it dropped)
            within = at - np.repeat(np.arange(lo, hi, dtype=np.int64) * width, s) < width
            at, own = at[within], own[within]
        flat[at] = own
    # A row owns its columns from its shared prefix on (past its end: zeros); a column before
    # it is the one of the nearest row above that owns it. Between two of the shared prefix
    # lengths that occur, a and the next, every column has the same owners (the nearest row
    # whose prefix is at most a): one slab of columns is copied per length (a handful, as
    # keys share their leading path parts), not one index per byte.
    rows, p = keys[start:end], prefix[start:end]
    near = np.arange(end - start, dtype=np.int32 if end - start < 1 << 31 else np.int64)
    lengths = np.unique(p).tolist()
    for a, b in zip(lengths, [*lengths[1:], width], strict=True):
        if a >= width:
            break
        owner = np.where(p <= a, near, 0)
        np.maximum.accumulate(owner, out=owner)
        rows[:, a : min(b, width)] = rows[owner, a : min(b, width)]
