"""Token-weighted packed mixtures that follow a `crossfeed.Schedule` (``Pack(weights_by="tokens")``):
phases over the documents consumed since training began, each phase's part of an epoch a token
mixture of its own (every prefix within a document of each source's token share), the vectorised
walk equal to the rule one document at a time, exact and elastic resume from the state's cursor,
a phase appended after the documents the state's rows consumed allowed, a begun one refused."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_pack import pieces, same
from token_data import write_tokens

import crossfeed
from crossfeed import Pack, Schedule
from crossfeed.errors import ConfigError
from crossfeed.read.options import Shuffle
from crossfeed.read.stages import pack as packmod
from crossfeed.read.stages.sampler import MixturePhases, PassOrders, ScheduledMixtureOrder, mixture_phases

SETTINGS = settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


def _weights(draw, k: int, span: int) -> list:
    """``k`` weights, each a number, a constant schedule (1–4 phases, weights 0–5) or a ramp."""
    out = []
    for _ in range(k):
        kind = draw(st.sampled_from(["fixed", "constant", "linear"]))
        if kind == "fixed":
            out.append(draw(st.integers(1, 5)))
            continue
        bounds = sorted(set(draw(st.lists(st.integers(1, span), min_size=kind == "linear", max_size=3))))
        points = [(0, draw(st.integers(0, 5)))] + [(b, draw(st.integers(0, 5))) for b in bounds]
        if kind == "constant":
            out.append(Schedule.constant(points))
        else:
            out.append(Schedule.linear(points, every=draw(st.integers(1, 20))))
    return out


def reference_order(phases, mix, lengths, epoch: int, n: int) -> list[tuple[int, int]]:
    """``(source, document)`` of an epoch by the rule one document at a time, written from the
    phases alone: at global document ``g = epoch·n + p`` the phase holding ``g``; its tokens count
    from the phase's start or the epoch's, whichever is later; the source whose
    ``(tokens + 1) · lcm / w`` is least (w > 0) is drawn, the first on ties."""
    k = len(phases[0][1])
    drawn, out = [0] * k, []
    tokens = [0] * k
    starts = [a for a, _ in phases]
    for p in range(n):
        g = epoch * n + p
        j = max(i for i, a in enumerate(starts) if a <= g)
        if p == 0 or g == starts[j]:
            tokens = [0] * k
        w = phases[j][1]
        lcm = math.lcm(*(x for x in w if x))
        keys = [(tokens[s] + 1) * (lcm // w[s]) if w[s] else math.inf for s in range(k)]
        s = keys.index(min(keys))
        doc = int(mix.source_samples(s, epoch * n + drawn[s], 1)[0])
        drawn[s] += 1
        tokens[s] += max(int(lengths(np.array([doc]))[0]), 1)
        out.append((s, doc))
    return out


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_prefix_of_every_phase_holds_each_sources_token_share_within_a_document(data, monkeypatch):
    """On integers, no files: the vectorised walk (chunks of 4–16 documents, cut where a phase
    begins) is the rule one document at a time; in every phase's part of every epoch, over every
    prefix, ``T_s·w_t − T_t·w_s ≤ M·w_t + w_s`` for the phase's weights (``M``: the longest
    document), a source weighted 0 is not drawn; a walk on from any cursor is the rest of it."""
    monkeypatch.setattr(packmod, "FIRST_SCAN", 4)
    monkeypatch.setattr(packmod, "SCAN", 16)
    k = data.draw(st.integers(2, 4), label="sources")
    n = data.draw(st.integers(1, 90), label="documents per epoch")
    weights = _weights(data.draw, k, 3 * n)
    try:
        phases = mixture_phases(weights)
    except ConfigError as e:  # a moment with every weight 0 is refused by name
        assert "every source" in str(e)
        return
    sizes = data.draw(st.lists(st.integers(1, 25), min_size=k, max_size=k), label="sizes")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    lens = np.random.default_rng(seed).integers(0, 40, sum(sizes))
    lengths = lambda ids: lens[np.asarray(ids, dtype=np.int64)]  # noqa: E731
    counts = [np.array([s], dtype=np.int64) for s in sizes]
    plan = MixturePhases(phases)
    passes = PassOrders(counts, seed, Shuffle.GLOBAL)
    longest = max(int(lens.max()), 1)
    for epoch in range(3):
        mix = ScheduledMixtureOrder(counts, plan, n=n, seed=seed, epoch=epoch, shuffle=Shuffle.GLOBAL, passes=passes)
        order = packmod.TokenMixtureOrder(mix)
        chunks = list(packmod._chunks(order, lengths))
        ids = np.concatenate([c[1] for c in chunks])
        src = np.searchsorted(mix.starts, ids, side="right") - 1
        want = reference_order(phases, mix, lengths, epoch, n)
        assert list(zip(src.tolist(), ids.tolist())) == want
        cuts = sorted({0, n} | {a - epoch * n for a, _ in phases if epoch * n < a < (epoch + 1) * n})
        for a, b in zip(cuts, cuts[1:]):
            g = epoch * n + a
            w = np.asarray(phases[max(i for i, (s, _) in enumerate(phases) if s <= g)][1])
            onehot = src[a:b, None] == np.arange(k)[None, :]
            toks = np.cumsum(onehot * np.maximum(lengths(ids[a:b]), 1)[:, None], axis=0)  # (prefix, source)
            assert not onehot[:, w == 0].any()
            live = np.flatnonzero(w)
            for s in live:
                for t in live:
                    assert (toks[:, s] * w[t] - toks[:, t] * w[s] <= longest * w[t] + w[s]).all(), (phases, a)
        # a walk on from the cursor at any chunk's position (or inside one) gives the rest
        j = data.draw(st.integers(0, len(chunks) - 1), label="chunk")
        lo, cids, _, draws = chunks[j]
        i = data.draw(st.integers(0, len(cids)), label="within")
        at = draws.at(i)
        rest = packmod._chunks(order, lengths, lo + i, at if lo + i else ())
        got = np.concatenate([c[1] for c in rest] or [np.zeros(0, np.int64)])
        assert got.tolist() == ids[lo + i :].tolist()


def _roots(tmp_path, sizes, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    out = []
    for s, n in enumerate(sizes):
        ls = rng.integers(0, 30, n)
        ls[0] = max(int(ls[0]), 1)  # a source of empty documents only has no token dtype to write
        out.append(write_tokens(tmp_path / f"s{s}", ls, source=s, num_shards=2))
    return out


@pytest.mark.slow
@SETTINGS
@given(
    seed=st.integers(0, 2**16),
    split=st.sampled_from(["documents", "rows"]),
    world=st.integers(1, 3),
    new_world=st.integers(1, 3),
    data=st.data(),
)
def test_a_scheduled_token_mixture_resumes_at_any_step_exactly_and_elastically(
    tmp_path_factory, seed, split, world, new_world, data
):
    """Two epochs of a scheduled token mixture, per rank; a state after any step of the first rank
    resumes every rank of the same world to the uninterrupted run's batches, and another world
    to the rest of the same rows (every token once)."""
    roots = _roots(tmp_path_factory.mktemp("mix"), (20, 12, 7), seed)
    weights = _weights(data.draw, 3, 120)
    try:
        mixture_phases(weights)
    except ConfigError:
        return
    mix = [crossfeed.Source(r, weight=w) for r, w in zip(roots, weights)]
    opts = dict(batch_size=2, seed=seed, samples_per_epoch=50, pack=Pack(32, weights_by="tokens", split=split))

    def run(w: int, r: int, state=None, epochs: int = 2) -> list[dict]:
        with crossfeed.Loader(mix, world_size=w, rank=r, **opts) as ld:
            if state is not None:
                ld.load_state_dict(state)
            return [b for _ in range(epochs) for b in ld]

    whole = [run(world, r) for r in range(world)]
    assert len({len(x) for x in whole}) == 1  # equal steps per rank
    steps = data.draw(st.integers(0, len(whole[0])), label="steps")
    with crossfeed.Loader(mix, world_size=world, rank=0, **opts) as ld:
        it = ld.epochs(2)
        for _ in range(steps):
            next(it)
        state = json.loads(json.dumps(ld.state_dict()))
    epochs_left = 2 - state["epoch"]
    for r in range(world):
        assert same(run(world, r, state, epochs_left), whole[r][steps:])
    rest = [b for r in range(new_world) for b in run(new_world, r, state, epochs_left)]
    done = [b for per in whole for b in per[:steps]]
    key = lambda bs: sorted(p for b in bs for p in pieces(b))  # noqa: E731
    assert key(done + rest) == key([b for per in whole for b in per])


def _state_at(mix, opts, steps: int) -> dict:
    with crossfeed.Loader(mix, **opts) as ld:
        it = iter(ld)
        for _ in range(steps):
            next(it)
        return json.loads(json.dumps(ld.state_dict()))


@pytest.mark.parametrize("split", ["documents", "rows"])
def test_a_phase_appended_after_the_states_documents_is_allowed_and_a_begun_one_refused(tmp_path, split):
    """The documents a state's rows consumed (`Pipeline.schedule_point`, exact): a phase appended
    there resumes to the run planned with it from the start; one document earlier, or a change to
    the running phase, is refused by name."""
    roots = _roots(tmp_path, (30, 15), 3)
    base = [Schedule.constant([(0, 3), (10, 1)]), Schedule.constant([(0, 1), (10, 3)])]
    opts = dict(batch_size=2, seed=5, samples_per_epoch=60, pack=Pack(32, weights_by="tokens", split=split))
    mix = [crossfeed.Source(r, weight=w) for r, w in zip(roots, base)]
    state = _state_at(mix, opts, 3)
    with crossfeed.Loader(mix, **opts) as ld:
        at = ld.pipeline.schedule_point(state["epoch"], state["position"], state["pack"])
        rows = ld.pipeline.sampler.rows(0, 0, state["position"])
    assert 10 < at < 60
    consumed = {int(d) for d in rows[:, 1]}  # the documents in the rows delivered …
    order = np.concatenate(
        [i for i, _ in packmod.document_chunks(ld.pipeline.sampler.order(0), ld.pipeline.sampler.lengths)]
    )
    assert consumed <= set(order[:at].tolist())  # … all among the first `at` of the plan's order
    assert int(order[at - 1]) in consumed or split == "documents"  # rows: the last one is in the last row

    def appended(where: int) -> list:
        return [crossfeed.Source(roots[0], weight=Schedule.constant([(0, 3), (10, 1), (where, 0)])), mix[1]]

    later = appended(at)
    with crossfeed.Loader(later, **opts) as ld:
        ld.load_state_dict(state)
        got = list(ld)
    with crossfeed.Loader(later, **opts) as ld:
        want = list(ld)
    assert same(got, want[3:])
    with crossfeed.Loader(appended(at - 1), **opts) as ld:
        with pytest.raises(ConfigError, match=rf"adds a phase at sample {at - 1}"):
            ld.load_state_dict(state)
    changed = [crossfeed.Source(roots[0], weight=Schedule.constant([(0, 3), (10, 2)])), mix[1]]
    with crossfeed.Loader(changed, **opts) as ld:
        with pytest.raises(ConfigError, match=r"phase 1 \(from sample 10"):
            ld.load_state_dict(state)


def test_a_source_weighted_0_in_a_phase_brings_no_tokens_there(tmp_path):
    """Two phases over documents 0–29 and 30–59 of one epoch: the new source is absent from the
    first phase's documents and holds its token share of the second's."""
    roots = _roots(tmp_path, (40, 40), 1)
    weights = [Schedule.constant([(0, 1), (30, 1)]), Schedule.constant([(0, 0), (30, 3)])]
    mix = [crossfeed.Source(r, weight=w) for r, w in zip(roots, weights)]
    opts = dict(batch_size=2, seed=0, samples_per_epoch=60, pack=Pack(32, weights_by="tokens"))
    with crossfeed.Loader(mix, **opts) as ld:
        sampler = ld.pipeline.sampler
        ids = np.concatenate([i for i, _ in packmod.document_chunks(sampler.order(0), sampler.lengths)])
        lens = np.maximum(sampler.lengths(ids), 1)
    src = (ids >= 40).astype(int)
    assert not src[:30].any()
    second = np.bincount(src[30:], weights=lens[30:], minlength=2)
    assert abs(second[1] - 0.75 * second.sum()) <= 30  # within a document (of at most 29 tokens) of 3/4
