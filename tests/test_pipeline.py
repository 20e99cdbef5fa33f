"""The read pipeline as one public object (`crossfeed.read.pipeline`): built once, asked for batches
and records by every front end; its stages satisfy declared contracts; one `classify` for sources;
nobody outside it reaches into its stages."""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest
from token_data import write_tokens

import crossfeed
from crossfeed.errors import ConfigError, CorruptRecordError
from crossfeed.read.pipeline import Builder, Executor, Pipeline, SamplerLike, SourceKind, classify

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tab(tmp_path_factory):
    path = tmp_path_factory.mktemp("pipe") / "tab"
    samples = [{"x": np.full(3, i, np.float32), "y": i} for i in range(40)]
    crossfeed.write_dataset(path, samples, num_shards=3).close()
    return str(path)


def test_classify_gives_one_answer_for_every_front_end(tab):
    assert classify(tab) is SourceKind.DATASET
    assert classify(pathlib.Path(tab)) is SourceKind.DATASET
    with crossfeed.open_dataset(tab) as ds:
        assert classify(ds) is SourceKind.DATASET
    assert classify(crossfeed.Source(tab)) is SourceKind.MIXTURE
    assert classify([crossfeed.Source(tab), crossfeed.Source(tab)]) is SourceKind.MIXTURE
    assert classify(iter([{"x": np.zeros(1)}])) is SourceKind.STREAM
    assert classify([{"x": np.zeros(1)}]) is SourceKind.STREAM  # batches in hand
    for bad in ([], [tab], (1, 2)):
        with pytest.raises(ConfigError, match="a mixture is a non-empty list of crossfeed.Source"):
            classify(bad)
    with pytest.raises(ConfigError, match="got int"):
        classify(3)


def test_batches_for_index_lists_equal_the_loaders_epoch(tab):
    with crossfeed.Loader(tab, batch_size=7, seed=3) as loader:
        plan = loader.plan()
        want = list(loader)
    lists = [plan.batch(b) for b in plan.batch_ids()]
    for threads in (0, 2):
        with Pipeline.build(tab, batch_size=7, seed=3, num_threads=threads, return_index=True) as p:
            got = list(p.batches(lists))
            assert [b["__index__"].tolist() for b in got] == [i.tolist() for i in lists]
            for a, b in zip(want, got, strict=True):
                np.testing.assert_array_equal(a["x"], b["x"])
                np.testing.assert_array_equal(a["y"], b["y"])


def test_records_for_keys_are_the_decoded_records(tab):
    with crossfeed.open_dataset(tab) as ds:
        want = [int(ds["train"][k]["y"]) for k in (5, 0, 39)]
    with Pipeline.build(tab, batch_size=1) as p:
        rec = p.records([5, 0, 39])
        assert rec["y"].tolist() == want
        np.testing.assert_array_equal(rec["x"][0], np.full(3, want[0], np.float32))
        assert re.search(r"\.tfrecord", p.where(5))
        assert p.starts.tolist() == [0, 40]


def test_records_of_a_mixture_run_through_its_sources(tab, tmp_path):
    other = tmp_path / "other"
    crossfeed.write_dataset(other, [{"x": np.full(3, -i, np.float32), "y": 1000 + i} for i in range(10)]).close()
    with Pipeline.build([crossfeed.Source(tab), crossfeed.Source(str(other))], batch_size=4) as p:
        assert p.kind is SourceKind.MIXTURE
        assert p.starts.tolist() == [0, 40, 50]
        got = p.records([40, 49])["y"].tolist()
        assert sorted(got) == got and all(1000 <= y < 1010 for y in got)
        assert 0 <= int(p.records([39])["y"][0]) < 40
        assert p.where(41).startswith("source 1:")


def test_a_corrupt_record_read_by_key_names_its_shard(tmp_path):
    path = tmp_path / "bad"
    crossfeed.write_dataset(path, [{"b": np.full(4096, i % 251, np.uint8)} for i in range(8)], num_shards=1).close()
    shard = next(path.glob("*.tfrecord"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with Pipeline.build(str(path), batch_size=1) as p, pytest.raises(CorruptRecordError, match=shard.name):
        p.records(np.arange(8))


def test_the_allocator_makes_the_batch_arrays(tab):
    made = []

    def alloc(shape, dtype):
        a = np.empty(shape, dtype)
        made.append(a)
        return a

    with Pipeline.build(tab, batch_size=8, alloc=alloc) as p:  # the decoder's arrays
        p.build_batch(np.arange(8))
        assert {(a.shape, a.dtype.str) for a in made} == {((8, 3), "<f4"), ((8,), "<i8")}
        made.clear()
        p.set_allocator(None)
        p.build_batch(np.arange(8))
        assert not made
    with Pipeline.build(tab, batch_size=8, alloc=alloc, transform=lambda s: s) as p:  # the collate's
        batch = p.build_batch(np.arange(8))
        assert any(np.shares_memory(batch["x"], a) for a in made)


def test_plain_and_packed_stages_satisfy_the_same_contracts(tab, tmp_path):
    tokens = write_tokens(tmp_path / "tok", [3, 9, 5, 2, 7, 4])
    with (
        Pipeline.build(tab, batch_size=4) as plain,
        Pipeline.build(tokens, batch_size=2, pack=crossfeed.Pack(length=8)) as packed,
    ):
        for p in (plain, packed):
            for stage, contract in ((p.sampler, SamplerLike), (p.builder, Builder), (p.executor, Executor)):
                for name in contract.__annotations__:
                    assert hasattr(stage, name), (type(stage).__name__, name)
                for name, member in vars(contract).items():
                    if name.startswith("_"):
                        continue
                    if isinstance(member, property):  # a value the stage holds
                        assert hasattr(stage, name), (type(stage).__name__, name)
                    else:  # an operation
                        assert callable(getattr(stage, name)), (type(stage).__name__, name)
        assert plain.plan(0).random_access and not packed.plan(0).random_access
        rows = list(packed.batches(packed.plan(0)))
        assert sum(int((b["segment_ids"] > 0).sum()) for b in rows) == 3 + 9 + 5 + 2 + 7 + 4
        walker = packed.walker()
        again = packed.batches([walker.batch(0, 0)])
        np.testing.assert_array_equal(next(again)["tokens"], rows[0]["tokens"])
        with pytest.raises(ConfigError, match="packed"):
            plain.walker()


def test_no_front_end_reaches_into_the_pipelines_stages():
    """The Loader, adapters, lease server, profiler and process worker call the pipeline's own
    operations; only the pipeline module (and tests of it) touch ``.builder``/``.sampler``/``.executor``."""
    reach = re.compile(r"(?<!self)(?<!read)\.(builder|sampler|executor)\b(?!\s*=)")  # read.executor: an option
    offenders = []
    for folder in ("crossfeed", "adapters", "beam_jobs"):
        for f in (ROOT / folder).rglob("*.py"):
            if f.name == "pipeline.py":
                continue
            for n, line in enumerate(f.read_text().splitlines(), 1):
                code = line.split("#")[0]
                if reach.search(code) and "crossfeed.read.stages.sampler" not in code:
                    offenders.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_the_loader_is_a_cursor_over_its_pipeline(tab):
    text = (ROOT / "crossfeed/read/loader.py").read_text()
    assert len(text.splitlines()) < 400  # was 545 before the pipeline took its stages
    with crossfeed.Loader(tab, batch_size=16, seed=1) as loader:
        first = next(iter(loader))
        state = loader.state_dict()
        rest = list(loader)
    with crossfeed.Loader(tab, batch_size=16, seed=1) as again:
        again.load_state_dict(state)
        assert [b["y"].tolist() for b in again] == [b["y"].tolist() for b in rest]
    assert len(first["y"]) + sum(len(b["y"]) for b in rest) == 40
