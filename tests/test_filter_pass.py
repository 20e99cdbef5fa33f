"""The filter pass (issue 36, item 4): ``crossfeed.filter_pass`` / ``crossfeed filter`` runs a
predicate over every stored sample once and writes the ids it drops as a skip file — so a filter
gets refilled steps (``refill``), token pipelines take filtered documents (``pack=`` with
``skip=FILE``), and shorter-step ``filter=`` and pass + ``skip=`` keep the same samples."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import recipe_helpers as rh
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loader_helpers import assert_resumes_identically
from test_pack import every_token, tokens_of
from token_data import write_tokens

import crossfeed
from crossfeed import ConfigError, Loader, Pack, Skip, Source, filter_pass
from crossfeed.read import skips as skips_mod

N, M = 120, 50


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("filter-pass")
    return rh.write(root / "a", n=N), rh.write(root / "b", n=M, shards=2)


def _ids(batches):
    return [np.asarray(b["__index__"]).tolist() for b in batches]


def _flat(batches):
    return [i for b in _ids(batches) for i in b]


# ---- the file is the set of ids the predicate drops -----------------------------------------------


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    drop=st.sets(st.integers(0, N - 1), max_size=40),
    mixture=st.booleans(),
    refill=st.booleans(),
    chunk=st.integers(1, 70),
    threads=st.integers(0, 2),
)
def test_the_pass_writes_exactly_the_ids_the_predicate_drops(
    data, tmp_path_factory, drop, mixture, refill, chunk, threads
):
    a, b = data
    out = tmp_path_factory.mktemp("f") / "filtered.txt"
    # a sample's label is its index in its source: a mixture's sources each, numbered as skip= numbers them
    src, sizes = ([Source(a, weight=1), Source(b, weight=3)], [N, M]) if mixture else (a, [N])
    want = [[s, i] for s, n in enumerate(sizes) for i in sorted(drop) if i < n]
    if len(want) == sum(sizes):
        return  # every sample dropped: refused (below)

    def keep(sample):
        return int(sample["label"]) not in drop

    done = filter_pass(src, keep, out, refill=refill, chunk=chunk, num_threads=threads)
    got = Skip.of(out)
    assert (got.samples.tolist() if got is not None else []) == want
    assert done.dropped == len(want) and done.seen == sum(sizes) and done.kept == done.seen - done.dropped
    assert [s[1:] for s in done.sources] == [(n, sum(1 for w in want if w[0] == k)) for k, n in enumerate(sizes)]
    text = out.read_text()
    assert ("\nrefill\n" in text) == refill
    assert f"# kept {done.kept:,}, dropped {done.dropped:,} of {done.seen:,} samples" in text
    assert "# crossfeed filter pass: filter " in text and all(f"# source {k}: " in text for k in range(len(sizes)))
    assert not [p for p in os.listdir(out.parent) if ".tmp-" in p]  # the temporary file was renamed


# ---- refilled steps: every kept sample once, every step full, exact and elastic resume -------------


def keep_not_five(s) -> bool:
    return int(s["label"]) % 5 != 0


def test_a_refilled_epoch_holds_every_kept_sample_once_in_full_steps(data, tmp_path):
    a, _ = data
    done = filter_pass(a, keep_not_five, tmp_path / "f.txt", refill=True)
    kept = [i for i in range(N) if i % 5]
    assert done.kept == len(kept) == 96 and done.skip.refill
    for skip in (tmp_path / "f.txt", {"file": tmp_path / "f.txt", "refill": True}):
        with Loader(a, batch_size=7, seed=3, skip=skip, return_index=True) as ld:
            got = _ids(ld)
        assert [len(b) for b in got] == [7] * 13 + [5]  # 96 = 13 × 7 + 5: every step full but the last
        assert sorted(i for b in got for i in b) == kept
    with Loader(a, batch_size=8, seed=3, skip=tmp_path / "f.txt", drop_last=True, epoch=1) as ld:
        assert all(len(b["label"]) == 8 for b in ld) and len(ld) == 12


def test_a_refilled_epoch_resumes_exactly_at_every_step(data, tmp_path):
    a, _ = data
    filter_pass(a, keep_not_five, tmp_path / "f.txt", refill=True)
    assert_resumes_identically(a, batch_size=8, seed=4, skip=str(tmp_path / "f.txt"), epoch=1)


def test_a_refilled_epoch_resumes_elastically_from_one_rank_to_two(data, tmp_path):
    a, _ = data
    filter_pass(a, keep_not_five, tmp_path / "f.txt", refill=True)
    kept = {i for i in range(N) if i % 5}
    kw = {"batch_size": 6, "seed": 9, "skip": str(tmp_path / "f.txt"), "return_index": True, "remainder": "drop"}
    for stop in (0, 5, 16):
        with Loader(a, world_size=1, rank=0, **kw) as ld:
            it = iter(ld)
            done = [i for _ in range(stop) for i in np.asarray(next(it)["__index__"]).tolist()]
            state = ld.state_dict()
        rest = []
        for rank in range(2):
            with Loader(a, world_size=2, rank=rank, **kw) as ld:
                ld.load_state_dict(state)
                rest.append(_ids(ld))
        assert len(rest[0]) == len(rest[1])  # equal steps per rank
        for r in rest:
            assert all(len(b) == 6 for b in r[:-1])  # full steps
        more = [i for r in rest for b in r for i in b]
        assert len(done) + len(more) == len(set(done) | set(more))  # nothing twice
        assert set(done) | set(more) <= kept and len(kept - set(done) - set(more)) < 2  # drop: under world left


# ---- shorter steps: filter= and pass + skip= keep the same samples --------------------------------


@pytest.mark.parametrize("mixture", [False, True])
def test_shorter_step_filter_and_the_pass_keep_the_same_samples(data, tmp_path, mixture):
    a, b = data
    src = [Source(a, weight=2), Source(b, weight=1)] if mixture else a
    filter_pass(src, rh.keep_even, tmp_path / "f.txt")
    kw = {"batch_size": 8, "seed": 5, "return_index": True}
    for epoch in (0, 1):
        with Loader(src, filter=rh.keep_even, epoch=epoch, **kw) as ld:
            filtered = list(ld)
        with Loader(src, skip=tmp_path / "f.txt", epoch=epoch, **kw) as ld:
            skipped = list(ld)
        # the very same batches, step for step: a filtered sample is accounted exactly like a skip
        assert len(filtered) == len(skipped)
        for x, y in zip(filtered, skipped):
            assert x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
        assert sorted(_flat(filtered)) == sorted(_flat(skipped))
        assert all(int(lab) % 2 == 0 for bt in skipped for lab in bt["label"])


# ---- token pipelines take the pass's file ---------------------------------------------------------

LENGTHS = np.array([5, 9, 12, 3, 7, 20, 11, 4, 6, 15, 8, 2, 30, 1, 9, 14, 3, 18, 10, 6], dtype=np.int64)


def short_documents_out(s) -> bool:
    return len(s["tokens"]) % 3 != 0


@pytest.mark.parametrize("how", [{"pack": Pack(16)}, {"pack": Pack(16, split="rows")}, {"batch_by_tokens": 40}])
def test_a_packed_epoch_over_the_pass_holds_exactly_the_kept_documents_tokens(tmp_path, how):
    tokens = write_tokens(tmp_path / "t", LENGTHS, num_shards=3)
    done = filter_pass(tokens, short_documents_out, tmp_path / "f.txt")
    kept = LENGTHS.copy()
    kept[kept % 3 == 0] = 0
    assert done.dropped == int((LENGTHS % 3 == 0).sum()) > 0
    want = every_token(kept)
    with pytest.raises(ConfigError, match=r"crossfeed filter DATASET --filter module:fn"):
        Loader(tokens, batch_size=2, filter=short_documents_out, **how)
    for epoch in (0, 1):
        with Loader(tokens, batch_size=2, seed=1, epoch=epoch, skip=tmp_path / "f.txt", **how) as ld:
            batches = list(ld)
        assert np.array_equal(np.sort(tokens_of(batches)), want)  # every kept token once, none of a dropped document


def test_a_packed_run_over_the_pass_resumes_exactly(tmp_path):
    tokens = write_tokens(tmp_path / "t", LENGTHS, num_shards=3)
    filter_pass(tokens, short_documents_out, tmp_path / "f.txt")
    kw = {"batch_size": 2, "seed": 2, "pack": Pack(16), "skip": str(tmp_path / "f.txt")}
    with Loader(tokens, **kw) as ld:
        whole = list(ld)
    for stop in (1, len(whole) // 2):
        with Loader(tokens, **kw) as ld:
            it = iter(ld)
            for _ in range(stop):
                next(it)
            state = ld.state_dict()
        with Loader(tokens, **kw) as ld:
            ld.load_state_dict(state)
            rest = list(ld)
        assert len(rest) == len(whole) - stop
        assert all(np.array_equal(x["tokens"], y["tokens"]) for x, y in zip(rest, whole[stop:]))


# ---- the command line, end to end -----------------------------------------------------------------


@pytest.mark.slow
def test_the_cli_writes_the_file_the_library_writes(data, tmp_path):
    a, _ = data
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "myfilters.py").write_text("def keep(s):\n    return int(s['label']) % 4 != 1\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(mods), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "cli.txt"
    cmd = [sys.executable, "-m", "crossfeed.cli.main", "filter", str(a), "--filter", "myfilters:keep"]
    res = subprocess.run([*cmd, "--out", str(out), "--refill"], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    assert "kept 90, dropped 30 of 120 samples" in res.stderr and f"--skip {out}" in res.stderr
    got = Skip.of(out)
    assert got.refill and got.samples[:, 1].tolist() == [i for i in range(N) if i % 4 == 1]
    assert "# crossfeed filter pass: filter myfilters:keep" in out.read_text()
    with Loader(a, batch_size=9, skip=out, return_index=True) as ld:
        assert sorted(_flat(ld)) == [i for i in range(N) if i % 4 != 1]
    bad = subprocess.run(
        [*cmd, "--out", str(tmp_path / "x.txt"), "--pack-length", "8"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert bad.returncode == 2 and "--pack-length" in bad.stderr and not (tmp_path / "x.txt").exists()
    none = subprocess.run(
        [
            sys.executable,
            "-m",
            "crossfeed.cli.main",
            "filter",
            str(a),
            "--filter",
            "myfilters:nope",
            "--out",
            str(tmp_path / "y.txt"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert none.returncode != 0 and "myfilters has no attribute 'nope'" in none.stderr


# ---- refused by name ------------------------------------------------------------------------------


def returns_none(s):
    return None


def returns_label(s):
    return int(s["label"])


def drop_first_seven(s) -> bool:
    return int(s["label"]) >= 7


def test_a_malformed_result_or_an_oversized_pass_is_refused_by_name(data, tmp_path, monkeypatch):
    a, _ = data
    out = tmp_path / "f.txt"
    out.write_text("# an older pass\n0 3\n")
    for fn, kind in ((returns_none, "NoneType"), (returns_label, "int")):
        with pytest.raises(ConfigError, match=rf"filter .*{fn.__name__} returned a {kind} for sample 0 of source 0"):
            filter_pass(a, fn, out)
    assert out.read_text() == "# an older pass\n0 3\n"  # untouched
    monkeypatch.setattr(skips_mod, "MAX_SAMPLES", 5)
    with pytest.raises(ConfigError, match=r"drop_first_seven drops more than 5 samples, the most a skip file holds"):
        filter_pass(a, drop_first_seven, out, chunk=4)
    monkeypatch.undo()
    with pytest.raises(ConfigError, match=r"drops 60 of 120 samples \(50.0%\), more than max_filtered=0.25"):
        filter_pass(a, rh.keep_even, out, max_filtered=0.25)
    with pytest.raises(ConfigError, match="drops all 120 samples"):
        filter_pass(a, lambda s: False, out)
    with pytest.raises(ConfigError, match=r"pack= belong to the Loader that reads its file"):
        filter_pass(a, rh.keep_even, out, pack=Pack(8))
    with pytest.raises(ConfigError, match=r"skip= belong to the Loader"):
        filter_pass(a, rh.keep_even, out, skip=Skip(samples=[1]))
    with pytest.raises(ConfigError, match="refill: True or False"):
        filter_pass(a, rh.keep_even, out, refill="yes")
    with pytest.raises(ConfigError, match="cannot import nowhere_mod"):
        filter_pass(a, "nowhere_mod:keep", out)
    with pytest.raises(ConfigError, match="cannot write the skip file"):
        filter_pass(a, rh.keep_even, tmp_path / "no" / "such" / "dir.txt")
    assert out.read_text() == "# an older pass\n0 3\n"
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


# ---- a mixture refills too: each source's passes close up around its dropped samples -------------


def _mixtures(a, b):
    return {
        "fixed": [Source(a, weight=1), Source(b, weight=3)],
        "scheduled": [Source(a, weight=1), Source(b, weight=crossfeed.Schedule.constant([(0, 1), (40, 3)]))],
    }


def _pairs(batch) -> list[tuple[int, int]]:
    return list(zip(np.asarray(batch["__source__"]).tolist(), np.asarray(batch["__index__"]).tolist()))


def _draws(batches) -> dict[int, list[int]]:
    """Each source's samples in the order they arrived."""
    out: dict[int, list[int]] = {}
    for bt in batches:
        for src, i in zip(np.asarray(bt["__source__"]).tolist(), np.asarray(bt["__index__"]).tolist()):
            out.setdefault(src, []).append(i)
    return out


@pytest.mark.parametrize("kind", ["fixed", "scheduled"])
def test_a_mixtures_refilled_epoch_draws_each_sources_kept_samples_in_whole_passes(data, tmp_path, kind):
    a, b = data
    mix = _mixtures(a, b)[kind]
    done = filter_pass(mix, keep_not_five, tmp_path / "f.txt", refill=True)
    kept = [[i for i in range(n) if i % 5] for n in (N, M)]
    assert [s[2] for s in done.sources] == [N - len(kept[0]), M - len(kept[1])]
    for epoch in (0, 1):
        with Loader(mix, batch_size=8, seed=6, epoch=epoch, skip=tmp_path / "f.txt", return_index=True) as ld:
            batches = list(ld)
            assert len(ld) == len(batches) == -(-len(kept[0] + kept[1]) // 8)  # the epoch is that much shorter
        assert all(len(bt["label"]) == 8 for bt in batches[:-1])  # every step full
        for src, got in _draws(batches).items():
            assert not [i for i in got if i % 5 == 0]  # no dropped sample arrives
            if epoch == 0:  # a source's draws from the run's start: whole passes over its kept samples
                k = len(kept[src])
                for lo in range(0, len(got), k):
                    block = got[lo : lo + k]
                    assert len(set(block)) == len(block) and set(block) <= set(kept[src])
                    assert len(block) < k or sorted(block) == kept[src]


@pytest.mark.parametrize("kind", ["fixed", "scheduled"])
def test_a_mixtures_refilled_epoch_resumes_exactly_and_elastically(data, tmp_path, kind):
    a, b = data
    mix = _mixtures(a, b)[kind]
    filter_pass(mix, keep_not_five, tmp_path / "f.txt", refill=True)
    kw = {"batch_size": 6, "seed": 3, "skip": str(tmp_path / "f.txt")}
    assert_resumes_identically(mix, stops=[0, 1, 7, 15, 23], epoch=1, **kw)
    with Loader(mix, return_index=True, **kw) as ld:
        whole = [i for bt in ld for i in _pairs(bt)]
    for stop in (3, 11):
        with Loader(mix, return_index=True, **kw) as ld:
            it = iter(ld)
            done = [i for _ in range(stop) for i in _pairs(next(it))]
            state = ld.state_dict()
        rest = []
        for rank in range(2):
            with Loader(mix, return_index=True, world_size=2, rank=rank, **kw) as ld:
                ld.load_state_dict(state)
                rest.append([_pairs(bt) for bt in ld])
        assert len(rest[0]) == len(rest[1]) and all(len(x) == 6 for r in rest for x in r[:-1])
        more = [i for r in rest for x in r for i in x]
        # the same draws as the uninterrupted run, dealt over two ranks (pad: the tail repeats under 2)
        assert done == whole[: stop * 6]
        assert set(more) == set(whole[len(done) :]) and 0 <= len(more) - (len(whole) - len(done)) < 2


def test_refill_counts_in_the_identity_of_a_mixture_and_a_fully_dropped_source_is_refused(data, tmp_path):
    a, b = data
    mix = [Source(a, weight=1), Source(b, weight=1)]
    filter_pass(mix, keep_not_five, tmp_path / "r.txt", refill=True)
    filter_pass(mix, keep_not_five, tmp_path / "s.txt")
    with Loader(mix, batch_size=4, skip=tmp_path / "r.txt") as ld:
        next(iter(ld))
        state = ld.state_dict()
    with Loader(mix, batch_size=4, skip=tmp_path / "s.txt") as ld:
        with pytest.raises(ConfigError, match="skip refill"):
            ld.load_state_dict(state)
    filter_pass(mix, lambda s: len(s["x"]) == 3 and int(s["label"]) >= M, tmp_path / "all-b.txt", refill=True)
    with pytest.raises(ConfigError, match=f"mixture source 1 has no samples left: skip= takes out all {M} of them"):
        Loader(mix, batch_size=4, skip=tmp_path / "all-b.txt")
    assert crossfeed.filter_pass is filter_pass
