"""``crossfeed convert …`` through typer's CliRunner, on a typer app of our own."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from conftest import requires
from typer.testing import CliRunner

from crossfeed import open_dataset
from crossfeed.beam_jobs.sample_data import make_image_folder

pytestmark = [pytest.mark.slow, requires("apache_beam")]  # slow: real Beam pipelines through the CLI


@pytest.fixture
def app():
    """The real `crossfeed` app, with its one error boundary (not a hand-built Typer app)."""
    from crossfeed.cli.main import app

    return app


def invoke(app, *args):
    r = CliRunner().invoke(app, ["convert", *map(str, args)])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception  # never a traceback
    return r


def test_convert_images_summary_and_verify(app, tmp_path):
    make_image_folder(tmp_path / "img", n_per_class=5, classes=2, size=24)
    r = invoke(
        app,
        "images",
        tmp_path / "img",
        tmp_path / "out",
        "--splits",
        "train=0.6,validation=0.4",
        "--shards",
        2,
        "--",
        "--runner",
        "DirectRunner",
    )
    assert r.exit_code == 0, r.output
    assert "wrote 10 samples" in r.output and "samples/s" in r.output and "verified" in r.output
    ds = open_dataset(tmp_path / "out")
    assert len(ds["train"]) + len(ds["validation"]) == 10 and len(ds.splits["train"].shards) == 2


def test_convert_csv_and_numpy_options(app, tmp_path):
    (tmp_path / "t.csv").write_text("a;b\n1;x\n2;y\noops\n")
    r = invoke(app, "csv", tmp_path / "t.csv", tmp_path / "o1", "--delimiter", ";")
    assert r.exit_code == 2 and "t.csv:4" in r.output  # one line on stderr since the CLI's one error boundary
    r = invoke(
        app,
        "csv",
        tmp_path / "t.csv",
        tmp_path / "o1",
        "--delimiter",
        ";",
        "--on-error",
        "skip",
        "--label",
        "b",
        "--shard-size",
        "1K",
        "--compress",
        "gzip",
    )
    assert r.exit_code == 0, r.output
    assert "skipped 1 bad records" in r.output
    ds = open_dataset(tmp_path / "o1")  # a string label is stored as class indices, names in the manifest
    assert sorted(s["label"] for s in ds["train"]) == [0, 1] and ds.metadata["class_names"] == ["x", "y"]
    np.savez(tmp_path / "a.npz", x=np.ones((6, 2), np.float32), y=np.arange(6))
    r = invoke(app, "numpy", tmp_path / "a.npz", tmp_path / "o2", "--label", "y", "--split", "test")
    assert r.exit_code == 0, r.output
    assert len(open_dataset(tmp_path / "o2")["test"]) == 6


def test_bad_parameters(app, tmp_path):
    np.save(tmp_path / "x.npy", np.arange(4))
    r = invoke(app, "numpy", tmp_path / "x.npy", tmp_path / "o", "--shards", 0)
    assert r.exit_code == 2
    r = invoke(app, "numpy", tmp_path / "x.npy", tmp_path / "o", "--shards", 2, "--shard-size", "1M")
    assert r.exit_code == 2 and "not both" in r.output
    r = invoke(app, "csv", tmp_path / "missing.csv", tmp_path / "o")
    assert r.exit_code == 2


def test_cli_module_does_not_import_beam():
    code = "import sys, crossfeed.cli.convert; sys.exit('apache_beam' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_a_bad_dask_address_is_one_clear_line(tmp_path):
    import subprocess
    import sys

    (tmp_path / "t.csv").write_text("a,b\n1,2\n3,4\n")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "crossfeed.cli.main",
            "convert",
            "csv",
            str(tmp_path / "t.csv"),
            str(tmp_path / "out"),
            "--runner",
            "DaskRunner",
            "--",
            "--dask_client_address=nonsense",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and "cannot reach a Dask scheduler" in out.stderr
