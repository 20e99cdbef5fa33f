"""Packed resume in O(bins + batch): a packed state carries the packer's cursor (its open rows and
where it stands in the documents), so a resume — at the same or another world size — a
dispatcher's re-lease and "which documents are in row R" walk on from a cursor, never from the
epoch's start; the cursor is checked strictly when a state is loaded (issue 33)."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_pack import every_token, lognormal, same, tokens_of
from token_data import write_tokens

import crossfeed
from crossfeed.errors import ConfigError
from crossfeed.read.options import Pack
from crossfeed.read.stages import pack as packmod
from crossfeed.read.stages.pack import DocLengths, packed_rows

SETTINGS = settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 4, then up to 16 documents: a small epoch has cursors all along it."""
    monkeypatch.setattr(packmod, "FIRST_SCAN", 4)
    monkeypatch.setattr(packmod, "SCAN", 16)


class Reads:
    """What the lengths source was asked for: the shards whose lengths files were loaded (and
    their bytes) and the documents whose lengths were looked up."""

    def __init__(self, monkeypatch):
        self.shards: dict[tuple[int, int], int] = {}
        self.ids: list[int] = []
        load, call = DocLengths._load, DocLengths.__call__

        def counted_load(lengths, s, k):
            got = load(lengths, s, k)
            self.shards[(s, k)] = int(got.nbytes)
            return got

        def counted_call(lengths, ids):
            self.ids += np.asarray(ids, dtype=np.int64).tolist()
            return call(lengths, ids)

        monkeypatch.setattr(DocLengths, "_load", counted_load)
        monkeypatch.setattr(DocLengths, "__call__", counted_call)


def state_after(path, steps: int, **opts) -> tuple[dict, list[dict]]:
    """The state after ``steps`` batches, and the batches."""
    with crossfeed.Loader(path, **opts) as ld:
        it = iter(ld)
        got = [next(it) for _ in range(steps)]
        state = ld.state_dict()
        it.close()
    return json.loads(json.dumps(state)), got


@pytest.mark.parametrize("split", ["documents", "rows"])
def test_a_resume_far_into_the_epoch_reads_no_lengths_before_it(tmp_path, monkeypatch, small_chunks, split):
    """40 shards, read in order (shuffle="none"): a state saved near the epoch's end resumes
    without loading the lengths file of any shard before its cursor (0 bytes), and looks up no
    document before it but those its open rows carry; the batches are an uninterrupted run's."""
    shards, per = 40, 60
    lengths = lognormal(shards * per, 40, 1.0, seed=7)
    path = write_tokens(tmp_path / "t", lengths, num_shards=shards)
    opts = dict(batch_size=2, seed=0, shuffle="none", pack=Pack(64, split=split, bins=8))
    with crossfeed.Loader(path, **opts) as ld:
        whole = list(ld)
    steps = len(whole) * 9 // 10
    state, _ = state_after(path, steps, **opts)
    cursor = state["pack"]
    carried = [p[0] for row in cursor["open"] for p in row]
    first = min([cursor["documents"], *carried])  # the earliest document the resume may need (ids = positions here)
    assert cursor["documents"] > 0.8 * len(lengths) and cursor["rows"] <= state["position"]
    assert len(cursor["open"]) <= 8 and (split == "documents" or not cursor["open"])
    reads = Reads(monkeypatch)
    with crossfeed.Loader(path, **opts) as ld:
        ld.load_state_dict(state)
        rest = [next(iter(ld))]
    assert same(rest, whole[steps : steps + 1])
    with crossfeed.open_dataset(path) as ds:
        starts = np.asarray(ds["train"].starts)
    before = [k for k in range(shards) if starts[k + 1] <= first]
    assert len(before) >= 0.7 * shards
    assert sum(b for (_, k), b in reads.shards.items() if k in before) == 0, "read a lengths file before the cursor"
    assert set(i for i in reads.ids if i < cursor["documents"]) <= set(carried)
    assert len(reads.ids) <= len(carried) + 4 * packmod.SCAN  # a chunk or two past the cursor, twice (check, plan)


@SETTINGS
@given(
    lengths=st.lists(st.integers(1, 60), min_size=1, max_size=160),
    seed=st.integers(0, 2**20),
    split=st.sampled_from(["documents", "rows"]),
    long=st.sampled_from(["split", "drop"]),
    data=st.data(),
)
def test_resumes_walk_on_from_the_cursor_exactly_and_elastically(
    tmp_path_factory, small_chunks, lengths, seed, split, long, data
):
    """2 ranks save a state at any batch; resuming it at 2 ranks gives each rank the rest of its
    uninterrupted run, at 3 ranks every remaining token exactly once — and a resume's walk starts
    at the state's cursor, not at the epoch's start."""
    path = write_tokens(tmp_path_factory.mktemp("tok"), lengths, num_shards=3)
    opts = dict(batch_size=2, seed=seed, pack=Pack(24, split=split, bins=3, long=long))
    whole = []
    for r in range(2):
        with crossfeed.Loader(path, rank=r, world_size=2, **opts) as ld:
            whole.append(list(ld))
    steps = data.draw(st.integers(0, len(whole[0])), label="steps")
    state, _ = state_after(path, steps, rank=0, world_size=2, **opts)
    cursor = state["pack"]
    assert cursor["rows"] <= state["position"] and len(cursor["open"]) <= 3
    walked = []
    real = packmod.walk

    def recorded(order, lengths, pack, cursor=None):
        walked.append(None if cursor is None else cursor.key)
        return real(order, lengths, pack, cursor)

    mp = pytest.MonkeyPatch()
    mp.setattr(packmod, "walk", recorded)
    try:
        for r in range(2):
            with crossfeed.Loader(path, rank=r, world_size=2, **opts) as ld:
                ld.load_state_dict(state)
                assert same(list(ld), whole[r][steps:])
    finally:
        mp.undo()
    assert walked and all(w is not None and w >= (cursor["rows"], cursor["documents"]) for w in walked)
    rest = []
    for r in range(3):
        with crossfeed.Loader(path, rank=r, world_size=3, **opts) as ld:
            ld.load_state_dict(state)
            rest += list(ld)
    done = [b for per in whole for b in per[:steps]]
    got = np.sort(np.concatenate([tokens_of(done), tokens_of(rest)]))
    assert got.tolist() == every_token(lengths, longest=24 if long == "drop" else None).tolist()


def test_which_documents_are_in_row_r_and_a_re_lease_walk_on_from_a_cursor(tmp_path, small_chunks):
    lengths = lognormal(400, 30, 1.0, seed=3)
    path = write_tokens(tmp_path / "t", lengths, num_shards=4)
    pack = Pack(48, bins=4)
    with crossfeed.Loader(path, batch_size=3, seed=2, pack=pack) as ld:
        sampler = ld.pipeline.sampler
        every = list(packed_rows(sampler.order(0), sampler.lengths, pack))
        walker = ld.pipeline.walker()
        forward = [walker.batch(0, b) for b in range(12)]
        again = walker.batch(0, 5)  # behind the walk: a server died, its batch leased again
        assert walker.restarts == 1 and (again == forward[5]).all()
        assert sampler.marks(0).best(15).rows > 0  # … walked on from a cursor near it, not from row 0
        for lo in (0, 7, 40, len(every) - 2):
            got = sampler.rows(0, lo, lo + 2)
            want = [(r, *p) for r in range(lo, min(lo + 2, len(every))) for p in every[r]]
            assert [tuple(x) for x in got.tolist()] == want


def test_len_of_a_rows_epoch_is_exact_without_a_walk(tmp_path, monkeypatch):
    lengths = lognormal(500, 30, 1.0, seed=5)
    path = write_tokens(tmp_path / "t", lengths, num_shards=3)
    for long in ("split", "drop"):
        opts = dict(batch_size=3, seed=4, world_size=2, rank=1, pack=Pack(40, split="rows", long=long))
        with crossfeed.Loader(path, **opts) as ld:
            want = len(list(ld))

        def no_walk(*a, **k):
            raise AssertionError("walked")

        with monkeypatch.context() as m:
            m.setattr(packmod, "walk", no_walk)
            with crossfeed.Loader(path, **opts) as ld:
                assert len(ld) == want


# ---- a state crosses a trust boundary -----------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    lengths = lognormal(600, 30, 1.0, seed=9)
    path = write_tokens(tmp_path_factory.mktemp("tok"), lengths, num_shards=3)
    out = {}
    for split in ("documents", "rows"):
        opts = dict(batch_size=2, seed=1, pack=Pack(64, split=split, bins=4))
        with crossfeed.Loader(path, **opts) as ld:
            n = len(ld)
        out[split] = (path, opts, state_after(path, n * 2 // 3, **opts)[0])
    return out


def _load(path, opts, state):
    with crossfeed.Loader(path, **opts) as ld:
        ld.load_state_dict(state)
        return next(iter(ld))


def _tampered(state, change) -> dict:
    state = copy.deepcopy(state)
    change(state["pack"])
    return state


@pytest.mark.parametrize(
    "change, field",
    [
        (
            lambda c: c["open"].extend([[[0, 0, 1, 1]]] * 5),
            r"pack\.open: \d+ open rows, more than the packing's bins=4",
        ),
        (lambda c: c["open"][0][0].__setitem__(0, 10**9), r"pack\.open\[0\]\[0\]\[0\] \(document\)"),
        (lambda c: c["open"][0][0].__setitem__(0, -1), r"pack\.open\[0\]\[0\]\[0\] \(document\)"),
        (lambda c: c["open"][0][0].__setitem__(1, c["open"][0][0][3]), r"pack\.open\[0\]\[0\]\[1\] \(start\)"),
        (lambda c: c["open"][0][0].__setitem__(2, 0), r"pack\.open\[0\]\[0\]\[2\] \(count\)"),
        (lambda c: c["open"][0][0].__setitem__(3, c["open"][0][0][3] + 1), r"pack\.open\[0\]\[0\]\[3\] \(length\)"),
        (lambda c: c["open"][0].append([1, 0, 63, 1000]), r"pack\.open\[0\]: holds \d+ tokens"),
        (lambda c: c["open"][0][0].__setitem__(0, "7"), r"pack\.open\[0\]\[0\]\[0\].*expected an integer"),
        (lambda c: c["open"].__setitem__(0, []), r"pack\.open\[0\]: expected a non-empty list"),
        (lambda c: c.__setitem__("documents", 10**6), r"pack\.documents: 1000000 is outside"),
        (lambda c: c.__setitem__("offset", 3), r"pack\.offset"),
        (lambda c: c.__setitem__("extra", 1), r"pack\.extra"),
        (lambda c: c.__setitem__("open", "rows"), r"pack\.open: expected a list"),
    ],
)
def test_a_tampered_best_fit_cursor_is_refused_naming_the_field(saved, change, field):
    path, opts, state = saved["documents"]
    assert state["pack"]["open"], "the saved cursor has open rows to tamper with"
    with pytest.raises(ConfigError, match=field):
        _load(path, opts, _tampered(state, change))


def test_a_tampered_rows_cursor_is_refused_naming_the_field(saved):
    path, opts, state = saved["rows"]
    with pytest.raises(ConfigError, match=r"pack\.open: split=\"rows\" carries no open rows"):
        _load(path, opts, _tampered(state, lambda c: c.__setitem__("open", [[[0, 0, 1, 1]]])))
    with pytest.raises(ConfigError, match=r"pack\.offset: .* is not inside document"):
        _load(path, opts, _tampered(state, lambda c: c.__setitem__("offset", 10**6)))
    with pytest.raises(ConfigError, match=r"pack: expected an object"):
        _load(path, opts, dict(state, pack=[1, 2]))


def test_older_states_resume_and_newer_ones_are_refused_by_version(saved):
    path, opts, state = saved["documents"]
    want = _load(path, opts, state)
    old = {k: v for k, v in state.items() if k != "pack"} | {"version": 2}  # saved before cursors: walks from the start
    assert same([_load(path, opts, old)], [want])
    with pytest.raises(ConfigError, match="version 2 state carries no packed cursor"):
        _load(path, opts, dict(state, version=2))
    with pytest.raises(ConfigError, match="version 4 is not one this crossfeed reads"):
        _load(path, opts, dict(state, version=4))
    elsewhere = _tampered(state, lambda c: c.__setitem__("epoch", 5))  # another epoch's cursor: not used
    assert same([_load(path, opts, elsewhere)], [want])


# ---- token-weighted mixtures: planned in numpy, resumed from their draws ------------------------


def reference_token_order(order, lengths) -> list[int]:
    """The token mixture's rule one document at a time (as first written): the source whose
    ``(tokens + 1) · lcm / w`` is smallest, the first on ties."""
    mix, steps = order.mix, order.steps
    keys, drawn, out = list(steps), [0] * len(steps), []
    for _ in range(order.n):
        s = keys.index(min(keys))
        doc = int(mix.source_samples(s, order.epoch * order.n + drawn[s], 1)[0])
        drawn[s] += 1
        keys[s] += max(int(lengths(np.array([doc]))[0]), 1) * steps[s]
        out.append(doc)
    return out


@SETTINGS
@given(
    sizes=st.lists(st.integers(1, 30), min_size=2, max_size=3),
    weights=st.lists(st.integers(1, 5), min_size=3, max_size=3),
    seed=st.integers(0, 2**16),
    per_epoch=st.integers(1, 150),
    epoch=st.integers(0, 2),
    split=st.sampled_from(["documents", "rows"]),
    data=st.data(),
)
def test_a_token_mixture_is_planned_in_numpy_and_resumes_from_its_draws(
    tmp_path_factory, small_chunks, sizes, weights, seed, per_epoch, epoch, split, data
):
    """The vectorised order (one lexsort a chunk) is the per-document rule's, documents of length
    0 included; a state carries each source's draws, so a resume walks on from them (never from
    the epoch's start) and gives the uninterrupted run's rows."""
    rng = np.random.default_rng(seed)
    lengths = [rng.integers(0, 40, n) for n in sizes]
    for ls in lengths:  # a source of empty documents only has no token dtype to write: give it one token
        ls[0] = max(int(ls[0]), 1)
    roots = [write_tokens(tmp_path_factory.mktemp(f"s{s}"), ls, source=s, num_shards=2) for s, ls in enumerate(lengths)]
    mix = [crossfeed.Source(r, weight=w) for r, w in zip(roots, weights)]
    opts = dict(batch_size=2, seed=seed, samples_per_epoch=per_epoch, pack=Pack(32, weights_by="tokens", split=split))
    with crossfeed.Loader(mix, epoch=epoch, **opts) as ld:
        sampler = ld.pipeline.sampler
        order = sampler.order(epoch)
        got = np.concatenate([ids for ids, _ in packmod.document_chunks(order, sampler.lengths)]).tolist()
        assert got == reference_token_order(order, sampler.lengths)
        whole = list(ld)
    steps = data.draw(st.integers(0, len(whole)), label="steps")
    with crossfeed.Loader(mix, epoch=epoch, **opts) as ld:
        it = iter(ld)
        for _ in range(steps):
            next(it)
        state = json.loads(json.dumps(ld.state_dict()))
    cursor = state["pack"]
    assert sum(d for d, _ in cursor.get("mixture", [])) == cursor["documents"]
    starts = []
    real = packmod.TokenMixtureOrder.walk

    def recorded(self, lengths, start=None):
        starts.append(start)
        return real(self, lengths, start)

    mp = pytest.MonkeyPatch()
    mp.setattr(packmod.TokenMixtureOrder, "walk", recorded)
    try:
        with crossfeed.Loader(mix, **opts) as ld:
            ld.load_state_dict(state)
            assert same(list(ld), whole[steps:])
    finally:
        mp.undo()
    assert cursor["documents"] == 0 or all(s is not None and s[0] >= cursor["documents"] for s in starts)
    if cursor["documents"]:
        bad = copy.deepcopy(state)
        bad["pack"]["mixture"][0][0] += 1
        with pytest.raises(ConfigError, match=r"pack\.mixture"):
            with crossfeed.Loader(mix, **opts) as ld:
                ld.load_state_dict(bad)


def test_dataloader_workers_resume_from_the_states_cursor(tmp_path):
    """`TorchDataset` hands its DataLoader workers the cursor of the state it resumed (a worker
    never walks to the position itself), and 2 workers resume to an uninterrupted run's batches."""
    pytest.importorskip("torch")
    from crossfeed.adapters.torch import StatefulLoader, TorchDataset

    lengths = lognormal(3000, 30, 1.0, seed=11)
    path = write_tokens(tmp_path / "t", lengths, num_shards=4)
    opts = dict(batch_size=2, seed=6, pack=Pack(64, bins=4))
    with crossfeed.Loader(path, **opts) as ld:
        whole = list(ld)
    state, _ = state_after(path, len(whole) * 3 // 4, **opts)
    assert state["pack"]["rows"] > 0
    ds = TorchDataset(path, **opts)
    ds.load_state_dict(state)
    worker = ds._state(state["epoch"], state["position"], ds._loader(1, 2))
    assert worker["pack"] == state["pack"]
    with StatefulLoader(TorchDataset(path, **opts), num_workers=2) as dl:
        dl.load_state_dict(state)
        rest = [{k: v.numpy() for k, v in b.items()} for b in dl]
    want = whole[len(whole) * 3 // 4 :]
    assert len(rest) == len(want)
    assert all((a[k].astype(np.int64) == b[k].astype(np.int64)).all() for a, b in zip(rest, want) for k in b)
    ds.close()


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 300), min_size=0, max_size=300),
    length=st.integers(1, 64),
    bins=st.integers(1, 8),
    long=st.sampled_from(["split", "drop"]),
)
def test_best_fit_rows_lie_within_the_bounds_the_tokens_give(lengths, length, bins, long):
    """⌈T/L⌉ ≤ rows ≤ ⌊2T/L⌋ + bins for best-fit (`PackSampler.rows_bounds`), whatever the lengths."""
    from test_pack import ArrayOrder

    lens = np.asarray(lengths, dtype=np.int64)
    pack = Pack(length, bins=bins, long=long)
    rows = sum(n for n, _ in packmod.row_blocks(ArrayOrder(np.arange(len(lens))), lambda ids: lens[ids], pack))
    tokens = int(lens[lens <= length].sum() if long == "drop" else lens.sum())
    assert -(-tokens // length) <= rows <= 2 * tokens // length + bins


def test_rows_bounds_without_a_walk(tmp_path, monkeypatch):
    lengths = lognormal(400, 50, 1.0, seed=2)
    path = write_tokens(tmp_path / "t", lengths, num_shards=3)
    for split in ("documents", "rows"):
        with crossfeed.Loader(path, batch_size=2, seed=0, pack=Pack(64, split=split)) as ld:
            rows = ld.pipeline.epoch_total(0)
            sampler = ld.pipeline.sampler
            with monkeypatch.context() as m:
                m.setattr(packmod, "walk", lambda *a, **k: pytest.fail("walked"))
                least, most = sampler.rows_bounds(1)
        assert least <= rows <= most and (split == "documents" or least == most == rows)
