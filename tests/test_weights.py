"""Per-sample weights and class balance (`crossfeed.format.weights`, `WeightedOrder`): each sample
drawn in exact proportion to its integer weight over every pass of the slot space, planned on
integers (any rank, any resume position, another world size), the weights file memory-mapped and
pinned by the stream's identity; a damaged or stale set refused by name."""

from __future__ import annotations

import collections
import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import crossfeed
from crossfeed.cli.main import app
from crossfeed.errors import ConfigError, IndexFileError
from crossfeed.format import weights as fw
from crossfeed.read.options import PlanOptions, ShardOptions
from crossfeed.read.stages.sampler import Sampler

N = 30


def _cum(w) -> fw.CumulativeWeights:
    cum = np.cumsum(np.asarray(w, dtype=np.int64)).astype(fw.DTYPE)
    return fw.CumulativeWeights(cum, int(cum[-1]), "0" * 64, "memory")


def _epoch(counts, w, *, world, epoch=0, position=0, n=None, shuffle="global", seed=3, batch=4):
    """Every rank's samples of the rest of an epoch, rank by rank."""
    plan = PlanOptions(batch_size=batch, seed=seed, shuffle=shuffle, samples_per_epoch=n, remainder="drop")
    out = []
    for r in range(world):
        s = Sampler(counts, plan, ShardOptions(rank=r, world_size=world), sample_weights=_cum(w))
        out.append(s.plan(epoch, position).samples)
    return out


@settings(max_examples=40, deadline=None)
@given(
    w=st.lists(st.integers(0, 5), min_size=1, max_size=24).filter(lambda w: sum(w) > 0),
    world=st.integers(1, 4),
    epoch=st.integers(0, 3),
    shuffle=st.sampled_from(["global", "block", "none"]),
    seed=st.integers(0, 2**32),
)
def test_every_pass_draws_each_sample_exactly_its_weight(w, world, epoch, shuffle, seed):
    """An epoch of ``world × sum(w)`` draws is ``world`` whole passes of the slot space, whatever
    the epoch: sample ``i`` arrives exactly ``world × w_i`` times across the ranks, and a weight 0 never."""
    counts = [len(w) // 2, len(w) - len(w) // 2]
    n = world * sum(w)
    got = collections.Counter(
        np.concatenate(_epoch(counts, w, world=world, epoch=epoch, n=n, shuffle=shuffle, seed=seed)).tolist()
    )
    assert got == collections.Counter({i: world * x for i, x in enumerate(w) if x})


@settings(max_examples=30, deadline=None)
@given(
    w=st.lists(st.integers(0, 4), min_size=2, max_size=20).filter(lambda w: sum(w) > 1),
    before=st.integers(1, 4),
    after=st.integers(1, 4),
    cut=st.integers(0, 40),
    epoch=st.integers(0, 2),
)
def test_elastic_resume_delivers_the_rest_of_the_same_epoch(w, before, after, cut, epoch):
    """Run at ``before`` ranks for some batches, resume at ``after`` ranks from the position: the
    two parts together are the draws of the whole epoch in order (strided by rank), as one rank
    would have drawn them — each position evaluated on its own."""
    n = 2 * sum(w) * before * after
    counts = [len(w)]
    batch = 2
    whole = _epoch(counts, w, world=1, epoch=epoch, n=n, batch=batch)[0]
    done = min(cut, n // (batch * before)) * batch * before  # positions consumed by whole rank batches
    first = _epoch(counts, w, world=before, epoch=epoch, n=n, batch=batch)
    firsts = np.stack([f[: done // before] for f in first], axis=1).reshape(-1)
    rest = _epoch(counts, w, world=after, epoch=epoch, n=n, position=done, batch=batch)
    rests = np.stack(rest, axis=1).reshape(-1)
    assert firsts.tolist() == whole[:done].tolist()
    assert rests.tolist() == whole[done : done + len(rests)].tolist()
    assert len({len(r) for r in rest}) == 1  # equal steps per rank


def test_draws_follow_the_weights_in_expectation_over_seeds():
    """A window shorter than a pass: the mean count over seeds is ``n × w_i / sum(w)``."""
    w = [1, 2, 3, 0, 4]
    n, runs = 5, 400
    total = np.zeros(len(w))
    for seed in range(runs):
        got = _epoch([len(w)], w, world=1, n=n, seed=seed, batch=5)[0]
        total += np.bincount(got, minlength=len(w))
    expected = n * np.array(w) / sum(w)
    assert np.abs(total / runs - expected).max() < 0.15 and total[3] == 0


@pytest.fixture()
def data(tmp_path):
    root = tmp_path / "ds"
    samples = [
        {"x": i, "w": i % 4, "f": (i % 5) / 4, "label": b"cat" if i < 21 else b"dog" if i < 27 else b"emu"}
        for i in range(N)
    ]
    crossfeed.write_dataset(root, samples, num_shards=3).close()
    return str(root)


def test_a_feature_weights_the_epoch_end_to_end(data):
    meta = crossfeed.write_weights(data, feature="w")
    total = sum(i % 4 for i in range(N))
    assert meta.splits["train"].total == total
    with crossfeed.Loader(data, batch_size=5, weights="w", samples_per_epoch=2 * total, seed=4) as loader:
        got = collections.Counter(x for b in loader for x in b["x"].tolist())
        ident = loader.state_dict()["identity"]["settings"]
    assert got == collections.Counter({i: 2 * (i % 4) for i in range(N) if i % 4})
    assert ident["weights"] == f"w sha256:{meta.splits['train'].sha256}"


def test_float_weights_are_quantised_at_the_resolution(data):
    meta = crossfeed.write_weights(data, feature="f", resolution=4, name="f4")
    cw = fw.CumulativeWeights.open(os.path.join(data, "weights", "f4.train.cw"), meta.splits["train"])
    with crossfeed.open_dataset(data) as ds:
        values = [float(r["f"]) for r in ds["train"]]  # in the split's record order
    assert cw.weights_of(np.arange(N)).tolist() == [round(v * 4) for v in values]
    assert sorted(set(values)) == [0, 0.25, 0.5, 0.75, 1]
    assert fw.quantise(np.array([0.25, 1.004]), 100).tolist() == [25, 100]
    with pytest.raises(ConfigError, match="negative"):
        list(fw.prefix_sums([np.array([1, -1])], "w"))


def test_class_balance_gives_each_class_the_same_total_weight(data):
    meta = crossfeed.write_weights(data, balance="label")
    assert meta.name == crossfeed.balanced("label") == "balance-label"
    cw = fw.CumulativeWeights.open(os.path.join(data, "weights", "balance-label.train.cw"), meta.splits["train"])
    w = cw.weights_of(np.arange(N))
    with crossfeed.open_dataset(data) as ds:
        labels = np.array([bytes(r["label"]) for r in ds["train"]])
    per_class = [int(w[labels == c].sum()) for c in (b"cat", b"dog", b"emu")]
    assert per_class[0] == per_class[1] == per_class[2] == cw.total // 3
    with crossfeed.Loader(data, batch_size=6, weights=crossfeed.balanced("label"), samples_per_epoch=cw.total) as ld:
        labels = collections.Counter(v for b in ld for v in b["label"].tolist())
    assert labels == {b"cat": cw.total // 3, b"dog": cw.total // 3, b"emu": cw.total // 3}
    assert fw.class_weights({"a": 3, "b": 4}) == {"a": 4, "b": 3}
    big = fw.class_weights({i: p for i, p in enumerate([1_000_003, 1_000_033, 1_000_037, 1_000_039, 999_983])})
    assert max(big.values()) < fw.MAX_TOTAL  # the multiple overflows: rounded shares of SCALE


def test_exact_resume_and_a_changed_set_refused_by_name(data):
    crossfeed.write_weights(data, feature="w")
    kw = dict(batch_size=4, weights="w", seed=2, samples_per_epoch=40)
    with crossfeed.Loader(data, **kw) as loader:
        whole = [b["x"].tolist() for b in loader]
    with crossfeed.Loader(data, **kw) as loader:
        it = iter(loader)
        head = [next(it)["x"].tolist() for _ in range(3)]
        state = json.loads(json.dumps(loader.state_dict()))
    with crossfeed.Loader(data, **kw) as loader:
        loader.load_state_dict(state)
        tail = [b["x"].tolist() for b in loader]
    assert head + tail == whole
    crossfeed.write_weights(data, feature="f", resolution=4, name="w")  # the set rewritten: other bytes
    with crossfeed.Loader(data, **kw) as loader, pytest.raises(ConfigError, match="weights was 'w sha256:") as e:
        loader.load_state_dict(state)
    assert "belongs to another stream" in str(e.value)
    with crossfeed.Loader(data, batch_size=4, seed=2) as loader, pytest.raises(ConfigError, match="weights was"):
        loader.load_state_dict(state)


def test_a_damaged_stale_or_missing_set_is_refused(data, tmp_path):
    with pytest.raises(ConfigError, match="no weights set 'nope'.*crossfeed weights"):
        crossfeed.Loader(data, batch_size=2, weights="nope")
    crossfeed.write_weights(data, feature="w")
    cw = os.path.join(data, "weights", "w.train.cw")
    raw = bytearray(open(cw, "rb").read())
    raw[8] ^= 1
    open(cw, "wb").write(bytes(raw))
    with pytest.raises(IndexFileError, match="w.train.cw"):
        crossfeed.Loader(data, batch_size=2, weights="w")
    meta = os.path.join(data, "weights", "w.json")
    d = json.load(open(meta))
    d["extra"] = 1
    open(meta, "w").write(json.dumps(d))
    with pytest.raises(IndexFileError, match="extra: unknown field"):
        crossfeed.Loader(data, batch_size=2, weights="w")
    crossfeed.write_weights(data, feature="w")
    crossfeed.write_dataset(data, [{"x": 1, "w": 1, "f": 0.5, "label": b"cat"}], split="val", add_split=True).close()
    with pytest.raises(ConfigError, match="another version of the dataset"):
        crossfeed.Loader(data, batch_size=2, weights="w")
    with pytest.raises(ConfigError, match="weights set is named"):
        crossfeed.Loader(data, batch_size=2, weights="../x")
    with pytest.raises(ConfigError, match="scalar numeric feature"):
        crossfeed.write_weights(data, feature="label")
    with pytest.raises(ConfigError, match="another version of the dataset"):  # a mixture's source's set too
        crossfeed.Loader([crossfeed.Source(data, weight=1)], batch_size=2, weights="w")


def test_cli_writes_a_balance_set_the_loader_reads(data):
    r = CliRunner().invoke(app, ["weights", data, "--balance", "label"])
    assert r.exit_code == 0, r.output
    assert "wrote weights set 'balance-label'" in r.output and "30 records" in r.output
    with crossfeed.Loader(data, batch_size=5, weights=crossfeed.balanced("label")) as loader:
        assert sum(len(b["x"]) for b in loader) == N
    r = CliRunner().invoke(app, ["weights", data, "--feature", "w", "--balance", "label"])
    assert r.exit_code != 0 and "one of them" in r.output


@pytest.mark.slow
def test_process_workers_draw_the_same_weighted_batches(data):
    crossfeed.write_weights(data, feature="w")
    kw = dict(batch_size=4, weights="w", seed=5, samples_per_epoch=24)
    with crossfeed.Loader(data, **kw) as loader:
        want = [b["x"].tolist() for b in loader]
    with crossfeed.Loader(data, **kw, executor="process", processes=2) as loader:
        assert [b["x"].tolist() for b in loader] == want


@settings(max_examples=20, deadline=None)
@given(
    w=st.lists(st.integers(0, 4), min_size=1, max_size=16).filter(lambda w: sum(w) > 0),
    workers=st.integers(1, 3),
    position=st.integers(0, 20),
)
def test_workers_split_the_same_weighted_batches(w, workers, position):
    """DataLoader workers take every K-th batch of the same plan: together, the one worker's batches."""
    n = 3 * sum(w) + 7
    position = min(position, n)
    plan = PlanOptions(batch_size=3, seed=9, samples_per_epoch=n)
    one = list(Sampler([len(w)], plan, ShardOptions(), sample_weights=_cum(w)).plan(1, position))
    parts = [
        list(
            Sampler([len(w)], plan, ShardOptions(worker=k, num_workers=workers), sample_weights=_cum(w)).plan(
                1, position
            )
        )
        for k in range(workers)
    ]
    merged = [parts[b % workers][b // workers] for b in range(len(one))]
    assert [m.tolist() for m in merged] == [o.tolist() for o in one]
