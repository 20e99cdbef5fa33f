"""Adopting TFRecords written by other tools with declared feature types: ``crossfeed index
--feature NAME=ENCODING[:DTYPE[:SHAPE]]`` (and the Python form, which also takes a TensorFlow
feature spec by duck typing, without importing TensorFlow)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import crossfeed
from crossfeed.errors import ConfigError
from crossfeed.format import example as ex
from crossfeed.format import tfrecord
from crossfeed.write.adopt.index import index_dataset, parse_feature


def _raw_shards(root, n=20, side=8):
    """What a TF user writes: the image as ``tobytes()`` in a bytes_list, the label an int64."""
    root.mkdir()
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, (n, side, side, 3), dtype=np.uint8)
    for s in range(2):
        with tfrecord.RecordWriter(root / f"train-{s:05d}-of-00002.tfrecord") as w:
            for i in range(s, n, 2):
                w.write(
                    ex.encode(
                        {
                            "image": (ex.BYTES, ex.encode_bytes_list([images[i].tobytes()])),
                            "label": (ex.INT64, ex.encode_int64_list([i])),
                        }
                    )
                )
    return images


def _index(path, *features: str) -> subprocess.CompletedProcess:
    """``crossfeed index PATH --feature F …`` through the real entry point."""
    cmd = [sys.executable, "-m", "crossfeed.cli.main", "index", str(path)]
    for f in features:
        cmd += ["--feature", f]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_declared_tensors_come_out_as_arrays_through_the_cli(tmp_path):
    images = _raw_shards(tmp_path / "d")
    out = _index(tmp_path / "d", "image=tensor:uint8:8,8,3", "label=int64")
    assert out.returncode == 0, out.stderr
    ds = crossfeed.open_dataset(tmp_path / "d")
    assert ds.schema["image"] == crossfeed.Feature("image", "uint8", (8, 8, 3), crossfeed.Encoding.TENSOR)
    with crossfeed.Loader(tmp_path / "d", batch_size=7, shuffle="global", seed=2) as loader:
        for b in loader:
            assert b["image"].dtype == np.uint8 and b["image"].shape[1:] == (8, 8, 3)
            for img, label in zip(b["image"], b["label"].tolist()):
                np.testing.assert_array_equal(img, images[label])


def test_a_declaration_that_does_not_fit_names_the_record(tmp_path):
    _raw_shards(tmp_path / "d")
    out = _index(tmp_path / "d", "image=tensor:uint8:8,8,4")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "train-00000-of-00002.tfrecord: record at byte offset 0" in out.stderr and "'image'" in out.stderr
    assert not (tmp_path / "d" / "crossfeed.json").exists()


def test_specs_parse_and_a_tf_feature_spec_is_read_without_tensorflow(tmp_path):
    assert parse_feature("x=float:float32:32").shape == (32,)
    assert parse_feature("jpeg=image").encoding is crossfeed.Encoding.IMAGE
    assert parse_feature("v=tensor:int16:?,4").shape == (None, 4)
    for bad in ("nope", "x=colour", "x=tensor", "x=tensor:uint8:a,b"):
        with pytest.raises(ConfigError, match="--feature"):
            parse_feature(bad)

    class _DType:
        def __init__(self, name):
            self.name = name

    class FixedLenFeature:  # what tf.io.FixedLenFeature looks like, duck-typed
        def __init__(self, shape, dtype):
            self.shape, self.dtype = shape, _DType(dtype)

    images = _raw_shards(tmp_path / "d")
    manifest = index_dataset(
        tmp_path / "d", features={"image": "tensor:uint8:8,8,3", "label": FixedLenFeature([], "int64")}
    )
    assert manifest.schema["label"] == crossfeed.Feature("label", "int64", (), crossfeed.Encoding.INT64)
    np.testing.assert_array_equal(crossfeed.open_dataset(tmp_path / "d")["train"][0]["image"], images[0])
