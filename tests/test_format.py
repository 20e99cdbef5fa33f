"""Framing, index files and write_dataset/open_dataset round trips for every encoding."""

from __future__ import annotations

import gzip
import io
import os
import pickle

import numpy as np
import pytest
from conftest import mixed_samples
from PIL import Image

import crossfeed
from crossfeed.errors import ConfigError, CorruptRecordError, SchemaError
from crossfeed.format import index as idx
from crossfeed.format import tfrecord
from crossfeed.format.manifest import MANIFEST
from crossfeed.format.schema import Encoding, Feature, Schema


@pytest.mark.parametrize("compress", [False, True])
def test_record_writer_round_trip(tmp_path, compress):
    payloads = [os.urandom(n) for n in (0, 1, 7, 300, 70_000)] * 3
    path = tmp_path / ("s.tfrecord" + (".gz" if compress else ""))
    with tfrecord.RecordWriter(path, compress=compress) as w:
        for p in payloads:
            w.write(p)
    raw = path.read_bytes()
    assert tfrecord.is_gzip(path) is compress and (raw[:2] == b"\x1f\x8b") is compress
    assert w.num_bytes == len(raw)
    stream = tfrecord.read_bytes(path)
    assert (gzip.decompress(raw) if compress else raw) == stream
    assert [bytes(p) for _, p in tfrecord.records(stream, str(path))] == payloads
    assert list(tfrecord.scan(stream, str(path))) == w.offsets
    for (off, n), p in zip(w.offsets, payloads):
        assert bytes(tfrecord.unframe(stream, off, n, str(path))) == p


def test_gzip_detected_by_content_not_name(tmp_path):
    path = tmp_path / "plainname.tfrecord"
    with tfrecord.RecordWriter(tmp_path / "x.gz", compress=True) as w:
        w.write(b"hello")
    os.replace(tmp_path / "x.gz", path)
    assert tfrecord.is_gzip(path)
    assert [bytes(p) for _, p in tfrecord.records(tfrecord.read_bytes(path), "p")] == [b"hello"]


def test_plain_record_starting_with_gzip_magic_is_not_gzip():
    rec = tfrecord.frame(b"z" * 0x8B1F)  # the length field starts 1f 8b
    assert rec[:2] == b"\x1f\x8b" and not tfrecord.looks_gzip(rec[:12])


def test_frame_layout_and_crc32c_check_value():
    rec = tfrecord.frame(b"abc")
    assert len(rec) == 19 and rec[:8] == (3).to_bytes(8, "little") and rec[12:15] == b"abc"
    assert int.from_bytes(rec[8:12], "little") == tfrecord.masked_crc(rec[:8])
    assert tfrecord.masked_crc(b"") == 0xA282EAD8
    assert tfrecord.masked_crc(b"123456789") == (((0xE3069283 >> 15) | (0xE3069283 << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def test_scan_many_batches_and_errors():
    payloads = [bytes([i % 251]) * (i % 50) for i in range(10_000)]
    buf = b"".join(tfrecord.frame(p) for p in payloads)
    got = list(tfrecord.records(buf, "f", batch=333))
    assert [bytes(p) for _, p in got] == payloads
    bad_at = got[4321][0]
    for pos, reason in ((bad_at + 2, "length CRC"), (bad_at + 9, "length CRC"), (bad_at + 12, "payload CRC")):
        broken = bytearray(buf)
        broken[pos] ^= 0x40
        seen = []
        with pytest.raises(CorruptRecordError, match=reason) as e:
            for off, _ in tfrecord.records(bytes(broken), "f", batch=333):
                seen.append(off)
        assert e.value.offset == bad_at and e.value.path == "f" and len(seen) == 4321
    with pytest.raises(CorruptRecordError, match="truncated") as e:
        list(tfrecord.records(buf[:-1], "f"))
    assert e.value.offset == got[-1][0]


def test_index_file_round_trip(tmp_path):
    offsets = [(0, 16), (16, 116), (132, 20)]
    p = tmp_path / "a.idx"
    idx.write_index(p, offsets)
    assert p.read_text() == "0 16\n16 116\n132 20\n"
    assert idx.read_index(p).tolist() == [list(o) for o in offsets]
    p.write_text("0 16\n5\n")
    with pytest.raises(crossfeed.IndexFileError, match="a.idx"):
        idx.read_index(p)


def _png(arr: np.ndarray) -> bytes:
    b = io.BytesIO()
    Image.fromarray(arr).save(b, format="PNG")
    return b.getvalue()


def _assert_equal(a, b):
    if isinstance(b, (bytes, str)):
        assert a == b
    elif isinstance(b, list) and b and isinstance(b[0], (bytes, str)):
        assert list(a) == b
    else:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        if isinstance(b, np.ndarray):
            assert np.asarray(a).dtype == b.dtype


DTYPES = [
    "uint8",
    "int8",
    "uint16",
    "int16",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "float32",
    "float64",
    "bool",
    "complex64",
]


@pytest.mark.parametrize("compress", [False, True])
def test_write_open_round_trip_every_encoding(tmp_path, compress):
    rng = np.random.default_rng(1)
    pixels = [rng.integers(0, 255, (6, 5, 3), dtype=np.uint8) for _ in range(12)]
    samples = []
    for i in range(12):
        s = {f"t_{d}": (rng.standard_normal((2, 3)) * 50).astype(d) for d in DTYPES}
        s.update(
            var=rng.standard_normal((i % 3 + 1, 4)).astype(np.float32),
            ints=np.arange(i % 5, dtype=np.int64) - 2**62,
            floats=(np.arange(i % 4) / 3).astype(np.float32),
            scalar_i=np.int64(-i),
            scalar_f=np.float32(i * 0.5),
            blob=os.urandom(i),
            text=f"héllo {i}",
            words=[f"w{i}", "x"],
            img=_png(pixels[i]),
        )
        samples.append(s)
    schema = Schema(
        [Feature(f"t_{d}", d, (2, 3), Encoding.TENSOR) for d in DTYPES]
        + [
            Feature("var", "float32", (None, 4), Encoding.TENSOR),
            Feature("ints", "int64", (None,), Encoding.INT64),
            Feature("floats", "float32", (None,), Encoding.FLOAT),
            Feature("scalar_i", "int64", (), Encoding.INT64),
            Feature("scalar_f", "float32", (), Encoding.FLOAT),
            Feature("blob", "bytes", (), Encoding.BYTES),
            Feature("text", "string", (), Encoding.BYTES),
            Feature("words", "string", (2,), Encoding.BYTES),
            Feature("img", "uint8", (6, 5, 3), Encoding.IMAGE),
        ]
    )
    with crossfeed.write_dataset(tmp_path / "d", samples, schema=schema, num_shards=4, compress=compress) as ds:
        assert ds.schema == schema and len(ds["train"]) == 12
        for shard in ds.splits["train"].shards:
            assert shard.file.endswith(".tfrecord.gz" if compress else ".tfrecord")
        for i, s in enumerate(samples):
            got = ds["train"][(i % 4) * 3 + i // 4]  # round-robin: sample i is in shard i % 4
            for k, v in s.items():
                _assert_equal(got[k], pixels[i] if k == "img" else v)
        assert [r["scalar_i"] for r in ds["train"]] == [-i for i in (0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11)]


def test_inferred_schema_and_variable_lists(tmp_path, mixed_dataset):
    root, samples = mixed_dataset
    with crossfeed.open_dataset(root) as ds:
        sch = ds.schema
        assert sch["image"] == Feature("image", "uint8", (4, 5, 3), Encoding.TENSOR)
        assert sch["tokens"].shape == (None,) and sch["label"].shape == ()
        assert sch["name"].dtype == "string"
        got = sorted((r for r in ds["train"]), key=lambda r: r["label"])
        for g, s in zip(got, samples):
            for k in s:
                _assert_equal(g[k], s[k])
        assert ds["train"].info.statistics["label"]["max"] == 29


def test_add_and_replace_splits(tmp_path, mixed_dataset):
    # Changed on purpose: writing into a dataset needs add_split=True (a new split) or overwrite=True
    # (the whole dataset), so splits of two conversions never end up side by side.
    root, samples = mixed_dataset
    with pytest.raises(ConfigError, match="already holds a dataset"):
        crossfeed.write_dataset(root, samples[:5], split="test", num_shards=2)
    crossfeed.write_dataset(root, samples[:5], split="test", num_shards=2, add_split=True).close()
    with crossfeed.open_dataset(root) as ds:
        assert {k: len(ds[k]) for k in ds.splits} == {"train": 30, "test": 5}
    with pytest.raises(ConfigError, match="already has split"):
        crossfeed.write_dataset(root, samples[10:13], split="train", num_shards=1, add_split=True)
    crossfeed.write_dataset(root, samples[10:13], split="train", num_shards=1, overwrite=True).close()
    with crossfeed.open_dataset(root) as ds:
        assert {k: len(ds[k]) for k in ds.splits} == {"train": 3}
        assert [r["label"] for r in ds["train"]] == [10, 11, 12]
    # every commit after the first names its shards with its generation: no name is ever reused
    assert sorted(os.listdir(root)) == sorted(
        [MANIFEST, "train-00000-of-00001.g2.tfrecord", "train-00000-of-00001.g2.tfrecord.idx"]
    )
    with pytest.raises(SchemaError, match="other types"):
        crossfeed.write_dataset(root, [{"other": 1.0}], split="test", add_split=True)
    crossfeed.write_dataset(root, [{"other": 1.0}], split="train", overwrite=True).close()
    assert sorted(os.listdir(root)) == sorted(
        [MANIFEST, "train-00000-of-00001.g3.tfrecord", "train-00000-of-00001.g3.tfrecord.idx"]
    )


def test_failed_write_leaves_nothing(tmp_path, mixed_dataset):
    def boom(n):
        yield from mixed_samples(n)
        raise RuntimeError("source failed")

    fresh = tmp_path / "fresh"
    with pytest.raises(RuntimeError, match="source failed"):
        crossfeed.write_dataset(fresh, boom(20), num_shards=3)
    assert os.listdir(fresh) == []
    with pytest.raises(crossfeed.DatasetNotFoundError):
        crossfeed.open_dataset(fresh)

    root, _ = mixed_dataset  # replacing a split that fails half-way keeps the old one intact
    before = {n: (root / n).read_bytes() for n in os.listdir(root)}
    with pytest.raises(RuntimeError):
        crossfeed.write_dataset(root, boom(7), split="train", shard_size=100, overwrite=True)
    assert {n: (root / n).read_bytes() for n in os.listdir(root)} == before
    with pytest.raises(ConfigError):
        crossfeed.write_dataset(tmp_path / "empty", [])
    assert os.listdir(tmp_path / "empty") == []


@pytest.mark.parametrize("mode", ["L", "LA", "RGB", "RGBA", "P", "I;16", "1"])
@pytest.mark.parametrize("interlace", [False, True])
def test_png_decoding_matches_pillow(mode, interlace):
    """PNGs decoded by libspng (8-bit gray/RGB/alpha) give Pillow's pixels; other kinds (palette,
    16-bit, 1-bit) are decoded by Pillow as before; a damaged PNG is an error naming the feature."""
    import io

    from PIL import Image

    from crossfeed.format.schema import decode_image

    rng = np.random.default_rng(7)
    base = Image.fromarray(rng.integers(0, 256, (23, 31, 4), dtype=np.uint8), "RGBA")
    im = base.convert(mode) if mode != "I;16" else Image.fromarray(rng.integers(0, 65536, (23, 31), dtype=np.uint16))
    buf = io.BytesIO()
    im.save(buf, format="PNG", interlace=interlace)
    data = buf.getvalue()
    want = np.asarray(Image.open(io.BytesIO(data)))
    want = want[:, :, None] if want.ndim == 2 else want
    got = decode_image(data)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(decode_image(memoryview(data)), want)
    with pytest.raises(SchemaError, match="'img'"):
        decode_image(data[:60], Feature("img", "uint8", (None, None, None), Encoding.IMAGE))


def test_the_on_disk_format_id_never_moves_with_the_code():
    """Manifests name their format "crossfeed.read.dataset" (the id datasets were written with);
    a module move must not change it, or every existing dataset would be refused."""
    from crossfeed.format.manifest import FORMAT

    assert FORMAT == "crossfeed.read.dataset"


def _png_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


# per kind: (feature, value) pairs of every shape form the kind takes (fixed, varying, scalar)
_KIND_CASES = {
    "tensor": [
        (Feature("t", "float16", (2, 3), Encoding.TENSOR), np.arange(6, dtype=np.float16).reshape(2, 3)),
        (Feature("t", "uint32", (None, 2), Encoding.TENSOR), np.arange(6, dtype=np.uint32).reshape(3, 2) << 30),
        (Feature("t", "int16", (), Encoding.TENSOR), np.int16(-7)),
    ],
    "image": [(Feature("i", "uint8", (3, 4, 3), Encoding.IMAGE), np.arange(36, dtype=np.uint8).reshape(3, 4, 3))],
    "int64": [
        (Feature("n", "int64", (), Encoding.INT64), -(1 << 62)),
        (Feature("n", "int64", (None,), Encoding.INT64), [0, 127, 128, 1 << 40]),
        (Feature("n", "int64", (2, 2), Encoding.INT64), np.array([[1, -2], [3, 300]])),
    ],
    "float": [
        (Feature("x", "float32", (), Encoding.FLOAT), 0.25),
        (Feature("x", "float32", (None,), Encoding.FLOAT), [1.5, -2.0]),
    ],
    "bytes": [
        (Feature("s", "string", (), Encoding.BYTES), "héllo"),
        (Feature("s", "bytes", (None,), Encoding.BYTES), [b"a", b"", b"\x00\xff"]),
    ],
}


def test_every_kind_has_cases_here():
    from crossfeed.format.codecs import CODECS

    assert sorted(e.value for e in CODECS) == sorted(_KIND_CASES)  # a new kind needs its round-trip cases


@pytest.mark.parametrize(
    "f,value", [c for cases in _KIND_CASES.values() for c in cases], ids=lambda c: getattr(c, "dtype", "")
)
def test_each_codec_round_trips_one_value_and_a_column(f, value):
    """Encode → decode through the feature's codec: the reference encoder and the compiled one
    (per value and per column) give the same bytes, and decoding them gives the value back."""
    from crossfeed.format import example as ex
    from crossfeed.format.codecs import codec_of
    from crossfeed.format.encode import encode_sample_reference, encoder_for
    from crossfeed.format.schema import decode_value, infer_feature

    codec = f.codec
    assert codec.encoding is f.encoding and f.codec is codec_of(f.encoding.value)
    assert pickle.loads(pickle.dumps(f)).codec is codec and pickle.loads(pickle.dumps(codec)) is codec
    stored = _png_bytes(value) if codec.image else value
    schema = Schema([f])
    ref = encode_sample_reference(schema, {f.name: stored})
    enc = encoder_for(schema)
    assert enc.encode({f.name: stored}) == ref
    column = np.stack([stored] * 3) if isinstance(stored, np.ndarray) else [stored] * 3
    assert enc.encode_columns({f.name: column}) == [ref] * 3
    parsed = ex.decode(ref)
    assert sorted(parsed) == sorted(codec.slots(f))
    got = decode_value(f, parsed)
    if codec.text:
        assert got == value
    else:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(value))
        assert np.asarray(got).dtype == codec.dtype(f)
    if not codec.image:  # inference gives back a feature of the same kind (images are declared)
        assert infer_feature(f.name, value).codec.value_kind == codec.value_kind
