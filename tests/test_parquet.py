"""Parquet files read in place: `crossfeed index` on files written by pyarrow and HF ``datasets``,
the Loader compared value for value with pyarrow's own reading, every plan property (global and
block shuffle, exact resume, ranks), ``crossfeed info/verify/head`` through the real CLI, and
files that changed or are damaged after indexing."""

from __future__ import annotations

import decimal
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from loader_helpers import assert_resumes_identically, epoch_batches
from parquet_data import ROW_GROUP, ROWS, assert_row_equal, oracle, png, write_hf_file, write_pyarrow_files

from crossfeed.errors import CorruptRecordError, ManifestError, SchemaError
from crossfeed.format.manifest import MANIFEST, loads
from crossfeed.format.schema import Encoding
from crossfeed.read.loader import INDEX_KEY, Loader
from crossfeed.read.sources.dataset import open_dataset
from crossfeed.read.tools.verify import verify_dataset
from crossfeed.write.adopt.index import index_dataset

N = sum(ROWS)


def _cli(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "crossfeed.cli.main", *map(str, args)], capture_output=True, text=True, timeout=120
    )


def _digests(root) -> dict[str, str]:
    return {n: hashlib.sha256(open(os.path.join(root, n), "rb").read()).hexdigest() for n in sorted(os.listdir(root))}


@pytest.fixture
def pa_dir(tmp_path):
    root = tmp_path / "pa"
    paths = write_pyarrow_files(root)
    before = _digests(root)
    index_dataset(root)
    after = _digests(root)
    assert set(after) == set(before) | {MANIFEST}  # nothing written but the manifest ...
    assert all(after[n] == d for n, d in before.items())  # ... and no file modified
    return root, paths


def _check_rows(batches, expected, names, *, skip=()):
    seen = 0
    for b in batches:
        for j, i in enumerate(b[INDEX_KEY].tolist()):
            for name in names:
                if name not in skip:
                    assert_row_equal(b[name][j], expected[name][i], name, f"row {i}")
            seen += 1
    return seen


def test_index_maps_columns_to_features(pa_dir):
    root, _ = pa_dir
    ds = open_dataset(root)
    s = {f.name: (f.encoding, f.dtype, f.shape) for f in ds.schema}
    assert s == {
        "id": (Encoding.INT64, "int64", ()),
        "label": (Encoding.TENSOR, "int32", ()),  # every number keeps the dtype the file stores
        "score": (Encoding.TENSOR, "float64", ()),
        "vec": (Encoding.TENSOR, "float32", (3,)),
        "mat": (Encoding.TENSOR, "int16", (2, 2)),
        "seq": (Encoding.TENSOR, "int64", (4,)),  # a plain list, every row 4 long
        "ragged": (Encoding.TENSOR, "float32", (None,)),
        "blob": (Encoding.BYTES, "bytes", ()),
        "text": (Encoding.BYTES, "string", ()),
        "flag": (Encoding.TENSOR, "bool", ()),
    }
    shards = ds.splits["train"].shards
    assert ds.splits["train"].format == "parquet"
    assert [sh.row_groups for sh in shards] == [(10,) * 5 + (3,), (10,) * 4 + (7,)]
    assert ds.splits["train"].num_records == N
    text = (root / MANIFEST).read_text()
    assert loads(text, "m").splits["train"].shards[0].row_groups == shards[0].row_groups  # round trip


def test_unshuffled_loader_equals_pyarrow_row_for_row(pa_dir):
    root, paths = pa_dir
    expected = oracle(paths)
    with Loader(root, batch_size=7, shuffle="none", return_index=True) as loader:
        batches = list(loader)
    assert np.concatenate([b[INDEX_KEY] for b in batches]).tolist() == list(range(N))
    b = batches[0]
    assert b["vec"].shape == (7, 3) and b["mat"].shape == (7, 2, 2) and b["mat"].dtype == np.int16
    assert b["seq"].shape == (7, 4) and b["label"].dtype == np.int32 and b["score"].dtype == np.float64
    assert b["ragged"].dtype == object and b["blob"].dtype == object and isinstance(b["text"][0], str)
    assert _check_rows(batches, expected, list(expected)) == N
    np.testing.assert_array_equal(np.concatenate([b["id"] for b in batches]), np.arange(N))


@pytest.mark.parametrize("shuffle", ["global", "block"])
@pytest.mark.parametrize("batch_size", [1, 16])
@pytest.mark.parametrize("lru", ["fits", "two"])
def test_shuffles_are_permutations_with_pyarrow_values(pa_dir, shuffle, batch_size, lru):
    """Both gather paths: row groups from the LRU (a batch gathered group by group), and, once the
    LRU holds the whole split, whole-split columns (one take per column)."""
    root, paths = pa_dir
    expected = oracle(paths)
    with Loader(root, batch_size=batch_size, shuffle=shuffle, seed=3, return_index=True) as loader:
        groups = loader.pipeline.builder.reader.frames.groups
        if lru == "two":
            groups.max_bytes = 0  # the LRU keeps its minimum of two row groups: never the whole split
        batches = list(loader)
        ids = np.concatenate([b[INDEX_KEY] for b in batches])
        assert sorted(ids.tolist()) == list(range(N)) and ids.tolist() != list(range(N))
        assert _check_rows(batches, expected, list(expected)) == N
        if lru == "fits":  # the split's 11 row groups fit the LRU: each decoded once, whatever the order
            assert (
                groups.loads == 11 and loader.pipeline.builder.reader.frames.split_columns is not None
            )  # ... then one take
        else:
            assert groups.loads >= 11 and len(groups) == 2
        second = np.concatenate([b[INDEX_KEY] for b in loader])
    assert sorted(second.tolist()) == list(range(N)) and second.tolist() != ids.tolist()  # epoch 1 differs


def test_block_shuffle_windows_over_row_groups(pa_dir):
    """With a window of one row group, a batch straddles at most two row groups, and an LRU of two
    (batches built one at a time) decodes each row group once."""
    root, _ = pa_dir
    kw = dict(batch_size=ROW_GROUP, shuffle="block", block_shards=1, seed=9, return_index=True, num_threads=0)
    with Loader(root, **kw) as loader:
        loader.pipeline.builder.reader.frames.groups.max_bytes = 0  # keep the minimum: 2 row groups
        ids = [b[INDEX_KEY] for b in loader]
        assert loader.pipeline.builder.reader.frames.groups.loads == 11
    starts = np.cumsum([0, *(10,) * 5, 3, *(10,) * 4])
    for b in ids:
        groups = np.unique(np.searchsorted(starts, b, side="right") - 1)
        assert len(groups) <= 2  # a batch straddles at most one window boundary


def test_exact_resume_and_ranks(pa_dir):
    root, _ = pa_dir
    assert_resumes_identically(root, stops=[0, 3, 7], batch_size=8, shuffle="global", seed=5)
    assert_resumes_identically(root, stops=[5], batch_size=8, shuffle="block", seed=5, block_shards=2)
    per_rank = [epoch_batches(root, batch_size=6, seed=2, rank=r, world_size=3) for r in range(3)]
    assert len({len(b) for b in per_rank}) == 1  # equal steps on every rank
    ids = np.concatenate([np.concatenate(b) for b in per_rank])
    assert set(ids.tolist()) == set(range(N)) and len(ids) == N + (-N % 3)


def test_selected_features_only_are_read(pa_dir):
    root, paths = pa_dir
    expected = oracle(paths)
    with Loader(root, batch_size=32, features=["text", "vec"], return_index=True, shuffle="global") as loader:
        batches = list(loader)
    assert set(batches[0]) == {"text", "vec", INDEX_KEY}
    assert _check_rows(batches, expected, ["text", "vec"]) == N


def test_hf_datasets_file_equals_pyarrow(tmp_path):
    root = tmp_path / "hf"
    path = write_hf_file(root)
    index_dataset(root)
    ds = open_dataset(root)
    s = {f.name: (f.encoding, f.dtype, f.shape) for f in ds.schema}
    assert s["label"] == (Encoding.INT64, "int64", ())
    assert s["emb"] == (Encoding.TENSOR, "float32", (4,))
    assert s["tokens"] == (Encoding.TENSOR, "int32", (None,))
    assert s["caption"] == (Encoding.BYTES, "string", ())
    assert s["image"] == (Encoding.IMAGE, "uint8", (None, None, None))
    assert list(ds.splits) == ["train"] and ds.splits["train"].shards[0].row_groups == (12, 12, 12, 4)
    expected = oracle([path])
    with Loader(root, batch_size=9, shuffle="global", seed=1, return_index=True) as loader:
        batches = list(loader)
    assert _check_rows(batches, expected, list(expected), skip=("image",)) == 40
    from PIL import Image

    for b in batches:
        assert b["image"].shape[1:] == (6, 5, 3)
        for j, i in enumerate(b[INDEX_KEY].tolist()):
            want = np.asarray(Image.open(__import__("io").BytesIO(expected["image"][i]["bytes"])))
            np.testing.assert_array_equal(b["image"][j], want)
            assert expected["image"][i]["bytes"] == png(i * 5)


def test_declared_features_pick_columns_and_type_bytes(tmp_path):
    root = tmp_path / "decl"
    os.makedirs(root)
    raw = np.arange(24 * 12, dtype=np.uint8).reshape(24, 12)
    t = pa.table(
        {
            "pixels": pa.array([r.tobytes() for r in raw], pa.binary()),
            "photo": pa.array([png(i) for i in range(24)], pa.binary()),
            "label": pa.array(np.arange(24)),
            "price": pa.array([decimal.Decimal(i) for i in range(24)], pa.decimal128(5, 0)),
            "tags": pa.array([[("a", i)] for i in range(24)], pa.map_(pa.string(), pa.int64())),
            "flat": pa.FixedSizeListArray.from_arrays(pa.array(raw.ravel()), 12),
        }
    )
    pq.write_table(t, root / "d.parquet", row_group_size=5)
    # every column crossfeed cannot read is named in one run
    with pytest.raises(SchemaError, match=r"d\.parquet: columns 'price' \(decimal.*'tags' \(map.*--feature"):
        index_dataset(root)
    index_dataset(root, features=["pixels=tensor:uint8:3,4", "photo=image", "label", "flat=tensor:uint8:2,2,3"])
    ds = open_dataset(root)
    assert ds.schema.names == ["pixels", "photo", "label", "flat"]  # in the file's column order
    with Loader(root, batch_size=24, shuffle="none") as loader:
        (b,) = list(loader)
    np.testing.assert_array_equal(b["pixels"], raw.reshape(24, 3, 4))
    assert b["photo"].shape == (24, 6, 5, 3) and b["photo"][3, 0, 0, 0] == 21
    np.testing.assert_array_equal(b["label"], np.arange(24))
    np.testing.assert_array_equal(b["flat"], raw.reshape(24, 2, 2, 3))  # a flat list reshaped as declared
    with pytest.raises(SchemaError, match=r"column 'pixels' row 0: 12 bytes do not fit uint8\[5\]"):
        index_dataset(root, features=["pixels=tensor:uint8:5"], force=True)


def test_nulls_and_unreadable_files_are_named(tmp_path):
    root = tmp_path / "nulls"
    os.makedirs(root)
    pq.write_table(pa.table({"x": pa.array([1, None, 3])}), root / "n.parquet")
    # a null in an int column: a mask feature beside it (tests/test_parquet_pandas.py)
    assert index_dataset(root, features=["x=int64"]).schema.names == ["x", "x/valid"]
    bad = tmp_path / "bad"
    os.makedirs(bad)
    (bad / "b.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(CorruptRecordError, match=r"b\.parquet.*not a readable Parquet file"):
        index_dataset(bad)


def test_manifest_format_is_validated(pa_dir):
    root, _ = pa_dir
    d = json.loads((root / MANIFEST).read_text())
    sh = d["splits"]["train"]["shards"][0]
    for split_change, change, match in [
        ({"format": "orc"}, {}, "format"),
        ({}, {"format": "parquet"}, "unknown field 'format'"),  # the split says, not its shards
        ({}, {"row_groups": [1, 2]}, "add up to 3 rows"),
        ({"format": "tfrecord"}, {}, "only a parquet shard has row groups"),
        ({}, {"index_sha256": "0" * 64}, "has no index file"),
    ]:
        bad = json.loads(json.dumps(d))
        bad["splits"]["train"].update(split_change)
        bad["splits"]["train"]["shards"][0] = {**sh, **change}
        with pytest.raises(ManifestError, match=match):
            loads(json.dumps(bad), "m")


@pytest.mark.slow
def test_cli_info_verify_head(pa_dir):
    root, _ = pa_dir
    out = _cli("info", root)
    assert out.returncode == 0, out.stderr
    assert "vec" in out.stdout and "100 records" in out.stdout
    out = _cli("head", root, "-n", "2")
    assert out.returncode == 0, out.stderr
    assert "[train 1]" in out.stdout and "text: str[" in out.stdout and "'row 1 ünïcode'" in out.stdout
    out = _cli("verify", root)
    assert out.returncode == 0, out.stderr
    assert "ok: 100 records in 2 shards" in out.stdout and "page CRCs are checked only where" in out.stdout
    out = _cli("index", root, "--force", "--feature", "text", "--feature", "blob=image")  # pick two columns
    assert out.returncode == 0, out.stderr
    assert "100 records in 2 shards; features blob, text" in out.stdout
    assert [f.encoding for f in open_dataset(root).schema] == [Encoding.IMAGE, Encoding.BYTES]


def test_a_damaged_page_and_a_changed_file_are_detected(pa_dir, tmp_path):
    root, paths = pa_dir
    # the last byte of row group 2's first column chunk (its data page) flipped: the page CRC fails
    col = pq.ParquetFile(paths[0]).metadata.row_group(2).column(0)
    sound = open(paths[0], "rb").read()
    data = bytearray(sound)
    data[(col.dictionary_page_offset or col.data_page_offset) + col.total_compressed_size - 1] ^= 0xFF
    open(paths[0], "wb").write(bytes(data))
    problems = verify_dataset(root)
    assert any("sha256 differs" in p.reason for p in problems)
    assert any("row group 2 does not decode" in p.reason for p in problems), problems
    out = _cli("verify", root)
    assert out.returncode == 1 and "row group 2" in out.stderr
    with Loader(root, batch_size=10, shuffle="none") as loader:
        it = iter(loader)
        next(it), next(it)  # row groups 0 and 1 are sound
        with pytest.raises(CorruptRecordError, match=r"part-0\.parquet.*row group 2 does not decode"):
            next(it)
    with Loader(root, batch_size=10, shuffle="none", on_error="skip", max_skips=5, return_index=True) as loader:
        ids = np.concatenate([b[INDEX_KEY] for b in loader])
        assert loader.skipped == 1 and len(ids) == N - 10 and not set(range(20, 30)) & set(ids.tolist())
    open(paths[0], "wb").write(sound)
    # a file rewritten with other row groups (and size) after indexing is refused when opened
    pq.write_table(pq.read_table(paths[1]), paths[1], row_group_size=7)
    with pytest.raises(CorruptRecordError, match=r"part-1\.parquet.*changed after `crossfeed index`"):
        with Loader(root, batch_size=N, shuffle="none") as loader:
            list(loader)
    assert any("part-1" in p.file and "manifest says" in p.reason for p in verify_dataset(root))


def test_parquet_sources_mix(pa_dir, tmp_path):
    """A mixture of Parquet sources (of any format: tests/test_mixture_formats.py) reads each
    source's rows by their source's index."""
    root, paths = pa_dir
    from crossfeed.read.options import Source

    expected = oracle(paths)
    kw = dict(batch_size=4, samples_per_epoch=24, features=["id"], return_index=True)
    with Loader([Source(root), Source(root, weight=2)], **kw) as loader:
        batches = list(loader)
    assert sum(len(b["id"]) for b in batches) == 24
    for b in batches:
        assert b["id"].tolist() == [expected["id"][i] for i in b["__index__"].tolist()]


def test_serve_streams_parquet_batches(pa_dir, tmp_path):
    """`crossfeed serve`'s own factory over Parquet, to a client on ipc://: every row once per
    epoch, with pyarrow's values."""
    from crossfeed.net import Server, ServerOptions, connect
    from crossfeed.net.run import LoaderEpochs
    from crossfeed.read.options import LoaderOptions

    root, paths = pa_dir
    expected = oracle(paths)
    factory = LoaderEpochs(str(root), LoaderOptions.of(batch_size=16, seed=1, features=["id", "vec", "text"]))
    opts = ServerOptions((f"ipc://{tmp_path}/pq.sock",), epochs=2, server_id="pq")
    got: dict[int, list] = {0: [], 1: []}
    try:
        with Server(factory, opts) as server:
            with connect(server.endpoints, with_meta=True) as client:
                for meta, batch in client:
                    ids = meta.sample_ids.tolist()
                    got[meta.epoch] += ids
                    np.testing.assert_array_equal(batch["id"], ids)
                    for j, i in enumerate(ids):
                        assert_row_equal(batch["vec"][j], expected["vec"][i], "vec", f"row {i}")
                        assert batch["text"][j] == expected["text"][i]
            assert server.wait(10)
            server.raise_if_failed()
    finally:
        factory.close()
    assert {e: sorted(v) for e, v in got.items()} == {0: list(range(N)), 1: list(range(N))}
    assert got[0] != got[1]  # each epoch its own global shuffle


def test_split_indexing_and_iteration_equal_pyarrow(pa_dir):
    root, paths = pa_dir
    expected = oracle(paths)
    with open_dataset(root) as ds:
        split = ds["train"]
        rows = list(split)
        assert len(rows) == N and isinstance(split[N - 1]["text"], str) and split[-1]["id"] == N - 1
    for i, row in enumerate(rows):
        for name, value in row.items():
            assert_row_equal(value, expected[name][i], name, f"row {i}")


def test_pyarrow_is_imported_only_when_parquet_is_read():
    from conftest import run_python

    out = run_python("""
        import sys
        import crossfeed, crossfeed.read.loader, crossfeed.read.tools.verify, crossfeed.write.adopt.index, crossfeed.cli.main
        print("pyarrow" in sys.modules)
    """)
    assert out.stdout.strip() == "False"


def test_pandas_written_file(tmp_path):
    import pandas as pd

    root = tmp_path / "pd"
    os.makedirs(root)
    df = pd.DataFrame(
        {
            "n": np.arange(30, dtype=np.int16),
            "f": np.linspace(0, 1, 30),
            "s": [f"s{i}" for i in range(30)],
            "v": [np.full(3, i, dtype=np.float64) for i in range(30)],
        }
    )
    df.to_parquet(root / "frame.parquet", row_group_size=8)
    index_dataset(root)
    s = {f.name: (f.encoding, f.dtype, f.shape) for f in open_dataset(root).schema}
    assert s == {
        "n": (Encoding.TENSOR, "int16", ()),
        "f": (Encoding.TENSOR, "float64", ()),
        "s": (Encoding.BYTES, "string", ()),
        "v": (Encoding.TENSOR, "float64", (3,)),
    }
    expected = oracle([root / "frame.parquet"])
    with Loader(root, batch_size=7, shuffle="global", seed=0, return_index=True) as loader:
        assert _check_rows(list(loader), expected, list(expected)) == 30


def test_a_thrashing_row_group_cache_is_reported_once(pa_dir, caplog):
    root, _ = pa_dir
    for shuffle, batch_size, small, warned in (
        ("block", 10, True, False),  # each row group decoded once per epoch: no waste
        ("global", 4, False, False),  # the split fits the cache (emptied each epoch, as the benchmark does)
        ("global", 4, True, True),
    ):
        caplog.clear()
        with Loader(root, batch_size=batch_size, shuffle=shuffle, block_shards=1, seed=1, num_threads=0) as loader:
            if small:
                loader.pipeline.builder.reader.frames.groups.max_bytes = 0  # two row groups: far less than the split
            for _ in range(3):
                loader.pipeline.builder.reader.frames.clear()
                assert sum(len(b["id"]) for b in loader) == N  # still every row, just slower
        msgs = [r.getMessage() for r in caplog.records if "row-group cache" in r.getMessage()]
        assert len(msgs) == (1 if warned else 0), (shuffle, msgs)
    assert "Use shuffle='block'" in msgs[0]
