"""``crossfeed bench`` on tiny generated datasets: it runs, reports every stage, and fails cleanly.
No timing is asserted — only that the report is there and consistent."""

from __future__ import annotations

import io
import re

import numpy as np
import pytest
from typer.testing import CliRunner

import crossfeed
from crossfeed.read.options import LoaderOptions
from crossfeed.read.tools.profile import STAGES, bench_loader


@pytest.fixture
def app():
    """The real `crossfeed` app, with its one error boundary (not a hand-built Typer app)."""
    from crossfeed.cli.main import app

    return app


@pytest.fixture
def tensors(tmp_path):
    rng = np.random.default_rng(0)
    samples = [{"image": rng.integers(0, 255, (8, 8, 3), dtype=np.uint8), "label": i} for i in range(40)]
    root = tmp_path / "tensors"
    crossfeed.write_dataset(root, samples, num_shards=3).close()
    return root


@pytest.fixture
def jpegs(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(1)
    samples = []
    for i in range(12):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(buf, format="JPEG")
        samples.append({"jpeg": buf.getvalue(), "label": i})
    schema = crossfeed.Schema(
        [
            crossfeed.Feature("jpeg", "uint8", (None, None, 3), crossfeed.Encoding.IMAGE),
            crossfeed.Feature("label", "int64", (), crossfeed.Encoding.INT64),
        ]
    )
    root = tmp_path / "jpegs"
    crossfeed.write_dataset(root, samples, num_shards=2, schema=schema).close()
    return root


@pytest.mark.parametrize("shuffle", ["global", "block", "none"])
def test_bench_prints_throughput_and_every_stage(app, tensors, shuffle):
    r = CliRunner().invoke(
        app, ["bench", str(tensors), "--batch-size", "8", "--batches", "3", "--threads", "2", "--shuffle", shuffle]
    )
    assert r.exit_code == 0, r.output
    out = r.output
    assert "3 batches of 8 (24 samples)" in out
    assert f"shuffle {shuffle}" in out
    for word in ("samples/s", "MB/s", "first batch", "peak RSS"):
        assert word in out
    for stage in STAGES:
        assert re.search(rf"^\s+{stage}\s+[\d.]+ ms/batch", out, re.M), stage


def test_bench_stops_at_the_end_of_the_split(app, tensors):
    r = CliRunner().invoke(app, ["bench", str(tensors), "--batch-size", "16", "--batches", "100"])
    assert r.exit_code == 0, r.output
    assert "3 batches of 16 (40 samples)" in r.output  # 40 samples: 16 + 16 + 8
    assert "only 3 batches" in r.output


def test_bench_decodes_images(app, jpegs):
    r = CliRunner().invoke(app, ["bench", str(jpegs), "--batch-size", "4", "--batches", "2", "--threads", "1"])
    assert r.exit_code == 0, r.output
    assert "2 batches of 4 (8 samples)" in r.output


def test_report_counts_bytes_and_stages(tensors):
    rep = bench_loader(tensors, LoaderOptions.of(batch_size=10, shuffle="none", num_threads=1), batches=2)
    ds = crossfeed.open_dataset(tensors)
    sp = ds["train"]
    framed = np.concatenate([sp.index(s)[:, 1] for s in range(len(sp.shards))])
    assert rep.batches == 2 and rep.samples == 20
    assert rep.record_bytes == int(framed[:20].sum())  # file order, epoch 0: the first 20 records
    assert rep.stages.batches == 2 and rep.stages.samples == 20
    assert set(rep.stages.seconds) == set(STAGES)
    assert rep.stages.seconds["read"] > 0 and rep.stages.seconds["decode"] > 0
    assert rep.stages.seconds["transform"] == 0 and rep.stages.seconds["batch"] == 0  # no transform given
    assert rep.peak_rss > 0 and rep.first_batch_s > 0
    ds.close()


def test_report_times_a_transform(tensors):
    rep = bench_loader(
        tensors,
        LoaderOptions.of(batch_size=10, num_threads=1),
        batches=2,
        transform=lambda s: {"image": s["image"].astype(np.float32) / 255, "label": s["label"]},
    )
    assert rep.stages.seconds["transform"] > 0 and rep.stages.seconds["batch"] > 0


def test_bench_missing_dataset_is_one_line_exit_2(app, tmp_path):
    r = CliRunner().invoke(app, ["bench", str(tmp_path / "nope")])
    assert r.exit_code == 2
    assert "error:" in r.output and "Traceback" not in r.output


def test_bench_unknown_split_is_one_line_exit_2(app, tensors):
    r = CliRunner().invoke(app, ["bench", str(tensors), "--split", "validation"])
    assert r.exit_code == 2
    assert "no split 'validation'" in r.output


def test_bench_rejects_bad_options(app, tensors):
    assert CliRunner().invoke(app, ["bench", str(tensors), "--batch-size", "0"]).exit_code == 2
    assert CliRunner().invoke(app, ["bench", str(tensors), "--shuffle", "sideways"]).exit_code == 2


def test_bench_times_the_stages_the_loader_runs(tmp_path, monkeypatch):
    """Small fixed-layout records go through the rows form and the columnar decoder in the
    Loader; the stage breakdown must time exactly those, not a look-alike path."""
    rng = np.random.default_rng(0)
    crossfeed.write_dataset(
        tmp_path / "t", [{"x": rng.random(8, dtype=np.float32), "y": i} for i in range(64)], num_shards=2
    ).close()
    rep = bench_loader(tmp_path / "t", LoaderOptions.of(batch_size=16, shuffle="none"), batches=2, stage_batches=2)
    assert rep.stages.batches == 2
    # every batch built (end to end, prefetched, and the 2 timed ones) took the rows form and the cut
    frames, decode = rep.paths["frames"], rep.paths["decode"]
    assert set(frames) <= {"rows", "whole", "whole_fixup"} and set(decode) == {"cut"}, rep.paths
    assert sum(frames.values()) == decode["cut"] >= 4
    assert any(line.startswith("frames paths") for line in rep.lines())
