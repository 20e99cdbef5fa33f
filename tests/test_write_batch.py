"""`write_dataset` of a given schema writes a chunk of samples at a time — variable-shape tensors
encoded without per-value work, each shard's share of a chunk framed and written at once,
statistics and lengths with numpy — and its files are byte for byte those of the one-sample-at-a-
time path (an inferred schema's): shards, indexes, lengths files, statistics."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import crossfeed
from crossfeed.format import tfrecord
from crossfeed.format.encode import encode_sample_reference, encoder_for
from crossfeed.format.index import format_index, index_path
from crossfeed.format.lengths import format_lengths, lengths_path
from crossfeed.format.manifest import MANIFEST
from crossfeed.format.schema import Encoding, Feature, Schema
from crossfeed.format.stats import FeatureStats, merge_all

TOKENS = Schema([Feature("tokens", "uint32", (None,), Encoding.TENSOR), Feature("label", "int64", (), Encoding.INT64)])


def _docs(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    flat = rng.integers(0, 50_000, 60 * n, dtype=np.uint32)
    lens = rng.integers(0, 60, n)
    lens[::97] = 0  # empty documents too
    off = np.concatenate([[0], np.cumsum(lens)])
    return [{"tokens": flat[off[i] : off[i + 1]], "label": int(i % 5)} for i in range(n)]


def _manifest(root) -> dict:
    with open(os.path.join(root, MANIFEST)) as f:
        return json.load(f)


def _one_at_a_time(tmp_path, docs, num_shards=None, shard_size=None, compress=False):
    """The files the plain path writes: each sample encoded by the reference encoder, framed and
    written alone (`RecordWriter.write`); shards by the documented rule (round-robin, or a new
    shard once one holds ``shard_size`` bytes); the index and lengths of each."""
    payloads = [encode_sample_reference(TOKENS, d) for d in docs]
    writers: list[tfrecord.RecordWriter] = []
    members: list[list[int]] = []

    def new():
        writers.append(tfrecord.RecordWriter(tmp_path / f"ref{len(writers)}", compress=compress))
        members.append([])

    for _ in range(num_shards or 0):
        new()
    for i, p in enumerate(payloads):
        if num_shards:
            k = i % num_shards
        else:
            if not writers or writers[-1].num_bytes >= shard_size:
                new()
            k = len(writers) - 1
        writers[k].write(p)
        members[k].append(i)
    out = []
    for w, mine in zip(writers, members):
        w.close()
        lens = [[docs[i]["tokens"].size] for i in mine]
        out.append(
            (open(w.path, "rb").read(), format_index(w.offsets), format_lengths(np.zeros((0, 1)) if not lens else lens))
        )
    stats = {k: FeatureStats() for k in TOKENS.names}
    for d in docs:
        for k, v in d.items():
            stats[k].add(v)
    return out, {k: v.to_json() for k, v in merge_all([stats]).items()}


@pytest.mark.parametrize(
    "layout",
    [
        {"num_shards": 3},
        {"num_shards": 7},
        {"num_shards": 3000},  # more shards than records: some stay empty
        {"shard_size": 40_000},  # shards end inside chunks and across them
        {"shard_size": 1},  # a record per shard
        {"num_shards": 2, "compress": True},
        {"shard_size": 20_000, "compress": True},
    ],
)
def test_chunked_write_is_byte_identical_to_one_at_a_time(tmp_path, layout):
    docs = _docs(2600 if layout.get("shard_size") != 1 else 300)
    crossfeed.write_dataset(tmp_path / "d", docs, schema=TOKENS, **layout).close()
    want, stats = _one_at_a_time(tmp_path, docs, **layout)
    m = _manifest(tmp_path / "d")
    shards = m["splits"]["train"]["shards"]
    assert m["lengths"] == ["tokens"] and len(shards) == len(want) > 1
    for sh, (data, index, lengths) in zip(shards, want):
        path = tmp_path / "d" / sh["file"]
        assert path.read_bytes() == data, sh["file"]
        assert open(index_path(path), "rb").read() == index
        assert open(lengths_path(path), "rb").read() == lengths
    assert m["splits"]["train"]["statistics"] == json.loads(json.dumps(stats))
    with crossfeed.open_dataset(tmp_path / "d") as ds:
        got = sorted((r["label"], r["tokens"].tolist()) for r in ds["train"])
    assert got == sorted((d["label"], d["tokens"].tolist()) for d in docs)


def test_a_shards_records_are_the_reference_encoding_framed_one_by_one(tmp_path):
    docs = _docs(1500, seed=1)
    crossfeed.write_dataset(tmp_path / "d", docs, schema=TOKENS, num_shards=4).close()
    m = _manifest(tmp_path / "d")
    for k, sh in enumerate(m["splits"]["train"]["shards"]):
        want = b"".join(tfrecord.frame(encode_sample_reference(TOKENS, d)) for d in docs[k::4])
        assert open(tmp_path / "d" / sh["file"], "rb").read() == want


def test_record_writer_batches_frame_as_single_writes(tmp_path):
    rng = np.random.default_rng(2)
    payloads = [rng.bytes(int(n)) for n in rng.integers(0, 3000, 300)] + [b"", b"x" * 300_000]
    with tfrecord.RecordWriter(tmp_path / "one") as one:
        for p in payloads:
            one.write(p)
    with tfrecord.RecordWriter(tmp_path / "many") as many:
        many.write_many(payloads[:7])
        many.write_many([])
        many.write_many(payloads[7:200])
        many.write_many([memoryview(p) for p in payloads[200:]])
    assert (tmp_path / "one").read_bytes() == (tmp_path / "many").read_bytes()
    assert one.offsets == many.offsets and one.sha256 == many.sha256 and one.num_bytes == many.num_bytes


@pytest.mark.parametrize(
    "feature, values",
    [
        (
            Feature("t", "uint32", (None,), Encoding.TENSOR),
            [np.arange(n, dtype=np.uint32) for n in (0, 1, 300, 20_000)],
        ),
        (Feature("t", "int16", (None, 3), Encoding.TENSOR), [np.ones((n, 3), np.int16) * n for n in (0, 2, 5000)]),
        (Feature("t", "float32", (2, None), Encoding.TENSOR), [np.full((2, n), 0.5, np.float32) for n in (1, 9)]),
        # not the fast path's values (a view with strides, another byte order, a list): per value, same bytes
        (Feature("t", "uint32", (None,), Encoding.TENSOR), [np.arange(10, dtype=np.uint32)[::2], np.arange(3)]),
        (Feature("t", "uint32", (None,), Encoding.TENSOR), [np.arange(4, dtype=">u4"), [1, 2, 3]]),
    ],
)
def test_variable_tensor_columns_encode_as_the_reference(feature, values):
    schema = Schema([feature, Feature("x", "int64", (), Encoding.INT64)])
    rows = [{"t": v, "x": i} for i, v in enumerate(values)]
    try:
        want = [encode_sample_reference(schema, r) for r in rows]
    except crossfeed.errors.SchemaError as e:  # the reference refuses it: so does the batch, the same way
        with pytest.raises(crossfeed.errors.SchemaError) as got:
            encoder_for(schema).encode_rows(rows)
        assert str(e) in str(got.value)
        return
    assert encoder_for(schema).encode_rows(rows) == want


@pytest.mark.parametrize("dtype", ["uint32", "int16", "uint8", "int64"])
def test_statistics_of_integer_arrays_at_once_equal_one_by_one(dtype):
    rng = np.random.default_rng(4)
    lo = -40 if dtype.startswith("int") else 0
    for trial in range(30):
        col = [rng.integers(lo, 100, int(n)).astype(dtype) for n in rng.integers(0, 6, rng.integers(1, 40))]
        if trial % 3 == 0:
            col = [c.reshape(-1, 1) for c in col]
        for start in ({}, {"total": 3.5, "min": -1.0, "max": 2.0, "count": 2, "n_values": 9}):
            one, many = FeatureStats(**start), FeatureStats(**start)
            for v in col:
                one.add(v)
            assert many.add_arrays(col)
            assert one == many and list(one.shapes) == list(many.shapes)


def test_statistics_at_once_refuse_what_they_cannot_promise():
    st = FeatureStats()
    assert not st.add_arrays([np.ones(3, np.float32)])  # float sums depend on the order
    assert not st.add_arrays([np.ones(3, np.uint32), np.ones(3, np.int32)])  # two dtypes
    assert not st.add_arrays([np.full(2, 2**62, np.int64)])  # the sum would round in float64
    assert not st.add_arrays([[1, 2]])
    assert st == FeatureStats()


@pytest.mark.parametrize("n, top", [(1023, 10**6), (1024, 9), (1024, 10), (5000, 10**6), (3000, 10**13)])
def test_index_lines_are_the_format_strings(n, top):
    rng = np.random.default_rng(n)
    offsets = [(0, 16)] + [
        (int(o), int(m)) for o, m in zip(np.sort(rng.integers(0, top, n - 1)), rng.integers(16, top + 17, n - 1))
    ]
    if n < 1024:
        want = "".join(f"{o} {m}\n" for o, m in offsets)
    else:
        wo, wm = len(str(max(o for o, _ in offsets))), len(str(max(m for _, m in offsets)))
        want = "".join(f"{o:0{wo}d} {m:0{wm}d}\n" for o, m in offsets)
    assert format_index(offsets) == want.encode()
