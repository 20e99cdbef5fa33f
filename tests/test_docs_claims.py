"""Claims the README and docs make, checked: a usage mistake is one line ``error: …`` and exit
status 2 through the real command (typer's own is a five-line box); ``crossfeed info`` counts
every image shape, not just the 20 commonest the manifest keeps; and every limit in
docs/limits.md names a benchmark or a test that shows it (the tests named exist; the limits no
other test shows are shown here)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

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


# ---------------------------------------------------------------- docs/limits.md

ROOT = Path(__file__).resolve().parent.parent
_TEST_REF = re.compile(r"`(tests/[\w/]+\.py)(?:::(\w+))?`")


def limits() -> list[str]:
    """The bullets of docs/limits.md, each as one string."""
    text = (ROOT / "docs" / "limits.md").read_text()
    return [b for b in re.split(r"\n(?=\* )", text) if b.startswith("* ")]


def test_every_limit_names_what_shows_it_and_each_test_named_exists():
    missing, unknown = [], []
    for bullet in limits():
        head = bullet.split("\n", 1)[0][:60]
        flat = " ".join(bullet.split())
        if "Shown by:" not in flat and "Nothing here to test" not in flat:
            missing.append(head)
        for file, name in _TEST_REF.findall(bullet):
            path = ROOT / file
            if not path.is_file() or (name and not re.search(rf"^def {name}\(", path.read_text(), re.M)):
                unknown.append(f"{head}: {file}{'::' + name if name else ''}")
    assert len(limits()) >= 10
    assert missing == [] and unknown == []


def cli(*args):
    from typer.testing import CliRunner

    from crossfeed.cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args])


def test_index_takes_one_directory_not_its_subdirectories(tmp_path):
    crossfeed.write_dataset(tmp_path / "ds", [{"x": i} for i in range(4)]).close()
    (tmp_path / "nested" / "sub").mkdir(parents=True)
    for f in (tmp_path / "ds").glob("*.tfrecord"):
        shutil.copy(f, tmp_path / "nested" / "sub" / f.name)
    r = cli("index", tmp_path / "nested")
    assert r.exit_code == 2 and "no TFRecord shards" in r.output
    assert cli("index", tmp_path / "nested" / "sub").exit_code == 0  # the directory that holds them


def test_compressed_tars_are_not_read_in_place(tmp_path):
    import webdataset as wds

    for name, compress in (("plain", False), ("gz", True)):
        (tmp_path / name).mkdir()
        suffix = ".tar.gz" if compress else ".tar"
        with wds.TarWriter(str(tmp_path / name / f"a-000000{suffix}"), compress=compress) as sink:
            for i in range(4):
                sink.write({"__key__": f"k{i}", "cls": i})
    assert cli("index", tmp_path / "plain").exit_code == 0
    r = cli("index", tmp_path / "gz")
    assert r.exit_code == 2 and ".tar" in r.output


def test_lengths_files_come_from_index_and_convert_not_from_tars_or_write_dataset(tmp_path):
    import webdataset as wds

    (tmp_path / "tars").mkdir()
    with wds.TarWriter(str(tmp_path / "tars" / "a-000000.tar")) as sink:
        for i in range(4):
            sink.write({"__key__": f"k{i}", "ids.npy": np.arange(i + 2)})
    r = cli("index", tmp_path / "tars", "--lengths", "ids")
    assert r.exit_code == 2 and "--lengths is not supported for WebDataset tars" in r.output
    crossfeed.write_dataset(tmp_path / "ds", [{"tokens": list(range(i + 1))} for i in range(4)]).close()
    assert not list((tmp_path / "ds").glob("*.len"))
    assert cli("index", tmp_path / "ds", "--force", "--lengths", "tokens").exit_code == 0  # index writes them
    assert list((tmp_path / "ds").glob("*.len"))


def test_the_lengths_histogram_is_where_sequences_md_says(tmp_path):
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    words = "the a cat dog sat on mat".split()
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    docs = [" ".join(words[: 2 + i % 5]) for i in range(20)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    r = cli("convert", "text", tmp_path / "c.jsonl", tmp_path / "tokens", "--tokenizer", tmp_path / "tok.json")
    assert r.exit_code == 0, r.output
    page = " ".join((ROOT / "docs" / "sequences.md").read_text().split())
    assert "`splits.<split>.statistics.tokens.lengths` in `crossfeed info --json`" in page
    r = cli("info", tmp_path / "tokens", "--json")
    assert r.exit_code == 0, r.output
    lengths = json.loads(r.stdout)["splits"]["train"]["statistics"]["tokens"]["lengths"]
    assert lengths["count"] == 20 and lengths["total"] == sum(len(d.split()) for d in docs)
