"""The batch wire format: round trips, zero copy, and hostile input (only WireError comes out)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crossfeed.errors import ConfigError, CrossfeedError, WireError
from crossfeed.format import wire

pytestmark = pytest.mark.timeout(60)

NUMERIC = [
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
]


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
    return _blobs(
        wire.encode(
            {"x": np.ones((4, 3), np.float32), "b": np.array([1, 0, 1, 1], bool), "t": ["a", "bb", "", "c"]},
            meta,
        )
    )


def _header(nfields=1, num_ids=0, magic=wire.MAGIC, version=wire.VERSION, sid=b""):
    return struct.pack("<4sHHqqqHH", magic, version, 0, 0, 0, num_ids, len(sid), nfields) + sid


def _field(name=b"x", kind=0, code=6, dims=(4,)):
    return (
        struct.pack("<H", len(name))
        + name
        + struct.pack("<BBB", kind, code, len(dims))
        + np.asarray(dims, "<u8").tobytes()
    )


@pytest.mark.parametrize(
    "frames, match",
    [
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
        ([_header() + _field(kind=1, code=0, dims=(2,)), b"", np.array([1, 9], "<u8").tobytes(), b"abc"], "add up"),
        (
            [_header() + _field(kind=1, code=0, dims=(2,)), b"", np.array([2**63, 2**63], "<u8").tobytes(), b"ab"],
            "add up",
        ),
        ([_header() + _field(kind=2, code=0, dims=(1,)), b"", np.array([2], "<u8").tobytes(), b"\xff\xff"], "utf-8"),
        ([_header() + _field(kind=1, code=0, dims=(2, 2)), b"", b"", b""], "one dim"),
    ],
)
def test_malformed_messages_raise_wire_error(frames, match):
    with pytest.raises(WireError, match=match):
        wire.decode(frames)


def test_oversized_messages_are_refused_before_decoding():
    frames = _valid_frames()
    with pytest.raises(WireError, match="exceeds"):
        wire.decode(frames, wire.WireLimits(max_message_bytes=sum(map(len, frames)) - 1))
    with pytest.raises(WireError, match="frames"):
        wire.decode(frames + [b""] * 600)


@pytest.mark.parametrize("make", ["_valid_frames", "_valid_ragged_frames"])
def test_every_truncation_of_a_valid_message_is_refused(make):
    frames = globals()[make]()
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


def _mutate(data, frames: list[bytes]) -> list[bytes]:
    """Up to six random edits of a valid message: bit flips, bytes or whole u64 values replaced,
    frames cut, grown, dropped or duplicated."""
    frames = [bytearray(f) for f in frames]
    for _ in range(data.draw(st.integers(1, 6))):
        if not frames:
            break
        action = data.draw(st.sampled_from(["flip", "set", "cut", "grow", "drop", "dup", "u64"]))
        i = data.draw(st.integers(0, len(frames) - 1))
        f = frames[i]
        if action in ("flip", "set") and f:
            pos = data.draw(st.integers(0, len(f) - 1))
            f[pos] = (
                (f[pos] ^ (1 << data.draw(st.integers(0, 7)))) if action == "flip" else data.draw(st.integers(0, 255))
            )
        elif action == "u64" and len(f) >= 8:  # a whole shape / dim / length replaced
            pos = data.draw(st.integers(0, len(f) - 8))
            f[pos : pos + 8] = _u64(data.draw(st.integers(0, 2**64 - 1) | st.integers(0, 8)))
        elif action == "cut":
            del f[data.draw(st.integers(0, len(f))) :]
        elif action == "grow":
            f.extend(data.draw(st.binary(min_size=1, max_size=16)))
        elif action == "drop":
            frames.pop(i)
        elif action == "dup":
            frames.insert(i, bytearray(f))
    return [bytes(f) for f in frames]


@_FUZZ
@given(st.data())
@pytest.mark.parametrize("make", ["_valid_frames", "_valid_ragged_frames"])
def test_fuzz_mutated_valid_messages(make, data):
    _decode_only_wire_errors(_mutate(data, globals()[make]()))


def test_wire_error_is_a_crossfeed_error():
    assert issubclass(WireError, CrossfeedError)


def test_object_arrays_of_same_shaped_numbers_are_sent_as_numbers():
    obj = np.empty(3, dtype=object)
    obj[:] = [np.int64(1), np.int64(5), np.int64(-2)]
    _, out = _roundtrip({"label": obj})
    assert out["label"].dtype == np.int64 and out["label"].tolist() == [1, 5, -2]
    ragged = np.empty(2, dtype=object)
    ragged[0], ragged[1] = np.zeros(2), np.zeros(3)
    _, out = _roundtrip({"r": ragged})  # ragged fields are sent as RAGGED since wire kind 5
    assert out["r"].dtype == object and [a.shape for a in out["r"]] == [(2,), (3,)]
    ragged[1] = np.zeros(3, np.int64)  # ... but only if their arrays share one dtype
    with pytest.raises(WireError, match="ragged"):
        wire.encode({"r": ragged})


# ---- ragged fields (kind RAGGED: per-item shapes + one data frame) ---------------------------


def _ragged(*arrays):
    """The Loader's form of a feature whose shape varies within the batch."""
    out = np.empty(len(arrays), dtype=object)
    for i, a in enumerate(arrays):
        out[i] = a
    return out


def _assert_ragged_equal(got, want):
    assert isinstance(got, np.ndarray) and got.dtype == object and got.shape == (len(want),)
    for g, w in zip(got, want):
        assert isinstance(g, np.ndarray) and g.dtype == np.asarray(w).dtype and g.shape == np.shape(w)
        np.testing.assert_array_equal(g, w)
        assert not g.flags.writeable


@pytest.mark.parametrize("dtype", ["int64", "float32"])
def test_ragged_lists_round_trip_with_empty_items(dtype):
    tokens = _ragged(*[(np.arange(i % 4) * 3 - 1).astype(dtype) for i in range(9)])
    ids = np.arange(9, dtype=np.int64)
    meta, out = _roundtrip({"tokens": tokens, "id": ids}, wire.BatchMeta(sample_ids=ids))
    _assert_ragged_equal(out["tokens"], tokens)
    np.testing.assert_array_equal(out["id"], ids)
    _, only_empty = _roundtrip({"e": _ragged(np.zeros(0, dtype), np.zeros((0,), dtype))})
    assert only_empty["e"].dtype == np.dtype(dtype) and only_empty["e"].shape == (2, 0)  # equal shapes stack
    _, empty_and_not = _roundtrip({"e": _ragged(np.zeros(0, dtype), np.ones(3, dtype))})
    _assert_ragged_equal(empty_and_not["e"], [np.zeros(0, dtype), np.ones(3, dtype)])


def test_ragged_images_of_different_sizes_round_trip():
    rng = np.random.default_rng(1)
    images = _ragged(*[rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in [(4, 5), (1, 1), (7, 2), (0, 3)]])
    frames = wire.encode({"image": images, "label": np.arange(4)})
    assert len(frames) == 2 + 2 + 1
    shapes = np.frombuffer(frames[2].tobytes(), "<u8").reshape(4, 3)
    assert shapes.tolist() == [[4, 5, 3], [1, 1, 3], [7, 2, 3], [0, 3, 3]]
    assert frames[3].tobytes() == b"".join(a.tobytes() for a in images)
    _, out = wire.decode(_blobs(frames))
    _assert_ragged_equal(out["image"], images)


def test_ragged_lists_of_arrays_and_big_endian_items_round_trip():
    items = [np.arange(3, dtype=">i4"), np.arange(2, dtype="<i4"), np.array([], dtype="i4")]
    _, out = _roundtrip({"r": items})
    assert all(a.dtype == np.dtype("<i4") for a in out["r"])
    assert [a.tolist() for a in out["r"]] == [[0, 1, 2], [0, 1], []]


def test_ragged_items_view_the_received_zmq_data_frame():
    ctx = zmq.Context()
    try:
        a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        a.bind("inproc://wire-ragged-zero-copy")
        b.connect("inproc://wire-ragged-zero-copy")
        src = _ragged(*[np.arange(n * 1000, dtype=np.float32).reshape(n, 1000) for n in (3, 1, 0, 5)])
        a.send_multipart(wire.encode({"x": src}), copy=False)
        assert b.poll(5000)
        frames = b.recv_multipart(copy=False)
        _, out = wire.decode(frames)
        _assert_ragged_equal(out["x"], src)
        data_view = np.frombuffer(frames[3].buffer, dtype=np.uint8)
        assert all(np.shares_memory(item, data_view) for item in out["x"] if item.size)
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()


@pytest.mark.parametrize(
    "items, match",
    [
        ([np.zeros(2, np.int64), np.zeros(3, np.float32)], "dtype"),
        ([np.zeros(2, np.int64), np.zeros((3, 1), np.int64)], "ndim"),
        ([np.zeros(2, "datetime64[D]"), np.zeros(3, "datetime64[D]")], "cannot be sent"),
        ([np.zeros(2, object), np.zeros(3, object)], "cannot be sent"),
    ],
)
def test_mixed_ragged_fields_raise_wire_error_naming_the_field(items, match):
    for value in (_ragged(*items), items):
        with pytest.raises(WireError, match=match) as info:
            wire.encode({"ok": np.zeros(2), "tokens": value})
        assert "'tokens'" in str(info.value)
    with pytest.raises(WireError, match="'grid'"):  # ragged fields are 1-D
        wire.encode({"grid": np.array([[np.zeros(1), np.zeros(2)]] * 2, dtype=object)})


def _ragged_field(name=b"r", code=5, dims=(2, 1)):
    return _field(name=name, kind=wire.RAGGED, code=code, dims=dims)


def _u64(*values):
    return np.array(values, "<u8").tobytes()


@pytest.mark.parametrize(
    "frames, match",
    [
        ([_header() + _ragged_field(dims=(2,)), b"", b"", b""], "2 dims"),
        ([_header() + _ragged_field(dims=(2**30, 1)), b"", b"", b""], "items"),
        ([_header() + _ragged_field(dims=(1, 40)), b"", b"", b""], "dims"),
        ([_header() + _ragged_field(code=200), b"", _u64(1, 1), b"\0" * 16], "dtype code"),
        ([_header() + _ragged_field(), b"", _u64(1), b"\0" * 16], "shape bytes"),
        ([_header() + _ragged_field(), b"", _u64(1, 1), b"\0" * 15], "whole number"),
        ([_header() + _ragged_field(), b"", _u64(1, 2), b"\0" * 16], "need 3"),
        ([_header() + _ragged_field(), b"", _u64(0, 1), b"\0" * 16], "need 1"),
        ([_header() + _ragged_field(), b"", _u64(2**63, 2**63), b"\0" * 16], "limit"),
        ([_header() + _ragged_field(dims=(1, 3)), b"", _u64(2**28, 2**28, 2**28), b"\0" * 16], "more elements"),
        ([_header() + _ragged_field(dims=(1, 2)), b"", _u64(2**28, 0), b"\0" * 16], "need 0"),
        ([_header() + _ragged_field(code=1), b"", _u64(1, 1), b"\x01\x02"], "bool"),
        ([_header() + _ragged_field(), b"", _u64(1, 1)], "ends before"),
        ([_header() + _ragged_field(), b""], "ends before"),
        ([_header() + _field(kind=6), b"", b"", b""], "unknown kind 6"),
    ],
)
def test_malformed_ragged_fields_raise_wire_error(frames, match):
    with pytest.raises(WireError, match=match):
        wire.decode(frames)


def test_ragged_sizes_are_checked_against_the_limits_before_allocating():
    frames = _blobs(wire.encode({"r": _ragged(np.zeros(3), np.zeros(4))}))
    with pytest.raises(WireError, match="items"):
        wire.decode(frames, wire.WireLimits(max_items=1))
    with pytest.raises(WireError, match="dims"):
        wire.decode(_blobs(wire.encode({"r": [np.zeros((1, 1, 1)), np.zeros((1, 2, 1))]})), wire.WireLimits(max_ndim=2))
    assert len(wire.decode(frames, wire.WireLimits(max_items=2))[1]["r"]) == 2


def _valid_ragged_frames():
    meta = wire.BatchMeta(epoch=1, seq=2, server_id="s", sample_ids=np.arange(4))
    return _blobs(
        wire.encode(
            {
                "tokens": _ragged(*[np.arange(i % 3, dtype=np.int64) for i in range(4)]),
                "img": _ragged(
                    np.ones((2, 1, 3), np.uint8),
                    np.zeros((1, 2, 3), np.uint8),
                    np.zeros((0, 2, 3), np.uint8),
                    np.ones((1, 1, 3), np.uint8),
                ),
                "mask": [np.array([True, False]), np.array([True]), np.array([], bool), np.array([False] * 3)],
                "id": np.arange(4),
            },
            meta,
        )
    )


@_FUZZ
@given(st.data())
def test_fuzz_ragged_fields_round_trip(data):
    dtype = np.dtype(data.draw(st.sampled_from(NUMERIC)))
    ndim = data.draw(st.integers(1, 3))
    shapes = data.draw(st.lists(st.tuples(*[st.integers(0, 4)] * ndim), min_size=1, max_size=6))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    items = [(rng.random(shape) * 100).astype(dtype) for shape in shapes]
    _, out = _roundtrip({"r": items, "o": _ragged(*items)})
    _assert_ragged_equal(out["r"], items)
    if len(set(shapes)) > 1:
        _assert_ragged_equal(out["o"], items)
    else:  # an object array of equal shapes is sent as one stacked array
        np.testing.assert_array_equal(out["o"], np.stack(items))


@_FUZZ
@given(
    code=st.integers(0, 20),
    n=st.integers(0, 6),
    ndim=st.integers(0, 4),
    shapes=st.lists(st.integers(0, 2**64 - 1) | st.integers(0, 5), max_size=24),
    data=st.binary(max_size=128),
    extra=st.lists(st.binary(max_size=16), max_size=2),
)
def test_fuzz_random_ragged_messages(code, n, ndim, shapes, data, extra):
    header = _header() + _ragged_field(code=code, dims=(n, ndim))
    _decode_only_wire_errors([header, b"", _u64(*shapes), data, *extra])
