"""A remote split whose shards are in the cache is read exactly as its local copy is: the same
batches, byte for byte, and the same fast paths (`Loader.paths`), for small records (the rows
form, a split held whole) and large ones (views, CRC checked at the copy), under every shuffle.

The remote copy is the local directory served over HTTP (with Range support) from a thread; the
oracle is the generator that wrote the samples (a sample's values are a function of its id)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from http_helpers import serving

import crossfeed

pytest.importorskip("aiohttp")

SHUFFLES = ("global", "block", "none")


def _image(i: int, side: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, (side, side, 3), dtype=np.uint8)


# small: 8×8×3 images (framed records well under ROWS_MAX: the rows form, a split held whole);
# large: 80×80×3 (19 KiB records: views, their payload CRCs checked at the copy)
SIZES = {"small": (8, 600, 5), "large": (80, 120, 4)}  # side, samples, shards


@pytest.fixture(scope="module", params=sorted(SIZES))
def served(request, tmp_path_factory):
    """``(local path, url, side)`` of a dataset written locally and served over HTTP."""
    side, n, shards = SIZES[request.param]
    root = tmp_path_factory.mktemp(request.param) / "ds"
    crossfeed.write_dataset(root, ({"image": _image(i, side), "id": i} for i in range(n)), num_shards=shards).close()
    with serving(root) as url:
        yield root, url, side


def _epoch(loader) -> tuple[list[dict], dict]:
    """One epoch's batches and the paths that served them (counts of this epoch only)."""
    before = loader.paths()
    batches = [{k: np.array(v) for k, v in b.items()} for b in loader]
    after = loader.paths()
    return batches, {
        stage: {p: n - before[stage].get(p, 0) for p, n in got.items() if n != before[stage].get(p, 0)}
        for stage, got in after.items()
    }


@pytest.mark.parametrize("shuffle", SHUFFLES)
@pytest.mark.parametrize("batch_size", [32, 256])
def test_a_cached_epoch_equals_the_local_one_batch_for_batch_on_the_same_paths(served, tmp_path, shuffle, batch_size):
    root, url, side = served
    kw = dict(batch_size=batch_size, shuffle=shuffle, seed=7)
    with crossfeed.Loader(root, **kw) as local, crossfeed.Loader(url, cache_dir=tmp_path / "cache", **kw) as remote:
        first, _ = _epoch(remote)  # epoch 0 downloads
        _epoch(local)
        for epoch in (1, 2):  # cached epochs
            want, want_paths = _epoch(local)
            got, got_paths = _epoch(remote)
            assert len(got) == len(want) > 0
            for j, (g, w) in enumerate(zip(got, want)):
                assert g.keys() == w.keys()
                for k in w:
                    np.testing.assert_array_equal(g[k], w[k], err_msg=f"epoch {epoch}, batch {j}, {k!r}")
                for i, img in zip(g["id"].tolist(), g["image"]):  # the oracle: the generator itself
                    np.testing.assert_array_equal(img, _image(i, side), err_msg=f"sample {i}")
            assert got_paths == want_paths, (got_paths, want_paths)
            assert "exact" not in got_paths["frames"], got_paths
        if side * side * 3 < 4096:
            assert set(got_paths["frames"]) <= {"whole", "whole_fixup"}, got_paths
        ids = np.concatenate([b["id"] for b in first])
        assert np.array_equal(np.sort(ids), np.sort(np.concatenate([b["id"] for b in got])))


def test_a_cached_entry_damaged_after_its_hash_check_is_caught_by_the_record_crcs(served, tmp_path):
    """The cached fast paths check every record's CRCs as the local ones do: a byte flipped in a
    cache entry after the cache hashed it (the mapping sees the change) fails the next epoch."""
    root, url, _ = served
    cache = tmp_path / "cache"
    with crossfeed.Loader(url, batch_size=32, shuffle="global", seed=1, cache_dir=cache) as remote:
        _epoch(remote)
        with crossfeed.open_dataset(root) as ds:
            sp = ds["train"]
            off, length = (int(x) for x in sp.index(1)[3])
            sha = sp.shards[1].sha256
        entry = cache / sha[:2] / sha
        with open(entry, "r+b") as f:
            f.seek(off + 12 + length // 3)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x20]))
        with pytest.raises(crossfeed.CorruptRecordError):
            _epoch(remote)
