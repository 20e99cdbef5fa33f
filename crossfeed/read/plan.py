"""The epoch plan: which samples each rank and worker delivers, in which order.

Everything here is a pure function of integers — (record counts, seed, epoch, shuffle mode,
world size, rank, worker, position) — computed before any byte is read. That gives, by
construction: equal batch counts on every rank (no DDP hang), every sample once per epoch
across ranks and workers (up to the documented remainder policy), the same order in every
framework, and O(1) exact and elastic resumption from ``(seed, epoch, position)``.

Layout of one epoch::

    order     = epoch_order(counts, seed, epoch, shuffle)     # a permutation of all N samples
    remaining = order[position:]                               # what is left of the epoch
    remaining = equalise(remaining, world_size, remainder)     # drop or pad to a multiple of W
    rank r    = remaining[r::W]                                # strided: lockstep-friendly
    batches   = consecutive runs of batch_size of that; worker w takes batches w, w+K, w+2K …

Because ranks take strided samples, after every rank delivered ``k`` batches the samples
consumed are exactly ``remaining[:k*B*W]``: the new position is ``position + k*B*W`` whatever
the world size was, which is what makes elastic resumption exact.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from crossfeed.errors import ConfigError

if TYPE_CHECKING:
    from crossfeed.read.options import PlanOptions, ShardOptions


class Shuffle(str, enum.Enum):
    GLOBAL = "global"  # an exact permutation of the split (random access through the index)
    BLOCK = "block"  # windows of shards, each shard read once and sequentially (remote data)
    NONE = "none"  # file order


class Remainder(str, enum.Enum):
    PAD = "pad"  # repeat samples from the start of the epoch so every rank gets as many
    DROP = "drop"  # drop the tail; the tail moves with the epoch, so no sample is skipped forever


def _rng(seed: int, epoch: int, stream: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(seed) >> 32, int(epoch), stream]))


def epoch_order(counts, *, seed: int, epoch: int, shuffle: Shuffle, block_shards: int = 4) -> np.ndarray:
    """All sample indices of the split (shard-major numbering) in this epoch's order."""
    counts = np.asarray(counts, dtype=np.int64)
    n = int(counts.sum())
    shuffle = Shuffle(shuffle)
    if shuffle is Shuffle.GLOBAL:
        return _rng(seed, epoch, 1).permutation(n)
    if shuffle is Shuffle.NONE:
        # rotate with the epoch so that a dropped remainder is not always the same samples
        shift = (epoch * 2654435761) % n if n else 0
        return np.roll(np.arange(n, dtype=np.int64), -shift)
    starts = np.concatenate([[0], np.cumsum(counts)])
    rng = _rng(seed, epoch, 2)
    shard_order = rng.permutation(len(counts))
    parts = []
    for w in range(0, len(shard_order), max(1, block_shards)):
        window = shard_order[w : w + block_shards]
        idx = np.concatenate([np.arange(starts[s], starts[s + 1]) for s in window]) if len(window) else np.zeros(0, np.int64)
        parts.append(idx[rng.permutation(len(idx))])
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def per_rank(remaining: int, world_size: int, remainder: Remainder) -> int:
    """Samples each rank gets from ``remaining`` samples (the same for every rank)."""
    if Remainder(remainder) is Remainder.DROP:
        return remaining // world_size
    return math.ceil(remaining / world_size)


def rank_samples(order: np.ndarray, *, position: int, world_size: int, rank: int, remainder: Remainder) -> np.ndarray:
    """This rank's samples, in delivery order, for the rest of the epoch after ``position``."""
    rest = order[position:]
    n = per_rank(len(rest), world_size, remainder)
    need = n * world_size
    if need > len(rest):  # pad by repeating from the start of the epoch's order
        rest = np.concatenate([rest, np.resize(order, need - len(rest))])
    return rest[:need][rank::world_size]


def num_batches(n: int, batch_size: int, drop_last: bool) -> int:
    return n // batch_size if drop_last else math.ceil(n / batch_size)


@dataclass(frozen=True)
class Plan:
    """One rank's (and worker's) batches for the rest of an epoch."""

    samples: np.ndarray  # this rank's samples in order
    batch_size: int
    drop_last: bool
    worker: int = 0
    num_workers: int = 1

    @property
    def rank_batches(self) -> int:
        """Batches this rank delivers (all its workers together)."""
        return num_batches(len(self.samples), self.batch_size, self.drop_last)

    def batch_ids(self) -> range:
        """Rank-level batch numbers this worker produces."""
        return range(self.worker, self.rank_batches, self.num_workers)

    def batch(self, b: int) -> np.ndarray:
        return self.samples[b * self.batch_size : (b + 1) * self.batch_size]

    def __len__(self) -> int:
        return len(self.batch_ids())

    def __iter__(self) -> Iterator[np.ndarray]:
        """This worker's batches of global sample indices, in order."""
        return map(self.batch, self.batch_ids())


class Sampler:
    """Stage 1 of the read pipeline: the plan, on integers only (it knows nothing of bytes).

    ``plan(epoch, position)`` gives this rank's and worker's `Plan` for the rest of an epoch;
    iterating it yields ``np.ndarray[int64]`` batches of global sample indices.
    """

    def __init__(self, counts, plan: PlanOptions, shard: ShardOptions):
        self.counts = np.asarray(counts, dtype=np.int64)
        self.total = int(self.counts.sum())
        self.options, self.shard = plan, shard

    def plan(self, epoch: int, position: int = 0) -> Plan:
        o, sh = self.options, self.shard
        if not 0 <= position <= self.total:
            raise ConfigError(f"position {position} is outside the epoch of {self.total} samples; was the state saved for another dataset?")
        order = epoch_order(self.counts, seed=o.seed, epoch=epoch, shuffle=o.shuffle, block_shards=o.block_shards)
        samples = rank_samples(order, position=position, world_size=sh.world_size, rank=sh.rank, remainder=o.remainder)
        return Plan(samples, o.batch_size, o.drop_last, sh.worker, sh.num_workers)

    def rank_batch_count(self, position: int = 0) -> int:
        """Batches each rank delivers from ``position`` to the end of an epoch (all its workers
        together), computed without building the epoch's order."""
        o = self.options
        n = per_rank(self.total - position, self.shard.world_size, o.remainder)
        return num_batches(n, o.batch_size, o.drop_last)

    def position_after(self, position: int, rank_batches_done: int) -> int:
        """The epoch position after every rank delivered ``rank_batches_done`` batches from ``position``."""
        return min(self.total, position + rank_batches_done * self.options.batch_size * self.shard.world_size)
