"""Property tests of the epoch plan: permutations, equal shares, epochs differ, determinism."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crossfeed.errors import ConfigError
from crossfeed.read.options import LoaderOptions, PlanOptions, Remainder, ShardOptions, Shuffle
from crossfeed.read.stages.sampler import Sampler, epoch_order

counts_st = st.lists(st.integers(0, 40), min_size=1, max_size=9).filter(lambda c: sum(c) > 0)


@settings(max_examples=150, deadline=None)
@given(
    counts=counts_st,
    seed=st.integers(0, 2**40),
    epoch=st.integers(0, 50),
    shuffle=st.sampled_from(list(Shuffle)),
    block=st.integers(1, 4),
)
def test_epoch_order_is_a_permutation_and_pure(counts, seed, epoch, shuffle, block):
    order = epoch_order(counts, seed=seed, epoch=epoch, shuffle=shuffle, block_shards=block)
    assert sorted(order.tolist()) == list(range(sum(counts)))
    again = epoch_order(counts, seed=seed, epoch=epoch, shuffle=shuffle, block_shards=block)
    np.testing.assert_array_equal(order, again)


@settings(max_examples=200, deadline=None)
@given(
    counts=counts_st,
    seed=st.integers(0, 2**31),
    epoch=st.integers(0, 9),
    world=st.integers(1, 7),
    workers=st.integers(1, 4),
    batch=st.integers(1, 9),
    drop_last=st.booleans(),
    remainder=st.sampled_from(list(Remainder)),
    shuffle=st.sampled_from(list(Shuffle)),
)
def test_ranks_get_equal_batches_and_cover_the_epoch(
    counts, seed, epoch, world, workers, batch, drop_last, remainder, shuffle
):
    cfg = PlanOptions(batch_size=batch, shuffle=shuffle, seed=seed, drop_last=drop_last, remainder=remainder)
    n = sum(counts)
    per_rank_batches, seen = set(), []
    for rank in range(world):
        rank_total = 0
        for w in range(workers):
            sampler = Sampler(counts, cfg, ShardOptions(rank=rank, world_size=world, worker=w, num_workers=workers))
            plan = sampler.plan(epoch, 0)
            assert sampler.rank_batch_count(0) == plan.rank_batches  # counted without building the order
            for b in plan.batch_ids():
                seen.extend(plan.batch(b).tolist())
                rank_total += 1
        per_rank_batches.add(rank_total)
    assert len(per_rank_batches) == 1, "ranks must produce the same number of batches"
    counts_seen = np.bincount(seen, minlength=n)
    if remainder is Remainder.PAD:
        assert counts_seen.max() <= 1 + -(-world // n), "padding repeats at most the shortfall"
        if not drop_last:
            assert counts_seen.min() >= 1, "pad: every sample at least once"
    else:
        assert counts_seen.max() <= 1, "no repeats without padding"
    if n % world == 0 and (n // world) % batch == 0:
        assert counts_seen.tolist() == [1] * n, "exactly once when everything divides"


@settings(max_examples=60, deadline=None)
@given(counts=counts_st, seed=st.integers(0, 2**31))
def test_epochs_differ_and_drop_rotates(counts, seed):
    n = sum(counts)
    if n < 6:
        return
    a = epoch_order(counts, seed=seed, epoch=0, shuffle=Shuffle.GLOBAL)
    b = epoch_order(counts, seed=seed, epoch=1, shuffle=Shuffle.GLOBAL)
    assert not np.array_equal(a, b)
    # with shuffle none and drop, the dropped sample is not the same in every epoch
    cfg = PlanOptions(batch_size=1, shuffle=Shuffle.NONE, seed=seed, remainder=Remainder.DROP)
    world = n - 1 if n > 2 else 2
    dropped = set()
    for epoch in range(6):
        got = set()
        for r in range(world):
            got |= set(Sampler(counts, cfg, ShardOptions(rank=r, world_size=world)).plan(epoch, 0).samples.tolist())
        dropped |= set(range(n)) - got
    assert len(dropped) > 1


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(1, 300),
    seed=st.integers(0, 1000),
    w1=st.integers(1, 6),
    w2=st.integers(1, 6),
    batch=st.integers(1, 8),
    steps=st.integers(0, 40),
)
def test_elastic_resume_loses_and_repeats_nothing(n, seed, w1, w2, batch, steps):
    """Run `steps` lockstep steps with world w1, resume the same epoch with world w2 (drop policy,
    no padding): together every sample at most once, and all of them when the counts divide."""
    cfg = PlanOptions(batch_size=batch, shuffle=Shuffle.GLOBAL, seed=seed, remainder=Remainder.DROP)
    counts = [n]
    before = []

    def sampler(r, w):
        return Sampler(counts, cfg, ShardOptions(rank=r, world_size=w))

    k = min(steps, sampler(0, w1).plan(3, 0).rank_batches)
    for r in range(w1):
        plan = sampler(r, w1).plan(3, 0)
        for b in range(k):
            before += plan.batch(b).tolist()
    position = sampler(0, w1).position_after(0, k)
    assert position == len(before) or position == n
    after = []
    for r in range(w2):
        plan = sampler(r, w2).plan(3, position)
        for b in plan.batch_ids():
            after += plan.batch(b).tolist()
    everything = before + after
    assert len(everything) == len(set(everything))
    assert len(everything) >= n - (w1 - 1) - (w2 - 1)


def test_bad_options_name_the_fix():
    with pytest.raises(ConfigError, match="shuffle='random' is not one of 'global', 'block', 'none'"):
        PlanOptions(batch_size=4, shuffle="random")
    with pytest.raises(ConfigError, match="batch_size"):
        PlanOptions(batch_size=0)
    with pytest.raises(ConfigError, match="seed"):
        PlanOptions(batch_size=4, seed=-1)
    with pytest.raises(ConfigError, match="position"):
        Sampler([5], PlanOptions(batch_size=4), ShardOptions(rank=0, world_size=1)).plan(0, 9)
    with pytest.raises(ConfigError, match="worker 2 is not in range"):
        ShardOptions(worker=2, num_workers=2)
    with pytest.raises(ConfigError, match="unknown loader option shufle="):
        LoaderOptions.of(batch_size=4, shufle="none")
    with pytest.raises(TypeError):
        PlanOptions(4)  # keyword-only: a positional batch size is a mistake waiting to happen


def test_options_pass_whole_and_replace_by_name():
    opts = LoaderOptions.of(batch_size=8, shuffle="block", seed=3, rank=1, world_size=4, num_threads=3, on_error="skip")
    assert opts.plan == PlanOptions(batch_size=8, shuffle=Shuffle.BLOCK, seed=3)
    assert (opts.rank, opts.world_size, opts.read.num_threads, opts.read.on_error.value) == (1, 4, 3, "skip")
    moved = opts.replace(rank=2, batch_size=16)
    assert (moved.rank, moved.world_size, moved.batch_size, moved.plan.seed) == (2, 4, 16, 3)
    with pytest.raises(ConfigError, match="rank 4 is not in range"):
        opts.replace(rank=4)


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 5000), seed=st.integers(0, 2**40), epoch=st.integers(0, 50))
def test_the_bijection_is_a_permutation(n, seed, epoch):
    from crossfeed.read.stages.sampler import Permutation, _keys

    got = Permutation(n, _keys(seed, epoch, 1))(np.arange(n))
    assert sorted(got.tolist()) == list(range(n))


@settings(max_examples=40, deadline=None)
@given(
    counts=counts_st,
    seed=st.integers(0, 2**31),
    epoch=st.integers(0, 9),
    shuffle=st.sampled_from(list(Shuffle)),
    block=st.integers(1, 4),
)
def test_large_epochs_are_evaluated_per_batch_with_the_same_properties(counts, seed, epoch, shuffle, block):
    """Above TABLE_MAX the order is never materialised: evaluated on any positions it is still a
    permutation, and a plan's batches are exactly its samples in order."""
    import crossfeed.read.stages.sampler as plan_mod

    old = plan_mod.TABLE_MAX
    plan_mod.TABLE_MAX = 0  # every epoch takes the large-epoch path
    try:
        order = epoch_order(counts, seed=seed, epoch=epoch, shuffle=shuffle, block_shards=block)
        assert sorted(order.tolist()) == list(range(sum(counts)))
        sampler = Sampler(
            counts,
            PlanOptions(batch_size=3, shuffle=shuffle, seed=seed, block_shards=block),
            ShardOptions(rank=0, world_size=2),
        )
        plan = sampler.plan(epoch, 0)
        got = [i for b in plan for i in b.tolist()]
        assert got == plan.samples.tolist()
        if shuffle is Shuffle.BLOCK:  # each window of shards is read before the next one starts
            starts = np.concatenate([[0], np.cumsum(counts)])
            shard_of = np.searchsorted(starts, order, side="right") - 1
            seen_windows = []
            for s in shard_of.tolist():
                w = [w for w, ws in enumerate(sampler.plan(epoch, 0).order._windows) if s in ws.tolist()][0]
                if not seen_windows or seen_windows[-1] != w:
                    assert w not in seen_windows
                    seen_windows.append(w)
    finally:
        plan_mod.TABLE_MAX = old


def test_a_ten_billion_sample_epoch_plans_in_constant_memory():
    import tracemalloc

    counts = [10**6] * 10**4  # 10^10 samples in 10,000 shards
    tracemalloc.start()
    for shuffle in Shuffle:
        sampler = Sampler(
            counts, PlanOptions(batch_size=256, shuffle=shuffle, seed=1), ShardOptions(rank=3, world_size=8)
        )
        plan = sampler.plan(5, 123_456_789)
        first, later = plan.batch(0), plan.batch(plan.rank_batches - 1)
        assert len(first) == 256 and len(set(first.tolist())) == 256
        assert ((0 <= first) & (first < 10**10)).all() and ((0 <= later) & (later < 10**10)).all()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 8 << 20, f"planning 10^10 samples used {peak / 2**20:.1f} MiB"
