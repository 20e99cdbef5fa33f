"""Remote reads are bounded in size and time (issue 22, item 6), and a backend's failure is one
`CrossfeedError` line at the CLI (item 15): a real HTTP server that never ends a file, lies about
``Content-Length`` or trickles a byte a second; an unreachable S3 endpoint and HTTP address.
Hostile reads run in a child process under an address-space limit."""

from __future__ import annotations

import functools
import http.server
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import crossfeed

pytest.importorskip("aiohttp")


class _Hostile(http.server.SimpleHTTPRequestHandler):
    """The dataset's files, except ``modes[name]``: "endless" (the file, then zeros forever, no
    length), "lying" (``Content-Length: 2**40``, zeros forever), "trickle" (a byte a second)."""

    modes: dict = {}
    stop: threading.Event

    def log_message(self, *a):
        pass

    def do_GET(self):
        name = self.path.split("?")[0].lstrip("/")
        mode = self.modes.get(name)
        if mode is None:
            return super().do_GET()
        data = (
            open(self.translate_path(self.path), "rb").read() if os.path.isfile(self.translate_path(self.path)) else b""
        )
        self.send_response(200)
        if mode == "lying":
            self.send_header("Content-Length", str(1 << 40))
        elif mode == "trickle":
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            if mode == "trickle":
                for i in range(len(data)):
                    if self.stop.wait(1.0):
                        return
                    self.wfile.write(data[i : i + 1])
                    self.wfile.flush()
                return
            self.wfile.write(data)
            zeros = bytes(1 << 16)
            for _ in range((8 << 30) // len(zeros)):  # 8 GiB at most: a client that never stops is a failure anyway
                if self.stop.is_set():
                    return
                self.wfile.write(zeros)
        except OSError:  # the client hung up: what a bounded reader does
            return


@pytest.fixture
def hostile(tmp_path):
    """A 3-shard dataset served over HTTP; yields ``(url, root, modes)``."""
    root = tmp_path / "ds"
    crossfeed.write_dataset(root, [{"x": np.full(8, i, np.float32), "id": i} for i in range(90)], num_shards=3).close()
    stop = threading.Event()
    handler = type("H", (_Hostile,), {"modes": {}, "stop": stop})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(root)))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", root, handler.modes
    finally:
        stop.set()
        server.shutdown()
        server.server_close()


_READ = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # the hostile file must not get near this
import crossfeed
url, cache = sys.argv[1], sys.argv[2]
try:
    with crossfeed.Loader(url, batch_size=30, shuffle="none", cache_dir=cache or None) as ld:
        print("read", sum(len(b["id"]) for b in ld))
except crossfeed.CrossfeedError as e:
    print(type(e).__name__, "|", e)
"""


def _read(url, cache="", env=None, timeout=120) -> str:
    out = subprocess.run(
        [sys.executable, "-c", _READ, url, str(cache)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def _tmp_bytes(folder) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)


def test_an_endless_manifest_is_an_error_after_what_a_manifest_may_hold(hostile):
    url, _, modes = hostile
    modes["crossfeed.json"] = "endless"
    out = _read(url)
    assert out.startswith("ManifestError |") and "more than a manifest may hold" in out and "crossfeed.json" in out


@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("mode", ["endless", "lying"])
def test_a_shard_longer_than_the_manifest_says_is_an_error_not_a_buffer(hostile, tmp_path, cached, mode):
    url, root, modes = hostile
    shard = sorted(f for f in os.listdir(root) if f.endswith(".tfrecord"))[1]
    size = os.path.getsize(root / shard)
    modes[shard] = mode
    out = _read(url, tmp_path / "c" if cached else "")
    assert out.startswith("CorruptRecordError |") and shard in out and f"the manifest says {size}" in out, out
    if cached:
        assert _tmp_bytes(tmp_path / "c") <= 3 * size  # nothing of the endless file stayed on disk


@pytest.mark.slow
@pytest.mark.parametrize("cached", [False, True])
def test_a_trickling_server_is_a_remote_error_naming_the_url(hostile, tmp_path, cached):
    url, root, modes = hostile
    shard = sorted(f for f in os.listdir(root) if f.endswith(".tfrecord"))[2]
    modes[shard] = "trickle"
    out = _read(url, tmp_path / "c" if cached else "", env={"CROSSFEED_READ_TIMEOUT": "1"}, timeout=60)
    assert out.startswith("RemoteError |") and f"{url}/{shard}" in out and "read deadline of 1 s" in out, out
    assert "could not be downloaded in 3 tries" in out  # a stall is tried again, as a reset is


def test_a_trickling_index_and_manifest_stall_too(hostile):
    url, root, modes = hostile
    modes["crossfeed.json"] = "trickle"
    t = time.monotonic()
    with pytest.raises(crossfeed.RemoteError, match=r"crossfeed.json: no progress within the read deadline"):
        crossfeed.open_dataset(url, read_timeout=0.5)
    assert time.monotonic() - t < 30  # bounded (the old reader waited for the whole trickle)
    del modes["crossfeed.json"]
    idx = sorted(f for f in os.listdir(root) if f.endswith(".idx"))[0]
    modes[idx] = "trickle"
    with pytest.raises(crossfeed.RemoteError, match=idx):
        crossfeed.open_dataset(url, read_timeout=0.5)["train"].index(0)


def test_the_read_deadline_is_checked_where_it_is_given(monkeypatch):
    for bad in ("0", "-1", "1e3", " 5", "soon", "nan"):
        monkeypatch.setenv("CROSSFEED_READ_TIMEOUT", bad)
        with pytest.raises(crossfeed.ConfigError, match="CROSSFEED_READ_TIMEOUT"):
            crossfeed.open_dataset("http://127.0.0.1:9/ds")
    monkeypatch.delenv("CROSSFEED_READ_TIMEOUT")
    for bad in (0, -2.0, float("inf"), True, "x"):
        with pytest.raises(crossfeed.ConfigError, match="read_timeout"):
            crossfeed.open_dataset("http://127.0.0.1:9/ds", read_timeout=bad)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed on exit: nothing listens there


def _cli(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "crossfeed.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_an_unreachable_http_url_is_one_error_line_at_the_cli():
    url = f"http://127.0.0.1:{_closed_port()}/ds"
    out = _cli("info", url)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("error: ") and out.stderr.count("\n") == 1 and url in out.stderr, out.stderr


@pytest.mark.slow
def test_an_unreachable_s3_endpoint_is_one_error_line_at_the_cli():
    pytest.importorskip("s3fs")
    env = {
        "FSSPEC_S3_ENDPOINT_URL": f"http://127.0.0.1:{_closed_port()}",
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
        "CROSSFEED_READ_TIMEOUT": "20",
    }
    out = _cli("info", "s3://bucket/ds", env=env)
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.startswith("error: ") and out.stderr.count("\n") == 1, out.stderr[-3000:]
    assert "s3://bucket/ds" in out.stderr or "bucket/ds" in out.stderr


_READ_TIMED = """
import sys, time
import crossfeed
url, cache = sys.argv[1], sys.argv[2]
start = time.time()
with crossfeed.Loader(url, batch_size=10, shuffle="none", cache_dir=cache) as ld:
    try:
        print("read", sum(len(b["id"]) for b in ld))
    except crossfeed.CrossfeedError as e:
        print(type(e).__name__, "|", e)
    print("failed after", time.time() - start, "at", time.time(), flush=True)
"""


@pytest.mark.slow  # a process timed to its exit (seconds of retries before the fix)
def test_download_ahead_stops_after_a_remote_read_fails_so_the_process_exits(tmp_path):
    """16 shards over HTTP, all but the first trickling, a read deadline of 3 s: the read fails
    (a RemoteError naming a shard), and the process exits soon after, not once the downloads
    ahead started meanwhile have run their own 3 tries (9 s; the bound is on a hang, generous
    for a loaded machine)."""
    root = tmp_path / "ds"
    crossfeed.write_dataset(
        root, [{"x": np.full(8, i, np.float32), "id": i} for i in range(320)], num_shards=16
    ).close()
    stop = threading.Event()
    shards = sorted(f for f in os.listdir(root) if f.endswith(".tfrecord"))
    handler = type("H", (_Hostile,), {"modes": dict.fromkeys(shards[1:], "trickle"), "stop": stop})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(root)))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        env = {**os.environ, "CROSSFEED_READ_TIMEOUT": "3"}
        proc = subprocess.run(
            [sys.executable, "-c", _READ_TIMED, url, str(tmp_path / "c")],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        ended = time.time()
    finally:
        stop.set()
        server.shutdown()
        server.server_close()
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.startswith("RemoteError |") and "read deadline of 3 s" in out, out
    failed_at = float(out.split(" at ")[-1])
    assert ended - failed_at < 6, f"{ended - failed_at:.1f}s from the failure to the exit"
