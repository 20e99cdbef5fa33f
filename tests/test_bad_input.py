"""Damaged datasets: every kind of damage raises a CrossfeedError naming the file (and the byte
offset where there is one), `verify` lists them all and exits 1, and undamaged shards stay readable."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from typer.testing import CliRunner

import crossfeed
from crossfeed.cli.main import app
from crossfeed.errors import CorruptRecordError, CrossfeedError, DatasetNotFoundError, IndexFileError
from crossfeed.format import index as idx
from crossfeed.format.manifest import MANIFEST
from crossfeed.read.tools.verify import verify_dataset

N_SHARDS = 8


@pytest.fixture
def dataset(tmp_path):
    root = tmp_path / "d"
    samples = [{"x": np.full(50, i, np.uint8), "y": i} for i in range(N_SHARDS * 5)]
    crossfeed.write_dataset(root, samples, num_shards=N_SHARDS).close()
    return root


def shard(root, i):
    return root / f"train-{i:05d}-of-{N_SHARDS:05d}.tfrecord"


def offsets(root, i):
    return idx.read_index(idx.index_path(shard(root, i)))


def flip_byte(root):
    off, n = offsets(root, 0)[2]
    data = bytearray(shard(root, 0).read_bytes())
    data[off + n - 10] ^= 0xFF
    shard(root, 0).write_bytes(bytes(data))
    return shard(root, 0), int(off)


def truncate(root):
    off, _ = offsets(root, 1)[-1]
    os.truncate(shard(root, 1), shard(root, 1).stat().st_size - 7)
    return shard(root, 1), int(off)


def remove(root):
    os.unlink(shard(root, 2))
    return shard(root, 2), None


def index_past_end(root):
    entries = offsets(root, 3)
    size = shard(root, 3).stat().st_size
    entries[-1] = (size + 100, entries[-1][1])
    idx.write_index(idx.index_path(shard(root, 3)), entries.tolist())
    return idx.index_path(shard(root, 3)), size + 100


def wrong_count(root):
    m = json.loads((root / MANIFEST).read_text())
    m["splits"]["train"]["shards"][4]["num_records"] += 1
    m["splits"]["train"]["num_records"] += 1
    (root / MANIFEST).write_text(json.dumps(m))
    return idx.index_path(shard(root, 4)), None


def not_tfrecord(root):
    size = shard(root, 5).stat().st_size
    shard(root, 5).write_bytes(b"this is a CSV file, not TFRecord\n" * (size // 33 + 1))
    return shard(root, 5), 0


DAMAGE = [flip_byte, truncate, remove, index_past_end, wrong_count, not_tfrecord]


def _read_all(split, shard_no):
    return [split.decode(shard_no, k) for k in range(int(split.counts[shard_no]))]


@pytest.mark.parametrize("damage", DAMAGE, ids=lambda f: f.__name__)
def test_damage_raises_crossfeed_error_naming_file_and_offset(dataset, damage):
    where, offset = damage(dataset)
    shard_no = DAMAGE.index(damage)
    with crossfeed.open_dataset(dataset) as ds:
        split = ds["train"]
        with pytest.raises(CrossfeedError) as e:
            _read_all(split, shard_no)
        assert str(where).removesuffix(".idx") in str(e.value)
        if damage is index_past_end:
            assert f"entry {N_SHARDS * 5 // N_SHARDS - 1} ('{offset} " in str(e.value)
        elif offset is not None:
            assert f"offset {offset}" in str(e.value)
        if damage in (wrong_count, index_past_end):  # an index that does not tile its shard is caught on load
            assert isinstance(e.value, IndexFileError)
        if damage is remove:
            assert isinstance(e.value, DatasetNotFoundError)
        if damage in (flip_byte, truncate, not_tfrecord):
            assert isinstance(e.value, CorruptRecordError) and e.value.offset == offset
        for other in range(N_SHARDS):  # the rest of the dataset stays readable
            if other != shard_no:
                assert [r["y"] for r in _read_all(split, other)] == list(range(other, N_SHARDS * 5, N_SHARDS))


def test_verify_lists_every_problem_and_exits_1(dataset):
    assert verify_dataset(dataset) == []
    damaged = {str(damage(dataset)[0]).removesuffix(".idx"): damage.__name__ for damage in DAMAGE}
    problems = verify_dataset(dataset)
    bad_files = {p.file.removesuffix(".idx") for p in problems}
    assert bad_files == set(damaged)  # all six, and no false alarm on shards 6 and 7
    by_file = {f: [p for p in problems if p.file.removesuffix(".idx") == f] for f in bad_files}
    flip = by_file[str(shard(dataset, 0))]
    assert any("payload CRC" in p.reason and p.offset == int(offsets(dataset, 0)[2][0]) for p in flip)
    assert any("truncated" in p.reason for p in by_file[str(shard(dataset, 1))])
    assert any("missing" in p.reason for p in by_file[str(shard(dataset, 2))])
    assert any("past the end" in p.reason for p in by_file[str(shard(dataset, 3))])
    assert any("manifest says 6" in p.reason for p in by_file[str(shard(dataset, 4))])
    assert any(p.offset == 0 and "length CRC" in p.reason for p in by_file[str(shard(dataset, 5))])

    result = CliRunner().invoke(app, ["verify", str(dataset)])
    assert result.exit_code == 1
    for f in damaged:
        assert f in result.stderr
    assert "Traceback" not in result.output + result.stderr
    assert f"in 6 of {N_SHARDS} shards" in result.stderr


def test_verify_catches_changed_bytes_and_bad_index_entries(dataset):
    # a record rewritten with valid CRCs: only the sha256 tells
    entries = offsets(dataset, 6)
    data = bytearray(shard(dataset, 6).read_bytes())
    off, n = (int(v) for v in entries[0])
    old = bytes(crossfeed.format.tfrecord.unframe(bytes(data), off, n, "x"))
    payload = old.replace(b"\x06" * 10, b"\x07" * 10)
    assert payload != old and len(payload) == len(old)
    data[off : off + n] = crossfeed.format.tfrecord.frame(payload)
    shard(dataset, 6).write_bytes(bytes(data))
    # an index entry that points at the middle of a record
    entries7 = offsets(dataset, 7)
    entries7[1][0] += 4
    idx.write_index(idx.index_path(shard(dataset, 7)), entries7.tolist())
    problems = verify_dataset(dataset)
    assert [p.file for p in problems] == [str(shard(dataset, 6)), idx.index_path(shard(dataset, 7))]
    assert "sha256" in problems[0].reason
    assert "entry 1" in problems[1].reason and problems[1].offset == int(entries7[1][0])


def test_verify_damaged_gzip_shard(tmp_path):
    root = tmp_path / "g"
    crossfeed.write_dataset(root, [{"x": os.urandom(2000)} for _ in range(40)], num_shards=2, compress=True).close()
    bad = root / "train-00000-of-00002.tfrecord.gz"
    os.truncate(bad, bad.stat().st_size // 2)
    problems = verify_dataset(root)
    assert problems and {p.file.removesuffix(".idx") for p in problems} == {str(bad)}
    assert any("GZIP" in p.reason for p in problems)
    with crossfeed.open_dataset(root) as ds:
        with pytest.raises(CorruptRecordError, match="GZIP"):
            ds["train"][0]
        assert len(_read_all(ds["train"], 1)) == 20


def test_bad_paths_and_files_are_one_line_errors(tmp_path, dataset):
    runner = CliRunner()
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "a.tfrecord").write_bytes(b"not a tfrecord at all, just text")
    (tmp_path / "badjson").mkdir()
    (tmp_path / "badjson" / MANIFEST).write_text("{not json")
    cases = [
        ["info", str(tmp_path / "nothing")],
        ["head", str(tmp_path / "nothing")],
        ["verify", str(tmp_path / "nothing")],
        ["index", str(tmp_path / "nothing")],
        ["index", str(tmp_path / "junk")],
        ["info", str(tmp_path / "badjson")],
        ["head", str(dataset), "--split", "nope"],
        ["verify", str(dataset), "--split", "nope"],
    ]
    for args in cases:
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert result.exception is None or isinstance(result.exception, SystemExit)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, result.stderr)
    junk = runner.invoke(app, ["index", str(tmp_path / "junk")]).stderr
    assert "a.tfrecord" in junk and "offset 0" in junk
    assert not (tmp_path / "junk" / MANIFEST).exists()
