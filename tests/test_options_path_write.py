"""One options path, the write side: `WriteOptions` is the one object `crossfeed.write_dataset`,
the Beam job (`WriteDataset`, `convert`) and ``crossfeed convert`` take — whole or as keywords —
with one default and one check each (shard size in the size grammar of every size option), the
same refusals everywhere, and the read side's bad-record budget."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

import crossfeed
from crossfeed.errors import ConfigError
from crossfeed.policy import DEFAULT_MAX_SKIPS
from crossfeed.read.options import ReadOptions
from crossfeed.write.options import DEFAULT_SHARD_SIZE, WriteOptions

# every field away from its default; and (field, value) pairs every write front end refuses
CHANGED = dict(num_shards=3, shard_size="1.5KiB", compress=True, on_error="skip", max_skips=5)
BAD = [
    ("shard_size", "lots"),
    ("shard_size", 0),
    ("shard_size", "0.5"),
    ("num_shards", 0),
    ("num_shards", "2"),
    ("compress", "yes"),
    ("on_error", "maybe"),
    ("max_skips", -2),
    ("max_skips", None),
]
FLAGS = {"shard_size": "--shard-size", "num_shards": "--shards", "compress": "--compress"}


def _samples(n=40):
    return [{"x": np.full(64, i, np.int64), "y": i} for i in range(n)]


def test_write_options_validate_where_they_are_made():
    opts = WriteOptions(**CHANGED)
    assert (opts.num_shards, opts.shard_size, opts.compress) == (3, 1536, True)
    assert opts.on_error.value == "skip" and opts.max_skips == 5
    assert WriteOptions() == WriteOptions.given(None, {}) and WriteOptions().shard_size == DEFAULT_SHARD_SIZE
    assert opts.replace(num_shards=None) == WriteOptions(**{**CHANGED, "num_shards": None})
    with pytest.raises(ConfigError, match="unknown write option.*'shards'.*the options are"):
        WriteOptions.given(None, {"shards": 2})
    with pytest.raises(ConfigError, match="not both"):
        WriteOptions.given(opts, {"compress": True})


def test_max_skips_has_one_default_reading_and_writing():
    assert WriteOptions().max_skips == ReadOptions().max_skips == DEFAULT_MAX_SKIPS == 1000


@pytest.mark.parametrize("field, value", BAD)
def test_write_dataset_refuses_what_the_options_refuse(tmp_path, field, value):
    with pytest.raises(ConfigError) as a:
        WriteOptions(**{field: value})
    assert field in str(a.value)
    with pytest.raises(ConfigError) as b:
        crossfeed.write_dataset(tmp_path / "d", _samples(), **{field: value})
    assert str(a.value) == str(b.value)
    assert not (tmp_path / "d").exists() or not any((tmp_path / "d").iterdir())


def test_write_dataset_takes_the_size_grammar_and_the_options_whole(tmp_path):
    def shards(path):
        with crossfeed.open_dataset(path) as ds:
            return [(sh.num_records, sh.num_bytes) for sh in ds.splits["train"].shards]

    by_bytes = shards(crossfeed.write_dataset(tmp_path / "a", _samples(), shard_size=1536).path)
    by_size = shards(crossfeed.write_dataset(tmp_path / "b", _samples(), shard_size="1.5KiB").path)
    whole = shards(crossfeed.write_dataset(tmp_path / "c", _samples(), options=WriteOptions(shard_size="1.5K")).path)
    assert by_bytes == by_size == whole and len(by_bytes) > 3
    with pytest.raises(ConfigError, match="no bad-record policy"):
        crossfeed.write_dataset(tmp_path / "e", _samples(), on_error="skip")


# -- the Beam job and `crossfeed convert` ----------------------------------------------------------


@pytest.fixture
def beam():
    pytest.importorskip("apache_beam")


@pytest.fixture
def csv(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("a,b\n" + "".join(f"{i},{i * 2}\n" for i in range(20)))
    return path


@pytest.fixture
def captured(monkeypatch, beam):
    """What ``crossfeed convert`` hands the job: its source and its WriteOptions."""
    got = {}

    def convert(source, out, *, options=None, **kw):
        got.update(source=source, options=options)
        raise SystemExit(0)

    monkeypatch.setattr("crossfeed.beam_jobs.job.convert", convert)
    return got


def _convert(*args):
    from crossfeed.cli.main import app

    return CliRunner().invoke(app, ["convert", *map(str, args)])


@pytest.mark.parametrize("field, value", BAD)
def test_the_beam_job_refuses_what_the_options_refuse(tmp_path, beam, csv, field, value):
    from crossfeed.beam_jobs.job import convert, make_source
    from crossfeed.beam_jobs.write import WriteDataset

    with pytest.raises(ConfigError) as a:
        WriteOptions(**{field: value})
    with pytest.raises(ConfigError) as b:
        WriteDataset(tmp_path / "w", **{field: value})
    with pytest.raises(ConfigError) as c:
        convert(make_source("csv", [str(csv)]), tmp_path / "c", **{field: value})
    assert str(b.value).endswith(str(a.value)) and str(c.value).endswith(str(a.value))


@pytest.mark.parametrize("field, value", [b for b in BAD if b not in (("num_shards", "2"), ("max_skips", None))])
def test_convert_refuses_what_the_options_refuse_by_name(tmp_path, captured, csv, field, value):
    """(Less the values a command line cannot say: None, and "2" for a count, which is the text of 2.)"""
    flag = FLAGS.get(field, "--" + field.replace("_", "-"))
    r = _convert("csv", csv, tmp_path / "out", flag, value)
    assert r.exit_code == 2 and captured == {}, r.output
    said = " ".join(r.output.split())
    assert flag in said or field in said, said


def test_convert_defaults_are_the_write_options_defaults(tmp_path, captured, csv):
    from crossfeed.beam_jobs.policy import ErrorPolicy

    _convert("csv", csv, tmp_path / "out")
    assert captured["options"] == WriteOptions()
    assert captured["source"].on_error == ErrorPolicy.of(WriteOptions()) == ErrorPolicy()


def test_convert_builds_the_same_options_from_the_same_flags(tmp_path, captured, csv):
    from crossfeed.beam_jobs.policy import ErrorPolicy

    flags = ["--compress", "gzip", "--on-error", "skip", "--max-skips", "5"]
    _convert("csv", csv, tmp_path / "out", "--shards", "3", *flags)
    want = WriteOptions(**CHANGED)
    assert captured["options"] == want.replace(shard_size=DEFAULT_SHARD_SIZE)
    assert captured["source"].on_error == ErrorPolicy.of(want)
    _convert("csv", csv, tmp_path / "out", "--shard-size", "1.5KiB", *flags)
    assert captured["options"] == want.replace(num_shards=None)


def test_the_beam_policy_refuses_a_bad_option_as_a_config_error(beam):
    from crossfeed.beam_jobs.policy import ErrorPolicy

    for bad in ({"max_skips": -1}, {"mode": "sometimes"}):
        with pytest.raises(ConfigError):
            ErrorPolicy(**bad)
