"""Soak: stream for a few seconds and check that neither side's memory grows."""

from __future__ import annotations

import os
import time

import pytest
from net_helpers import FAST_HB, child, read_endpoint, stop

from crossfeed.net import connect

pytestmark = pytest.mark.timeout(90)
SOAK_SECONDS = float(os.environ.get("CROSSFEED_SOAK_SECONDS", "6"))


def _rss_mb(pid: int | str = "self") -> float:
    """Anonymous resident memory (a leak's kind): the page cache of the mapped shards, which the
    kernel maps in and reclaims as it likes, is left out."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon")


def test_memory_stays_flat_while_streaming(tmp_path):
    # endless server; 64 batches/epoch of 32 x 64x64x3 float32 (1.5 MB each)
    server = child(
        "run_server",
        str(tmp_path / "ep"),
        "tcp://127.0.0.1:0",
        32 * 64,
        32,
        None,
        0.0,
        "",
        [64, 64, 3],
        log=tmp_path / "server.log",
    )
    try:
        address = read_endpoint(tmp_path / "ep", procs=[server])
        samples = {"client": [], "server": []}
        with connect(address, with_meta=True, **FAST_HB) as client:
            start = time.monotonic()
            next_sample = start + SOAK_SECONDS / 4  # first sample after warm-up
            batches = 0
            for meta, batch in client:  # noqa: B007 (the last meta says how many epochs ran)
                batches += 1
                assert batch["x"].shape == (32, 64, 64, 3)
                now = time.monotonic()
                if now >= next_sample:
                    samples["client"].append(_rss_mb())
                    samples["server"].append(_rss_mb(server.pid))
                    next_sample = now + SOAK_SECONDS / 8
                if now - start > SOAK_SECONDS:
                    break
            epochs = meta.epoch
        assert server.poll() is None, (tmp_path / "server.log").read_text()
    finally:
        stop(server)
    assert epochs >= 2 and batches > 100, f"streamed only {batches} batches"
    for side, rss in samples.items():
        assert len(rss) >= 4
        growth = max(rss[len(rss) // 2 :]) - rss[0]
        assert growth < 40, f"{side} RSS grew {growth:.1f} MB over the soak: {rss}"
