"""The tf.train.Example codec: encode/decode round trips for every list kind and every schema
encoding, plus malformed input. Compatibility with TensorFlow's parser is in test_compat.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crossfeed.errors import ExampleError, SchemaError
from crossfeed.format import example as ex
from crossfeed.format.encode import encode_sample
from crossfeed.format.schema import Encoding, Feature, Schema, decode_value, infer_schema

names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)
int64s = st.lists(st.integers(-(2**63), 2**63 - 1), max_size=20)
floats = st.lists(st.floats(width=32, allow_nan=False), max_size=20)
blobs = st.lists(st.binary(max_size=40), max_size=6)
feature_values = st.one_of(
    st.tuples(st.just(ex.INT64), int64s), st.tuples(st.just(ex.FLOAT), floats), st.tuples(st.just(ex.BYTES), blobs)
)
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
@given(
    st.sampled_from(["uint8", "int16", "uint32", "int64", "float16", "float32", "float64", "bool"]),
    st.lists(st.integers(1, 4), min_size=0, max_size=3),
    st.integers(0, 2**32 - 1),
)
def test_tensor_encoding_round_trip_property(dtype, shape, seed):
    arr = (np.random.default_rng(seed).standard_normal(shape) * 100).astype(dtype)
    fixed = Feature("x", dtype, tuple(shape), Encoding.TENSOR)
    varied = Feature("x", dtype, (None,) * len(shape), Encoding.TENSOR)
    for f in (fixed, varied):
        got = decode_value(f, ex.decode(encode_sample(Schema([f]), {"x": arr})))
        assert got.dtype == arr.dtype and got.shape == arr.shape
        np.testing.assert_array_equal(got, arr)


def test_encode_sample_every_encoding_round_trip():
    sample = {
        "t": np.arange(6, dtype=">i4").reshape(2, 3),
        "i": [3, -4],
        "f": 0.25,
        "b": b"\x00\xff",
        "s": "ünï",
        "bl": [b"a", b"bc"],
        "e": [],
    }
    schema = Schema(
        [
            Feature("t", "int32", (2, 3), Encoding.TENSOR),
            Feature("i", "int64", (2,), Encoding.INT64),
            Feature("f", "float32", (), Encoding.FLOAT),
            Feature("b", "bytes", (), Encoding.BYTES),
            Feature("s", "string", (), Encoding.BYTES),
            Feature("bl", "bytes", (None,), Encoding.BYTES),
            Feature("e", "float32", (None,), Encoding.FLOAT),
        ]
    )
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


# ---- compiled encoder (schema.Encoder) against the reference path ----------------------------------

from crossfeed.format.encode import Encoder, SampleSchemaError, encode_sample_reference, encoder_for  # noqa: E402

_TENSOR_DTYPES = ["uint8", "int16", "int32", "int64", "float16", "float32", "float64", "bool"]
_any_float = st.one_of(
    st.floats(),
    st.floats(width=32),
    st.sampled_from([0.0, -0.0, 1e300, -1e39, 3.4028235e38, 3.4028236e38]),
    st.integers(0, 2**64 - 1).map(lambda b: float(np.uint64(b).view(np.float64))),
)  # NaN payloads
_int64 = st.integers(-(2**63), 2**63 - 1)


def _int_value(shape):
    if shape == ():
        return st.one_of(
            st.integers(-(2**63), 2**64 - 1),
            _int64.map(np.int64),
            st.integers(0, 2**64 - 1).map(np.uint64),
            st.integers(-128, 127).map(np.int8),
            st.booleans(),
        )
    n = shape[0] if shape[0] is not None else None
    lists = st.lists(_int64, min_size=n or 0, max_size=n if n is not None else 5)
    return st.one_of(lists, lists.map(lambda v: np.array(v, dtype=np.int64)), lists.map(tuple))


def _float_value(shape):
    if shape == ():
        return st.one_of(
            _any_float, _any_float.map(np.float64), st.floats(width=32).map(np.float32), st.integers(-1000, 1000)
        )
    n = shape[0] if shape[0] is not None else None
    lists = st.lists(_any_float, min_size=n or 0, max_size=n if n is not None else 5)
    return st.one_of(
        lists, lists.map(lambda v: np.array(v, dtype=np.float64)), lists.map(lambda v: np.array(v, dtype=np.float32))
    )


def _text_value(dtype, shape):
    one = st.text(max_size=300) if dtype == "string" else st.binary(max_size=300)
    mixed = st.one_of(st.text(max_size=20), st.binary(max_size=20))
    return one if shape == () else st.lists(mixed, max_size=4)


@st.composite
def _feature_and_values(draw, name, n):
    enc = draw(st.sampled_from(list(Encoding)))
    if enc is Encoding.INT64 or enc is Encoding.FLOAT:
        shape = draw(st.sampled_from([(), (), (1,), (3,), (None,), (0,)]))
        f = Feature(name, "int64" if enc is Encoding.INT64 else "float32", shape, enc)
        gen = _int_value(shape) if enc is Encoding.INT64 else _float_value(shape)
    elif enc is Encoding.BYTES:
        dtype, shape = draw(st.sampled_from(["bytes", "string"])), draw(st.sampled_from([(), (None,), (2,)]))
        f, gen = Feature(name, dtype, shape, enc), _text_value(dtype, shape)
    elif enc is Encoding.IMAGE:
        f, gen = Feature(name, "uint8", (None, None, 3), enc), st.binary(max_size=200)
    else:
        dtype = draw(st.sampled_from(_TENSOR_DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
        varied = draw(st.booleans())
        f = Feature(name, dtype, tuple(None if varied else d for d in shape), enc)
        order = draw(st.sampled_from("<>="))

        @st.composite
        def gen(draw2):
            seed = draw2(st.integers(0, 2**32 - 1))
            return (np.random.default_rng(seed).standard_normal(shape) * 100).astype(
                np.dtype(dtype).newbyteorder(order)
            )

        gen = gen()
    values = draw(st.lists(gen, min_size=n, max_size=n))
    if f.shape == (0,):  # lists that fit: empty ones
        values = [v[:0] if not isinstance(v, (int, float, np.generic)) else [] for v in values]
    if f.shape == (2,) and f.encoding is Encoding.BYTES:
        values = [list(v[:2]) + [b"x"] * (2 - len(v[:2])) for v in values]
    if f.shape in ((1,), (3,)):
        k = f.shape[0]
        values = [v[:k] if len(v) >= k else v for v in values]
        values = [
            v if len(v) == k else (np.zeros(k, np.asarray(v).dtype) if isinstance(v, np.ndarray) else [0] * k)
            for v in values
        ]
    return f, values


def _column_forms(values):
    yield list(values)
    try:
        arr = np.array(values)
    except (ValueError, OverflowError, TypeError):
        return
    if arr.dtype.kind in "biuf" and arr.shape[:1] == (len(values),):
        yield arr


@st.composite
def _schema_and_columns(draw):
    n = draw(st.integers(1, 6))
    names = draw(
        st.lists(
            st.sampled_from(["a", "b", "a/x", "a.b", "b0", "ü", "lab", "label", "z" * 200]),
            min_size=0,
            max_size=5,
            unique=True,
        )
    )
    feats, cols = [], {}
    for name in names:
        f, values = draw(_feature_and_values(name, n))
        feats.append(f)
        cols[name] = values
    return Schema(feats), cols, n


def _reference_or_error(schema, rows):
    out = []
    for i, r in enumerate(rows):
        try:
            out.append(encode_sample_reference(schema, r))
        except Exception as e:  # noqa: BLE001 - the encoder must raise the same
            return i, e
    return out


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@settings(max_examples=400, deadline=None)
@given(_schema_and_columns())
def test_encoder_bytes_equal_reference_property(case):
    schema, cols, n = case
    enc = Encoder(schema)
    forms = [dict(cols)] + [{**cols, k: arr} for k in cols for arr in list(_column_forms(cols[k]))[1:]]
    for columns in forms:
        rows = [{k: c[i] for k, c in columns.items()} for i in range(n)]
        want = _reference_or_error(schema, rows)
        if isinstance(want, list):
            assert [enc.encode(r) for r in rows] == want
            assert enc.encode_rows(rows) == want
            assert enc.encode_columns(columns, n) == want
            assert enc.encode_batch(columns, n) == want and enc.encode_batch(rows) == want
            assert [encode_sample(schema, r) for r in rows] == want
        else:
            i, err = want
            for call in (lambda: enc.encode_rows(rows), lambda: enc.encode_columns(columns, n)):
                with pytest.raises(type(err)) as got:
                    call()
                if isinstance(err, SchemaError):
                    assert (
                        isinstance(got.value, SampleSchemaError)
                        and got.value.index == i
                        and got.value.reason == str(err)
                    )
                else:
                    assert str(got.value) == str(err)


def test_tabular_columns_vectorised_and_identical():
    rng = np.random.default_rng(1)
    n = 5000
    schema = Schema(
        [
            Feature("id", "int64", (), Encoding.INT64),
            Feature("a", "float32", (), Encoding.FLOAT),
            Feature("b", "float32", (), Encoding.FLOAT),
            Feature("name", "string", (), Encoding.BYTES),
            Feature("label", "int64", (), Encoding.INT64),
            Feature("v", "float32", (3,), Encoding.FLOAT),
            Feature("t", "uint8", (2, 2), Encoding.TENSOR),
        ]
    )
    ids = rng.integers(-(2**63), 2**63 - 1, n)
    ids[:20] = [0, 1, 127, 128, 16383, 16384, -1, -(2**63), 2**63 - 1, 2**35, 300, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    a = rng.normal(size=n) * 1e38
    a[:6] = [np.nan, -np.inf, -0.0, 1e300, 1e-46, 3.4028236e38]
    cols = {
        "id": ids,
        "a": a,
        "b": rng.uniform(size=n).astype(np.float32),
        "name": [f"itém{i}" * (i % 40) for i in range(n)],
        "label": rng.integers(0, 10, n).astype(np.uint8),
        "v": rng.normal(size=(n, 3)),
        "t": rng.integers(0, 255, (n, 2, 2)).astype(np.uint8),
    }
    rows = [{k: c[i] for k, c in cols.items()} for i in range(n)]
    enc = encoder_for(schema)
    with np.errstate(over="ignore"):
        want = [encode_sample_reference(schema, r) for r in rows]
        assert enc.encode_columns(cols) == want
        assert enc.encode_rows(rows) == want
        assert [enc.encode(r) for r in rows] == want
    assert encoder_for(schema) is enc


def test_batch_errors_name_the_first_bad_sample():
    schema = Schema([Feature("x", "float32", (2,), Encoding.FLOAT), Feature("y", "int64", (), Encoding.INT64)])
    rows = [{"x": [1.0, 2.0], "y": 1}, {"x": [1.0, 2.0], "y": [1, 2]}, {"x": [1.0], "y": 3}]
    with pytest.raises(SampleSchemaError) as e:
        encoder_for(schema).encode_rows(rows)
    assert e.value.index == 1 and "feature 'y'" in e.value.reason and "sample 1" in str(e.value)
    rows[1]["y"] = 2
    with pytest.raises(SampleSchemaError, match=r"sample 2: feature 'x': got shape \[1\], the schema says \[2\]"):
        encoder_for(schema).encode_columns({k: [r[k] for r in rows] for k in ("x", "y")})
    with pytest.raises(SampleSchemaError, match="sample 0: sample keys differ"):
        encoder_for(schema).encode_rows([{"x": [1.0, 2.0]}])
    with pytest.raises(SchemaError, match="missing"):
        encoder_for(schema).encode_columns({"x": [[1.0, 2.0]]})


def test_write_dataset_errors_and_stats_unchanged(tmp_path):
    from crossfeed import write_dataset
    from crossfeed.format.stats import FeatureStats
    from crossfeed.write.writer import _add_stats

    schema = Schema([Feature("x", "float32", (), Encoding.FLOAT), Feature("y", "int64", (), Encoding.INT64)])
    samples = [{"x": float(i), "y": i} for i in range(3000)] + [{"x": 1.0, "y": [1, 2]}]
    with pytest.raises(SchemaError, match=r"^sample 3000: feature 'y': got shape \[2\], the schema says \[\]$"):
        write_dataset(tmp_path / "bad", samples, schema=schema)
    assert not any(p.name.endswith(".tfrecord") for p in (tmp_path / "bad").iterdir())

    rng = np.random.default_rng(3)
    cols = {
        "f": rng.normal(size=3000).tolist(),
        "g": rng.normal(size=3000).astype(np.float32),
        "z": [0.0, -0.0] * 1500,
        "n": [np.nan if i % 7 == 0 else float(i) for i in range(3000)],
        "i": rng.integers(-(2**62), 2**62, 3000).tolist(),
        "j": rng.integers(0, 9, 3000),
        "s": ["a"] * 3000,
        "v": [np.arange(i % 3) for i in range(3000)],
    }
    chunk = [{k: c[i] for k, c in cols.items()} for i in range(3000)]
    want: dict = {}
    for s in chunk:
        for k, v in s.items():
            want.setdefault(k, FeatureStats()).add(v)
    got: dict = {}
    for lo in range(0, 3000, 700):
        _add_stats(got, chunk[lo : lo + 700])
    assert list(got) == list(want)
    for k in want:
        assert repr(got[k]) == repr(want[k]), k


@pytest.mark.parametrize("values", [[0], [5], [127], [128], [-1], [2**63 - 1], [-(2**63)], [], [1, 2]])
def test_scalar_value_agrees_with_the_list_parsers(values):
    """The scalar fast path reads packed and unpacked int64 lists and both float forms exactly as
    the general parsers do, and declines (None) anything that is not exactly one value."""
    unsigned = [v & (2**64 - 1) for v in values]
    packed = b"".join(ex.varint(v) for v in unsigned)
    int_regions = [b"\x0a" + ex.varint(len(packed)) + packed, b"".join(b"\x08" + ex.varint(v) for v in unsigned)]
    floats = np.asarray(values[:2], np.float32) / 3
    float_regions = [
        b"\x0a" + ex.varint(4 * len(floats)) + floats.tobytes(),
        b"".join(b"\x0d" + f.tobytes() for f in floats),
    ]
    for kind, regions, parse in ((ex.INT64, int_regions, ex.int64_values), (ex.FLOAT, float_regions, ex.float_values)):
        for region in regions:
            got, want = ex.scalar_value(kind, memoryview(region)), parse(memoryview(region))
            if len(want) == 1:
                assert got == want[0] and got.dtype == want.dtype
            else:
                assert got is None
