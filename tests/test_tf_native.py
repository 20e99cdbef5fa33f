"""The TensorFlow adapter's native engine and specs, in process, on tiny generated data."""

from __future__ import annotations

import io

import numpy as np
import pytest
from conftest import lazy_import

import crossfeed
from crossfeed import ConfigError, DatasetNotFoundError, Encoding, Feature, Schema, SchemaError

tf = lazy_import("tensorflow")
cftf = lazy_import("crossfeed.adapters.tf")
pytestmark = pytest.mark.slow  # TensorFlow imported


def _png(arr: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(arr.squeeze(-1) if arr.shape[-1] == 1 else arr).save(buf, format="PNG")
    return buf.getvalue()


RICH = Schema(
    [
        Feature("id", "int64", (), Encoding.INT64),
        Feature("half", "float16", (2, 3), Encoding.TENSOR),
        Feature("u32", "uint32", (None,), Encoding.TENSOR),
        Feature("mask", "bool", (2,), Encoding.TENSOR),
        Feature("img", "uint8", (4, 5, 3), Encoding.IMAGE),
        Feature("gray", "uint8", (None, None, 1), Encoding.IMAGE),
        Feature("tokens", "int64", (None,), Encoding.INT64),
        Feature("score", "float32", (2,), Encoding.FLOAT),
        Feature("name", "string", (), Encoding.BYTES),
        Feature("tags", "bytes", (None,), Encoding.BYTES),
    ]
)


def rich_samples(n: int) -> list[dict]:
    rng = np.random.default_rng(7)
    return [
        {
            "id": i,
            "half": rng.standard_normal((2, 3)).astype(np.float16),
            "u32": np.arange(i % 4, dtype=np.uint32) * np.uint32(1 << 30),
            "mask": np.array([i % 2 == 0, i % 3 == 0]),
            "img": _png(rng.integers(0, 255, (4, 5, 3), dtype=np.uint8)),
            "gray": _png(rng.integers(0, 255, (2 + i % 3, 3, 1), dtype=np.uint8)),
            "tokens": list(range(i % 3)),
            "score": np.array([i, -i], np.float32) / 3,
            "name": f"sample-{i}",
            "tags": [b"t%d" % j for j in range(i % 2 + 1)],
        }
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def rich(tmp_path_factory):
    root = tmp_path_factory.mktemp("rich")
    samples = rich_samples(23)
    crossfeed.write_dataset(root, samples, num_shards=3, schema=RICH).close()
    return root, samples


def _records(dataset) -> list[dict]:
    """Every sample of a dataset (batched or not) as python values, in delivery order."""
    out = []
    for el in dataset:
        el = {k: (v.to_list() if isinstance(v, tf.RaggedTensor) else v.numpy()) for k, v in el.items()}
        n = len(el["id"]) if np.ndim(el["id"]) else None
        if n is None:
            out.append(el)
        else:
            out += [{k: v[j] for k, v in el.items()} for j in range(n)]
    return out


def _expected(sample: dict) -> dict:
    from crossfeed.format.schema import decode_image

    return {
        **sample,
        "img": decode_image(sample["img"]),
        "gray": decode_image(sample["gray"]),
        "name": sample["name"].encode(),
    }


def _assert_same(got: dict, want: dict):
    for k, w in want.items():
        g = got[k]
        if isinstance(w, (list, tuple)) or (isinstance(w, np.ndarray) and isinstance(g, list)):
            assert [np.asarray(x).tolist() for x in g] == [np.asarray(x).tolist() for x in w], k
        else:
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=k)


@pytest.mark.parametrize("batch_size", [None, 4])
def test_native_values_equal_written_samples(rich, batch_size):
    root, samples = rich
    ds = cftf.dataset(root, batch_size=batch_size, drop_last=False, seed=3)
    got = sorted(_records(ds), key=lambda r: int(r["id"]))
    assert [int(r["id"]) for r in got] == list(range(len(samples)))
    for g, s in zip(got, samples):
        _assert_same(g, _expected(s))


@pytest.mark.parametrize("batch_size,drop_last", [(None, True), (4, True), (4, False)])
def test_element_spec_comes_from_the_manifest(rich, batch_size, drop_last):
    root, _ = rich
    ds = cftf.dataset(root, batch_size=batch_size, drop_last=drop_last)
    assert ds.element_spec == cftf.element_spec(root, batch_size=batch_size, drop_last=drop_last)
    spec = ds.element_spec
    lead = [] if batch_size is None else [batch_size if drop_last else None]
    assert spec["half"] == tf.TensorSpec(lead + [2, 3], tf.float16)
    assert spec["img"] == tf.TensorSpec(lead + [4, 5, 3], tf.uint8)
    assert spec["name"].dtype == tf.string and spec["mask"].dtype == tf.bool
    if batch_size is not None:
        assert spec["gray"] == tf.RaggedTensorSpec(lead + [None, None, 1], tf.uint8, 2, tf.int64)
        assert spec["tokens"] == tf.RaggedTensorSpec(lead + [None], tf.int64, 1, tf.int64)
        for batch in ds:  # every element conforms to the spec it announced
            assert all(spec[k].is_compatible_with(v) for k, v in batch.items())


def test_feature_spec_reads_with_plain_tf_data(mixed_dataset):
    root, samples = mixed_dataset
    ds = crossfeed.open_dataset(root)
    files = [str(root / sh.file) for sh in ds["train"].shards]
    spec = cftf.feature_spec(root)
    assert spec["image"] == tf.io.FixedLenFeature([], tf.string)  # raw tensor bytes
    batch = next(iter(tf.data.TFRecordDataset(files).batch(100).map(lambda b: tf.io.parse_example(b, spec))))
    by_label = {int(v): i for i, v in enumerate(batch["label"].numpy())}
    assert sorted(by_label) == list(range(len(samples)))
    for s in samples:
        i = by_label[s["label"]]
        img = tf.reshape(tf.io.decode_raw(batch["image"][i], tf.uint8), [4, 5, 3]).numpy()
        np.testing.assert_array_equal(img, s["image"])
        assert batch["tokens"][i].numpy().tolist() == s["tokens"]
        assert batch["name"][i].numpy() == s["name"].encode()


def _labels(ds) -> list[int]:
    return [int(x) for b in ds for x in np.atleast_1d(b["label"].numpy())]


def test_native_order_is_a_function_of_seed_and_epoch(mixed_dataset):
    root, samples = mixed_dataset
    a = _labels(cftf.dataset(root, batch_size=4, seed=5, shuffle_buffer=8))
    assert a == _labels(cftf.dataset(root, batch_size=4, seed=5, shuffle_buffer=8))
    assert a != _labels(cftf.dataset(root, batch_size=4, seed=6, shuffle_buffer=8))
    assert a != _labels(cftf.dataset(root, batch_size=4, seed=5, epoch=1, shuffle_buffer=8))
    assert len(a) == len(samples)  # the last partial batch is kept (drop_last=False, as in the Loader)
    # shuffle="none" is index (shard) order, as the dataset itself iterates
    index_order = [s["label"] for s in crossfeed.open_dataset(root)["train"]]
    assert _labels(cftf.dataset(root, batch_size=None, shuffle="none")) == index_order


def test_each_pass_reshuffles_deterministically(mixed_dataset):
    root, _ = mixed_dataset
    ds = cftf.dataset(root, batch_size=5, seed=1)
    first, second = _labels(ds), _labels(ds)
    assert sorted(first) == sorted(second) and first != second
    assert first == _labels(cftf.dataset(root, batch_size=5, seed=1))


@pytest.mark.parametrize("num_shards,world_size", [(3, 2), (5, 2), (2, 3)])
def test_ranks_read_equal_disjoint_shares(tmp_path, num_shards, world_size):
    root = tmp_path / "d"
    crossfeed.write_dataset(root, [{"label": i} for i in range(31)], num_shards=num_shards).close()
    shares = [
        _labels(cftf.dataset(root, batch_size=None, seed=2, rank=r, world_size=world_size)) for r in range(world_size)
    ]
    assert len({len(s) for s in shares}) == 1  # equal, so no rank waits on another
    flat = [x for s in shares for x in s]
    assert len(flat) == len(set(flat)) >= 31 - world_size * 8


def test_gzip_shards_and_feature_selection(tmp_path):
    root = tmp_path / "gz"
    crossfeed.write_dataset(
        root, [{"label": i, "x": np.full(3, i, np.int16)} for i in range(10)], num_shards=2, compress=True
    ).close()
    ds = cftf.dataset(root, batch_size=10, shuffle="none", features=["x"])
    assert list(ds.element_spec) == ["x"]
    (batch,) = list(ds)
    assert sorted(batch["x"].numpy()[:, 0].tolist()) == list(range(10))


def test_options_are_validated(mixed_dataset, tmp_path):
    root, _ = mixed_dataset
    with pytest.raises(ConfigError, match="batch_size"):
        cftf.dataset(root, batch_size=0)
    with pytest.raises(ConfigError, match="shuffle"):
        cftf.dataset(root, shuffle="sometimes")
    with pytest.raises(ConfigError, match="engine"):
        cftf.dataset(root, engine="fast")
    with pytest.raises(ConfigError, match="rank"):
        cftf.dataset(root, rank=2, world_size=2)
    with pytest.raises(ConfigError, match="plan"):
        cftf.dataset(root, batch_size=2, engine="native", return_index=True)
    with pytest.raises(ConfigError, match="no split"):
        cftf.dataset(root, split="test")
    with pytest.raises(SchemaError, match="nope"):
        cftf.dataset(root, features=["nope"])
    with pytest.raises(DatasetNotFoundError):
        cftf.dataset(tmp_path / "nothing-here")
    (root / crossfeed.open_dataset(root)["train"].shards[0].file).unlink()
    with pytest.raises(DatasetNotFoundError, match="missing"):
        cftf.dataset(root, engine="native")


def test_native_and_plan_deliver_the_same_samples(rich):
    root, samples = rich
    native = _records(cftf.dataset(root, batch_size=5, drop_last=False, seed=9, engine="native"))
    plan = _records(cftf.dataset(root, batch_size=5, drop_last=False, seed=9, engine="plan"))
    assert cftf.dataset(root, batch_size=5, engine="plan").element_spec == cftf.element_spec(root, batch_size=5)
    assert [int(r["id"]) for r in native] != [int(r["id"]) for r in plan]  # orders differ (documented) ...
    native.sort(key=lambda r: int(r["id"]))
    plan.sort(key=lambda r: int(r["id"]))
    assert [int(r["id"]) for r in native] == [int(r["id"]) for r in plan] == list(range(len(samples)))
    for n, p in zip(native, plan):  # ... the samples and their values do not
        _assert_same(n, p)


@pytest.mark.parametrize("name", RICH.names)
def test_each_codec_tf_spec_reads_what_it_encodes(name):
    """Each kind's TF parse spec, dtype and in-graph decoding (the codec's) read with TF's own
    parser what the codec encodes, and give the values crossfeed's own decoder gives."""
    from crossfeed.format import example as ex
    from crossfeed.format.encode import encode_sample
    from crossfeed.format.schema import decode_value

    f = RICH[name]
    codec = f.codec
    schema = Schema([f])
    for s in rich_samples(4):
        payload = encode_sample(schema, {name: s[name]})
        spec = codec.tf_parse_spec(f, tf)
        assert set(spec) == set(codec.slots(f))
        parsed = tf.io.parse_single_example(payload, spec)
        got = codec.tf_decode(f, parsed[name], parsed, tf)
        assert got.dtype == codec.tf_dtype(f, tf)
        want = decode_value(f, ex.decode(payload))
        if codec.text:
            got = [v.decode() if f.dtype == "string" else v for v in np.atleast_1d(got.numpy()).tolist()]
            assert got == (want if isinstance(want, list) else [want])
        else:
            np.testing.assert_array_equal(got.numpy(), want)
