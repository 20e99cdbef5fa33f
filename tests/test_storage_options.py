"""fsspec's ``storage_options`` reach every place a dataset is opened: the Loader, a mixture's
`Source`, ``open_dataset`` and a manifest's ``data_root``, a worker process's recipe, and the CLI's
``--storage-option`` on ``info``, ``head``, ``bench``, ``verify`` and ``index``. Against moto's S3
server, the endpoint given only as a storage option (never ``FSSPEC_S3_ENDPOINT_URL`` or fsspec's
config); credentials from the standard AWS environment or credentials file. (docs/storage.md)"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import lazy_import, requires
from s3_helpers import isolated_aws
from typer.testing import CliRunner

import crossfeed
from crossfeed.cli.main import app
from crossfeed.errors import ConfigError
from crossfeed.read.executors.processes import WorkerRecipe
from crossfeed.read.options import LoaderOptions, Source
from crossfeed.read.sources.dataset import open_dataset
from crossfeed.read.tools.verify import verify_dataset
from crossfeed.write.adopt.index import index_dataset

moto_server = lazy_import("moto.server")
boto3 = lazy_import("boto3")
pytestmark = [pytest.mark.slow, requires("moto", "s3fs", "boto3")]  # slow: an S3 server (moto) in a process

N = 60


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """``(endpoint, boto3 client, local copy)``: a bucket ``data`` holding a TFRecord dataset under
    ``ds/`` and two Parquet files under ``pq/``."""
    from parquet_data import write_pyarrow_files

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id="test",
            aws_secret_access_key="test",
            region_name="us-east-1",
        )
        client.create_bucket(Bucket="data")
        root = tmp_path_factory.mktemp("s3src")
        ds = root / "ds"
        samples = [{"x": np.full(4, i, np.float32), "id": i} for i in range(N)]
        crossfeed.write_dataset(ds, samples, num_shards=3).close()
        write_pyarrow_files(root / "pq")
        for prefix in ("ds", "pq"):
            for f in sorted(os.listdir(root / prefix)):
                client.upload_file(str(root / prefix / f), "data", f"{prefix}/{f}")
        yield endpoint, client, ds
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def no_endpoint_config(monkeypatch, tmp_path):
    """No endpoint anywhere but where a test puts it: not fsspec's config or environment, not
    AWS's; credentials from the standard AWS environment; no ~/.aws of the machine's."""
    yield from isolated_aws(monkeypatch, tmp_path)


def _ids(loader) -> list[int]:
    return [i for b in loader for i in b["id"].tolist()]


def _run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_the_loader_reads_s3_with_the_endpoint_only_in_storage_options(s3, tmp_path):
    endpoint, _, local = s3
    options = {"endpoint_url": endpoint}
    with crossfeed.Loader(local, batch_size=7, seed=3) as ld:
        want = _ids(ld)
    with crossfeed.Loader("s3://data/ds", batch_size=7, seed=3, storage_options=options) as ld:
        assert _ids(ld) == want and sorted(want) == list(range(N))
        assert ld.dataset.storage.storage_options == options and ld.options.read.storage_options == options
    # the cache downloads through the same storage: each shard once
    with crossfeed.Loader(
        "s3://data/ds", batch_size=7, seed=3, cache_dir=tmp_path / "c", storage_options=options
    ) as ld:
        assert _ids(ld) == want and ld.cache.downloads == 3


def test_a_source_of_a_mixture_carries_its_own_storage_options(s3):
    endpoint, _, local = s3
    remote = Source("s3://data/ds", storage_options={"endpoint_url": endpoint})
    with crossfeed.Loader([remote, Source(local)], batch_size=10, samples_per_epoch=40, seed=1) as ld:
        assert ld.datasets[0].storage.storage_options == {"endpoint_url": endpoint}
        assert len(_ids(ld)) == 40
    # a worker process rebuilds the sources (and the options) from its recipe
    opts = LoaderOptions.of(batch_size=10, executor="process", storage_options={"anon": False})
    back = WorkerRecipe.from_json(json.loads(json.dumps(WorkerRecipe([remote], opts).to_json())))
    assert back.source == [remote] and back.source[0].storage_options == {"endpoint_url": endpoint}
    assert back.options == opts
    with pytest.raises(ConfigError, match="Source storage_options must be a dict"):
        Source("s3://data/ds", storage_options="endpoint_url=x")


def test_open_dataset_and_a_data_root_use_the_storage_options(s3, tmp_path):
    endpoint, _, local = s3
    options = {"endpoint_url": endpoint}
    with open_dataset("s3://data/ds", storage_options=options) as ds, open_dataset(local) as want:
        assert [int(ds["train"][i]["id"]) for i in range(N)] == [int(want["train"][i]["id"]) for i in range(N)]
    # Parquet adopted in place: the index dir's manifest names s3://data/pq as its data_root
    index_dataset("s3://data/pq", index_dir=tmp_path / "pq-index", storage_options=options)
    allowed = ["s3://data/pq"]
    with open_dataset(tmp_path / "pq-index", storage_options=options, allowed_roots=allowed) as ds:
        assert ds.manifest.data_root == "s3://data/pq" and ds.storage.storage_options == options
        assert int(ds["train"][3]["id"]) == 3
    assert verify_dataset(tmp_path / "pq-index", storage_options=options, allowed_roots=allowed) == []


def test_credentials_from_the_standard_credentials_file(s3, monkeypatch, tmp_path):
    endpoint, _, _ = s3
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k)
    creds = tmp_path / "credentials"
    creds.write_text("[default]\naws_access_key_id = fromfile\naws_secret_access_key = fromfile\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    with crossfeed.Loader("s3://data/ds", batch_size=N, storage_options={"endpoint_url": endpoint}) as ld:
        assert sorted(_ids(ld)) == list(range(N))


def test_the_cli_takes_storage_options(s3, tmp_path):
    endpoint, _, _ = s3
    opt = ["--storage-option", f"endpoint_url={endpoint}", "--storage-option", "client_kwargs.region_name=us-east-1"]
    info = _run("info", "s3://data/ds", *opt)
    assert info.exit_code == 0, info.output
    assert f"{N:>12,} records" in info.output and "s3://data/ds" in info.output
    head = _run("head", "s3://data/ds", "-n", "2", *opt)
    assert head.exit_code == 0 and "[train 1]" in head.output, head.output
    bench = _run("bench", "s3://data/ds", "--batches", "2", "--batch-size", "8", *opt)
    assert bench.exit_code == 0, bench.output
    index = _run("index", "s3://data/pq", "--index-dir", tmp_path / "pq-index", *opt)
    assert index.exit_code == 0 and "indexed s3://data/pq" in index.output, index.output
    head = _run("head", tmp_path / "pq-index", "-n", "1", "--allow-root", "s3://data/pq", *opt)
    assert head.exit_code == 0 and "id: int64[] 0" in head.output, head.output
    bad = _run("info", "s3://data/ds", "--storage-option", "endpoint_url")
    assert bad.exit_code == 2 and "KEY=VALUE" in bad.output


def test_verify_reads_a_remote_dataset_once_and_names_a_damaged_shard_by_its_url(s3, tmp_path, monkeypatch):
    endpoint, client, local = s3
    opt = ["--storage-option", f"endpoint_url={endpoint}"]
    ok = _run("verify", "s3://data/ds", *opt)
    assert ok.exit_code == 0 and f"ok: {N} records in 3 shards" in ok.output, ok.output
    # the endpoint from AWS's own environment variable (botocore >= 1.31): no option needed
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    assert _run("verify", "s3://data/ds").exit_code == 0
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    # a copy with one byte of one shard flipped, and one index file gone
    shard = sorted(f for f in os.listdir(local) if f.endswith(".tfrecord"))[1]
    for f in os.listdir(local):
        data = (local / f).read_bytes()
        if f == shard:
            data = data[:40] + bytes([data[40] ^ 0xFF]) + data[41:]
        if f != sorted(os.listdir(local))[-1] or not f.endswith(".idx"):
            client.put_object(Bucket="data", Key=f"bad/{f}", Body=data)
    problems = verify_dataset("s3://data/bad", storage_options={"endpoint_url": endpoint})
    files = {p.file for p in problems}
    assert f"s3://data/bad/{shard}" in files and all(f.startswith("s3://data/bad/") for f in files), problems
    assert any(p.file.endswith(".idx") and "missing" in p.reason for p in problems), problems
    bad = _run("verify", "s3://data/bad", *opt)
    assert bad.exit_code == 1 and f"BAD s3://data/bad/{shard}" in bad.output


def test_storage_options_are_frozen_json_and_local_to_each_process():
    from crossfeed.io.storage import FsOptions

    given = {"endpoint_url": "http://127.0.0.1:9000", "secret": "s3cr3t", "client_kwargs": {"region_name": "x"}}
    o = LoaderOptions.of(batch_size=2, storage_options=given)
    assert LoaderOptions.of(**o.flat()) == o and o.flat()["storage_options"] == given
    assert json.loads(json.dumps(o.flat())) == o.flat()
    assert hash(o) == hash(LoaderOptions.of(batch_size=2, storage_options=dict(given)))
    assert "storage_options" not in o.plan_fields()  # a dispatcher never ships credentials
    o.read.storage_options["client_kwargs"]["region_name"] = "changed"  # a copy: the options stay as made
    assert o.read.storage_options["client_kwargs"] == {"region_name": "x"}
    assert "s3cr3t" not in repr(o) and "127.0.0.1:9000" in repr(o)
    for bad in (["a"], {1: "x"}, {"a": float("nan")}, {"a": object()}):
        with pytest.raises(ConfigError, match="storage_options"):
            LoaderOptions.of(batch_size=2, storage_options=bad)
    assert FsOptions(None) == {} and not FsOptions()


def test_the_cli_parses_storage_options_as_json_values_and_dotted_keys(monkeypatch, options_data):
    got = {}

    def bench_loader(dataset, options, **kw):
        got["options"] = options
        raise SystemExit(0)

    monkeypatch.setattr("crossfeed.read.tools.profile.bench_loader", bench_loader)
    args = ["endpoint_url=http://h:1", "anon=false", "max_concurrency=4", "client_kwargs.region_name=eu"]
    _run("bench", options_data, *[a for v in args for a in ("--storage-option", v)])
    assert dict(got["options"].read.storage_options) == {
        "endpoint_url": "http://h:1",
        "anon": False,
        "max_concurrency": 4,
        "client_kwargs": {"region_name": "eu"},
    }
    for bad in (["noequals"], ["a=1", "a=2"], ["a=1", "a.b=2"], [".a=1"]):
        r = _run("bench", options_data, *[a for v in bad for a in ("--storage-option", v)])
        assert r.exit_code == 2 and "--storage-option" in r.output, (bad, r.output)
