"""Trust, third round (issue 35): what a dataset URL carries and where it leads.

* Item 1: a password in a URL (``http://alice:hunter2@host/…``) or a credential in its query is
  never shown: not by `crossfeed info`, not in `verify`'s problems, not in a `RemoteError` (nor
  the CLI's ``error:`` line), not in a log line — while the credential still reaches the server.
* Item 3: an HTTP redirect to another origin is refused, naming both origins (redacted); the
  dataset is never read from the second server.
* Item 13: a shard named ``a#b`` (``?``, space, ``%``) is fetched as ``a#b``, not as ``a``.

Every test runs real HTTP servers on 127.0.0.1:0 and the real CLI in a child process."""

from __future__ import annotations

import base64
import collections
import functools
import http.server
import json
import logging
import os
import subprocess
import sys
import threading
import urllib.parse

import numpy as np
import pytest
from http_helpers import RangeFiles

import crossfeed
from crossfeed.errors import redact

pytest.importorskip("aiohttp")

SECRET = "hunter2"
USER = "alice"


class _Server(RangeFiles):
    """Range-capable static files that count every request by path; ``auth``: the Basic
    credentials a request must carry (401 without); ``fail``: paths answered with HTTP 500;
    ``redirect``: path → the URL a 302 sends the client to."""

    auth: str | None = None
    fail: set = set()
    redirect: dict = {}
    seen: collections.Counter

    def do_GET(self):
        type(self).seen[self.path] += 1
        if self.auth is not None and self.headers.get("Authorization") != "Basic " + base64.b64encode(
            self.auth.encode()
        ).decode("ascii"):
            self.send_error(401)
            return
        if self.path in self.fail:
            self.send_error(500)
            return
        target = self.redirect.get(self.path)
        if target is not None:
            self.send_response(302)
            self.send_header("Location", target)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        super().do_GET()

    do_HEAD = do_GET


class _Running:
    def __init__(self, directory, **attrs):
        handler = type("H", (_Server,), {"seen": collections.Counter(), "fail": set(), "redirect": {}, **attrs})
        self.handler = handler
        self.server = http.server.ThreadingHTTPServer(
            ("127.0.0.1", 0), functools.partial(handler, directory=str(directory))
        )
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.origin = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def servers():
    started = []

    def start(directory, **attrs) -> _Running:
        started.append(_Running(directory, **attrs))
        return started[-1]

    yield start
    for s in started:
        s.close()


def _dataset(root, n=90, shards=3, value=0):
    crossfeed.write_dataset(
        root, [{"x": np.full(8, value + i, np.float32), "id": i} for i in range(n)], num_shards=shards
    ).close()
    return sorted(f for f in os.listdir(root) if f.endswith(".tfrecord"))


def _cli(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "crossfeed.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CROSSFEED_READ_TIMEOUT": "20", **(env or {})},
    )


# ---- item 1: no secret shown -------------------------------------------------------------------


def test_redact_hides_userinfo_and_credential_query_values_only():
    assert redact("http://alice:hunter2@h:80/d/x?token=t1&n=1#f") == "http://***@h:80/d/x?token=***&n=1#f"
    assert redact("see s3://b/k?X-Amz-Signature=zz&X-Amz-Credential=c&part=2 now") == (
        "see s3://b/k?X-Amz-Signature=***&X-Amz-Credential=***&part=2 now"
    )
    assert redact("gs://b/o?sig=1&Password=p&api_key=k&size=3") == "gs://b/o?sig=***&Password=***&api_key=***&size=3"
    assert redact("https://a:b@c@host/p") == "https://***@host/p"  # up to the last '@' of the authority
    for plain in ("ipc:///tmp/x", "tcp://127.0.0.1:5555", "a=b, c=d", "/data/train-00000-of-00003.tfrecord"):
        assert redact(plain) == plain


@pytest.fixture
def secret_dataset(tmp_path, servers):
    """A 3-shard dataset behind a server that wants Basic credentials; ``(url, root, server)``,
    the URL carrying the credentials."""
    root = tmp_path / "ds"
    _dataset(root)
    server = servers(root, auth=f"{USER}:{SECRET}")
    return server.origin.replace("http://", f"http://{USER}:{SECRET}@"), root, server


def test_info_shows_the_url_without_its_password(secret_dataset):
    url, _, server = secret_dataset
    out = _cli("info", url)
    assert out.returncode == 0, out.stderr
    assert (
        SECRET not in out.stdout + out.stderr
        and f"http://***@127.0.0.1:{server.origin.rsplit(':', 1)[1]}" in out.stdout
    )
    assert "90 records" in out.stdout  # the credentials still reached the server
    assert SECRET not in repr(crossfeed.open_dataset(url))


def test_verify_problems_name_the_url_without_its_password(secret_dataset):
    url, root, _ = secret_dataset
    shard = root / "train-00001-of-00003.tfrecord"
    data = bytearray(shard.read_bytes())
    data[40] ^= 0xFF
    shard.write_bytes(bytes(data))
    out = _cli("verify", url)
    assert out.returncode == 1, out.stderr
    assert "BAD" in out.stderr and "train-00001-of-00003.tfrecord" in out.stderr, out.stderr
    assert SECRET not in out.stdout + out.stderr and "http://***@" in out.stderr


def test_a_remote_error_and_the_cli_error_line_hide_the_password(secret_dataset):
    url, root, server = secret_dataset
    server.handler.fail.add("/train-00002-of-00003.tfrecord")
    with pytest.raises(crossfeed.RemoteError) as info:
        with crossfeed.Loader(url, batch_size=30, shuffle="none") as ld:
            list(ld)
    assert "HTTP 500" in str(info.value) and SECRET not in str(info.value) and SECRET not in info.value.url
    assert "http://***@" in str(info.value)
    server.handler.fail.add("/crossfeed.json")
    out = _cli("head", url)
    assert out.returncode == 2 and out.stderr.startswith("error: "), out.stderr
    assert "HTTP 500" in out.stderr and SECRET not in out.stderr and "http://***@" in out.stderr


def test_log_lines_hide_the_password(secret_dataset, tmp_path, caplog):
    url, root, server = secret_dataset
    server.handler.fail.add("/train-00002-of-00003.tfrecord")
    with caplog.at_level(logging.DEBUG, "crossfeed"):
        with pytest.raises(crossfeed.RemoteError):
            with crossfeed.Loader(url, batch_size=30, shuffle="none", cache_dir=tmp_path / "c") as ld:
                list(ld)
    assert "prefetching" in caplog.text and "HTTP 500" in caplog.text, caplog.text  # the prefetcher's warning
    assert "cached http://***@" in caplog.text  # the cache's debug line of the shards that came
    assert SECRET not in caplog.text


# ---- item 3: no redirect to another origin -----------------------------------------------------


@pytest.fixture
def two_servers(tmp_path, servers):
    """Server A (the one named) and server B (another origin) each hold a dataset of the same
    file names but other values; ``(a, b, names)``, ``names`` the URL paths of A's files."""
    for name, value in (("a", 0), ("b", 1000)):
        _dataset(tmp_path / name, value=value)
    a, b = servers(tmp_path / "a"), servers(tmp_path / "b")
    return a, b, sorted("/" + f for f in os.listdir(tmp_path / "a"))


def _read_ids(url, **kw):
    with crossfeed.Loader(url, batch_size=30, shuffle="none", **kw) as ld:
        return [float(v) for b in ld for v in b["x"][:, 0]]


@pytest.mark.parametrize("what", ["manifest", "index", "shard", "shard-cached", "everything"])
def test_a_redirect_to_another_origin_is_refused_and_names_both(two_servers, tmp_path, what):
    a, b, names = two_servers
    shard = "/train-00001-of-00003.tfrecord"
    moved = {
        "manifest": ["/crossfeed.json"],
        "index": [shard + ".idx"],
        "shard": [shard],
        "shard-cached": [shard],
        "everything": names,
    }[what]
    a.handler.redirect.update({p: b.origin + p for p in moved})
    url = a.origin.replace("http://", f"http://{USER}:{SECRET}@")
    with pytest.raises(crossfeed.RemoteError) as info:
        _read_ids(url, cache_dir=tmp_path / "c" if what == "shard-cached" else None)
    message = str(info.value)
    assert "redirects to another origin" in message, message
    assert f"{b.origin}" in message and f"(from {a.origin})" in message, message
    assert SECRET not in message
    assert sum(b.handler.seen.values()) == 0  # nothing was read from the other server


def test_a_redirect_to_another_origin_is_one_error_line_at_the_cli(two_servers):
    a, b, names = two_servers
    a.handler.redirect.update({p: b.origin + p for p in names})
    out = _cli("head", a.origin)
    assert out.returncode == 2 and out.stderr.startswith("error: ") and out.stderr.count("\n") == 1, out.stderr
    assert "redirects to another origin" in out.stderr and b.origin in out.stderr
    assert sum(b.handler.seen.values()) == 0


def test_a_redirect_within_the_origin_is_followed(two_servers, tmp_path):
    a, _, names = two_servers
    os.rename(tmp_path / "a" / "train-00001-of-00003.tfrecord", tmp_path / "a" / "moved.bin")
    a.handler.redirect["/train-00001-of-00003.tfrecord"] = "/moved.bin"
    assert sorted(_read_ids(a.origin)) == [float(i) for i in range(90)]
    assert a.handler.seen["/moved.bin"] >= 1


# ---- item 13: a shard's name is a file name, not URL syntax ------------------------------------

ODD_NAMES = ("a#b.tfrecord", "a?b=1.tfrecord", "a b%41%zz.tfrecord")


def _renamed_dataset(root) -> list[str]:
    """A 3-shard dataset whose shards (and index files) are renamed to `ODD_NAMES` in its
    manifest; beside them a decoy ``a`` (what ``a#b`` and ``a?b`` fetched unquoted)."""
    old = _dataset(root)
    manifest = json.loads((root / "crossfeed.json").read_text())
    for shard, new in zip(manifest["splits"]["train"]["shards"], ODD_NAMES):
        os.rename(root / shard["file"], root / new)
        os.rename(root / (shard["file"] + ".idx"), root / (new + ".idx"))
        shard["file"] = new
    (root / "crossfeed.json").write_text(json.dumps(manifest))
    (root / "a").write_bytes((root / ODD_NAMES[1]).read_bytes())
    return old


@pytest.mark.parametrize("cached", [False, True])
def test_names_with_url_syntax_are_fetched_as_named(tmp_path, servers, cached):
    root = tmp_path / "ds"
    _renamed_dataset(root)
    server = servers(root)
    got = _read_ids(server.origin, cache_dir=tmp_path / "c" if cached else None)
    assert sorted(got) == [float(i) for i in range(90)]
    files = collections.Counter()  # the files the server was asked for, as it reads the paths
    for path, n in server.handler.seen.items():
        files[urllib.parse.unquote(path)] += n
    assert not any(p == "/a" or p.startswith(("/a?", "/a#")) for p in server.handler.seen), server.handler.seen
    for name in ODD_NAMES:
        assert files[f"/{name}"] >= 1 and files[f"/{name}.idx"] == 1, files
