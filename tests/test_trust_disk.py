"""Data at rest that crossfeed did not write, or that changed after it did: names confined to
the dataset root, index checksums, damaged GZIP shards, malformed manifests, file permissions,
writes that never mix two datasets, and a `verify` that reads as fast as the Loader."""

from __future__ import annotations

import gzip
import json
import os
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from typer.testing import CliRunner

import crossfeed
from crossfeed.cli.main import app
from crossfeed.errors import ConfigError, CorruptRecordError, CrossfeedError, IndexFileError, ManifestError
from crossfeed.format import index as idx
from crossfeed.format import tfrecord
from crossfeed.format.manifest import MANIFEST
from crossfeed.read.loader import Loader
from crossfeed.read.tools.verify import verify_dataset


def _write(root, n=12, shards=2, **kw):
    samples = [{"x": np.full(4, i, np.float32), "y": i} for i in range(n)]
    crossfeed.write_dataset(root, samples, num_shards=shards, **kw).close()
    return root


def _manifest(root) -> dict:
    return json.loads((root / MANIFEST).read_text())


def _save(root, m: dict) -> None:
    (root / MANIFEST).write_text(json.dumps(m))


# ---- 7: names confined to the root ---------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "../other/x.tfrecord",
        "/dev/zero",
        "/etc/passwd",
        "sub/x.tfrecord",
        "..",
        ".",
        ".tmp-x.tfrecord",
        "crossfeed.json",
        "a.tfrecord.idx",
        "a\x00b",
        "a\\..\\b",
        "",
    ],
)
def test_manifest_names_outside_the_root_are_refused(tmp_path, name):
    root = _write(tmp_path / "d")
    m = _manifest(root)
    m["splits"]["train"]["shards"][0]["file"] = name
    _save(root, m)
    with pytest.raises(ManifestError, match=r"splits\.train\.shards\[0\]\.file"):
        crossfeed.open_dataset(root)
    result = CliRunner().invoke(app, ["verify", str(root)])  # one line, exit 2, no hang on /dev/zero
    assert result.exit_code == 2 and "splits.train.shards[0].file" in result.stderr


def test_a_write_never_deletes_outside_the_root(tmp_path):
    outside = tmp_path / "other"
    outside.mkdir()
    victim = outside / "x.tfrecord"
    victim.write_bytes(b"precious")
    (outside / "x.tfrecord.idx").write_bytes(b"precious")
    root = _write(tmp_path / "d")
    m = _manifest(root)
    m["splits"]["train"]["shards"][0]["file"] = "../other/x.tfrecord"
    _save(root, m)
    with pytest.raises(ManifestError):
        _write(root)
    _write(root, overwrite=True)  # replaces the unreadable dataset, deletes nothing it cannot vouch for
    assert victim.read_bytes() == b"precious" and (outside / "x.tfrecord.idx").read_bytes() == b"precious"
    assert len(crossfeed.open_dataset(root)["train"]) == 12


def test_verify_reports_a_fifo_or_device_shard_instead_of_hanging(tmp_path):
    root = _write(tmp_path / "d", shards=3)
    shard = root / "train-00000-of-00003.tfrecord"
    shard.unlink()
    os.mkfifo(shard)
    (root / "train-00001-of-00003.tfrecord").unlink()
    os.symlink("/dev/zero", root / "train-00001-of-00003.tfrecord")
    index = root / "train-00002-of-00003.tfrecord.idx"
    index.unlink()
    os.mkfifo(index)  # a FIFO where an index should be
    code = textwrap.dedent(f"""
        from crossfeed.read.tools.verify import verify_dataset
        for p in verify_dataset({str(root)!r}):
            print(p)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("not a regular file") == 3, out.stdout
    code = textwrap.dedent(f"""
        import crossfeed
        from crossfeed.read.loader import Loader
        with crossfeed.open_dataset({str(root)!r}) as ds:
            for shard in range(3):
                try:
                    ds["train"].index(shard)
                except crossfeed.CrossfeedError as e:
                    print(type(e).__name__, e)
        try:
            with Loader({str(root)!r}, batch_size=4, shuffle="none") as loader:
                list(loader)
        except crossfeed.CrossfeedError as e:
            print("loader", type(e).__name__)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120, text=True)
    assert out.returncode == 0, out.stderr  # the readers never open a FIFO or a device either
    assert out.stdout.count("not a regular file") == 3 and "loader CorruptRecordError" in out.stdout, out.stdout


# ---- 9: index checksums --------------------------------------------------------------------------


def _duplicate_a_record(root):
    """Point entry 1 of shard 0 at record 2 (a valid record): one sample twice, another never."""
    path = idx.index_path(root / "train-00000-of-00002.tfrecord")
    entries = idx.read_index(path)
    entries[1] = entries[2]
    idx.write_index(path, entries.tolist())
    return path


@pytest.mark.parametrize("with_checksum", [True, False])
def test_an_edited_index_is_caught_with_or_without_a_checksum(tmp_path, with_checksum):
    root = _write(tmp_path / "d")
    m = _manifest(root)
    assert all("index_sha256" in sh for sh in m["splits"]["train"]["shards"])
    if not with_checksum:  # a manifest of an older crossfeed: the entries are cross-checked instead
        for sh in m["splits"]["train"]["shards"]:
            del sh["index_sha256"]
        _save(root, m)
        assert len(crossfeed.open_dataset(root)["train"]) == 12  # older manifests still load
    path = _duplicate_a_record(root)
    with crossfeed.open_dataset(root) as ds:
        with pytest.raises(IndexFileError, match="entry") as e:
            ds["train"][0]
    assert str(path) in str(e.value)
    with pytest.raises(IndexFileError, match=str(path)):
        with Loader(root, batch_size=4, shuffle="none") as loader:
            list(loader)
    problems = verify_dataset(root)
    assert problems and {p.file for p in problems} == {str(path)}


def test_an_index_rewritten_consistently_is_caught_by_its_checksum(tmp_path):
    root = _write(tmp_path / "d")
    path = idx.index_path(root / "train-00000-of-00002.tfrecord")
    path_text = open(path).read()
    with open(path, "w") as f:  # the same entries, other spacing: only the checksum can tell
        f.write(path_text.replace(" ", "  "))
    with pytest.raises(IndexFileError, match="index_sha256"):
        crossfeed.open_dataset(root)["train"][0]
    assert [p.file for p in verify_dataset(root)] == [str(path)]


def test_adopted_datasets_carry_index_checksums(tmp_path):
    from crossfeed.write.adopt.index import index_dataset

    root = tmp_path / "a"
    root.mkdir()
    from crossfeed.format.encode import encoder_for
    from crossfeed.format.schema import infer_schema

    enc = encoder_for(infer_schema([{"v": 1}]))
    with tfrecord.RecordWriter(root / "data.tfrecord") as w:
        for i in range(5):
            w.write(enc.encode({"v": i}))
    manifest = index_dataset(root)
    assert all(sh.index_sha256 for s in manifest.splits.values() for sh in s.shards)
    _duplicate_a_record_in(root / "data.tfrecord")
    with pytest.raises(IndexFileError):
        crossfeed.open_dataset(root)["train"][0]


def _duplicate_a_record_in(shard):
    path = idx.index_path(shard)
    entries = idx.read_index(path)
    entries[1] = entries[2]
    idx.write_index(path, entries.tolist())


# ---- 10: damaged GZIP shards ---------------------------------------------------------------------


def test_gzip_bit_flips_are_corrupt_record_errors_everywhere(tmp_path):
    root = _write(tmp_path / "g", n=40, shards=1, compress=True)
    shard = root / "train-00000-of-00001.tfrecord.gz"
    good = shard.read_bytes()
    rng = np.random.default_rng(0)
    for trial in range(40):
        data = bytearray(good)
        at = int(rng.integers(10, len(data)))
        data[at] ^= 1 << int(rng.integers(0, 8))
        shard.write_bytes(bytes(data))
        try:
            gzip.decompress(bytes(data))
        except Exception:
            pass
        else:
            continue  # the flip left a valid stream (a CRC of the record frames then catches it, or not)
        with crossfeed.open_dataset(root) as ds:
            with pytest.raises(CorruptRecordError, match=str(shard.name)):
                ds["train"][0]
        for on_error in ("raise", "skip"):
            with pytest.raises(CrossfeedError):
                with Loader(root, batch_size=8, shuffle="none", on_error=on_error) as loader:
                    list(loader)
        problems = verify_dataset(root)
        assert problems and all(p.file.removesuffix(".idx") == str(shard) for p in problems), trial
    result = CliRunner().invoke(app, ["verify", str(root)])
    assert result.exit_code in (1, 2) and "Traceback" not in result.output and str(shard) in result.stderr


# ---- 11: malformed manifests ---------------------------------------------------------------------

MALFORMED = [
    (lambda m: m["splits"]["train"]["shards"][0].__setitem__("num_records", 1e15), r"shards\[0\]\.num_records"),
    (lambda m: m["splits"]["train"]["shards"][0].__setitem__("num_records", 10**15), r"shards\[0\]\.num_records"),
    (lambda m: m["splits"]["train"]["shards"][0].__setitem__("num_bytes", -1), r"shards\[0\]\.num_bytes"),
    (
        lambda m: m["splits"]["train"]["shards"].append(dict(m["splits"]["train"]["shards"][0])),
        r"shards\[2\]\.file.*twice",
    ),
    (lambda m: m.__setitem__("schema", []), r"schema: no features"),
    (lambda m: m["schema"][0].__setitem__("shape", [-8]), r"schema\[0\]\.shape\[0\]"),
    (lambda m: m["schema"][0].__setitem__("dtype", "object"), r"schema\[0\]\.dtype"),
    (lambda m: m["schema"][0].__setitem__("encoding", "pickle"), r"schema\[0\]\.encoding"),
    (lambda m: m["schema"].append(dict(m["schema"][0])), r"schema\[2\]\.name.*twice"),
    (lambda m: m.__setitem__("splits", []), r"splits: expected an object"),
    (lambda m: m["splits"]["train"].__setitem__("shards", {"a": 1}), r"splits\.train\.shards"),
    (lambda m: m["splits"]["train"]["shards"][1].__setitem__("sha256", "zz"), r"shards\[1\]\.sha256"),
    (lambda m: m["splits"]["train"]["shards"][1].__setitem__("index_sha256", 5), r"shards\[1\]\.index_sha256"),
    (lambda m: m["splits"]["train"].__setitem__("num_records", 3), r"splits\.train\.num_records"),
    (lambda m: m.__setitem__("metadata", json.loads("[" * 100 + "]" * 100)), r"metadata"),
]


@pytest.mark.parametrize("mutate,field", MALFORMED, ids=[f for _, f in MALFORMED])
def test_malformed_manifests_are_manifest_errors_naming_the_field(tmp_path, mutate, field):
    root = _write(tmp_path / "d")
    m = _manifest(root)
    mutate(m)
    _save(root, m)
    with pytest.raises(ManifestError, match=field):
        crossfeed.open_dataset(root)
    result = CliRunner().invoke(app, ["verify", str(root)])
    assert result.exit_code == 2 and result.stderr.startswith("error: ")


@pytest.mark.parametrize("text", [b"\xff\xfe{}", b"[" * 100_000, b"{" * 100_000, b"null", b'{"format": 1}'])
def test_unparseable_manifests_are_manifest_errors(tmp_path, text):
    root = _write(tmp_path / "d")
    (root / MANIFEST).write_bytes(text)
    with pytest.raises(ManifestError):
        crossfeed.open_dataset(root)


# ---- 12: permissions -----------------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_dataset_files_follow_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        root = _write(tmp_path / "d")
    finally:
        os.umask(old)
    for name in os.listdir(root):
        assert stat.S_IMODE(os.stat(root / name).st_mode) == 0o666 & ~umask, name


def test_keygen_secret_keys_are_private_from_the_start(tmp_path):
    from crossfeed.net.keys import ServerKeys, keygen

    old = os.umask(0)  # even with the most permissive umask
    try:
        public, secret = keygen(tmp_path / "k", "server")
        keygen(tmp_path / "k", "client")
    finally:
        os.umask(old)
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(public.stat().st_mode) == 0o644
    with pytest.raises(ConfigError, match="exists"):
        keygen(tmp_path / "k", "server")
    keys_dir = tmp_path / "k"
    os.chmod(keys_dir, 0o700)
    assert ServerKeys.from_dir(keys_dir).allowed
    for mode in (0o770, 0o707, 0o1777):
        os.chmod(keys_dir, mode)
        with pytest.raises(ConfigError, match="writable by .*chmod go-w"):
            ServerKeys.from_dir(keys_dir)
    os.chmod(keys_dir, 0o700)
    os.chmod(keys_dir / "client.key", 0o666)
    with pytest.raises(ConfigError, match="client key file"):
        ServerKeys.from_dir(keys_dir)


# ---- A: never two datasets in one directory ------------------------------------------------------


def test_writes_refuse_existing_datasets_and_foreign_directories(tmp_path):
    root = _write(tmp_path / "d")
    with pytest.raises(ConfigError, match="already holds a dataset.*overwrite"):
        _write(root, n=3, split="validation")
    foreign = tmp_path / "f"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not empty"):
        _write(foreign)
    assert os.listdir(foreign) == ["notes.txt"]
    _write(foreign, overwrite=True)  # overwrite writes beside foreign files, never deletes them
    assert (foreign / "notes.txt").read_text() == "mine"
    with pytest.raises(ConfigError, match="not both"):
        _write(root, overwrite=True, add_split=True)


def test_convert_cli_refuses_an_existing_dataset_without_overwrite(tmp_path):
    pytest.importorskip("apache_beam")
    np.save(tmp_path / "x.npy", np.arange(20, dtype=np.int64))
    out = tmp_path / "out"
    runner = CliRunner()
    first = runner.invoke(app, ["convert", "numpy", str(tmp_path / "x.npy"), str(out), "--no-verify"])
    assert first.exit_code == 0, first.output
    again = runner.invoke(app, ["convert", "numpy", str(tmp_path / "x.npy"), str(out), "--no-verify"])
    assert again.exit_code != 0 and "overwrite" in str(again.exception or "") + again.output
    replaced = runner.invoke(app, ["convert", "numpy", str(tmp_path / "x.npy"), str(out), "--no-verify", "--overwrite"])
    assert replaced.exit_code == 0, replaced.output
    assert len(crossfeed.open_dataset(out)["train"]) == 20


# ---- B: verify -----------------------------------------------------------------------------------


@pytest.mark.parametrize("compress", [False, True])
def test_verify_reports_progress_and_catches_a_record_that_breaks_the_schema(tmp_path, compress, monkeypatch):
    import crossfeed.read.tools.verify as verify_mod

    monkeypatch.setattr(verify_mod, "CHUNK_BYTES", 200)  # many chunks on tiny data
    root = _write(tmp_path / "d", n=60, shards=3, compress=compress)
    calls = []
    assert verify_dataset(root, progress=lambda done, total: calls.append((done, total))) == []
    total = sum(s.num_bytes for s in crossfeed.open_dataset(root).splits["train"].shards)
    assert calls[-1] == (total, total) and all(t == total for _, t in calls)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls) and len(calls) > 3
    # A record with valid CRCs whose float feature holds 5 values instead of 4: only decoding sees it.
    from crossfeed.format.schema import Encoding, Feature, Schema

    loose = Schema([Feature("x", "float32", (None,), Encoding.FLOAT), Feature("y", "int64", (), Encoding.INT64)])
    from crossfeed.format.encode import encoder_for

    bad = encoder_for(loose).encode({"x": np.zeros(5, np.float32), "y": 7})
    name = f"train-00001-of-00003.tfrecord{'.gz' if compress else ''}"
    stream = bytearray(tfrecord.read_bytes(root / name))
    entries = idx.read_index(idx.index_path(root / name))
    off, n = (int(v) for v in entries[5])
    assert len(tfrecord.frame(bad)) != n  # a different length: the stream and index change around it
    new = bytes(stream[:off]) + tfrecord.frame(bad) + bytes(stream[off + n :])
    (root / name).write_bytes(gzip.compress(new) if compress else new)
    ends = np.cumsum([len(tfrecord.frame(bad)) if i == 5 else int(e[1]) for i, e in enumerate(entries)])
    idx.write_index(
        idx.index_path(root / name),
        [
            (int(e - n), int(n))
            for e, n in zip(ends, [len(tfrecord.frame(bad)) if i == 5 else int(x[1]) for i, x in enumerate(entries)])
        ],
    )
    problems = verify_dataset(root)
    schema_problems = [p for p in problems if "schema" in p.reason]
    assert (
        len(schema_problems) == 1 and schema_problems[0].offset == off and schema_problems[0].file == str(root / name)
    )
