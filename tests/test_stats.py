"""The Loader's stage metrics (`crossfeed.read.metrics`): what `Loader.stats()` counts, with
threads, in the consumer's thread and in worker processes, through the shard cache; the verdict
on three pipelines whose bottleneck is known (a slow decode, a slow transform, a slow consumer);
``log_stats``; ``crossfeed bench``. No timing is asserted: only counts, structure, and which
stage is named when one stage is made far slower than the others."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import time

import numpy as np
import pytest
from typer.testing import CliRunner

import crossfeed
from crossfeed.errors import ConfigError
from crossfeed.format import tfrecord
from crossfeed.read import metrics
from crossfeed.read.loader import Loader
from crossfeed.read.metrics import BUILD, STAGES, StageStat, Stats, Verdict

N = 40


@pytest.fixture
def small(tmp_path):
    rng = np.random.default_rng(0)
    root = tmp_path / "small"
    samples = [{"x": rng.random(4, dtype=np.float32), "y": i} for i in range(N)]
    crossfeed.write_dataset(root, samples, num_shards=3).close()
    return root


@pytest.fixture
def pngs(tmp_path):
    """Large PNGs (512×512, smooth: 1.5 KB each) — slow to decode, quick to read."""
    from PIL import Image

    yy, xx = np.mgrid[0:512, 0:512]
    samples = []
    for i in range(8):
        im = np.stack([(xx + i) % 256, (yy * 2) % 256, (xx + yy) % 256], -1).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(im).save(buf, format="PNG")
        samples.append({"image": buf.getvalue(), "label": i})
    schema = crossfeed.Schema(
        [
            crossfeed.Feature("image", "uint8", (None, None, 3), crossfeed.Encoding.IMAGE),
            crossfeed.Feature("label", "int64", (), crossfeed.Encoding.INT64),
        ]
    )
    root = tmp_path / "pngs"
    crossfeed.write_dataset(root, samples, num_shards=2, schema=schema).close()
    return root


def _payload_bytes(root) -> int:
    """Every record's payload bytes, read back with the TFRecord reader (not the Loader)."""
    ds = crossfeed.open_dataset(root)
    total = 0
    for shard in ds["train"].shards:
        data = (root / shard.file).read_bytes()
        total += sum(len(p) for _, p in tfrecord.records(data, shard.file))
    ds.close()
    return total


def plus_one(sample: dict) -> dict:
    """A module-level transform (worker processes import it by reference)."""
    return {"x": sample["x"], "y": sample["y"] + 1}


def slow_transform(sample: dict) -> dict:
    time.sleep(0.005)
    return sample


def busy_transform(sample: dict) -> dict:
    """A transform that computes in Python for about 5 ms, holding the GIL."""
    end = time.thread_time() + 0.005
    while time.thread_time() < end:
        pass
    return sample


# -- what is counted ----------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [{}, {"transform": plus_one}, {"transform": plus_one, "num_threads": 1}])
def test_every_batch_is_counted_in_every_stage_it_went_through(small, kw):
    with Loader(small, batch_size=8, **kw) as loader:
        assert loader.stats().batches == 0 and not any(s.count for s in loader.stats().stages.values())
        got = sum(len(b["y"]) for b in loader)
        st = loader.stats()
    assert got == N and st.batches == 5 and st.samples == N and st.epochs == 1
    assert st.bytes == _payload_bytes(small)
    transformed = "transform" in kw
    # built on threads (a transform): each has a hand-over; small records without one are built
    # in the consumer's thread, where there is none
    ran = {"plan", "read", "decode", *(("transform", "batch", "handover") if transformed else ())}
    assert {s for s in STAGES if st.stages[s].count} == ran
    assert all(st.stages[s].count == 5 for s in ran)
    assert all(st.stages[s].seconds > 0 for s in ran)  # timed, not only counted
    assert st.threads == (kw.get("num_threads", 2) if transformed else 0)  # small records: the consumer's thread
    assert st.wait_seconds > 0 and st.consumer_seconds > 0 and st.elapsed_seconds > 0
    assert st.cache_hits == st.cache_misses == st.cache_bytes == 0


def test_counters_are_cumulative_and_since_gives_an_epoch(small):
    with Loader(small, batch_size=8, transform=plus_one) as loader:
        list(loader)
        first = loader.stats()
        list(loader)
        both = loader.stats()
    assert both.batches == 10 and both.samples == 2 * N and both.bytes == 2 * first.bytes and both.epochs == 2
    second = both.since(first)
    assert (second.batches, second.samples, second.bytes, second.epochs) == (5, N, first.bytes, 1)
    assert all(second.stages[s].count == first.stages[s].count for s in STAGES)
    assert second.stages["decode"].seconds == pytest.approx(
        both.stages["decode"].seconds - first.stages["decode"].seconds
    )
    assert both.since(both).batches == 0 and both.since(both).stages["read"] == StageStat(0.0, 0)


def test_a_broken_off_iteration_counts_what_was_delivered(small):
    with Loader(small, batch_size=8, transform=plus_one) as loader:
        for i, _ in enumerate(loader):
            if i == 1:
                break
        st = loader.stats()
    assert st.batches == 2 and st.samples == 16 and st.epochs == 0
    assert st.stages["read"].count >= 2  # batches built ahead of the consumer count as built


@pytest.mark.parametrize("kw", [{}, {"transform": plus_one}])
def test_the_counters_are_current_between_batches(small, kw):
    """Asked mid-epoch (the consumer holding its batch), every batch delivered so far is counted."""
    with Loader(small, batch_size=8, **kw) as loader:
        it = iter(loader)
        for n in (1, 2):
            next(it)
            st = loader.stats()
            assert (st.batches, st.samples) == (n, 8 * n) and st.wait_seconds > 0
            # in the consumer's thread exactly these were planned and built; threads build ahead
            built = [st.stages[s].count for s in ("plan", "read", "decode")]
            assert built == [n] * 3 if not kw else min(built) >= n
        assert loader.stats().consumer_seconds > 0  # its own time with the first batch


def test_each_thread_adds_to_its_own_tally_and_stats_sums_them():
    import threading

    meter = metrics.Meter()
    seen = []

    def work():
        t = meter.tally()
        assert meter.tally() is t  # one per thread
        seen.append(t)
        for _ in range(1000):
            t.read += 3
            t.n_read += 1

    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len({id(t) for t in seen}) == 4
    assert meter.stats().stages["read"] == StageStat(4 * 3000 / 1e9, 4000)
    drained = meter.drain()
    assert drained["n"] == {"read": 4000} and drained["ns"] == {"read": 12000}
    assert meter.drain()["n"] == {}  # since the last drain
    parent = metrics.Meter()
    parent.merge(drained, done=0)
    parent.merge({"ns": {"read": -1, "nope": 5}, "n": "x", "bytes": True})  # ignored
    assert (
        parent.stats().stages["read"] == StageStat(12000 / 1e9, 4000) and parent.stats().stages["handover"].count == 1
    )


def test_worker_processes_send_their_stage_times_with_each_batch(small):
    with Loader(small, batch_size=8, transform=plus_one, executor="process", processes=2) as loader:
        assert sorted(int(v) for b in loader for v in b["y"]) == list(range(1, N + 1))
        st = loader.stats()
    # the parent never builds a batch: every read, decode, transform and batch was timed in a worker
    assert st.batches == 5 and st.samples == N and st.processes == 2 and st.threads == 0
    assert all(st.stages[s].count == 5 for s in ("plan", "read", "decode", "transform", "batch", "handover"))
    assert st.bytes == _payload_bytes(small)
    assert st.verdict().workers == "2 worker processes"


def test_the_shard_cache_counts_downloads_then_hits(tmp_path, small):
    from http_helpers import serving

    shards = len(crossfeed.open_dataset(small)["train"].shards)
    sizes = sum(s.num_bytes for s in crossfeed.open_dataset(small)["train"].shards)
    with serving(small) as url:
        with Loader(url, batch_size=8, cache_dir=str(tmp_path / "c")) as cold:
            list(cold)
            st = cold.stats()
        assert st.cache_misses == shards and st.cache_bytes == sizes and st.bytes == _payload_bytes(small)
        with Loader(url, batch_size=8, cache_dir=str(tmp_path / "c")) as warm:
            list(warm)
            st = warm.stats()
        assert st.cache_misses == 0 and st.cache_bytes == 0 and st.cache_hits >= shards


def test_metrics_switched_off_time_nothing(small, monkeypatch):
    """The overhead benchmark's switch: the Loader runs its code paths of before metrics."""
    monkeypatch.setattr(metrics, "ENABLED", False)
    with Loader(small, batch_size=8, transform=plus_one) as loader:
        assert loader.pipeline.meter is None and loader.pipeline.builder.meter is None
        assert sum(len(b["y"]) for b in loader) == N
        assert loader.stats() == Stats()


# -- the verdict on pipelines whose bottleneck is known -------------------------------------------


def test_a_slow_decode_is_named(pngs):
    with Loader(pngs, batch_size=4) as loader:
        list(loader)
        v = loader.stats().verdict()
    assert v.input_bound and v.bottleneck == "decode" and v.share > 0.5
    assert str(v).startswith("input-bound: the trainer waited") and "decode takes" in str(v)


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_a_slow_transform_is_named_and_the_advice_follows_its_cpu_time(small, executor):
    """A transform that waits (sleeps: the GIL released) gets more threads or processes as advice,
    never executor='process'; one that computes in Python keeps executor='process' on threads."""
    with Loader(small, batch_size=4, transform=busy_transform, executor=executor) as loader:
        list(loader)
        st = loader.stats()
    v = st.verdict()
    assert v.input_bound and v.bottleneck == "transform" and v.share > 0.5
    assert st.busy("transform") > metrics.WAITING
    assert ("executor='process'" in v.advice) == (executor == "thread") and "waits" not in v.advice
    with Loader(small, batch_size=4, transform=slow_transform, executor=executor) as loader:
        list(loader)
        st = loader.stats()
    v = st.verdict()
    assert v.input_bound and v.bottleneck == "transform" and st.busy("transform") < metrics.WAITING
    assert "executor='process'" not in v.advice and "the transform waits most of its time" in v.advice
    assert ("more num_threads (now 2)" in v.advice) == (executor == "thread")
    assert ("more processes (now 2)" in v.advice) == (executor == "process")


def test_a_waiting_batch_transform_is_told_apart_too(small):
    def waits(batch):
        time.sleep(0.02)
        return batch

    with Loader(small, batch_size=4, batch_transform=waits) as loader:
        list(loader)
        st = loader.stats()
    assert st.stages["transform"].count == st.stages["transform"].count > 0
    assert st.busy("transform") < metrics.WAITING and "num_threads" in st.verdict().advice


def test_a_slow_consumer_is_not_input_bound(small):
    with Loader(small, batch_size=4, transform=plus_one) as loader:
        it = iter(loader)
        next(it)
        start = loader.stats()  # from the first batch on: the Loader's start-up is not the question
        for _ in it:
            time.sleep(0.05)
        v = loader.stats().since(start).verdict()
    assert not v.input_bound and v.wait_ratio < metrics.INPUT_BOUND
    assert str(v).startswith("not input-bound: the trainer waited")


# -- the Stats and Verdict objects -------------------------------------------------------------------


def _stats(wait, consumer, **stage_seconds) -> Stats:
    return Stats(
        batches=10,
        stages={s: StageStat(v, 10) for s, v in stage_seconds.items()},
        wait_seconds=wait,
        consumer_seconds=consumer,
        threads=2,
    )


def test_the_verdict_from_the_numbers():
    v = _stats(3.8, 6.2, read=0.5, decode=7.1, transform=2.4).verdict()
    assert (v.input_bound, v.bottleneck, v.workers) == (True, "decode", "2 threads")
    assert v.wait_ratio == pytest.approx(0.38) and v.share == pytest.approx(0.71)
    assert str(v).startswith(
        "input-bound: the trainer waited 38% of the time; decode takes 71% of build time on 2 threads; try"
    )
    quiet = _stats(0.2, 9.8, decode=1.0).verdict()
    assert not quiet.input_bound and str(quiet) == "not input-bound: the trainer waited 2% of the time"
    assert quiet.bottleneck == "decode"  # named even when it does not hold the consumer up
    assert _stats(0.0, 0.0).verdict() == Verdict(False, 0.0, None, 0.0, _stats(0, 0).verdict().advice, "2 threads")
    # the hand-over is not build time: a large one does not make it the bottleneck
    assert _stats(5, 5, read=1.0, handover=50.0).verdict().bottleneck == "read"
    # the transform's CPU time decides its advice; unknown, the GIL's
    waits = dataclasses.replace(_stats(5, 5), stages={"transform": StageStat(4.0, 10, 0.2)})
    gil = dataclasses.replace(_stats(5, 5), stages={"transform": StageStat(4.0, 10, 1.9)})  # 2 threads, one GIL
    assert gil.busy("transform") == pytest.approx(0.95) and "executor='process'" in gil.verdict().advice
    computes = dataclasses.replace(_stats(5, 5), stages={"transform": StageStat(4.0, 10, 3.9)})
    unknown = dataclasses.replace(_stats(5, 5), stages={"transform": StageStat(4.0, 10)})
    assert "more num_threads (now 2)" in waits.verdict().advice and "5%" in waits.verdict().advice
    assert "executor='process'" in computes.verdict().advice == unknown.verdict().advice
    assert waits.since(_stats(0, 0)).stages["transform"].cpu_seconds == 0.2
    assert metrics.combine([waits, computes]).stages["transform"] == StageStat(8.0, 20, 4.1)
    assert metrics.combine([waits, unknown]).stages["transform"].cpu_seconds is None


def test_as_dict_is_flat_json_with_stable_keys():
    d = _stats(1.0, 3.0, decode=2.0).as_dict()
    assert json.loads(json.dumps(d)) == d and all(isinstance(v, (int, float)) for v in d.values())
    assert d["wait_ratio"] == 0.25 and d["stage_decode_seconds"] == 2.0 and d["stage_decode_count"] == 10
    assert {f"stage_{s}_{k}" for s in STAGES for k in ("seconds", "count")} <= set(d)
    assert set(Stats().as_dict()) == set(d)


def test_stats_are_frozen_and_checked():
    st = _stats(1.0, 1.0, decode=1.0)
    with pytest.raises(AttributeError):
        st.batches = 3
    with pytest.raises(TypeError):
        st.stages["decode"] = StageStat()
    with pytest.raises(ConfigError, match="unknown stages"):
        Stats(stages={"fetch": StageStat()})
    with pytest.raises(ConfigError):
        StageStat(-1.0, 0)
    with pytest.raises(ConfigError):
        Verdict(True, 1.5, None, 0.0, "")
    with pytest.raises(ConfigError):
        st.since({"batches": 1})
    assert set(BUILD) == set(STAGES) - {"handover"}


def test_combine_adds_loaders():
    a, b = _stats(1.0, 2.0, decode=1.0), _stats(3.0, 4.0, read=2.0)
    c = metrics.combine([a, b])
    assert (c.batches, c.wait_seconds, c.consumer_seconds) == (20, 4.0, 6.0)
    assert c.stages["decode"] == StageStat(1.0, 10) and c.stages["read"] == StageStat(2.0, 10)
    assert c.stages["plan"] == StageStat(0.0, 0) and metrics.combine([]) == Stats()


# -- log_stats, and crossfeed bench -----------------------------------------------------------------


def test_log_stats_logs_one_line_per_epoch(small, caplog):
    with caplog.at_level(logging.INFO, logger="crossfeed.read.loader"):
        with Loader(small, batch_size=8, transform=plus_one, log_stats=True) as loader:
            list(loader)
            list(loader)
        with Loader(small, batch_size=8) as quiet:
            list(quiet)
    lines = [r.getMessage() for r in caplog.records if "crossfeed epoch" in r.getMessage()]
    assert len(lines) == 2 and lines[0].startswith("crossfeed epoch 0: 5 batches (40 samples")
    assert lines[1].startswith("crossfeed epoch 1: 5 batches (40 samples")  # the epoch's own, not cumulative
    assert all("input-bound" in line and "on 2 threads" in line for line in lines)


def test_bench_prints_the_verdict(small):
    from crossfeed.cli.main import app

    r = CliRunner().invoke(app, ["bench", str(small), "--batch-size", "8", "--batches", "3"])
    assert r.exit_code == 0, r.output
    verdict = [line for line in r.output.splitlines() if line.startswith("verdict ")]
    assert len(verdict) == 1 and "input-bound: the trainer waited" in verdict[0]
    assert any(line.startswith("as run ") and "3 batches (24 samples" in line for line in r.output.splitlines())
