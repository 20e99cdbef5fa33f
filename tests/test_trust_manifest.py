"""Trust, third round (issue 35, item 8): every size a manifest declares is bounded before it is
allocated. A manifest claiming 10^12 records (with a byte count that agrees), a shard at the
records cap whose index is short, and a manifest of millions of empty JSON objects each end in
one `ManifestError`/`IndexFileError` line — in a child process whose address space is capped
(`resource.setrlimit(RLIMIT_AS)`), where allocating what they claim would be a raw MemoryError.
A split of many shards opens without making an object per shard it does not read."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import numpy as np
import pytest

import crossfeed
from crossfeed.format import manifest as mf

LIMIT_AS = 1 << 30  # far below what any claim here would allocate


def _limited(argv: list[str]) -> subprocess.CompletedProcess:
    """``argv`` in a child whose address space is capped at `LIMIT_AS`."""

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (LIMIT_AS, LIMIT_AS))

    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    return subprocess.run(argv, preexec_fn=cap, env=env, capture_output=True, text=True, timeout=180)


LOADER = """
import sys
import crossfeed
try:
    with crossfeed.Loader(sys.argv[1], batch_size=4, shuffle=sys.argv[2], num_threads=1) as ld:
        print("read", sum(len(b["id"]) for b in ld))
except crossfeed.CrossfeedError as e:
    print(type(e).__name__, "|", e)
"""


@pytest.fixture
def small(tmp_path):
    """A one-shard dataset of 30 records; ``(root, manifest dict)``."""
    root = tmp_path / "ds"
    crossfeed.write_dataset(root, [{"x": np.full(8, i, np.float32), "id": i} for i in range(30)], num_shards=1).close()
    return root, json.loads((root / "crossfeed.json").read_text())


def _claim(root, m, records: int) -> None:
    """The manifest rewritten to claim ``records`` records in its shard, with a byte count that
    agrees (a record is at least 16 bytes; GZIP may inflate 1100:1)."""
    split = m["splits"]["train"]
    shard = split["shards"][0]
    shard["num_records"] = split["num_records"] = records
    shard["num_bytes"] = split["num_bytes"] = records * 16 // 1100 + 16
    split["statistics"] = {}
    (root / "crossfeed.json").write_text(json.dumps(m))


def _one_line(out: subprocess.CompletedProcess, kind_text: str) -> None:
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.startswith("error: ") and out.stderr.count("\n") == 1, out.stderr[-3000:]
    assert kind_text in out.stderr and "MemoryError" not in out.stderr


@pytest.mark.parametrize("shuffle", ["none", "block", "global"])
def test_a_manifest_claiming_a_trillion_records_is_a_manifest_error(small, shuffle):
    root, m = small
    _claim(root, m, 10**12)
    out = _limited([sys.executable, "-c", LOADER, str(root), shuffle])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ManifestError |"), out.stdout
    assert (
        "shards[0].num_records: 1000000000000 is out of range" in out.stdout and str(mf.MAX_SHARD_RECORDS) in out.stdout
    )


def test_head_and_info_of_a_trillion_records_say_one_line(small):
    root, m = small
    _claim(root, m, 10**12)
    for command in ("head", "info", "verify"):
        _one_line(_limited([sys.executable, "-m", "crossfeed.cli.main", command, str(root)]), "num_records")


def test_a_shard_at_the_records_cap_with_a_short_index_is_an_index_error(small):
    """4 billion records are allowed; the index is then read as far as it goes (in pieces: the
    read never allocates the 256 GiB such an index may hold) and found short."""
    root, m = small
    _claim(root, m, mf.MAX_SHARD_RECORDS)
    out = _limited([sys.executable, "-c", LOADER, str(root), "none"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("IndexFileError |") and "the manifest says 4294967296 records" in out.stdout, (
        out.stdout
    )
    _one_line(_limited([sys.executable, "-m", "crossfeed.cli.main", "head", str(root)]), "4294967296")


def test_millions_of_empty_json_objects_are_refused_before_they_are_parsed(small):
    """``[{},{},…]``: 60 MB of text, under the manifest's byte cap, that json would turn into 1.3 GB
    of dicts; counted first and refused."""
    root, m = small
    m["metadata"] = {"x": "@"}
    text = json.dumps(m).replace('"@"', "[" + "{}," * (20 << 20) + "{}]")
    assert len(text) < mf.MAX_MANIFEST_BYTES
    (root / "crossfeed.json").write_text(text)
    out = _limited([sys.executable, "-c", LOADER, str(root), "none"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ManifestError |") and "more than a manifest may hold" in out.stdout, out.stdout


def test_more_shards_than_a_split_may_hold_is_a_manifest_error(small, monkeypatch):
    root, m = small
    monkeypatch.setattr(mf, "MAX_SHARDS", 3)
    shard = m["splits"]["train"]["shards"][0]
    m["splits"]["train"]["shards"] = [dict(shard, file=f"s{i}.tfrecord") for i in range(4)]
    with pytest.raises(crossfeed.ManifestError, match=r"splits\.train\.shards: 4 shards, more than 3"):
        mf.loads(json.dumps(m), "crossfeed.json")


def test_a_split_of_many_shards_makes_objects_only_for_the_shards_it_reads(small):
    """100,000 shards listed (25 MB of manifest): opening it fits the capped address space, and
    reading one sample opens one shard file object, not 100,000."""
    root, m = small
    shard = m["splits"]["train"]["shards"][0]
    n = 100_000
    m["splits"]["train"]["shards"] = [shard] + [dict(shard, file=f"more-{i:06d}.tfrecord") for i in range(1, n)]
    m["splits"]["train"]["num_records"] = 30 * n
    m["splits"]["train"]["num_bytes"] = shard["num_bytes"] * n
    m["splits"]["train"]["statistics"] = {}
    (root / "crossfeed.json").write_text(json.dumps(m))
    script = (
        "import sys, crossfeed\n"
        "ds = crossfeed.open_dataset(sys.argv[1]); s = ds['train']\n"
        "print(len(ds.splits['train'].shards), len(s), int(s[29]['id']), len(s._files))\n"
    )
    out = _limited([sys.executable, "-c", script, str(root)])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [str(n), str(30 * n), "29", "1"]


@pytest.mark.parametrize("bad", [-1, 1 << 32, "0x1234", 1.5, True, None])
def test_a_shards_crc32c_must_be_a_32_bit_integer(small, bad):
    """The whole-shard CRC32C a writer records (`ShardInfo.crc32c`) is parsed strictly: a value
    that is not an unsigned 32-bit integer is a `ManifestError` naming the field."""
    root, m = small
    assert isinstance(m["splits"]["train"]["shards"][0]["crc32c"], int)
    m["splits"]["train"]["shards"][0]["crc32c"] = bad
    with pytest.raises(crossfeed.CrossfeedError, match=r"shards\[0\]\.crc32c"):
        mf.loads(json.dumps(m), "crossfeed.json")
