"""Per-sample weights of a mixture's sources (``Loader(mix, weights="NAME")``: each source's set of
that name): within its share of the mixture a source draws its samples over passes of its slot
space, each sample exactly its weight per pass, planned on integers — exact and elastic resume,
the sets pinned by the stream's identity, a source without the set refused by name."""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import crossfeed
from crossfeed import Schedule, Skip, Source
from crossfeed.errors import ConfigError
from crossfeed.format import weights as fw
from crossfeed.read.options import PlanOptions, ShardOptions
from crossfeed.read.stages.sampler import Sampler


def _cum(w) -> fw.CumulativeWeights:
    cum = np.cumsum(np.asarray(w, dtype=np.int64)).astype(fw.DTYPE)
    return fw.CumulativeWeights(cum, int(cum[-1]), "0" * 64, "memory")


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    shuffle=st.sampled_from(["global", "block", "none"]),
    seed=st.integers(0, 2**32),
    epochs=st.integers(1, 3),
)
def test_each_source_draws_every_sample_its_weight_per_pass_of_its_slots(data, shuffle, seed, epochs):
    k = data.draw(st.integers(1, 3), label="sources")
    per_sample = [
        data.draw(st.lists(st.integers(0, 4), min_size=1, max_size=12).filter(lambda w: sum(w) > 0)) for _ in range(k)
    ]
    weighted = [data.draw(st.booleans()) for _ in range(k)]  # a source without weights: None, drawn uniformly
    mix_w = data.draw(st.lists(st.integers(1, 4), min_size=k, max_size=k), label="mixture weights")
    n = data.draw(st.integers(1, 60), label="samples per epoch")
    counts = [[len(w) // 2, len(w) - len(w) // 2] for w in per_sample]
    plan = PlanOptions(batch_size=4, seed=seed, shuffle=shuffle, samples_per_epoch=n)
    owners = [_cum(w) if on else None for w, on in zip(per_sample, weighted)]
    sampler = Sampler(counts, plan, ShardOptions(), weights=mix_w, sample_weights=owners)
    got = np.concatenate([sampler.plan(e).samples for e in range(epochs)])
    plain = Sampler(counts, plan, ShardOptions(), weights=mix_w)
    want_src = np.concatenate([plain.plan(e).samples for e in range(epochs)])
    starts = np.concatenate([[0], np.cumsum([len(w) for w in per_sample])])
    src = np.searchsorted(starts, got, side="right") - 1
    assert (src == np.searchsorted(starts, want_src, side="right") - 1).all()  # the sources' shares unchanged
    for s, w in enumerate(per_sample):
        mine = got[src == s] - starts[s]  # in draw order
        size = sum(w) if weighted[s] else len(w)
        whole = len(mine) // size
        c = np.bincount(mine[: whole * size], minlength=len(w))
        assert c.tolist() == [whole * (x if weighted[s] else 1) for x in w]
        if weighted[s]:
            assert not np.isin(mine, np.flatnonzero(np.asarray(w) == 0)).any()  # weight 0: never drawn


def _source(root, name: str, n: int, offset: int) -> str:
    samples = [{"x": offset + i, "w": i % 3} for i in range(n)]
    crossfeed.write_dataset(root / name, samples, num_shards=2).close()
    crossfeed.write_weights(str(root / name), feature="w")
    return str(root / name)


@pytest.fixture()
def paths(tmp_path):
    return [_source(tmp_path, "a", 12, 0), _source(tmp_path, "b", 9, 100)]


def test_a_weighted_mixture_draws_each_sample_its_weight_and_resumes_exactly_and_elastically(paths):
    mix = [Source(paths[0], weight=8), Source(paths[1], weight=3)]  # 24 draws of a, 9 of b an epoch
    slots = [sum(i % 3 for i in range(12)), sum(i % 3 for i in range(9))]  # 12 and 9: 2 passes, 1 pass
    kw = dict(batch_size=3, weights="w", seed=5, samples_per_epoch=33)
    with crossfeed.Loader(mix, **kw) as ld:
        whole = [b["x"].tolist() for b in ld]
        ident = ld.state_dict()["identity"]["settings"]
    drawn = collections.Counter(x for b in whole for x in b)
    assert drawn == {**{i: 2 * (i % 3) for i in range(12) if i % 3}, **{100 + i: i % 3 for i in range(9) if i % 3}}
    assert sum(drawn[i] for i in range(12)) == 2 * slots[0] and sum(drawn[100 + i] for i in range(9)) == slots[1]
    assert ident["weights"].startswith("w sha256:") and ident["weights"].count(",") == 1
    with crossfeed.Loader(mix, **kw) as ld:
        it = iter(ld)
        head = [next(it)["x"].tolist() for _ in range(3)]  # 9 samples: 24 left, 12 a rank
        state = json.loads(json.dumps(ld.state_dict()))
    with crossfeed.Loader(mix, **kw) as ld:
        ld.load_state_dict(state)
        assert head + [b["x"].tolist() for b in ld] == whole
    rest = []
    for r in range(2):  # another world size: the rest of the same samples
        with crossfeed.Loader(mix, world_size=2, rank=r, **kw) as ld:
            ld.load_state_dict(state)
            rest += [x for b in ld for x in b["x"].tolist()]
    assert sorted(rest) == sorted(x for b in whole[3:] for x in b)


def test_a_scheduled_weighted_mixture_and_refusals_by_name(paths, tmp_path):
    sched = [Source(paths[0], weight=Schedule.constant([(0, 1), (12, 0)])), Source(paths[1], weight=1)]
    with crossfeed.Loader(sched, batch_size=4, weights="w", seed=1, samples_per_epoch=24) as ld:
        xs = [x for b in ld for x in b["x"].tolist()]
    assert all(x >= 100 for x in xs[12:]) and all(x % 100 % 3 for x in xs)  # weight 0 never drawn
    bare = tmp_path / "bare"
    crossfeed.write_dataset(bare, [{"x": i, "w": 1} for i in range(4)]).close()
    with pytest.raises(ConfigError, match=r"bare: no weights set 'w'.*crossfeed weights"):
        crossfeed.Loader([Source(paths[0]), Source(str(bare))], batch_size=2, weights="w")
    with pytest.raises(ConfigError, match="one weights set per source"):
        Sampler([[3], [3]], PlanOptions(batch_size=2), ShardOptions(), weights=[1, 1], sample_weights=_cum([1, 1, 1]))
    state_kw = dict(batch_size=4, seed=5, samples_per_epoch=36)
    mix = [Source(paths[0], weight=2), Source(paths[1], weight=1)]
    with crossfeed.Loader(mix, weights="w", **state_kw) as ld:
        state = ld.state_dict()
    with crossfeed.Loader(mix, **state_kw) as ld, pytest.raises(ConfigError, match="weights was 'w sha256:"):
        ld.load_state_dict(state)


def test_refilled_skips_are_refused_for_a_weighted_mixture_by_name(paths):
    """A mixture whose sources draw by per-sample weights cannot close up around skipped ids (its
    passes run over weight slots, not samples): refused by name, shorter steps still work."""
    mix = [Source(paths[0], weight=1), Source(paths[1], weight=1)]
    with pytest.raises(ConfigError, match="per-sample-weighted plan draws its samples"):
        crossfeed.Loader(mix, batch_size=4, weights="w", skip=Skip(samples=[(0, 1)], refill=True))
    with crossfeed.Loader(mix, batch_size=4, weights="w", seed=2, skip=Skip(samples=[(0, 1)])) as ld:
        assert sum(len(b["x"]) for b in ld) > 0
