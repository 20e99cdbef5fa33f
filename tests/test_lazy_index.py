"""Indexes read in place (`LazyIndex`): the same entries as the whole index, each block checked
for tiling when first touched, and a large split's Loader never reading an index whole."""

from __future__ import annotations

import os

import numpy as np
import pytest

import crossfeed
from crossfeed.errors import IndexFileError
from crossfeed.format import index as idx
from crossfeed.read.stages import frames as frame_reader


def _entries(n: int, seed: int = 0) -> list[tuple[int, int]]:
    lens = np.random.default_rng(seed).integers(16, 300, n)
    offs = np.concatenate([[0], np.cumsum(lens)[:-1]])
    return list(zip(offs.tolist(), lens.tolist()))


def _lazy(path, n: int, num_bytes: int | None):
    fd = os.open(path, os.O_RDONLY)
    return idx.LazyIndex.open(lambda off, k: os.pread(fd, k, off), os.path.getsize(path), str(path), n, num_bytes)


def test_fixed_width_lines_read_in_place_give_the_whole_index(tmp_path):
    entries = _entries(5000)
    p = tmp_path / "a.idx"
    idx.write_index(p, entries)
    lines = p.read_bytes().splitlines()
    assert len({len(x) for x in lines}) == 1  # one width: entry k at byte k × width
    whole = idx.read_index(p)  # the padded numbers parse as before
    assert whole.tolist() == [list(e) for e in entries]
    lazy = _lazy(p, 5000, sum(entries[-1]))
    k = np.random.default_rng(1).integers(0, 5000, 700)
    np.testing.assert_array_equal(lazy[k], whole[k])
    small = tmp_path / "b.idx"  # short indexes stay as tfrecord2idx writes them
    idx.write_index(small, [(0, 16), (16, 116)])
    assert small.read_text() == "0 16\n16 116\n" and _lazy(small, 2, 132) is None


def _edit(path, entry: int, offset: int, length: int) -> None:
    data = bytearray(path.read_bytes())
    w = data.index(b"\n") + 1
    sp = data.index(b" ")
    data[entry * w : (entry + 1) * w] = f"{offset:0{sp}d} {length:0{w - sp - 2}d}\n".encode()
    path.write_bytes(bytes(data))


def test_a_bad_entry_is_caught_when_its_block_is_first_read(tmp_path):
    entries = _entries(4 * idx.BLOCK)
    p = tmp_path / "a.idx"
    idx.write_index(p, entries)
    bad = 2 * idx.BLOCK + 10
    _edit(p, bad, entries[bad][0] + 1, entries[bad][1])  # does not start where the one before ends
    lazy = _lazy(p, len(entries), sum(entries[-1]))
    assert lazy[np.array([5, idx.BLOCK + 3])].tolist() == [list(entries[5]), list(entries[idx.BLOCK + 3])]
    with pytest.raises(IndexFileError, match=f"entry {bad} does not start"):
        lazy[np.array([2 * idx.BLOCK])]


def test_blocks_that_tile_alone_but_overlap_each_other_are_caught(tmp_path):
    entries = _entries(4 * idx.BLOCK, seed=2)
    p = tmp_path / "a.idx"
    idx.write_index(p, entries)
    # the last block moved back onto block 2's bytes, tiling within itself (the stream's size is
    # not known, as for a GZIP shard): only block 2, never read, shows the seam
    lo = 3 * idx.BLOCK
    shift = entries[lo][0] - entries[2 * idx.BLOCK][0]
    for k in range(lo, len(entries)):
        o, n = entries[k]
        _edit(p, k, o - shift, n)
    for first, then in ((idx.BLOCK + 5, lo + 7), (lo + 7, idx.BLOCK + 5)):  # either order
        lazy = _lazy(p, len(entries), None)
        lazy[np.array([first])]
        with pytest.raises(IndexFileError, match="overlap"):
            lazy[np.array([then])]


def test_a_large_split_reads_its_indexes_in_place_and_the_same_batches(tmp_path, monkeypatch):
    samples = [{"x": np.full(4, i, np.float32), "id": i} for i in range(3 * 1500)]
    crossfeed.write_dataset(tmp_path / "d", samples, num_shards=3).close()
    kw = dict(batch_size=64, seed=5, shuffle="global", return_index=True)
    with crossfeed.Loader(tmp_path / "d", **kw) as loader:
        want = list(loader)
    monkeypatch.setattr(frame_reader, "ALL_INDEX_MAX", 1000)  # a "large" split: indexes read lazily
    with crossfeed.Loader(tmp_path / "d", **kw) as loader:
        got = list(loader)
        split = loader.split
        assert all(isinstance(x, idx.LazyIndex) for x in split._lazy)
        assert all(x is None for x in split._index)  # no index was ever read whole
    for a, b in zip(got, want, strict=True):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
