"""Sequence packing and length-aware batching (`crossfeed.read.stages.pack`): every token of an
epoch exactly once across ranks and workers, the same rows for the same seed, exact resumption at
any batch and elastic resumption at another world size or worker count, mixtures, the padding
goal, and the errors. Tokens name themselves (`token_data.token`), so a row tells where each of
its tokens came from."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from token_data import add_lengths, repin_lengths, source_doc_pos, token, write_tokens

import crossfeed
from crossfeed.errors import ConfigError, IndexFileError
from crossfeed.format.manifest import MANIFEST
from crossfeed.read.options import LoaderOptions, Pack, PackSplit
from crossfeed.read.stages.pack import packed_rows

SETTINGS = settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


class ArrayOrder:
    """An epoch order over ``n`` documents from an array (what `EpochOrder` is to the packer)."""

    sequential = False  # any position evaluated on its own (the order contract)

    def __init__(self, ids):
        self.ids = np.asarray(ids, dtype=np.int64)
        self.n = len(self.ids)

    def __call__(self, positions):
        return self.ids[positions]


def lognormal(n: int, mean: float, sigma: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.maximum(1, rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, n)).astype(np.int64)


def pieces(batch: dict) -> list[tuple[int, int, int, int]]:
    """``(source, document, first token, count)`` of each piece in a packed batch, checked: a
    segment is one run of consecutive tokens of one document, numbered 1, 2 … in its row, with
    positions 0 … count-1; padding is ``pad_id`` 0, segment 0."""
    out = []
    seg, pos, tok = batch["segment_ids"], batch["positions"], batch["tokens"]
    assert seg.dtype == pos.dtype == np.int32 and seg.shape == pos.shape == tok.shape
    for r in range(len(tok)):
        ids = seg[r]
        assert (tok[r][ids == 0] == 0).all() and (pos[r][ids == 0] == 0).all()
        used = ids[ids > 0]
        assert (np.diff(ids[: len(used)]) >= 0).all() and (ids[len(used) :] == 0).all()  # padding at the end
        for s in range(1, int(ids.max(initial=0)) + 1):
            cols = np.flatnonzero(ids == s)
            assert len(cols) and (np.diff(cols) == 1).all()
            src, doc, i = source_doc_pos(tok[r][cols])
            assert (src == src[0]).all() and (doc == doc[0]).all()
            assert (pos[r][cols] == np.arange(len(cols))).all() and (i == i[0] + np.arange(len(cols))).all()
            out.append((int(src[0]), int(doc[0]), int(i[0]), len(cols)))
    return out


def tokens_of(batches) -> np.ndarray:
    return np.concatenate([b["tokens"][b["segment_ids"] > 0] for b in batches] or [np.zeros(0, np.int64)])


def every_token(lengths, source: int = 0, *, longest: int | None = None) -> np.ndarray:
    return np.sort(
        np.concatenate(
            [token(source, d, np.arange(n)) for d, n in enumerate(lengths) if longest is None or n <= longest]
            or [np.zeros(0, np.int64)]
        )
    )


def rank_batches(path, world: int, workers: int = 1, **opts) -> list[list[dict]]:
    """Every rank's batches of one epoch, each rank read by ``workers`` Loaders interleaved as a
    DataLoader does (batch b from worker b % workers)."""
    out = []
    for r in range(world):
        per = []
        for w in range(workers):
            with crossfeed.Loader(path, rank=r, world_size=world, worker=w, num_workers=workers, **opts) as ld:
                per.append(list(ld))
        n = sum(map(len, per))
        out.append([per[b % workers][b // workers] for b in range(n)])
    return out


def same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all((x[k] == y[k]).all() for k in x) for x, y in zip(a, b))


# ---- the packing on integers --------------------------------------------------------------------


def test_best_fit_meets_the_padding_goal_on_log_normal_lengths():
    """L=2048, log-normal lengths of mean 600: best-fit in 32 open rows pads under 2%, concatenate
    and chunk pads only the last row; a greedy packer that never looks back (bins=1) pads far more."""
    lens = lognormal(20000, 600, 1.0)
    total = int(lens.sum())

    def padding(**kw) -> float:
        rows = list(packed_rows(ArrayOrder(np.arange(len(lens))), lambda ids: lens[ids], Pack(2048, **kw)))
        assert sum(c for row in rows for _, _, c, _ in row) == total
        return 1 - total / (len(rows) * 2048)

    best, greedy, chunks = padding(), padding(bins=1), padding(split="rows")
    assert best < 0.02 < 0.1 < greedy
    assert chunks < 2048 / total


@settings(max_examples=300, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 130), max_size=60),
    length=st.integers(1, 40),
    bins=st.integers(1, 5),
    drop=st.booleans(),
    cuts=st.lists(st.integers(0, 60), max_size=4),
    resume=st.booleans(),
)
def test_best_fit_a_chunk_at_a_time_packs_exactly_the_rules_rows(lengths, length, bins, drop, cuts, resume):
    """`_BestFitChunks` (the walk's packer: a chunk of documents at a time, pieces laid out in
    numpy) gives exactly the rows of `_BestFit` (the rule, one document at a time), whatever the
    chunks, when restarted from its state at every chunk's end (a cursor), long documents,
    documents of exactly a row or none, dropped or split."""
    from crossfeed.read.stages.pack import _BestFit, _BestFitChunks

    lens = np.asarray(lengths, dtype=np.int64)
    ref, want = _BestFit(length, bins), []
    for d, n in enumerate(lengths):
        if not (drop and n > length):
            ref.add(d, n, want)
    want += ref.flush()
    ids = np.arange(len(lens)) * 7 + 3
    packer, done, blocks = _BestFitChunks.at(length, bins), 0, []
    bounds = sorted({0, len(lens), *[min(c, len(lens)) for c in cuts]})
    for a, b in zip(bounds, bounds[1:]):
        if resume:
            packer = _BestFitChunks.at(length, bins, packer.state())
        rows, block = packer.add(ids[a:b], lens[a:b], drop, done)
        done, blocks = done + rows, blocks + [block]
    rows, block = packer.flush(done)
    got: list[list] = [[] for _ in range(done + rows)]
    for r, doc, start, count, n in np.concatenate(blocks + [block]).tolist():
        got[r].append(((doc - 3) // 7, start, count, n))
    assert got == [list(row) for row in want]


# ---- every token once, across ranks and workers -------------------------------------------------


@SETTINGS
@given(
    lengths=st.lists(st.integers(0, 70), min_size=1, max_size=40).filter(any),
    seed=st.integers(0, 2**20),
    world=st.integers(1, 3),
    workers=st.integers(1, 2),
    batch=st.integers(1, 3),
    length=st.integers(8, 40),
    split=st.sampled_from(["documents", "rows"]),
    shuffle=st.sampled_from(["global", "block", "none"]),
)
def test_every_token_once_across_ranks_and_workers(
    tmp_path_factory, lengths, seed, world, workers, batch, length, split, shuffle
):
    path = write_tokens(tmp_path_factory.mktemp("tok"), lengths, num_shards=2)
    pack = Pack(length, split=split, bins=3)
    ranks = rank_batches(path, world, workers, batch_size=batch, seed=seed, shuffle=shuffle, pack=pack)
    assert len({len(r) for r in ranks}) == 1  # equal steps on every rank
    for per in ranks:
        for b in per:
            assert b["tokens"].shape == (batch, length)
            pieces(b)
    got = np.sort(tokens_of([b for per in ranks for b in per]))
    assert got.tolist() == every_token(lengths).tolist()
    with crossfeed.Loader(
        path, rank=0, world_size=world, batch_size=batch, seed=seed, shuffle=shuffle, pack=pack
    ) as ld:
        assert len(ld) == len(ranks[0])
        assert same(list(ld), ranks[0])  # the same seed: the same rows


def test_long_documents_split_or_drop(tmp_path):
    lengths = [5, 40, 3, 17, 100, 0, 9]
    path = write_tokens(tmp_path / "t", lengths)
    for long, want in (("split", every_token(lengths)), ("drop", every_token(lengths, longest=16))):
        with crossfeed.Loader(path, batch_size=2, pack=Pack(16, long=long)) as ld:
            got = list(ld)
        assert np.sort(tokens_of(got)).tolist() == want.tolist()
        cut = [p for b in got for p in pieces(b) if p[1] in (1, 4)]
        assert (len(cut) > 2) == (long == "split")


def test_documents_stay_whole_unless_longer_than_a_row(tmp_path):
    lengths = lognormal(120, 20, 0.8, seed=3)
    lengths = np.minimum(lengths, 64)
    path = write_tokens(tmp_path / "t", lengths)
    with crossfeed.Loader(path, batch_size=4, seed=1, pack=Pack(64)) as ld:
        got = [p for b in ld for p in pieces(b)]
    assert sorted((d, n) for _, d, _, n in got) == sorted(enumerate(lengths.tolist()))
    with crossfeed.Loader(path, batch_size=4, seed=1, pack=Pack(64, split="rows")) as ld:
        rows = [p for b in ld for p in pieces(b)]
    assert len(rows) > len(lengths)  # concatenate and chunk cuts documents at row ends


# ---- resumption ---------------------------------------------------------------------------------


@SETTINGS
@given(
    lengths=st.lists(st.integers(1, 50), min_size=1, max_size=40),
    seed=st.integers(0, 2**20),
    world=st.integers(1, 3),
    new_world=st.integers(1, 4),
    new_workers=st.integers(1, 2),
    split=st.sampled_from(["documents", "rows"]),
    data=st.data(),
)
def test_resume_at_any_batch_exactly_and_elastically(
    tmp_path_factory, lengths, seed, world, new_world, new_workers, split, data
):
    path = write_tokens(tmp_path_factory.mktemp("tok"), lengths, num_shards=3)
    opts = dict(batch_size=2, seed=seed, pack=Pack(24, split=split, bins=4))
    whole = rank_batches(path, world, **opts)
    steps = data.draw(st.integers(0, len(whole[0])), label="steps")
    with crossfeed.Loader(path, rank=0, world_size=world, **opts) as ld:  # one rank's state resumes every rank
        it = iter(ld)
        for _ in range(steps):
            next(it)
        state = ld.state_dict()
    json.dumps(state)
    for r in range(world):  # the same world size: the same batches
        with crossfeed.Loader(path, rank=r, world_size=world, **opts) as ld:
            ld.load_state_dict(state)
            assert len(ld) == len(whole[r]) - steps
            assert same(list(ld), whole[r][steps:])
    rest = []
    for r in range(new_world):  # another world size and worker count: the rest of the epoch, each token once
        for w in range(new_workers):
            with crossfeed.Loader(path, rank=r, world_size=new_world, worker=w, num_workers=new_workers, **opts) as ld:
                ld.load_state_dict(state)
                rest += list(ld)
    done = [b for per in whole for b in per[:steps]]
    got = np.sort(np.concatenate([tokens_of(done), tokens_of(rest)]))
    assert got.tolist() == every_token(lengths).tolist()


def test_a_fresh_process_resumes_mid_document_and_mid_row(tmp_path):
    lengths = [90, 7, 33, 61, 12, 48, 5, 77]
    path = write_tokens(tmp_path / "t", lengths)
    opts = dict(batch_size=1, seed=5, pack=Pack(32, split="rows"))
    with crossfeed.Loader(path, **opts) as ld:
        first = list(ld)
        assert ld.epoch == 1
    cut = [p for p in pieces(first[3]) if p[2] > 0]
    assert cut  # the row starts inside a document: the resume point is mid-document
    with crossfeed.Loader(path, start=(0, 3), **opts) as ld:
        assert same(list(ld), first[3:])


def test_epochs_differ_and_state_carries_the_epoch(tmp_path):
    path = write_tokens(tmp_path / "t", list(range(1, 40)))
    opts = dict(batch_size=2, seed=3, pack=Pack(32))
    with crossfeed.Loader(path, **opts) as ld:
        e0, e1 = list(ld), list(ld)
        assert ld.state_dict()["epoch"] == 2
    assert not same(e0, e1) and np.sort(tokens_of(e0)).tolist() == np.sort(tokens_of(e1)).tolist()
    with crossfeed.Loader(path, epoch=1, **opts) as ld:
        assert same(list(ld), e1)


# ---- mixtures -----------------------------------------------------------------------------------


@SETTINGS
@given(
    sizes=st.tuples(st.integers(1, 25), st.integers(1, 25)),
    weights=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    seed=st.integers(0, 2**20),
    world=st.integers(1, 3),
    per_epoch=st.integers(5, 60),
    data=st.data(),
)
def test_a_packed_mixture_has_exact_document_shares_and_resumes(
    tmp_path_factory, sizes, weights, seed, world, per_epoch, data
):
    """The packed rows of a mixture hold exactly the documents the unpacked mixture plan draws
    (so each source's share is exact), whole, once per draw; resumption elastic and exact."""
    rng = np.random.default_rng(seed)
    roots, lens = [], []
    for s, n in enumerate(sizes):
        lens.append(rng.integers(1, 30, n))
        roots.append(write_tokens(tmp_path_factory.mktemp(f"src{s}"), lens[-1], source=s, num_shards=2))
    mix = [crossfeed.Source(r, weight=w) for r, w in zip(roots, weights)]
    plan = dict(seed=seed, samples_per_epoch=per_epoch)
    with crossfeed.Loader(mix, batch_size=per_epoch, features=["tokens"], **plan) as ld:
        (drawn,) = list(ld)
    want = sorted(tuple(int(x[0]) for x in source_doc_pos(np.ravel(t)[:1])[:2]) for t in drawn["tokens"])
    opts = dict(batch_size=2, pack=Pack(32), **plan)
    whole = rank_batches(mix, world, **opts)
    got = sorted((s, d) for per in whole for b in per for s, d, _, _ in pieces(b))
    assert got == want  # every drawn document once per draw (documents shorter than a row stay whole)
    steps = data.draw(st.integers(0, len(whole[0])), label="steps")
    new_world = data.draw(st.integers(1, 3), label="new_world")
    with crossfeed.Loader(mix, world_size=world, rank=0, start=(0, 0), **opts) as ld:
        it = iter(ld)
        for _ in range(steps):
            next(it)
        state = ld.state_dict()
    rest = []
    for r in range(new_world):
        with crossfeed.Loader(mix, world_size=new_world, rank=r, **opts) as ld:
            ld.load_state_dict(state)
            rest += list(ld)
    done = [b for per in whole for b in per[:steps]]
    assert sorted((s, d) for b in done + rest for s, d, _, _ in pieces(b)) == want


@pytest.mark.slow
@SETTINGS
@given(
    sizes=st.tuples(st.integers(1, 12), st.integers(1, 12)),
    weights=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    seed=st.integers(0, 2**20),
    world=st.integers(1, 3),
    per_epoch=st.integers(20, 60),
    data=st.data(),
)
def test_a_mixture_weighted_by_tokens_has_token_shares_and_resumes(
    tmp_path_factory, sizes, weights, seed, world, per_epoch, data
):
    """``weights_by="tokens"``: short documents in one source, long ones in the other; after the
    epoch each source's tokens are within a document of its share (``T_s/w_s - T_t/w_t <= M/w_s
    + 1/w_t``, which counting documents misses by far), each source's documents are a pass
    (none twice before all once), the same seed gives the same rows, and resumption at any batch,
    at the same or another world size, delivers the rest exactly (every token once)."""
    rng = np.random.default_rng(seed)
    roots, lens = [], []
    for s, n in enumerate(sizes):
        lens.append(rng.integers(1, 4, n) if s == 0 else rng.integers(20, 31, n))
        roots.append(write_tokens(tmp_path_factory.mktemp(f"src{s}"), lens[-1], source=s, num_shards=2))
    mix = [crossfeed.Source(r, weight=w) for r, w in zip(roots, weights)]
    opts = dict(batch_size=2, seed=seed, samples_per_epoch=per_epoch, pack=Pack(32, weights_by="tokens"))
    whole = rank_batches(mix, world, **opts)
    toks = [0, 0]
    counts = [np.zeros(n, np.int64) for n in sizes]
    for per in whole:
        for b in per:
            for s, d, first, n in pieces(b):
                assert first == 0 and n == lens[s][d]  # documents shorter than a row stay whole
                toks[s] += n
                counts[s][d] += 1
    assert sum(int(c.sum()) for c in counts) == per_epoch
    longest = 30
    for s, t in ((0, 1), (1, 0)):
        assert toks[s] * weights[t] - toks[t] * weights[s] <= longest * weights[t] + weights[s]
    for c in counts:
        assert c.max() - c.min() <= 1
    with crossfeed.Loader(mix, rank=0, world_size=world, **opts) as ld:
        assert same(list(ld), whole[0])
    steps = data.draw(st.integers(0, len(whole[0])), label="steps")
    new_world = data.draw(st.integers(1, 3), label="new_world")
    with crossfeed.Loader(mix, world_size=world, rank=0, **opts) as ld:
        it = iter(ld)
        for _ in range(steps):
            next(it)
        state = ld.state_dict()
    for r in range(world):
        with crossfeed.Loader(mix, world_size=world, rank=r, **opts) as ld:
            ld.load_state_dict(state)
            assert same(list(ld), whole[r][steps:])
    rest = []
    for r in range(new_world):
        with crossfeed.Loader(mix, world_size=new_world, rank=r, **opts) as ld:
            ld.load_state_dict(state)
            rest += list(ld)
    done = [b for per in whole for b in per[:steps]]
    assert np.sort(tokens_of(done + rest)).tolist() == np.sort(tokens_of([b for per in whole for b in per])).tolist()


def test_token_weights_need_a_mixture_and_differ_from_document_weights(tmp_path):
    """One source: the same rows either way; a mixture of short and long documents at equal
    weights: counting tokens draws far more short documents than counting documents."""
    short = write_tokens(tmp_path / "s", [2] * 10, source=0)
    long = write_tokens(tmp_path / "l", [20] * 10, source=1)
    with crossfeed.Loader(short, batch_size=2, pack=Pack(16, weights_by="tokens")) as a:
        with crossfeed.Loader(short, batch_size=2, pack=Pack(16)) as b:
            assert same(list(a), list(b))
    mix = [crossfeed.Source(short), crossfeed.Source(long)]
    shares = {}
    for by in ("documents", "tokens"):
        with crossfeed.Loader(mix, batch_size=2, samples_per_epoch=22, pack=Pack(32, weights_by=by)) as ld:
            srcs = [s for b in ld for s, _, _, _ in pieces(b)]
        shares[by] = srcs.count(0)
    assert shares["documents"] == 11 and shares["tokens"] == 20


# ---- batch_by_tokens ----------------------------------------------------------------------------


@SETTINGS
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=50),
    seed=st.integers(0, 2**20),
    world=st.integers(1, 3),
    workers=st.integers(1, 2),
    budget=st.integers(30, 200),
    new_world=st.integers(1, 3),
    data=st.data(),
)
def test_batch_by_tokens_keeps_the_budget_equal_steps_and_resumes(
    tmp_path_factory, lengths, seed, world, workers, budget, new_world, data
):
    path = write_tokens(tmp_path_factory.mktemp("tok"), lengths, num_shards=2)
    opts = dict(batch_size=1, seed=seed, batch_by_tokens=budget)
    ranks = rank_batches(path, world, workers, **opts)
    assert len({len(r) for r in ranks}) == 1
    for step in zip(*ranks):
        assert len({b["tokens"].shape for b in step}) == 1  # one shape per step on every rank
        for b in step:
            rows, width = b["tokens"].shape
            assert rows * width <= budget or rows == 1
            assert all(p[2] == 0 and p[3] == lengths[p[1]] for p in pieces(b))  # whole documents
    assert np.sort(tokens_of([b for r in ranks for b in r])).tolist() == every_token(lengths).tolist()
    steps = data.draw(st.integers(0, len(ranks[0])), label="steps")
    with crossfeed.Loader(path, world_size=world, rank=0, **opts) as ld:
        it = iter(ld)
        for _ in range(steps):
            next(it)
        state = ld.state_dict()
    with crossfeed.Loader(path, world_size=world, rank=world - 1, **opts) as ld:
        ld.load_state_dict(state)
        assert same(list(ld), ranks[world - 1][steps:])
    rest = []
    for r in range(new_world):
        with crossfeed.Loader(path, world_size=new_world, rank=r, **opts) as ld:
            ld.load_state_dict(state)
            rest += list(ld)
    done = [b for r in ranks for b in r[:steps]]
    assert np.sort(tokens_of(done + rest)).tolist() == every_token(lengths).tolist()


# ---- where lengths come from, and what goes wrong -----------------------------------------------


def test_without_lengths_files_the_lengths_are_decoded_once(tmp_path, caplog):
    lengths = lognormal(60, 25, 1.0, seed=4)
    a = write_tokens(tmp_path / "a", lengths)
    b = write_tokens(tmp_path / "b", lengths, with_lengths=False)
    opts = dict(batch_size=3, seed=9, pack=Pack(48))
    with crossfeed.Loader(a, **opts) as la, crossfeed.Loader(b, **opts) as lb:
        assert same(list(la), list(lb))
    assert "no lengths files for 'tokens'" in caplog.text


def test_a_decoded_length_that_differs_from_the_plan_names_shard_record_and_lengths_file(tmp_path):
    root = write_tokens(tmp_path / "t", [5, 6, 7, 8], num_shards=1)
    name = repin_lengths(root, [5, 6, 9, 8])
    with crossfeed.Loader(root, batch_size=4, pack=Pack(64), shuffle="none") as ld:
        with pytest.raises(IndexFileError) as e:
            list(ld)
    msg = str(e.value)
    assert name in msg and "record at byte offset" in msg and f"{name}.len" in msg and "has 7 values" in msg


def test_a_missing_or_tampered_lengths_file_is_named(tmp_path):
    root = write_tokens(tmp_path / "t", [5, 6, 7, 8], num_shards=2)
    with open(os.path.join(root, MANIFEST)) as f:
        first = json.load(f)["splits"]["train"]["shards"][0]["file"]
    lenfile = os.path.join(root, first + ".len")
    with open(lenfile, "r+b") as f:
        f.write(b"\x01")
    with (
        crossfeed.Loader(root, batch_size=2, pack=Pack(8)) as ld,
        pytest.raises(IndexFileError, match="lengths_sha256"),
    ):
        list(ld)
    os.remove(lenfile)
    with crossfeed.Loader(root, batch_size=2, pack=Pack(8)) as ld, pytest.raises(IndexFileError, match="missing"):
        list(ld)


def test_what_packing_refuses(tmp_path):
    root = write_tokens(tmp_path / "t", [3, 4])
    for bad, match in (
        (dict(transform="options_helpers:keep"), "batch_transform"),
        (dict(return_index=True), "return_index"),
        (dict(features=["x"]), "leave features= out"),
        (dict(pack=Pack(8, features=("nope",))), "nope"),
    ):
        with pytest.raises(ConfigError, match=match):
            crossfeed.Loader(root, batch_size=2, **{"pack": Pack(8), **bad})
    other = tmp_path / "fixed"
    crossfeed.write_dataset(other, [{"tokens": 3}] * 2).close()
    with pytest.raises(ConfigError, match="not a list of numbers"):
        crossfeed.Loader(other, batch_size=2, pack=Pack(8))
    with pytest.raises(ConfigError, match="which feature holds the tokens"):
        crossfeed.Loader(write_tokens(tmp_path / "n", [3], with_lengths=False), batch_size=1, batch_by_tokens=8)


def test_pack_options_are_validated_and_travel_as_json():
    opts = LoaderOptions.of(batch_size=2, pack={"length": 16, "features": ["tokens", "mask"], "split": "rows"})
    assert opts.plan.pack == Pack(16, features=("tokens", "mask"), split=PackSplit.ROWS)
    assert LoaderOptions.of(**json.loads(json.dumps(opts.flat()))) == opts
    assert LoaderOptions.from_plan(opts.plan_fields(), LoaderOptions.of(batch_size=1)).plan.pack == opts.plan.pack
    for bad, match in (
        (dict(pack=Pack(16), batch_by_tokens=100), "not both"),
        (dict(pack={"length": 0}), "pack length"),
        (dict(pack={"length": 8, "features": "tokens"}), "list of feature names"),
        (dict(pack={"length": 8, "features": ["segment_ids"]}), "segment_ids"),
        (dict(pack={"length": 8, "long": "wrap"}), "pack long"),
        (dict(pack={"length": 8, "split": "bytes"}), "pack split"),
        (dict(pack={"length": 8, "weights_by": "bytes"}), "weights_by"),
        (dict(pack={"length": 8, "segments": "no"}), "segments"),
        (dict(pack={"length": 8, "colour": 1}), "colour"),
        (dict(pack=2048), "crossfeed.Pack"),
        (dict(batch_by_tokens=0), "batch_by_tokens"),
    ):
        with pytest.raises(ConfigError, match=match):
            LoaderOptions.of(batch_size=2, **bad)


def test_process_workers_build_the_same_packed_batches(tmp_path):
    path = write_tokens(tmp_path / "t", lognormal(50, 20, 1.0, seed=2))
    opts = dict(batch_size=2, seed=1, pack=Pack(40))
    with crossfeed.Loader(path, **opts) as a, crossfeed.Loader(path, executor="process", processes=2, **opts) as b:
        assert same(list(a), [{k: np.array(v) for k, v in x.items()} for x in b])


@pytest.mark.parametrize("split", ["rows", "documents"])
@pytest.mark.parametrize("executor", ["thread", "process"])
def test_segments_false_delivers_the_same_rows_without_segment_ids(tmp_path, split, executor):
    path = write_tokens(tmp_path / "t", lognormal(60, 20, 1.0, seed=3))
    opts = dict(batch_size=3, seed=1, executor=executor)
    with crossfeed.Loader(path, pack=Pack(32, split=split), **opts) as ld:
        want = list(ld)
    with crossfeed.Loader(path, pack=Pack(32, split=split, segments=False), **opts) as ld:
        got = list(ld)
    assert len(got) == len(want) > 2
    for g, w in zip(got, want):
        assert list(g) == ["tokens"] and g["tokens"].dtype == w["tokens"].dtype
        assert (np.asarray(g["tokens"]) == w["tokens"]).all()
    assert Pack.of(Pack(8, segments=False).to_json()) == Pack(8, segments=False)


def test_two_features_pack_together_and_pad_with_pad_id(tmp_path):
    docs = [{"tokens": token(0, d, np.arange(n)).tolist(), "mask": [d % 2] * n} for d, n in enumerate([3, 9, 4, 6])]
    crossfeed.write_dataset(tmp_path / "t", docs, num_shards=2).close()
    add_lengths(str(tmp_path / "t"), ("tokens", "mask"))
    with crossfeed.Loader(tmp_path / "t", batch_size=2, pack=Pack(12, features=("tokens", "mask"), pad_id=-1)) as ld:
        got = list(ld)
    for b in got:
        assert (b["tokens"][b["segment_ids"] == 0] == -1).all() and (b["mask"][b["segment_ids"] == 0] == -1).all()
        real = b["segment_ids"] > 0
        assert (b["mask"][real] == source_doc_pos(b["tokens"][real])[1] % 2).all()


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_packed_batches_are_timed_like_any_other(tmp_path, executor):
    root = write_tokens(tmp_path / "d", [5, 9, 30, 2, 17, 8, 40, 3])
    extra = {"executor": "process", "processes": 1} if executor == "process" else {"num_threads": 1}
    with crossfeed.Loader(root, batch_size=2, pack=crossfeed.Pack(length=16), **extra) as loader:
        delivered = sum(1 for _ in loader)
        stats = loader.stats()
    assert stats.batches == delivered > 0
    assert stats.stages["decode"].count == delivered and stats.stages["batch"].count == delivered


def test_bench_measures_a_packed_loader(tmp_path):
    from typer.testing import CliRunner

    from crossfeed.cli.main import app

    root = write_tokens(tmp_path / "d", [5, 9, 30, 2, 17, 8, 40, 3] * 4)
    result = CliRunner().invoke(app, ["bench", root, "--pack-length", "16", "--batch-size", "2", "--batches", "4"])
    assert result.exit_code == 0, result.output
    assert "verdict" in result.output and "decode" in result.output


def test_opening_a_first_batch_and_a_state_mid_epoch_do_not_walk_the_whole_epoch(tmp_path, monkeypatch):
    """The plan walks lengths only as far as it needs: the epoch's row count (`epoch_total`,
    one walk of every length: minutes at 10^8 documents) is never asked to open, to deliver the
    first batches, to save a state or to resume one mid-epoch; only ``len()`` asks for it."""
    from crossfeed.read.stages.pack import PackSampler

    path = write_tokens(tmp_path / "t", lognormal(300, 20, 1.0, seed=4))
    opts = dict(batch_size=2, seed=1, pack=Pack(32))
    with crossfeed.Loader(path, **opts) as ld:
        whole = list(ld)

    def whole_walk(self, epoch):
        raise AssertionError("walked the whole epoch")

    monkeypatch.setattr(PackSampler, "epoch_total", whole_walk)
    with crossfeed.Loader(path, **opts) as ld:
        it = iter(ld)
        first = [next(it), next(it)]
        state = ld.state_dict()
        it.close()
    assert same(first, whole[:2]) and state["position"] == 4
    with crossfeed.Loader(path, **opts) as ld:
        ld.load_state_dict(state)
        assert same([next(iter(ld))], whole[2:3])
        with pytest.raises(AssertionError, match="whole epoch"):
            len(ld)


def test_the_builders_runs_of_padding_and_positions_past_the_views_it_keeps():
    """A batch's padding and positions are views of one row, kept by length up to `KEEP`; a length
    asked for after that is cut from the row all the same (right bytes, not kept)."""
    from crossfeed.read.stages.pack import _Prefixes

    row = np.arange(10, dtype=np.int32).tobytes()
    runs = _Prefixes(row, 4)
    runs.KEEP = 2
    for n in (3, 0, 7, 10, 3):
        assert bytes(runs[n]) == row[: 4 * n]
    assert sorted(runs) == [0, 3]  # the first two lengths kept, the rest cut each time
