"""The Loader's fast paths against TensorFlow's own reader (STYLE.md habit 16): every batch, value
for value, equals what ``tf.data.TFRecordDataset`` + ``tf.io.parse_example`` + ``tf.io.decode_raw``
make of the same records, matched by the Loader's ``__index__`` (global indices, shard order).

Shards written by `crossfeed.write_dataset` and by ``tf.io.TFRecordWriter`` (then adopted with
``crossfeed index``, which calls an undeclared raw tensor ``bytes``: those are compared as bytes),
at the sizes where each path switches on: batches of ≥ 1 MiB of 64×64×3 uint8/float32 tensors
(records > 4096 bytes: the big-value copy), values of 508 / 512 / 516 bytes around the big-value
threshold, and small records (≤ 4096 framed bytes: the columnar path) with int64 varints of 1 to 10
bytes. Imports tensorflow, never torch.
"""

from __future__ import annotations

import shutil
import struct

import numpy as np
import pytest
from conftest import lazy_import
from typer.testing import CliRunner

import crossfeed
from crossfeed import Encoding, Feature, ReadOptions, Schema
from crossfeed.cli.main import app

tf = lazy_import("tensorflow")
pytestmark = pytest.mark.slow  # TensorFlow imported: its parser as the reference


CODES = (0, 127, 128, 2**40, -1)  # varints of 1, 1, 2, 6 and 10 bytes
LABEL0 = 2**20
N_SHARDS = 3

# name → (dtype, shape, encoding): the samples written by both writers
SMALL_FEATURES = {
    "label": ("int64", (), Encoding.INT64),
    "code": ("int64", (), Encoding.INT64),
    "score": ("float32", (), Encoding.FLOAT),
    "emb": ("float32", (4,), Encoding.FLOAT),
    "v508": ("uint8", (508,), Encoding.TENSOR),
    "v512": ("uint8", (512,), Encoding.TENSOR),
    "v516": ("float32", (129,), Encoding.TENSOR),
}
BIG_FEATURES = {
    **SMALL_FEATURES,
    "img": ("uint8", (64, 64, 3), Encoding.TENSOR),
    "imgf": ("float32", (64, 64, 3), Encoding.TENSOR),
}
NUMERIC = ["label", "code", "score", "emb"]


def _samples(feats: dict, n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        s = {}
        for name, (dtype, shape, _enc) in feats.items():
            if name == "label":  # a 3-byte varint in every record: only `code` varies the record length,
                s[name] = LABEL0 + i  # so records of one length share one layout (the columnar path holds)
            elif name == "code":
                s[name] = CODES[i % len(CODES)]
            elif dtype == "uint8":
                s[name] = rng.integers(0, 256, shape, dtype=np.uint8)
            else:
                s[name] = rng.standard_normal(shape).astype(np.float32)
        out.append(s)
    return out


def _write_crossfeed(root, feats, samples) -> None:
    schema = Schema([Feature(k, d, s, e) for k, (d, s, e) in feats.items()])
    crossfeed.write_dataset(root, samples, num_shards=N_SHARDS, schema=schema).close()


def _tf_example(feats, s) -> bytes:
    f = {}
    for name, (_, _, enc) in feats.items():
        v = s[name]
        if enc is Encoding.TENSOR:
            f[name] = tf.train.Feature(bytes_list=tf.train.BytesList(value=[np.ascontiguousarray(v).tobytes()]))
        elif enc is Encoding.INT64:
            f[name] = tf.train.Feature(int64_list=tf.train.Int64List(value=np.atleast_1d(v).tolist()))
        else:
            f[name] = tf.train.Feature(float_list=tf.train.FloatList(value=np.atleast_1d(v).tolist()))
    return tf.train.Example(features=tf.train.Features(feature=f)).SerializeToString()


def _write_tf(root, feats, samples) -> None:
    root.mkdir(parents=True)
    writers = [tf.io.TFRecordWriter(str(root / f"train-{s:05d}-of-{N_SHARDS:05d}.tfrecord")) for s in range(N_SHARDS)]
    for i, s in enumerate(samples):
        writers[i % N_SHARDS].write(_tf_example(feats, s))
    for w in writers:
        w.close()
    result = CliRunner().invoke(app, ["index", str(root)])
    assert result.exit_code == 0, result.output


def tf_reference(root, feats: dict) -> dict:
    """Every record of the split, in shard order, as TensorFlow parses it: ``{name: array}``
    (raw tensors through ``decode_raw``) plus ``{name + "/bytes": list of bytes}``."""
    with crossfeed.open_dataset(root) as ds:
        sp = ds["train"]
        paths = [sp.file(s).path for s in range(len(sp.counts))]
    spec = {}
    for name, (_dtype, shape, enc) in feats.items():
        if enc is Encoding.TENSOR:
            spec[name] = tf.io.FixedLenFeature([], tf.string)
        else:
            spec[name] = tf.io.FixedLenFeature(list(shape), tf.int64 if enc is Encoding.INT64 else tf.float32)
    parts: dict[str, list] = {}
    for recs in tf.data.TFRecordDataset(paths).batch(64):
        p = tf.io.parse_example(recs, spec)
        for name, (dtype, shape, enc) in feats.items():
            if enc is Encoding.TENSOR:
                parts.setdefault(name + "/bytes", []).extend(p[name].numpy().tolist())
                arr = tf.reshape(tf.io.decode_raw(p[name], tf.as_dtype(dtype)), [-1, *shape])
            else:
                arr = p[name]
            parts.setdefault(name, []).append(arr.numpy())
    return {k: (v if k.endswith("/bytes") else np.concatenate(v)) for k, v in parts.items()}


def _dataset(tmp_path_factory, writer: str, feats: dict, seed: int, n: int):
    root = tmp_path_factory.mktemp(f"tfo-{writer}") / "ds"
    samples = _samples(feats, n, seed)
    (_write_crossfeed if writer == "crossfeed" else _write_tf)(root, feats, samples)
    ref = tf_reference(root, feats)
    assert len(ref["label"]) == n and sorted(ref["label"].tolist()) == list(range(LABEL0, LABEL0 + n))
    return root, ref


@pytest.fixture(scope="module", params=["crossfeed", "tf"])
def big(request, tmp_path_factory):
    """300 records of ~62 KB in 3 shards: a batch of 32 `imgf` is 1.5 MiB."""
    return request.param, *_dataset(tmp_path_factory, request.param, BIG_FEATURES, 11, 300)


@pytest.fixture(scope="module", params=["crossfeed", "tf"])
def small(request, tmp_path_factory):
    """600 records of ~1.7 KB (framed ≤ 4096 bytes: the columnar path) in 3 shards."""
    return request.param, *_dataset(tmp_path_factory, request.param, SMALL_FEATURES, 12, 600)


def assert_matches_tf(batch: dict, ref: dict, feats: dict, schema) -> None:
    idx = batch["__index__"]
    for name in (k for k in batch if k != "__index__"):
        got = batch[name]
        if schema[name].encoding is Encoding.BYTES:  # an adopted raw tensor, undeclared: bytes
            assert got.dtype == object and got.shape == (len(idx),)
            assert [bytes(v) for v in got] == [ref[name + "/bytes"][i] for i in idx.tolist()], name
            continue
        want = ref[name][idx]
        assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, got.shape, want.dtype, want.shape)
        np.testing.assert_array_equal(got, want, err_msg=f"feature {name!r}")


def read_and_compare(root, ref, feats, *, batch_size, shuffle, features=None, epochs=1, keep=False, **kw):
    kept = []
    with crossfeed.Loader(
        root, batch_size=batch_size, shuffle=shuffle, seed=7, return_index=True, features=features, **kw
    ) as loader:
        schema = loader.dataset.schema
        for _ in range(epochs):
            seen = []
            for b in loader:
                assert_matches_tf(b, ref, feats, schema)
                seen.append(b["__index__"])
                if keep:
                    kept.append(b)
            assert sorted(np.concatenate(seen).tolist()) == list(range(len(ref["label"])))
    for b in kept:  # nothing delivered earlier was overwritten since
        assert_matches_tf(b, ref, feats, schema)
    return kept


def test_adopted_schema(small):
    """What `crossfeed index` makes of TensorFlow-written shards: raw tensors are `bytes`."""
    writer, root, _ = small
    with crossfeed.open_dataset(root) as ds:
        enc = {f.name: f.encoding for f in ds.schema}
    if writer == "tf":
        assert enc["v512"] is Encoding.BYTES and enc["emb"] is Encoding.FLOAT and enc["code"] is Encoding.INT64
    else:
        assert enc["v512"] is Encoding.TENSOR


@pytest.mark.parametrize("shuffle", ["none", "global", "block"])
@pytest.mark.parametrize("batch_size", [1, 7, 32, 128, 256])
def test_big_records_match_tf(big, shuffle, batch_size):
    _, root, ref = big
    read_and_compare(root, ref, BIG_FEATURES, batch_size=batch_size, shuffle=shuffle)


@pytest.mark.parametrize("shuffle", ["none", "global", "block"])
@pytest.mark.parametrize("batch_size", [1, 7, 32, 256])
def test_small_records_match_tf(small, shuffle, batch_size):
    _, root, ref = small
    read_and_compare(root, ref, SMALL_FEATURES, batch_size=batch_size, shuffle=shuffle)
    # numeric features only (today a feature subset makes the fixed-layout path step aside: the
    # values of the features left out count as layout bytes, which differ between records)
    read_and_compare(root, ref, SMALL_FEATURES, batch_size=batch_size, shuffle=shuffle, features=NUMERIC)


def _spanning(root, ref, feats) -> None:
    n = len(ref["label"])
    read_and_compare(root, ref, feats, batch_size=n - 1, shuffle="none", epochs=2)  # one batch over every shard
    read_and_compare(root, ref, feats, batch_size=n // 2 + 1, shuffle="global")


def test_big_batches_spanning_shards_match_tf(big):
    _spanning(big[1], big[2], BIG_FEATURES)


def test_small_batches_spanning_shards_match_tf(small):
    _spanning(small[1], small[2], SMALL_FEATURES)


def test_kept_batches_match_tf_after_several_epochs(big):
    """Every batch of three epochs kept alive, then compared again: the recycler hands out no
    array still in use."""
    _, root, ref = big
    kept = read_and_compare(
        root,
        ref,
        BIG_FEATURES,
        batch_size=32,
        shuffle="global",
        epochs=3,
        keep=True,
        read=ReadOptions(num_threads=2, prefetch=2),
    )
    assert len(kept) == 3 * 10


def test_int64_vectors_whose_varint_widths_differ_match_tf(tmp_path):
    """Equal-length records whose int64 pair splits its bytes differently ([128, 0] vs [0, 128])."""
    pairs = [[128, 0], [0, 128], [2**40, 1], [1, 2**40], [-1, 0], [0, -1], [127, 128], [128, 127]]
    feats = {
        "label": ("int64", (), Encoding.INT64),
        "ids": ("int64", (2,), Encoding.INT64),
        "x": ("uint8", (16,), Encoding.TENSOR),
    }
    samples = [{**s, "ids": np.array(pairs[i % len(pairs)], np.int64)} for i, s in enumerate(_samples(feats, 96, 3))]
    for writer in ("crossfeed", "tf"):
        root = tmp_path / writer
        (_write_crossfeed if writer == "crossfeed" else _write_tf)(root, feats, samples)
        ref = tf_reference(root, feats)
        for shuffle in ("none", "global"):
            for b in (2, 8, 96):
                read_and_compare(root, ref, feats, batch_size=b, shuffle=shuffle)


def _flip(src, dst, shard: int, record: int, at: int, new: bytes | None) -> None:
    """Copy dataset ``src`` to ``dst``, overwrite bytes at ``at`` of one framed record (None: invert one)."""
    shutil.copytree(src, dst)
    with crossfeed.open_dataset(dst) as ds:
        sp = ds["train"]
        path, off = sp.file(shard).path, int(sp.index(shard)[record][0])
    with open(path, "r+b") as f:
        f.seek(off + at)
        old = f.read(len(new or b"x"))
        f.seek(off + at)
        f.write(new if new is not None else bytes(b ^ 0xFF for b in old))  # None: invert the byte
    assert new is None or new != old


def _refused(root, ref, bad, damage: str, shuffle: str) -> None:
    """A flipped byte inside a value (the layout still fits), or a length header one more than the
    index says (its CRC that of the true length): TensorFlow's reader refuses the shard, and so
    must every crossfeed path."""
    with crossfeed.open_dataset(root) as ds:
        sp = ds["train"]
        off, length = (int(x) for x in sp.index(1)[4])
        files = [sp.file(s).path.replace(str(root), str(bad)) for s in range(len(sp.counts))]
        with open(sp.file(1).path, "rb") as f:
            payload = f.read(off + length)[off + 12 : off + length - 4]
    at = payload.find(ref["v508/bytes"][int(sp.starts[1]) + 4])
    assert at > 0
    _flip(root, bad, 1, 4, *((12 + at + 10, None) if damage == "payload" else (0, struct.pack("<Q", length - 16 + 1))))
    with pytest.raises(tf.errors.DataLossError):
        for _ in tf.data.TFRecordDataset(files):
            pass
    with (
        pytest.raises(crossfeed.CorruptRecordError),
        crossfeed.Loader(bad, batch_size=64, shuffle=shuffle, seed=0) as loader,
    ):
        for _ in loader:
            pass


@pytest.mark.parametrize("damage", ["payload", "length"])
@pytest.mark.parametrize("shuffle", ["none", "global"])
def test_damaged_small_records_are_refused_like_tf_refuses_them(small, tmp_path, damage, shuffle):
    _refused(small[1], small[2], tmp_path / "bad", damage, shuffle)


@pytest.mark.parametrize("damage", ["payload", "length"])
@pytest.mark.parametrize("shuffle", ["none", "global"])
def test_damaged_big_records_are_refused_like_tf_refuses_them(big, tmp_path, damage, shuffle):
    _refused(big[1], big[2], tmp_path / "bad", damage, shuffle)
