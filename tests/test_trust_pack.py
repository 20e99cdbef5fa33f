"""Sizes a token Loader allocates by, bounded before it allocates (issue 35, item 9): a lengths
entry of 2^31 in a file re-pinned in the manifest is refused when the file is loaded — naming the
file and the entry — instead of sizing rows and batches by it (it took `Pack` and ``len()`` to
2.9 GB then a raw `MemoryError`, and ``batch_by_tokens`` to an 8 GiB allocation); the Loader runs
in an address space of 1.5 GiB to show nothing big is tried first. Options past what crossfeed
allocates (``Pack(length=2**31)``, ``batch_size=2**40``, ``batch_by_tokens=2**40``, JAX
``pad_to=2**40``), and a ``pad_id`` outside the token dtype (70000 or -1 for uint16 tokens), are
one `ConfigError` naming the option and the bound."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from token_data import add_lengths, write_tokens

import crossfeed
from crossfeed.errors import ConfigError, IndexFileError
from crossfeed.format.lengths import lengths_path, record_bound
from crossfeed.format.manifest import MANIFEST
from crossfeed.read.options import MAX_BATCH_SIZE, MAX_BATCH_TOKENS, MAX_PACK_LENGTH, LoaderOptions, Pack

LIMIT_AS = 3 << 29  # 1.5 GiB


def _repin(root, shard_no: int, entry: int, value: int) -> str:
    """Set entry ``entry`` of shard ``shard_no``'s lengths file to ``value`` and pin the new bytes
    in the manifest (what an attacker who can write the dataset does); returns the file's path."""
    mpath = os.path.join(root, MANIFEST)
    with open(mpath) as f:
        manifest = json.load(f)
    shard = manifest["splits"]["train"]["shards"][shard_no]
    path = lengths_path(os.path.join(root, shard["file"]))
    arr = np.fromfile(path, dtype="<u4")
    arr[entry] = value
    arr.tofile(path)
    shard["lengths_sha256"] = hashlib.sha256(arr.tobytes()).hexdigest()
    with open(mpath, "w") as f:
        json.dump(manifest, f)
    return path


def write_u16(root, lens) -> str:
    """Documents of raw uint16 tokens (what ``crossfeed convert text`` writes), lengths files too."""
    schema = crossfeed.Schema([crossfeed.Feature("tokens", "uint16", (None,), crossfeed.Encoding.TENSOR)])
    docs = [{"tokens": np.arange(n, dtype=np.uint16)} for n in lens]
    crossfeed.write_dataset(root, docs, num_shards=1, schema=schema).close()
    add_lengths(str(root), ("tokens",))
    return str(root)


@pytest.fixture
def hostile(tmp_path):
    root = write_tokens(tmp_path / "tok", [5, 9, 3, 12, 7, 4, 8, 6, 10], num_shards=3)
    return root, _repin(root, 1, 2, 1 << 31)


HOSTILE_READ = """
    import resource, sys
    resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
    import crossfeed
    from crossfeed.errors import IndexFileError
    root, how = sys.argv[1], sys.argv[2]
    opts = dict(pack=crossfeed.Pack(length=64)) if how == "pack" else dict(batch_by_tokens=4096)
    try:
        with crossfeed.Loader(root, batch_size=4, shuffle=False, **opts) as loader:
            if how == "pack":
                len(loader)
            for _ in loader:
                pass
    except IndexFileError as e:
        print("refused:", e)
    else:
        print("read it all")
"""


@pytest.mark.parametrize("how", ["pack", "batch_by_tokens"])
def test_a_lengths_entry_past_its_record_is_refused_before_allocating(hostile, how):
    root, path = hostile
    code = textwrap.dedent(HOSTILE_READ.format(limit=LIMIT_AS))
    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code, root, how], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    out = proc.stdout.strip()
    assert out.startswith(f"refused: {path}: entry 2 says record 2 holds 2,147,483,648 values of 'tokens'"), out
    assert "can hold at most" in out


def test_the_bound_is_what_the_record_can_hold(tmp_path):
    """Raw uint16 tokens take 2 bytes a value, varints 1; a GZIP shard may inflate 1,032 times.
    Lengths that are true stay within it, whatever the documents."""
    root = write_u16(tmp_path / "u16", (1, 300, 7, 2000))
    with crossfeed.open_dataset(root) as ds:
        shard, feature = ds["train"].shards[0], ds.schema["tokens"]
        assert record_bound(shard, feature) == shard.num_bytes // 2 >= 2000
        gz = type(shard)(shard.file + ".gz", shard.num_records, shard.num_bytes, shard.sha256)
        assert record_bound(gz, feature) == shard.num_bytes * 1032 // 2
        assert record_bound(shard, feature, "parquet") == 2**32 - 1
    with crossfeed.Loader(root, batch_size=2, shuffle=False, pack=Pack(length=512)) as loader:
        assert sum(int((b["segment_ids"] > 0).sum()) for b in loader) == 1 + 300 + 7 + 2000


def test_a_lengths_entry_within_the_shard_but_wrong_is_still_caught_when_read(tmp_path):
    """The bound is what a record can hold; a smaller lie is caught against the decoded record."""
    root = write_tokens(tmp_path / "tok", [5, 9, 3], num_shards=1)
    _repin(root, 0, 1, 10)
    with pytest.raises(IndexFileError, match="the lengths do not belong"):
        with crossfeed.Loader(root, batch_size=3, shuffle=False, pack=Pack(length=32)) as loader:
            list(loader)


@pytest.mark.parametrize(
    ("make", "names"),
    [
        (lambda: Pack(length=2**31), ["pack length=2,147,483,648", f"{MAX_PACK_LENGTH:,}"]),
        (lambda: Pack(length=8, pad_id=2**70), ["pad_id"]),
        (lambda: LoaderOptions.of(batch_size=2**40), ["batch_size=1,099,511,627,776", f"{MAX_BATCH_SIZE:,}"]),
        (lambda: LoaderOptions.of(batch_size=4, batch_by_tokens=2**40), ["batch_by_tokens", f"{MAX_BATCH_TOKENS:,}"]),
        (
            lambda: LoaderOptions.of(batch_size=2**20, pack=Pack(length=2**20)),
            ["batch_size=1,048,576", "length=1,048,576", f"{MAX_BATCH_TOKENS:,}"],
        ),
    ],
)
def test_options_past_what_crossfeed_allocates_are_config_errors(make, names):
    with pytest.raises(ConfigError) as e:
        make()
    assert all(n in str(e.value) for n in names), str(e.value)


@pytest.mark.parametrize("pad_id", [70_000, -1])
def test_a_pad_id_outside_the_token_dtype_is_refused_before_the_first_batch(tmp_path, pad_id):
    root = write_u16(tmp_path / "u16", (3, 9, 4))
    with pytest.raises(ConfigError, match=f"pad_id={pad_id} does not fit feature 'tokens' \\(uint16: 0 to 65,535\\)"):
        crossfeed.Loader(root, batch_size=2, pack=Pack(length=8, pad_id=pad_id))
    with crossfeed.Loader(root, batch_size=2, shuffle=False, pack=Pack(length=8, pad_id=65_535)) as loader:
        batch = next(iter(loader))
        assert batch["tokens"].dtype == np.uint16 and (batch["tokens"][batch["segment_ids"] == 0] == 65_535).all()


def test_a_packed_batch_past_the_machines_memory_is_refused(tmp_path):
    root = write_tokens(tmp_path / "tok", [5, 9, 3], num_shards=1)
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    length = MAX_PACK_LENGTH
    rows = min(MAX_BATCH_TOKENS // length, memory // (16 * length) + 1)  # int64 tokens + 8 bytes: 16 a token
    if rows * length * 16 <= memory:
        pytest.skip("this machine holds the largest packed batch the options allow")
    with pytest.raises(ConfigError, match="more than this machine's"):
        crossfeed.Loader(root, batch_size=rows, pack=Pack(length=length))


def test_jax_pad_to_is_bounded(tmp_path):
    jax_mod = pytest.importorskip("crossfeed.adapters.jax")
    root = write_tokens(tmp_path / "tok", [5, 9, 3, 4], num_shards=1)
    with pytest.raises(ConfigError, match=f"pad_to=\\{{'tokens': 1,099,511,627,776\\}}.*{MAX_PACK_LENGTH:,}"):
        jax_mod.JaxLoader(root, batch_size=2, pad_to={"tokens": 2**40})
    with pytest.raises(ConfigError, match=f"batch_size=1,048,576.*{MAX_BATCH_TOKENS:,}"):
        jax_mod.JaxLoader(root, batch_size=2**20, pad_to={"tokens": 2**13})
