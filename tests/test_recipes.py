"""Data recipes (issue 36): filters, per-sample randomness and skips — exact across resume,
ranks, workers and executors (crossfeed.read.stages.recipes, crossfeed.read.skips)."""

from __future__ import annotations

import numpy as np
import pytest
import recipe_helpers as rh
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loader_helpers import assert_resumes_identically, epoch_batches

import crossfeed
from crossfeed import ConfigError, Loader, Skip


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return rh.write(tmp_path_factory.mktemp("recipes") / "d")


def _ids(batches):
    return [np.asarray(b["__index__"]).tolist() for b in batches]


# ---- filters ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "how", [{"filter": rh.keep_even}, {"filter": "recipe_helpers:keep_even"}, {"transform": rh.drop_odd}]
)
def test_a_filter_drops_samples_and_the_rest_of_each_batch_is_unchanged(data, how):
    plain = epoch_batches(data, batch_size=16, seed=3)
    with Loader(data, batch_size=16, seed=3, return_index=True, **how) as ld:
        got = list(ld)
        assert ld.filtered == 60
    assert len(got) == len(plain)  # shorter steps, as many
    for a, b in zip(got, plain):
        assert a["__index__"].tolist() == [i for i in b.tolist() if i % 2 == 0]
        assert (a["label"] % 2 == 0).all() and (a["x"][:, 0] == a["label"]).all()


def test_a_filtered_epoch_resumes_exactly_at_every_batch(data):
    assert_resumes_identically(data, batch_size=16, seed=5, filter=rh.keep_even)


def test_a_batch_whose_samples_are_all_dropped_comes_with_no_rows(data):
    with Loader(data, batch_size=4, shuffle="none", transform=rh.augment_even, filter=rh.drop_most) as ld:
        got = list(ld)
    assert len(got) == 30
    empty = [b for b in got if len(b["label"]) == 0]
    assert empty and all(set(b) == {"x", "label", "noise", "shift"} for b in empty)
    assert sum(len(b["label"]) for b in got) == 12  # labels 0, 10, 20 … 110


def test_the_filter_budget_names_the_filter_and_the_share(data):
    with Loader(data, batch_size=16, filter=rh.drop_most, max_filtered=0.5) as ld:
        with pytest.raises(
            ConfigError, match=r"filter recipe_helpers:drop_most dropped .* \(\d\d\.\d%\).*max_filtered=0\.5"
        ):
            list(ld)
    with Loader(data, batch_size=16, filter=rh.keep_even, max_filtered=0.5) as ld:
        assert sum(len(b["label"]) for b in ld) == 60  # at the budget, not past it
    with pytest.raises(ConfigError, match="max_filtered must be a share"):
        Loader(data, batch_size=16, max_filtered=2)


def test_a_transform_that_returns_neither_a_dict_nor_none_is_named(data):
    with Loader(data, batch_size=8, transform=rh.not_a_dict) as ld:
        with pytest.raises(ConfigError, match="transform recipe_helpers:not_a_dict returned a int"):
            list(ld)


# ---- per-sample randomness ----------------------------------------------------------------------


def _noise(data, **kw):
    kw = {"batch_size": 8, "seed": 11, "return_index": True, "transform": rh.augment, **kw}
    with Loader(data, **kw) as ld:
        return rh.noise_by_id(ld)


def test_each_sample_gets_its_own_generator_keyed_by_seed_epoch_and_id(data):
    got = _noise(data)
    assert len(got) == 120 and len(set(got.values())) == 120
    g = crossfeed.sample_rng(11, 0, 7)
    assert got[7] == g.random(4).tobytes() + np.int64(g.integers(0, 1000)).tobytes()
    assert _noise(data, epoch=1) != got and _noise(data, seed=12) != got
    assert _noise(data, batch_size=5, shuffle="none", num_threads=3) == got  # not the batch, order or threads


def test_the_generators_are_the_same_on_any_rank_and_after_a_resume(data):
    whole = _noise(data)
    ranks = {}
    for r in range(3):
        ranks.update(_noise(data, rank=r, world_size=3, drop_last=True, remainder="pad"))
    assert all(whole[i] == v for i, v in ranks.items())
    with Loader(data, batch_size=8, seed=11, return_index=True, transform=rh.augment) as ld:
        it = iter(ld)
        first = rh.noise_by_id([next(it) for _ in range(5)])
        state = ld.state_dict()
    with Loader(data, batch_size=8, seed=11, return_index=True, transform=rh.augment, world_size=2, rank=1) as ld:
        ld.load_state_dict(state)
        rest = rh.noise_by_id(ld)
    assert all(whole[i] == v for i, v in {**first, **rest}.items())


def test_with_rng_marks_a_transform_whatever_its_parameter_is_called(data):
    def aug(sample, g):
        return rh.augment(sample, g)

    assert _noise(data, transform=crossfeed.with_rng(aug)) == _noise(data)


@pytest.mark.slow
def test_the_process_executor_gives_the_same_samples_byte_for_byte(data):
    threads = _noise(data, transform=rh.augment_even, epoch=2)
    procs = _noise(data, transform="recipe_helpers:augment_even", epoch=2, executor="process", processes=2)
    assert procs == threads and len(threads) == 60
    with Loader(data, batch_size=8, filter="recipe_helpers:keep_even", executor="process", processes=2) as ld:
        assert sum(len(b["label"]) for b in ld) == 60
        assert ld.filtered == 60


# ---- skips --------------------------------------------------------------------------------------


def test_skipped_steps_are_not_yielded_and_the_rest_is_unchanged(data):
    plain = epoch_batches(data, batch_size=8, seed=2)  # 15 steps an epoch
    with Loader(data, batch_size=8, seed=2, return_index=True, skip=Skip(steps=[(3, 5), (14, 18)])) as ld:
        assert len(ld) == 12
        assert ld.global_step() == 0
        got = _ids(ld)
        assert ld.global_step() == 15
        second = _ids(ld)  # epoch 1: its global steps 15, 16, 17 are skipped
    keep = [b.tolist() for i, b in enumerate(plain) if i not in (3, 4, 14)]
    assert got == keep
    assert len(second) == 12


def test_skipped_sample_ids_never_arrive(data, tmp_path):
    plain = epoch_batches(data, batch_size=8, seed=2)
    skipped = {3, 50, 51, 119}
    for skip in (Skip(samples=sorted(skipped)), {"samples": [(0, i) for i in skipped]}):
        got = epoch_batches(data, batch_size=8, seed=2, skip=skip)
        assert [b.tolist() for b in got] == [[i for i in b.tolist() if i not in skipped] for b in plain]
    with pytest.raises(ConfigError, match="index 120 is past its end"):
        Loader(data, batch_size=8, skip=Skip(samples=[120]))
    with pytest.raises(ConfigError, match="source 1 does not exist"):
        Loader(data, batch_size=8, skip=Skip(samples=[(1, 0)]))


def test_a_skip_file_is_read_strictly(data, tmp_path):
    f = tmp_path / "skips.txt"
    f.write_text(
        '# the loss spike of run 7\n3\n0 50\n{"source": 0, "index": 51}\n[0, 119]\nsteps 2 4\n{"steps": [9, 10]}\n'
    )
    s = Skip.of(str(f))
    both = Skip.of({"samples": [7, (0, 8)], "file": f, "steps": [(20, 21)]})  # inline entries join the file's
    assert both.samples[:, 1].tolist() == [3, 7, 8, 50, 51, 119] and both.steps == ((2, 4), (9, 10), (20, 21))
    assert s.steps == ((2, 4), (9, 10)) and s.samples[:, 1].tolist() == [3, 50, 51, 119]
    via_file = epoch_batches(data, batch_size=8, seed=2, skip=f)
    inline = epoch_batches(data, batch_size=8, seed=2, skip=Skip(steps=[(2, 4), (9, 10)], samples=[3, 50, 51, 119]))
    assert [b.tolist() for b in via_file] == [b.tolist() for b in inline]
    for bad, why in (
        ("3\nx y\n", "line 2: 'x' is not an integer"),
        ("1 2 3\n", "line 1: expected"),
        ("steps 5 5\n", "line 1: step range"),
        ("[1,\n", "line 1: not JSON"),
        ("-4\n", "line 1: a sample"),
    ):
        f.write_text(bad)
        with pytest.raises(ConfigError, match=f"skip file {f}, {why}"):
            Skip.of(f)


def test_the_skip_list_is_part_of_the_identity(data):
    kw = {"batch_size": 8, "seed": 2, "return_index": True}
    with Loader(data, skip=Skip(steps=[(3, 5)], samples=[7]), **kw) as ld:
        it = iter(ld)
        for _ in range(6):  # through global step 7 (3 and 4 skipped)
            next(it)
        state = ld.state_dict()
        assert ld.global_step() == 8
        rest = _ids(ld)
    assert state["identity"]["settings"]["skip steps"] == [[3, 5]]
    assert state["identity"]["settings"]["skip samples"].startswith("1 sha256:")
    for other in (Skip(steps=[(3, 5)], samples=[8]), Skip(steps=[(3, 6)], samples=[7]), None):
        with Loader(data, skip=other, **kw) as ld, pytest.raises(ConfigError, match="skip (samples|steps) was"):
            ld.load_state_dict(state)
    # the loss-spike workflow: skip steps that lie after the resume point — allowed, exact
    with Loader(data, skip=Skip(steps=[(3, 5), (10, 12)], samples=[7]), **kw) as ld:
        ld.load_state_dict(state)
        after = _ids(ld)
    assert after == rest[:2] + rest[4:]
    with Loader(data, skip=Skip(steps=[(3, 5), (7, 12)], samples=[7]), **kw) as ld:
        with pytest.raises(ConfigError, match="skip steps was"):
            ld.load_state_dict(state)  # step 7 was delivered already
        ld.load_state_dict(state, on_change="next_epoch")
        assert (ld.epoch, ld.position) == (1, 0)


def test_a_plan_without_a_skip_list_keeps_its_identity(data):
    with Loader(data, batch_size=8) as a, Loader(data, batch_size=8, skip=Skip()) as b:
        assert a.pipeline.identity == b.pipeline.identity
        assert "skip steps" not in a.pipeline.identity.settings
    with Loader(data, batch_size=8) as ld:
        state = ld.state_dict()
    with Loader(data, batch_size=8, skip=Skip(steps=[(5, 6)])) as ld:
        ld.load_state_dict(state)  # adding a future skip to a run that had none


def test_refilled_skips_are_refused_for_token_pipelines_by_name(tmp_path):
    pytest.importorskip("crossfeed.read.stages.pack")
    crossfeed.write_dataset(tmp_path / "t", [{"tokens": list(range(i % 7 + 1))} for i in range(40)]).close()
    with pytest.raises(ConfigError, match="not built for token pipelines"):
        Loader(
            tmp_path / "t",
            batch_size=2,
            pack={"length": 8, "features": ["tokens"]},
            skip=Skip(samples=[1], refill=True),
        )


# ---- properties ---------------------------------------------------------------------------------

RANGES = st.lists(st.tuples(st.integers(0, 40), st.integers(1, 6)).map(lambda t: (t[0], t[0] + t[1])), max_size=4)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ranges=RANGES,
    ids=st.lists(st.integers(0, 119), max_size=12),
    world=st.integers(1, 4),
    workers=st.integers(1, 3),
    stop=st.integers(0, 20),
    epoch=st.integers(0, 2),
)
def test_skips_and_filters_hold_across_ranks_workers_and_resume(data, ranges, ids, world, workers, stop, epoch):
    kw = {
        "batch_size": 4,
        "seed": 9,
        "return_index": True,
        "world_size": world,
        "drop_last": True,
        "skip": Skip(steps=ranges, samples=ids),
        "filter": rh.keep_even,
        "epoch": epoch,
    }
    for rank in range(world):
        with Loader(data, rank=rank, **kw) as ld:
            whole = _ids(ld)
        # DataLoader-style workers: worker w takes the rank's kept batches w, w+K, …
        parts = []
        for w in range(workers):
            with Loader(data, rank=rank, worker=w, num_workers=workers, **kw) as ld:
                parts.append(_ids(ld))
        merged = [parts[j % workers][j // workers] for j in range(len(whole))]
        assert merged == whole
        # the plan's batches: skipped steps gone, skipped ids and odd labels never there
        flat = [i for b in whole for i in b]
        assert not set(flat) & set(ids) and all(i % 2 == 0 for i in flat)
        with Loader(data, rank=rank, **{**kw, "skip": None, "filter": None}) as ld:
            S = len(ld)
            plain = _ids(ld)
        skipped = {s - epoch * S for lo, hi in ranges for s in range(lo, hi)}
        keep = [[i for i in b if i % 2 == 0 and i not in ids] for j, b in enumerate(plain) if j not in skipped]
        assert whole == keep
        # a resume after any batch, under another world size, continues the same stream
        k = min(stop, len(whole))
        with Loader(data, rank=rank, **kw) as ld:
            it = iter(ld)
            for _ in range(k):
                next(it)
            state = ld.state_dict()
        with Loader(data, **{**kw, "world_size": 1, "rank": 0}) as ld:
            ld.load_state_dict(state)
            rest = [i for b in _ids(ld) for i in b]
        if world == 1:
            assert rest == [i for b in whole[k:] for i in b]
        delivered = {i for b in whole[:k] for i in b}
        assert not delivered & set(rest)


def test_a_mixtures_skips_name_a_source_and_its_generators_key_global_ids(tmp_path):
    a, b = rh.write(tmp_path / "a", n=40, shards=2), rh.write(tmp_path / "b", n=80, shards=4)
    mix = [crossfeed.Source(a, weight=1), crossfeed.Source(b, weight=3)]
    kw = {"batch_size": 8, "seed": 4, "return_index": True, "transform": rh.augment}
    skip = Skip(samples=[(0, 3), (1, 3), (1, 79)])
    with Loader(mix, **kw) as ld:
        plain = list(ld)
    with Loader(mix, skip=skip, **kw) as ld:
        got = list(ld)
    gone = {(0, 3), (1, 3), (1, 79)}
    for p, g in zip(plain, got):
        pairs = list(zip(p["__source__"].tolist(), p["__index__"].tolist()))
        assert list(zip(g["__source__"].tolist(), g["__index__"].tolist())) == [x for x in pairs if x not in gone]
        keep = np.array([x not in gone for x in pairs], bool)
        assert g["noise"].tobytes() == p["noise"][keep].tobytes()  # the same draws for the samples left
    first = got[0]
    s, i = int(first["__source__"][0]), int(first["__index__"][0])
    g = crossfeed.sample_rng(4, 0, [0, 40][s] + i)  # a mixture's sample id is global across its sources
    assert first["noise"][0].tobytes() == g.random(4).tobytes()
    with pytest.raises(ConfigError, match=r"source 0 \(.*a\) has 40 samples; index 40 is past its end"):
        Loader(mix, batch_size=8, skip=Skip(samples=[(0, 40)]))


def test_one_sample_at_a_time_a_dropped_sample_is_not_yielded_and_still_counted(data):
    with Loader(data, batch_size=None, seed=6, return_index=True, filter=rh.keep_even) as ld:
        it = iter(ld)
        head = [int(next(it)["__index__"]) for _ in range(10)]
        state = ld.state_dict()
        rest = [int(s["__index__"]) for s in it]
    assert all(i % 2 == 0 for i in head + rest) and len(head + rest) == 60
    with Loader(data, batch_size=None, seed=6, return_index=True, filter=rh.keep_even) as ld:
        ld.load_state_dict(state)
        assert [int(s["__index__"]) for s in ld] == rest


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    world=st.integers(1, 4),
    batch=st.integers(1, 9),
    threads=st.integers(0, 2),
    stop=st.integers(0, 12),
    epoch=st.integers(0, 3),
    shuffle=st.sampled_from(["global", "block", "none"]),
)
def test_every_sample_draws_its_own_generators_numbers_however_it_is_read(
    data, world, batch, threads, stop, epoch, shuffle
):
    kw = {"batch_size": batch, "seed": 21, "return_index": True, "transform": rh.augment, "shuffle": shuffle}
    got = {}  # {(epoch, sample id): its draws}
    for rank in range(world):
        with Loader(data, rank=rank, world_size=world, num_threads=threads, epoch=epoch, **kw) as ld:
            it = iter(ld)
            got.update({(epoch, i): v for i, v in rh.noise_by_id(b for _, b in zip(range(stop), it)).items()})
            state = ld.state_dict()
        with Loader(data, **kw) as ld:  # resumed whole, in another world size (the next epoch, past the end)
            ld.load_state_dict(state)
            e = ld.epoch
            got.update({(e, i): v for i, v in rh.noise_by_id(ld).items()})
    for (e, i), v in got.items():
        g = crossfeed.sample_rng(21, e, i)
        assert v == g.random(4).tobytes() + np.int64(g.integers(0, 1000)).tobytes()


# ---- the per-sample generators' reset -----------------------------------------------------------


def test_the_in_place_reset_is_used_here_and_draws_a_new_philoxs_numbers():
    """This numpy's Philox layout is the one `PhiloxRewind` checks for (the fast reset is in
    use), and a reset after any partial use — a half-spent 32-bit word, a spent buffer, normals —
    draws exactly what a new ``Philox`` of that key draws, for keys across the whole range."""
    from crossfeed.read.stages.recipes import PhiloxRewind

    bg = np.random.Philox(key=np.zeros(2, np.uint64))
    rewind = PhiloxRewind.of(bg)
    assert rewind is not None
    gen = np.random.Generator(bg)
    rng = np.random.default_rng(5)
    for k0, k1 in [(0, 0), (2**64 - 1, 2**64 - 1), *rng.integers(0, 2**63, (40, 2)).tolist()]:
        gen.integers(0, 9, int(rng.integers(0, 7)), dtype=np.uint32)  # leave a half-spent word or not
        gen.standard_normal(int(rng.integers(0, 5)))
        rewind(k0, k1)
        want = np.random.Generator(np.random.Philox(key=np.array([k0, k1], np.uint64)))
        assert (
            gen.integers(0, 2**32, 5, dtype=np.uint32).tobytes()
            == want.integers(0, 2**32, 5, dtype=np.uint32).tobytes()
        )
        assert gen.random(7).tobytes() == want.random(7).tobytes()
        for part in ("counter", "key"):  # where each stands after the draws
            assert np.array_equal(bg.state["state"][part], want.bit_generator.state["state"][part])


@pytest.mark.parametrize("fast", [True, False], ids=["in place", "state setter"])
def test_either_reset_gives_each_sample_its_sample_rng_stream(data, monkeypatch, fast):
    """With the in-place reset or without it (numpy's ``state`` setter, where the layout is not
    the expected one), every sample draws `crossfeed.sample_rng`'s numbers."""
    from crossfeed.read.stages import recipes

    if not fast:
        monkeypatch.setattr(recipes.PhiloxRewind, "of", classmethod(lambda cls, bg: None))
    kw = {"batch_size": 7, "seed": 13, "return_index": True, "transform": rh.augment}
    for epoch in (0, 2):
        with Loader(data, epoch=epoch, **kw) as ld:
            got = rh.noise_by_id(ld)
        for i, v in got.items():
            g = crossfeed.sample_rng(13, epoch, i)
            assert v == g.random(4).tobytes() + np.int64(g.integers(0, 1000)).tobytes()
    rngs = recipes.SampleRngs()
    rng = rngs.keyed(13, 1)
    assert (rngs._local.rewind is not None) is fast
    for i in (0, 5, 2**40):
        assert rng(i).random(3).tobytes() == crossfeed.sample_rng(13, 1, i).random(3).tobytes()


@settings(max_examples=60, deadline=None)
@given(
    skipped=st.lists(st.integers(0, 2**41), max_size=40, unique=True),
    near=st.lists(st.integers(-3, 3), max_size=20),
    far=st.lists(st.integers(0, 2**42), max_size=20),
)
def test_skipped_ids_are_found_alike_in_a_dense_range_and_by_binary_search(skipped, near, far):
    """`SkipIds` looks ids up in a byte per id of a dense range, or by binary search in a sparse
    one: both answer alike for ids inside, at the edges of and outside the range."""
    from crossfeed.read.stages.recipes import SkipIds

    ids = np.sort(np.asarray(skipped, dtype=np.int64))
    small = np.unique(ids % 5000)  # a range of at most 5000 ids: dense
    dense, sparse = SkipIds(small), SkipIds(small)
    sparse._flags = None  # the binary search
    assert (dense._flags is not None) == bool(len(small))
    if len(ids) > 1 and ids[-1] - ids[0] > 2**30:
        assert SkipIds(ids)._flags is None  # a sparse range keeps no bytes per id
    edges = [int(x) + d for x in small.tolist() or [0] for d in near]
    queries = np.asarray(edges + [f % 6000 for f in far] + [-1, 0, 4999, 5000], dtype=np.int64)
    want = ~np.isin(queries, small)
    assert dense.keep(queries).tolist() == want.tolist() == sparse.keep(queries).tolist()
