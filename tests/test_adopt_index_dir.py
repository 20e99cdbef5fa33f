"""``crossfeed index --index-dir`` for WebDataset tars and Parquet files: a read-only data
directory is left exactly as it was (names, sizes, mtimes, modes, sha256; indexing runs under an
audit hook, since tests run as root), and what the Loader, ``info``, ``verify`` and ``head`` give
through the index directory equals what they give on a copy indexed in place. A remote data
directory (fsspec's ``memory://``, and an S3 bucket served by moto) is read where it lies."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pyarrow.parquet as pq
import pytest
from adopt_helpers import INDEX_AUDITED, read_only, snapshot, trusted_roots  # noqa: F401 (autouse)
from conftest import lazy_import, run_python
from parquet_data import ROWS, assert_row_equal, oracle, write_pyarrow_files
from PIL import Image

from crossfeed.errors import ConfigError, CorruptRecordError
from crossfeed.format.manifest import MANIFEST
from crossfeed.read.loader import INDEX_KEY, Loader
from crossfeed.read.sources.dataset import open_dataset
from crossfeed.read.tools.verify import verify_dataset
from crossfeed.write.adopt.index import index_dataset

pads = lazy_import("pyarrow.dataset")
wds = lazy_import("webdataset")
skdata = lazy_import("skimage.data")

N_TAR = 11  # samples; 4 per tar → 3 tars


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "crossfeed.cli.main", *map(str, args)], capture_output=True, text=True, timeout=120
    )


def _png(im: np.ndarray) -> bytes:
    b = io.BytesIO()
    Image.fromarray(im).save(b, format="PNG")
    return b.getvalue()


@pytest.fixture(scope="module")
def tars(tmp_path_factory) -> Path:
    """Tars written by ``webdataset.ShardWriter`` (never indexed here: tests index copies)."""
    root = tmp_path_factory.mktemp("tars") / "data"
    root.mkdir()
    photos = [skdata.astronaut()[::16, ::16], skdata.coffee()[::16, ::16], skdata.chelsea()[::16, ::16]]
    with wds.ShardWriter(str(root / "shard-%06d.tar"), maxcount=4, verbose=0) as sink:
        for i in range(N_TAR):
            sink.write(
                {
                    "__key__": f"s{i:04d}",
                    "png": _png(photos[i % 3]),
                    "cls": i % 5,
                    "txt": f"sample {i} é",
                    "npy": np.arange(i, i + 4 * (1 + i % 2), dtype=np.float32).reshape(-1, 4),
                }
            )
    return root


@pytest.fixture(scope="module")
def parquet_files(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pq") / "data"
    write_pyarrow_files(root)
    return root


def _copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def _indexed_in_place(src: Path, dest: Path) -> Path:
    """The reference: a copy of the data indexed beside itself."""
    index_dataset(_copy(src, dest))
    return dest


def _rows(path, **kw) -> list[tuple[int, dict]]:
    """``(sample index, {feature: value})`` of every sample of one epoch, in Loader order."""
    out = []
    with Loader(path, batch_size=4, seed=7, return_index=True, **kw) as loader:
        for b in loader:
            for j, i in enumerate(b[INDEX_KEY].tolist()):
                out.append((i, {k: v[j] for k, v in b.items() if k != INDEX_KEY}))
    return out


def _assert_same_rows(got: list, want: list) -> None:
    assert [i for i, _ in got] == [i for i, _ in want] and got
    for (i, g), (_, w) in zip(got, want):
        assert sorted(g) == sorted(w), i
        for k, v in w.items():
            if isinstance(v, (bytes, str)):
                assert g[k] == v, f"sample {i} {k}"
            else:
                np.testing.assert_array_equal(np.asarray(g[k]), np.asarray(v), err_msg=f"sample {i} {k}")


def _data_files(root: Path) -> list[str]:
    return sorted(os.listdir(root))


# ---- WebDataset tars ---------------------------------------------------------------------------


@pytest.mark.slow
def test_read_only_tar_dir_is_indexed_untouched_and_reads_as_in_place(tars, tmp_path):
    data, idx_dir = _copy(tars, tmp_path / "data"), tmp_path / "index"
    beside = _indexed_in_place(tars, tmp_path / "beside")
    names = _data_files(data)
    with read_only(data):
        before = snapshot(data)
        # the audit hook bites: without --index-dir, indexing would write beside the tars
        refused = subprocess.run(
            [sys.executable, "-c", INDEX_AUDITED, str(data)], capture_output=True, text=True, timeout=120
        )
        assert refused.returncode != 0
        assert "adoption opened" in refused.stderr or "--index-dir" in refused.stderr, refused.stderr[-2000:]
        run_python(INDEX_AUDITED, str(data), "--index-dir", str(idx_dir))
        assert snapshot(data) == before
        assert _data_files(idx_dir) == sorted([MANIFEST, *(n + ".idx" for n in names)])
        assert json.loads((idx_dir / MANIFEST).read_text())["data_root"] == str(data)
        for n in names:  # the same sample ranges as indexed in place
            assert (idx_dir / (n + ".idx")).read_bytes() == (beside / (n + ".idx")).read_bytes()
        for shuffle in ("none", "global", "block"):
            _assert_same_rows(_rows(idx_dir, shuffle=shuffle), _rows(beside, shuffle=shuffle))
        _assert_same_rows(
            _rows(idx_dir, shuffle="global", decode_images=False), _rows(beside, shuffle="global", decode_images=False)
        )

        info = _cli("info", idx_dir)
        assert info.returncode == 0, info.stderr
        assert f"data    {data} (shards read in place)" in info.stdout and "npy" in info.stdout
        ver = _cli("verify", idx_dir)
        assert ver.returncode == 0, ver.stderr
        assert f"ok: {N_TAR} records in 3 shards" in ver.stdout and "no payload checksums" in ver.stderr
        head, head_beside = _cli("head", idx_dir, "-n", "3"), _cli("head", beside, "-n", "3")
        assert head.returncode == 0, head.stderr
        assert head.stdout == head_beside.stdout and "'sample 2 é'" in head.stdout
        assert snapshot(data) == before


def test_a_damaged_tar_and_a_lost_index_are_named_through_the_index_dir(tars, tmp_path):
    data, idx_dir = _copy(tars, tmp_path / "data"), tmp_path / "index"
    index_dataset(data, index_dir=idx_dir)
    names = _data_files(data)
    shard = data / names[1]
    offset = int((idx_dir / (names[1] + ".idx")).read_text().split("\n")[2].split()[0])  # its third sample
    with open(shard, "r+b") as f:
        f.seek(offset + 3)
        f.write(b"X")  # inside a member name: only the header checksum can tell
    with pytest.raises(CorruptRecordError) as e:
        _rows(idx_dir, shuffle="none", features=["cls"])
    assert e.value.path == str(shard) and e.value.offset == offset and "checksum" in e.value.reason
    (idx_dir / (names[0] + ".idx")).unlink()
    ver = _cli("verify", idx_dir)
    assert ver.returncode == 1
    assert f"BAD {shard}: byte offset {offset}: tar header checksum mismatch" in ver.stderr
    assert f"BAD {idx_dir / (names[0] + '.idx')}: index file is missing" in ver.stderr


@pytest.fixture
def bucket():
    """A fresh ``memory://`` directory URL (fsspec's in-process filesystem), removed after."""
    fs = fsspec.filesystem("memory")
    name = f"bucket-{uuid.uuid4().hex}"
    yield fs, f"memory://{name}/data"
    fs.rm(f"/{name}", recursive=True)


def test_remote_tar_dir_is_read_where_it_lies(tars, tmp_path, bucket):
    fs, url = bucket
    for p in tars.iterdir():
        fs.pipe_file(f"{url}/{p.name}", p.read_bytes())
    listing = sorted(fs.ls(url, detail=False))
    with pytest.raises(ConfigError, match="--index-dir"):
        index_dataset(url)
    idx_dir = tmp_path / "index"
    manifest = index_dataset(url, index_dir=idx_dir)
    assert manifest.data_root == url and manifest.splits["train"].format == "tar"
    assert sorted(fs.ls(url, detail=False)) == listing  # nothing written to the bucket
    beside = _indexed_in_place(tars, tmp_path / "beside")
    assert _data_files(idx_dir) == sorted([MANIFEST, *(n + ".idx" for n in _data_files(tars))])
    for shuffle in ("global", "block"):  # range reads; whole tars
        _assert_same_rows(_rows(idx_dir, shuffle=shuffle), _rows(beside, shuffle=shuffle))
    cached = _rows(idx_dir, shuffle="global", cache_dir=str(tmp_path / "cache"))  # sha256-checked copies
    _assert_same_rows(cached, _rows(beside, shuffle="global"))
    with open_dataset(idx_dir) as ds, open_dataset(beside) as ref:
        assert ds.storage.remote and not ds.index_storage.remote
        assert ds["train"][6]["txt"] == ref["train"][6]["txt"] == "sample 6 é"
    assert verify_dataset(idx_dir) == []  # each remote tar fetched once, checked as a local one
    name = _data_files(tars)[2]
    offset = int((idx_dir / (name + ".idx")).read_text().split("\n")[1].split()[0])  # its second sample
    blob = bytearray(fs.cat_file(f"{url}/{name}"))
    blob[offset + 3] ^= 0xFF
    fs.pipe_file(f"{url}/{name}", bytes(blob))
    with pytest.raises(CorruptRecordError) as e:
        _rows(idx_dir, shuffle="global")
    assert e.value.path == f"{url}/{name}" and e.value.offset == offset and "checksum" in e.value.reason
    assert {p.file for p in verify_dataset(idx_dir)} == {f"{url}/{name}"}  # named by its URL


# ---- Parquet -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_read_only_parquet_dir_is_indexed_untouched_and_reads_as_in_place(parquet_files, tmp_path):
    data, idx_dir = _copy(parquet_files, tmp_path / "data"), tmp_path / "index"
    beside = _indexed_in_place(parquet_files, tmp_path / "beside")
    expected = oracle([data / n for n in _data_files(data)])
    with read_only(data):
        before = snapshot(data)
        run_python(INDEX_AUDITED, str(data), "--index-dir", str(idx_dir))
        assert snapshot(data) == before
        assert _data_files(idx_dir) == [MANIFEST]  # Parquet has no index files
        assert json.loads((idx_dir / MANIFEST).read_text())["data_root"] == str(data)
        for shuffle in ("none", "global", "block"):
            got = _rows(idx_dir, shuffle=shuffle)
            _assert_same_rows(got, _rows(beside, shuffle=shuffle))
            for i, row in got:
                for k, v in row.items():
                    assert_row_equal(v, expected[k][i], k, f"row {i}")
        # the data directory stays Parquet-only: pyarrow's own dataset reads it; beside, the manifest trips it
        assert pads.dataset(str(data), format="parquet").count_rows() == sum(ROWS)
        with pytest.raises(Exception, match="crossfeed.json|magic"):
            pads.dataset(str(beside), format="parquet").count_rows()

        info = _cli("info", idx_dir)
        assert info.returncode == 0, info.stderr
        assert f"data    {data} (shards read in place)" in info.stdout and f"{sum(ROWS)} records" in info.stdout
        ver = _cli("verify", idx_dir)
        assert ver.returncode == 0, ver.stderr
        assert f"ok: {sum(ROWS)} records in 2 shards" in ver.stdout
        head, head_beside = _cli("head", idx_dir, "-n", "2"), _cli("head", beside, "-n", "2")
        assert head.returncode == 0, head.stderr
        assert head.stdout == head_beside.stdout and "'row 1 ünïcode'" in head.stdout
        assert snapshot(data) == before


@pytest.mark.slow
def test_parquet_index_notes_the_pyarrow_dataset_clash_and_file_urls_work(parquet_files, tmp_path):
    beside = _copy(parquet_files, tmp_path / "beside")
    out = _cli("index", beside)
    assert out.returncode == 0, out.stderr
    assert "pyarrow.dataset" in out.stderr and "--index-dir" in out.stderr
    data = _copy(parquet_files, tmp_path / "data")
    out = _cli("index", f"file://{data}", "--index-dir", tmp_path / "index")
    assert out.returncode == 0, out.stderr
    assert "pyarrow.dataset" not in out.stderr and _data_files(data) == _data_files(parquet_files)
    with open_dataset(tmp_path / "index") as ds:
        assert ds.manifest.data_root == str(data)


def test_a_changed_parquet_file_is_caught_through_the_index_dir(parquet_files, tmp_path):
    data, idx_dir = _copy(parquet_files, tmp_path / "data"), tmp_path / "index"
    index_dataset(data, index_dir=idx_dir)
    path = data / "part-1.parquet"
    pq.write_table(pq.read_table(path), path, row_group_size=7)  # rewritten: other row groups and size
    with pytest.raises(CorruptRecordError, match=r"part-1\.parquet.*changed after `crossfeed index`"):
        _rows(idx_dir, shuffle="none")
    ver = _cli("verify", idx_dir)
    assert ver.returncode == 1 and f"BAD {path}: " in ver.stderr and "sha256 differs" in ver.stderr
    path.unlink()
    with pytest.raises(CorruptRecordError, match=r"part-1\.parquet.*missing"):
        _rows(idx_dir, shuffle="none")


def test_remote_parquet_is_read_where_it_lies(parquet_files, tmp_path, bucket):
    fs, url = bucket
    for p in parquet_files.iterdir():
        fs.pipe_file(f"{url}/{p.name}", p.read_bytes())
    with pytest.raises(ConfigError, match="--index-dir"):
        index_dataset(url)
    idx_dir = tmp_path / "index"
    manifest = index_dataset(url, index_dir=idx_dir)
    assert manifest.data_root == url and _data_files(idx_dir) == [MANIFEST]
    beside = _indexed_in_place(parquet_files, tmp_path / "beside")
    with open_dataset(beside) as ref:
        assert manifest.splits == ref.manifest.splits  # sizes, sha256 and row groups alike
    for shuffle in ("none", "global", "block"):
        _assert_same_rows(_rows(idx_dir, shuffle=shuffle), _rows(beside, shuffle=shuffle))
    expected = oracle(sorted(parquet_files / n for n in _data_files(parquet_files)))
    with open_dataset(idx_dir) as ds:
        split = ds["train"]
        for i in (0, 52, 53, len(split) - 1):
            for k, v in split[i].items():
                assert_row_equal(v, expected[k][i], k, f"row {i}")
    assert verify_dataset(idx_dir) == []
    src = f"{url}/part-0.parquet"
    buf = io.BytesIO()
    pq.write_table(pq.read_table(parquet_files / "part-0.parquet"), buf, row_group_size=7)
    fs.pipe_file(src, buf.getvalue())
    with pytest.raises(CorruptRecordError, match=r"part-0\.parquet.*changed after `crossfeed index`"):
        _rows(idx_dir, shuffle="none")
    assert [p.file for p in verify_dataset(idx_dir)][:1] == [src]
    fs.rm(src)
    with pytest.raises(CorruptRecordError, match=r"part-0\.parquet.*missing"):
        _rows(idx_dir, shuffle="none")
    assert any(p.file == src and "missing" in p.reason for p in verify_dataset(idx_dir))


# ---- S3 (moto's server, through s3fs): real range requests; the CLI in processes of its own ----


@pytest.mark.slow
def test_s3_tars_and_parquet_through_moto(tars, parquet_files, tmp_path, monkeypatch):
    moto_server = pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    import boto3

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        host, port = server.get_host_and_port()
        env = {
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1",
            "FSSPEC_S3_ENDPOINT_URL": f"http://{host}:{port}",  # fsspec's config, read by the CLI processes
        }
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": env["FSSPEC_S3_ENDPOINT_URL"]})
        s3 = boto3.client("s3", endpoint_url=env["FSSPEC_S3_ENDPOINT_URL"])
        s3.create_bucket(Bucket="data")
        for prefix, src in (("wds", tars), ("pq", parquet_files)):
            for p in src.iterdir():
                s3.upload_file(str(p), "data", f"{prefix}/{p.name}")
        for prefix, src in (("wds", tars), ("pq", parquet_files)):
            idx_dir = tmp_path / f"{prefix}-index"
            out = _cli("index", f"s3://data/{prefix}", "--index-dir", idx_dir)
            assert out.returncode == 0, out.stderr
            beside = _indexed_in_place(src, tmp_path / f"{prefix}-beside")
            with open_dataset(idx_dir) as ds:
                assert ds.manifest.data_root == f"s3://data/{prefix}" and ds.storage.remote
            for shuffle in ("global", "block"):
                _assert_same_rows(_rows(idx_dir, shuffle=shuffle), _rows(beside, shuffle=shuffle))
            head = _cli("head", idx_dir, "-n", "2")
            assert head.returncode == 0, head.stderr
            assert head.stdout == _cli("head", beside, "-n", "2").stdout
            listed = s3.list_objects_v2(Bucket="data", Prefix=f"{prefix}/")["Contents"]
            assert sorted(o["Key"].split("/")[1] for o in listed) == _data_files(src)  # nothing written there
    finally:
        server.stop()


def test_a_large_index_in_the_index_dir_is_read_in_place(tmp_path):
    """An index of fixed-width lines is read entry by entry (`LazyIndex`) from the index
    directory — not from a stale ``.idx`` left beside the shards by an earlier in-place index."""
    import crossfeed
    from crossfeed.format.index import FIXED_MIN, LazyIndex

    data = tmp_path / "data"
    crossfeed.write_dataset(data, [{"id": i} for i in range(FIXED_MIN + 100)], num_shards=1).close()
    shard = next(n for n in _data_files(data) if n.endswith(".tfrecord"))
    (data / MANIFEST).unlink()
    stale = data / (shard + ".idx")
    stale.write_text("".join(f"{8 * k:06d} 000008\n" for k in range(FIXED_MIN + 100)))  # wrong, same width class
    index_dataset(data, index_dir=tmp_path / "index")
    with open_dataset(tmp_path / "index") as ds:
        split = ds["train"]
        lazy = split.lazy_index(0)
        assert isinstance(lazy, LazyIndex) and lazy.where == str(tmp_path / "index" / (shard + ".idx"))
        k = np.array([0, 5, FIXED_MIN + 99])
        np.testing.assert_array_equal(lazy[k], split.index(0)[k])
    with Loader(tmp_path / "index", batch_size=256, shuffle="global", seed=1, features=["id"]) as loader:
        assert sorted(i for b in loader for i in b["id"].tolist()) == list(range(FIXED_MIN + 100))
