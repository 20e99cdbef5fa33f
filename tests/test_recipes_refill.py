"""Refilled skips (issue 36): ``Skip(samples=…, refill=True)`` takes the skipped samples out of
the epoch's order and closes it up, so every step is full — through the order's inverse
(`Permutation.inverse`, `EpochOrder.positions_of`), exact and elastic on resume, ranks 1–4,
small (table) and large (evaluated) epochs, every shuffle mode."""

from __future__ import annotations

import numpy as np
import pytest
import recipe_helpers as rh
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loader_helpers import assert_resumes_identically

import crossfeed
from crossfeed import ConfigError, Loader, Skip
from crossfeed.read.options import Shuffle
from crossfeed.read.stages import sampler as sampler_mod
from crossfeed.read.stages.sampler import EpochOrder, Permutation, RefilledOrder, _keys

N = 120


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return rh.write(tmp_path_factory.mktemp("refill") / "d", n=N)


def _ids(batches):
    return [np.asarray(b["__index__"]).tolist() for b in batches]


# ---- the order's inverse --------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 3000), seed=st.integers(0, 2**40), epoch=st.integers(0, 5))
def test_the_permutations_inverse_undoes_it_for_every_position(n, seed, epoch):
    perm = Permutation(n, _keys(seed, epoch, 1))
    k = np.arange(n, dtype=np.int64)
    y = perm(k)
    assert np.array_equal(np.sort(y), k)
    assert np.array_equal(perm.inverse(y), k)


COUNTS = st.lists(st.integers(0, 60), min_size=1, max_size=9).filter(lambda c: sum(c) > 0)


@settings(max_examples=60, deadline=None)
@given(
    counts=COUNTS,
    shuffle=st.sampled_from(list(Shuffle)),
    table=st.booleans(),
    block=st.integers(1, 4),
    seed=st.integers(0, 999),
    picks=st.lists(st.integers(0, 10**6), max_size=12),
)
def test_a_refilled_order_is_the_order_without_the_skipped_samples(counts, shuffle, table, block, seed, picks):
    saved = sampler_mod.TABLE_MAX
    sampler_mod.TABLE_MAX = saved if table else 0  # 0: the order is evaluated (Feistel, windows), never a table
    try:
        order = EpochOrder(counts, seed=seed, epoch=3, shuffle=shuffle, block_shards=block)
        assert order.materialised == (table or shuffle is Shuffle.NONE)
        whole = order(np.arange(order.n, dtype=np.int64))
        assert np.array_equal(order.positions_of(whole), np.arange(order.n))  # the exact inverse
        skipped = np.unique(np.asarray(picks, dtype=np.int64) % order.n)
        refilled = RefilledOrder(order, skipped)
        want = [s for s in whole.tolist() if s not in set(skipped.tolist())]
        assert refilled.n == len(want)
        assert refilled(np.arange(refilled.n, dtype=np.int64)).tolist() == want
        lo = refilled.n // 3
        assert refilled.run(lo, refilled.n).tolist() == want[lo:]
    finally:
        sampler_mod.TABLE_MAX = saved


# ---- through the Loader ---------------------------------------------------------------------------


def test_refilled_steps_are_full_and_the_skipped_samples_never_come(data):
    skip = Skip(samples=[3, 17, 50, 51, 119], refill=True)
    with Loader(data, batch_size=8, seed=1, skip=skip, return_index=True) as ld:
        assert len(ld) == 15  # 115 samples: 14 full steps and a tail of 3
        got = _ids(ld)
    assert [len(b) for b in got] == [8] * 14 + [3]
    flat = [i for b in got for i in b]
    assert sorted(flat) == sorted(set(range(N)) - {3, 17, 50, 51, 119})
    with Loader(data, batch_size=8, seed=1, skip=Skip(samples=[3, 17, 50, 51, 119]), return_index=True) as ld:
        shorter = _ids(ld)
    assert [i for b in shorter for i in b] == flat  # the same order, closed up
    assert len(shorter) == 15 and sum(len(b) < 8 for b in shorter) > 1


@pytest.mark.parametrize("shuffle", ["global", "block", "none"])
@pytest.mark.parametrize("table", [True, False])
def test_a_refilled_epoch_resumes_exactly_at_every_batch(data, monkeypatch, shuffle, table):
    if not table:
        monkeypatch.setattr(sampler_mod, "TABLE_MAX", 0)
    skip = Skip(samples=[0, 1, 2, 64, 90, 118], refill=True)
    assert_resumes_identically(data, batch_size=8, seed=4, shuffle=shuffle, skip=skip, epoch=2)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ids=st.lists(st.integers(0, N - 1), min_size=1, max_size=20),
    world=st.integers(1, 4),
    after=st.integers(1, 4),
    batch=st.integers(1, 9),
    remainder=st.sampled_from(["drop", "pad"]),
    stop=st.integers(0, 12),
    epoch=st.integers(0, 2),
    table=st.booleans(),
)
def test_refill_holds_across_ranks_and_elastic_resume(data, ids, world, after, batch, remainder, stop, epoch, table):
    saved = sampler_mod.TABLE_MAX
    sampler_mod.TABLE_MAX = saved if table else 0
    try:
        _check_refill(data, ids, world, after, batch, remainder, stop, epoch)
    finally:
        sampler_mod.TABLE_MAX = saved


def _check_refill(data, ids, world, after, batch, remainder, stop, epoch):
    kept = sorted(set(range(N)) - set(ids))
    kw = {"batch_size": batch, "seed": 7, "return_index": True, "remainder": remainder, "epoch": epoch}
    kw["skip"] = Skip(samples=ids, refill=True)
    ranks = []
    for rank in range(world):
        with Loader(data, rank=rank, world_size=world, **kw) as ld:
            ranks.append(_ids(ld))
            assert len(ld) == len(ranks[-1])
    assert len({len(r) for r in ranks}) == 1  # equal steps on every rank
    per = len(kept) // world if remainder == "drop" else -(-len(kept) // world)
    for r in ranks:  # every step full but each rank's last, which holds the rest of its share
        assert [len(b) for b in r[:-1]] == [batch] * (len(r) - 1) and sum(map(len, r)) == per
    flat = [i for r in ranks for b in r for i in b]
    assert not set(flat) & set(ids)
    if remainder == "drop":  # each kept sample at most once, fewer than `world` left out
        assert len(flat) == len(set(flat)) and len(kept) - len(flat) < world
    else:  # each kept sample at least once, under `world` of them again
        assert set(flat) == set(kept) and len(flat) - len(kept) < world
    # stop every rank after `stop` steps, resume under another world size: the rest of the epoch
    k = min(stop, len(ranks[0]))
    with Loader(data, rank=0, world_size=world, **kw) as ld:
        it = iter(ld)
        for _ in range(k):
            next(it)
        state = ld.state_dict()
    done = [i for r in ranks for b in r[:k] for i in b]
    rest = []
    for rank in range(after):
        with Loader(data, rank=rank, world_size=after, **kw) as ld:
            ld.load_state_dict(state)
            rest.append(_ids(ld))
    assert len({len(r) for r in rest}) == 1
    more = [i for r in rest for b in r for i in b]
    assert not set(more) & set(ids)
    if remainder == "drop":
        assert not set(done) & set(more) and len(set(more)) == len(more)
    else:
        assert set(done) | set(more) == set(kept)


def test_refill_is_part_of_the_streams_identity(data):
    kw = {"batch_size": 8, "seed": 2}
    with Loader(data, skip=Skip(samples=[5, 9], refill=True), **kw) as ld:
        it = iter(ld)
        next(it)
        state = ld.state_dict()
    with Loader(data, skip=Skip(samples=[5, 9]), **kw) as ld:
        with pytest.raises(ConfigError, match="skip refill"):
            ld.load_state_dict(state)
    with Loader(data, skip={"samples": [5, 9], "refill": True}, **kw) as ld:  # the same, as a dict
        ld.load_state_dict(state)
    assert Skip.of(Skip(samples=[5, 9], refill=True).to_json()) == Skip(samples=[5, 9], refill=True)


def test_refill_is_refused_by_name_where_it_is_not_built(data, tmp_path):
    refill = Skip(samples=[(0, 1)], refill=True)
    mix = [crossfeed.Source(data, weight=1), crossfeed.Source(data, weight=2)]
    Loader(mix, batch_size=8, skip=refill).close()  # a mixture refills each source's passes (test_filter_pass.py)
    every = Skip(samples=[(1, i) for i in range(N)], refill=True)
    with pytest.raises(ConfigError, match="mixture source 1 has no samples left: skip= takes out all 120 of them"):
        Loader(mix, batch_size=8, skip=every)
    weighed = crossfeed.write_dataset(tmp_path / "w", [{"x": i, "label": i % 3} for i in range(30)])
    weighed.close()
    crossfeed.write_weights(tmp_path / "w", balance="label", name="b")
    with pytest.raises(ConfigError, match=r"a per-sample-weighted plan draws its samples by weight and cannot refill"):
        Loader(tmp_path / "w", batch_size=8, weights="b", skip=Skip(samples=[1], refill=True))
    with pytest.raises(ConfigError, match="takes out all 120 samples"):
        Loader(data, batch_size=8, skip=Skip(samples=range(N), refill=True))
    with pytest.raises(ConfigError, match="skip refill: True or False"):
        Skip(samples=[1], refill="yes")


def test_a_skip_file_refills_and_a_dispatchers_rank_plans_refill_too(data, tmp_path):
    text, lines = tmp_path / "skips.txt", tmp_path / "skips.jsonl"
    text.write_text("# spike at step 40\n3\n17\nrefill\n")
    lines.write_text('3\n[0, 17]\n{"refill": true}\n')
    assert Skip.of(text) == Skip.of(lines) == Skip(samples=[3, 17], refill=True)
    assert not Skip.of({"samples": [3, 17]}).refill
    with Loader(data, batch_size=8, seed=6, skip=text, world_size=2, rank=1, return_index=True) as ld:
        got = [i for b in _ids(ld) for i in b]
        planned = ld.pipeline.rank_sampler(1, 2).plan(0).samples  # what a lease server plans for rank 1
    assert planned.tolist() == got and len(got) == 59 and not {3, 17} & set(got)


def test_token_pipelines_refuse_refilled_skips_by_name(tmp_path):
    from token_data import write_tokens

    tokens = write_tokens(tmp_path / "t", [5, 9, 12, 3, 7, 20, 11, 4], num_shards=2)
    for how in ({"pack": crossfeed.Pack(16)}, {"batch_by_tokens": 32}):
        with pytest.raises(ConfigError, match=r"skipped sample ids \(skip= samples\) .* not built for token pipelines"):
            Loader(tokens, batch_size=2, skip=Skip(samples=[1], refill=True), **how)


def test_batch_at_replays_a_refilled_step_without_a_walk(data):
    skip = Skip(samples=[2, 30, 31, 99], refill=True)
    with Loader(data, batch_size=8, seed=8, skip=skip, world_size=2, rank=1, return_index=True) as ld:
        got = _ids(ld)
        for step in (0, 3, len(got) - 1):
            assert [r.key for r in ld.batch_at(step)] == got[step]


def test_refill_with_skipped_steps_and_worker_processes(data):
    kw = {"batch_size": 8, "seed": 12, "return_index": True}
    with Loader(data, skip=Skip(samples=[4, 8, 15, 16, 23, 42], refill=True), **kw) as ld:
        refilled = _ids(ld)
    both = Skip(steps=[(2, 4)], samples=[4, 8, 15, 16, 23, 42], refill=True)
    for executor in ("thread", "process"):
        with Loader(data, skip=both, executor=executor, **kw) as ld:
            assert _ids(ld) == refilled[:2] + refilled[4:]
