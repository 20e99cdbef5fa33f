"""WriteDataset and its steps, run as real Beam pipelines (TestPipeline + assert_that)."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
from conftest import lazy_import

from crossfeed import DatasetNotFoundError, open_dataset
from crossfeed.beam_jobs.policy import DuplicateKeyError, EmptyInputError
from crossfeed.beam_jobs.records import SampleBatch, key_hashes
from crossfeed.beam_jobs.splits import SplitSpec
from crossfeed.format.schema import Encoding, Feature, Schema

beam = lazy_import("apache_beam")
fn_api_runner = lazy_import("apache_beam.runners.portability.fn_api_runner")
beam_testing = lazy_import("apache_beam.testing.test_pipeline")
beam_util = lazy_import("apache_beam.testing.util")
beam_arrays = lazy_import("crossfeed.beam_jobs.arrays")
beam_job = lazy_import("crossfeed.beam_jobs.job")
beam_steps = lazy_import("crossfeed.beam_jobs.steps")
beam_write = lazy_import("crossfeed.beam_jobs.write")
pytestmark = pytest.mark.slow  # real Beam pipelines


def pipeline():
    return beam_testing.TestPipeline(runner=fn_api_runner.FnApiRunner())


def pairs(n, offset=0):
    return [
        (f"s{i:05d}", {"x": np.int64(i), "v": np.arange(3, dtype=np.float32) + i, "name": f"n{i}"})
        for i in range(offset, offset + n)
    ]


def shard_files(root):
    return {
        f: hashlib.sha256(open(os.path.join(root, f), "rb").read()).hexdigest()
        for f in sorted(os.listdir(root))
        if ".tfrecord" in f
    }


def test_encode_step_splits_each_batch_by_key_hash(tmp_path):
    schema = Schema([Feature("x", "int64", (), Encoding.INT64)])
    cfg = beam_steps.WriteConfig(str(tmp_path), "t0", SplitSpec.parse("a=0.5,b=0.5"), schema=schema)
    batches = [SampleBatch(f"b{j}", [f"k{j}-{i}" for i in range(50)], {"x": np.arange(50)}) for j in range(3)]

    def summarise(kv):
        parts, summary = kv[1]
        return (
            kv[0],
            sorted((p.split, len(p.keys)) for p in parts),
            sum(int(c.sum()) for _, c in summary.buckets.values()),
        )

    expected = []
    for b in batches:
        _, h = key_hashes(b.keys)
        names, which = cfg.splits.assign(h)
        expected.append(
            (b.batch_id, sorted((n, int(np.sum(which == i))) for i, n in enumerate(names) if np.any(which == i)), 50)
        )
    with pipeline() as p:
        out = p | beam.Create(batches) | beam.ParDo(beam_steps.EncodeDoFn(cfg)) | beam.Map(summarise)
        beam_util.assert_that(out, beam_util.equal_to(expected))


def test_write_dataset_from_pairs(tmp_path):
    data = pairs(300)
    with pipeline() as p:
        result = p | beam.Create(data) | beam_write.WriteDataset(tmp_path, splits="train=0.8,test=0.2", num_shards=4)
        beam_util.assert_that(
            result | beam.Map(lambda r: (sum(r.samples.values()), r.shards)),
            beam_util.equal_to([(300, {"train": 4, "test": 4})]),
        )
    ds = open_dataset(tmp_path)
    assert ds.schema.names == ["x", "v", "name"]
    got = {}
    for split in ("train", "test"):
        counts = [s.num_records for s in ds.splits[split].shards]
        assert max(counts) - min(counts) <= 1
        for sample in ds[split]:
            got[sample["name"]] = (split, int(sample["x"]), sample["v"].tolist())
        # the write-time shuffle: records in (hash, key) order across the shards of the split
        xs = [f"s{int(s['x']):05d}" for s in ds[split]]
        h, _ = key_hashes(xs)
        assert np.all(np.diff(h.astype(np.float64)) >= 0)
    assert len(got) == 300
    assert all(got[f"n{i}"][1:] == (i, [i, i + 1.0, i + 2.0]) for i in range(300))
    stats = ds.splits["train"].statistics
    assert stats["x"]["count"] == len(ds["train"]) and stats["v"]["shapes"] == {"3": len(ds["train"])}
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp-")]


def test_same_input_gives_identical_shards_whatever_the_batching(tmp_path):
    rng = np.random.default_rng(1)
    np.savez(tmp_path / "a.npz", x=rng.normal(size=(700, 2, 3)).astype(np.float32), y=rng.integers(0, 5, 700))
    outs = []
    for i, rows in enumerate((64, 1000)):
        src = beam_arrays.NumpySource.scan(tmp_path / "a.npz", label="y", batch_rows=rows)
        assert len(src.units()) == (11 if rows == 64 else 1)
        beam_job.convert(src, tmp_path / f"out{i}", splits="train=0.7,validation=0.3", num_shards=3)
        outs.append(shard_files(tmp_path / f"out{i}"))
    assert outs[0] == outs[1] and len(outs[0]) == 12
    m0, m1 = ((tmp_path / f"out{i}" / "crossfeed.json").read_text() for i in range(2))
    assert m0 == m1  # statistics merge in a fixed order too


def test_shard_size_derives_the_count_and_gzip_reads_back(tmp_path):
    with pipeline() as p:
        p | beam.Create(pairs(200)) | beam_write.WriteDataset(tmp_path, shard_size=2000, compress=True)
    ds = open_dataset(tmp_path)
    info = ds.splits["train"]
    assert len(info.shards) > 3 and all(s.file.endswith(".tfrecord.gz") for s in info.shards)
    counts = [s.num_records for s in info.shards]
    assert max(counts) - min(counts) <= 1 and sum(counts) == 200
    assert sorted(int(s["x"]) for s in ds["train"]) == list(range(200))


def test_duplicate_keys_fail_and_leave_nothing(tmp_path):
    data = pairs(50) + [("s00007", {"x": np.int64(1), "v": np.zeros(3, np.float32), "name": "dup"})]
    with pytest.raises(Exception, match="s00007") as info:
        with pipeline() as p:
            p | beam.Create(data) | beam_write.WriteDataset(tmp_path, num_shards=2)
    assert isinstance(info.value, DuplicateKeyError) or "DuplicateKeyError" in str(info.value)
    with pytest.raises(DatasetNotFoundError):
        open_dataset(tmp_path)


@pytest.mark.parametrize("in_memory", [False, True])
def test_a_failed_conversion_removes_its_staged_batches(tmp_path, monkeypatch, in_memory):
    """The batches' staged records live beside the staged shards (``.tmp-<token>.batches`` in the
    output root) or, on the in-process runner, in this process's memory; a job that fails after
    staging them leaves no ``.tmp-`` entry behind and holds none of their bytes."""
    from crossfeed.beam_jobs.records import STAGED

    np.save(tmp_path / "x.npy", np.arange(300, dtype=np.int64))
    out = tmp_path / "out"
    seen, held = [], []

    def fail(self, element):
        held.append((self.cfg.token, STAGED.held(self.cfg.token)))
        if not in_memory:
            seen.append(os.path.relpath(self.cfg.batches_dir, out))
            seen.extend(os.listdir(self.cfg.batches_dir))
        raise RuntimeError("a shard writer failed")
        yield

    monkeypatch.setattr(beam_steps.WriteShardDoFn, "process", fail)
    if not in_memory:
        monkeypatch.setattr("crossfeed.beam_jobs.job.MEMORY_STAGING", 0)
    with pytest.raises(Exception, match="a shard writer failed"):
        beam_job.convert(beam_job.make_source("numpy", tmp_path / "x.npy"), out, num_shards=2)
    token, nbytes = held[0]
    if in_memory:  # every record staged in memory (300 framed int64 records), no folder
        assert nbytes > 300 * 16 and not [f for f in os.listdir(out) if f.endswith(".batches")]
    else:
        assert nbytes == 0 and seen[0].startswith(".tmp-") and seen[0].endswith(".batches") and len(seen) > 1
    assert not [f for f in os.listdir(out) if f.startswith(".tmp-")]
    assert STAGED.held(token) == 0


def test_empty_input_is_a_clear_error(tmp_path):
    with pytest.raises(Exception, match="no samples") as info:
        with pipeline() as p:
            p | beam.Create([]) | beam_write.WriteDataset(tmp_path / "out", num_shards=2)
    assert isinstance(info.value, EmptyInputError) or "EmptyInputError" in str(info.value)


def test_rerun_adds_a_split_or_replaces_the_whole_dataset(tmp_path):
    # Changed on purpose: a rerun into a dataset must say add_split (a new split) or overwrite (all of
    # it); replacing one split beside another conversion's splits is refused.
    for split, n, mode in (("train", 100, {}), ("test", 30, {"add_split": True}), ("train", 60, {"overwrite": True})):
        with pipeline() as p:
            p | beam.Create(pairs(n)) | beam_write.WriteDataset(tmp_path, split=split, num_shards=3, **mode)
    ds = open_dataset(tmp_path)
    assert len(ds["train"]) == 60 and "test" not in ds
    names = sorted(os.listdir(tmp_path))  # the third commit: generation 2's names
    assert names == sorted(
        ["crossfeed.json"] + [f"train-{i:05d}-of-00003.g2.tfrecord{x}" for i in range(3) for x in ("", ".idx")]
    )
    with pytest.raises(Exception, match="already holds a dataset"):
        with pipeline() as p:
            p | beam.Create(pairs(10)) | beam_write.WriteDataset(tmp_path, split="train", num_shards=1)
    assert len(open_dataset(tmp_path)["train"]) == 60


def test_more_shards_than_samples_gives_empty_shards(tmp_path):
    with pipeline() as p:
        p | beam.Create(pairs(3)) | beam_write.WriteDataset(tmp_path, num_shards=5)
    counts = [s.num_records for s in open_dataset(tmp_path).splits["train"].shards]
    assert sorted(counts) == [0, 0, 1, 1, 1]


def test_only_the_in_process_runner_skips_construction_type_checks():
    """The default runner builds crossfeed's own graph without Beam's construction-time type
    inference (a fixed cost of every job); any other runner gets the Beam options as given."""
    from apache_beam.options.pipeline_options import TypeOptions

    from crossfeed.beam_jobs import runner

    local = runner.runner_name(runner.make_runner(None))
    assert not runner.beam_options([], runner_name=local).view_as(TypeOptions).pipeline_type_check
    assert (
        not runner.beam_options(["--no_pipeline_type_check"], runner_name=local)
        .view_as(TypeOptions)
        .pipeline_type_check
    )
    for other in ("FlinkRunner", "SparkRunner", "DataflowRunner"):
        assert (
            runner.beam_options(["--flink_master=host:8081"], runner_name=other)
            .view_as(TypeOptions)
            .pipeline_type_check
        )
