"""A dataset opened from an untrusted place reaches nothing outside it, and a reader reads the
version it opened (issue 22, items 2–4).

* ``data_root``: a planted manifest pointing at ``/etc`` (run under an audit hook: nothing there
  is opened), at another directory holding a valid dataset, at a real HTTP server on 127.0.0.1
  (no request reaches it), or at a symlink planted inside the dataset is refused, naming the
  root; the same dataset reads once its root is allowed (keyword, ``--allow-root``,
  ``CROSSFEED_ALLOWED_ROOTS``), and ``crossfeed index --index-dir`` prints exactly what to pass.
* A remote shard named ``%2e%2e`` (``..`` to a server) is refused before any shard request.
* Overwrites never reuse a shard name; a reader opened on version 1, with versions 2 and 3
  committed meanwhile (in this process, or another process reading), reads version 1's samples
  or raises `DatasetRewrittenError` ("… rewritten while this reader had it open; reopen it").
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import run_python
from typer.testing import CliRunner

import crossfeed
from crossfeed.cli.main import app
from crossfeed.errors import DatasetNotFoundError, DatasetRewrittenError, ManifestError, RootNotAllowedError
from crossfeed.format.manifest import MANIFEST, check_name
from crossfeed.io import roots
from crossfeed.io.storage import Storage
from crossfeed.read.loader import Loader
from crossfeed.read.sources.dataset import open_dataset
from crossfeed.read.tools.verify import verify_dataset

REWRITTEN = "the dataset was rewritten while this reader had it open"


@pytest.fixture(autouse=True)
def no_allowed_roots(monkeypatch):
    monkeypatch.delenv(roots.ENV, raising=False)


def _samples(version: int, n: int = 12) -> list[dict]:
    return [{"version": version, "i": i, "x": np.full(3, i, dtype=np.float32)} for i in range(n)]


def _write(root: Path, version: int = 1, **kw) -> Path:
    crossfeed.write_dataset(root, _samples(version), num_shards=3, **kw).close()
    return root


def _plant(secret: Path, untrusted: Path, data_root: str) -> Path:
    """A dataset directory holding ``secret``'s manifest and index files, its shards said to lie
    in ``data_root``: what an attacker ships."""
    untrusted.mkdir()
    manifest = json.loads((secret / MANIFEST).read_text())
    manifest["data_root"] = data_root
    (untrusted / MANIFEST).write_text(json.dumps(manifest))
    for p in secret.glob("*.idx"):
        shutil.copy(p, untrusted / p.name)
    return untrusted


def _ids(loader) -> list[int]:
    return sorted(int(i) for b in loader for i in b["i"])


# ---- item 2: data_root ---------------------------------------------------------------------------


_ETC = """
import json, sys
opened = []
sys.addaudithook(lambda ev, args: opened.append(str(args[0])) if ev == "open" and str(args[0]).startswith("/etc/passwd") else None)
from crossfeed.read.loader import Loader
from crossfeed.read.tools.verify import verify_dataset
errors = []
for attempt in (lambda: Loader(sys.argv[1], batch_size=2), lambda: verify_dataset(sys.argv[1])):
    try:
        attempt()
        errors.append("no error")
    except Exception as e:
        errors.append(f"{type(e).__name__}: {e}")
print(json.dumps({"errors": errors, "opened": opened}))
"""


def test_a_data_root_of_etc_is_refused_and_nothing_there_is_opened(tmp_path):
    if not os.path.isfile("/etc/passwd"):
        pytest.skip("needs /etc/passwd")
    secret = _write(tmp_path / "ds")
    manifest = json.loads((secret / MANIFEST).read_text())
    manifest["data_root"] = "/etc"
    shard = manifest["splits"]["train"]["shards"][0]
    os.rename(secret / (shard["file"] + ".idx"), secret / "passwd.idx")
    shard["file"], shard["num_bytes"] = "passwd", os.path.getsize("/etc/passwd")
    manifest["splits"]["train"].pop("num_bytes")
    (secret / MANIFEST).write_text(json.dumps(manifest))
    out = json.loads(run_python(_ETC, str(secret)).stdout)
    assert out["opened"] == []
    for err in out["errors"]:
        assert err.startswith("RootNotAllowedError") and "'/etc'" in err and "--allow-root /etc" in err, err
    result = CliRunner().invoke(app, ["verify", str(secret)])
    assert result.exit_code == 2 and "data_root '/etc' lies outside the dataset" in result.stderr


def test_a_data_root_in_another_directory_reads_only_once_allowed(tmp_path, monkeypatch):
    secret = _write(tmp_path / "secret")
    untrusted = _plant(secret, tmp_path / "untrusted", str(secret))
    for attempt in (
        lambda: open_dataset(untrusted),
        lambda: Loader(untrusted, batch_size=4),
        lambda: verify_dataset(untrusted),
        lambda: Loader([crossfeed.Source(untrusted)], batch_size=4),
    ):
        with pytest.raises(RootNotAllowedError, match=f"data_root '{secret}' lies outside the dataset"):
            attempt()
    with Loader(untrusted, batch_size=4, allowed_roots=[secret]) as loader:  # the keyword
        assert _ids(loader) == list(range(12))
    assert verify_dataset(untrusted, allowed_roots=[tmp_path]) == []  # a parent directory allows it too
    with pytest.raises(RootNotAllowedError):  # a sibling whose name merely starts the same does not
        open_dataset(untrusted, allowed_roots=[str(secret)[:-1]])
    # worker processes open it again by path: they trust what the Dataset was opened with
    ds = open_dataset(untrusted, allowed_roots=[secret])
    with Loader(ds, batch_size=4, executor="process", processes=1) as loader:
        assert _ids(loader) == list(range(12))
    monkeypatch.setenv(roots.ENV, f"/nowhere, {secret}")  # the environment, comma-separated
    with Loader(untrusted, batch_size=4) as loader:
        assert _ids(loader) == list(range(12))


def test_a_symlink_planted_inside_the_dataset_is_outside_it(tmp_path):
    secret = _write(tmp_path / "secret")
    untrusted = _plant(secret, tmp_path / "untrusted", str(tmp_path / "untrusted" / "data"))
    os.symlink(secret, untrusted / "data")
    with pytest.raises(RootNotAllowedError, match=f"data_root '{secret}'"):
        open_dataset(untrusted)
    os.unlink(untrusted / "data")
    shutil.copytree(secret, untrusted / "data")  # a real directory inside the dataset: its own data
    with Loader(untrusted, batch_size=4) as loader:
        assert _ids(loader) == list(range(12))


class _Recorder(http.server.SimpleHTTPRequestHandler):
    """Static files (Range too), every request's raw path recorded."""

    paths: list = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        type(self).paths.append(self.path)
        rng = self.headers.get("Range")
        path = self.translate_path(self.path)
        if not rng or not os.path.isfile(path):
            return super().do_GET()
        data = Path(path).read_bytes()
        start, _, stop = rng.removeprefix("bytes=").partition("-")
        body = data[int(start) : (int(stop) + 1 if stop else len(data))]
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{int(start) + len(body) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_HEAD(self):
        type(self).paths.append(self.path)
        return super().do_HEAD()


@pytest.fixture
def served(tmp_path):
    """``(url, request paths)`` of an HTTP server on 127.0.0.1 serving ``tmp_path / "www"``."""
    pytest.importorskip("aiohttp")
    (tmp_path / "www").mkdir()
    handler = type("Handler", (_Recorder,), {"paths": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=tmp_path / "www"))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler.paths
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_a_data_root_url_is_refused_and_no_request_reaches_the_server(tmp_path, served, monkeypatch):
    url, paths = served
    secret = _write(tmp_path / "www" / "data")
    untrusted = _plant(secret, tmp_path / "untrusted", f"{url}/data/")
    with pytest.raises(RootNotAllowedError, match=f"data_root '{url}/data' lies outside"):
        Loader(untrusted, batch_size=4)
    with pytest.raises(RootNotAllowedError):  # another path on the same server is not the allowed one
        Loader(untrusted, batch_size=4, allowed_roots=[f"{url}/dat"])
    assert paths == []
    monkeypatch.setenv(roots.ENV, url)
    with Loader(untrusted, batch_size=4) as loader:  # the server is real: allowed, it is read
        assert _ids(loader) == list(range(12))
    assert paths
    # a root that climbs out of an allowed prefix is no root at all
    manifest = json.loads((untrusted / MANIFEST).read_text())
    for bad in (f"{url}/data/%2e%2e/etc", f"{url}/data/../etc", f"{url}/data?x=1", f"simplecache::{url}/data"):
        manifest["data_root"] = bad
        (untrusted / MANIFEST).write_text(json.dumps(manifest))
        with pytest.raises(ManifestError, match="data_root"):
            open_dataset(untrusted)


def test_a_remote_dataset_may_use_its_own_bucket_only(tmp_path, served):
    url, paths = served
    data = _write(tmp_path / "www" / "data")
    _plant(data, tmp_path / "www" / "index", f"{url}/data")
    with Loader(f"{url}/index", batch_size=4) as loader:  # the same server: its own bucket
        assert _ids(loader) == list(range(12))
    _plant(data, tmp_path / "www" / "evil", str(data))  # a remote dataset sending us to a local path
    with pytest.raises(RootNotAllowedError, match=f"data_root '{data}'"):
        open_dataset(f"{url}/evil")


def test_index_dir_prints_exactly_what_to_pass(tmp_path, monkeypatch):
    src = _write(tmp_path / "src")
    data = tmp_path / "data"
    data.mkdir()
    for p in src.glob("*.tfrecord"):
        shutil.copy(p, data / p.name)
    runner = CliRunner()
    out = runner.invoke(app, ["index", str(data), "--index-dir", str(tmp_path / "idx")])
    assert out.exit_code == 0, out.output
    assert f"allowed_roots=[{str(data)!r}], --allow-root {data}, or {roots.ENV}={data}" in out.stdout, out.stdout
    refused = runner.invoke(app, ["verify", str(tmp_path / "idx")])
    assert refused.exit_code == 2 and f"--allow-root {data}" in refused.stderr
    assert runner.invoke(app, ["verify", str(tmp_path / "idx"), "--allow-root", str(data)]).exit_code == 0
    assert runner.invoke(app, ["head", str(tmp_path / "idx"), "--allow-root", str(data)]).exit_code == 0
    monkeypatch.setenv(roots.ENV, str(data))
    assert runner.invoke(app, ["verify", str(tmp_path / "idx")]).exit_code == 0


def test_allowed_roots_are_checked_where_they_are_made(tmp_path):
    for bad in ("/one/root", 5, ["ok", ""], ["http://h/a/%2e%2e"]):
        with pytest.raises(crossfeed.ConfigError, match="allowed_roots"):
            crossfeed.LoaderOptions.of(batch_size=2, allowed_roots=bad)
    opts = crossfeed.LoaderOptions.of(batch_size=2, allowed_roots=["rel", "s3://b/x/"])
    assert opts.read.allowed_roots == (os.path.abspath("rel"), "s3://b/x")
    assert "allowed_roots" not in opts.plan_fields()  # a dispatcher never widens a server's trust


# ---- item 3: a remote shard named %2e%2e --------------------------------------------------------


def test_a_shard_named_percent_encoded_dot_dot_is_refused_before_any_request(tmp_path, served):
    url, paths = served
    for name in ("%2e%2e", "%2E%2e", "%252e%252e", "a%2fb", "%2e", "..%5c"):
        with pytest.raises(ManifestError, match="not a plain file name"):
            check_name(name, "here")
        with pytest.raises(ManifestError, match="URL join would leave the root"):
            Storage(f"{url}/ds").url(name)
    ds = _write(tmp_path / "www" / "ds")
    manifest = json.loads((ds / MANIFEST).read_text())
    manifest["splits"]["train"]["shards"][0]["file"] = "%2e%2e"
    (ds / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="'%2e%2e' is not a plain file name"):
        Loader(f"{url}/ds", batch_size=4)
    assert paths == ["/ds/crossfeed.json"]


# ---- item 4: overwrites never reuse a shard name; a reader reads its version or raises ---------


def test_overwrites_never_reuse_a_shard_name(tmp_path):
    root = tmp_path / "ds"
    names = []
    for version in (1, 2, 3, 4):
        _write(root, version, overwrite=version > 1)
        names.append(set(open_dataset(root).manifest.files))
    assert all(not (a & b) for i, a in enumerate(names) for b in names[i + 1 :])
    os.unlink(root / MANIFEST)  # a lost manifest: the files on disk still say which names were used
    _write(root, 5, overwrite=True)
    assert not set(open_dataset(root).manifest.files) & set().union(*names)


def test_a_reader_open_across_two_overwrites_reads_its_version_or_says_it_was_rewritten(tmp_path):
    root = _write(tmp_path / "ds", 1)
    split = open_dataset(root)["train"]
    assert split[0]["version"] == 1  # shard 0 and its index are open; shards 1 and 2 not yet
    _write(root, 2, overwrite=True)
    _write(root, 3, overwrite=True)
    seen, errors = set(), []
    for i in range(len(split)):
        try:
            seen.add(int(split[i]["version"]))
        except DatasetRewrittenError as e:
            errors.append(str(e))
    assert seen == {1}
    assert errors and all(REWRITTEN in e and e.endswith("reopen it") for e in errors), errors
    assert {int(s["version"]) for s in open_dataset(root)["train"]} == {3}  # reopened: the new version


def test_a_missing_shard_without_a_rewrite_is_not_called_one(tmp_path):
    root = _write(tmp_path / "ds")
    split = open_dataset(root)["train"]
    os.unlink(root / split.shards[1].file)
    with pytest.raises(DatasetNotFoundError, match="restore it") as e:
        split[4]  # the first sample of shard 1
    assert not isinstance(e.value, DatasetRewrittenError)


_READER = """
import sys
from crossfeed.errors import DatasetRewrittenError
from crossfeed.read.loader import Loader
loader = Loader(sys.argv[1], batch_size=2, shuffle="none", num_threads=0, executor=sys.argv[2], processes=1)
batches = iter(loader)
print(sorted(set(next(batches)["version"].tolist())), flush=True)
sys.stdin.readline()  # the parent rewrites the dataset twice meanwhile
try:
    for b in batches:
        print(sorted(set(b["version"].tolist())), flush=True)
except DatasetRewrittenError as e:
    print("rewritten:", e, flush=True)
loader.close()
"""


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_a_reader_in_another_process_reads_its_version_or_says_it_was_rewritten(tmp_path, executor):
    root = _write(tmp_path / "ds", 1)
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_READER), str(root), executor],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = proc.stdout.readline()  # EOF if the child fails: never blocks past its end
        assert first.strip() == "[1]", proc.stderr.read()
        _write(root, 2, overwrite=True)
        _write(root, 3, overwrite=True)
        out, err = proc.communicate("go\n", timeout=120)
    finally:
        proc.kill()
        proc.wait(10)
    assert proc.returncode == 0, err[-3000:]
    lines = out.splitlines()
    assert all(line == "[1]" for line in lines[:-1]), lines
    assert lines[-1].startswith("rewritten:") and REWRITTEN in lines[-1] and lines[-1].endswith("reopen it"), lines


def test_worker_processes_started_after_a_rewrite_refuse_the_new_version(tmp_path):
    root = _write(tmp_path / "ds", 1)
    with Loader(root, batch_size=4, shuffle="none", executor="process", processes=1) as loader:
        _write(root, 2, overwrite=True)  # before the first batch: the workers start after it
        with pytest.raises(DatasetRewrittenError, match=REWRITTEN):
            list(loader)


@pytest.mark.parametrize("which", ["shard", "index"])
def test_a_shard_or_index_that_links_out_of_the_dataset_is_refused_unless_allowed(tmp_path, which):
    """A dataset's files are read only inside it: a shard (or its index) replaced by a symbolic
    link to a file elsewhere — a copy of the same bytes, so only the link is wrong — is refused,
    naming the link; allowing the target's directory reads it. A link inside the dataset is fine."""
    root = tmp_path / "ds"
    crossfeed.write_dataset(root, ({"label": i} for i in range(20)), num_shards=2).close()
    shard = open_dataset(root)["train"].shards[0].file
    name = shard if which == "shard" else shard + ".idx"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copy(root / name, outside / name)
    (root / name).unlink()
    (root / name).symlink_to(outside / name)
    with pytest.raises(RootNotAllowedError, match="symbolic link.*outside the dataset"):
        with Loader(root, batch_size=5, shuffle="none") as loader:
            list(loader)
    with Loader(root, batch_size=5, shuffle="none", allowed_roots=[str(outside)]) as loader:
        assert sorted(int(x) for b in loader for x in b["label"]) == list(range(20))
    inside = root / "kept"
    inside.mkdir()
    (root / name).unlink()
    shutil.move(str(outside / name), inside / name)
    (root / name).symlink_to(inside / name)
    with Loader(root, batch_size=5, shuffle="none") as loader:
        assert sorted(int(x) for b in loader for x in b["label"]) == list(range(20))
