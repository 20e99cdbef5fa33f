"""`crossfeed index | info | verify | head` through typer's CliRunner, plus one real subprocess run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

import crossfeed
from crossfeed.cli.main import app
from crossfeed.format import tfrecord
from crossfeed.format.encode import encode_sample
from crossfeed.format.manifest import MANIFEST
from crossfeed.format.schema import Encoding, Feature, infer_schema

runner = CliRunner()


def invoke(*args):
    result = runner.invoke(app, [str(a) for a in args])
    assert "Traceback" not in result.output + result.stderr
    return result


def test_info_text_and_json(mixed_dataset):
    root, _ = mixed_dataset
    result = invoke("info", root)
    assert result.exit_code == 0, result.stderr
    assert "train" in result.stdout and "30 records" in result.stdout and "3 shards" in result.stdout
    assert "image" in result.stdout and "uint8" in result.stdout and "(4, 5, 3)" in result.stdout
    as_json = json.loads(invoke("info", root, "--json").stdout)
    assert as_json["splits"]["train"]["num_records"] == 30
    assert [f["name"] for f in as_json["schema"]] == ["image", "label", "score", "tokens", "name"]


def test_head_shows_samples(mixed_dataset):
    root, samples = mixed_dataset
    result = invoke("head", root, "-n", 2)
    assert result.exit_code == 0, result.stderr
    assert result.stdout.count("[train ") == 2
    assert "uint8[4, 5, 3]" in result.stdout and "'sample-0'" in result.stdout
    assert "-n" in invoke("head", "--help").stdout


def test_head_truncates_long_bytes(tmp_path):
    crossfeed.write_dataset(tmp_path / "b", [{"blob": b"x" * 1000}], split="val").close()
    result = invoke("head", tmp_path / "b")
    assert result.exit_code == 0 and "bytes[1000]" in result.stdout and "x" * 33 not in result.stdout


def test_verify_ok_and_split(mixed_dataset):
    root, samples = mixed_dataset
    crossfeed.write_dataset(root, samples[:4], split="test", add_split=True).close()
    result = invoke("verify", root)
    assert (
        result.exit_code == 0
        and result.stdout.strip() == "ok: 34 records in 4 shards (" + result.stdout.split("(")[1].strip()
    )
    assert "ok: 4 records in 1 shards" in invoke("verify", root, "--split", "test").stdout
    os.unlink(root / "test-00000-of-00001.g1.tfrecord.idx")  # the second commit: generation 1's names
    assert invoke("verify", root, "--split", "train").exit_code == 0
    bad = invoke("verify", root)
    assert bad.exit_code == 1 and "index file is missing" in bad.stderr


def _foreign_shards(root, names, n=10, gzip_names=()):
    """Shards written record by record, the way other tools write them (names chosen by the caller)."""
    schema = infer_schema([{"v": [1.0, 2.0], "id": 1, "tag": b"t"}])
    root.mkdir()
    k = 0
    for name in names:
        with tfrecord.RecordWriter(root / name, compress=name in gzip_names) as w:
            for _ in range(n):
                w.write(encode_sample(schema, {"v": [k, k / 2], "id": k, "tag": f"t{k}".encode()}))
                k += 1
    return k


def test_index_adopts_foreign_shards_and_splits_from_names(tmp_path):
    root = tmp_path / "beam"
    names = ["train-00000-of-00002", "train-00001-of-00002", "validation-00000-of-00001.tfrecords", "extra.tfrecord"]
    _foreign_shards(root, names, gzip_names={"train-00001-of-00002"})
    (root / "README.txt").write_text("not a shard")
    result = invoke("index", root)
    assert result.exit_code == 0, result.stderr
    with crossfeed.open_dataset(root) as ds:
        assert {k: len(ds[k]) for k in ds.splits} == {"train": 30, "validation": 10}  # extra.tfrecord → train
        assert [s.file for s in ds.splits["train"].shards] == [
            "extra.tfrecord",
            "train-00000-of-00002",
            "train-00001-of-00002",
        ]
        assert ds.schema["v"] == Feature("v", "float32", (2,), Encoding.FLOAT)
        assert ds.schema["id"] == Feature("id", "int64", (), Encoding.INT64)
        assert ds.schema["tag"] == Feature("tag", "bytes", (), Encoding.BYTES)
        r = ds["train"][25]  # the GZIP shard, named without .gz
        assert r["id"] == 15 and r["tag"] == b"t15" and r["v"].tolist() == [15.0, 7.5]
    assert (root / "train-00001-of-00002.idx").exists()
    assert invoke("verify", root).exit_code == 0
    again = invoke("index", root)
    assert again.exit_code == 2 and "--force" in again.stderr
    assert invoke("index", root, "--force").exit_code == 0
    one = invoke("index", root, "--force", "--no-split-from-name", "--split", "all")
    assert one.exit_code == 0
    with crossfeed.open_dataset(root) as ds:
        assert {k: len(ds[k]) for k in ds.splits} == {"all": 40}


def test_index_infers_images_and_variable_lengths(tmp_path):
    import io

    from PIL import Image

    def png(h, w):
        b = io.BytesIO()
        Image.fromarray(np.full((h, w, 3), 7, np.uint8)).save(b, format="PNG")
        return b.getvalue()

    schema = crossfeed.Schema(
        [
            Feature("img", "bytes", (), Encoding.BYTES),
            Feature("ids", "int64", (None,), Encoding.INT64),
            Feature("maybe", "float32", (None,), Encoding.FLOAT),
        ]
    )
    root = tmp_path / "imgs"
    root.mkdir()
    with tfrecord.RecordWriter(root / "x.tfrecord") as w:
        for i in range(6):
            w.write(encode_sample(schema, {"img": png(4, 3 + i % 2), "ids": list(range(i)), "maybe": [0.5] * (i % 2)}))
    assert invoke("index", root).exit_code == 0
    with crossfeed.open_dataset(root) as ds:
        assert ds.schema["img"] == Feature("img", "uint8", (4, None, 3), Encoding.IMAGE)
        assert ds.schema["ids"].shape == (None,) and ds.schema["maybe"].shape == (None,)
        r = ds["train"][3]
        assert r["img"].shape == (4, 4, 3) and (r["img"] == 7).all() and r["ids"].tolist() == [0, 1, 2]


def test_reindex_keeps_tensor_schema(mixed_dataset):
    root, samples = mixed_dataset
    before = crossfeed.open_dataset(root).schema
    assert invoke("index", root, "--force").exit_code == 0
    with crossfeed.open_dataset(root) as ds:
        assert ds.schema == before
        np.testing.assert_array_equal(ds["train"][0]["image"], samples[0]["image"])


@pytest.mark.slow
def test_real_subprocess_run(mixed_dataset):
    root, _ = mixed_dataset
    exe = shutil.which("crossfeed", path=os.path.dirname(sys.executable))
    cmd = [exe] if exe else [sys.executable, "-m", "crossfeed.cli.main"]
    ok = subprocess.run([*cmd, "verify", str(root)], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and ok.stdout.startswith("ok: 30 records in 3 shards"), ok.stderr
    os.unlink(root / MANIFEST)
    bad = subprocess.run([*cmd, "info", str(root)], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and bad.stderr.count("\n") == 1 and "crossfeed.json" in bad.stderr
    assert "Traceback" not in bad.stderr
