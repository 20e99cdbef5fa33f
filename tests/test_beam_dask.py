"""The same conversion on DaskRunner (a LocalCluster of two worker processes) and on the default
in-process runner gives byte-identical shards and the same manifest, and leaves nothing behind."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
from conftest import lazy_import, requires

from crossfeed import open_dataset
from crossfeed.beam_jobs.sample_data import make_image_folder

distributed = lazy_import("distributed")
beam_job = lazy_import("crossfeed.beam_jobs.job")
pytestmark = [pytest.mark.slow, requires("apache_beam", "distributed")]  # slow: a real Dask cluster


@pytest.fixture(scope="module")
def cluster():
    with distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None, memory_limit="2GiB"
    ) as c:
        yield c


def executed(cluster) -> list[int]:
    with distributed.Client(cluster.scheduler_address, timeout=30) as client:
        return list(client.run(lambda dask_worker: dask_worker.state.executed_count).values())


def files(root) -> dict[str, str]:
    return {f: hashlib.sha256((root / f).read_bytes()).hexdigest() for f in sorted(os.listdir(root))}


def test_dask_and_direct_write_identical_datasets(cluster, tmp_path):
    img = tmp_path / "img"
    make_image_folder(img, n_per_class=15, classes=4, size=24)
    rng = np.random.default_rng(3)
    (tmp_path / "csv").mkdir()
    for f in range(3):
        rows = "\n".join(f"{f * 1000 + i},{rng.normal():.5f},w{i % 7}" for i in range(400))
        (tmp_path / "csv" / f"p{f}.csv").write_text("id,x,word\n" + rows + "\n")
    jobs = {
        "images": (
            beam_job.make_source("images", img, batch_files=8),
            dict(splits="train=0.8,validation=0.2", num_shards=3),
        ),
        "csv": (beam_job.make_source("csv", tmp_path / "csv", batch_rows=100), dict(shard_size="8K", compress=True)),
    }
    before = sum(executed(cluster))
    for name, (source, options) in jobs.items():
        direct = beam_job.convert(source, tmp_path / f"{name}-direct", **options)
        dask = beam_job.convert(
            source,
            tmp_path / f"{name}-dask",
            runner="DaskRunner",
            beam_args=[f"--dask_client_address={cluster.scheduler_address}"],
            **options,
        )
        assert dask.samples == direct.samples and dask.shards == direct.shards
        a, b = files(tmp_path / f"{name}-direct"), files(tmp_path / f"{name}-dask")
        assert a == b  # shards, index files and the manifest, byte for byte
        assert not [f for f in a if f.startswith(".")]  # no temporaries on either runner
        assert len([f for f in a if f.endswith(".tfrecord") or f.endswith(".gz")]) == sum(direct.shards.values())
    assert open_dataset(tmp_path / "csv-dask").splits["train"].num_records == 1200
    assert len(open_dataset(tmp_path / "csv-dask").splits["train"].shards) > 2
    counts = executed(cluster)
    assert sum(counts) > before and all(c > 0 for c in counts)  # both worker processes did work


def test_dask_failure_is_raised_and_cleaned_up(cluster, tmp_path):
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n3\n")
    with pytest.raises(Exception, match="bad.csv:3"):
        beam_job.convert(
            beam_job.make_source("csv", tmp_path / "bad.csv"),
            tmp_path / "out",
            runner="DaskRunner",
            beam_args=[f"--dask_address={cluster.scheduler_address}"],
        )
    assert os.listdir(tmp_path / "out") == []
