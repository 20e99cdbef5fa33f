"""The batch wire format: round trips, zero copy, and hostile input (only WireError comes out)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crossfeed import wire
from crossfeed.errors import ConfigError, CrossfeedError, WireError

pytestmark = pytest.mark.timeout(60)

NUMERIC = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
           "float16", "float32", "float64", "complex64", "complex128"]


def _blobs(frames):
    """What a receiver gets: each frame as its own bytes object."""
    return [f.tobytes() if isinstance(f, np.ndarray) else bytes(f) for f in frames]


def _roundtrip(batch, meta=wire.BatchMeta()):
    return wire.decode(_blobs(wire.encode(batch, meta)))


@pytest.mark.parametrize("dtype", NUMERIC)
@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 3, 4), (1, 0, 2)])
def test_every_numeric_dtype_round_trips(dtype, shape):
    rng = np.random.default_rng(0)
    arr = (rng.random(shape) * 100).astype(dtype)
    _, out = _roundtrip({"a": arr})
    assert out["a"].dtype == np.dtype(dtype)
    assert out["a"].shape == shape
    np.testing.assert_array_equal(out["a"], arr)


def test_bfloat16_round_trips():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    arr = np.linspace(-3, 3, 12, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(3, 4)
    _, out = _roundtrip({"w": arr})
    assert out["w"].dtype == arr.dtype
    np.testing.assert_array_equal(out["w"].astype(np.float32), arr.astype(np.float32))


def test_big_endian_input_arrives_with_the_same_values():
    arr = np.arange(6, dtype=">i4").reshape(2, 3)
    frames = wire.encode({"a": arr})
    assert frames[2].tobytes() == np.arange(6, dtype="<i4").tobytes()
    _, out = wire.decode(_blobs(frames))
    np.testing.assert_array_equal(out["a"], arr)


def test_text_fields_and_metadata_round_trip():
    ids = np.array([7, 3, 11], dtype=np.int64)
    meta = wire.BatchMeta(epoch=4, seq=123456789012, server_id="host-ä:17", sample_ids=ids)
    batch = {
        "img": np.zeros((3, 2, 2, 3), np.uint8),
        "raw": [b"", b"\x00\xff", b"abc"],
        "caption": ["ein Bär", "", "x" * 1000],
        "grid": np.array([["a", "b"], ["c", "dé"]], dtype=object),
        "blobs": np.array([b"1", b"22"], dtype=object),
    }
    got_meta, out = _roundtrip(batch, meta)
    assert (got_meta.epoch, got_meta.seq, got_meta.server_id) == (4, 123456789012, "host-ä:17")
    np.testing.assert_array_equal(got_meta.sample_ids, ids)
    assert list(out) == list(batch)
    assert out["raw"] == batch["raw"] and out["caption"] == batch["caption"]
    assert out["grid"].shape == (2, 2) and out["grid"].tolist() == batch["grid"].tolist()
    assert out["blobs"].tolist() == [b"1", b"22"]


def test_arrays_view_the_received_zmq_frames():
    ctx = zmq.Context()
    try:
        a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        a.bind("inproc://wire-zero-copy")
        b.connect("inproc://wire-zero-copy")
        src = np.arange(200_000, dtype=np.float32).reshape(1000, 200)
        a.send_multipart(wire.encode({"x": src}), copy=False)
        assert b.poll(5000)
        frames = b.recv_multipart(copy=False)
        _, out = wire.decode(frames)
        np.testing.assert_array_equal(out["x"], src)
        assert not out["x"].flags.writeable
        frame_view = np.frombuffer(frames[2].buffer, dtype=np.uint8)
        assert np.shares_memory(out["x"], frame_view)
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()


def test_unsupported_values_raise_wire_error_on_encode():
    with pytest.raises(WireError):
        wire.encode({"d": np.array(["2020-01-01"], dtype="datetime64[D]")})
    with pytest.raises(WireError):
        wire.encode({"mixed": [b"a", "b"]})


def test_limits_are_validated():
    with pytest.raises(ConfigError):
        wire.WireLimits(max_fields=0)


# ---- hostile input --------------------------------------------------------------------------

def _valid_frames():
    meta = wire.BatchMeta(epoch=1, seq=2, server_id="s", sample_ids=np.arange(4))
    return _blobs(wire.encode(
        {"x": np.ones((4, 3), np.float32), "b": np.array([1, 0, 1, 1], bool), "t": ["a", "bb", "", "c"]},
        meta,
    ))


def _header(nfields=1, num_ids=0, magic=wire.MAGIC, version=wire.VERSION, sid=b""):
    return struct.pack("<4sHHqqqHH", magic, version, 0, 0, 0, num_ids, len(sid), nfields) + sid


def _field(name=b"x", kind=0, code=6, dims=(4,)):
    return struct.pack("<H", len(name)) + name + struct.pack("<BBB", kind, code, len(dims)) + \
        np.asarray(dims, "<u8").tobytes()


@pytest.mark.parametrize("frames, match", [
    ([b"xx"], "frames"),
    ([_header(magic=b"NOPE"), b""], "magic"),
    ([_header(version=99), b""], "version"),
    ([_header()[:10], b""], "truncated"),
    ([_header(nfields=1000), b""], "fields"),
    ([_header(num_ids=3), b"\0" * 8], "sample-id"),
    ([_header() + _field(), b"", b"\0" * 5], "needs 4 bytes"),
    ([_header() + _field(code=200), b"", b""], "dtype code"),
    ([_header() + _field(kind=9), b"", b""], "kind"),
    ([_header() + _field(dims=(1,) * 40), b"", b""], "dims"),
    ([_header() + _field(dims=(2**40, 2**40)), b"", b""], "limit"),
    ([_header() + _field(code=1, dims=(2,)), b"", b"\x01\x07"], "bool"),
    ([_header() + _field(name=b"\xff\xfe"), b"", b"\0" * 4], "utf-8"),
    ([_header(nfields=2) + _field() + _field(), b"", b"\0" * 4, b"\0" * 4], "twice"),
    ([_header() + _field() + b"junk", b"", b"\0" * 4], "trailing"),
    ([_header() + _field(), b"", b"\0" * 4, b"extra"], "frames"),
    ([_header() + _field(), b""], "ends before"),
    ([_header() + _field(kind=1, code=0, dims=(2,)), b"", np.array([1, 9], "<u8").tobytes(), b"abc"],
     "add up"),
    ([_header() + _field(kind=1, code=0, dims=(2,)), b"", np.array([2**63, 2**63], "<u8").tobytes(), b"ab"],
     "add up"),
    ([_header() + _field(kind=2, code=0, dims=(1,)), b"", np.array([2], "<u8").tobytes(), b"\xff\xff"],
     "utf-8"),
    ([_header() + _field(kind=1, code=0, dims=(2, 2)), b"", b"", b""], "one dim"),
])
def test_malformed_messages_raise_wire_error(frames, match):
    with pytest.raises(WireError, match=match):
        wire.decode(frames)


def test_oversized_messages_are_refused_before_decoding():
    frames = _valid_frames()
    with pytest.raises(WireError, match="exceeds"):
        wire.decode(frames, wire.WireLimits(max_message_bytes=sum(map(len, frames)) - 1))
    with pytest.raises(WireError, match="frames"):
        wire.decode(frames + [b""] * 600)


def test_every_truncation_of_a_valid_message_is_refused():
    frames = _valid_frames()
    for i, frame in enumerate(frames):
        for cut in range(len(frame)):
            bad = list(frames)
            bad[i] = frame[:cut]
            with pytest.raises(WireError):
                wire.decode(bad)
    for n in range(len(frames)):
        with pytest.raises(WireError):
            wire.decode(frames[:n])


def _decode_only_wire_errors(frames):
    try:
        meta, batch = wire.decode(frames)
    except WireError:
        return
    except Exception as e:  # anything else is a bug
        raise AssertionError(f"decoder leaked {type(e).__name__}: {e}") from e
    assert isinstance(meta, wire.BatchMeta) and isinstance(batch, dict)


_FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_FUZZ
@given(st.lists(st.binary(max_size=200), max_size=8))
def test_fuzz_random_frames(frames):
    _decode_only_wire_errors(frames)


@_FUZZ
@given(st.data())
def test_fuzz_mutated_valid_messages(data):
    frames = [bytearray(f) for f in _valid_frames()]
    for _ in range(data.draw(st.integers(1, 6))):
        action = data.draw(st.sampled_from(["flip", "set", "cut", "grow", "drop", "dup"]))
        i = data.draw(st.integers(0, len(frames) - 1)) if frames else 0
        if not frames:
            break
        f = frames[i]
        if action in ("flip", "set") and f:
            pos = data.draw(st.integers(0, len(f) - 1))
            f[pos] = (f[pos] ^ (1 << data.draw(st.integers(0, 7)))) if action == "flip" else \
                data.draw(st.integers(0, 255))
        elif action == "cut":
            del f[data.draw(st.integers(0, len(f))):]
        elif action == "grow":
            f.extend(data.draw(st.binary(min_size=1, max_size=16)))
        elif action == "drop":
            frames.pop(i)
        elif action == "dup":
            frames.insert(i, bytearray(f))
    _decode_only_wire_errors([bytes(f) for f in frames])


def test_wire_error_is_a_crossfeed_error():
    assert issubclass(WireError, CrossfeedError)


def test_object_arrays_of_same_shaped_numbers_are_sent_as_numbers():
    obj = np.empty(3, dtype=object)
    obj[:] = [np.int64(1), np.int64(5), np.int64(-2)]
    _, out = _roundtrip({"label": obj})
    assert out["label"].dtype == np.int64 and out["label"].tolist() == [1, 5, -2]
    ragged = np.empty(2, dtype=object)
    ragged[0], ragged[1] = np.zeros(2), np.zeros(3)
    with pytest.raises(WireError, match="ragged"):
        wire.encode({"r": ragged})
