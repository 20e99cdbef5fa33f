"""The shard layout of a split, computed on integers before any shard is written.

Records are ordered by ``(shuffle hash, key)``. Shard ``i`` of ``n`` holds the records of global
rank ``[lo_i, hi_i)`` with ``hi_i - lo_i`` equal to ``total // n`` or one more, so counts differ by at
most one. The plan only needs a histogram of the top `BUCKET_BITS` of the hash: it maps each shard
to the contiguous range of buckets its ranks fall in. Every record of a bucket is sent to every
shard whose range touches that bucket (only the few boundary buckets go to two shards); a shard
writer then sorts what it received, whose first record has the known rank ``first_offset``, and
keeps ranks ``[lo, hi)``. No step sees more than a shard plus its boundary buckets.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from crossfeed.beam_jobs.policy import DuplicateKeyError
from crossfeed.beam_jobs.records import BUCKET_BITS, NUM_BUCKETS, Part, StagedPart
from crossfeed.errors import ConfigError, CrossfeedError

P = TypeVar("P", Part, StagedPart)


@dataclass(frozen=True)
class ShardPlan:
    """Shard ``index`` of ``num_shards`` of ``split``: global ranks ``[lo, hi)``; it receives whole
    buckets ``first_bucket..last_bucket``, whose records have ranks ``[first_offset, end_offset)``."""

    split: str
    index: int
    num_shards: int
    lo: int
    hi: int
    first_bucket: int
    last_bucket: int
    first_offset: int
    end_offset: int

    @property
    def num_records(self) -> int:
        return self.hi - self.lo


def balanced_ranges(total: int, n: int) -> list[tuple[int, int]]:
    """``n`` consecutive ranges covering ``[0, total)`` whose lengths differ by at most one."""
    base, extra = divmod(total, n)
    starts = [i * base + min(i, extra) for i in range(n + 1)]
    return list(zip(starts[:-1], starts[1:]))


def num_shards_for(split: str, total: int, num_bytes: int, *, num_shards: int | None, shard_size: int) -> int:
    """``num_shards`` when given, else enough shards of about ``shard_size`` bytes (at least one,
    at most one per record)."""
    if num_shards is not None:
        return num_shards
    return max(1, min(total, math.ceil(num_bytes / shard_size)))


def plan_split(split: str, hist: np.ndarray, num_shards: int) -> list[ShardPlan]:
    """The `ShardPlan` of every shard of a split from its bucket histogram."""
    if hist.shape != (NUM_BUCKETS,):
        raise ConfigError(f"bucket histogram must have {NUM_BUCKETS} entries, got {hist.shape}")
    cum = np.cumsum(hist, dtype=np.int64)
    total = int(cum[-1])
    plans = []
    for i, (lo, hi) in enumerate(balanced_ranges(total, num_shards)):
        if hi > lo:
            fb = int(np.searchsorted(cum, lo, side="right"))
            lb = int(np.searchsorted(cum, hi - 1, side="right"))
            plans.append(ShardPlan(split, i, num_shards, lo, hi, fb, lb, int(cum[fb] - hist[fb]), int(cum[lb])))
        else:  # fewer records than shards: an empty shard receives nothing
            plans.append(ShardPlan(split, i, num_shards, lo, hi, -1, -1, lo, lo))
    return plans


def route_table(plans: list[ShardPlan]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(first_buckets, last_buckets, shard_indices)`` of a split's non-empty shards."""
    live = [p for p in plans if p.num_records]
    return (
        np.array([p.first_bucket for p in live], dtype=np.int64),
        np.array([p.last_bucket for p in live], dtype=np.int64),
        np.array([p.index for p in live], dtype=np.int64),
    )


def route(part: P, table: tuple[np.ndarray, np.ndarray, np.ndarray]) -> Iterator[tuple[int, P]]:
    """Yields ``(shard_index, records)``: each record goes to every shard whose bucket range holds
    its bucket (one shard, or several for a boundary bucket)."""
    for shard, r in _destinations(part, table):
        yield shard, part.take(r)


def route_ranges(part: StagedPart, table: tuple[np.ndarray, np.ndarray, np.ndarray]) -> Iterator[tuple[int, int, int]]:
    """`route` of a part whose records are in hash order, as ``(shard_index, lo, hi)``: the records
    a shard keeps (whole buckets, contiguous in hash order) are the range ``[lo, hi)``."""
    for shard, r in _destinations(part, table):
        lo, hi = int(r.min()), int(r.max()) + 1
        if hi - lo != len(r):
            raise CrossfeedError(f"split {part.split!r}: a staged batch's records are not in hash order")
        yield shard, lo, hi


def _destinations(part: Part | StagedPart, table) -> Iterator[tuple[int, np.ndarray]]:
    first, last, index = table
    b = (part.hashes >> np.uint64(64 - BUCKET_BITS)).astype(np.int64)
    lo = np.searchsorted(last, b, side="left")  # first live shard ending at or after b
    hi = np.searchsorted(first, b, side="right") - 1  # last live shard starting at or before b
    if len(b) and (np.any(hi < lo) or np.any(hi >= len(index))):
        raise CrossfeedError(f"split {part.split!r}: a record's bucket is in no shard; the plan and the data disagree")
    spread = hi - lo
    dest, recs = [lo], [np.arange(len(b))]
    for k in range(1, int(spread.max(initial=0)) + 1):
        extra = np.flatnonzero(spread >= k)
        dest.append(lo[extra] + k)
        recs.append(extra)
    dest_all, recs_all = np.concatenate(dest), np.concatenate(recs)
    order = np.argsort(dest_all, kind="stable")
    dest_all, recs_all = dest_all[order], recs_all[order]
    cuts = np.flatnonzero(np.diff(dest_all)) + 1
    for d, r in zip(np.split(dest_all, cuts), np.split(recs_all, cuts)):
        if len(d):
            yield int(index[d[0]]), r


def sorted_order(hashes: np.ndarray, keys: list[str], split: str) -> np.ndarray:
    """Positions in ``(hash, key)`` order; raises `DuplicateKeyError` on a repeated key."""
    order = np.argsort(hashes, kind="stable")
    h = hashes[order]
    ties = np.flatnonzero(h[1:] == h[:-1])
    if ties.size:
        order = order.copy()
        starts = ties[np.r_[True, np.diff(ties) > 1]]
        for s in starts.tolist():
            e = s + 1
            while e < len(h) and h[e] == h[s]:
                e += 1
            run = sorted(order[s:e].tolist(), key=lambda i: keys[i])
            for a, b in zip(run, run[1:]):
                if keys[a] == keys[b]:
                    raise DuplicateKeyError(
                        f"split {split!r}: key {keys[a]!r} occurs more than once; every sample needs its own key"
                    )
            order[s:e] = run
    return order
