"""A conversion killed half-way (SIGKILL after its first shard is staged) leaves no dataset a
reader accepts, and the next run replaces everything cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import lazy_import, requires

from crossfeed import DatasetNotFoundError, open_dataset

beam_job = lazy_import("crossfeed.beam_jobs.job")
pytestmark = [pytest.mark.slow, requires("apache_beam")]  # slow: kill tests

KILLER = textwrap.dedent("""
    import os, signal, sys
    from crossfeed.beam_jobs import job, steps
    from crossfeed.beam_jobs.job import convert, make_source

    if len(sys.argv) > 3:
        job.MEMORY_STAGING = int(sys.argv[3])  # 0: the batches staged on disk

    real = steps.WriteShardDoFn.process

    def process(self, element):
        for out in real(self, element):
            os.kill(os.getpid(), signal.SIGKILL)  # killed with one shard staged, before the commit
            yield out

    steps.WriteShardDoFn.process = process
    convert(make_source("numpy", sys.argv[1]), sys.argv[2], num_shards=4, overwrite=True)
""")


def run_killed(tmp_path, src, out, *memory):
    script = tmp_path / "killer.py"
    script.write_text(KILLER)
    args = [sys.executable, str(script), str(src), str(out), *map(str, memory)]
    proc = subprocess.run(args, capture_output=True, timeout=240)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]


@pytest.mark.parametrize("on_disk", [False, True])
def test_killed_conversion_leaves_nothing_readable_and_rerun_is_clean(tmp_path, on_disk):
    np.save(tmp_path / "x.npy", np.arange(400, dtype=np.int64))
    out = tmp_path / "out"
    run_killed(tmp_path, tmp_path / "x.npy", out, *([0] if on_disk else []))
    leftovers = os.listdir(out)
    assert any(f.startswith(".tmp-") for f in leftovers) and "crossfeed.json" not in leftovers
    batches = [f for f in leftovers if f.startswith(".tmp-") and f.endswith(".batches")]
    assert bool(batches) == on_disk  # the batches' staged records: on disk, or in the killed process's memory
    with pytest.raises(DatasetNotFoundError):
        open_dataset(out)
    r = beam_job.convert(beam_job.make_source("numpy", tmp_path / "x.npy"), out, num_shards=4)
    assert r.total_samples == 400
    assert sorted(os.listdir(out)) == sorted(
        ["crossfeed.json"] + [f"train-{i:05d}-of-00004.tfrecord{x}" for i in range(4) for x in ("", ".idx")]
    )


def test_killed_rewrite_keeps_the_old_dataset_whole(tmp_path):
    np.save(tmp_path / "x.npy", np.arange(100, dtype=np.int64))
    out = tmp_path / "out"
    beam_job.convert(beam_job.make_source("numpy", tmp_path / "x.npy"), out, num_shards=2)
    np.save(tmp_path / "x.npy", np.arange(1000, 1300, dtype=np.int64))
    run_killed(tmp_path, tmp_path / "x.npy", out)
    old = open_dataset(out)  # the commit never started: the old dataset is intact and consistent
    assert sorted(int(s["x"]) for s in old["train"]) == list(range(100))
    beam_job.convert(beam_job.make_source("numpy", tmp_path / "x.npy"), out, num_shards=3, overwrite=True)
    new = open_dataset(out)
    assert sorted(int(s["x"]) for s in new["train"]) == list(range(1000, 1300))
    assert not [f for f in os.listdir(out) if f.startswith(".tmp-") or "-of-00002" in f]
