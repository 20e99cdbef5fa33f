"""Conversions write where they are told: ``crossfeed convert``, ``write_dataset`` and ``index
--index-dir`` to an S3 URL (moto's real S3 server, the endpoint only in ``--storage-option``),
read back by the Loader and ``crossfeed verify`` there; a writer SIGKILLed at every step of an
upload leaves the previous version readable and the next write cleans what it left; ``memory://``
and local paths still work; a URL of an unknown scheme is refused by name, never a folder named
``s3:``. (docs/storage.md, crossfeed.write.target)"""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import lazy_import, requires
from PIL import Image
from s3_helpers import isolated_aws
from typer.testing import CliRunner

import crossfeed
from crossfeed.cli.main import app
from crossfeed.errors import ConfigError
from crossfeed.format.manifest import MANIFEST

moto_server = lazy_import("moto.server")
boto3 = lazy_import("boto3")

pytestmark = [pytest.mark.slow, requires("s3fs", "apache_beam", "moto.server", "boto3")]  # Beam conversions, S3 server


@pytest.fixture(scope="module")
def s3():
    """``(endpoint, boto3 client)`` of a moto S3 server with a bucket ``out``."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        client = boto3.client(
            "s3", endpoint_url=endpoint, aws_access_key_id="test", aws_secret_access_key="test", region_name="us-east-1"
        )
        client.create_bucket(Bucket="out")
        yield endpoint, client
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def aws_env(monkeypatch, tmp_path):
    """Credentials from the standard AWS environment; no endpoint anywhere but the storage options."""
    yield from isolated_aws(monkeypatch, tmp_path)


def _keys(client, prefix: str) -> list[str]:
    got = client.list_objects_v2(Bucket="out", Prefix=prefix + "/").get("Contents", [])
    return sorted(o["Key"][len(prefix) + 1 :] for o in got)


def _run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _image_folder(root):
    for c, color in (("cat", (200, 10, 10)), ("dog", (10, 200, 10))):
        (root / c).mkdir(parents=True)
        for i in range(4):
            Image.new("RGB", (8, 6), tuple(v + i for v in color)).save(root / c / f"{i}.png")
    return root


def test_convert_images_and_parquet_to_s3_read_back_and_verified_there(s3, tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    endpoint, client = s3
    opt = ["--storage-option", f"endpoint_url={endpoint}"]
    monkeypatch.chdir(tmp_path)  # a folder named "s3:" would appear here
    images = _image_folder(tmp_path / "photos")
    r = _run("convert", "images", images, "s3://out/photos", "--shards", "2", *opt)
    assert r.exit_code == 0, r.output
    assert "verified s3://out/photos: OK" in r.output
    assert not (tmp_path / "s3:").exists()
    keys = _keys(client, "photos")
    assert MANIFEST in keys and sum(k.endswith(".tfrecord") for k in keys) == 2
    options = {"endpoint_url": endpoint}
    with crossfeed.Loader("s3://out/photos", batch_size=3, storage_options=options) as ld:
        labels = sorted(int(v) for b in ld for v in b["label"])
    assert labels == [0] * 4 + [1] * 4

    table = pa.table({"id": np.arange(20, dtype=np.int64), "f32": np.linspace(0, 1, 20, dtype=np.float32)})
    pq.write_table(table, tmp_path / "t.parquet")
    r = _run("convert", "parquet", tmp_path / "t.parquet", "s3://out/tab", *opt)
    assert r.exit_code == 0, r.output
    r = _run("verify", "s3://out/tab", *opt)
    assert r.exit_code == 0 and "20 records in 1 shards" in r.output, r.output
    with crossfeed.Loader("s3://out/tab", batch_size=20, shuffle="none", storage_options=options) as ld:
        (batch,) = list(ld)
    order = np.argsort(batch["id"])
    assert np.array_equal(batch["f32"][order], table["f32"].to_numpy())
    # a second conversion without --overwrite is refused; with it the old objects go
    r = _run("convert", "parquet", tmp_path / "t.parquet", "s3://out/tab", *opt)
    assert r.exit_code != 0 and "--overwrite" in r.output
    before = _keys(client, "tab")
    r = _run("convert", "parquet", tmp_path / "t.parquet", "s3://out/tab", "--overwrite", *opt)
    assert r.exit_code == 0, r.output
    after = _keys(client, "tab")
    assert not (set(before) - {MANIFEST}) & set(after) and MANIFEST in after


def test_write_dataset_and_index_dir_to_s3(s3, tmp_path):
    endpoint, client = s3
    options = {"endpoint_url": endpoint}
    samples = [{"x": np.full(3, i, np.int16)} for i in range(10)]
    ds = crossfeed.write_dataset("s3://out/wd", samples, num_shards=2, storage_options=options)
    assert ds.path == "s3://out/wd" and sorted(int(s["x"][0]) for s in ds["train"]) == list(range(10))
    ds.close()
    more = [{"x": np.full(3, 100 + i, np.int16)} for i in range(3)]
    crossfeed.write_dataset("s3://out/wd", more, split="validation", add_split=True, storage_options=options).close()
    with crossfeed.open_dataset("s3://out/wd", storage_options=options) as ds:
        assert sorted(ds.splits) == ["train", "validation"] and ds.splits["validation"].num_records == 3
    local = tmp_path / "tf"
    crossfeed.write_dataset(local, samples, num_shards=2).close()
    for n in os.listdir(local):
        if n.endswith(".tfrecord"):
            client.upload_file(str(local / n), "out", f"raw/{n}")
    r = _run(
        "index", "s3://out/raw", "--index-dir", "s3://out/raw-index", "--storage-option", f"endpoint_url={endpoint}"
    )
    assert r.exit_code == 0, r.output
    assert MANIFEST in _keys(client, "raw-index")
    with crossfeed.open_dataset("s3://out/raw-index", storage_options=options, allowed_roots=["s3://out/raw"]) as ds:
        assert sorted(int(s["x"][0]) for s in ds["train"]) == list(range(10))


def _killed_write(url: str, options: dict, k: int) -> int:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            import s3fs

            s3fs.S3FileSystem.clear_instance_cache()  # no connections shared with the parent
            os.environ["CROSSFEED_TEST_CRASH_AT"] = str(k)
            samples = [{"x": np.full(3, 1000 + i, np.int16)} for i in range(7)]
            crossfeed.write_dataset(url, samples, num_shards=3, overwrite=True, storage_options=options).close()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return status


def test_a_writer_killed_at_every_step_leaves_the_previous_version_readable(s3):
    endpoint, client = s3
    options = {"endpoint_url": endpoint}
    url = "s3://out/killed"
    old = list(range(6))
    crossfeed.write_dataset(url, [{"x": np.full(3, v, np.int16)} for v in old], num_shards=2, storage_options=options)
    seen = set()
    for k in range(1, 60):
        status = _killed_write(url, options, k)
        with crossfeed.open_dataset(url, storage_options=options) as ds:
            got = sorted(int(s["x"][0]) for s in ds["train"])
        if os.WIFEXITED(status):
            assert os.WEXITSTATUS(status) == 0 and got == list(range(1000, 1007))
            break
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == 9
        seen.add(tuple(got))
        assert got in (old, list(range(1000, 1007)))
        if got == old:  # still the old version: put it back for the next k (objects a kill left stay)
            continue
        crossfeed.write_dataset(
            url, [{"x": np.full(3, v, np.int16)} for v in old], num_shards=2, overwrite=True, storage_options=options
        ).close()
    else:
        pytest.fail("the write never completed")
    assert (tuple(old),) and tuple(old) in seen  # some kills happened before the manifest's PUT
    # the completed write left only what its manifest names: no staged objects of the killed ones
    with crossfeed.open_dataset(url, storage_options=options) as ds:
        named = ds.manifest.files | {MANIFEST}
    assert set(_keys(client, "killed")) == named


def test_memory_and_local_paths_still_work(tmp_path, monkeypatch):
    import fsspec

    samples = [{"x": np.full(2, i, np.int32)} for i in range(5)]
    with crossfeed.write_dataset("memory://wr/ds", samples, num_shards=2) as ds:
        assert sorted(int(s["x"][0]) for s in ds["train"]) == list(range(5))
    assert "/wr/ds/crossfeed.json" in fsspec.filesystem("memory").ls("/wr/ds", detail=False)
    monkeypatch.chdir(tmp_path)
    with crossfeed.write_dataset("rel/ds", samples) as ds:
        assert ds.splits["train"].num_records == 5
    assert (tmp_path / "rel" / "ds" / MANIFEST).exists()
    with crossfeed.write_dataset(f"file://{tmp_path}/f", samples) as ds:
        assert ds.splits["train"].num_records == 5


def test_an_unknown_scheme_is_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    samples = [{"x": 1}]
    with pytest.raises(ConfigError, match="unknown URL scheme 'foo'"):
        crossfeed.write_dataset("foo://bucket/dir", samples)
    with pytest.raises(ConfigError, match="s3:// URL with a slash missing"):
        crossfeed.write_dataset("s3:/bucket/dir", samples)
    # a known scheme whose backend is not installed names the package
    import sys

    monkeypatch.setitem(
        sys.modules["fsspec.registry"].known_implementations,
        "zz",
        {"class": "no_such_module_zz.FS", "err": "Install no_such_module_zz to access zz://"},
    )
    with pytest.raises(ConfigError, match="pip install"):
        crossfeed.write_dataset("zz://bucket/dir", samples)
    photos = _image_folder(tmp_path / "photos")
    r = _run("convert", "images", photos, "foo://bucket/dir")
    assert r.exit_code == 2 and "unknown URL scheme 'foo'" in r.output, r.output
    assert sorted(os.listdir(tmp_path)) == ["photos"]  # no folder named "foo:" or "s3:"


def test_a_convert_job_killed_mid_upload_leaves_the_previous_version(s3, tmp_path):
    """The real CLI in a subprocess, SIGKILLed after its second object's upload, then after the
    manifest's PUT (before the old objects go): the URL reads as the old version, then the new."""
    import subprocess
    import sys

    import pyarrow as pa
    import pyarrow.parquet as pq

    endpoint, client = s3
    options = {"endpoint_url": endpoint}
    for name, base in (("old.parquet", 0), ("new.parquet", 500)):
        pq.write_table(pa.table({"id": np.arange(base, base + 30, dtype=np.int64)}), tmp_path / name)

    def convert(name: str, crash: str | None) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k != "CROSSFEED_TEST_CRASH_AT"}
        if crash:
            env["CROSSFEED_TEST_CRASH_AT"] = crash
        cmd = [sys.executable, "-m", "crossfeed.cli.main", "convert", "parquet", str(tmp_path / name)]
        cmd += ["s3://out/job", "--overwrite", "--shards", "3", "--storage-option", f"endpoint_url={endpoint}"]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)

    def ids() -> list[int]:
        with crossfeed.open_dataset("s3://out/job", storage_options=options) as ds:
            return sorted(int(s["id"]) for s in ds["train"])

    done = convert("old.parquet", None)
    assert done.returncode == 0, done.stderr
    old_keys = set(_keys(client, "job"))
    killed = convert("new.parquet", "object uploaded:2")
    assert killed.returncode == -9, killed.stderr
    assert ids() == list(range(30))  # the previous version, whole
    assert _run("verify", "s3://out/job", "--storage-option", f"endpoint_url={endpoint}").exit_code == 0
    assert len(set(_keys(client, "job")) - old_keys) == 2  # two staged objects no manifest names
    killed = convert("new.parquet", "manifest uploaded:1")
    assert killed.returncode == -9, killed.stderr
    assert ids() == list(range(500, 530))  # the commit point passed: the new version
    done = convert("old.parquet", None)
    assert done.returncode == 0, done.stderr
    assert ids() == list(range(30))
    with crossfeed.open_dataset("s3://out/job", storage_options=options) as ds:
        assert set(_keys(client, "job")) == ds.manifest.files | {MANIFEST}  # what the killed jobs left is gone
