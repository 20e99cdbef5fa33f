"""Hostile input at the format trust boundaries (issue 22, second round): tar headers whose
numeric fields carry a sign or junk (they used to loop ``crossfeed index``, the Loader and
``verify`` forever), GZIP shards that inflate far past what the index declared, hostile TFDS
``dataset_info.json``/``features.json`` and Parquet footers. Every case is a real file written by
a real tool (``tarfile``, ``gzip``, pyarrow, the TFDS builder helper) and then damaged; only
`CrossfeedError` subclasses may escape, and at the CLI a one-line error, never a traceback."""

from __future__ import annotations

import gzip
import io
import os
import resource
import struct
import subprocess
import sys
import tarfile
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import crossfeed
from crossfeed.cli.main import EXIT_ERROR
from crossfeed.errors import CorruptRecordError, CrossfeedError
from crossfeed.format import tar, tfrecord
from crossfeed.read.loader import Loader

pytestmark = pytest.mark.timeout(120)  # a parser that loops fails here instead of hanging the suite

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _cli(*args, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "crossfeed.cli.main", *map(str, args)], capture_output=True, text=True, timeout=timeout
    )


def _no_traceback(proc: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


# ---- tar: strict numeric header fields -------------------------------------------------------------


def _member(tf: tarfile.TarFile, name: str, data: bytes = b"", kind=tarfile.REGTYPE) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.size = kind, len(data) if kind == tarfile.REGTYPE else 0
    tf.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


def _sample_tar(extra=None, fmt=tarfile.GNU_FORMAT) -> bytes:
    """A webdataset tar of three samples (``cls`` + ``txt``) written by ``tarfile``; ``extra``
    adds members after the first sample."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for i in range(3):
            _member(tf, f"s{i}.cls", str(i).encode())
            _member(tf, f"s{i}.txt", f"text {i}".encode())
            if i == 0 and extra:
                extra(tf)
    return buf.getvalue()


def _headers(data: bytes) -> list[int]:
    """Offsets of the tar's headers, found by ``tarfile`` (an independent reader)."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        return [m.offset for m in tf.getmembers()]


def _rewrite(data: bytes, at: int, lo: int, hi: int, value: bytes) -> bytes:
    """``data`` with the header at ``at``'s bytes ``[lo, hi)`` set to ``value`` (NUL-padded) and
    its checksum recomputed, so only the field's own parse can refuse it."""
    block = bytearray(data[at : at + 512])
    block[lo:hi] = value.ljust(hi - lo, b"\0")[: hi - lo]
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    return data[:at] + bytes(block) + data[at + 512 :]


def _pax_header(records: dict[str, str]) -> bytes:
    """A pax extended header (type ``x``) carrying ``records``, built by hand: ``tarfile`` would
    refuse to write a hostile value."""
    body = b""
    for k, v in records.items():
        text = f" {k}={v}\n".encode()
        n = len(text) + len(str(len(text)))
        n += len(str(n)) - len(str(len(text)))  # the length counts its own digits
        body += str(n).encode() + text
    info = tarfile.TarInfo("PaxHeaders/x")
    info.type, info.size = tarfile.XHDTYPE, len(body)
    return info.tobuf(format=tarfile.USTAR_FORMAT) + body + bytes(-len(body) % 512)


def _write(root, data: bytes, name: str = "shard-000000.tar"):
    root.mkdir(exist_ok=True)
    (root / name).write_bytes(data)
    return root / name


NEGATIVE = b"-0000001000"  # int(text, 8) == -512: one block back, onto the same header


@pytest.mark.parametrize(
    "entry",
    [
        pytest.param(lambda tf: _member(tf, "s0/", kind=tarfile.DIRTYPE), id="directory"),
        pytest.param(lambda tf: _member(tf, "README", b"no dot here"), id="dotless-name"),
        pytest.param(lambda tf: _member(tf, "s0.json", b"{}"), id="sample-member"),
    ],
)
def test_a_negative_size_field_is_refused_by_index(tmp_path, entry):
    data = _sample_tar(entry)
    at = _headers(data)[2]  # the extra member's header (after s0.cls and s0.txt)
    path = _write(tmp_path / "d", _rewrite(data, at, 124, 136, NEGATIVE))
    out = _cli("index", tmp_path / "d")
    assert out.returncode == EXIT_ERROR, out.stderr
    _no_traceback(out)
    assert f"{path}: corrupt record at byte offset {at}" in out.stderr and "size field" in out.stderr
    with pytest.raises(CorruptRecordError, match="not octal digits") as e:
        tar.sample_ranges(path.read_bytes(), str(path), lambda k, g: None)
    assert e.value.offset == at


@pytest.mark.parametrize("size", ["-1536", "+512", " 512", "5_12", "0x200", "١٢", "99999999999999999999999"])
def test_a_hostile_pax_size_is_refused(tmp_path, size):
    def extra(tf):
        tf.fileobj.write(_pax_header({"size": size}))
        tf.offset += len(_pax_header({"size": size}))
        _member(tf, "s0.json", b"x" * 600)

    data = _sample_tar(extra)
    path = _write(tmp_path / "d", data)
    with pytest.raises(CorruptRecordError, match="pax size"):
        tar.sample_ranges(data, str(path), lambda k, g: None)
    out = _cli("index", tmp_path / "d")
    assert out.returncode == EXIT_ERROR and "pax size" in out.stderr, out.stderr
    _no_traceback(out)


def test_a_header_rewritten_after_indexing_is_refused_by_loader_and_verify(tmp_path):
    data = _sample_tar()
    path = _write(tmp_path / "d", data)
    assert _cli("index", tmp_path / "d").returncode == 0
    at = _headers(data)[3]  # s1.txt, inside the second sample's indexed range
    path.write_bytes(_rewrite(data, at, 124, 136, NEGATIVE))
    with Loader(tmp_path / "d", batch_size=3, shuffle="none") as loader, pytest.raises(CorruptRecordError) as e:
        list(loader)
    assert e.value.path == str(path) and e.value.offset == at and "size field" in e.value.reason
    ver = _cli("verify", tmp_path / "d")
    assert ver.returncode == 1 and f"BAD {path}: byte offset {at}: tar header's size field" in ver.stderr, ver.stderr
    _no_traceback(ver)


def _check_walk(data: bytes) -> None:
    """Walk a tar as index and the Loader do; only `CrossfeedError` may escape, and every
    member must lie inside the buffer, each after the one before."""
    got = []
    try:
        for m in tar.members(data, 0, len(data), "fuzz.tar"):
            assert m.start >= (got[-1].end if got else 0) and 0 <= m.size and m.data + m.size <= len(data)
            got.append(m)
            assert len(got) <= len(data) // 512
        for o, n in tar.sample_ranges(data, "fuzz.tar", lambda k, g: None):
            tar.read_sample(data, o, n, "fuzz.tar")
    except CrossfeedError:
        pass


_FIELD_BYTES = st.one_of(
    st.binary(max_size=12),
    st.text("01234567 -+_\0x", max_size=12).map(str.encode),
    st.tuples(st.sampled_from([b"\x80", b"\xff", b"\xc0"]), st.binary(min_size=11, max_size=11)).map(b"".join),
)


@FUZZ
@given(
    which=st.integers(0, 5), field=st.sampled_from([(124, 136), (148, 156), (0, 100), (156, 157)]), value=_FIELD_BYTES
)
def test_fuzzed_tar_header_fields(which, field, value):
    data = _sample_tar(lambda tf: _member(tf, "dir/", kind=tarfile.DIRTYPE))
    at = _headers(data)[which]
    lo, hi = field
    damaged = _rewrite(data, at, lo, hi, value) if field != (148, 156) else _raw(data, at + lo, value, hi - lo)
    _check_walk(damaged)


def _raw(data: bytes, at: int, value: bytes, width: int) -> bytes:
    return data[:at] + value.ljust(width, b"\0")[:width] + data[at + width :]


@FUZZ
@given(
    body=st.one_of(
        st.binary(max_size=64),
        st.lists(st.tuples(st.text("0123456789 -+_", max_size=4), st.text(max_size=8)), max_size=4).map(
            lambda rs: "".join(f"{n} size={v}\n" for n, v in rs).encode()
        ),
    )
)
def test_fuzzed_pax_records(body):
    info = tarfile.TarInfo("PaxHeaders/x")
    info.type, info.size = tarfile.XHDTYPE, len(body)
    pax = info.tobuf(format=tarfile.USTAR_FORMAT) + body + bytes(-len(body) % 512)
    _check_walk(pax + _sample_tar())


# ---- GZIP: inflation bounded by the index, or streamed --------------------------------------------

LIMIT_AS = 1 << 30  # the address space a hostile read runs in: the bombs inflate to twice that
BOMB_BYTES = 2 << 30


def _zeros_members(total: int) -> bytes:
    """``total`` zero bytes as concatenated GZIP members (what ``gzip`` reads as one stream):
    a few KiB of file per 16 MiB of zeros."""
    member = gzip.compress(bytes(16 << 20), compresslevel=9)
    return member * (total // (16 << 20))


def _limited(argv: list[str], **kw) -> subprocess.CompletedProcess:
    """``argv`` in a child whose address space is capped at `LIMIT_AS`."""

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (LIMIT_AS, LIMIT_AS))

    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    return subprocess.run(argv, preexec_fn=cap, env=env, capture_output=True, text=True, timeout=120, **kw)


@pytest.fixture
def gz_dataset(tmp_path):
    """A dataset of GZIP shards written by crossfeed; its first shard then replaced by the same
    records followed by 2 GiB of zeros (a bomb its index knows nothing of)."""
    root = tmp_path / "gz"
    crossfeed.write_dataset(
        root, [{"x": os.urandom(300), "y": i} for i in range(40)], num_shards=2, compress=True
    ).close()
    shard = root / "train-00000-of-00002.tfrecord.gz"
    with gzip.open(shard, "rb") as f:
        stream = f.read()
    shard.write_bytes(gzip.compress(stream) + _zeros_members(BOMB_BYTES))
    return root, shard, len(stream)


LOADER_UNDER_CAP = """
import sys
from crossfeed.errors import CrossfeedError
from crossfeed.read.loader import Loader
try:
    with Loader(sys.argv[1], batch_size=4, shuffle="none", num_threads=1) as loader:
        n = sum(len(b["y"]) for b in loader)
    print("read", n)
except CrossfeedError as e:
    print(type(e).__name__, e)
"""


def test_a_gzip_bomb_is_refused_by_the_loader_at_the_length_its_index_declares(gz_dataset):
    root, shard, stream_len = gz_dataset
    out = _limited([sys.executable, "-c", LOADER_UNDER_CAP, str(root)])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith(f"CorruptRecordError {shard}: corrupt record at byte offset {stream_len}:"), out.stdout
    assert f"inflates past the {stream_len} bytes its index declares" in out.stdout


@pytest.mark.slow
def test_a_gzip_bomb_is_streamed_by_verify(gz_dataset):
    root, shard, stream_len = gz_dataset
    out = _limited([sys.executable, "-m", "crossfeed.cli.main", "verify", str(root)])
    _no_traceback(out)
    assert out.returncode == 1, out.stderr[-3000:]
    assert f"BAD {shard}: byte offset {stream_len}: length CRC mismatch" in out.stderr, out.stderr


def _example_frames(tmp_path) -> bytes:
    """Five framed ``tf.train.Example`` records, as crossfeed's writer frames them."""
    crossfeed.write_dataset(tmp_path / "plain", [{"x": b"abc", "y": i} for i in range(5)], num_shards=1).close()
    return (tmp_path / "plain" / "train-00000-of-00001.tfrecord").read_bytes()


@pytest.mark.parametrize("prefix", ["none", "records"])
def test_a_gzip_bomb_is_streamed_by_index(tmp_path, prefix):
    """``crossfeed index`` has no index to bound the stream by: it walks it record by record."""
    root = tmp_path / "adopt"
    root.mkdir()
    frames = _example_frames(tmp_path) if prefix == "records" else b""
    (root / "data-00000-of-00001.tfrecord").write_bytes(gzip.compress(frames) + _zeros_members(BOMB_BYTES))
    out = _limited([sys.executable, "-m", "crossfeed.cli.main", "index", str(root)])
    _no_traceback(out)
    assert out.returncode == EXIT_ERROR, out.stderr[-3000:]
    assert f"corrupt record at byte offset {len(frames)}: length CRC mismatch" in out.stderr, out.stderr


def test_a_record_claiming_more_than_a_stream_may_hold_is_refused_before_it_is_read(tmp_path):
    head = struct.pack("<Q", BOMB_BYTES)
    frames = _example_frames(tmp_path) + head + struct.pack("<I", tfrecord.masked_crc(head))
    root = tmp_path / "adopt"
    root.mkdir()
    (root / "data-00000-of-00001.tfrecord").write_bytes(gzip.compress(frames) + _zeros_members(BOMB_BYTES))
    out = _limited([sys.executable, "-m", "crossfeed.cli.main", "index", str(root)])
    _no_traceback(out)
    assert out.returncode == EXIT_ERROR and f"a record of {BOMB_BYTES} bytes" in out.stderr, out.stderr


@FUZZ
@given(cut=st.integers(0, 400), flip=st.integers(0, 400), junk=st.binary(max_size=16))
def test_fuzzed_gzip_streams_inflate_like_gzip_or_fail_as_crossfeed_errors(cut, flip, junk):
    """`tfrecord.inflate` against ``gzip.decompress`` (an independent inflater) on damaged,
    truncated and concatenated streams: the same bytes, or a `CorruptRecordError`."""
    good = gzip.compress(b"".join(tfrecord.frame(b"r%d" % i) for i in range(20))) * 2
    data = bytearray(good[: len(good) - cut] + junk)
    if flip < len(data):
        data[flip] ^= 0x55
    data = bytes(data)
    try:
        want = gzip.decompress(data)
    except (OSError, EOFError, zlib.error):
        want = None
    try:
        got = b"".join(tfrecord.inflate(io.BytesIO(data).read, "f.gz"))
    except CorruptRecordError:
        got = None
    if want is not None and got is not None:
        assert got == want
    assert got is not None or want is None or data.rstrip(b"\0") != data  # refused only what gzip refuses
