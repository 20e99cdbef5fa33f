"""Weighted mixtures of datasets: the schedule's proportions over every prefix, each source's
passes, and every Loader property (equal steps per rank, exact and elastic resumption)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from loader_helpers import assert_resumes_identically, ids_of

import crossfeed
from crossfeed.errors import ConfigError
from crossfeed.read.options import Shuffle
from crossfeed.read.stages import sampler as plan_mod
from crossfeed.read.stages.sampler import MixtureOrder, PassOrders, integer_weights, smooth_schedule


@settings(max_examples=200, deadline=None)
@given(weights=st.lists(st.integers(1, 30), min_size=1, max_size=6))
def test_every_prefix_keeps_the_proportions_within_one_sample(weights):
    period = smooth_schedule(weights)
    assert len(period) == sum(weights)
    seq = np.tile(period, 3)  # the schedule repeats: check across period boundaries too
    counts = np.cumsum(seq[:, None] == np.arange(len(weights))[None, :], axis=0)
    prefix = np.arange(1, len(seq) + 1)[:, None]
    assert np.abs(counts - prefix * np.asarray(weights) / sum(weights)).max() < 1


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=4).filter(any), min_size=1, max_size=4),
    data=st.data(),
)
def test_an_epoch_drawn_whole_equals_it_evaluated_position_by_position(sizes, data):
    """A small epoch is drawn whole, source by source (consecutive draws, slices of the passes'
    orders); a large one is evaluated on any positions. Both must give the same order, and the
    passes shared by the epochs of one plan must give what fresh ones give."""
    weights = data.draw(st.lists(st.integers(1, 9), min_size=len(sizes), max_size=len(sizes)))
    n = data.draw(st.integers(1, 300))
    shuffle = data.draw(st.sampled_from(list(Shuffle)))
    shared = PassOrders([np.asarray(c) for c in sizes], 7, shuffle)
    for epoch in (0, 1, 4):
        whole = MixtureOrder(sizes, weights, n=n, seed=7, epoch=epoch, shuffle=shuffle, passes=shared)
        assert whole.materialised
        positions = np.arange(n)
        old, plan_mod.TABLE_MAX = plan_mod.TABLE_MAX, 0
        try:
            evaluated = MixtureOrder(sizes, weights, n=n, seed=7, epoch=epoch, shuffle=shuffle)
        finally:
            plan_mod.TABLE_MAX = old
        assert not evaluated.materialised
        np.testing.assert_array_equal(whole(positions), evaluated(positions))
        picked = np.random.default_rng(epoch).permutation(n)[: max(1, n // 3)]
        np.testing.assert_array_equal(whole(picked), evaluated(picked))
        # each source's draws of the epoch are its own ids, and a pass is a permutation of them
        got = whole(positions)
        starts = np.concatenate([[0], np.cumsum([sum(c) for c in sizes])])
        assert ((got >= 0) & (got < starts[-1])).all()


def test_weights_become_small_integers():
    assert integer_weights([3, 1]) == [3, 1]
    assert integer_weights([0.3, 0.7]) == [3, 7]
    assert integer_weights([2, 4, 6]) == [1, 2, 3]
    with pytest.raises(ConfigError, match="positive"):
        integer_weights([1, 0])


def _source(root, name: str, n: int, offset: int, shards: int = 2, **extra):
    samples = [
        {"x": np.full(3, offset + i, np.float32), "id": offset + i, **{k: v(i) for k, v in extra.items()}}
        for i in range(n)
    ]
    crossfeed.write_dataset(root / name, samples, num_shards=shards).close()
    return root / name


@pytest.fixture
def two(tmp_path):
    return [
        crossfeed.Source(_source(tmp_path, "big", 60, 0, shards=3), weight=3),
        crossfeed.Source(_source(tmp_path, "small", 7, 1000), weight=1),
    ]


def test_a_mixture_delivers_the_weights_and_each_source_pass_by_pass(two):
    with crossfeed.Loader(two, batch_size=8, seed=3, return_index=True, samples_per_epoch=200) as loader:
        batches = list(loader)
        assert len(batches) == 25 and loader.batch_count() == 25
    src = np.concatenate([b["__source__"] for b in batches])
    idx = np.concatenate([b["__index__"] for b in batches])
    ids = np.concatenate([b["id"] for b in batches])
    id_of = [[int(crossfeed.open_dataset(s.path)["train"][i]["id"]) for i in range(n)] for s, n in zip(two, (60, 7))]
    np.testing.assert_array_equal(ids, [id_of[s][i] for s, i in zip(src.tolist(), idx.tolist())])  # the right samples
    counts = np.cumsum(src[:, None] == np.arange(2)[None, :], axis=0)
    prefix = np.arange(1, len(src) + 1)[:, None]
    assert np.abs(counts - prefix * np.array([3, 1]) / 4).max() < 1
    small = idx[src == 1]  # 50 draws from 7 samples: 7 whole passes, each a permutation, then 1 sample
    for p in range(7):
        assert sorted(small[7 * p : 7 * p + 7].tolist()) == list(range(7))
    big = idx[src == 0]  # 150 draws from 60: passes 0 and 1 whole, pass 2 begun
    assert sorted(big[:60].tolist()) == list(range(60)) and sorted(big[60:120].tolist()) == list(range(60))
    assert len(set(big[120:].tolist())) == 30
    assert not np.array_equal(big[:60], big[60:120])  # each pass its own order


def test_the_next_epoch_continues_each_source_where_it_was(two):
    with crossfeed.Loader(two, batch_size=5, seed=1, return_index=True, shuffle="none") as loader:
        e0 = [b for b in loader]
        e1 = [b for b in loader]
    small = np.concatenate([b["__index__"][b["__source__"] == 1] for b in e0 + e1])
    # pass after pass, each a permutation of the 7 samples, continued across the epoch boundary
    assert len(small) == 34
    for p in range(4):
        assert sorted(small[7 * p : 7 * p + 7].tolist()) == list(range(7)), p


@pytest.mark.parametrize("shuffle", ["global", "block", "none"])
def test_a_mixture_resumes_identically_from_every_batch(two, shuffle):
    assert_resumes_identically(two, batch_size=6, seed=5, shuffle=shuffle, samples_per_epoch=50)


def test_ranks_get_equal_steps_and_resume_elastically(two):
    kw = dict(batch_size=4, seed=2, samples_per_epoch=96, remainder="drop", return_index=True)
    with crossfeed.Loader(two, **kw) as whole:
        reference = np.concatenate(ids_of(whole))
    steps = 3
    first, state = [], None
    for r in range(3):  # 3 ranks take 3 lockstep steps...
        with crossfeed.Loader(two, rank=r, world_size=3, **kw) as ld:
            assert len(ld) == 8
            it = iter(ld)
            for _ in range(steps):
                first.append(next(iter([ids_of([next(it)])[0]])))
            state = ld.state_dict()
    rest = []
    for r in range(2):  # ... then 2 ranks finish the epoch from rank 0's state
        with crossfeed.Loader(two, rank=r, world_size=2, **kw) as ld:
            ld.load_state_dict(state)
            assert len(ld) == 8  # 60 positions left: 30 per rank, in batches of 4
            rest += ids_of(ld)
    got = np.concatenate(first + rest)
    # every position of the epoch exactly once: the same draws, source by source, as one rank reads
    assert len(got) == 96 and sorted(got.tolist()) == sorted(reference.tolist())
    assert state["position"] == 36
    assert (
        sum(
            s["offset"] + 60 * s["pass"] if i == 0 else s["offset"] + 7 * s["pass"]
            for i, s in enumerate(state["sources"])
        )
        == 36
    )


def test_sources_must_agree_on_their_features(tmp_path):
    a = crossfeed.Source(_source(tmp_path, "a", 5, 0, tag=lambda i: f"t{i}"))
    b = crossfeed.Source(_source(tmp_path, "b", 5, 100))
    with crossfeed.Loader([a, b], batch_size=4, return_index=True) as ld:  # the shared features
        batch = next(iter(ld))
        assert set(batch) == {"x", "id", "__source__", "__index__"}
    with pytest.raises(ConfigError, match=r"source 1 .* has no feature 'tag'"):
        crossfeed.Loader([a, b], batch_size=4, features=["tag", "id"])
    # another length of x: the mixture's x is the more general float32[None], each sample its own
    crossfeed.write_dataset(tmp_path / "c", [{"x": np.full(4, 7, np.float32), "id": 1}], num_shards=1).close()
    with crossfeed.Loader([a, crossfeed.Source(tmp_path / "c")], batch_size=6, shuffle="none", return_index=True) as ld:
        assert ld.features[0].shape == (None,)
        batch = next(iter(ld))
    assert [len(x) for x in batch["x"]] == [3 + s for s in batch["__source__"].tolist()]
    for x, s, i in zip(batch["x"], batch["__source__"].tolist(), batch["id"].tolist()):
        np.testing.assert_array_equal(x, np.full(4, 7, np.float32) if s else np.full(3, i, np.float32))
    # a string where the others hold numbers cannot be one feature
    crossfeed.write_dataset(tmp_path / "d", [{"x": "seven", "id": 1}], num_shards=1).close()
    with pytest.raises(ConfigError, match=r"feature 'x' cannot be mixed: the sources decode it to different kinds"):
        crossfeed.Loader([a, crossfeed.Source(tmp_path / "d")], batch_size=4)
    with pytest.raises(ConfigError, match="weight"):
        crossfeed.Source(tmp_path / "a", weight=0)
    with pytest.raises(ConfigError, match="list of crossfeed.Source"):
        crossfeed.Loader([str(tmp_path / "a")], batch_size=4)


def test_an_endless_mixture_resumes_anywhere(two):
    kw = dict(batch_size=8, seed=6, samples_per_epoch=40, return_index=True)
    with crossfeed.Loader(two, **kw) as loader:
        run = loader.epochs(None)
        got = [next(run) for _ in range(23)]  # 4.6 epochs of 5 batches
        state = loader.state_dict()
        more = [next(run) for _ in range(7)]
    assert state["epoch"] == 4 and state["position"] == 24
    with crossfeed.Loader(two, **kw) as again:
        again.load_state_dict(state)
        resumed = [b for _, b in zip(range(7), again.epochs())]
    assert [a.tolist() for a in ids_of(resumed)] == [a.tolist() for a in ids_of(more)]
    assert len(got) == 23
