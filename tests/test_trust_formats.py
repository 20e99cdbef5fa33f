"""Hostile input at the format trust boundaries (issue 22, second round): tar headers whose
numeric fields carry a sign or junk (they used to loop ``crossfeed index``, the Loader and
``verify`` forever), GZIP shards that inflate far past what the index declared, hostile TFDS
``dataset_info.json``/``features.json`` and Parquet footers. Every case is a real file written by
a real tool (``tarfile``, ``gzip``, pyarrow, the TFDS builder helper) and then damaged; only
`CrossfeedError` subclasses may escape, and at the CLI a one-line error, never a traceback."""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crossfeed.cli.main import EXIT_ERROR
from crossfeed.errors import CorruptRecordError, CrossfeedError
from crossfeed.format import tar
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
