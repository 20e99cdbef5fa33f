"""Day-one tools for token datasets made by a real ``crossfeed convert text`` (a trained tokenizer,
a Beam job): ``crossfeed head`` shows token ids as text when the tokenizer the manifest records
is found (refused by name when another is given), ``crossfeed info`` gives length percentiles
(p50/p90/p99/max) and ``crossfeed bench`` tokens/s."""

from __future__ import annotations

import re
import shutil
import types

import numpy as np
import pytest
from conftest import requires
from test_convert_text import corpus, train_tokenizer  # noqa: E402
from typer.testing import CliRunner

import crossfeed  # noqa: E402
from crossfeed.read.tools.lengths import length_percentiles  # noqa: E402

pytestmark = [pytest.mark.slow, requires("tokenizers", "apache_beam")]  # Beam conversions


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from crossfeed.cli.main import app

    tmp = tmp_path_factory.mktemp("tokens")
    tok = train_tokenizer(tmp / "tok.json")
    docs = corpus(80)
    (tmp / "docs.txt").write_text("\n".join(docs) + "\n")
    out = tmp / "out"
    r = CliRunner().invoke(
        app, ["convert", "text", str(tmp / "docs.txt"), str(out), "--per-line", "--tokenizer", str(tmp / "tok.json")]
    )
    assert r.exit_code == 0, r.output
    return app, tmp, out, tok, docs


def _run(app, *args):
    r = CliRunner().invoke(app, [*map(str, args)])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    return r


def test_head_shows_tokens_as_text_with_the_recorded_tokenizer(converted):
    app, tmp, out, tok, docs = converted
    with crossfeed.open_dataset(out) as ds:
        first = ds["train"][0]["tokens"].tolist()
    r = _run(app, "head", out, "-n", "1", "--tokenizer", tmp / "tok.json")
    assert r.exit_code == 0, r.output
    assert f"text: {tok.decode(first, skip_special_tokens=False)[:120]!r}" in r.output
    # without --tokenizer: ids only, and a note saying how to see text
    r = _run(app, "head", out, "-n", "1")
    assert r.exit_code == 0 and "text:" not in r.output and "pass --tokenizer tok.json" in r.output
    # the recorded file beside the dataset is found by its name
    shutil.copy(tmp / "tok.json", out / "tok.json")
    try:
        r = _run(app, "head", out, "-n", "2")
        assert r.exit_code == 0 and r.output.count("text: ") == 2
    finally:
        (out / "tok.json").unlink()
    other = train_tokenizer(tmp / "other.json", special=("[END]",))
    assert other is not None
    r = _run(app, "head", out, "--tokenizer", tmp / "other.json")
    assert r.exit_code == 2 and "is not the tokenizer the tokens were made with" in r.output


def test_info_gives_length_percentiles(converted):
    app, _, out, _, _ = converted
    with crossfeed.Loader(out, batch_size=1, shuffle=False) as ld:
        lengths = np.array([b["tokens"][0].size for b in ld])
    r = _run(app, "info", out)
    assert r.exit_code == 0, r.output
    want = [int(np.percentile(lengths, q, method="inverted_cdf")) for q in (50, 90, 99)]
    m = re.search(r"length percentiles: p50 ([\d,]+)  p90 ([\d,]+)  p99 ([\d,]+)  max ([\d,]+)", r.output)
    assert m, r.output
    assert [int(g.replace(",", "")) for g in m.groups()] == [*want, int(lengths.max())]


def test_percentiles_without_lengths_files_are_bucket_bounds():
    split = types.SimpleNamespace(
        dataset=types.SimpleNamespace(manifest=types.SimpleNamespace(lengths=())),
        info=types.SimpleNamespace(
            shards=(),
            statistics={"tokens": {"lengths": {"count": 10, "max": 9, "histogram": {"1": 5, "2-3": 4, "8-15": 1}}}},
        ),
    )
    assert length_percentiles(split, "tokens") == {"p50": "1", "p90": "2-3", "p99": "8-15", "max": 9, "exact": False}


def test_bench_reports_tokens_per_second(converted):
    app, _, out, _, _ = converted
    with crossfeed.Loader(out, batch_size=4, shuffle=False) as ld:
        total = sum(int(sum(np.size(t) for t in b["tokens"])) for b in ld)
    for extra in ([], ["--pack-length", "64"]):
        r = _run(app, "bench", out, "--batch-size", 4, "--batches", 1000, *extra)
        assert r.exit_code == 0, r.output
        m = re.search(r"tokens\s+([\d,]+) tokens/s\s+of 'tokens' \(([\d,]+) tokens, padding not counted\)", r.output)
        assert m, r.output
        assert int(m.group(2).replace(",", "")) == total  # every token once, packed or not
