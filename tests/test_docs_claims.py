"""Claims the README and docs make about the CLI, checked through the real command: a usage
mistake is one line ``error: …`` and exit status 2 (typer's own is a five-line box), and
``crossfeed info`` counts every image shape, not just the 20 commonest the manifest keeps."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import crossfeed
from crossfeed.format.schema import Feature

CLI = [sys.executable, "-m", "crossfeed.cli.main"]


def run(*args):
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["info", "--bogus", "x"], "No such option: --bogus; see 'crossfeed info --help'"),
        (["nosuch"], "No such command 'nosuch'; see 'crossfeed --help'"),
        (["--bogus", "info"], "No such option: --bogus"),
        (["head"], "Missing argument"),
        (["convert", "images"], "see 'crossfeed convert images --help'"),
    ],
)
def test_a_usage_mistake_is_one_line_and_exit_status_2(args, says):
    r = run(*args)
    assert r.returncode == 2
    assert r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ") and says in r.stderr, r.stderr
    assert "╭" not in r.stderr and "Traceback" not in r.stderr


def test_help_asked_for_without_arguments_is_still_help():
    r = run("convert")
    assert "Usage: crossfeed convert" in r.stdout + r.stderr and "error:" not in r.stderr


def test_info_counts_every_shape_not_the_20_the_manifest_keeps(tmp_path):
    # 30 distinct shapes, the commonest first: 5 × (1, 1), 2 × (2, 1), then one record each
    shapes = [(1, 1)] * 5 + [(2, 1)] * 2 + [(h, 1) for h in range(3, 31)]
    samples = [{"x": np.zeros(s, np.float32), "y": i} for i, s in enumerate(shapes)]
    schema = [Feature("x", "float32", (None, 1), "tensor"), Feature("y", "int64", (), "int64")]
    crossfeed.write_dataset(tmp_path / "ds", samples, schema=schema)
    r = run("info", tmp_path / "ds")
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if "shapes 1x1 ×5" in ln)
    assert line.endswith("2x1 ×2, 3x1 ×1 (+27 more, ×27)"), line  # not "+17 more" (20 kept - 3)
