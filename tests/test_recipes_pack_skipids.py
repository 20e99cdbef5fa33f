"""Skipped documents of token pipelines (issue 36): ``skip=Skip(samples=[...])`` with ``pack=``
(both split modes), a token-weighted mixture and ``batch_by_tokens=`` — a skipped document is
absent from the plan (its length taken as 0: never read, no tokens, the documents after it
packed on), deterministically across ranks, resume, elastic resume and workers
(crossfeed.read.stages.pack.DocLengths)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_pack import ArrayOrder, every_token, lognormal, same, tokens_of
from token_data import token, write_tokens

import crossfeed
from crossfeed.read.options import Pack
from crossfeed.read.stages import pack as packmod

LENGTHS = lognormal(120, 24, 1.0, seed=11)
LENGTHS[[7, 50]] = 0  # empty documents stay empty (and are not reported)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> str:
    return write_tokens(tmp_path_factory.mktemp("skip-ids") / "t", LENGTHS, num_shards=SHARDS)


@pytest.fixture
def built(monkeypatch) -> list[np.ndarray]:
    """The documents of every packed batch the builder is handed (what it reads)."""
    docs: list[np.ndarray] = []
    call = packmod.PackBuilder.__call__

    def recorded(self, encoded, *a, **k):
        docs.append(np.asarray(encoded[packmod.HEADER :], dtype=np.int64).reshape(-1, packmod.PIECE)[:, 1].copy())
        return call(self, encoded, *a, **k)

    monkeypatch.setattr(packmod.PackBuilder, "__call__", recorded)
    return docs


SHARDS = 3
# a sample index (global id: shard by shard) → its document (`write_tokens` deals them round-robin)
DOC = np.concatenate([np.arange(k, len(LENGTHS), SHARDS) for k in range(SHARDS)])


def kept_tokens(skip, longest: int | None = None) -> np.ndarray:
    """Every token of the documents not skipped (``skip``: sample indices; ``longest``: of
    those at most that long, as ``long="drop"`` keeps)."""
    lens = LENGTHS.copy()
    lens[DOC[list(skip)]] = 0
    return every_token(lens, longest=longest)


def reference_rows(ld, epoch: int, pack: Pack, skip) -> list:
    """The epoch's rows packed from its documents' order with the skipped ones removed (one
    document at a time, `packed_rows`), as ``(row, document, start, count, length)``."""
    order = ld.pipeline._plan_sampler.docs.plan(epoch, 0).order
    ids = order(np.arange(order.n, dtype=np.int64))
    ids = ids[~np.isin(ids, list(skip))]
    assert (LENGTHS[DOC] == ld.pipeline._plan_sampler.lengths.stored(np.arange(len(LENGTHS)))).all()
    rows = packmod.packed_rows(ArrayOrder(ids), lambda d: LENGTHS[DOC[d]], pack)
    return [(r, *p) for r, row in enumerate(rows) for p in row]


SKIPS = st.sets(st.integers(0, len(LENGTHS) - 1), max_size=30)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    split=st.sampled_from(["documents", "rows"]),
    skip=SKIPS,
    world=st.integers(1, 3),
    epoch=st.integers(0, 1),
    stop=st.integers(0, 8),
    long=st.sampled_from(["split", "drop"]),
)
def test_skipped_documents_are_absent_from_the_packed_rows(tokens, built, split, skip, world, epoch, stop, long):
    pack = Pack(40, split=split, bins=4, long=long)
    kw = dict(batch_size=2, seed=3, pack=pack, world_size=world, epoch=epoch)
    sk = crossfeed.Skip(samples=sorted(skip))
    got_tokens = []
    for rank in range(world):
        built.clear()
        with crossfeed.Loader(tokens, rank=rank, skip=sk, **kw) as ld:
            n = len(ld)
            got = list(ld)
            assert n == len(got)
            if rank == 0:  # the plan's rows are those of the order without the skipped documents
                sampler = ld.pipeline._plan_sampler
                rows = sampler.rows(epoch, 0, sampler.epoch_total(epoch))
                assert [tuple(p) for p in rows.tolist()] == reference_rows(ld, epoch, pack, skip)
        read = np.concatenate(built) if built else np.zeros(0, np.int64)
        assert not np.isin(read, list(skip)).any()  # no record of a skipped document is read
        got_tokens.append(tokens_of(got))
        # a resume after any batch (the state's packed cursor) continues exactly
        k = min(stop, len(got))
        with crossfeed.Loader(tokens, rank=rank, skip=sk, **kw) as ld:
            it = iter(ld)
            for _ in range(k):
                next(it)
            state = json.loads(json.dumps(ld.state_dict()))
            it.close()
        with crossfeed.Loader(tokens, rank=rank, skip=sk, **kw) as ld:
            ld.load_state_dict(state)
            assert same(list(ld), got[k:])
    every = np.sort(np.concatenate(got_tokens))
    want = kept_tokens(skip, 40 if long == "drop" else None)
    assert np.array_equal(every, want)  # every kept token once, none of a skipped one


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    split=st.sampled_from(["documents", "rows"]),
    skip=SKIPS,
    world=st.integers(1, 3),
    then=st.integers(1, 3),
    stop=st.integers(0, 6),
)
def test_an_elastic_resume_with_skipped_documents_delivers_every_kept_token_once(
    tokens, split, skip, world, then, stop
):
    kw = dict(batch_size=2, seed=5, pack=Pack(40, split=split, bins=4), skip=crossfeed.Skip(samples=sorted(skip)))
    before, state = [], None
    for rank in range(world):
        with crossfeed.Loader(tokens, rank=rank, world_size=world, **kw) as ld:
            it = iter(ld)
            for _ in range(min(stop, len(ld))):
                before.append(next(it))
            state = json.loads(json.dumps(ld.state_dict()))  # every rank's state is the same position
            it.close()
    after = []
    for rank in range(then):
        with crossfeed.Loader(tokens, rank=rank, world_size=then, **kw) as ld:
            ld.load_state_dict(state)
            after += list(ld)
    assert np.array_equal(np.sort(tokens_of(before + after)), kept_tokens(skip))


@pytest.mark.parametrize("workers", [2, 3])
def test_workers_agree_on_skipped_documents(tokens, workers):
    kw = dict(batch_size=2, seed=6, pack=Pack(40, split="rows"), skip=crossfeed.Skip(samples=[0, 3, 4, 90]))
    with crossfeed.Loader(tokens, **kw) as ld:
        whole = list(ld)
    parts = []
    for w in range(workers):
        with crossfeed.Loader(tokens, worker=w, num_workers=workers, **kw) as ld:
            parts.append(list(ld))
    assert same([parts[j % workers][j // workers] for j in range(len(whole))], whole)


def test_replay_names_the_steps_of_a_plan_with_skipped_documents(tokens):
    kw = dict(batch_size=2, seed=7, pack=Pack(40), skip=crossfeed.Skip(samples=list(range(0, 120, 3))))
    with crossfeed.Loader(tokens, **kw) as ld:
        whole = list(ld)
        for n in (0, 3, len(whole) - 1):
            step = ld.batch_at(n)
            assert same([ld.pipeline.build_batch(step.planned)], [whole[n]])
            assert not np.isin(np.asarray(step.keys), np.arange(0, 120, 3)).any()


def test_a_skipped_empty_document_is_never_read(tokens, monkeypatch):
    """The check of empty documents (`DocLengths._check_empty`) reads the records its lengths
    files say are empty; a skipped one is not read, nor reported."""
    read = []
    real = packmod.DocLengths._check_empty

    def recorded(self, s, k, lengths, where, fix):
        zeros = np.flatnonzero(lengths == 0) + int(self.starts[s] + self.splits[s].starts[k])
        read.extend(zeros[~self.is_skipped(zeros)].tolist())
        return real(self, s, k, lengths, where, fix)

    monkeypatch.setattr(packmod.DocLengths, "_check_empty", recorded)
    seven, fifty = (int(np.flatnonzero(DOC == d)[0]) for d in (7, 50))  # the empty documents' sample indices
    with crossfeed.Loader(tokens, batch_size=2, pack=Pack(40), skip=crossfeed.Skip(samples=[seven])) as ld:
        got = list(ld)
    assert seven not in read and fifty in read
    assert np.array_equal(np.sort(tokens_of(got)), kept_tokens({seven}))


def test_batch_by_tokens_gives_a_skipped_document_an_empty_row(tokens):
    kw = dict(batch_size=1, seed=3, batch_by_tokens=96, world_size=2)
    skip = {1, 2, 30}
    got = []
    for rank in range(2):
        with crossfeed.Loader(tokens, rank=rank, skip=crossfeed.Skip(samples=sorted(skip)), **kw) as ld:
            got += list(ld)
    assert np.array_equal(np.sort(tokens_of(got)), kept_tokens(skip))


def test_a_token_weighted_mixture_skips_documents_of_a_source(tmp_path):
    roots = [write_tokens(tmp_path / f"s{s}", lognormal(40, 20, 1.0, seed=s), source=s, num_shards=2) for s in (0, 1)]
    mix = [crossfeed.Source(roots[0], weight=1), crossfeed.Source(roots[1], weight=2)]
    skip = crossfeed.Skip(samples=[(1, 0), (1, 5), (0, 3)])
    kw = dict(batch_size=2, seed=2, samples_per_epoch=60, pack=Pack(32, weights_by="tokens"), skip=skip)
    with crossfeed.Loader(mix, **kw) as ld:
        got = list(ld)
        planned = np.concatenate(
            [ids for ids, _ in packmod.document_chunks(ld.pipeline.sampler.order(0), ld.pipeline.sampler.lengths)]
        )
    toks = tokens_of(got)
    doc = np.concatenate([np.arange(0, 40, 2), np.arange(1, 40, 2)])  # sample index → document (2 shards)
    gone = np.concatenate([token(s, doc[i], np.arange(1000)) for s, i in ((1, 0), (1, 5), (0, 3))])
    assert not np.isin(toks, gone).any() and len(toks)
    with crossfeed.Loader(mix, **kw) as ld:  # a resume mid-epoch walks on from the state's draws
        it = iter(ld)
        for _ in range(3):
            next(it)
        state = json.loads(json.dumps(ld.state_dict()))
    with crossfeed.Loader(mix, **kw) as ld:
        ld.load_state_dict(state)
        assert same(list(ld), got[3:])
    assert len(planned) == 60


def test_a_dispatchers_walker_leases_the_loaders_batches_with_skipped_documents(tokens):
    """The batches a dispatcher leases (`PackWalker`, any order, one behind the walk) are the
    Loader's, skipped documents absent."""
    kw = dict(batch_size=2, seed=9, pack=Pack(40), skip=crossfeed.Skip(samples=list(range(1, 120, 4))))
    with crossfeed.Loader(tokens, **kw) as ld:
        whole = list(ld)
        walker = ld.pipeline.walker()
        order = [2, 0, 1, len(whole) - 1, 3]
        got = [ld.pipeline.build_batch(walker.batch(0, b)) for b in order]
    assert same(got, [whole[b] for b in order])
