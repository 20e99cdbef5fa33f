"""Soak: stream many epochs and check that neither side's memory grows with the data streamed."""

from __future__ import annotations

import os
import statistics

import pytest
from net_helpers import FAST_HB, child, read_endpoint, stop

from crossfeed.net import connect

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
BATCHES_PER_EPOCH = 64
BATCH_MB = 32 * 64 * 64 * 3 * 4 / 2**20  # 1.5 MB of float32
SAMPLES_PER_EPOCH = 8
SOAK_EPOCHS = int(os.environ.get("CROSSFEED_SOAK_EPOCHS", "48"))  # a multiple of 4
LEAK_FRACTION = 64  # the bound: 1/64 of the data streamed between the two windows


def _rss_mb(pid: int | str = "self") -> float:
    """Anonymous resident memory (a leak's kind): the page cache of the mapped shards, which the
    kernel maps in and reclaims as it likes, is left out."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon")


def test_memory_stays_flat_while_streaming(tmp_path):
    """Memory is sampled by batches streamed, not by the clock, so a loaded machine streams the
    same data between samples as an idle one. Resident memory first climbs to a plateau (socket
    buffers, credits in flight, the allocator's per-thread arenas; how high depends on the
    scheduling, which is why no absolute number of MB is asserted) and must then stay there: the
    median RSS of the last quarter of the epochs may exceed the median of the second quarter by
    less than 1/64 of the data streamed in between (36 MB of 2.3 GB), so a leak of even 24 KB per
    1.5 MB batch fails (a leak raises every sample after it), while the plateau's height, whatever
    it is, does not — nor does a passing spike (the allocator's arenas on a loaded machine once
    lifted one epoch's highest by 45 MB and gave it back the next)."""
    # endless server; 64 batches/epoch of 32 x 64x64x3 float32
    server = child(
        "run_server",
        str(tmp_path / "ep"),
        "tcp://127.0.0.1:0",
        32 * BATCHES_PER_EPOCH,
        32,
        None,
        0.0,
        "",
        [64, 64, 3],
        log=tmp_path / "server.log",
    )
    total = SOAK_EPOCHS * BATCHES_PER_EPOCH
    every = BATCHES_PER_EPOCH // SAMPLES_PER_EPOCH
    rss = {"client": [], "server": []}  # one sample every `every` batches
    try:
        address = read_endpoint(tmp_path / "ep", procs=[server])
        with connect(address, with_meta=True, **FAST_HB) as client:
            for batches, (_meta, batch) in enumerate(client, 1):
                assert batch["x"].shape == (32, 64, 64, 3)
                if batches % every == 0:
                    rss["client"].append(_rss_mb())
                    rss["server"].append(_rss_mb(server.pid))
                if batches == total:
                    break
        assert server.poll() is None, (tmp_path / "server.log").read_text()
    finally:
        stop(server)
    assert batches == total, f"streamed only {batches} batches"
    quarter = len(rss["client"]) // 4
    streamed_between = 2 * quarter * every * BATCH_MB  # from the second quarter's to the last's
    bound = streamed_between / LEAK_FRACTION
    for side, samples in rss.items():
        assert len(samples) == SOAK_EPOCHS * SAMPLES_PER_EPOCH
        plateau, last = statistics.median(samples[quarter : 2 * quarter]), statistics.median(samples[3 * quarter :])
        per_epoch = [round(max(samples[i : i + SAMPLES_PER_EPOCH])) for i in range(0, len(samples), SAMPLES_PER_EPOCH)]
        assert last - plateau < bound, (
            f"{side} median RSS grew {last - plateau:.1f} MB from the second quarter of the soak to the last "
            f"(bound {bound:.0f} MB, 1/{LEAK_FRACTION} of the {streamed_between:.0f} MB streamed "
            f"in between); highest MB per epoch: {per_epoch}"
        )
