"""Compatibility with the real peers: TensorFlow (tf.data + tf.io.parse_example) and the `tfrecord`
PyPI package, both reading crossfeed's shards and writing shards crossfeed adopts.

All TensorFlow use of the suite lives here. The `tfrecord` package registers protobuf descriptors
that clash with TensorFlow's, so it only ever runs in a subprocess."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from conftest import lazy_import, run_python
from PIL import Image
from typer.testing import CliRunner

import crossfeed
from crossfeed.cli.main import app
from crossfeed.format.schema import Encoding, Feature, Schema

tf = lazy_import("tensorflow")
pytestmark = pytest.mark.slow  # TensorFlow imported: tf.data and tfrecord compatibility


def _png(arr):
    b = io.BytesIO()
    Image.fromarray(arr).save(b, format="PNG")
    return b.getvalue()


def _jpeg(arr):
    b = io.BytesIO()
    Image.fromarray(arr).save(b, format="JPEG", quality=90)
    return b.getvalue()


SCHEMA = Schema(
    [
        Feature("pixels", "uint8", (6, 5, 3), Encoding.TENSOR),
        Feature("emb", "float32", (3,), Encoding.TENSOR),
        Feature("counts", "int16", (None, 2), Encoding.TENSOR),
        Feature("vec", "float32", (4,), Encoding.FLOAT),
        Feature("label", "int64", (), Encoding.INT64),
        Feature("ids", "int64", (None,), Encoding.INT64),
        Feature("text", "string", (), Encoding.BYTES),
        Feature("png", "uint8", (6, 5, 3), Encoding.IMAGE),
    ]
)


def _samples(n=24):
    rng = np.random.default_rng(3)
    out = []
    for i in range(n):
        px = rng.integers(0, 255, (6, 5, 3), dtype=np.uint8)
        out.append(
            {
                "pixels": px,
                "emb": rng.standard_normal(3).astype(np.float32),
                "counts": rng.integers(-999, 999, (i % 3, 2)).astype(np.int16),
                "vec": rng.standard_normal(4).astype(np.float32),
                "label": i - 5,
                "ids": np.arange(i % 4, dtype=np.int64) * 10**12,
                "text": f"é{i}",
                "png": _png(px),
            }
        )
    return out


def _tf_spec(schema):
    """What a TensorFlow user writes by hand from `crossfeed info`."""
    spec = {}
    for f in schema:
        if f.encoding in (Encoding.TENSOR, Encoding.IMAGE) or (f.encoding is Encoding.BYTES and f.shape == ()):
            spec[f.name] = tf.io.FixedLenFeature([], tf.string)
            if f.encoding is Encoding.TENSOR and not f.fixed:
                spec[f.name + "/shape"] = tf.io.FixedLenFeature([len(f.shape)], tf.int64)
        elif f.fixed:
            spec[f.name] = tf.io.FixedLenFeature(f.shape, tf.int64 if f.encoding is Encoding.INT64 else tf.float32)
        else:
            spec[f.name] = tf.io.RaggedFeature(tf.int64 if f.encoding is Encoding.INT64 else tf.float32)
    return spec


@pytest.mark.parametrize("compress", [False, True])
def test_tf_data_reads_crossfeed_shards(tmp_path, compress):
    samples = _samples()
    with crossfeed.write_dataset(tmp_path / "d", samples, schema=SCHEMA, num_shards=3, compress=compress) as ds:
        files = [str(tmp_path / "d" / s.file) for s in ds.splits["train"].shards]
        expected = list(ds["train"])
    assert sorted(r["label"] for r in expected) == list(range(-5, 19))
    records = tf.data.TFRecordDataset(files, compression_type="GZIP" if compress else None).batch(100)
    batch = tf.io.parse_example(next(iter(records)), _tf_spec(SCHEMA))
    assert len(batch["label"]) == len(expected)
    for i, want in enumerate(expected):
        np.testing.assert_array_equal(
            tf.reshape(tf.io.decode_raw(batch["pixels"][i], tf.uint8), (6, 5, 3)).numpy(), want["pixels"]
        )
        np.testing.assert_array_equal(tf.io.decode_raw(batch["emb"][i], tf.float32).numpy(), want["emb"])
        shape = batch["counts/shape"][i].numpy()
        np.testing.assert_array_equal(
            tf.reshape(tf.io.decode_raw(batch["counts"][i], tf.int16), shape).numpy(), want["counts"]
        )
        np.testing.assert_array_equal(batch["vec"][i].numpy(), want["vec"])
        assert batch["label"][i].numpy() == want["label"]
        assert batch["ids"][i].numpy().tolist() == want["ids"].tolist()
        assert batch["text"][i].numpy().decode() == want["text"]
        np.testing.assert_array_equal(tf.io.decode_png(batch["png"][i]).numpy(), want["png"])


def test_tfrecord_package_reads_crossfeed_shards(tmp_path):
    samples = [
        {"label": i, "score": np.float32(i / 4), "vec": [i + 0.5, i + 1.0, -i], "name": f"n{i}"} for i in range(20)
    ]
    args, expected = [], []
    for compress in (False, True):  # one subprocess for both: importing the package is slow
        with crossfeed.write_dataset(tmp_path / f"d{compress}", samples, num_shards=2, compress=compress) as ds:
            args += [
                f"{'gzip' if compress else 'plain'}:{tmp_path / f'd{compress}' / s.file}"
                for s in ds.splits["train"].shards
            ]
            expected += [{k: np.asarray(v).tolist() for k, v in r.items()} for r in ds["train"]]
    out = run_python(
        """
        import json, os, sys, tempfile
        from tfrecord.reader import tfrecord_loader
        from tfrecord.tools.tfrecord2idx import create_index
        rows, same_index = [], True
        for arg in sys.argv[1:]:
            kind, path = arg.split(":", 1)
            gz = kind == "gzip"
            desc = {"label": "int", "score": "float", "vec": "float", "name": "byte"}
            for worker in range(3):  # the package splits work by our index offsets
                for r in tfrecord_loader(path, path + ".idx", desc, shard=(worker, 3), compression_type="gzip" if gz else None):
                    rows.append({"label": int(r["label"][0]), "score": float(r["score"][0]),
                                 "vec": r["vec"].tolist(), "name": bytes(r["name"]).decode()})
            if not gz:  # the package's own index tool writes the same index file
                theirs = os.path.join(tempfile.mkdtemp(), "x.idx")
                create_index(path, theirs)
                same_index &= open(theirs).read().split() == open(path + ".idx").read().split()
        print(json.dumps({"rows": rows, "same_index": same_index}))
    """,
        *args,
    )
    got = json.loads(out.stdout)
    assert got["same_index"]
    assert got["rows"] == expected


def _tf_example(i, jpeg, png):
    F = tf.train.Feature
    return tf.train.Example(
        features=tf.train.Features(
            feature={
                "image/encoded": F(bytes_list=tf.train.BytesList(value=[jpeg])),
                "mask": F(bytes_list=tf.train.BytesList(value=[png])),
                "bbox": F(float_list=tf.train.FloatList(value=[0.1 * i, 0.2, 0.3, 0.4])),
                "label": F(int64_list=tf.train.Int64List(value=[i])),
                "objects": F(int64_list=tf.train.Int64List(value=list(range(i % 3)))),
                "caption": F(bytes_list=tf.train.BytesList(value=[f"cap {i}".encode()])),
            }
        )
    ).SerializeToString()


@pytest.mark.parametrize("compress", [False, True])
def test_crossfeed_adopts_tensorflow_written_shards(tmp_path, compress):
    root = tmp_path / "tfdata"
    root.mkdir()
    rng = np.random.default_rng(0)
    opts = tf.io.TFRecordOptions(compression_type="GZIP") if compress else None
    pngs = []
    for s in range(2):  # Beam's naming; GZIP files without a .gz suffix
        with tf.io.TFRecordWriter(str(root / f"data-{s:05d}-of-00002"), options=opts) as w:
            for i in range(s * 7, s * 7 + 7):
                px = np.repeat(np.repeat(rng.integers(0, 255, (4, 4, 3), dtype=np.uint8), 8, 0), 8, 1)
                pngs.append(px)
                w.write(_tf_example(i, _jpeg(px), _png(px)))
    result = CliRunner().invoke(app, ["index", str(root)])
    assert result.exit_code == 0, result.stderr
    assert (root / "data-00001-of-00002.idx").exists()
    with crossfeed.open_dataset(root) as ds:
        assert list(ds.splits) == ["data"]
        assert ds.schema["image/encoded"] == Feature("image/encoded", "uint8", (32, 32, 3), Encoding.IMAGE)
        assert ds.schema["bbox"] == Feature("bbox", "float32", (4,), Encoding.FLOAT)
        assert ds.schema["objects"] == Feature("objects", "int64", (None,), Encoding.INT64)
        assert ds.schema["caption"] == Feature("caption", "bytes", (), Encoding.BYTES)
        got = list(ds["data"])
    assert len(got) == 14
    files = [str(root / f"data-{s:05d}-of-00002") for s in range(2)]
    theirs = list(tf.data.TFRecordDataset(files, compression_type="GZIP" if compress else None))
    for i, (r, raw) in enumerate(zip(got, theirs)):
        assert r["label"] == i and r["objects"].tolist() == list(range(i % 3)) and r["caption"] == f"cap {i}".encode()
        np.testing.assert_allclose(r["bbox"], [0.1 * i, 0.2, 0.3, 0.4], rtol=1e-6)
        np.testing.assert_array_equal(r["mask"], pngs[i])
        parsed = tf.io.parse_single_example(raw, {"image/encoded": tf.io.FixedLenFeature([], tf.string)})
        tf_pixels = tf.io.decode_jpeg(parsed["image/encoded"]).numpy().astype(int)
        assert r["image/encoded"].shape == tf_pixels.shape
        diff = np.abs(r["image/encoded"].astype(int) - tf_pixels)  # two JPEG decoders: chroma upsampling differs
        assert diff.mean() < 1.5 and diff.max() <= 12


def test_crossfeed_adopts_tfrecord_package_shards(tmp_path):
    root = tmp_path / "pkg"
    root.mkdir()
    run_python(
        """
        import sys
        from tfrecord import TFRecordWriter
        for s in range(2):
            w = TFRecordWriter(f"{sys.argv[1]}/part-{s}.tfrecord")
            for i in range(s * 5, s * 5 + 5):
                w.write({"x": ([float(i), 0.5], "float"), "y": (i * 3, "int"), "blob": (bytes([i]) * i, "byte")})
            w.close()
    """,
        str(root),
    )
    assert CliRunner().invoke(app, ["index", str(root), "--split", "all"]).exit_code == 0
    with crossfeed.open_dataset(root) as ds:
        assert ds.schema["x"] == Feature("x", "float32", (2,), Encoding.FLOAT)
        rows = list(ds["all"])
    assert [r["y"] for r in rows] == [i * 3 for i in range(10)]
    assert [r["x"].tolist() for r in rows] == [[float(i), 0.5] for i in range(10)]
    assert [r["blob"] for r in rows] == [bytes([i]) * i for i in range(10)]


@pytest.mark.parametrize("tf_first", [True, False], ids=["tf-then-crossfeed", "crossfeed-then-tf"])
def test_codec_next_to_tensorflow_in_one_process(tf_first):
    imports = "import tensorflow as tf\nimport crossfeed" if tf_first else "import crossfeed\nimport tensorflow as tf"
    out = run_python(
        imports
        + """
import numpy as np
from crossfeed.format import example as ex
from crossfeed.format.encode import encode_sample
from crossfeed.format.schema import infer_schema
sample = {"a": [0.0, 1.0, 2.0], "b": 7, "c": "hi", "t": np.arange(4, dtype=np.int16)}
payload = encode_sample(infer_schema([sample]), sample)
p = tf.io.parse_single_example(payload, {"a": tf.io.FixedLenFeature([3], tf.float32),
                                         "b": tf.io.FixedLenFeature([], tf.int64), "c": tf.io.FixedLenFeature([], tf.string),
                                         "t": tf.io.FixedLenFeature([], tf.string)})
assert p["a"].numpy().tolist() == [0.0, 1.0, 2.0] and int(p["b"]) == 7 and p["c"].numpy() == b"hi"
assert tf.io.decode_raw(p["t"], tf.int16).numpy().tolist() == [0, 1, 2, 3]
theirs = tf.train.Example(features=tf.train.Features(feature={
    "f": tf.train.Feature(int64_list=tf.train.Int64List(value=[-1, 2**62]))})).SerializeToString()
assert ex.to_python(theirs) == {"f": [-1, 2**62]}
assert tf.train.Example.FromString(payload).features.feature["b"].int64_list.value == [7]
print("ok")
"""
    )
    assert out.stdout.strip().endswith("ok")
