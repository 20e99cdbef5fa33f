"""`crossfeed serve | keygen | mon | stat | show`, end to end with real processes."""

from __future__ import annotations

import numpy as np
import pytest
from net_helpers import read_endpoint, serve_child, served_batches, stop, write_image_dataset
from PIL import Image
from typer.testing import CliRunner

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def app():
    """The real `crossfeed` app, with its one error boundary (not a hand-built Typer app)."""
    from crossfeed.cli.main import app

    return app


@pytest.fixture
def dataset(tmp_path):
    path = tmp_path / "ds"
    write_image_dataset(str(path), 20)
    return str(path)


def test_serve_streams_the_loaders_batches_with_provenance(tmp_path, dataset):
    proc, ep = serve_child(
        tmp_path, dataset, "--epochs", "2", "--seed", "3", "--transform", "net_helpers:add_hundred", "--threads", "2"
    )
    got = served_batches(proc, ep, tmp_path / "serve.log")
    for epoch in (0, 1):
        ids = [i for e, b, _, _ in got if e == epoch for i in b]
        assert sorted(ids) == list(range(20))
    for _, _ids, labels, pixels in got:
        assert labels == [p + 100 for p in pixels]  # the transform ran
    for epoch in (0, 1):
        assert sorted(p for e, _, _, ps in got if e == epoch for p in ps) == list(range(20))
    assert [b for e, b, _, _ in got if e == 0] != [b for e, b, _, _ in got if e == 1]  # reshuffled


def test_serve_reports_a_bad_dataset_in_one_line(tmp_path, app):
    result = CliRunner().invoke(app, ["serve", str(tmp_path / "nothing"), "tcp://127.0.0.1:0"])
    assert result.exit_code != 0
    result = CliRunner().invoke(app, ["serve", str(tmp_path), "tcp://127.0.0.1:0", "--transform", "nope"])
    assert result.exit_code == 2 and "module:function" in result.output
    assert "Traceback" not in result.output


def test_keygen_writes_key_pairs_and_refuses_to_overwrite(tmp_path, app):
    runner = CliRunner()
    result = runner.invoke(app, ["keygen", str(tmp_path / "k")])
    assert result.exit_code == 0, result.output
    names = sorted(p.name for p in (tmp_path / "k").iterdir())
    assert names == ["client.key", "client.key_secret", "server.key", "server.key_secret"]
    assert (tmp_path / "k" / "server.key_secret").stat().st_mode & 0o077 == 0
    again = runner.invoke(app, ["keygen", str(tmp_path / "k"), "server"])
    assert again.exit_code == 2 and "exists" in again.output


def test_mon_stat_show_watch_a_broadcast_stream(tmp_path, dataset, app):
    proc, ep = serve_child(tmp_path, dataset, "--mode", "broadcast")  # endless until killed
    try:
        address = read_endpoint(ep, procs=[proc])
        runner = CliRunner()
        mon = runner.invoke(app, ["mon", address, "-c", "5", "--every", "0.1", "--timeout", "10"])
        assert mon.exit_code == 0, mon.output
        assert "total: 5 batches" in mon.output and "MB/s" in mon.output

        stat = runner.invoke(app, ["stat", address, "-c", "4", "--timeout", "10"])
        assert stat.exit_code == 0, stat.output
        rows = {line.split()[0]: line for line in stat.output.splitlines()[1:]}
        # broadcast joins mid-stream (lossy by design): the batches seen are some of the epoch's
        stats = dict(kv.split("=") for kv in rows["image"].split() if "=" in kv)
        assert "uint8" in rows["image"] and 0 <= float(stats["min"]) < float(stats["max"]) <= 19
        assert "int64" in rows["label"] and "std=" in rows["label"]

        png = tmp_path / "grid.png"
        show = runner.invoke(app, ["show", address, "-o", str(png), "--timeout", "10"])
        assert show.exit_code == 0, show.output
        with Image.open(png) as img:
            assert img.format == "PNG" and img.width >= 8 * 2 and img.height > 8
            assert np.asarray(img).max() > 0
    finally:
        stop(proc)


def test_watchers_report_a_dead_address_in_one_line(app, tmp_path):
    result = CliRunner().invoke(app, ["stat", f"ipc://{tmp_path}/none.sock", "-c", "1", "--timeout", "0.5"])
    assert result.exit_code == 2 and "no batch received" in result.output
