"""Mixture schedules (`crossfeed.Schedule`): every prefix of every phase keeps each source within
one sample of its scheduled share, the plan is a pure function of the global sample, and every
Loader property holds — equal steps per rank, exact and elastic resumption at any step — with
appending a phase beyond the resume position allowed and a change to a begun phase refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from loader_helpers import assert_resumes_identically, ids_of

import crossfeed
from crossfeed import Schedule
from crossfeed.errors import ConfigError
from crossfeed.format.schema import SOURCE_KEY
from crossfeed.read.options import PlanOptions, ShardOptions, Shuffle
from crossfeed.read.sources.mixture_file import load_mixture_spec
from crossfeed.read.stages import sampler as plan_mod
from crossfeed.read.stages.sampler import MixturePhases, PassOrders, Sampler, ScheduledMixtureOrder, mixture_phases


def _schedules(draw, k: int) -> list:
    """``k`` weights, each a number or a constant schedule with 1–4 phases (weights 0–5)."""
    out = []
    for _ in range(k):
        if draw(st.booleans()):
            out.append(draw(st.integers(1, 5)))
            continue
        bounds = sorted(set(draw(st.lists(st.integers(1, 120), max_size=3))))
        out.append(Schedule.constant([(0, draw(st.integers(0, 5)))] + [(b, draw(st.integers(0, 5))) for b in bounds]))
    return out


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_every_prefix_of_every_phase_keeps_each_source_within_one_sample(data):
    k = data.draw(st.integers(1, 4))
    weights = _schedules(data.draw, k)
    try:
        phases = mixture_phases(weights)
    except ConfigError as e:  # a moment with every weight 0 is refused by name
        assert "every source" in str(e)
        return
    plan = MixturePhases(phases)
    total = 200
    src, draw = plan.locate(np.arange(total))
    ends = [a for a, _ in phases[1:]] + [total]
    for (start, w), end in zip(phases, ends):
        if start >= total:
            break
        seg = src[start:end]
        counts = np.cumsum(seg[:, None] == np.arange(k)[None, :], axis=0)
        prefix = np.arange(1, len(seg) + 1)[:, None]
        share = np.asarray(w) / sum(w)
        assert np.abs(counts - prefix * share).max() < 1, (phases, start)
        assert not counts[:, np.asarray(w) == 0].any()  # a source weighted 0 is never drawn there
    for s in range(k):  # each source's draws are numbered 0, 1, 2 … in order: no draw twice, none missed
        np.testing.assert_array_equal(draw[src == s], np.arange(int((src == s).sum())))
    # the draws before any sample, as a resume or a state's "sources" computes them
    for g in data.draw(st.lists(st.integers(0, total), max_size=5)):
        np.testing.assert_array_equal(plan.before(g), np.bincount(src[:g], minlength=k))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_an_epoch_is_a_cut_of_the_global_stream_drawn_whole_or_evaluated(data):
    sizes = data.draw(st.lists(st.lists(st.integers(1, 20), min_size=1, max_size=3), min_size=2, max_size=3))
    weights = [Schedule.constant([(0, 1), (data.draw(st.integers(1, 150)), 0)])] + [
        Schedule.constant([(0, 0), (data.draw(st.integers(1, 150)), 2)])
    ] * (len(sizes) - 1)
    n = data.draw(st.integers(1, 90))
    shuffle = data.draw(st.sampled_from(list(Shuffle)))
    plan = MixturePhases(mixture_phases([*weights[:-1], 1]))
    shared = PassOrders([np.asarray(c) for c in sizes], 7, shuffle)
    src_all, draw_all = plan.locate(np.arange(4 * n))
    for epoch in (0, 1, 3):
        whole = ScheduledMixtureOrder(sizes, plan, n=n, seed=7, epoch=epoch, shuffle=shuffle, passes=shared)
        old, plan_mod.TABLE_MAX = plan_mod.TABLE_MAX, 0
        try:
            evaluated = ScheduledMixtureOrder(sizes, plan, n=n, seed=7, epoch=epoch, shuffle=shuffle)
        finally:
            plan_mod.TABLE_MAX = old
        assert whole.materialised and not evaluated.materialised
        got = whole(np.arange(n))
        np.testing.assert_array_equal(got, evaluated(np.arange(n)))
        starts = np.concatenate([[0], np.cumsum([sum(c) for c in sizes])])
        src = np.searchsorted(starts, got, side="right") - 1
        np.testing.assert_array_equal(src, src_all[epoch * n : (epoch + 1) * n])


def test_schedules_are_validated_and_written_as_json():
    s = Schedule.constant([(0, 3), (10, 1)], per_step=8)
    assert s.points == ((0, 3), (80, 1)) and Schedule.from_json(json.loads(json.dumps(s.to_json()))) == s
    lin = Schedule.linear([(0, 1), (10, 3)], every=4)
    assert lin.pieces() == [(0, 1.0), (4, 1.8), (8, 2.6), (10, 3)]
    assert Schedule.from_json(lin.to_json()) == lin and Schedule.from_identity(lin.identity()) == lin
    for bad, match in [
        (lambda: Schedule.constant([(5, 1)]), "starts at sample 0"),
        (lambda: Schedule.constant([(0, 1), (0, 2)]), "increasing"),
        (lambda: Schedule.constant([(0, -1)]), ">= 0"),
        (lambda: Schedule.constant([]), "list of 1 to"),
        (lambda: Schedule.linear([(0, 1), (10, 2)], every=0), "every"),
        (lambda: Schedule.linear([(0, 1), (10**9, 2)], every=1).pieces(), "make every= larger"),
        (lambda: Schedule.from_json({"steps": []}), "constant"),
        (lambda: crossfeed.Source("x/", weight={"constant": [[0, "a"]]}), "weight must be a number"),
    ]:
        with pytest.raises(ConfigError, match=match):
            bad()
    with pytest.raises(ConfigError, match="every source of the mixture is weighted 0"):
        mixture_phases([Schedule.constant([(0, 1), (5, 0)]), Schedule.constant([(0, 0)])])


def test_a_fine_ramp_is_rounded_to_shares_of_a_thousand_and_a_fine_constant_is_refused():
    ramp = Schedule.linear([(0, 1), (7000, 37)], every=700)
    phases = mixture_phases([ramp, Schedule.linear([(0, 50), (7000, 3.3)], every=1000), 7])
    for start, ints in phases:
        a = 1 + 36 * min(start // 700 * 700, 7000) / 7000
        b = 50 + (3.3 - 50) * min(start // 1000 * 1000, 7000) / 7000
        exact = np.array([a, b, 7]) / (a + b + 7)
        assert sum(ints) <= 1000 and np.abs(np.array(ints) / sum(ints) - exact).max() <= 1 / 1000, (start, ints)
    with pytest.raises(ConfigError, match="too fine-grained"):
        mixture_phases([Schedule.constant([(0, 1), (5, 0.997)]), Schedule.constant([(0, 1), (5, 0.331)]), 29])


def test_packing_by_tokens_follows_a_schedule():
    """A token-weighted packed plan takes a schedule (tests/test_token_schedule.py): no refusal."""
    plan = PlanOptions(batch_size=2, pack=crossfeed.Pack(length=8, weights_by="tokens"))
    sampler = Sampler([[4], [4]], plan, ShardOptions(), weights=[Schedule.constant([(0, 1), (8, 2)]), 1])
    assert sampler.phases is not None and [a for a, _ in sampler.phases.phases] == [0, 8]


def _source(root, name: str, n: int, offset: int, shards: int = 2):
    samples = [{"x": np.full(2, offset + i, np.float32), "id": offset + i} for i in range(n)]
    crossfeed.write_dataset(root / name, samples, num_shards=shards).close()
    return root / name


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("sched")
    return _source(root, "broad", 50, 0, shards=3), _source(root, "hq", 9, 1000), _source(root, "new", 6, 2000)


def _mix(paths, broad, hq, new=None):
    out = [crossfeed.Source(paths[0], weight=broad), crossfeed.Source(paths[1], weight=hq)]
    return out + ([crossfeed.Source(paths[2], weight=new)] if new is not None else [])


def _two_phase(paths, at: int = 40):
    """A broad mix, then annealing on the high-quality source; new data brought in at ``at``."""
    return _mix(
        paths,
        Schedule.constant([(0, 3), (at, 1)]),
        Schedule.constant([(0, 1), (at, 3)]),
        Schedule.constant([(0, 0), (at // 2, 1)]),
    )


KW = dict(batch_size=4, seed=3, samples_per_epoch=48, return_index=True)


def test_a_two_phase_mixture_delivers_each_phase_share(paths):
    with crossfeed.Loader(_two_phase(paths), **KW) as ld:
        batches = list(ld) + list(ld)  # two epochs: 96 samples
    src = np.concatenate([b[SOURCE_KEY] for b in batches])
    ids = np.concatenate([b["id"] for b in batches])
    assert not (src[:20] == 2).any() and (src[20:40] == 2).sum() == 4  # phase 1: 3:1:1
    tail = src[40:]  # phase 2 (1:3:1), across the epoch boundary at 48
    counts = np.cumsum(tail[:, None] == np.arange(3)[None, :], axis=0)
    assert np.abs(counts - np.arange(1, len(tail) + 1)[:, None] * np.array([1, 3, 1]) / 5).max() < 1
    assert set(ids[src == 1].tolist()) <= set(range(1000, 1009)) and set(ids[src == 2].tolist()) <= set(
        range(2000, 2006)
    )


@pytest.mark.parametrize("shuffle", ["global", "block", "none"])
def test_a_scheduled_mixture_resumes_identically_from_every_batch(paths, shuffle):
    assert_resumes_identically(_two_phase(paths, at=20), batch_size=5, seed=1, shuffle=shuffle, samples_per_epoch=40)


@settings(max_examples=12, deadline=None)
@given(world=st.integers(1, 4), later=st.integers(1, 4), stop=st.integers(0, 5), at=st.integers(2, 60))
def test_ranks_get_equal_steps_and_resume_elastically_at_any_step(paths, world, later, stop, at):
    kw = dict(KW, remainder="drop")
    mix = _two_phase(paths, at=at)
    with crossfeed.Loader(mix, **kw) as whole:  # one rank: the global order (batch 4 = 4 samples)
        reference = np.concatenate(ids_of(list(whole) + list(whole)))
    got: dict[int, np.ndarray] = {}

    def take(rank_batches: list[list[np.ndarray]], start: int, w: int) -> int:
        """Lay the ranks' strided samples back at their global positions; the samples taken."""
        n = 0
        for r, bs in enumerate(rank_batches):
            flat = np.concatenate(bs) if bs else np.zeros(0, np.int64)
            for j, v in enumerate(flat.tolist()):
                got[start + r + j * w] = v
            n += len(flat)
        return n

    state, firsts = None, []
    for r in range(world):  # `world` ranks take `stop` lockstep steps
        with crossfeed.Loader(mix, rank=r, world_size=world, **kw) as ld:
            assert len(ld) == 48 // world // 4
            it = iter(ld)
            firsts.append(ids_of([next(it) for _ in range(min(stop, len(ld)))]))
            state = ld.state_dict()
    done = take(firsts, 0, world)
    assert state["position"] == done
    epoch_start = 48
    rests, counts = [], set()
    for r in range(later):  # `later` ranks finish the epoch from rank 0's state, then one more epoch
        with crossfeed.Loader(mix, rank=r, world_size=later, **kw) as ld:
            ld.load_state_dict(state)
            rests.append(ids_of(ld))
            counts.add(len(rests[-1]))
    assert len(counts) == 1  # equal steps per rank
    take(rests, done, later)
    for pos, v in got.items():
        assert v == reference[pos], (pos, world, later, stop)
    assert all(p < epoch_start for p in got)


def test_appending_a_phase_beyond_the_resume_position_is_allowed(paths):
    base = _mix(paths, Schedule.constant([(0, 3), (40, 1)]), Schedule.constant([(0, 1), (40, 3)]))
    more = _mix(paths, Schedule.constant([(0, 3), (40, 1), (72, 2)]), Schedule.constant([(0, 1), (40, 3), (60, 0)]))
    with crossfeed.Loader(base, **KW) as ld:
        it = iter(ld)
        seen = ids_of([next(it) for _ in range(12)])  # 48 samples: the whole first epoch
        for _ in it:
            pass
        it = iter(ld)
        seen += ids_of([next(it) for _ in range(2)])  # epoch 1, position 8: global sample 56
        state = ld.state_dict()
    drawn = np.bincount(np.concatenate(seen) // 10**9, minlength=2)  # where each source stands
    assert [s["pass"] * n + s["offset"] for s, n in zip(state["sources"], (50, 9))] == drawn.tolist()
    with crossfeed.Loader(more, **KW) as ld:
        ld.load_state_dict(state)  # the phases from sample 60 on are new: allowed
        rest = ids_of(ld)
    with crossfeed.Loader(more, **KW) as fresh:  # the same as planning the new schedule from the start
        want = ids_of(list(fresh) + list(fresh))
    np.testing.assert_array_equal(np.concatenate(seen + rest), np.concatenate(want))
    src = np.concatenate(want) // 10**9
    assert not (src[60:72] == 1).any()  # the appended phase: hq weighted 0 from sample 60
    # a resume before the appended phases: also allowed (they are in its future)
    with crossfeed.Loader(more, **KW) as ld:
        ld.load_state_dict({**state, "epoch": 0, "position": 44})


@pytest.mark.parametrize(
    "broad, hq, match",
    [
        ([(0, 3), (40, 2)], [(0, 1), (40, 3)], r"phase 1 \(from sample 40, weights \[1, 3\]\) began.*weights \[2, 3\]"),
        ([(0, 3), (30, 1)], [(0, 1), (30, 3)], r"phase 1 \(from sample 40"),
        ([(0, 3), (40, 1), (50, 2)], [(0, 1), (40, 3)], "adds a phase at sample 50"),
    ],
)
def test_changing_a_phase_that_began_is_refused_by_name(paths, broad, hq, match):
    base = _mix(paths, Schedule.constant([(0, 3), (40, 1)]), Schedule.constant([(0, 1), (40, 3)]))
    with crossfeed.Loader(base, **KW) as ld:
        ld.start_at(1, 8)  # global sample 56
        state = ld.state_dict()
    with crossfeed.Loader(_mix(paths, Schedule.constant(broad), Schedule.constant(hq)), **KW) as ld:
        with pytest.raises(ConfigError, match=match):
            ld.load_state_dict(state)
    with crossfeed.Loader(_mix(paths, 3, 1), **KW) as ld:  # fixed weights plan otherwise: refused
        with pytest.raises(ConfigError, match="source 0 weight was"):
            ld.load_state_dict(state)


def test_a_linear_ramp_is_a_step_function_of_every_samples(paths):
    ramp = Schedule.linear([(0, 0), (40, 4)], every=8)
    with crossfeed.Loader(_mix(paths, 4, ramp), **dict(KW, samples_per_epoch=80)) as ld:
        src = np.concatenate([b[SOURCE_KEY] for b in ld])
    assert not (src[:8] == 1).any()
    for lo, w in [(8, 0.8), (16, 1.6), (24, 2.4), (32, 3.2), (40, 4)]:  # weights 4 : w, phase by phase
        seg = src[lo : lo + 8] if lo < 40 else src[40:]
        share = np.cumsum(seg == 1) - np.arange(1, len(seg) + 1) * w / (4 + w)
        assert np.abs(share).max() < 1, lo


def test_a_mixture_file_takes_a_schedule(paths, tmp_path):
    spec = tmp_path / "mix.json"
    spec.write_text(
        json.dumps(
            {
                "sources": [
                    {"path": str(paths[0]), "weight": {"constant": [[0, 3], [40, 1]]}},
                    {"path": str(paths[1]), "weight": {"linear": [[0, 1], [40, 3]], "every": 8}},
                ],
                "samples_per_epoch": 48,
            }
        )
    )
    sources, n = load_mixture_spec(spec)
    assert sources[0].weight == Schedule.constant([(0, 3), (40, 1)]) and n == 48
    assert crossfeed.Source.from_json(sources[1].to_json()) == sources[1]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"sources": [{"path": str(paths[0]), "weight": {"constant": [[3, 1]]}}]}))
    with pytest.raises(ConfigError, match="source 0: a schedule starts at sample 0"):
        load_mixture_spec(bad)


def test_a_packed_scheduled_mixture_packs_the_scheduled_documents_and_resumes(tmp_path):
    """``pack=`` over a scheduled mixture (weights by documents): the rows hold exactly the
    documents the unpacked scheduled plan draws, each whole, once per draw; a resume at any step
    with another world size delivers the rest; a phase after the documents the state's rows
    consumed may be appended on resume, a change to a begun one is refused."""
    from test_pack import pieces
    from token_data import source_doc_pos, write_tokens

    rng = np.random.default_rng(0)
    roots = [
        write_tokens(tmp_path / f"s{s}", rng.integers(1, 20, n), source=s, num_shards=2) for s, n in enumerate((15, 6))
    ]
    weights = [Schedule.constant([(0, 3), (24, 1)]), Schedule.constant([(0, 1), (24, 3)])]
    mix = [crossfeed.Source(r, weight=w) for r, w in zip(roots, weights)]
    plan = dict(seed=4, samples_per_epoch=40)
    with crossfeed.Loader(mix, batch_size=40, features=["tokens"], **plan) as ld:
        (drawn,) = list(ld)
    want = sorted(tuple(int(x[0]) for x in source_doc_pos(np.ravel(t)[:1])[:2]) for t in drawn["tokens"])
    opts = dict(batch_size=2, pack=crossfeed.Pack(32), **plan)
    with crossfeed.Loader(mix, **opts) as ld:
        whole = list(ld)
    assert sorted((s, d) for b in whole for s, d, _, _ in pieces(b)) == want
    for steps in (0, 3, len(whole)):
        with crossfeed.Loader(mix, **opts) as ld:
            it = iter(ld)
            done = [next(it) for _ in range(steps)]
            state = ld.state_dict()
        rest = []
        for r in range(2):
            with crossfeed.Loader(mix, world_size=2, rank=r, **opts) as ld:
                ld.load_state_dict(state)
                rest += list(ld)
        assert sorted((s, d) for b in done + rest for s, d, _, _ in pieces(b)) == want
    later = [crossfeed.Source(r, weight=Schedule.constant([(0, 3), (24, 1), (70, 2)])) for r in roots[:1]]
    later.append(crossfeed.Source(roots[1], weight=weights[1]))
    with crossfeed.Loader(later, **opts) as ld:
        ld.load_state_dict(state)  # the epoch's 40 documents all consumed: a phase at 70 is in the future
    changed = [crossfeed.Source(roots[0], weight=Schedule.constant([(0, 3), (24, 2)])), later[1]]
    with crossfeed.Loader(changed, **opts) as ld:
        with pytest.raises(ConfigError, match=r"phase 1 \(from sample 24"):
            ld.load_state_dict(state)


@pytest.mark.slow
def test_worker_processes_build_a_scheduled_mixture_alike(paths):
    """``executor="process"``: the workers rebuild the sources from JSON, schedules and all."""
    mix = _two_phase(paths, at=20)
    with crossfeed.Loader(mix, **KW) as ld:
        want = ids_of(list(ld) + list(ld))
    with crossfeed.Loader(mix, executor="process", processes=2, **KW) as ld:
        got = ids_of(list(ld) + list(ld))
    assert len(got) == len(want) == 24
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
