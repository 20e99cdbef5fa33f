"""TFDS prepared datasets adopted in place, and ``--index-dir``: ``crossfeed index`` maps a data
directory written by tensorflow-datasets itself (``tests/tfds_builder.py``, run in a process of
its own) to crossfeed's schema and splits, writes nothing into it, and what crossfeed and
PyTorch then read — in a process where TensorFlow cannot be imported — equals ``tfds.as_numpy``
value for value."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
from adopt_helpers import INDEX_AUDITED, read_only, snapshot, trusted_roots  # noqa: F401 (autouse)
from conftest import run_python

import crossfeed
from crossfeed.errors import ConfigError, CorruptRecordError, ManifestError, SchemaError
from crossfeed.format.manifest import loads
from crossfeed.read.tools.verify import verify_dataset
from crossfeed.write.adopt.index import index_dataset
from crossfeed.write.adopt.placement import placement

pytestmark = [
    pytest.mark.slow,  # tensorflow-datasets and TensorFlow in processes of their own
    pytest.mark.skipif(
        importlib.util.find_spec("tensorflow_datasets") is None, reason="needs tensorflow-datasets to build the data"
    ),
]
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """``(data_dir, {split: [tfds.as_numpy sample]})`` of the dataset TFDS prepared (3 shards a split)."""
    base = tmp_path_factory.mktemp("tfds")
    out = base / "expected.pkl"
    proc = subprocess.run(
        [sys.executable, str(HERE / "tfds_builder.py"), str(base / "data"), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out, "rb") as f:
        expected = pickle.load(f)
    return Path(expected["data_dir"]), expected["splits"]


def _copy(prepared, tmp_path) -> Path:
    data = tmp_path / "tiny_tfds" / "1.0.0"
    shutil.copytree(prepared[0], data)
    return data


def _cli(*args, check: bool = True) -> subprocess.CompletedProcess:
    """A ``crossfeed`` command through the real entry point."""
    proc = subprocess.run(
        [sys.executable, "-m", "crossfeed.cli.main", *map(str, args)], capture_output=True, text=True, timeout=120
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def _assert_same(got: dict, want: dict, where: str) -> None:
    """A crossfeed sample against the TFDS one, value for value (crossfeed's dtype is the stored one)."""
    assert sorted(got) == sorted(want), where
    for k, w in want.items():
        g = got[k]
        if isinstance(w, bytes):  # Text: TFDS hands out bytes, crossfeed the str
            assert g == w.decode("utf-8"), f"{where} {k}"
            continue
        w = np.asarray(w)
        g = np.asarray(g)
        assert g.shape == w.shape, f"{where} {k}: {g.shape} != {w.shape}"
        np.testing.assert_array_equal(g, w.astype(g.dtype) if w.dtype.kind == "f" else w, err_msg=f"{where} {k}")


# The reader: a fresh interpreter in which `import tensorflow` fails, reading every split whole,
# through a globally shuffled Loader and through PyTorch's DataLoader.
_READ_WITHOUT_TF = """
import pickle, sys
sys.modules["tensorflow"] = None  # any import of TensorFlow now raises
import numpy as np, torch, crossfeed
from crossfeed.adapters.torch import TorchDataset
index_dir, out = sys.argv[1], sys.argv[2]
ds = crossfeed.open_dataset(index_dir)
whole = {s: [ds[s][i] for i in range(len(ds[s]))] for s in ds.splits}
shuffled = []
with crossfeed.Loader(index_dir, split="train", batch_size=5, shuffle="global", seed=3, return_index=True) as loader:
    for b in loader:
        for j, i in enumerate(b["__index__"].tolist()):
            shuffled.append((i, {k: v[j] for k, v in b.items() if k != "__index__"}))
fixed = ("mask", "label", "embedding", "patch", "counts", "flag", "meta/pair", "meta/weight", "meta/kind")
tds = TorchDataset(index_dir, split="test", batch_size=3, shuffle="none", features=fixed, drop_last=False)
torch_batches = [{k: v.numpy() for k, v in b.items()} for b in torch.utils.data.DataLoader(tds, batch_size=None)]
assert not any(m == "tensorflow" or m.startswith("tensorflow.") for m in sys.modules if sys.modules[m] is not None)
with open(out, "wb") as f:
    pickle.dump({"whole": whole, "shuffled": shuffled, "torch": torch_batches}, f)
"""


def test_read_only_tfds_dir_is_adopted_untouched_and_read_without_tensorflow(prepared, tmp_path):
    data = _copy(prepared, tmp_path)
    index_dir = tmp_path / "index"
    with read_only(data):
        before = snapshot(data)
        if os.geteuid() != 0:  # root writes through any mode; the audit hook below covers it
            refused = _cli("index", data, check=False)
            assert refused.returncode != 0 and "--index-dir" in refused.stderr
        run_python(INDEX_AUDITED, str(data), "--index-dir", str(index_dir))
        assert snapshot(data) == before
        assert sorted(os.listdir(index_dir)) == sorted(
            ["crossfeed.json"] + [n + ".idx" for n in os.listdir(data) if ".tfrecord-" in n]
        )
        manifest = json.loads((index_dir / "crossfeed.json").read_text())
        assert manifest["data_root"] == str(data)
        assert manifest["metadata"]["tfds"]["class_names"] == {"label": ["cat", "dog", "bird"], "meta/kind": ["a", "b"]}
        assert manifest["metadata"]["tfds"]["dtypes"] == {"counts": "int32", "flag": "bool", "meta/weight": "float64"}
        assert {s: len(v["shards"]) for s, v in manifest["splits"].items()} == {"train": 3, "test": 3}

        out = tmp_path / "read.pkl"
        run_python(_READ_WITHOUT_TF, str(index_dir), str(out), timeout=300)
        assert snapshot(data) == before
    with open(out, "rb") as f:
        got = pickle.load(f)
    expected = prepared[1]
    for split, samples in expected.items():
        assert len(got["whole"][split]) == len(samples)
        for i, (g, w) in enumerate(zip(got["whole"][split], samples)):
            _assert_same(g, w, f"{split}[{i}]")
    assert sorted(i for i, _ in got["shuffled"]) == list(range(len(expected["train"])))
    assert [i for i, _ in got["shuffled"]] != sorted(i for i, _ in got["shuffled"])
    for i, g in got["shuffled"]:
        _assert_same(g, expected["train"][i], f"shuffled train[{i}]")
    rows = [{k: v[j] for k, v in b.items()} for b in got["torch"] for j in range(len(b["label"]))]
    assert len(rows) == len(expected["test"])
    for i, (g, w) in enumerate(zip(rows, expected["test"])):
        _assert_same(g, {k: w[k] for k in g}, f"torch test[{i}]")


def test_info_verify_head_through_the_cli(prepared, tmp_path):
    data = _copy(prepared, tmp_path)
    out = _cli("index", data, "--index-dir", tmp_path / "idx")
    assert "train: 23 records in 3 shards" in out.stdout
    info = _cli("info", tmp_path / "idx").stdout
    assert f"data    {data} (shards read in place)" in info
    assert 'source: "tfds"' in info and '"label": ["cat", "dog", "bird"]' in info
    assert "image                uint8    (?, ?, 3)" in info
    assert json.loads(_cli("info", tmp_path / "idx", "--json").stdout)["data_root"] == str(data)
    assert "30 records in 6 shards" in _cli("verify", tmp_path / "idx").stdout
    head = _cli("head", tmp_path / "idx", "-s", "test").stdout
    assert "'sample 0 of split 1: é ü'" in head and "patch: uint8[2, 3]" in head

    # Beside the data, without --index-dir: the same schema, no data_root.
    _cli("index", data)
    beside = crossfeed.open_dataset(data)
    assert beside.manifest.data_root is None
    assert beside.schema == crossfeed.open_dataset(tmp_path / "idx").schema
    _assert_same(beside["train"][5], prepared[1]["train"][5], "train[5]")


def test_a_changed_shard_is_caught_through_the_index_dir(prepared, tmp_path):
    data = _copy(prepared, tmp_path)
    _cli("index", data, "--index-dir", tmp_path / "idx")
    shard = data / "tiny_tfds-train.tfrecord-00001-of-00003"
    blob = bytearray(shard.read_bytes())
    blob[40] ^= 0xFF  # inside the first record's payload: same size, bad CRC
    shard.write_bytes(bytes(blob))
    bad = _cli("verify", tmp_path / "idx", check=False)
    assert bad.returncode == 1
    assert f"{shard}: sha256 differs from the manifest" in bad.stdout + bad.stderr
    with pytest.raises(CorruptRecordError, match=str(shard)):
        with crossfeed.Loader(tmp_path / "idx", batch_size=4, shuffle="none") as loader:
            list(loader)
    shard.unlink()
    gone = _cli("verify", tmp_path / "idx", check=False)
    assert gone.returncode == 1 and f"{shard}: shard file is missing" in gone.stdout + gone.stderr


def test_remote_data_dir_is_read_where_it_lies(prepared, tmp_path):
    """An fsspec URL (the in-memory filesystem stands in for a bucket): indexed into a local
    --index-dir, then read by range requests and through the sha256-checked shard cache."""
    import fsspec

    fs = fsspec.filesystem("memory")
    url = f"memory://tfds-{uuid.uuid4().hex}/tiny_tfds/1.0.0"
    for p in prepared[0].iterdir():
        fs.pipe_file(f"{url}/{p.name}", p.read_bytes())
    with pytest.raises(ConfigError, match="--index-dir"):
        index_dataset(url)
    place = placement(url, tmp_path / "idx")
    with place.open("features.json") as f:
        assert f.read() == (prepared[0] / "features.json").read_bytes()
    assert place.data_root == url and place.index_path("a") == str(tmp_path / "idx" / "a.idx")
    manifest = index_dataset(url, index_dir=tmp_path / "idx")
    assert manifest.data_root == url and manifest.metadata["tfds"]["name"] == "tiny_tfds"
    with crossfeed.open_dataset(tmp_path / "idx") as ds:
        assert ds.storage.remote and not ds.index_storage.remote
        for split, samples in prepared[1].items():
            for i, w in enumerate(samples):
                _assert_same(ds[split][i], w, f"remote {split}[{i}]")
    cache = tmp_path / "cache"
    with crossfeed.Loader(tmp_path / "idx", batch_size=4, shuffle="global", seed=1, cache_dir=str(cache)) as loader:
        assert sum(len(b["label"]) for b in loader) == 23
    assert verify_dataset(tmp_path / "idx") == []  # each remote shard fetched once, checked as a local one
    shard = f"{url}/tiny_tfds-train.tfrecord-00002-of-00003"
    blob = bytearray(fs.cat_file(shard))
    blob[-10] ^= 0xFF
    fs.pipe_file(shard, bytes(blob))
    assert {p.file for p in verify_dataset(tmp_path / "idx")} == {shard}
    with pytest.raises(CorruptRecordError, match="sha256"):
        with crossfeed.Loader(
            tmp_path / "idx", batch_size=4, shuffle="global", seed=1, cache_dir=str(tmp_path / "cache2")
        ) as loader:
            list(loader)
    fs.rm(url.removeprefix("memory://").split("/")[0], recursive=True)


def _tfds_dir(tmp_path, features: dict, file_format: str = "tfrecord") -> Path:
    """A TFDS directory of JSON and one empty shard: enough for the feature mapping to speak."""
    d = tmp_path / "x" / "1.0.0"
    d.mkdir(parents=True)
    info = {
        "name": "x",
        "fileFormat": file_format,
        "version": "1.0.0",
        "splits": [
            {
                "name": "train",
                "shardLengths": ["1"],
                "filepathTemplate": "{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}",
            }
        ],
    }
    (d / "dataset_info.json").write_text(json.dumps(info))
    tree = {
        "pythonClassName": "tensorflow_datasets.core.features.features_dict.FeaturesDict",
        "featuresDict": {"features": features},
    }
    (d / "features.json").write_text(json.dumps(tree))
    (d / f"x-train.{file_format}-00000-of-00001").write_bytes(b"")
    return d


_P = "tensorflow_datasets.core.features."


def _tensor(dtype, dims=(), encoding="none") -> dict:
    return {
        "pythonClassName": _P + "tensor_feature.Tensor",
        "tensor": {"dtype": dtype, "encoding": encoding, "shape": {"dimensions": [str(d) for d in dims]}},
    }


def _seq(feature, length=-1) -> dict:
    return {
        "pythonClassName": _P + "sequence_feature.Sequence",
        "sequence": {"feature": feature, "length": str(length)},
    }


_IMAGE = {
    "pythonClassName": _P + "image_feature.Image",
    "image": {"dtype": "uint8", "shape": {"dimensions": ["-1", "-1", "3"]}},
}


@pytest.mark.parametrize(
    ("feature", "why"),
    [
        (_tensor("float32", (8, 8), "zlib"), "encoding 'zlib'"),
        (_tensor("int64", (-1, 3)), r"shape \[None, 3\] has a variable dimension among others"),
        (_seq(_tensor("float32", (4,))), r"shape \[None, 4\] has a variable dimension among others"),
        (_seq(_IMAGE), "a sequence of images"),
        (_seq(_seq(_tensor("int64"))), "a sequence of sequences"),
        (_tensor("uint64", (2,)), "uint64 is stored bit-cast"),
        (_tensor("uint8", (-1, -1), "bytes"), "varies"),
        ({"pythonClassName": _P + "audio_feature.Audio", "audio": {}}, r"\(Audio\).*crossfeed maps Image"),
    ],
)
def test_layouts_crossfeed_cannot_read_are_refused_by_name(tmp_path, feature, why):
    d = _tfds_dir(tmp_path, {"ok": _tensor("int64"), "bad": feature})
    with pytest.raises(SchemaError, match=rf"TFDS feature 'bad' .*{why}.*--feature bad="):
        index_dataset(d, index_dir=tmp_path / "idx")
    assert not (tmp_path / "idx" / "crossfeed.json").exists()


def test_non_tfrecord_tfds_and_bad_data_roots_are_refused(tmp_path):
    d = _tfds_dir(tmp_path, {"ok": _tensor("int64")}, file_format="array_record")
    with pytest.raises(ConfigError, match="stored as 'array_record'.*file_format='tfrecord'"):
        index_dataset(d, index_dir=tmp_path / "idx")
    with pytest.raises(ConfigError, match="lies inside the data directory"):
        index_dataset(d, index_dir=d / "sub")
    doc = {
        "format": "crossfeed.read.dataset",
        "version": 1,
        "schema": [{"name": "a", "dtype": "int64", "shape": [], "encoding": "int64"}],
        "splits": {
            "train": {"shards": [{"file": "a.tfrecord", "num_records": 1, "num_bytes": 20, "sha256": "0" * 64}]}
        },
    }
    for bad in ("relative/dir", "", 7, "/x\n"):
        with pytest.raises(ManifestError, match="data_root"):
            loads(json.dumps({**doc, "data_root": bad}), "m")
    assert loads(json.dumps({**doc, "data_root": "s3://bucket/ds"}), "m").data_root == "s3://bucket/ds"


def test_an_index_dir_dataset_takes_no_new_splits(prepared, tmp_path):
    """A writer never puts shards among index files whose shards lie elsewhere."""
    data = _copy(prepared, tmp_path)
    index_dataset(data, index_dir=tmp_path / "idx")
    with pytest.raises(ConfigError, match="lies in .*--index-dir"):
        crossfeed.write_dataset(tmp_path / "idx", [{"x": 1}], split="extra", add_split=True).close()
    assert crossfeed.open_dataset(tmp_path / "idx").manifest.data_root == str(data)


_READ_WITH_TF_NATIVE = """
import pickle, sys
import crossfeed.adapters.tf as cftf
index_dir, out = sys.argv[1], sys.argv[2]
feats = ["image", "mask", "label", "patch", "counts", "caption", "tokens", "meta/weight"]
ds = cftf.dataset(index_dir, split="train", batch_size=None, shuffle="none", features=feats, engine="native")
rows = [{k: (v.numpy() if hasattr(v, "numpy") else v) for k, v in r.items()} for r in ds]
with open(out, "wb") as f:
    pickle.dump(rows, f)
"""


def test_tensorflow_native_engine_reads_the_index_dir(prepared, tmp_path):
    """tf.data's own TFRecordDataset opens the shards where they lie (the manifest's data_root)."""
    data = _copy(prepared, tmp_path)
    index_dataset(data, index_dir=tmp_path / "idx")
    out = tmp_path / "tf.pkl"
    run_python(_READ_WITH_TF_NATIVE, str(tmp_path / "idx"), str(out), timeout=300)
    with open(out, "rb") as f:
        rows = pickle.load(f)
    assert len(rows) == len(prepared[1]["train"])
    for i, (g, w) in enumerate(zip(rows, prepared[1]["train"])):
        g = {k: v.decode("utf-8") if isinstance(v, bytes) else v for k, v in g.items()}
        _assert_same(g, {k: w[k] for k in g}, f"tf native train[{i}]")


def test_tf_written_shards_plain_and_gzip_go_through_an_index_dir(tmp_path):
    """The general plumbing, without TFDS: declared features, a GZIP shard, --force re-indexing."""
    from crossfeed.format import example as ex
    from crossfeed.format import tfrecord

    data = tmp_path / "shards"
    data.mkdir()
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (12, 4, 4, 3), dtype=np.uint8)
    for s, compress in ((0, False), (1, True)):
        path = data / (f"train-{s:05d}-of-00002.tfrecord" + (".gz" if compress else ""))
        with tfrecord.RecordWriter(path, compress=compress) as w:
            for i in range(s, 12, 2):
                w.write(
                    ex.encode(
                        {
                            "image": (ex.BYTES, ex.encode_bytes_list([images[i].tobytes()])),
                            "label": (ex.INT64, ex.encode_int64_list([i])),
                        }
                    )
                )
    before = snapshot(data)
    args = ("index", data, "--index-dir", tmp_path / "idx", "--feature", "image=tensor:uint8:4,4,3")
    _cli(*args)
    assert _cli(*args, check=False).returncode != 0  # indexed already
    _cli(*args, "--force")
    assert snapshot(data) == before
    assert sorted(os.listdir(tmp_path / "idx")) == [
        "crossfeed.json",
        "train-00000-of-00002.tfrecord.idx",
        "train-00001-of-00002.tfrecord.gz.idx",
    ]
    with crossfeed.Loader(tmp_path / "idx", batch_size=5, shuffle="global", seed=4) as loader:
        seen = [(int(label), img) for b in loader for label, img in zip(b["label"], b["image"])]
    assert sorted(label for label, _ in seen) == list(range(12))
    for label, img in seen:
        np.testing.assert_array_equal(img, images[label])
    assert "12 records in 2 shards" in _cli("verify", tmp_path / "idx").stdout
