"""The process executor (ReadOptions executor="process"): the thread executor's batches, values
and order, from worker processes through shared memory; crashes reported, nothing leaked."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from loader_helpers import assert_resumes_identically, epoch_batches
from procs_helpers import FAIL_LABEL

import crossfeed
from crossfeed.errors import ConfigError, WorkerError
from crossfeed.read.loader import Loader
from crossfeed.read.options import ReadOptions

pytestmark = pytest.mark.timeout(120)  # a hang is a failure, never a stuck run
PROC = dict(executor="process", processes=2)
TESTS = os.path.dirname(__file__)


def _same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert list(x) == list(y), f"batch {i}: keys differ"
        for k in x:
            if x[k].dtype == object:
                assert [np.asarray(u).tolist() for u in x[k]] == [np.asarray(u).tolist() for u in y[k]], (i, k)
            else:
                assert x[k].dtype == y[k].dtype
                np.testing.assert_array_equal(x[k], y[k], err_msg=f"batch {i} {k}")


def _all(path, **kw) -> list[dict]:
    with Loader(path, return_index=True, **kw) as loader:
        return [dict(b) for b in loader]


@pytest.mark.parametrize(
    "kw",
    [
        dict(shuffle="global", seed=3),
        dict(shuffle="block", seed=1, block_shards=2),
        dict(shuffle="none", drop_last=True),
        dict(shuffle="global", seed=5, rank=1, world_size=3),
        dict(shuffle="global", seed=2, processes=3, prefetch=0),
    ],
)
def test_same_batches_as_threads(mixed_dataset, kw):
    path, _ = mixed_dataset
    threads = _all(path, batch_size=4, **kw)
    procs = _all(path, batch_size=4, **{**PROC, **kw})
    _same(threads, procs)


def test_python_transforms_picklable_or_by_name(mixed_dataset):
    path, _ = mixed_dataset
    from procs_helpers import add_one, flip_and_scale

    kw = dict(batch_size=5, seed=7, features=["image", "label"])
    want = _all(path, transform=flip_and_scale, batch_transform=add_one, **kw)
    assert "scaled" in want[0]
    _same(want, _all(path, transform=flip_and_scale, batch_transform=add_one, **PROC, **kw))
    _same(
        want,
        _all(path, transform="procs_helpers:flip_and_scale", batch_transform="procs_helpers:add_one", **PROC, **kw),
    )


@pytest.mark.slow
def test_resume_is_exact(mixed_dataset):
    path, _ = mixed_dataset
    assert_resumes_identically(path, stops=[0, 1, 4, 8], batch_size=4, seed=9, **PROC)
    assert epoch_batches(path, batch_size=4, seed=9, epoch=2, **PROC)[0].tolist() == (
        epoch_batches(path, batch_size=4, seed=9, epoch=2)[0].tolist()
    )


def test_kept_batches_stay_valid_and_slots_are_reused(mixed_dataset):
    """A batch kept while the workers build many more is never overwritten; dropped batches'
    slots are reused, so passes without keeping anything use a bounded number of slots."""
    path, _ = mixed_dataset
    with Loader(path, batch_size=4, seed=1, return_index=True, **PROC) as loader:
        kept = next(iter(loader))  # the rest of that pass is abandoned mid-way
        copy = {k: v.copy() for k, v in kept.items()}
        kept_image = kept["image"][1:, ::2]  # a view outlives the batch dict
        rest = []
        for _ in range(3):
            for batch in loader:
                rest.append(batch["__index__"].tolist())
                batch["image"][...] = 255  # the consumer owns its batch: writes go to its slot only
        # the abandoned pass's batches still in flight were dropped: the Loader went on after batch 0
        want = epoch_batches(path, batch_size=4, seed=1)
        assert rest[: len(want) - 1] == [b.tolist() for b in want[1:]]
        slots = loader.pipeline.executor.slots
        assert slots <= 2 * (2 + 2) + 1, slots
        _same([kept], [copy])
        del kept
        np.testing.assert_array_equal(kept_image, copy["image"][1:, ::2])
        for _ in range(2):
            for _batch in loader:
                pass
        assert loader.pipeline.executor.slots == slots  # nothing kept: the same slots, over and over


def test_transform_error_names_the_batch(mixed_dataset):
    path, _ = mixed_dataset
    with Loader(path, batch_size=4, shuffle="none", transform="procs_helpers:fail_at_label", **PROC) as loader:
        got = 0
        with pytest.raises(WorkerError) as e:
            for _ in loader:
                got += 1
        assert got == FAIL_LABEL // 4
        msg = str(e.value)
        assert f"building batch {FAIL_LABEL // 4}" in msg and f"refuses label {FAIL_LABEL}" in msg
        assert "Traceback" in msg and "worker process 1" in msg
        # the workers live on; the Loader resumes after the last batch it gave, the failing one
        with pytest.raises(
            WorkerError, match=f"building batch 0 of this pass \\(first sample id {FAIL_LABEL // 4 * 4}\\)"
        ):
            next(iter(loader))


@pytest.mark.slow
def test_corrupt_data_is_the_same_crossfeed_error(mixed_dataset):
    path, _ = mixed_dataset
    shard = sorted(p for p in path.rglob("*") if p.is_file() and "tfrecord" in p.name)[0]
    data = bytearray(shard.read_bytes())
    data[40] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(crossfeed.CrossfeedError) as threads:
        _all(path, batch_size=4, shuffle="none")
    with pytest.raises(crossfeed.CrossfeedError) as procs:
        _all(path, batch_size=4, shuffle="none", **PROC)
    assert type(procs.value) is type(threads.value) and str(procs.value) == str(threads.value)
    assert any("worker process" in n for n in getattr(procs.value, "__notes__", []))
    with Loader(path, batch_size=4, seed=2, on_error="skip", return_index=True) as threads:
        want = [dict(b) for b in threads]
        assert threads.skipped == 1
    with Loader(path, batch_size=4, seed=2, on_error="skip", return_index=True, **PROC) as procs:
        _same(want, [dict(b) for b in procs])
        assert procs.skipped == 1


def test_killed_worker_is_an_error_not_a_hang(mixed_dataset):
    path, _ = mixed_dataset
    with Loader(path, batch_size=2, seed=4, transform="procs_helpers:flip_and_scale", **PROC) as loader:
        it = iter(loader)
        next(it)
        victim = loader.pipeline.executor.pids[1]
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(WorkerError, match=r"killed by SIGKILL while building batch \d+"):
            for _ in it:
                pass
        deadline = time.monotonic() + 10  # its socket closes a moment before it is a zombie
        while _alive(victim) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not _alive(victim)
        rest = len(loader)  # the Loader resumes after the last batch it gave
        assert 0 < rest < 15 and len(list(loader)) == rest  # from fresh workers


def test_options_are_validated(mixed_dataset):
    path, _ = mixed_dataset
    with pytest.raises(ConfigError, match="executor='bogus'"):
        ReadOptions(executor="bogus")
    with pytest.raises(ConfigError, match="processes"):
        ReadOptions(executor="process", processes=0)
    with pytest.raises(ConfigError, match="pickle"):
        Loader(path, batch_size=4, transform=lambda s: s, **PROC)


PARENT = """
import os, sys, time
sys.path.insert(0, {tests!r})
from crossfeed.read.loader import Loader
loader = Loader({path!r}, batch_size=2, executor="process", processes=2, transform="procs_helpers:flip_and_scale")
it = iter(loader)
held = [next(it), next(it)]
print(" ".join(map(str, loader.pipeline.executor.pids)), flush=True)
time.sleep(60)
"""


@pytest.mark.slow
def test_kill_9_of_the_parent_leaves_no_worker_and_no_shared_memory(mixed_dataset):
    path, _ = mixed_dataset
    shm_before = sorted(os.listdir("/dev/shm"))
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(PARENT.format(tests=TESTS, path=str(path)))],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        assert any(
            os.readlink(f"/proc/{pids[0]}/fd/{fd}").startswith("/memfd:crossfeed-batch")
            for fd in os.listdir(f"/proc/{pids[0]}/fd")
        )
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids), "orphan worker processes"
    assert sorted(os.listdir("/dev/shm")) == shm_before


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_batches_are_made_in_the_slot_not_copied_into_it(mixed_dataset):
    """What a worker does, in this process: the decoder (no transform) or the transform's stack
    writes the batch's arrays straight into the slot; `finish` copies nothing of those."""
    import mmap

    from procs_helpers import flip_and_scale

    from crossfeed.read.executors.slots import SlotPool, SlotWriter

    path, _ = mixed_dataset
    pool = SlotPool()
    for transform in (None, flip_and_scale):
        with Loader(path, batch_size=4, seed=0, num_threads=0, transform=transform) as loader:
            build, ids = loader.pipeline.builder, loader.plan().batch(0)
            writer = SlotWriter(pool.take())
            build.alloc = writer.alloc
            if transform is None:
                build.reader.decoder.alloc = writer.alloc
            batch = build(ids)
            assert isinstance(batch["image"].base, mmap.mmap) and isinstance(batch["label"].base, mmap.mmap)
            used = writer.used
            layout, nbytes = writer.finish(batch)
            assert nbytes == used  # nothing was copied in
            got = pool.batch(writer.slot.id, layout, nbytes)
            np.testing.assert_array_equal(got["image"], batch["image"])
    pool.close()


def test_nothing_from_a_worker_is_unpickled(tmp_path):
    """A message is JSON plus blobs: a pickle sent down the socket is a malformed message, never
    run; crossfeed errors cross as data (type and arguments), other types do not cross at all."""
    import pickle
    import socket

    from crossfeed.errors import CorruptRecordError
    from crossfeed.read.executors.processes import Channel, exception_from_json, exception_to_json

    flag = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (open, (str(flag), "w"))

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours, theirs = Channel(a), Channel(b)
    payload = pickle.dumps(Evil())
    import struct

    a.sendall(struct.pack("<QQI", len(payload), len(payload), 0) + payload)
    with pytest.raises(WorkerError, match="malformed message"):
        theirs.recv(timeout=5)
    assert not flag.exists()
    ours.send(["done", 1, [2, None]], [b"\x00\x01", b""])
    assert theirs.recv(timeout=5) == (["done", 1, [2, None]], [b"\x00\x01", b""])
    ours.close(), theirs.close()

    e = exception_from_json(exception_to_json(CorruptRecordError("s.tfrecord", 12, "bad crc")))
    assert isinstance(e, CorruptRecordError) and (e.path, e.offset, e.reason) == ("s.tfrecord", 12, "bad crc")
    assert exception_to_json(ValueError("x")) is None
    assert exception_from_json({"type": "Evil", "args": []}) is None
    assert exception_from_json({"type": "__class__", "args": []}) is None


def test_options_cross_as_plain_values():
    from crossfeed.read.options import LoaderOptions

    opts = LoaderOptions.of(
        batch_size=7, shuffle="block", seed=3, on_error="skip", executor="process", processes=3, features=["a"]
    )
    flat = opts.flat()
    assert json.loads(json.dumps(flat)) == flat
    assert LoaderOptions.of(**flat) == opts
