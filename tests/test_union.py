"""A local mixture reads its sources' shards as one split (`UnionSplit`): one pass per batch.
It must deliver exactly what a read per source delivers, in every record layout, and name a
bad record's source and file."""

from __future__ import annotations

import numpy as np
import pytest

import crossfeed
from crossfeed.errors import CorruptRecordError
from crossfeed.read.sources.union import UnionSplit
from crossfeed.read.stages.fetch import MixtureReader, SourceReader


def _source(root, name: str, n: int, offset: int, shards: int, text: bool):
    def sample(i):
        s = {"x": np.full(3 + (i % 3 if text else 0), offset + i, np.float32)[:3], "id": offset + i}
        if text:  # a bytes feature: the decoder is not columnar, records come as views
            s["t"] = b"r" * (i % 50)
        return s

    crossfeed.write_dataset(root / name, [sample(i) for i in range(n)], num_shards=shards).close()
    return root / name


def _ids(path) -> list[int]:
    with crossfeed.open_dataset(path) as ds:
        return [int(ds["train"][i]["id"]) for i in range(len(ds["train"]))]


def _per_source(loader) -> None:
    union = loader.pipeline.builder.reader.union
    readers = [
        SourceReader(sp, union.decoder.features, read=loader.options.read, whole_shards=False, keep_loaded=None)
        for sp in union.frames.split.splits
    ]
    loader.pipeline.builder.reader = MixtureReader(readers, loader.pipeline.builder.reader.starts)


@pytest.mark.parametrize("text", [False, True], ids=["rows", "views"])
def test_one_pass_over_every_source_reads_what_a_pass_per_source_reads(tmp_path, text):
    paths = [
        _source(tmp_path, n, k, o, s, text) for n, k, o, s in (("a", 50, 0, 3), ("b", 9, 1000, 2), ("c", 23, 5000, 4))
    ]
    sources = [crossfeed.Source(p, weight=w) for p, w in zip(paths, (5, 3, 2))]
    ids = [_ids(p) for p in paths]
    kw = dict(batch_size=16, seed=7, return_index=True, samples_per_epoch=160)
    with crossfeed.Loader(sources, **kw) as one, crossfeed.Loader(sources, **kw) as each:
        assert isinstance(one.pipeline.builder.reader.union.frames.split, UnionSplit)
        assert one.pipeline.builder.reader.rows is (not text)
        _per_source(each)
        for a, b in zip(one, each, strict=True):
            assert a.keys() == b.keys()
            for k in a:
                if a[k].dtype == object:
                    assert a[k].tolist() == b[k].tolist()
                else:
                    np.testing.assert_array_equal(a[k], b[k])
            want = [ids[s][i] for s, i in zip(a["__source__"].tolist(), a["__index__"].tolist())]
            np.testing.assert_array_equal(a["id"], want)  # the right samples, not only the same ones


def test_a_bad_record_names_its_source_and_file_or_is_skipped(tmp_path):
    paths = [_source(tmp_path, n, k, o, 2, False) for n, k, o in (("a", 40, 0), ("b", 30, 1000))]
    ids_of = [_ids(p) for p in paths]
    ds = crossfeed.open_dataset(paths[1])
    shard, first = ds["train"].file(1).path, int(ds["train"].starts[1])
    off = int(ds["train"].index(1)[3][0])
    ds.close()
    with open(shard, "r+b") as f:  # flip a payload byte of record 3 of source 1's second shard
        f.seek(off + 14)
        byte = f.read(1)
        f.seek(off + 14)
        f.write(bytes([byte[0] ^ 0xFF]))
    sources = [crossfeed.Source(p, weight=1) for p in paths]
    with crossfeed.Loader(sources, batch_size=10, seed=0, shuffle="none") as loader:
        with pytest.raises(CorruptRecordError, match=str(shard.rsplit("/", 1)[-1])):
            list(loader)
    with crossfeed.Loader(sources, batch_size=10, seed=0, shuffle="none", on_error="skip", return_index=True) as loader:
        got = list(loader)
        assert loader.skipped == 1
    src = np.concatenate([b["__source__"] for b in got])
    idx = np.concatenate([b["__index__"] for b in got])
    ids = np.concatenate([b["id"] for b in got])
    np.testing.assert_array_equal(ids, [ids_of[s][i] for s, i in zip(src.tolist(), idx.tolist())])
    assert first + 3 not in idx[src == 1].tolist() and len(ids) == 69
