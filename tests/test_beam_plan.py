"""The pure parts of the Beam conversion jobs: shard plan, routing, ordering, splits, hashing."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import requires
from hypothesis import given, settings
from hypothesis import strategies as st

from crossfeed.beam_jobs import plan as planning
from crossfeed.beam_jobs.policy import DuplicateKeyError
from crossfeed.beam_jobs.records import BUCKET_BITS, NUM_BUCKETS, Part, key_hashes
from crossfeed.beam_jobs.splits import SplitSpec
from crossfeed.config import parse_size
from crossfeed.errors import ConfigError

pytestmark = requires("apache_beam")


def test_key_hashes_are_stable_blake2b():
    import hashlib

    shuffle, split = key_hashes(["a/1.jpg", "b"])
    d = hashlib.blake2b(b"a/1.jpg", digest_size=16, person=b"crossfeed.key").digest()
    assert int(shuffle[0]) == int.from_bytes(d[:8], "big") and int(split[0]) == int.from_bytes(d[8:], "big")
    seeded, split2 = key_hashes(["a/1.jpg", "b"], seed=7)
    assert not np.array_equal(seeded, shuffle) and np.array_equal(split2, split)  # seed moves order, not splits


@given(st.integers(0, 500), st.integers(1, 40))
def test_balanced_ranges(total, n):
    ranges = planning.balanced_ranges(total, n)
    assert len(ranges) == n and ranges[0][0] == 0 and ranges[-1][1] == total
    sizes = [hi - lo for lo, hi in ranges]
    assert max(sizes) - min(sizes) <= 1
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def _simulate(hashes: np.ndarray, keys: list[str], n: int) -> list[list[str]]:
    """Plan, route a few 'batches', and cut each shard as the WriteShards step does."""
    hist = np.bincount((hashes >> np.uint64(64 - BUCKET_BITS)).astype(np.int64), minlength=NUM_BUCKETS)
    plans = planning.plan_split("train", hist, n)
    table = planning.route_table(plans)
    received: dict[int, list[Part]] = {}
    for chunk in np.array_split(np.arange(len(keys)), 3):
        part = Part("train", hashes[chunk], [keys[i] for i in chunk], [keys[i].encode() for i in chunk])
        for shard, piece in planning.route(part, table):
            received.setdefault(shard, []).append(piece)
    shards = []
    for p in plans:
        pieces = received.get(p.index, [])
        h = np.concatenate([x.hashes for x in pieces]) if pieces else np.zeros(0, np.uint64)
        ks = [k for x in pieces for k in x.keys]
        assert len(ks) == p.end_offset - p.first_offset
        order = planning.sorted_order(h, ks, "train")
        shards.append([ks[i] for i in order[p.lo - p.first_offset : p.hi - p.first_offset]])
    return shards


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 400), st.integers(1, 12), st.integers(0, 2**32), st.booleans())
def test_plan_route_cut_is_the_global_order_in_balanced_pieces(n_records, n_shards, seed, clustered):
    rng = np.random.default_rng(seed)
    keys = [f"k{i}" for i in range(n_records)]
    if clustered:  # few distinct buckets, so boundary buckets span several shards
        hashes = (rng.integers(0, 3, n_records).astype(np.uint64) << np.uint64(60)) | rng.integers(
            0, 2**40, n_records
        ).astype(np.uint64)
        hashes[: n_records // 3] = hashes[0]  # ties broken by key
    else:
        hashes = rng.integers(0, 2**63, n_records, dtype=np.int64).astype(np.uint64) * np.uint64(2)
    shards = _simulate(hashes, keys, n_shards)
    expected = [keys[i] for i in sorted(range(n_records), key=lambda i: (int(hashes[i]), keys[i]))]
    assert [k for s in shards for k in s] == expected
    sizes = [len(s) for s in shards]
    assert len(sizes) == n_shards and max(sizes) - min(sizes) <= 1


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 400), st.integers(1, 12), st.integers(0, 2**32), st.booleans())
def test_a_hash_ordered_part_routes_as_ranges(n_records, n_shards, seed, clustered):
    """What a held (in-memory) part sends each shard is a range of its records in hash order: the
    same records `route` sends, boundary buckets to every shard that keeps them."""
    from crossfeed.beam_jobs.records import StagedPart

    rng = np.random.default_rng(seed)
    top = rng.integers(0, 3 if clustered else NUM_BUCKETS, n_records).astype(np.uint64) << np.uint64(64 - BUCKET_BITS)
    hashes = np.sort(top | rng.integers(0, 2**40, n_records).astype(np.uint64))
    hist = np.bincount((hashes >> np.uint64(64 - BUCKET_BITS)).astype(np.int64), minlength=NUM_BUCKETS)
    table = planning.route_table(planning.plan_split("train", hist, n_shards))
    keys = [f"k{i}" for i in range(n_records)]
    zeros = np.zeros(n_records, np.int64)
    part = StagedPart("train", "b", hashes, keys, zeros, zeros)
    by_route = {shard: sorted(piece.keys, key=keys.index) for shard, piece in planning.route(part, table)}
    by_range = {shard: keys[lo:hi] for shard, lo, hi in planning.route_ranges(part, table)}
    assert by_range == by_route and sum(map(len, by_range.values())) >= n_records


def test_duplicate_key_is_named():
    h = np.array([5, 9, 5], dtype=np.uint64)
    with pytest.raises(DuplicateKeyError, match="'x'"):
        planning.sorted_order(h, ["x", "y", "x"], "train")
    order = planning.sorted_order(h, ["b", "y", "a"], "train")  # equal hashes, different keys: by key
    assert order.tolist() == [2, 0, 1]


def test_split_spec():
    spec = SplitSpec.parse("train=0.9,validation=0.1")
    assert spec.names == ("train", "validation")
    _, h = key_hashes([f"k{i}" for i in range(20000)])
    names, which = spec.assign(h)
    frac = np.mean(which == 0)
    assert 0.88 < frac < 0.92
    assert SplitSpec.parse("test").names == ("test",)
    for bad in ("train=0.5,validation=0.4", "train=x", "a=1,a=0", "bad name=1"):
        with pytest.raises(ConfigError):
            SplitSpec.parse(bad)


def test_parse_size():
    assert parse_size("256MB") == 256 << 20 and parse_size("1.5k") == 1536 and parse_size("4096") == 4096
    with pytest.raises(ConfigError):
        parse_size("lots")
