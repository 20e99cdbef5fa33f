"""Where a conversion stages its encoded batches until the shard writers copy them: in files of
the job's staging folder, or — on the in-process runner, within `job.MEMORY_STAGING` bytes — in
this process's memory (`crossfeed.beam_jobs.records.STAGED`). Wherever they were, the dataset is
the same bytes."""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import lazy_import, requires
from test_convert_golden import GOLDEN, convert_text, summary

beam_runner = lazy_import("crossfeed.beam_jobs.runner")
pytestmark = requires("apache_beam", "tokenizers")


@pytest.mark.slow
@pytest.mark.parametrize("budget", [0, 200_000])  # all on disk; the first batches in memory, the rest on disk
def test_batches_staged_on_disk_or_partly_in_memory_give_the_same_bytes(tmp_path, monkeypatch, budget):
    from crossfeed.beam_jobs.records import STAGED

    monkeypatch.setattr("crossfeed.beam_jobs.job.MEMORY_STAGING", budget)
    put = STAGED.put
    held = []

    def spy(token, part, data, limit):
        held.append(put(token, part, data, limit))
        return held[-1]

    monkeypatch.setattr(STAGED, "put", spy)
    out = convert_text(tmp_path, "a", num_shards=3)
    assert summary(out) == GOLDEN["text-3"]
    if budget:
        assert True in held and False in held  # some batches held, then the budget was spent
    else:
        assert held == []


def test_a_step_that_does_not_share_the_encoders_memory_names_the_batch(tmp_path):
    """A part held in memory is a handle of a few fields (its records' hashes, keys and bytes stay
    in the encoding process); one reaching a step in another process (a runner that is not
    in-process, given a memory budget by mistake) is a clear error, never a wrong shard."""
    import pickle

    from crossfeed.beam_jobs import steps
    from crossfeed.beam_jobs.records import STAGED, HeldPart, SampleBatch
    from crossfeed.beam_jobs.splits import SplitSpec
    from crossfeed.errors import CrossfeedError
    from crossfeed.format.schema import Encoding, Feature, Schema

    schema = Schema([Feature("v", "float32", (16,), Encoding.TENSOR)])
    cfg = steps.WriteConfig(str(tmp_path), "t1", SplitSpec.single("train"), schema=schema, memory_budget=1 << 20)
    batch = SampleBatch("b0", [f"k{i}" for i in range(200)], {"v": np.ones((200, 16), np.float32)})
    [(_, ([part], _))] = list(steps.EncodeDoFn(cfg).process(batch))
    assert isinstance(part, HeldPart) and (part.lo, part.hi) == (0, 200) and len(pickle.dumps(part)) < 200
    assert STAGED.held("t1") > 200 * 64 and not os.path.exists(cfg.batches_dir)
    whole = part.resolve("t1")
    assert whole.keys == sorted(whole.keys, key=lambda k: whole.hashes[whole.keys.index(k)])
    assert list(whole.hashes) == sorted(whole.hashes) and whole.in_memory
    STAGED.drop("t1")  # as if in another process
    with pytest.raises(CrossfeedError, match=f"batch {part.name}: its records were staged in the memory"):
        part.resolve("t1")
    with pytest.raises(Exception, match="memory_budget must be"):
        steps.WriteConfig(str(tmp_path), "t2", SplitSpec.single("train"), memory_budget=-1)


def test_only_the_in_process_runner_stages_in_memory():
    assert beam_runner.in_process(None) and beam_runner.in_process("DirectRunner", ["--direct_num_workers=2"])
    assert beam_runner.in_process(None, ["--direct_running_mode=multi_threading"])
    assert not beam_runner.in_process(None, ["--direct_running_mode=multi_processing"])
    assert not beam_runner.in_process(None, ["--runner=DaskRunner"]) and not beam_runner.in_process("FlinkRunner")


def test_a_shards_hashing_thread_ends_with_it_and_a_forked_child_hashes_too(tmp_path):
    """A large write's sha256 runs on a thread of the shard file's own, which ends when the file
    is closed (no thread is left behind); a process forked from one that hashed this way hashes
    its own shards right, and does not hang."""
    import hashlib
    import multiprocessing
    import threading

    from crossfeed.format.tfrecord import RecordWriter

    big = os.urandom(3 << 20)
    with RecordWriter(tmp_path / "parent.tfrecord") as w:
        w.write(big)
        assert [t for t in threading.enumerate() if t.name.startswith("crossfeed-sha256")]
    assert not [t for t in threading.enumerate() if t.name.startswith("crossfeed-sha256")]
    with open(tmp_path / "parent.tfrecord", "rb") as f:
        assert w.sha256 == hashlib.sha256(f.read()).hexdigest()
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        sha = pool.apply_async(_child_sha, (str(tmp_path / "child.tfrecord"), big)).get(timeout=60)
    with open(tmp_path / "child.tfrecord", "rb") as f:
        assert sha == hashlib.sha256(f.read()).hexdigest()


def _child_sha(path: str, payload: bytes) -> str:
    from crossfeed.format.tfrecord import RecordWriter

    with RecordWriter(path) as w:
        w.write(payload)
    return w.sha256


@pytest.mark.slow
def test_every_direct_running_mode_writes_the_same_bytes(tmp_path):
    """In memory (the default), two worker threads sharing the staged batches, two worker
    processes staging them on disk: one dataset, byte for byte."""
    import hashlib

    beam_job = lazy_import("crossfeed.beam_jobs.job")
    np.save(tmp_path / "x.npy", np.arange(3000, dtype=np.int64))
    modes = ([], ["--direct_running_mode=multi_threading", "--direct_num_workers=2"])
    modes += (["--direct_running_mode=multi_processing", "--direct_num_workers=2"],)
    digests = []
    for i, args in enumerate(modes):
        out = tmp_path / f"out{i}"
        src = beam_job.make_source("numpy", tmp_path / "x.npy", batch_rows=200)
        assert beam_job.convert(src, out, num_shards=3, beam_args=args).total_samples == 3000
        digests.append({f: hashlib.sha256((out / f).read_bytes()).hexdigest() for f in sorted(os.listdir(out))})
    assert digests[0] == digests[1] == digests[2] and len(digests[0]) == 7  # 3 shards, 3 indexes, the manifest


def test_a_shards_hash_may_lag_its_writes_and_still_hashes_what_was_written(tmp_path):
    """Large writes are hashed on the file's thread while the next ones are made; the hash is
    of the bytes written, even when the caller changes its buffer at once, and final at close."""
    import hashlib

    from crossfeed.format.tfrecord import RecordWriter

    buf = bytearray(os.urandom(1 << 20))
    with RecordWriter(tmp_path / "s.tfrecord") as w:
        for i in range(24):
            w.write_framed(buf if i % 2 else bytes(buf), np.array([len(buf)]))
            buf[: 1 << 10] = os.urandom(1 << 10)  # changed at once
        w.write(b"a small record after them")
    with open(tmp_path / "s.tfrecord", "rb") as f:
        data = f.read()
    assert w.sha256 == hashlib.sha256(data).hexdigest() and w.num_bytes == len(data)


def _finish_spy(monkeypatch, fail: str | None = None):
    """Spies on `ShardSink.finish`: each call's thread, and the most running at once; the shard
    whose name holds ``fail`` fails to fsync (a full disk)."""
    import threading

    from crossfeed.write import staging

    seen = {"threads": [], "running": 0, "most": 0}
    lock = threading.Lock()
    finish, fsync = staging.ShardSink.finish, os.fsync

    def spy(self, lengths=None):
        with lock:
            seen["threads"].append(threading.current_thread().name)
            seen["running"] += 1
            seen["most"] = max(seen["most"], seen["running"])
        try:
            return finish(self, lengths)
        finally:
            with lock:
                seen["running"] -= 1

    def failing(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if fail is not None and fail in os.path.basename(path):
            raise OSError(28, "No space left on device", path)
        fsync(fd)

    monkeypatch.setattr(staging.ShardSink, "finish", spy)
    monkeypatch.setattr(os, "fsync", failing)
    return seen


def _crossfeed_threads() -> list[str]:
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith("crossfeed-")]


def test_on_the_in_process_runner_shards_finish_on_a_thread_one_at_a_time(tmp_path, monkeypatch):
    beam_job = lazy_import("crossfeed.beam_jobs.job")
    seen = _finish_spy(monkeypatch)
    np.save(tmp_path / "x.npy", np.arange(3000, dtype=np.int64))
    src = beam_job.make_source("numpy", tmp_path / "x.npy", batch_rows=200)
    assert beam_job.convert(src, tmp_path / "out", num_shards=4).total_samples == 3000
    assert seen["threads"] == ["crossfeed-finish-shard"] * 4 and seen["most"] == 1
    assert not _crossfeed_threads()  # every finishing (and hashing) thread ended with the job


@pytest.mark.parametrize("shard", [0, 3])  # raised by the next shard's hand-off; by the commit, the last
def test_a_shard_that_fails_to_finish_on_its_thread_is_named_and_nothing_is_committed(tmp_path, monkeypatch, shard):
    beam_job = lazy_import("crossfeed.beam_jobs.job")
    _finish_spy(monkeypatch, fail=f"-train-{shard:05d}.tfrecord")
    np.save(tmp_path / "x.npy", np.arange(3000, dtype=np.int64))
    src = beam_job.make_source("numpy", tmp_path / "x.npy", batch_rows=200)
    out = tmp_path / "out"
    with pytest.raises(Exception, match=rf"shard {shard} of split 'train' \(.*\): finishing it failed \(OSError"):
        beam_job.convert(src, out, num_shards=4)
    assert not (out / "crossfeed.json").exists()
    assert not [n for n in os.listdir(out) if n.startswith(".tmp-")] if out.exists() else True
    assert not _crossfeed_threads()


def test_a_finishing_another_process_did_is_a_clear_error_and_drop_waits_for_its_thread():
    import threading

    from crossfeed.beam_jobs.handoff import ShardFinishing
    from crossfeed.errors import CrossfeedError

    finishing, go = ShardFinishing(), threading.Event()
    pending = finishing.hand_off("t1", "train", 0, "shard 0", lambda: go.wait(30) and "staged")  # type: ignore[arg-type, return-value]
    with pytest.raises(CrossfeedError, match="shard 1 of split 'train': it was finished by a process"):
        finishing.result("t1", "train", 1)
    go.set()
    assert finishing.result("t1", pending.split, pending.index) == "staged"
    finishing.drop("t1")
    assert not _crossfeed_threads()
    with pytest.raises(CrossfeedError, match="shard 0 of split 'train': it was finished by a process"):
        finishing.result("t1", "train", 0)
