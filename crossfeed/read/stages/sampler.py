"""The epoch plan: which samples each rank and worker delivers, in which order.

Everything here is a pure function of integers — (record counts, seed, epoch, shuffle mode,
world size, rank, worker, position) — computed before any byte is read. That gives, by
construction: equal batch counts on every rank (no DDP hang), every sample once per epoch
across ranks and workers (up to the documented remainder policy), the same order in every
framework, and O(1) exact and elastic resumption from ``(seed, epoch, position)``.

Layout of one epoch::

    order(k)  = the k-th sample of the epoch, for k in [0, N)   # a seeded bijection, never an array
    remaining = order[position:]                               # what is left of the epoch
    remaining = equalise(remaining, world_size, remainder)     # drop or pad to a multiple of W
    rank r    = remaining[r::W]                                # strided: lockstep-friendly
    batches   = consecutive runs of batch_size of that; worker w takes batches w, w+K, w+2K …

Because ranks take strided samples, after every rank delivered ``k`` batches the samples
consumed are exactly ``remaining[:k*B*W]``: the new position is ``position + k*B*W`` whatever
the world size was, which is what makes elastic resumption exact.

Nothing here grows with the dataset: the global order is a keyed Feistel network over
``[0, N)`` with cycle walking (`Permutation`), the block order permutes shards (O(shards)) and,
within each window of shards, evaluates a permutation of the window; a batch's indices are
computed from its position in the epoch, O(batch size). Small epochs (≤ `TABLE_MAX` samples)
draw their order once into a table instead (one C shuffle): faster per batch; the order is
still a pure function of the plan's inputs.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np

from crossfeed.errors import ConfigError
from crossfeed.read.options import PlanOptions, Remainder, ShardOptions, Shuffle

TABLE_MAX = 1 << 21  # epochs up to this many samples draw their order as a table (16 MiB at most)
CHUNK_SAMPLES = 1 << 14  # larger epochs evaluate their order this many positions at a time
MAX_COUNTED = 1 << 62  # samples since the run began that a weighted or scheduled plan counts (int64)
_CHUNK_LOCK = threading.Lock()


def _keys(seed: int, epoch: int, stream: int, *more: int, count: int = 8) -> np.ndarray:
    words = [int(seed) & 0xFFFFFFFF, int(seed) >> 32, int(epoch), stream, *more]
    return np.random.SeedSequence(words).generate_state(count, np.uint64)


class Permutation:
    """A seeded bijection on ``[0, n)``, evaluated on any array of positions in O(its size).

    Four rounds of ``x = (x * m + c) mod 2**b`` (``m`` odd: a bijection) then ``x ^= x >> s``
    (also a bijection) on the ``b = bit_length(n - 1)`` bits, keyed by ``(m, c)`` per round, with
    cycle walking: an output ``>= n`` goes round again until it lands in range (a permutation's
    cycles guarantee it does; ``2**b < 2n``, so under two rounds on average)."""

    ROUNDS = 4

    def __init__(self, n: int, keys: np.ndarray):
        self.n = int(n)
        bits = max(1, (self.n - 1).bit_length())
        self._mask = np.uint64((1 << bits) - 1)
        self._shift = np.uint64(max(1, (bits + 1) // 2))
        keys = np.asarray(keys, dtype=np.uint64)
        self._rounds = [(np.uint64(keys[2 * r] | np.uint64(1)), np.uint64(keys[2 * r + 1])) for r in range(self.ROUNDS)]

    def _step(self, x: np.ndarray) -> np.ndarray:
        mask, shift = self._mask, self._shift
        for m, c in self._rounds:
            x = (x * m + c) & mask
            x ^= x >> shift
        return x

    def __call__(self, k: np.ndarray) -> np.ndarray:
        return self._walk(self._step, np.asarray(k, dtype=np.uint64))

    def _walk(self, step, x: np.ndarray) -> np.ndarray:
        """``step`` applied to each of ``x``, again to those that leave ``[0, n)``, until all are in."""
        x = step(x)
        out = np.flatnonzero(x >= self.n)
        while len(out):
            x[out] = step(x[out])
            out = out[x[out] >= self.n]
        return x.astype(np.int64)

    def _unstep(self, y: np.ndarray) -> np.ndarray:
        """``_step``'s inverse: the rounds backwards, each ``x ^= x >> s`` undone by xor-shifts
        until the shifted bits run out, each ``x = x·m + c`` by ``(x − c)·m⁻¹`` (``m`` odd: it
        has an inverse modulo ``2**b``)."""
        mask, shift = self._mask, self._shift
        bits = int(mask).bit_length()
        for m, c in reversed(self._rounds):
            x = y.copy()
            for _ in range(-(-bits // int(shift))):  # after j passes x is right on j·s more bits
                x = y ^ (x >> shift)
            y = ((x - c) * np.uint64(pow(int(m), -1, 1 << 64))) & mask
        return y

    def inverse(self, y: np.ndarray) -> np.ndarray:
        """The positions ``k`` with ``self(k) == y`` (``y`` in ``[0, n)``): the cycle walk
        backwards — step back until the value lands in range again."""
        return self._walk(self._unstep, np.asarray(y, dtype=np.uint64))


class EpochOrder:
    """``order(positions)``: the samples at those positions of one epoch's order (global,
    shard-major indices). Built in O(shards); evaluated in O(len(positions))."""

    sequential = False  # any position evaluated on its own (`crossfeed.read.stages.pack.documents`)

    def __init__(self, counts, *, seed: int, epoch: int, shuffle: Shuffle, block_shards: int = 4):
        self.counts = np.asarray(counts, dtype=np.int64)
        self.n = int(self.counts.sum())
        self.shuffle = Shuffle(shuffle)
        self._table: np.ndarray | None = None  # the whole order, for small epochs
        if self.shuffle is Shuffle.GLOBAL:
            self._perm = Permutation(self.n, _keys(seed, epoch, 1))
            if self.n <= TABLE_MAX:  # small: one C shuffle beats evaluating the bijection
                self._table = np.random.default_rng(_keys(seed, epoch, 1, count=4)).permutation(self.n)
        elif self.shuffle is Shuffle.NONE:
            # rotate with the epoch so that a dropped remainder is not always the same samples
            self._shift = (epoch * 2654435761) % self.n if self.n else 0
        else:
            starts = np.concatenate([[0], np.cumsum(self.counts)])
            rng = np.random.default_rng(
                np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(seed) >> 32, int(epoch), 2])
            )
            shard_order = rng.permutation(len(self.counts))
            self._windows = [
                shard_order[w : w + block_shards] for w in range(0, len(shard_order), max(1, block_shards))
            ]
            sizes = np.array([int(self.counts[ws].sum()) for ws in self._windows], dtype=np.int64)
            self._wstarts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
            self._starts = starts
            self._wkeys = (seed, epoch)
        if self.n <= TABLE_MAX and self.shuffle is Shuffle.BLOCK:  # small: one C shuffle per window
            rng = np.random.default_rng(_keys(seed, epoch, 2, count=4))
            self._table = np.concatenate(
                [
                    np.concatenate([np.arange(starts[s], starts[s + 1]) for s in ws])[
                        rng.permutation(int(self.counts[ws].sum()))
                    ]
                    for ws in self._windows
                ]
                or [np.zeros(0, np.int64)]
            ).astype(np.int64)

    @property
    def materialised(self) -> bool:
        """Whether the whole order is a table (small epochs) or evaluated on demand."""
        return self._table is not None or self.shuffle is Shuffle.NONE

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        if self._table is not None:
            return self._table[positions]
        return self._eval(positions)

    def run(self, lo: int, hi: int) -> np.ndarray:
        """The samples at positions ``lo..hi-1`` (``self(np.arange(lo, hi))``, a slice of a table)."""
        if self._table is not None:
            return self._table[lo:hi]
        return self._eval(np.arange(lo, hi, dtype=np.int64))

    def _eval(self, k: np.ndarray) -> np.ndarray:
        if self.shuffle is Shuffle.GLOBAL:
            return self._perm(k)
        if self.shuffle is Shuffle.NONE:
            return (k + self._shift) % self.n
        out = np.empty(len(k), dtype=np.int64)
        w = np.searchsorted(self._wstarts, k, side="right") - 1
        for win in np.unique(w).tolist():
            m = w == win
            shards = self._windows[win]
            size = int(self._wstarts[win + 1] - self._wstarts[win])
            inner = Permutation(size, _keys(*self._wkeys, 2, win))(k[m] - self._wstarts[win])
            cum = np.cumsum(self.counts[shards])
            j = np.searchsorted(cum, inner, side="right")
            before = np.concatenate([[0], cum])[j]
            out[m] = self._starts[shards[j]] + inner - before
        return out

    def positions_of(self, samples: np.ndarray) -> np.ndarray:
        """The positions of ``samples`` (global ids in ``[0, n)``) in this epoch's order: the
        order's inverse, O(len(samples)) for evaluated orders (`Permutation.inverse`; block shuffle:
        the sample's window and its place there, inverted), one pass over a table (small epochs)."""
        samples = np.asarray(samples, dtype=np.int64)
        if self._table is not None:
            inv = np.empty(self.n, dtype=np.int64)
            inv[self._table] = np.arange(self.n, dtype=np.int64)
            return inv[samples]
        if self.shuffle is Shuffle.GLOBAL:
            return self._perm.inverse(samples)
        if self.shuffle is Shuffle.NONE:
            return (samples - self._shift) % self.n if self.n else samples
        shard = np.searchsorted(self._starts, samples, side="right") - 1
        win_of = np.empty(len(self.counts), dtype=np.int64)
        before = np.empty(len(self.counts), dtype=np.int64)  # the shard's first place in its window
        for win, shards in enumerate(self._windows):
            win_of[shards] = win
            before[shards] = np.concatenate([[0], np.cumsum(self.counts[shards])[:-1]])
        out = np.empty(len(samples), dtype=np.int64)
        w = win_of[shard]
        inner = before[shard] + samples - self._starts[shard]
        for win in np.unique(w).tolist():
            m = w == win
            size = int(self._wstarts[win + 1] - self._wstarts[win])
            out[m] = self._wstarts[win] + Permutation(size, _keys(*self._wkeys, 2, win)).inverse(inner[m])
        return out


class RefilledOrder:
    """An epoch's order with some samples taken out and the rest closed up (``Skip(refill=True)``,
    `crossfeed.read.skips`): position ``k`` is the inner order's ``k``-th position that holds no
    skipped sample. Built from the skipped samples' positions (the inner order's inverse), sorted:
    ``select(k) = k + #{skipped positions ≤ select(k)}``, a binary search over ``p_i − i`` (the
    kept positions before each skipped one) — O(log S) a position, O(S) memory. A table (small
    epochs) is closed up once instead."""

    sequential = False

    def __init__(self, inner: EpochOrder, skipped: np.ndarray):
        self.inner = inner
        self.counts = inner.counts
        self._table: np.ndarray | None = None
        if inner._table is not None:  # one pass over the table: the skipped samples' places, in order
            gone = np.isin(inner._table, skipped, assume_unique=True)
            pos = np.flatnonzero(gone)
            self._table = inner._table[~gone]
        else:
            pos = np.sort(inner.positions_of(skipped))
        self.n = inner.n - len(pos)
        self._before = pos - np.arange(len(pos), dtype=np.int64)  # kept positions before each skipped one

    @property
    def materialised(self) -> bool:
        return self._table is not None or self.inner.materialised

    def select(self, k: np.ndarray) -> np.ndarray:
        """The inner order's positions of kept positions ``k``."""
        k = np.asarray(k, dtype=np.int64)
        return k + np.searchsorted(self._before, k, side="right")

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        if self._table is not None:
            return self._table[np.asarray(positions, dtype=np.int64)]
        return self.inner(self.select(positions))

    def run(self, lo: int, hi: int) -> np.ndarray:
        if self._table is not None:
            return self._table[lo:hi]
        return self(np.arange(lo, hi, dtype=np.int64))


def epoch_order(counts, *, seed: int, epoch: int, shuffle: Shuffle, block_shards: int = 4) -> np.ndarray:
    """All sample indices of the split (shard-major numbering) in this epoch's order, as one
    array (for tests and small tools; the Loader never builds it for large epochs)."""
    order = EpochOrder(counts, seed=seed, epoch=epoch, shuffle=shuffle, block_shards=block_shards)
    return order(np.arange(order.n, dtype=np.int64))


MAX_PERIOD = 1 << 14  # a mixture's weights, as integers, may sum to at most this


def integer_weights(weights) -> list[int]:
    """Weights as the smallest integers in the same proportions (floats to 1/1000 precision)."""
    fr = [Fraction(w).limit_denominator(1000) for w in weights]
    if not fr or any(f <= 0 for f in fr):
        tiny = [w for w, f in zip(weights, fr) if f <= 0 and w > 0]
        if tiny:
            raise ConfigError(
                f"mixture weight {tiny[0]!r} rounds to 0 (weights are kept to 1/1000); make it 0.001 or more"
            )
        raise ConfigError(f"mixture weights must be positive numbers, got {_short(list(weights))}")
    scale = math.lcm(*(f.denominator for f in fr))
    ints = [int(f * scale) for f in fr]
    g = math.gcd(*ints)
    ints = [i // g for i in ints]
    if sum(ints) > MAX_PERIOD:
        raise ConfigError(
            f"mixture weights {_short(list(weights))} are too fine-grained (as integers {_short(ints)} they sum "
            f"to {_short(sum(ints), 24)} > {MAX_PERIOD}); round them"
        )
    return ints


def _short(v, n: int = 80) -> str:
    text = repr(v)
    return text if len(text) <= n else text[: n - 1] + "…"


def smooth_schedule(weights: list[int]) -> np.ndarray:
    """One period (``sum(weights)`` positions) of a schedule of sources in which, over every
    prefix, each source's count differs from ``weight / total × prefix`` by less than one.

    Tijdeman's chairman assignment (1980), with ``δ = 1/(2(k−1))``: at step ``t`` a source is
    eligible when its deficit ``t·w/W − count`` is at least ``δ`` (choosing it keeps it under
    its upper bound), and the eligible source whose lower bound would be violated first — the
    smallest deadline ``(count + 1 − δ)·W/w`` — is chosen (the first on ties). Its discrepancy is
    at most ``1 − δ``. After ``W`` steps every source was chosen exactly ``w`` times, so the
    schedule repeats with period ``W``. Integer arithmetic throughout (scaled by ``D = 2(k−1)``).
    """
    k, total = len(weights), sum(weights)
    if k == 1:
        return np.zeros(total, dtype=np.int64)
    d = 2 * (k - 1)  # δ = 1 / d
    count = [0] * k
    out = np.empty(total, dtype=np.int64)
    for t in range(1, total + 1):
        best, best_num, best_w = -1, 0, 1
        for i, w in enumerate(weights):
            if d * (t * w - count[i] * total) >= total:  # eligible: deficit ≥ δ
                # the deadline ``num / w``, up to the common factor W/d, compared in integers
                num = (count[i] + 1) * d - 1
                if best < 0 or num * best_w < best_num * w:
                    best, best_num, best_w = i, num, w
        if best < 0:  # cannot happen (Tijdeman's theorem); never fail silently if it did
            raise AssertionError(f"no eligible source at step {t} for weights {weights}")
        count[best] += 1
        out[t - 1] = best
    return out


def _source_sizes(counts: list[np.ndarray], passes: PassOrders | None) -> tuple[np.ndarray, np.ndarray]:
    """A mixture's ``(starts, sizes)``: each source's first global id (and the total), from its
    stored samples; and the samples of each of its passes — fewer where ``Skip(refill=True)``
    takes some out of every pass (`PassOrders.sizes`). A source with none is refused by name."""
    stored = np.array([int(c.sum()) for c in counts], dtype=np.int64)
    sizes = passes.sizes if passes is not None else stored
    if (sizes == 0).any():
        s = int(np.flatnonzero(sizes == 0)[0])
        why = f" left: skip= takes out all {int(stored[s]):,} of them" if stored[s] else ""
        raise ConfigError(f"mixture source {s} has no samples{why}")
    return np.concatenate([[0], np.cumsum(stored)]).astype(np.int64), sizes


class MixtureOrder:
    """The order of one epoch of a weighted mixture of sources, as an `EpochOrder` is for one.

    Position ``p`` of the epoch goes to source ``schedule[p % period]``; it is that source's
    ``c``-th draw since training began, where ``c`` counts its earlier draws (in earlier epochs
    too: each epoch of ``n`` positions takes the same number from each source). Draw ``c`` of a
    source of ``N`` samples is position ``c % N`` of the source's own pass ``c // N`` — a
    permutation of the source drawn with the source's own seed stream and the plan's shuffle —
    so a small source repeats, pass after pass, and a large one is subsampled, exactly as the
    weights say. Sample ids are global across sources: source ``s``'s sample ``i`` is
    ``starts[s] + i``. Everything is O(sources) to build and O(positions) to evaluate.
    """

    sequential = False  # any position evaluated on its own

    def __init__(
        self,
        counts: list,
        weights: list[int],
        *,
        n: int,
        seed: int,
        epoch: int,
        shuffle: Shuffle,
        block_shards: int = 4,
        passes: PassOrders | None = None,
    ):
        """``passes``: the sources' per-pass orders, shared by the epochs of one `Sampler` (a
        source's pass usually straddles two epochs: its order is drawn once)."""
        self.counts = [np.asarray(c, dtype=np.int64) for c in counts]
        self.starts, self.sizes = _source_sizes(self.counts, passes)
        self.n, self.epoch = int(n), int(epoch)
        self.weights = np.asarray(weights, dtype=np.int64)
        self.schedule = smooth_schedule(list(weights))
        self.period = len(self.schedule)
        onehot = self.schedule[:, None] == np.arange(len(weights))[None, :]
        self._before = np.concatenate(
            [np.zeros((1, len(weights)), np.int64), np.cumsum(onehot, axis=0)]
        )  # (period+1, k)
        self.per_epoch = self.draws(np.full(len(weights), self.n, dtype=np.int64), np.arange(len(weights)))
        self._passes = passes if passes is not None else PassOrders(self.counts, seed, shuffle, block_shards)
        self._table: np.ndarray | None = None  # the whole epoch, for small epochs (as `EpochOrder`)
        if self.n <= TABLE_MAX:
            self._table = self._whole_epoch()

    @property
    def materialised(self) -> bool:
        return self._table is not None

    def draws(self, positions: np.ndarray, source: np.ndarray) -> np.ndarray:
        """Draws of ``source`` at positions before ``positions`` of one epoch."""
        whole, part = np.divmod(positions, self.period)
        return whole * self.weights[source] + self._before[part, source]

    def source_of(self, positions: np.ndarray) -> np.ndarray:
        return self.schedule[positions % self.period]

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        if self._table is not None:
            return self._table[positions]
        return self._eval(positions)

    def _eval(self, positions: np.ndarray) -> np.ndarray:
        src = self.source_of(positions)
        out = np.empty(len(positions), dtype=np.int64)
        for s in range(len(self.sizes)):
            m = src == s
            if not m.any():
                continue
            c = self.epoch * self.per_epoch[s] + self.draws(positions[m], np.full(int(m.sum()), s))
            out[m] = self._ids(s, c)
        return out

    def _ids(self, s: int, c: np.ndarray) -> np.ndarray:
        """Source ``s``'s samples (global ids) at its draws ``c`` (any order)."""
        passes, within = np.divmod(c, self._passes.sizes[s])
        lo, hi = int(passes.min()), int(passes.max())
        if lo == hi:
            got = self._passes.samples(s, lo, within)
        else:
            got = np.empty(len(c), dtype=np.int64)
            for p in range(lo, hi + 1):
                q = passes == p
                if q.any():
                    got[q] = self._passes.samples(s, p, within[q])
        return self.starts[s] + got

    def drawn(self, position: int) -> np.ndarray:
        """Each source's draws since training began, before ``position`` of this epoch."""
        k = len(self.sizes)
        return self.epoch * self.per_epoch + self.draws(np.full(k, position), np.arange(k))

    def _whole_epoch(self) -> np.ndarray:
        """`_eval` of every position of the epoch, by source, laid out as rows of one period:
        source ``s`` holds the columns ``j`` with ``schedule[j] == s``, read row by row, and its
        ``i``-th position is its draw ``epoch·per_epoch[s] + i`` — consecutive draws, so slices
        of its passes' orders."""
        rows, tail = divmod(self.n, self.period)
        out = np.empty((rows + 1) * self.period, dtype=np.int64)
        grid = out.reshape(rows + 1, self.period)
        for s in range(len(self.sizes)):
            cols = np.flatnonzero(self.schedule == s)
            count = int(self.per_epoch[s])
            got = self.source_samples(s, self.epoch * count, count)
            body = rows * len(cols)
            grid[:rows, cols] = got[:body].reshape(rows, len(cols))
            grid[rows, cols[cols < tail]] = got[body:]
        return out[: self.n]

    def source_samples(self, s: int, first: int, count: int) -> np.ndarray:
        """Source ``s``'s samples (global ids) at its draws ``first .. first + count - 1``."""
        size, out = int(self._passes.sizes[s]), np.empty(count, dtype=np.int64)
        c, end = int(first), int(first) + count
        while c < end:
            p, w = divmod(c, size)
            take = min(size - w, end - c)
            np.add(self._passes.run(s, p, w, w + take), self.starts[s], out=out[c - first : c - first + take])
            c += take
        return out


def mixture_phases(weights) -> list[tuple[int, tuple[int, ...]]]:
    """A scheduled mixture's phases: ``[(start sample, integer weights), …]``, the first at 0.

    ``weights``: one per source, a number or a `crossfeed.read.schedule.Schedule`. Every source's
    boundaries together cut the samples into phases; in each, the weights are `integer_weights`
    of the positive ones (a source weighted 0 there is not drawn: 0). Consecutive phases of equal
    integer weights are one phase. At most `MAX_PHASES` phases."""
    from crossfeed.read.schedule import MAX_PHASES, Schedule

    pieces = [w.pieces() if isinstance(w, Schedule) else [(0, w)] for w in weights]
    linear = [isinstance(w, Schedule) and w.kind == "linear" for w in weights]
    bounds = sorted({a for p in pieces for a, _ in p})
    if len(bounds) > MAX_PHASES:
        raise ConfigError(f"a mixture schedule has {len(bounds)} phases, more than {MAX_PHASES}; use fewer boundaries")
    at = [0] * len(pieces)
    out: list[tuple[int, tuple[int, ...]]] = []
    for b in bounds:
        now = []
        for i, p in enumerate(pieces):
            while at[i] + 1 < len(p) and p[at[i] + 1][0] <= b:
                at[i] += 1
            now.append(p[at[i]][1])
        live = [j for j, w in enumerate(now) if w > 0]
        if not live:
            raise ConfigError(f"at sample {b} every source of the mixture is weighted 0: one must be drawn")
        ints = [0] * len(now)
        ramp = any(linear[j] for j in live)
        for j, w in zip(live, _phase_weights([now[j] for j in live], ramp)):
            ints[j] = w
        if not out or out[-1][1] != tuple(ints):
            out.append((b, tuple(ints)))
    return out


RAMP_SHARES = 1000  # a ramp's phase whose weights are finer than integers can hold: shares of this


def _phase_weights(values: list, ramp: bool) -> list[int]:
    """`integer_weights` of one phase's positive weights; in a phase where a linear schedule
    weighs, weights that would need more than `RAMP_SHARES` as integers (a line's values are
    any fractions) are rounded to shares of `RAMP_SHARES` instead (largest remainders, each
    source at least 1)."""
    try:
        ints = integer_weights(values)
    except ConfigError:
        if not ramp:
            raise
        ints = []
    if not ramp or (ints and sum(ints) <= RAMP_SHARES):
        return ints
    return ramp_shares(values)


def ramp_shares(values) -> list[int]:
    """``values`` (numbers ≥ 0, some > 0) as shares of `RAMP_SHARES` by largest remainders — each
    positive value at least 1, a 0 stays 0 — in lowest terms: a ramp phase's integer weights."""
    fr = [Fraction(v) for v in values]
    exact = [f * RAMP_SHARES / sum(fr) for f in fr]
    out = [max(1, math.floor(e)) if e > 0 else 0 for e in exact]
    drawn = sorted((j for j in range(len(out)) if exact[j] > 0), key=lambda j: (out[j] - exact[j], j))
    for j in drawn[: max(0, RAMP_SHARES - sum(out))]:
        out[j] += 1
    g = math.gcd(*out)
    return [o // g for o in out]


_PHASE_SCHEDULES: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}


def phase_schedule(weights: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """``(schedule, before)`` of one phase's integer weights (zeros allowed): `smooth_schedule`
    of the positive ones, as sources of the whole mixture, and each source's draws before each
    position of one period (``(period + 1, sources)``). Kept per weights (a ramp repeats few)."""
    got = _PHASE_SCHEDULES.get(weights)
    if got is None:
        live = np.flatnonzero(np.asarray(weights) > 0)
        sched = live[smooth_schedule([weights[j] for j in live])].astype(np.int64)
        onehot = sched[:, None] == np.arange(len(weights))[None, :]
        before = np.concatenate([np.zeros((1, len(weights)), np.int64), np.cumsum(onehot, axis=0)])
        got = (sched, before)
        with _CHUNK_LOCK:
            if len(_PHASE_SCHEDULES) > 256:
                _PHASE_SCHEDULES.clear()
            _PHASE_SCHEDULES[weights] = got
    return got


class MixturePhases:
    """The global plan of a scheduled mixture over the samples consumed since training began
    (``g = epoch × n + position``): phase ``j`` covers ``[starts[j], starts[j+1])`` and is a
    mixture of its own from its start (its `smooth_schedule`, restarted there), so each source is
    within one sample of its share over every prefix of every phase. ``drawn[j]``: each source's
    draws before phase ``j`` (O(phases × sources), computed once); a position's source and draw
    number are then O(1) (O(log phases) to find the phase)."""

    def __init__(self, phases: list[tuple[int, tuple[int, ...]]]):
        self.phases = phases
        self.starts = np.array([a for a, _ in phases], dtype=np.int64)
        self.weights = np.array([w for _, w in phases], dtype=np.int64)  # (phases, sources)
        k = self.weights.shape[1]
        self._keys = [tuple(int(w) for w in row) for row in self.weights]
        self._rows = list(self.weights)
        drawn = np.zeros((len(phases), k), dtype=np.int64)
        for j in range(1, len(phases)):
            drawn[j] = drawn[j - 1] + self._within(j - 1, int(self.starts[j] - self.starts[j - 1]))
        self.drawn = drawn
        self._firsts = list(drawn)

    def _within(self, j: int, offset: int) -> np.ndarray:
        """Each source's draws in the first ``offset`` samples of phase ``j``."""
        sched, before = phase_schedule(self._keys[j])
        whole, part = divmod(offset, len(sched))
        return whole * self.weights[j] + before[part]

    def phase_of(self, g: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.starts, g, side="right") - 1

    def before(self, g: int) -> np.ndarray:
        """Each source's draws before global sample ``g``."""
        j = int(self.phase_of(np.array([g]))[0])
        return self.drawn[j] + self._within(j, int(g - self.starts[j]))

    def locate(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(source, draw number)`` of each global sample ``g``."""
        g = np.asarray(g, dtype=np.int64)
        if len(g):
            lo, hi = self.phase_of(np.array([g.min(), g.max()]))
            if lo == hi:  # one phase (a batch usually is): no masks
                return self._in_phase(int(lo), g)
        ph = self.phase_of(g)
        src = np.empty(len(g), dtype=np.int64)
        draw = np.empty(len(g), dtype=np.int64)
        for j in np.unique(ph).tolist():
            m = ph == j
            src[m], draw[m] = self._in_phase(j, g[m])
        return src, draw

    def sources(self, g: int, count: int) -> np.ndarray:
        """`locate`'s sources of the ``count`` consecutive global samples from ``g``: each phase's
        period repeated over its part (no per-sample arithmetic)."""
        out = np.empty(count, dtype=np.int64)
        lo, end, j = g, g + count, int(self.phase_of(np.array([g]))[0])
        while lo < end:
            hi = end if j + 1 == len(self.starts) else min(end, int(self.starts[j + 1]))
            sched = phase_schedule(self._keys[j])[0]
            o = (lo - int(self.starts[j])) % len(sched)
            period = np.concatenate([sched[o:], sched[:o]])
            out[lo - g : hi - g] = np.tile(period, -(-(hi - lo) // len(period)))[: hi - lo]
            lo, j = hi, j + 1
        return out

    def _in_phase(self, j: int, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        sched, before = phase_schedule(self._keys[j])
        whole, part = np.divmod(g - self.starts[j], len(sched))
        s = sched[part]
        # a draw: the source's draws before the phase, whole periods, and this period's before it
        at = before.ravel()[part * before.shape[1] + s]
        return s, self._firsts[j][s] + whole * self._rows[j][s] + at


class ScheduledMixtureOrder(MixtureOrder):
    """The order of one epoch of a scheduled mixture (`MixturePhases`): position ``p`` of epoch
    ``e`` is global sample ``e·n + p``, whose phase says its source and draw number; draws map to
    samples through the sources' passes as in `MixtureOrder`."""

    def __init__(
        self,
        counts: list,
        phases: MixturePhases,
        *,
        n: int,
        seed: int,
        epoch: int,
        shuffle: Shuffle,
        block_shards: int = 4,
        passes: PassOrders | None = None,
    ):
        self.counts = [np.asarray(c, dtype=np.int64) for c in counts]
        self.starts, self.sizes = _source_sizes(self.counts, passes)
        self.n, self.epoch = int(n), _counted(epoch, n, "scheduled mixture")
        self.phases = phases
        self.weights = phases.weights[0]
        self.base = self.epoch * self.n  # the epoch's first global sample
        self._passes = passes if passes is not None else PassOrders(self.counts, seed, shuffle, block_shards)
        self._table: np.ndarray | None = None
        if self.n <= TABLE_MAX:
            self._table = self._whole_epoch()

    def source_of(self, positions: np.ndarray) -> np.ndarray:
        return self.phases.locate(self.base + np.asarray(positions, dtype=np.int64))[0]

    def drawn(self, position: int) -> np.ndarray:
        return self.phases.before(self.base + int(position))

    def _eval(self, positions: np.ndarray) -> np.ndarray:
        src, draw = self.phases.locate(self.base + positions)
        out = np.empty(len(positions), dtype=np.int64)
        for s in range(len(self.sizes)):
            m = src == s
            if m.any():
                out[m] = self._ids(s, draw[m])
        return out

    def _whole_epoch(self) -> np.ndarray:
        """Each source's draws in an epoch are consecutive: slices of its passes' orders."""
        src = self.phases.sources(self.base, self.n)
        first = self.drawn(0)
        out = np.empty(self.n, dtype=np.int64)
        for s in range(len(self.sizes)):
            at = np.flatnonzero(src == s)
            if len(at):
                out[at] = self.source_samples(s, int(first[s]), len(at))
        return out


def _counted(epoch, n, what: str) -> int:
    """``epoch`` if its samples lie within the `MAX_COUNTED` a ``what`` plan counts from the run's
    start (``epoch × n + position`` on int64), else `ConfigError` naming it."""
    epoch = int(epoch)
    if (epoch + 1) * int(n) > MAX_COUNTED:
        raise ConfigError(
            f"epoch {epoch} of {n} samples is past the 2^62 samples a {what} plan counts from the run's start; "
            f"was the state (or the step replayed) meant for another run?"
        )
    return epoch


class WeightedOrder:
    """The order of one epoch of a split drawn by per-sample weights (`crossfeed.format.weights`),
    as an `EpochOrder` is for plain epochs.

    Sample ``i`` owns ``w_i`` consecutive slots of the split's slot space (``S = sum(w)`` slots).
    Draws run over passes of that space: draw ``c`` (``epoch·n + position`` — each epoch takes
    ``n`` draws) is position ``c % S`` of pass ``c // S``, a permutation of the slots drawn with
    the plan's shuffle (block shuffle: windows of shards' slots), and the sample is the slot's owner
    (a binary search on the memory-mapped prefix sums). So every whole pass draws sample ``i``
    exactly ``w_i`` times, any window of draws in proportion to the weights in expectation, and
    a position is evaluated on its own: O(1) memory in the epoch's length, exact and elastic resume.
    """

    sequential = False
    materialised = False

    def __init__(self, counts, cum, *, n: int, seed: int, epoch: int, passes: PassOrders):
        self.counts = np.asarray(counts, dtype=np.int64)
        self.cum = cum  # a `crossfeed.format.weights.CumulativeWeights`
        self.slots = int(cum.total)
        self.n, self.epoch = int(n), _counted(epoch, n, "weighted")
        self._passes = passes

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        c = self.epoch * self.n + positions
        passes, within = np.divmod(c, self.slots)
        lo, hi = (int(passes.min()), int(passes.max())) if len(c) else (0, 0)
        if lo == hi:
            slots = self._passes(0, lo)(within)
        else:
            slots = np.empty(len(c), dtype=np.int64)
            for p in range(lo, hi + 1):
                q = passes == p
                if q.any():
                    slots[q] = self._passes(0, p)(within[q])
        return self.cum.sample_of(slots)

    def run(self, lo: int, hi: int) -> np.ndarray:
        return self(np.arange(lo, hi, dtype=np.int64))


class PassOrders:
    """``passes(s, p)``: the order (an `EpochOrder`) of pass ``p`` over mixture source ``s``,
    drawn with the source's own seed stream. The last ``keep`` passes of each source are kept: a
    pass usually straddles two epochs, and the `MixtureOrder`s of one `Sampler` share these."""

    def __init__(
        self,
        counts: list,
        seed: int,
        shuffle: Shuffle,
        block_shards: int = 4,
        keep: int = 2,
        skipped: list[np.ndarray] | None = None,
        owners: list | None = None,
    ):
        """``skipped``: each source's skipped sample indices (sorted), taken out of each of its
        passes, which close up (`RefilledOrder`; ``Skip(refill=True)``): ``sizes`` counts the rest.
        ``owners``: a mixture's per-sample weights, one per source (a `CumulativeWeights`, or None
        for a source drawn uniformly): such a source's passes run over its slots (each shard's
        ``shard_slots``), and a slot's sample is its owner (`samples`, `run`), as `WeightedOrder`."""
        self.owners = list(owners) if owners is not None else [None] * len(counts)
        counts = [c if o is None else o.shard_slots(c) for c, o in zip(counts, self.owners)]
        self.counts, self.keep = counts, keep
        self.skipped = skipped
        # each source's pass: its samples (less the skipped ones), or its slots
        self.sizes = np.array(
            [int(np.asarray(c).sum()) - (len(skipped[s]) if skipped else 0) for s, c in enumerate(counts)],
            dtype=np.int64,
        )
        self._seeds = [
            int(np.random.SeedSequence([int(seed), s, 0x6D6978]).generate_state(1, np.uint64)[0] >> 2)
            for s in range(len(counts))
        ]
        self._shuffle, self._block = Shuffle(shuffle), block_shards
        self._orders: list[dict[int, EpochOrder | RefilledOrder]] = [{} for _ in counts]
        self._lock = threading.Lock()

    def __call__(self, s: int, p: int) -> EpochOrder | RefilledOrder:
        kept = self._orders[s]
        with self._lock:
            got = kept.get(p)
            if got is None:
                while len(kept) >= self.keep:
                    del kept[next(iter(kept))]  # the oldest first
                got = EpochOrder(
                    self.counts[s], seed=self._seeds[s], epoch=p, shuffle=self._shuffle, block_shards=self._block
                )
                if self.skipped is not None and len(self.skipped[s]):
                    got = RefilledOrder(got, self.skipped[s])
                kept[p] = got
        return got

    def samples(self, s: int, p: int, within: np.ndarray) -> np.ndarray:
        """Source ``s``'s samples (its own numbering) at places ``within`` of its pass ``p``."""
        got = self(s, p)(within)
        owner = self.owners[s]
        return got if owner is None else owner.sample_of(got)

    def run(self, s: int, p: int, lo: int, hi: int) -> np.ndarray:
        """Source ``s``'s samples at places ``lo … hi - 1`` of its pass ``p``."""
        got = self(s, p).run(lo, hi)
        owner = self.owners[s]
        return got if owner is None else owner.sample_of(got)


def per_rank(remaining: int, world_size: int, remainder: Remainder) -> int:
    """Samples each rank gets from ``remaining`` samples (the same for every rank)."""
    if Remainder(remainder) is Remainder.DROP:
        return remaining // world_size
    return math.ceil(remaining / world_size)


def num_batches(n: int, batch_size: int, drop_last: bool) -> int:
    return n // batch_size if drop_last else math.ceil(n / batch_size)


@dataclass(frozen=True)
class Plan:
    """One rank's (and worker's) batches for the rest of an epoch, computed batch by batch."""

    order: EpochOrder | MixtureOrder | WeightedOrder | RefilledOrder
    position: int  # samples of the epoch all ranks consumed before this plan
    per_rank: int  # samples this rank delivers (all its workers together)
    rank: int
    world_size: int
    batch_size: int
    drop_last: bool
    worker: int = 0
    num_workers: int = 1
    _chunk: dict = field(default_factory=dict, compare=False, repr=False)  # {chunk: indices}, see `batch`
    random_access = True  # `batch_ids` and `batch`: any batch by number (looked ahead at by the prefetcher)

    @property
    def rank_batches(self) -> int:
        """Batches this rank delivers (all its workers together)."""
        return num_batches(self.per_rank, self.batch_size, self.drop_last)

    def batch_ids(self) -> range:
        """Rank-level batch numbers this worker produces."""
        return range(self.worker, self.rank_batches, self.num_workers)

    def batch(self, b: int) -> np.ndarray:
        """The global sample indices of rank batch ``b``. Large epochs evaluate the order for a
        chunk of consecutive batches at once (the per-call cost of numpy dominates a single
        batch) and keep the last chunk; the indices are the same either way."""
        if self.order.materialised:
            return self._at(
                np.arange(b * self.batch_size, min((b + 1) * self.batch_size, self.per_rank), dtype=np.int64)
            )
        per = max(1, CHUNK_SAMPLES // self.batch_size)
        c = b // per
        with _CHUNK_LOCK:
            cached = self._chunk.get(c)
        if cached is None:
            lo = c * per * self.batch_size
            cached = self._at(np.arange(lo, min(lo + per * self.batch_size, self.per_rank), dtype=np.int64))
            with _CHUNK_LOCK:
                self._chunk.clear()
                self._chunk[c] = cached
        start = (b - c * per) * self.batch_size
        return cached[start : start + self.batch_size]

    @property
    def samples(self) -> np.ndarray:
        """All of this rank's samples in order (O(per_rank): for tests and small tools)."""
        return self._at(np.arange(self.per_rank, dtype=np.int64))

    def _at(self, j: np.ndarray) -> np.ndarray:
        """Rank sample ``j`` is ``remaining[rank + j * W]``; past the end of the epoch the
        remainder pads from the start of the epoch's order."""
        k = self.rank + j * self.world_size
        left = self.order.n - self.position
        pos = np.where(k < left, self.position + k, (k - left) % max(self.order.n, 1))
        return self.order(pos)

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

    def __init__(self, counts, plan: PlanOptions, shard: ShardOptions, *, weights=None, sample_weights=None):
        """``counts``: the record counts of the split's shards; for a mixture (``weights`` given,
        one per source), a list of such arrays, one per source. ``sample_weights``: one split's
        per-sample weights (a `crossfeed.format.weights.CumulativeWeights`; `WeightedOrder`)."""
        self.options, self.shard = plan, shard
        self.phases: MixturePhases | None = None  # a scheduled mixture's (`crossfeed.read.schedule`)
        self.weights: list[int] | None
        self.total: int
        if weights is not None and any(not isinstance(w, (int, float)) for w in weights):
            self.phases = MixturePhases(mixture_phases(weights))
            self.weights = [int(w) for w in self.phases.weights[0]]
        else:
            self.weights = integer_weights(weights) if weights is not None else None
        self.source_weights: list | None = None  # a mixture's per-sample weights, one per source
        if sample_weights is not None and weights is not None:
            if not isinstance(sample_weights, (list, tuple)) or len(sample_weights) != len(weights):
                raise ConfigError("a mixture's per-sample weights are one weights set per source")
            self.source_weights, sample_weights = list(sample_weights), None
        self.sample_weights = sample_weights
        self.counts: Any  # the shards' record counts (an int64 array), or a mixture's: one array per source
        if self.weights is None:
            self.counts = np.asarray(counts, dtype=np.int64)
            self.total = int(self.counts.sum())
        else:
            if len(counts) != len(self.weights):
                raise ConfigError(f"{len(counts)} sources but {len(self.weights)} weights")
            self.counts = [np.asarray(c, dtype=np.int64) for c in counts]
            sizes = sum(int(c.sum()) for c in self.counts)
            self.total = int(plan.samples_per_epoch) if plan.samples_per_epoch is not None else sizes
        self._order: tuple[int, EpochOrder | MixtureOrder | WeightedOrder | RefilledOrder] | None = None
        self.refill: np.ndarray | None = None  # skipped sample ids taken out of every epoch (Skip(refill=True))
        skip = getattr(plan, "skip", None)
        skipped: list[np.ndarray] | None = None  # a mixture's refilled ids, by source (its passes close up)
        if skip is not None and skip.refill and len(skip.samples):
            if sample_weights is not None or any(w is not None for w in self.source_weights or ()):
                raise ConfigError(
                    "Skip(refill=True) closes up an order of samples; a per-sample-weighted plan draws its samples "
                    "by weight and cannot refill: use Skip(samples=…) without refill (shorter steps)"
                )
            if self.weights is None:
                self.refill = skip.ids(np.array([0, self.total], dtype=np.int64))
                if len(self.refill) >= self.total:
                    raise ConfigError(
                        f"skip= takes out all {self.total:,} samples of the epoch; nothing is left to read"
                    )
                self.total -= len(self.refill)
            else:  # each source's passes close up around its skipped samples
                stored = np.array([int(c.sum()) for c in self.counts], dtype=np.int64)
                starts = np.concatenate([[0], np.cumsum(stored)]).astype(np.int64)
                self.refill = skip.ids(starts)
                skipped = [
                    self.refill[(self.refill >= lo) & (self.refill < hi)] - lo for lo, hi in zip(starts, starts[1:])
                ]
                gone = np.flatnonzero(stored == np.array([len(k) for k in skipped]))
                if len(gone):
                    g = int(gone[0])
                    raise ConfigError(
                        f"mixture source {g} has no samples left: skip= takes out all {int(stored[g]):,} of them"
                    )
                if plan.samples_per_epoch is None:
                    self.total -= len(self.refill)
        if self.source_weights is not None:
            for i, (c, sw) in enumerate(zip(self.counts, self.source_weights)):
                if sw is None:  # a source drawn uniformly
                    continue
                if len(sw) != int(c.sum()):
                    raise ConfigError(f"{sw.where}: weights of {len(sw)} records, source {i} has {int(c.sum())}")
                if not sw.total:
                    raise ConfigError(f"{sw.where}: every weight of source {i} is 0; none of its samples can be drawn")
        self._passes: PassOrders | None = (
            PassOrders(
                self.counts, plan.seed, plan.shuffle, plan.block_shards, skipped=skipped, owners=self.source_weights
            )
            if self.weights is not None
            else None
        )
        if sample_weights is not None:
            if len(sample_weights) != int(self.counts.sum()):
                raise ConfigError(
                    f"{sample_weights.where}: weights of {len(sample_weights)} records, the split has {int(self.counts.sum())}"
                )
            if plan.samples_per_epoch is not None:
                self.total = int(plan.samples_per_epoch)
            slot_counts = sample_weights.shard_slots(self.counts)
            self._passes = PassOrders([slot_counts], plan.seed, plan.shuffle, plan.block_shards)
        self._lock = threading.Lock()

    def _make_order(self, epoch: int):
        o = self.options
        if self.sample_weights is not None:
            assert self._passes is not None  # set with sample_weights
            return WeightedOrder(
                self.counts, self.sample_weights, n=self.total, seed=o.seed, epoch=epoch, passes=self._passes
            )
        if self.weights is None:
            order = EpochOrder(self.counts, seed=o.seed, epoch=epoch, shuffle=o.shuffle, block_shards=o.block_shards)
            return order if self.refill is None else RefilledOrder(order, self.refill)
        kw: dict[str, Any] = dict(
            n=self.total, seed=o.seed, epoch=epoch, shuffle=o.shuffle, block_shards=o.block_shards, passes=self._passes
        )
        if self.phases is not None:
            return ScheduledMixtureOrder(self.counts, self.phases, **kw)
        return MixtureOrder(self.counts, self.weights, **kw)

    def plan(self, epoch: int, position: int = 0) -> Plan:
        o, sh = self.options, self.shard
        if not 0 <= position <= self.total:
            raise ConfigError(
                f"position {position} is outside the epoch of {self.total} samples; was the state saved for another dataset?"
            )
        with self._lock:
            if self._order is None or self._order[0] != epoch:  # the order of one epoch is kept
                self._order = (epoch, self._make_order(epoch))
            order = self._order[1]
        n = per_rank(self.total - position, sh.world_size, o.remainder)
        return Plan(order, position, n, sh.rank, sh.world_size, o.batch_size, o.drop_last, sh.worker, sh.num_workers)

    def epoch_total(self, epoch: int = 0) -> int:
        """Positions in an epoch: its samples, whichever epoch (a `PackSampler`'s rows depend on it)."""
        return self.total

    def within(self, epoch: int, position: int) -> bool:
        """Whether ``position`` lies in an epoch (0 … its samples)."""
        return 0 <= position <= self.total

    def rank_batch_count(self, position: int = 0, epoch: int = 0) -> int:
        """Batches each rank delivers from ``position`` to the end of an epoch (all its workers
        together), computed without building the epoch's order (any ``epoch``: the same count)."""
        o = self.options
        n = per_rank(self.total - position, self.shard.world_size, o.remainder)
        return num_batches(n, o.batch_size, o.drop_last)

    def position_after(self, position: int, rank_batches_done: int, epoch: int = 0) -> int:
        """The epoch position after every rank delivered ``rank_batches_done`` batches from ``position``."""
        return min(self.total, position + rank_batches_done * self.options.batch_size * self.shard.world_size)

    def source_positions(self, epoch: int, position: int) -> list[dict] | None:
        """Where each source of a mixture stands at ``position`` of epoch ``epoch``: its pass over
        its records and the offset in it (None: one dataset)."""
        if self.weights is None:
            return None
        order: Any = self.plan(epoch, position).order  # a `MixtureOrder`: weights are given
        draws = order.drawn(position)
        sizes = order._passes.sizes  # a pass: a source's samples, or its slots under per-sample weights
        return [{"pass": int(d // k), "offset": int(d % k)} for d, k in zip(draws.tolist(), sizes)]
