"""The read pipeline's stages one by one: frame reader, decoder, executor (the sampler's
properties are in test_plan.py, the whole Loader's in test_loader.py)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import crossfeed
from crossfeed.errors import CorruptRecordError, ExampleError
from crossfeed.format import example as ex
from crossfeed.format import tfrecord
from crossfeed.read.executors.threads import ThreadExecutor
from crossfeed.read.stages.decode import ColumnarDecoder, RecordDecoder, make_decoder
from crossfeed.read.stages.frames import FrameReader, Frames
from crossfeed.write.adopt.index import index_dataset


@pytest.fixture
def tabular(tmp_path):
    rng = np.random.default_rng(0)
    samples = [{"x": rng.random(6, dtype=np.float32), "y": int(v)} for v in rng.integers(-5, 300, 90)]
    crossfeed.write_dataset(tmp_path / "tab", samples, num_shards=3).close()
    return crossfeed.open_dataset(tmp_path / "tab"), samples


def _reference(split, indices):
    """Payload bytes read with the plain sequential reader (no batch checks, no index)."""
    every = []
    for s in range(len(split.shards)):
        every += [bytes(p) for _, p in tfrecord.records(tfrecord.read_bytes(split.file(s).path), "ref")]
    return [every[i] for i in indices]


def _payloads(frames: Frames) -> list[bytes]:
    if frames.payloads is not None:
        return [bytes(p) for p in frames.payloads]
    out = [None] * len(frames)
    for pos, matrix in frames.rows:
        for j, row in zip(range(len(matrix)) if pos is None else pos.tolist(), matrix):
            out[j] = row.tobytes()
    return out


@pytest.mark.parametrize("rows", [False, True])
def test_frame_reader_gives_the_records_in_batch_order_in_either_form(tabular, rows):
    ds, _ = tabular
    split = ds["train"]
    reader = FrameReader(split, rows=rows)
    rng = np.random.default_rng(1)
    for indices in (np.arange(5), rng.permutation(len(split))[:40], np.array([89, 0, 45, 44]), np.zeros(0, np.int64)):
        frames = reader(indices)
        assert (frames.rows is not None) == (rows and len(indices) > 0)
        np.testing.assert_array_equal(frames.indices, indices)
        assert _payloads(frames) == _reference(split, indices.tolist())


def test_frame_reader_names_a_corrupt_record_or_drops_it(tabular, tmp_path):
    ds, _ = tabular
    split = ds["train"]
    path = split.file(1).path
    off, length = (int(v) for v in split.index(1)[3])
    want = _reference(split, [0, 60, int(split.starts[1]) + 4])
    with open(path, "r+b") as f:  # flip a payload byte of shard 1's record 3
        f.seek(off + tfrecord.HEADER + 2)
        b = f.read(1)
        f.seek(off + tfrecord.HEADER + 2)
        f.write(bytes([b[0] ^ 0xFF]))
    bad = int(split.starts[1]) + 3
    batch = np.array([0, bad, 60, bad + 1])
    for rows in (False, True):
        reader = FrameReader(crossfeed.open_dataset(ds.path)["train"], rows=rows)
        with pytest.raises(CorruptRecordError) as e:
            reader(batch)
        assert e.value.path == path and e.value.offset == off and "payload CRC" in e.value.reason
        seen = []
        frames = reader(batch, on_error=seen.append)
        assert frames.indices.tolist() == [0, 60, bad + 1] and len(seen) == 1 and seen[0].offset == off
        assert _payloads(frames) == want


def test_frame_reader_reports_an_index_entry_past_the_end(tabular):
    ds, _ = tabular
    split = ds["train"]
    split.index(0)[2, 1] = 10**9  # an index that lies (the cached table, as a damaged .idx would load)
    reader = FrameReader(split)
    with pytest.raises(CorruptRecordError, match="runs past the end"):
        reader(np.array([1, 2]))
    assert reader(np.array([1, 3])).indices.tolist() == [1, 3]  # the rest of the shard still reads


def test_frame_reader_reads_remote_records_by_range(tabular):
    fsspec = pytest.importorskip("fsspec")
    ds, _ = tabular
    fs = fsspec.filesystem("memory")
    import os

    for name in os.listdir(ds.path):
        fs.pipe(f"memory://stages/{name}", open(os.path.join(ds.path, name), "rb").read())
    remote = crossfeed.open_dataset("memory://stages")["train"]
    indices = np.array([70, 3, 33])
    frames = FrameReader(remote, rows=True)(indices)
    assert frames.payloads is not None  # range reads: one checked view per record
    assert _payloads(frames) == _reference(ds["train"], indices.tolist())


def test_decoder_is_chosen_once_from_the_schema(tabular, tmp_path):
    ds, samples = tabular
    assert isinstance(make_decoder(ds.schema), ColumnarDecoder)
    crossfeed.write_dataset(tmp_path / "s", [{"s": "a", "y": 1}], num_shards=1).close()
    assert type(make_decoder(crossfeed.open_dataset(tmp_path / "s").schema)) is RecordDecoder


def test_columnar_and_record_decoders_agree(tabular):
    ds, samples = tabular
    split = ds["train"]
    indices = np.random.default_rng(2).permutation(len(split))[:50]
    frames = FrameReader(split, rows=True)(indices)
    col, kept = make_decoder(ds.schema)(frames)
    ref, kept2 = RecordDecoder(tuple(ds.schema))(frames)
    assert kept.tolist() == kept2.tolist() == list(range(50))
    for k in ("x", "y"):
        np.testing.assert_array_equal(col[k], ref[k])
        assert col[k].dtype == ref[k].dtype
    np.testing.assert_array_equal(col["y"], [split[i]["y"] for i in indices.tolist()])


def _mixed_order_dataset(root) -> crossfeed.Dataset:
    """Records whose fields come in two orders (as other writers may produce): one byte layout
    cannot cut them all."""
    root.mkdir()
    with tfrecord.RecordWriter(root / "train-00000-of-00001.tfrecord") as w:
        for i in range(12):
            ent = {
                "x": (ex.FLOAT, ex.encode_float_list(np.arange(4, dtype=np.float32) + i)),
                "y": (ex.INT64, ex.encode_int64_list([i * 100])),
            }
            if i % 2:
                ent = dict(reversed(list(ent.items())))
            w.write(ex.encode(ent))
    index_dataset(root)
    return crossfeed.open_dataset(root)


@pytest.mark.parametrize("rows", [False, True])
def test_columnar_decoder_parses_a_group_its_layout_does_not_fit(tmp_path, rows):
    ds = _mixed_order_dataset(tmp_path / "mixed")
    frames = FrameReader(ds["train"], rows=rows)(np.arange(12))
    batch, kept = make_decoder(ds.schema)(frames)
    assert kept.tolist() == list(range(12))
    np.testing.assert_array_equal(batch["y"], np.arange(12) * 100)
    np.testing.assert_array_equal(batch["x"], np.arange(4, dtype=np.float32) + np.arange(12)[:, None])


def test_decoder_names_or_skips_a_record_that_is_not_an_example(tabular):
    ds, _ = tabular
    good = FrameReader(ds["train"])(np.arange(4))
    frames = Frames(good.indices, payloads=[good.payloads[0], b"\xff\xff\xff", good.payloads[2], good.payloads[3]])
    for decoder in (make_decoder(ds.schema), RecordDecoder(tuple(ds.schema))):
        with pytest.raises(ExampleError, match="record 1 is here"):
            decoder(frames, where=lambda j: f"record {j} is here")
        seen = []
        batch, kept = decoder(frames, on_error=seen.append)
        assert kept.tolist() == [0, 2, 3] and len(seen) == 1 and len(batch["y"]) == 3


def test_executor_keeps_order_bounds_the_window_and_passes_errors_on():
    active, peak, lock = [0], [0], threading.Lock()

    def build(i):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.002 * (i % 3))
        with lock:
            active[0] -= 1
        if i == 13:
            raise ValueError("batch 13 is bad")
        return i * i

    ex_ = ThreadExecutor(3, 4)
    assert list(ex_.map(build, range(10))) == [i * i for i in range(10)]
    taken = []
    started = []

    def spy(i):
        started.append(i)
        return build(i)

    it = ex_.map(spy, iter(range(100)))
    for _ in range(5):
        taken.append(next(it))
    assert max(started) < 5 + 4  # never more than the window ahead of the consumer
    with pytest.raises(ValueError, match="batch 13 is bad"):
        list(ex_.map(build, range(20)))
    ex_.close()
    assert peak[0] <= 3


def test_a_large_split_gathers_only_the_shards_a_batch_touches(tabular, monkeypatch):
    from crossfeed.read.stages import frames as frame_reader

    ds, _ = tabular
    indices = np.random.default_rng(3).permutation(len(ds["train"]))[:30]
    want = _payloads(FrameReader(ds["train"])(indices))
    monkeypatch.setattr(frame_reader, "ALL_INDEX_MAX", 0)
    reader = FrameReader(crossfeed.open_dataset(ds.path)["train"])
    assert _payloads(reader(indices)) == want
    assert reader._index is None  # no split-wide table was built


def test_a_subset_of_features_keeps_the_columnar_cut(tmp_path):
    """Features left out are no part of the byte layout: reading two of three features still cuts
    column-wise (no record-by-record parse), with the same values."""
    rng = np.random.default_rng(5)
    samples = [
        {"a": rng.random(4, dtype=np.float32), "b": rng.random(6, dtype=np.float32), "label": i % 7} for i in range(64)
    ]
    crossfeed.write_dataset(tmp_path / "d", samples, num_shards=2).close()
    with crossfeed.Loader(
        tmp_path / "d", batch_size=16, shuffle="none", features=["a", "label"], return_index=True
    ) as ld:
        batches = list(ld)
        paths = ld.paths()
    assert paths["decode"] == {"cut": 4} and len(batches) == 4
    ds = crossfeed.open_dataset(tmp_path / "d")["train"]
    for b in batches:
        for i, a, label in zip(b["__index__"].tolist(), b["a"], b["label"].tolist()):
            np.testing.assert_array_equal(a, ds[i]["a"])
            assert label == int(ds[i]["label"])


@pytest.mark.parametrize("threads", [0, 1])
def test_one_thread_and_no_thread_keep_order_and_pass_errors_on(threads):
    def build(i):
        if i == 7:
            raise ValueError("batch 7 is bad")
        return i * 2

    ex_ = ThreadExecutor(threads, 3)
    assert list(ex_.map(build, range(7))) == [i * 2 for i in range(7)]
    with pytest.raises(ValueError, match="batch 7 is bad"):
        list(ex_.map(build, range(10)))
    it = ex_.map(build, iter(range(100)))
    assert [next(it) for _ in range(3)] == [0, 2, 4]
    it.close()  # a consumer that stops early: the producer stops too
    ex_.close()
