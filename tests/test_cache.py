"""The remote shard cache against real servers started by the test: a local HTTP server with
Range support that injects latency and counts requests, and an S3-API server (moto's standalone
server, reached through s3fs)."""

from __future__ import annotations

import collections
import functools
import hashlib
import http.server
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import crossfeed
from crossfeed.config import parse_size
from crossfeed.io.cache import Prefetcher, ShardCache
from crossfeed.io.storage import Storage

pytest.importorskip("aiohttp")

from loader_helpers import ids_of  # noqa: E402


class _Handler(http.server.SimpleHTTPRequestHandler):
    """Static files with Range support; ``latency`` seconds per request; every GET counted."""

    counts: collections.Counter = collections.Counter()
    sent: collections.Counter = collections.Counter()  # body bytes per path
    latency = 0.02
    chunk_delay = 0.0
    ignore_range = False
    fail = 0  # answer this many more range GETs with 503
    before_first_range = None  # called before answering a range that starts at byte 0

    def log_message(self, *a):
        pass

    def do_GET(self):
        type(self).counts[self.path.split("?")[0].lstrip("/")] += 1
        time.sleep(self.latency)
        path = self.translate_path(self.path)
        if not os.path.isfile(path):
            self.send_error(404)
            return
        with open(path, "rb") as f:
            data = f.read()
        if self.headers.get("Range") and type(self).fail > 0:
            type(self).fail -= 1
            self.send_error(503)
            return
        rng = None if self.ignore_range else self.headers.get("Range")
        start, stop = 0, len(data)
        if rng:
            a, b = rng.split("=")[1].split("-")
            start, stop = int(a), (int(b) + 1 if b else len(data))
            if start == 0 and self.before_first_range is not None:
                type(self).before_first_range()
        body = data[start:stop]
        type(self).sent[self.path.split("?")[0].lstrip("/")] += len(body)
        self.send_response(206 if rng else 200)
        if rng:
            self.send_header("Content-Range", f"bytes {start}-{start + len(body) - 1}/{len(data)}")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        step = 1 << 12 if self.chunk_delay else 1 << 16
        for i in range(0, len(body), step):
            if self.chunk_delay:  # the body trickles: a download is in progress for a while
                time.sleep(self.chunk_delay)
            self.wfile.write(body[i : i + step])

    def do_HEAD(self):
        path = self.translate_path(self.path)
        if not os.path.isfile(path):
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(os.path.getsize(path)))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()


@pytest.fixture
def served(tmp_path):
    """A 600-sample dataset in 6 shards, served over HTTP; yields (url, local path, handler class)."""
    root = tmp_path / "ds"
    rng = np.random.default_rng(0)
    crossfeed.write_dataset(
        root, [{"x": rng.random(16, dtype=np.float32), "id": i} for i in range(600)], num_shards=6
    ).close()
    handler = type(
        "H",
        (_Handler,),
        {
            "counts": collections.Counter(),
            "sent": collections.Counter(),
            "latency": 0.02,
            "chunk_delay": 0.0,
            "fail": 0,
            "before_first_range": None,
        },
    )
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(root)))
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", root, handler
    finally:
        server.shutdown()
        server.server_close()


def _shard_requests(handler) -> int:
    return sum(n for k, n in handler.counts.items() if k.endswith(".tfrecord"))


def _values(loader) -> dict[int, np.ndarray]:
    return {int(i): x for b in loader for i, x in zip(b["id"], b["x"])}


@pytest.mark.parametrize("shuffle", ["global", "block"])
def test_the_second_epoch_makes_no_data_requests(served, tmp_path, shuffle):
    url, root, handler = served
    with crossfeed.Loader(root, batch_size=50, shuffle="none") as local:
        want = _values(local)
    with crossfeed.Loader(url, batch_size=50, shuffle=shuffle, cache_dir=tmp_path / "cache") as loader:
        assert _values_equal(_values(loader), want)
        after_first = _shard_requests(handler)
        assert after_first <= 6 * 2  # each shard fetched whole (a size probe and a GET at most)
        assert _values_equal(_values(loader), want)
        assert _shard_requests(handler) == after_first  # epoch 2: served from the cache


def _values_equal(got, want) -> bool:
    return got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)


def test_the_cache_stays_under_its_limit_by_at_most_one_shard(served, tmp_path):
    url, root, handler = served
    shard = max(os.path.getsize(root / f) for f in os.listdir(root) if f.endswith(".tfrecord"))
    limit = int(2.5 * shard)
    cache = ShardCache(tmp_path / "c", limit)
    with crossfeed.Loader(
        url,
        batch_size=20,
        shuffle="block",
        block_shards=1,
        cache_dir=tmp_path / "c",
        cache_limit=limit,
        num_threads=1,
        prefetch=0,
    ) as loader:
        n = 0
        for b in loader:
            n += len(b["id"])
            assert cache.size() <= limit + shard
        assert n == 600


@pytest.mark.slow
def test_global_shuffle_larger_than_the_cache_says_so_and_still_reads(served, tmp_path, caplog):
    url, root, _ = served
    with caplog.at_level("WARNING", "crossfeed.read.loader"):
        with crossfeed.Loader(url, batch_size=100, shuffle="global", cache_dir=tmp_path / "c", cache_limit=1000) as ld:
            assert sum(len(b["id"]) for b in ld) == 600
    assert "more than the cache limit" in caplog.text and "shuffle='block'" in caplog.text


def test_a_corrupted_cache_entry_is_detected_and_downloaded_again(served, tmp_path):
    url, root, handler = served
    with crossfeed.Loader(url, batch_size=600, shuffle="none", cache_dir=tmp_path / "c") as ld:
        want = _values(ld)
    entries = ShardCache(tmp_path / "c").entries()
    assert len(entries) == 6
    with open(entries[0].path, "r+b") as f:  # same size, one byte flipped
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x55]))
    before = _shard_requests(handler)
    with crossfeed.Loader(url, batch_size=600, shuffle="none", cache_dir=tmp_path / "c") as ld:
        assert _values_equal(_values(ld), want)
    assert 1 <= _shard_requests(handler) - before <= 2  # that shard, again


_KILLED_DOWNLOAD = """
import sys, crossfeed
with crossfeed.Loader(sys.argv[1], batch_size=600, shuffle="none", cache_dir=sys.argv[2]) as ld:
    for b in ld:
        pass
"""


@pytest.mark.slow
def test_kill_9_mid_download_leaves_nothing_accepted(served, tmp_path):
    url, root, handler = served
    handler.chunk_delay = 0.05  # downloads crawl: the kill lands mid-download
    cache_dir = tmp_path / "c"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_DOWNLOAD, url, str(cache_dir)])
    deadline = time.time() + 60
    while time.time() < deadline and not any(".tmp-" in f for _, _, fs in os.walk(cache_dir) for f in fs):
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL  # killed mid-download, not finished
    handler.chunk_delay = 0.0
    with crossfeed.Loader(root, batch_size=600, shuffle="none") as local:
        want = _values(local)
    with crossfeed.Loader(url, batch_size=600, shuffle="none", cache_dir=cache_dir) as ld:
        assert _values_equal(_values(ld), want)
    assert not [f for _, _, fs in os.walk(cache_dir) for f in fs if ".tmp-" in f]  # the dead writer's file is gone


_SHARE = """
import sys, crossfeed
with crossfeed.Loader(sys.argv[1], batch_size=100, shuffle="global", cache_dir=sys.argv[2]) as ld:
    print(sum(len(b["id"]) for b in ld))
"""


@pytest.mark.slow
def test_two_processes_sharing_a_cache_download_each_shard_once(served, tmp_path):
    url, root, handler = served
    handler.chunk_delay = 0.005
    procs = [
        subprocess.Popen([sys.executable, "-c", _SHARE, url, str(tmp_path / "c")], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert outs == ["600", "600"]
    gets = {k: n for k, n in handler.counts.items() if k.endswith(".tfrecord")}
    assert len(gets) == 6 and all(n == 1 for n in gets.values()), gets


def test_sizes_parse():
    assert parse_size("50GB") == 50 << 30 and parse_size("512M") == 512 << 20 and parse_size(1000) == 1000
    with pytest.raises(crossfeed.ConfigError, match="not a size"):
        parse_size("lots")


@pytest.mark.slow
def test_s3_through_moto_and_s3fs(tmp_path, monkeypatch):
    moto_server = pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    import boto3
    import fsspec

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        for k, v in {
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1",
        }.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": endpoint})
        s3 = boto3.client("s3", endpoint_url=endpoint)
        s3.create_bucket(Bucket="data")
        root = tmp_path / "ds"
        crossfeed.write_dataset(
            root, [{"x": np.full(4, i, np.float32), "id": i} for i in range(200)], num_shards=4
        ).close()
        for f in os.listdir(root):
            s3.upload_file(str(root / f), "data", f"ds/{f}")
        with crossfeed.Loader(root, batch_size=50, shuffle="global", seed=1, return_index=True) as local:
            want = ids_of(local)
        with crossfeed.Loader(
            "s3://data/ds", batch_size=50, shuffle="global", seed=1, return_index=True, cache_dir=tmp_path / "c"
        ) as remote:
            got = ids_of(remote)
            again = ids_of(remote)
            assert remote.cache.downloads == 4  # each shard once, the second epoch from the cache
        assert [a.tolist() for a in got] == [a.tolist() for a in want] and len(again) == 4
    finally:
        server.stop()


@pytest.mark.slow
def test_cache_command_lists_prunes_and_clears(served, tmp_path):
    url, _, _ = served
    with crossfeed.Loader(url, batch_size=600, shuffle="none", cache_dir=tmp_path / "c") as ld:
        list(ld)
    run = [sys.executable, "-m", "crossfeed.cli.main", "cache"]
    out = subprocess.run(run + ["ls", "--dir", str(tmp_path / "c")], capture_output=True, text=True, check=True).stdout
    assert "6 shards" in out
    subprocess.run(run + ["prune", "1", "--dir", str(tmp_path / "c")], capture_output=True, text=True, check=True)
    assert ShardCache(tmp_path / "c").size() <= 1
    subprocess.run(run + ["clear", "--dir", str(tmp_path / "c")], capture_output=True, text=True, check=True)
    assert ShardCache(tmp_path / "c").entries() == []
    bad = subprocess.run(run + ["ls", "--dir", str(tmp_path / "nope")], capture_output=True, text=True)
    assert bad.returncode != 0 and "no such cache directory" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_bench_reads_through_the_cache(served, tmp_path):
    url, _, handler = served
    cmd = [
        sys.executable,
        "-m",
        "crossfeed.cli.main",
        "bench",
        url,
        "--batch-size",
        "50",
        "--batches",
        "4",
        "--cache-dir",
        str(tmp_path / "c"),
        "--cache-limit",
        "1GB",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "samples/s" in out.stdout
    assert len(ShardCache(tmp_path / "c").entries()) == 6


# -- large shards: parallel range requests, hashed as they land ---------------------------------


def _shard_sizes(root) -> dict[str, int]:
    return {f: os.path.getsize(root / f) for f in os.listdir(root) if f.endswith(".tfrecord")}


@pytest.mark.parametrize("shuffle", ["global", "block"])
def test_large_shards_arrive_as_parallel_ranges_each_byte_once(served, tmp_path, monkeypatch, shuffle):
    url, root, handler = served
    monkeypatch.setattr("crossfeed.io.cache.CHUNK", 2048)  # ~5 range requests per 10 KB shard
    with crossfeed.Loader(root, batch_size=50, shuffle="none") as local:
        want = _values(local)
    with crossfeed.Loader(url, batch_size=50, shuffle=shuffle, cache_dir=tmp_path / "c") as loader:
        assert loader.cache.chunk_bytes == 2048
        assert _values_equal(_values(loader), want)
        sizes = _shard_sizes(root)
        assert {k: handler.sent[k] for k in sizes} == sizes  # every byte once, none twice
        assert all(handler.counts[k] >= n // 2048 for k, n in sizes.items())  # in chunks, not one GET
        before = _shard_requests(handler)
        assert _values_equal(_values(loader), want)
        assert _shard_requests(handler) == before
    for e in ShardCache(tmp_path / "c").entries():  # each entry is the shard, byte for byte
        assert any(open(root / f, "rb").read() == open(e.path, "rb").read() for f in sizes)


def test_a_server_that_ignores_ranges_is_an_error_not_data(served, tmp_path, monkeypatch):
    url, root, handler = served
    monkeypatch.setattr("crossfeed.io.cache.CHUNK", 2048)
    handler.ignore_range = True  # every GET answers the whole file
    with pytest.raises(crossfeed.CrossfeedError, match="ignored the range"):
        with crossfeed.Loader(url, batch_size=600, shuffle="none", cache_dir=tmp_path / "c") as ld:
            list(ld)
    assert ShardCache(tmp_path / "c").entries() == []
    assert not [f for _, _, fs in os.walk(tmp_path / "c") for f in fs if ".tmp-" in f]


def test_a_remote_shard_changed_since_the_manifest_is_an_error(served, tmp_path, monkeypatch):
    url, root, handler = served
    monkeypatch.setattr("crossfeed.io.cache.CHUNK", 2048)
    shard = sorted(_shard_sizes(root))[0]
    with open(root / shard, "r+b") as f:  # same size, other bytes
        f.seek(3000)
        f.write(b"\xff" * 8)
    with pytest.raises(crossfeed.CrossfeedError, match="changed or is damaged"):
        with crossfeed.Loader(url, batch_size=600, shuffle="none", cache_dir=tmp_path / "c") as ld:
            list(ld)
    assert len(ShardCache(tmp_path / "c").entries()) < 6  # the changed shard was not accepted


_CHUNKED = """
import sys, crossfeed, crossfeed.io.cache as c
c.CHUNK = 2048
with crossfeed.Loader(sys.argv[1], batch_size=100, shuffle=sys.argv[3], cache_dir=sys.argv[2]) as ld:
    print(sum(len(b["id"]) for b in ld))
"""


@pytest.mark.slow
def test_kill_9_mid_chunked_download_leaves_nothing_accepted(served, tmp_path):
    url, root, handler = served
    handler.chunk_delay = 0.3  # every range request crawls: the kill lands mid-download
    handler.latency = 0.1
    cache_dir = tmp_path / "c"
    proc = subprocess.Popen([sys.executable, "-c", _CHUNKED, url, str(cache_dir), "none"], stdout=subprocess.PIPE)
    deadline = time.time() + 60
    while time.time() < deadline and not any(".tmp-" in f for _, _, fs in os.walk(cache_dir) for f in fs):
        time.sleep(0.01)
    time.sleep(0.5)  # the first chunks written, not all
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL  # killed mid-download, not finished
    for e in ShardCache(cache_dir).entries():  # an accepted entry is whole: its name is its sha256
        assert hashlib.sha256(open(e.path, "rb").read()).hexdigest() == e.name
    handler.chunk_delay, handler.latency = 0.0, 0.0
    with crossfeed.Loader(root, batch_size=600, shuffle="none") as local:
        want = _values(local)
    with crossfeed.Loader(url, batch_size=600, shuffle="none", cache_dir=cache_dir) as ld:
        assert _values_equal(_values(ld), want)
    assert not [f for _, _, fs in os.walk(cache_dir) for f in fs if ".tmp-" in f]


@pytest.mark.slow
def test_two_processes_sharing_a_cache_download_each_chunked_shard_once(served, tmp_path):
    url, root, handler = served
    handler.chunk_delay = 0.005
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHUNKED, url, str(tmp_path / "c"), "global"], stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert outs == ["600", "600"]
    sizes = _shard_sizes(root)
    assert {k: handler.sent[k] for k in sizes} == sizes  # each shard's bytes crossed the link once


@pytest.mark.slow
def test_a_failed_range_request_is_tried_again_and_a_dead_server_is_a_clear_error(served, tmp_path, monkeypatch):
    url, root, handler = served
    monkeypatch.setattr("crossfeed.io.cache.CHUNK", 2048)
    with crossfeed.Loader(root, batch_size=600, shuffle="none") as local:
        want = _values(local)
    handler.fail = 3  # three 503s among the first range requests
    with crossfeed.Loader(url, batch_size=600, shuffle="none", cache_dir=tmp_path / "c") as ld:
        assert _values_equal(_values(ld), want)
    handler.fail = 10**6  # every range request fails
    with pytest.raises(crossfeed.CrossfeedError, match=r"could not be downloaded in 3 tries.*503"):
        with crossfeed.Loader(url, batch_size=600, shuffle="none", cache_dir=tmp_path / "d") as ld:
            list(ld)
    assert ShardCache(tmp_path / "d").entries() == []


_FORKED = """
import hashlib, os, signal, sys
from crossfeed.io.cache import Prefetcher, ShardCache
from crossfeed.io.storage import Storage
url, root, cache_dir, rel = sys.argv[1:]
data = open(os.path.join(root, rel), "rb").read()
sha, size = hashlib.sha256(data).hexdigest(), len(data)
cache, storage = ShardCache(cache_dir, chunk_bytes=2048), Storage(url)
cache.release(cache.fetch(storage, rel, sha, size))  # the range pool now exists in this process
cache.clear()
pid = os.fork()
if pid == 0:  # a forked worker (DataLoader's default): the parent's pool threads are gone
    signal.alarm(60)  # a pool without threads would wait forever
    path = cache.fetch(Storage(url), rel, sha, size)
    os._exit(0 if open(path, "rb").read() == data else 1)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.slow
def test_a_forked_worker_downloads_with_a_range_pool_of_its_own(served, tmp_path):
    url, root, handler = served
    rel = sorted(_shard_sizes(root))[0]
    out = subprocess.run(
        [sys.executable, "-c", _FORKED, url, str(root), str(tmp_path / "c"), rel],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0", out.stderr
    assert handler.sent[rel] == 2 * _shard_sizes(root)[rel]  # once by the parent, once by the child


def test_a_finished_range_is_written_at_once_not_held_for_an_earlier_one(served, tmp_path):
    """Memory holds only the requests in flight: while the shard's first range is still on its
    way, the ranges after it are already in the temporary file (not buffered until it lands)."""
    url, root, handler = served
    rel = sorted(f for f in os.listdir(root) if f.endswith(".tfrecord"))[0]
    want = (root / rel).read_bytes()
    cache = ShardCache(tmp_path / "c", chunk_bytes=1024, streams=4, window=4)
    seen = []

    def wait_for_later_ranges():  # on the server's thread, before answering bytes 0-1023
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            tmps = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "c") for f in fs if ".tmp-" in f]
            if tmps and open(tmps[0], "rb").read()[1024:4096] == want[1024:4096]:
                seen.append(True)
                return
            time.sleep(0.01)
        seen.append(False)

    handler.before_first_range = staticmethod(wait_for_later_ranges)
    path = cache.fetch(Storage(url), rel, hashlib.sha256(want).hexdigest(), len(want))
    assert seen == [True]
    assert open(path, "rb").read() == want


def test_downloads_ahead_never_push_the_entries_in_use_over_the_limit(served, tmp_path):
    url, root, _ = served
    shards = [s for s in crossfeed.open_dataset(root).splits["train"].shards]
    biggest = max(s.num_bytes for s in shards)
    cache = ShardCache(tmp_path / "c", int(2.5 * biggest))
    storage = Storage(url)
    used = [cache.fetch(storage, s.file, s.sha256, s.num_bytes) for s in shards[:2]]  # the reader's window
    prefetcher = Prefetcher(cache)
    prefetcher.want([(storage, s.file, s.sha256, s.num_bytes) for s in shards[2:]])
    prefetcher.close()
    assert cache.downloads == 2  # no room beside the two in use: the reader fetches the next itself
    for path in used:
        cache.release(path)
    prefetcher = Prefetcher(cache)
    prefetcher.want([(storage, s.file, s.sha256, s.num_bytes) for s in shards[2:]])
    deadline = time.monotonic() + 30  # (close() stops downloads in flight: let them finish first)
    while cache.downloads < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    prefetcher.close()
    assert cache.downloads == 4 and cache.size() <= cache.limit  # two fit once nothing is in use
