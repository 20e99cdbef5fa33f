"""Step replay (`Loader.batch_at`, `crossfeed replay`): the samples named for a step are exactly
the ones iteration delivered in it — every rank, every step, across epochs, with workers sharing a
rank's batches, in mixtures, after a resume (also at another world size), packed or not — and
each `SampleRef` names the file and record that hold the sample."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from token_data import write_tokens
from typer.testing import CliRunner

import crossfeed
from crossfeed.errors import ConfigError
from crossfeed.format.schema import SOURCE_KEY
from crossfeed.read.loader import INDEX_KEY, Loader
from crossfeed.read.options import Pack

N = 53


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay")
    rows = [{"x": np.full(3, i, np.int64), "label": i, "name": f"s{i}"} for i in range(N)]
    crossfeed.write_dataset(root / "ds", rows, num_shards=3).close()
    crossfeed.write_dataset(root / "b", [{"x": np.full(3, -i, np.int64), "label": 1000 + i} for i in range(11)]).close()
    rng = np.random.default_rng(0)
    write_tokens(root / "tok", rng.integers(1, 40, 90).tolist())
    write_tokens(root / "tok2", rng.integers(1, 30, 25).tolist(), source=1, num_shards=2)
    return root


def _keys(got) -> list[int]:
    return [s.key for s in got]


@settings(max_examples=30, deadline=None)
@given(
    world=st.integers(1, 4),
    batch=st.integers(1, 9),
    shuffle=st.sampled_from(["global", "block", "none"]),
    drop_last=st.booleans(),
    remainder=st.sampled_from(["pad", "drop"]),
    seed=st.integers(0, 3),
)
def test_every_step_of_every_rank_names_what_iteration_delivered(
    data, world, batch, shuffle, drop_last, remainder, seed
):
    opts = dict(batch_size=batch, shuffle=shuffle, drop_last=drop_last, remainder=remainder, seed=seed)
    for rank in range(world):
        with Loader(data / "ds", return_index=True, rank=rank, world_size=world, **opts) as ld:
            per_epoch, step = ld.rank_batch_count(), 0
            for epoch in range(2):
                for b, got in enumerate(ld):
                    assert _keys(ld.batch_at(b, epoch=epoch)) == got[INDEX_KEY].tolist()
                    # a global step across epochs; any rank asked from any rank's Loader
                    assert _keys(ld.batch_at(step, rank=rank)) == got[INDEX_KEY].tolist()
                    step += 1
                assert b == per_epoch - 1
    with Loader(data / "ds", return_index=True, rank=0, world_size=world, **opts) as ld0:
        with Loader(data / "ds", return_index=True, rank=world - 1, world_size=world, **opts) as last:
            first = next(iter(last))
            assert _keys(ld0.batch_at(0, epoch=0, rank=world - 1)) == first[INDEX_KEY].tolist()


def test_a_sample_ref_names_its_shard_file_and_record(data):
    with Loader(data / "ds", batch_size=7, seed=3) as ld:
        split = ld.split
        got = ld.batch_at(4)
        records = ld.samples_at(4)
        built = ld.samples_at(4, built=True)
    assert len(got) == 7 and got.epoch == 0 and got.step == 4
    np.testing.assert_array_equal(records["label"], built["label"])
    for i, s in enumerate(got):
        assert s.path == split.file(s.shard).path and s.path.endswith(split.shards[s.shard].file)
        assert s.source == str(data / "ds") and s.source_index == 0 and s.index == s.key
        assert split.decode(s.shard, s.record)["label"] == split[s.key]["label"] == records["label"][i]
        assert records["name"][i] == f"s{records['label'][i]}"
    assert json.loads(json.dumps(got.to_json()))["samples"][0]["record"] == got[0].record


def test_workers_share_a_ranks_steps_and_replay_answers_for_the_rank(data):
    """Worker w of 2 delivers the rank's batches w, w+2, …; a step is the rank's batch number."""
    opts = dict(batch_size=4, seed=1, rank=1, world_size=2, return_index=True)
    with Loader(data / "ds", **opts) as whole:
        rank_batches = [b[INDEX_KEY].tolist() for b in whole]
    for w in range(2):
        with Loader(data / "ds", worker=w, num_workers=2, **opts) as ld:
            mine = [b[INDEX_KEY].tolist() for b in ld]
            assert mine == rank_batches[w::2]
            for b in range(len(rank_batches)):
                assert _keys(ld.batch_at(b, epoch=0)) == rank_batches[b]


def test_a_transform_and_one_sample_at_a_time(data):
    double = lambda s: {**s, "x": s["x"] * 2}  # noqa: E731
    with Loader(data / "ds", batch_size=5, seed=2, transform=double, return_index=True) as ld:
        batches = list(ld)
        for b, batch in enumerate(batches):
            built = ld.samples_at(b, epoch=0, built=True)
            np.testing.assert_array_equal(built["x"], batch["x"])
            np.testing.assert_array_equal(ld.samples_at(b, epoch=0)["x"] * 2, batch["x"])  # records: no transform
    with Loader(data / "ds", batch_size=None, seed=2, return_index=True) as ld:
        for k, sample in enumerate(ld):
            assert _keys(ld.batch_at(k, epoch=0)) == [int(sample[INDEX_KEY])]


def test_mixture_steps_name_each_source_and_its_index(data):
    sources = [crossfeed.Source(data / "ds", weight=3), crossfeed.Source(data / "b", weight=1)]
    for world in (1, 3):
        for rank in range(world):
            opts = dict(batch_size=4, seed=4, rank=rank, world_size=world, samples_per_epoch=40, return_index=True)
            with Loader(sources, **opts) as ld:
                for epoch in range(3):  # the small source wraps round its passes
                    for b, batch in enumerate(ld):
                        got = ld.batch_at(b, epoch=epoch)
                        assert [s.source_index for s in got] == batch[SOURCE_KEY].tolist()
                        assert [s.index for s in got] == batch[INDEX_KEY].tolist()
                        assert [s.source for s in got] == [str(data / ("ds", "b")[s]) for s in batch[SOURCE_KEY]]
                        np.testing.assert_array_equal(ld.samples_at(b, epoch=epoch)["label"], batch["label"])


def test_an_order_evaluated_batch_by_batch_replays_the_same(data, monkeypatch):
    """Large epochs evaluate their order a chunk at a time (no table): replay agrees there too."""
    from crossfeed.read.stages import sampler as plan_mod

    monkeypatch.setattr(plan_mod, "TABLE_MAX", 0)
    monkeypatch.setattr(plan_mod, "CHUNK_SAMPLES", 8)
    for shuffle in ("global", "block"):
        for rank in range(2):
            opts = dict(batch_size=3, seed=8, shuffle=shuffle, rank=rank, world_size=2, return_index=True)
            with Loader(data / "ds", **opts) as ld:
                assert not ld.plan().order.materialised
                batches = [b[INDEX_KEY].tolist() for b in ld]
                for b in reversed(range(len(batches))):  # any order: no walk, no chunk assumed
                    assert _keys(ld.batch_at(b, epoch=0)) == batches[b]


@pytest.mark.parametrize("new_world", [2, 3])
def test_after_a_resume_the_steps_still_replay(data, new_world):
    """A resume under the same world size continues the step numbering; under another, the steps
    after it count from the saved position."""
    opts = dict(batch_size=3, seed=6, return_index=True)
    with Loader(data / "ds", rank=0, world_size=2, **opts) as ld:
        ld.set_epoch(1)
        it = iter(ld)
        done = [next(it)[INDEX_KEY].tolist() for _ in range(3)]
        state = ld.state_dict()
    with Loader(data / "ds", rank=0, world_size=2, **opts) as again:
        again.load_state_dict(state)
        rest = [b[INDEX_KEY].tolist() for b in again]
        for b, keys in enumerate(done + rest):
            assert _keys(again.batch_at(b, epoch=1)) == keys
    for rank in range(new_world):
        with Loader(data / "ds", rank=rank, world_size=new_world, **opts) as el:
            el.load_state_dict(state)
            rest = [b[INDEX_KEY].tolist() for b in el]
            for b, keys in enumerate(rest):
                assert _keys(el.batch_at(b, epoch=1, position=state["position"])) == keys


@pytest.mark.parametrize(
    "plan", [dict(pack=Pack(32)), dict(pack=Pack(32, split="rows")), dict(batch_by_tokens=64)], ids=str
)
def test_packed_steps_name_each_rows_pieces(data, plan):
    """Each row's pieces, laid end to end, are the row's tokens; the batch rebuilt from the
    replayed plan is the one iteration built."""
    for world in (1, 2):
        for rank in range(world):
            with Loader(data / "tok", batch_size=3, seed=2, rank=rank, world_size=world, **plan) as ld:
                step = 0
                for epoch in range(2):
                    for b, batch in enumerate(ld):
                        got = ld.batch_at(b, epoch=epoch)
                        np.testing.assert_array_equal(ld.batch_at(step).planned, got.planned)
                        step += 1
                        rebuilt = ld.samples_at(b, epoch=epoch, built=True)
                        for k in batch:
                            np.testing.assert_array_equal(rebuilt[k], batch[k])
                        docs = ld.samples_at(b, epoch=epoch)["tokens"]
                        by_key = dict(zip(got.keys.tolist(), docs))
                        filled: dict[int, int] = {}
                        for s in got:
                            at = filled.get(s.row, 0)
                            piece = np.asarray(by_key[s.key])[s.start : s.start + s.count]
                            np.testing.assert_array_equal(batch["tokens"][s.row, at : at + s.count], piece)
                            filled[s.row] = at + s.count


def test_a_packed_mixture_names_each_pieces_source(data):
    sources = [crossfeed.Source(data / "tok", weight=2), crossfeed.Source(data / "tok2")]
    with Loader(sources, batch_size=2, seed=3, pack=Pack(48), samples_per_epoch=60) as ld:
        for epoch in range(2):
            for b, batch in enumerate(ld):
                got = ld.batch_at(b, epoch=epoch)
                docs = dict(zip(got.keys.tolist(), ld.samples_at(b, epoch=epoch)["tokens"]))
                filled: dict[int, int] = {}
                for s in got:
                    tokens = np.asarray(docs[s.key])
                    assert (tokens >> 40 == s.source_index).all() and s.source == str(
                        data / ("tok", "tok2")[s.source_index]
                    )
                    at = filled.get(s.row, 0)
                    np.testing.assert_array_equal(
                        batch["tokens"][s.row, at : at + s.count], tokens[s.start : s.start + s.count]
                    )
                    filled[s.row] = at + s.count


def test_bad_steps_ranks_and_positions_are_refused_by_name(data):
    with Loader(data / "ds", batch_size=4, world_size=2, rank=0) as ld:
        n = ld.rank_batch_count()
        with pytest.raises(ConfigError, match=rf"step {n} is beyond epoch 0: it has {n} steps per rank"):
            ld.batch_at(n, epoch=0)
        assert ld.batch_at(n).epoch == 1  # a global step: the next epoch's first
        with pytest.raises(ConfigError, match="rank must be in 0 … 1"):
            ld.batch_at(0, rank=2)
        with pytest.raises(ConfigError, match="step must be an integer >= 0"):
            ld.batch_at(-1)
        with pytest.raises(ConfigError, match="pass epoch= with it"):
            ld.batch_at(0, position=8)
        with pytest.raises(ConfigError, match="position 999 is outside epoch 0"):
            ld.batch_at(0, epoch=0, position=999)


# ---- the command ------------------------------------------------------------------------------


@pytest.fixture
def app():
    from crossfeed.cli.main import app

    return app


def test_replay_command_prints_the_steps_samples_and_dumps_them(data, app, tmp_path):
    with Loader(data / "ds", batch_size=4, seed=5, rank=1, world_size=2) as ld:
        want = ld.batch_at(17)  # a global step: epoch 2
        records = ld.samples_at(17)
    args = ["replay", str(data / "ds"), "-b", "4", "--seed", "5", "--rank", "1", "--world-size", "2"]
    res = CliRunner().invoke(app, [*args, "--step", "17", "--json", "--dump", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    lines = [json.loads(line) for line in res.stdout.splitlines()]
    assert [(x["epoch"], x["step"], x["rank"]) for x in lines] == [(want.epoch, want.step, 1)] * len(want)
    assert [x["key"] for x in lines] == _keys(want) and [x["record"] for x in lines] == [s.record for s in want]
    assert [x["path"] for x in lines] == [s.path for s in want]
    meta = json.loads((tmp_path / "out" / "step.json").read_text())
    for i, s in enumerate(meta["samples"]):
        with np.load(tmp_path / "out" / s["file"], allow_pickle=False) as f:
            np.testing.assert_array_equal(f["x"], records["x"][i])
            assert str(f["name"]) == records["name"][i]
    # the same step, counted within its epoch
    table = CliRunner().invoke(app, [*args, "--step", str(want.step), "--epoch", str(want.epoch)])
    assert table.exit_code == 0, table.output
    assert f"epoch 2 step {want.step} of rank 1/2" in table.stdout
    rows = [line.split() for line in table.stdout.splitlines()[2:]]
    assert [int(r[-1]) for r in rows] == _keys(want)
    assert [r[2] for r in rows] == [s.path.rsplit("/", 1)[1] for s in want]


def test_replay_command_takes_a_mixture_spec_and_a_saved_state(data, app, tmp_path):
    spec = tmp_path / "mix.json"
    spec.write_text(json.dumps({"sources": [{"path": str(data / "ds"), "weight": 3}, {"path": str(data / "b")}]}))
    with Loader([crossfeed.Source(data / "ds", weight=3), crossfeed.Source(data / "b")], batch_size=8, seed=7) as ld:
        ld.set_epoch(1)
        next(iter(ld))
        state = ld.state_dict()
        want = ld.batch_at(2, epoch=1)
    (tmp_path / "state.json").write_text(json.dumps(state))
    run = CliRunner().invoke
    res = run(app, ["replay", str(spec), "--step", "2", "--state", str(tmp_path / "state.json"), "--json"])
    assert res.exit_code == 0, res.output
    got = [json.loads(line) for line in res.stdout.splitlines()]
    assert [(x["source_index"], x["index"], x["epoch"]) for x in got] == [(s.source_index, s.index, 1) for s in want]
    # a state is checked against the options: one given otherwise is named
    res = run(app, ["replay", str(spec), "--step", "2", "--state", str(tmp_path / "state.json"), "--seed", "1"])
    assert res.exit_code == 2 and "--seed 1 differs from the seed 7" in res.stderr
    res = run(app, ["replay", str(spec), "--step", "2", "--state", str(tmp_path / "state.json"), "--shuffle", "none"])
    assert res.exit_code == 2 and "saved for another stream: shuffle was 'global', is 'none'" in res.stderr
    res = run(app, ["replay", str(spec), "--step", "99", "--epoch", "0", "-b", "8"])
    assert res.exit_code == 2 and "--step 99: step 99 is beyond epoch 0: it has 8 steps per rank" in res.stderr
    res = run(app, ["replay", str(spec), "--step", "0", "--position", "8", "-b", "8"])
    assert res.exit_code == 2 and "--position counts --step within one epoch: give --epoch" in res.stderr
    res = run(app, ["replay", str(data / "ds"), "--step", "0", "--rank", "2", "--world-size", "2"])
    assert res.exit_code == 2 and "rank 2 is not below --world-size 2" in res.stderr


def test_replay_command_on_a_packed_plan(data, app):
    with Loader(data / "tok", batch_size=2, pack=Pack(32)) as ld:
        want = ld.batch_at(3)
    res = CliRunner().invoke(app, ["replay", str(data / "tok"), "--step", "3", "-b", "2", "--pack-length", "32"])
    assert res.exit_code == 0, res.output
    rows = [line.split() for line in res.stdout.splitlines()[2:]]
    assert [(int(r[1]), r[2], int(r[-1])) for r in rows] == [(s.row, f"{s.start}+{s.count}", s.key) for s in want]
