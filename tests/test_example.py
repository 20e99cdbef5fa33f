"""The tf.train.Example codec: encode/decode round trips for every list kind and every schema
encoding, plus malformed input. Compatibility with TensorFlow's parser is in test_compat.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crossfeed import example as ex
from crossfeed.errors import ExampleError, SchemaError
from crossfeed.schema import Encoding, Feature, Schema, decode_value, encode_sample, infer_schema

names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)
int64s = st.lists(st.integers(-(2**63), 2**63 - 1), max_size=20)
floats = st.lists(st.floats(width=32, allow_nan=False), max_size=20)
blobs = st.lists(st.binary(max_size=40), max_size=6)
feature_values = st.one_of(
    st.tuples(st.just(ex.INT64), int64s), st.tuples(st.just(ex.FLOAT), floats), st.tuples(st.just(ex.BYTES), blobs))
_ENCODERS = {ex.INT64: ex.encode_int64_list, ex.FLOAT: ex.encode_float_list, ex.BYTES: ex.encode_bytes_list}


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(names, feature_values, max_size=6))
def test_example_round_trip_property(features):
    payload = ex.encode({k: (kind, _ENCODERS[kind](v)) for k, (kind, v) in features.items()})
    got = ex.to_python(payload)
    assert set(got) == set(features)
    for k, (kind, values) in features.items():
        want = [float(np.float32(v)) for v in values] if kind == ex.FLOAT else list(values)
        assert got[k] == want
        decoded_kind, _ = ex.decode(payload)[k]
        assert decoded_kind in ((kind,) if values else (kind, 0))


def test_encoding_is_deterministic_and_key_sorted():
    a = ex.encode({"b": (ex.INT64, ex.encode_int64_list([1])), "a": (ex.FLOAT, ex.encode_float_list([1.0]))})
    b = ex.encode({"a": (ex.FLOAT, ex.encode_float_list([1.0])), "b": (ex.INT64, ex.encode_int64_list([1]))})
    assert a == b and a.index(b"\x0a\x01a") < a.index(b"\x0a\x01b")


def test_unpacked_and_packed_lists_both_decode():
    # int64_list {value: 5 value: -1} unpacked (wire type 0) and float_list with one fixed32 value
    unpacked_int = b"\x08\x05" + b"\x08" + ex._varint(-1)
    assert ex.int64_values(memoryview(unpacked_int)).tolist() == [5, -1]
    assert ex.float_values(memoryview(b"\x0d" + np.float32(2.5).tobytes())).tolist() == [2.5]


@pytest.mark.parametrize("bad", [b"\x0a\x05abc", b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", b"\x0b"])
def test_malformed_examples_raise_example_error(bad):
    with pytest.raises(ExampleError):
        ex.decode(bad)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(["uint8", "int16", "uint32", "int64", "float16", "float32", "float64", "bool"]),
       st.lists(st.integers(1, 4), min_size=0, max_size=3), st.integers(0, 2**32 - 1))
def test_tensor_encoding_round_trip_property(dtype, shape, seed):
    arr = (np.random.default_rng(seed).standard_normal(shape) * 100).astype(dtype)
    fixed = Feature("x", dtype, tuple(shape), Encoding.TENSOR)
    varied = Feature("x", dtype, (None,) * len(shape), Encoding.TENSOR)
    for f in (fixed, varied):
        got = decode_value(f, ex.decode(encode_sample(Schema([f]), {"x": arr})))
        assert got.dtype == arr.dtype and got.shape == arr.shape
        np.testing.assert_array_equal(got, arr)


def test_encode_sample_every_encoding_round_trip():
    sample = {"t": np.arange(6, dtype=">i4").reshape(2, 3), "i": [3, -4], "f": 0.25, "b": b"\x00\xff", "s": "ünï",
              "bl": [b"a", b"bc"], "e": []}
    schema = Schema([Feature("t", "int32", (2, 3), Encoding.TENSOR), Feature("i", "int64", (2,), Encoding.INT64),
                     Feature("f", "float32", (), Encoding.FLOAT), Feature("b", "bytes", (), Encoding.BYTES),
                     Feature("s", "string", (), Encoding.BYTES), Feature("bl", "bytes", (None,), Encoding.BYTES),
                     Feature("e", "float32", (None,), Encoding.FLOAT)])
    parsed = ex.decode(encode_sample(schema, sample))
    got = {f.name: decode_value(f, parsed) for f in schema}
    np.testing.assert_array_equal(got["t"], sample["t"])  # big-endian input stored little-endian
    assert got["i"].tolist() == [3, -4] and got["f"] == np.float32(0.25) and got["f"].shape == ()
    assert got["b"] == b"\x00\xff" and got["s"] == "ünï" and got["bl"] == [b"a", b"bc"]
    assert got["e"].dtype == np.float32 and got["e"].size == 0


def test_schema_mismatch_is_a_schema_error():
    schema = infer_schema([{"x": np.zeros((2, 2), np.float32), "y": 1}])
    with pytest.raises(SchemaError, match="missing"):
        encode_sample(schema, {"x": np.zeros((2, 2), np.float32)})
    with pytest.raises(SchemaError, match="float32"):
        encode_sample(schema, {"x": np.zeros((3, 2), np.float32), "y": 1})
    parsed = ex.decode(encode_sample(schema, {"x": np.zeros((2, 2), np.float32), "y": 1}))
    with pytest.raises(SchemaError, match="int64_list"):
        decode_value(Feature("y", "float32", (), Encoding.FLOAT), parsed)
