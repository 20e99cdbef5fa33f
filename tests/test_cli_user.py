"""A new user's first hour with the real `crossfeed` command: the one error boundary, --version,
help on every option, convert with several inputs and globs, type inference that explains itself,
quiet pipes and logs, progress, and the watch tools on photos of different sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import typer
from typer.testing import CliRunner
from user_data import WINE_BAD_LINE, parquet_parts, photos_folder, wine_csv
from user_data import crossfeed as run_cli

import crossfeed
from crossfeed.cli.main import app

pytestmark = pytest.mark.timeout(240)


def invoke(*args):
    """The real app in-process; a traceback (an exception other than SystemExit) fails."""
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


# -- the one error boundary -------------------------------------------------------------------------


def test_unknown_split_is_one_line_everywhere(mixed_dataset):
    root, _ = mixed_dataset
    ds = crossfeed.open_dataset(root)
    with pytest.raises(crossfeed.SplitNotFoundError) as e:
        ds["nope"]
    assert isinstance(e.value, KeyError) and isinstance(e.value, crossfeed.CrossfeedError)
    assert str(e.value).endswith("no split 'nope'; it has ['train']")  # not a quoted KeyError
    for args in (
        ["serve", root, "tcp://127.0.0.1:0", "--split", "nope"],
        ["head", root, "--split", "nope"],
        ["verify", root, "--split", "nope"],
        ["bench", root, "--split", "nope"],
    ):
        r = invoke(*args)
        assert r.exit_code == 2 and r.output.strip().splitlines() == [
            f"error: {root}: no split 'nope'; it has ['train']"
        ], (args, r.output)


def test_interrupt_is_130_and_a_bug_keeps_its_traceback(mixed_dataset, monkeypatch):
    import crossfeed.read.sources.dataset as dataset_module

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(dataset_module, "open_dataset", interrupted)
    r = CliRunner().invoke(app, ["info", str(mixed_dataset[0])])
    assert r.exit_code == 130 and "Traceback" not in r.output

    def bug(*a, **k):
        raise RuntimeError("a bug")

    monkeypatch.setattr(dataset_module, "open_dataset", bug)
    r = CliRunner().invoke(app, ["info", str(mixed_dataset[0])])
    assert isinstance(r.exception, RuntimeError)  # not turned into a friendly line


def test_a_closed_stdout_is_quiet(mixed_dataset):
    # `crossfeed info DS | head -1`: the reader is gone before crossfeed writes
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "crossfeed.cli.main", "info", str(mixed_dataset[0])],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 141 and err == ""


def test_version_and_help_on_every_option():
    r = invoke("--version")
    assert r.exit_code == 0 and r.output.strip() == f"crossfeed {crossfeed.__version__}"
    missing = []

    def walk(cmd, path):
        for p in cmd.params:
            if getattr(p, "help", None) in (None, "") and p.name != "help":
                missing.append(f"{path} {p.name}")
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, f"{path} {name}")

    walk(typer.main.get_command(app), "crossfeed")
    assert missing == []


def test_info_shows_statistics_and_head_defaults_as_documented(tmp_path, mixed_dataset):
    root, samples = mixed_dataset
    r = invoke("info", root)
    assert "statistics (train):" in r.output and "shapes 4x5x3 ×30" in r.output and "label" in r.output
    crossfeed.write_dataset(tmp_path / "vt", samples[:3], split="validation").close()
    crossfeed.write_dataset(tmp_path / "vt", samples[:2], split="test", add_split=True).close()
    r = invoke("head", tmp_path / "vt", "-n", 1)
    assert r.exit_code == 0 and "[test 0]" in r.output  # no train: the first split by name, as --help says
    assert "first split by name" in invoke("head", "--help").output


def test_transform_modules_are_found_in_the_current_directory(tmp_path, monkeypatch):
    from crossfeed.config import resolve_callable
    from crossfeed.errors import ConfigError

    (tmp_path / "myaug.py").write_text("def flip(s):\n    return s\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert resolve_callable("myaug:flip", search_cwd=True)({"a": 1}) == {"a": 1}
    with pytest.raises(ConfigError, match="PYTHONPATH"):
        resolve_callable("notthere:f", search_cwd=True)


# -- convert -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_convert_takes_several_inputs_and_globs(tmp_path):
    parts = parquet_parts(tmp_path / "pq")
    r = run_cli("convert", "parquet", *parts, tmp_path / "a", "--label", "y")  # the shell expanded the glob
    assert r.returncode == 0, r.stderr
    ds = crossfeed.open_dataset(tmp_path / "a")
    assert len(ds["train"]) == 12 and ds.metadata["class_names"] == ["a", "b"]
    assert sorted(int(s["label"]) for s in ds["train"]) == [0] * 6 + [1] * 6
    r = run_cli("convert", "parquet", "part-*.parquet", tmp_path / "b", cwd=tmp_path / "pq")  # quoted glob
    assert r.returncode == 0, r.stderr
    assert len(crossfeed.open_dataset(tmp_path / "b")["train"]) == 12
    assert "apitools" not in r.stderr and "INFO" not in r.stderr  # Beam's noise stays below WARNING
    assert "━" not in r.stderr and "ETA" not in r.stderr  # no progress bar when stderr is not a terminal


@pytest.mark.slow
def test_convert_rejects_stray_arguments(tmp_path):
    csv = wine_csv(tmp_path / "wine.csv")

    def said(r):  # typer draws the message in a box
        return " ".join(line.strip("│ ") for line in r.stderr.splitlines())

    r = run_cli("convert", "csv", csv, tmp_path / "out", "bogus")
    assert r.returncode == 2 and "usage: INPUT... OUT" in said(r) and not (tmp_path / "bogus").exists()
    r = run_cli("convert", "csv", csv, csv)  # OUT forgotten: the last input would be overwritten
    assert r.returncode == 2 and "is a file" in said(r)
    r = run_cli(
        "convert",
        "csv",
        csv,
        tmp_path / "out",
        "--label",
        "cultivar",
        "--runner",
        "DirectRunner",
        "--",
        "--direct_num_workers",
        "1",
    )  # Beam options after --
    assert r.returncode == 0, r.stderr


@pytest.mark.slow
def test_csv_inference_reports_decisions_with_file_and_line(tmp_path):
    csv = wine_csv(tmp_path / "wine.csv")
    r = run_cli("convert", "csv", csv, tmp_path / "out", "--label", "cultivar")
    assert r.returncode == 0, r.stderr
    assert f"'1n/a' at wine.csv:{WINE_BAD_LINE}" in r.stderr and "--types alcohol:float" in r.stderr
    assert "malic_acid: float" in r.stderr and "wine.csv:4, wine.csv:12" in r.stderr  # empty cells → NaN, named
    assert "magnesium: float, not int64" in r.stderr and "wine.csv:6" in r.stderr
    ds = crossfeed.open_dataset(tmp_path / "out")
    assert ds.metadata["class_names"] == ["barbera", "barolo", "grignolino"]
    assert "1n/a" in ds.metadata["inferred_types"]["alcohol"]
    assert {f.name: f.dtype for f in ds.schema}["label"] == "int64"

    r = run_cli("convert", "csv", csv, tmp_path / "o2", "--label", "cultivar", "--types", "alcohol:float")
    assert r.returncode == 2 and f"wine.csv:{WINE_BAD_LINE}: column 'alcohol': '1n/a'" in r.stderr
    r = run_cli(
        "convert",
        "csv",
        csv,
        tmp_path / "o3",
        "--types",
        "alcohol:float",
        "--on-error",
        "skip",
        "--label",
        "cultivar",
        "--no-label-classes",
    )
    assert r.returncode == 0 and "skipped 1 bad records" in r.stdout
    assert sorted({s["label"] for s in crossfeed.open_dataset(tmp_path / "o3")["train"]}) == [
        "barbera",
        "barolo",
        "grignolino",
    ]


@pytest.mark.slow
def test_convert_warns_about_empty_shards(tmp_path):
    csv = wine_csv(tmp_path / "wine.csv", rows=12)
    r = run_cli("convert", "csv", csv, tmp_path / "out", "--splits", "train=0.8,validation=0.2", "--shards", "8")
    assert r.returncode == 0, r.stderr
    empty = sum(sh.num_records == 0 for sh in crossfeed.open_dataset(tmp_path / "out").splits["validation"].shards)
    assert empty and f"{empty} of 8 shards of split 'validation' are empty" in r.stderr


def test_progress_bar_names_the_phase_on_a_terminal(capsys):
    from crossfeed.cli.progress import Progress

    with Progress(enabled=True) as progress:
        bar = progress.phase("verifying", total=1000, unit="bytes")
        bar.callback(400)  # increment form
        bar.callback(1000, 1000)  # (done, total) form
    err = capsys.readouterr().err
    assert "verifying" in err and "ETA" in err and "100%" in err
    with Progress(enabled=False) as progress:  # not a terminal: nothing drawn
        progress.phase("encoding").update(5)
    assert capsys.readouterr().err == ""


# -- the watch tools ---------------------------------------------------------------------------------


def test_mon_at_a_distribution_address_fails_and_says_why():
    from net_helpers import Synthetic

    from crossfeed.net import Server, ServerOptions

    with Server(Synthetic(num_samples=40, batch_size=8), ServerOptions(("tcp://127.0.0.1:0",))) as server:
        r = invoke("mon", server.endpoints[0], "--timeout", "1", "-c", "1")
    assert r.exit_code == 2 and "broadcast" in r.output and "error:" in r.output


@pytest.mark.slow
def test_stat_and_show_on_photos_of_different_sizes(tmp_path):
    from net_helpers import child, read_endpoint, stop
    from PIL import Image

    photos_folder(tmp_path / "jpg")
    assert run_cli("convert", "images", tmp_path / "jpg", tmp_path / "ds").returncode == 0
    ep = tmp_path / "ep"
    proc = child(
        "cli",
        "serve",
        str(tmp_path / "ds"),
        "tcp://127.0.0.1:0",
        "--mode",
        "broadcast",
        "--batch-size",
        "4",
        "--endpoint-file",
        str(ep),
        log=tmp_path / "serve.log",
    )
    try:
        address = read_endpoint(ep, timeout=60, procs=[proc])
        stat = invoke("stat", address, "-c", "3", "--timeout", "30")
        assert stat.exit_code == 0, stat.output
        row = next(line for line in stat.output.splitlines() if line.startswith("image"))
        assert "varies:" in row and " x 3 (" in row  # heights and widths vary, 3 channels
        values = dict(kv.split("=") for kv in row.split() if "=" in kv)
        assert 0 <= float(values["min"]) and float(values["max"]) > 70  # pixels, not the heights (20..69)
        png = tmp_path / "grid.png"
        show = invoke("show", address, "-o", png, "--dataset", tmp_path / "ds", "--timeout", "30")
        assert show.exit_code == 0, show.output
        with Image.open(png) as img:
            assert img.format == "PNG" and img.width % 96 == 0 and np.asarray(img).max() > 0  # 96-pixel tiles
    finally:
        stop(proc)
    assert "serving broadcast" in (tmp_path / "serve.log").read_text()


def test_image_grid_tiles_any_sizes_and_writes_class_names():
    from crossfeed.net.observe import field_stats, image_grid

    rng = np.random.default_rng(0)
    imgs = np.empty(3, dtype=object)
    imgs[:] = [rng.integers(0, 255, s, dtype=np.uint8) for s in ((20, 50, 3), (64, 30, 3), (33, 33, 1))]
    batch = {"image": imgs, "label": np.array([0, 1, 1]), "height": np.array([20, 64, 33])}
    plain = np.asarray(image_grid(batch, tile=48))
    named = np.asarray(image_grid(batch, tile=48, class_names=["cat", "dog"]))
    assert plain.shape == named.shape == (48 + 14, 3 * 48, 3)
    assert (plain[:48] == named[:48]).all() and (plain[48:] != named[48:]).any()  # same tiles, other captions
    stats = field_stats([batch])["image"]
    assert stats.shape_text() == "varies: 20..64 x 30..50 x 1..3 (3 shapes)" and stats.max > 64
    assert json.dumps(stats.row("image"))  # one printable line
