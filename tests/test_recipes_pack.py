"""Skipped steps of token pipelines (issue 36): ``skip=Skip(steps=...)`` with ``pack=`` (both split
modes) and ``batch_by_tokens=`` — a skipped step's batch is never built, every rank skips the same
global steps, the rest is the unskipped run's, every other token exactly once, and a resume
(with future ranges added, too) continues exactly (crossfeed.read.stages.recipes.StepSkipSampler)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_pack import every_token, lognormal, same, tokens_of
from token_data import write_tokens

import crossfeed
from crossfeed.errors import ConfigError
from crossfeed.read.stages import pack as packmod

LENGTHS = lognormal(160, 24, 1.0, seed=5)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> str:
    return write_tokens(tmp_path_factory.mktemp("skip-pack") / "t", LENGTHS, num_shards=3)


def batches(path, **opts) -> list[dict]:
    with crossfeed.Loader(path, **opts) as ld:
        n = len(ld)
        got = list(ld)
    assert n == len(got)  # len() leaves the skipped steps out
    return got


def skipped(ranges, first: int, count: int) -> set[int]:
    """The epoch's step numbers (0 …) whose global step ``first + b`` lies in ``ranges``."""
    return {b for b in range(count) if any(lo <= first + b < hi for lo, hi in ranges)}


RANGES = st.lists(st.tuples(st.integers(0, 30), st.integers(1, 4)).map(lambda t: (t[0], t[0] + t[1])), max_size=3)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    split=st.sampled_from(["documents", "rows"]),
    ranges=RANGES,
    world=st.integers(1, 3),
    epoch=st.integers(0, 1),
    stop=st.integers(0, 12),
    drop_last=st.booleans(),
)
def test_skipped_packed_steps_leave_the_rest_and_resume_exactly(tokens, split, ranges, world, epoch, stop, drop_last):
    pack = crossfeed.Pack(40, split=split, bins=4)
    kw = dict(batch_size=2, seed=4, pack=pack, world_size=world, drop_last=drop_last, epoch=epoch)
    skip = crossfeed.Skip(steps=ranges)
    first = 0  # the epoch's first global step: the earlier epochs' steps summed
    for e in range(epoch):
        with crossfeed.Loader(tokens, rank=0, **{**kw, "epoch": e}) as ld:
            first += len(ld)
    kept_tokens, all_tokens, gone_tokens = [], [], []
    for rank in range(world):
        plain = batches(tokens, rank=rank, **kw)
        gone = skipped(skip.steps, first, len(plain))
        got = batches(tokens, rank=rank, skip=skip, **kw)
        assert same(got, [b for j, b in enumerate(plain) if j not in gone])
        kept_tokens.append(tokens_of(got))
        all_tokens.append(tokens_of(plain))
        gone_tokens.append(tokens_of([plain[j] for j in sorted(gone)]))
        # a resume after any batch (the state's packed cursor) continues the same kept steps
        k = min(stop, len(got))
        with crossfeed.Loader(tokens, rank=rank, skip=skip, **kw) as ld:
            it = iter(ld)
            for _ in range(k):
                next(it)
            state = json.loads(json.dumps(ld.state_dict()))
            it.close()
        assert "pack" in state
        with crossfeed.Loader(tokens, rank=rank, skip=skip, **kw) as ld:
            ld.load_state_dict(state)
            assert len(ld) == len(got) - k
            assert same(list(ld), got[k:])
    kept, every = np.concatenate(kept_tokens), np.concatenate(all_tokens)
    assert len(np.unique(kept)) == len(kept)  # no token twice
    if not drop_last:
        assert (np.sort(every) == every_token(LENGTHS)).all()
    # the tokens kept are every token but those of the skipped steps' rows, each once
    assert (np.sort(np.concatenate([kept, *gone_tokens])) == np.sort(every)).all()


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stop=st.integers(0, 10), ahead=st.integers(0, 5), width=st.integers(1, 3), world=st.integers(1, 3))
def test_a_future_skip_added_on_resume_is_exact(tokens, stop, ahead, width, world):
    """The loss-spike workflow on packed rows: a state of a run without skips resumes with the
    coming steps skipped; the rest is the uninterrupted run's without them."""
    kw = dict(batch_size=2, seed=1, pack=crossfeed.Pack(40), world_size=world)
    for rank in range(world):
        plain = batches(tokens, rank=rank, **kw)
        k = min(stop, len(plain))
        with crossfeed.Loader(tokens, rank=rank, **kw) as ld:
            it = iter(ld)
            for _ in range(k):
                next(it)
            assert ld.global_step() == k
            state = json.loads(json.dumps(ld.state_dict()))
            it.close()
        lo = k + ahead
        with crossfeed.Loader(tokens, rank=rank, skip=crossfeed.Skip(steps=[(lo, lo + width)]), **kw) as ld:
            ld.load_state_dict(state)
            assert same(list(ld), [b for j, b in enumerate(plain[k:], k) if not lo <= j < lo + width])
    if stop > 0:  # a range reaching back before the resume point changes the past: refused by name
        with crossfeed.Loader(tokens, **{**kw, "world_size": 1, "rank": 0}) as ld:
            it = iter(ld)
            next(it)
            state = ld.state_dict()
            it.close()
        with crossfeed.Loader(tokens, **{**kw, "world_size": 1, "rank": 0}, skip=crossfeed.Skip(steps=[(0, 1)])) as ld:
            with pytest.raises(ConfigError, match="skip steps"):
                ld.load_state_dict(state)


def test_a_skipped_packed_step_is_never_built(tokens, monkeypatch):
    """The builder is handed only the kept steps' batches: a skipped step's documents are not read."""
    kw = dict(batch_size=2, seed=2, pack=crossfeed.Pack(40))
    built = []
    call = packmod.PackBuilder.__call__

    def counted(self, indices, *a, **k):
        built.append(np.asarray(indices).copy())
        return call(self, indices, *a, **k)

    plain = batches(tokens, **kw)
    monkeypatch.setattr(packmod.PackBuilder, "__call__", counted)
    got = batches(tokens, skip=crossfeed.Skip(steps=[(0, 3), (5, 9)]), **kw)
    assert len(built) == len(got) == len(plain) - 7
    assert same(got, plain[3:5] + plain[9:])


@pytest.mark.parametrize("workers", [2, 3])
def test_workers_share_a_ranks_kept_packed_steps(tokens, workers):
    kw = dict(batch_size=2, seed=6, pack=crossfeed.Pack(40, split="rows"), skip=crossfeed.Skip(steps=[(1, 2), (4, 7)]))
    whole = batches(tokens, **kw)
    parts = [batches(tokens, worker=w, num_workers=workers, **kw) for w in range(workers)]
    assert same([parts[j % workers][j // workers] for j in range(len(whole))], whole)


def test_batch_by_tokens_skips_steps_too(tokens):
    kw = dict(batch_size=1, seed=3, batch_by_tokens=96, world_size=2)
    for rank in range(2):
        plain = batches(tokens, rank=rank, **kw)
        got = batches(tokens, rank=rank, skip=crossfeed.Skip(steps=[(2, 4), (len(plain) - 1, len(plain))]), **kw)
        assert same(got, plain[:2] + plain[4:-1])


def test_global_steps_of_packed_epochs_add_up_as_replay_counts_them(tokens):
    """Best-fit epochs differ in rows: epoch 1's first global step is epoch 0's step count, and
    ``batch_at(N)`` of a run names the very step ``Skip(steps=[(N, N + 1)])`` leaves out."""
    kw = dict(batch_size=2, seed=7, pack=crossfeed.Pack(40))
    with crossfeed.Loader(tokens, **kw) as ld:
        e0 = list(ld)
        assert ld.global_step() == len(e0)
        e1 = list(ld)
    N = len(e0) + 2  # epoch 1, its step 2
    with crossfeed.Loader(tokens, **kw) as ld:
        spike = ld.batch_at(N)
        assert (spike.epoch, spike.step) == (1, 2)
        assert same([ld.pipeline.build_batch(spike.planned)], [e1[2]])
    with crossfeed.Loader(tokens, **kw, skip=crossfeed.Skip(steps=[(N, N + 1)])) as ld:
        assert same(list(ld), e0) and same(list(ld), e1[:2] + e1[3:])


def test_token_pipelines_refuse_filters_and_a_dispatchers_walker_builds_kept_steps(tokens):
    """A dispatcher's server walks a packed plan with skipped steps by kept step (`StepSkipWalker`):
    in any order (behind the walk: a re-lease), each the Loader's batch; past the kept ones refused."""
    with pytest.raises(ConfigError, match=r"filter= .* not built for token pipelines"):
        crossfeed.Loader(tokens, batch_size=2, pack=crossfeed.Pack(40), filter=lambda s: True)
    with crossfeed.Loader(tokens, batch_size=2, pack=crossfeed.Pack(40), skip=crossfeed.Skip(samples=[1])) as ld:
        assert len(list(ld)) == len(ld)  # skipped documents are taken (tests/test_recipes_pack_skipids.py)
    kw = dict(batch_size=2, seed=4, pack=crossfeed.Pack(40))
    with crossfeed.Loader(tokens, **kw) as ld:
        n0 = len(ld)  # epoch 0's steps: the second range spans into epoch 1
    with crossfeed.Loader(tokens, **kw, skip=crossfeed.Skip(steps=[(1, 3), (n0 - 1, n0 + 2)])) as ld:
        walker = ld.pipeline.walker()
        for e in (0, 1):
            ld.set_epoch(e)
            want = list(ld)
            assert len(want) == ld.rank_batch_count(0, epoch=e) == (n0 - 3 if e == 0 else len(want))
            order = [0, 2, 1, len(want) - 1, 3, 0]
            assert same([ld.pipeline.builder(walker.batch(e, j)) for j in order], [want[j] for j in order])
            with pytest.raises(ConfigError, match="past the epoch's .* kept steps"):
                walker.batch(e, len(want))
        assert walker.restarts >= 2


@pytest.mark.parametrize("pack", [None, crossfeed.Pack(40)])
def test_a_loader_with_skipped_steps_replays_steps_as_the_trainer_counted_them(tokens, pack):
    kw = dict(batch_size=2, seed=8, pack=pack, features=("tokens",))
    with crossfeed.Loader(tokens, **kw) as ld:
        want = [ld.batch_at(n).keys.tolist() for n in (1, 2, 5)]
    with crossfeed.Loader(tokens, **kw, skip=crossfeed.Skip(steps=[(2, 4)])) as ld:
        assert [ld.batch_at(n).keys.tolist() for n in (1, 2, 5)] == want


def test_a_dispatcher_plans_each_packed_epochs_kept_steps(tokens):
    """The dispatcher's packed plan counts each epoch's kept steps (an epoch of skipped steps only
    counts none), under the packed stride, as the Loader with the same skip list does."""
    from crossfeed.net import run
    from crossfeed.net.lease.book import PACKED_STRIDE
    from crossfeed.read.options import LoaderOptions

    kw = dict(batch_size=2, pack=crossfeed.Pack(40))
    with crossfeed.Loader(tokens, **kw) as ld:
        whole = [ld.rank_batch_count(0, epoch=e) for e in range(3)]
    skip = crossfeed.Skip(steps=[(1, 3), (whole[0], whole[0] + whole[1])])  # epoch 1: every step
    options = LoaderOptions.given(None, dict(kw, skip=skip))
    with run.plan_dispatch(tokens, options, epochs=3) as plan:
        assert plan.packed and plan.batches == PACKED_STRIDE and plan.per_rank == whole[0] - 2
        assert [plan.counts(e) for e in range(3)] == [whole[0] - 2, 0, whole[2]]
