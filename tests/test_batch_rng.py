"""Per-batch randomness (issue 36 item 5, token pipelines): a ``batch_transform`` whose second
parameter is ``rng`` gets `crossfeed.batch_rng(seed, epoch, global step, rank)` — Philox keyed by
the batch's global step as ``skip=`` and replay count it — so a packed batch's masking draws are
the same through threads, worker processes, any resume, skipped steps and replay
(crossfeed.read.stages.batch.call_batch_transform, Pipeline._stepped)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from token_data import write_tokens

import crossfeed
from crossfeed.errors import ConfigError

LENGTHS = np.arange(1, 90) % 23 + 1
SEED = 2


def mask(batch, rng):
    """MLM-style masking of packed rows: 15% of the tokens, and the raw draws to compare."""
    out = dict(batch)
    out["mask"] = rng.random(np.shape(batch["tokens"])) < 0.15
    out["draw"] = rng.integers(0, 2**31 - 1, (len(batch["tokens"]), 3))  # a row each, int32-safe: JAX
    return out


def no_rng(batch):
    out = dict(batch)
    out["total"] = np.asarray(batch["tokens"]).sum(keepdims=True)
    return out


def masked_sample(sample, rng):
    return sample


def draws(batches) -> list[bytes]:
    return [np.asarray(b["draw"]).tobytes() + np.asarray(b["mask"]).tobytes() for b in batches]


def _bytes(v) -> bytes:
    a = np.asarray(v)
    if a.dtype == object:  # ragged samples: each one's bytes
        return b"|".join(np.asarray(e).tobytes() for e in a)
    return a.tobytes()


def same(a, b) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(_bytes(x[k]) == _bytes(y[k]) for k in x) for x, y in zip(a, b)
    )


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> str:
    return write_tokens(tmp_path_factory.mktemp("batch-rng") / "t", LENGTHS, num_shards=3)


def packed(**more) -> dict:
    return dict(batch_size=2, seed=SEED, pack=crossfeed.Pack(length=32), batch_transform=mask, **more)


def run(path, **opts) -> list[dict]:
    with crossfeed.Loader(path, **opts) as ld:
        return list(ld)


def want_draws(batch: dict, seed: int, epoch: int, step: int, rank: int = 0) -> bool:
    """Whether ``batch`` holds the draws of `crossfeed.batch_rng` of that step (as `mask` draws them)."""
    g = crossfeed.batch_rng(seed, epoch, step, rank)
    m = g.random(np.shape(batch["tokens"])) < 0.15
    return (m == batch["mask"]).all() and (g.integers(0, 2**31 - 1, (len(batch["tokens"]), 3)) == batch["draw"]).all()


@pytest.mark.parametrize("world", [1, 2])
def test_each_packed_batch_gets_its_global_steps_generator(tokens, world):
    """Step j of epoch 1 is global step len(epoch 0) + j; each rank its own generator."""
    first = len(crossfeed.Loader(tokens, world_size=world, rank=0, **packed()))
    per_rank = []
    for rank in range(world):
        got = run(tokens, world_size=world, rank=rank, epoch=1, **packed())
        assert got and all(want_draws(b, SEED, 1, first + j, rank) for j, b in enumerate(got))
        per_rank.append(draws(got))
    if world == 2:  # the ranks' batches of one step draw differently
        assert per_rank[0][0] != per_rank[1][0]


@pytest.mark.slow  # worker processes
def test_threads_and_worker_processes_draw_the_same(tokens):
    want = run(tokens, **packed())
    assert len(want) > 8
    assert same(run(tokens, num_threads=2, **packed()), want)
    assert same(run(tokens, executor="process", processes=2, **packed()), want)


@pytest.mark.slow  # worker processes
def test_batch_by_tokens_and_unpacked_batches_get_their_steps_generator(tokens):
    kw = dict(seed=SEED, batch_transform=mask, epoch=2)
    for opts in (dict(batch_size=1, batch_by_tokens=64), dict(batch_size=4)):
        first = 0  # the earlier epochs' steps summed (batch_by_tokens' epochs differ in steps)
        for e in (0, 1):
            with crossfeed.Loader(tokens, **{**kw, **opts, "epoch": e}) as ld:
                first += len(ld)
        got = run(tokens, **kw, **opts)
        assert got and all(want_draws(b, SEED, 2, first + j) for j, b in enumerate(got)), opts
        assert same(run(tokens, executor="process", processes=2, **kw, **opts), got)


def test_different_steps_epochs_and_seeds_draw_differently(tokens):
    got = draws(run(tokens, **packed()))
    assert len(set(got)) == len(got)  # every step its own draws
    assert draws(run(tokens, epoch=1, **packed()))[0] != got[0]
    assert draws(run(tokens, **{**packed(), "seed": SEED + 1}))[0] != got[0]
    assert draws(run(tokens, **packed()))[0] == got[0]  # and the same run again, the same


def test_a_batch_transform_without_rng_is_called_with_the_batch_alone(tokens):
    kw = dict(batch_size=2, seed=SEED, pack=crossfeed.Pack(length=32))
    plain = run(tokens, **kw)
    got = run(tokens, batch_transform=no_rng, **kw)
    assert same(got, [no_rng(b) for b in plain])


@pytest.mark.slow  # worker processes
def test_skipped_steps_keep_the_other_steps_draws(tokens):
    """Skipped global steps are counted: a kept step draws what it drew without the skip."""
    want = run(tokens, **packed())
    got = run(tokens, skip=crossfeed.Skip(steps=[(2, 4), (7, 8)]), **packed())
    kept = [b for j, b in enumerate(want) if j not in (2, 3, 7)]
    assert same(got, kept)
    assert same(
        run(tokens, skip=crossfeed.Skip(steps=[(2, 4)]), executor="process", processes=2, **packed()),
        [b for j, b in enumerate(want) if j not in (2, 3)],
    )


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stop=st.integers(0, 17), epoch=st.integers(0, 1), threads=st.sampled_from([0, 2]))
def test_a_resume_at_any_step_continues_the_same_draws(tokens, stop, epoch, threads):
    want = run(tokens, epoch=epoch, **packed())
    k = min(stop, len(want))
    with crossfeed.Loader(tokens, epoch=epoch, **packed()) as ld:
        it = iter(ld)
        head = [next(it) for _ in range(k)]
        state = json.loads(json.dumps(ld.state_dict()))
        it.close()
    with crossfeed.Loader(tokens, num_threads=threads, **packed()) as ld:
        ld.load_state_dict(state)
        rest = list(ld)
    assert same(head + rest, want)


def test_replay_builds_the_step_with_its_draws(tokens):
    """`Loader.samples_at(step, built=True)` applies the batch transform with the step's generator."""
    want = run(tokens, epoch=1, **packed())
    with crossfeed.Loader(tokens, **packed()) as ld:
        first = len(ld)
        for j in (0, 5, len(want) - 1):
            assert same([ld.samples_at(first + j, built=True)], [want[j]])
            assert same([ld.samples_at(j, epoch=1, built=True)], [want[j]])


def test_a_batch_built_without_its_step_is_refused_by_name(tokens):
    with crossfeed.Loader(tokens, **packed()) as ld:
        planned = ld.batch_at(3).planned
        with pytest.raises(ConfigError, match="mask takes rng.*without its step"):
            ld.pipeline.build_batch(np.asarray(planned))


def test_a_per_sample_transform_taking_rng_is_refused_for_token_pipelines_naming_the_batch_one(tokens):
    for opts in (dict(pack=crossfeed.Pack(length=32)), dict(batch_size=1, batch_by_tokens=64)):
        with pytest.raises(ConfigError, match=r"per-sample transforms taking rng.*use a batch_transform taking rng"):
            crossfeed.Loader(tokens, **{"batch_size": 2, **opts}, transform=masked_sample)
