"""A mixture of every format the Loader reads — a WebDataset tar, a TFRecord dataset and a
Parquet file, their features renamed to one set of names — keeps every mixture property: each
sample is what its source alone delivers, exact proportions over every prefix, exact resumption
from any batch, elastic resumption at another world size, equal steps per rank; and images
brought to one size at decode time batch densely in the thread and the process executors."""

from __future__ import annotations

import numpy as np
import pytest
from adopt_helpers import trusted_roots  # noqa: F401 (autouse: the tests' data roots are trusted)
from loader_helpers import assert_resumes_identically, ids_of
from photo_data import WEIGHTS, halves, labels, sources, write_all

import crossfeed
from crossfeed.errors import ConfigError, SchemaError
from crossfeed.format.schema import Encoding, Feature, mix_feature

KINDS = ("tar", "tfrecord", "parquet")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return write_all(tmp_path_factory.mktemp("formats"))


def _alone(path, rename: dict) -> dict[int, dict]:
    """Every sample of one source read alone, in index order, under the mixture's names."""
    out = {}
    with crossfeed.Loader(path, batch_size=4, shuffle="none", return_index=True) as ld:
        for b in ld:
            for j, i in enumerate(b["__index__"].tolist()):
                out[i] = {rename.get(k, k): b[k][j] for k in b if k != "__index__"}
    return out


def test_each_sample_is_what_its_source_alone_delivers_renamed(paths):
    mix = sources(paths)
    alone = [_alone(paths[k], dict(s.rename)) for k, s in zip(KINDS, mix)]
    for k, samples in zip(KINDS, alone):  # (a TFRecord dataset's index order is not its write order)
        assert sorted(int(v["label"]) for v in samples.values()) == sorted(labels(k))
    with crossfeed.Loader(mix, batch_size=7, seed=4, return_index=True, samples_per_epoch=60) as ld:
        assert [f.name for f in ld.features] == ["label", "image"]
        assert ld.features[1].shape == (None, None, None)  # (None, None, 3) and gray: the more general
        batches = list(ld)
    seen = 0
    for b in batches:
        assert set(b) == {"image", "label", "__source__", "__index__"} and b["label"].dtype == np.int64
        for j, (s, i) in enumerate(zip(b["__source__"].tolist(), b["__index__"].tolist())):
            want = alone[s][i]
            assert int(b["label"][j]) == int(want["label"])
            np.testing.assert_array_equal(b["image"][j], want["image"], err_msg=f"source {s} sample {i}")
            seen += 1
    assert seen == 60
    src = np.concatenate([b["__source__"] for b in batches])
    counts = np.cumsum(src[:, None] == np.arange(3)[None, :], axis=0)
    w = np.array([WEIGHTS[k] for k in KINDS])
    assert np.abs(counts - np.arange(1, 61)[:, None] * w / w.sum()).max() < 1  # every prefix, within one sample
    for s, k in enumerate(KINDS):  # each source pass by pass: a pass is a permutation of its samples
        idx = np.concatenate([b["__index__"][b["__source__"] == s] for b in batches])
        n = len(labels(k))
        for p in range(len(idx) // n):
            assert sorted(idx[p * n : (p + 1) * n].tolist()) == list(range(n))


@pytest.mark.parametrize("shuffle", ["global", "block"])
def test_the_mixture_resumes_identically_from_every_batch(paths, shuffle):
    assert_resumes_identically(
        sources(paths), batch_size=6, seed=2, shuffle=shuffle, samples_per_epoch=42, image_size=(6, 6), channels=3
    )


def test_ranks_get_equal_steps_and_resume_elastically_at_another_world_size(paths):
    mix = sources(paths)
    kw = dict(batch_size=4, seed=9, samples_per_epoch=72, remainder="drop", return_index=True)
    with crossfeed.Loader(mix, **kw) as whole:
        reference = np.concatenate(ids_of(whole))
    first, state = [], None
    for r in range(3):  # 3 ranks take 2 lockstep steps ...
        with crossfeed.Loader(mix, rank=r, world_size=3, **kw) as ld:
            assert len(ld) == 6
            it = iter(ld)
            first += ids_of([next(it) for _ in range(2)])
            state = ld.state_dict()
    rest = []
    for r in range(2):  # ... then 2 ranks finish the epoch from the state
        with crossfeed.Loader(mix, rank=r, world_size=2, **kw) as ld:
            ld.load_state_dict(state)
            assert len(ld) == 6  # 48 positions left: 24 per rank
            rest += ids_of(ld)
    got = np.concatenate(first + rest)
    assert state["position"] == 24 and len(got) == 72 and sorted(got.tolist()) == sorted(reference.tolist())


@pytest.mark.parametrize("resize", ["stretch", "crop", "pad"])
def test_photos_of_any_size_and_channels_batch_densely_at_the_image_size(paths, resize):
    with crossfeed.Loader(
        sources(paths), batch_size=8, seed=1, image_size=(10, 12), channels=3, resize=resize, samples_per_epoch=40
    ) as ld:
        assert ld.features[1] == Feature("image", "uint8", (10, 12, 3), Encoding.IMAGE)
        batches = list(ld)
    for b in batches:
        assert b["image"].shape == (len(b["label"]), 10, 12, 3) and b["image"].dtype == np.uint8
        for im, y in zip(b["image"], b["label"].tolist()):
            if resize == "pad":  # zero border above and below or left and right, the photo between
                rows, cols = np.flatnonzero(im.any(axis=(1, 2))), np.flatnonzero(im.any(axis=(0, 2)))
                im = im[rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1]
            assert halves(im, y), (resize, y)


@pytest.mark.slow
def test_the_process_executor_fits_and_merges_as_the_threads_do(paths):
    kw = dict(batch_size=5, seed=3, image_size=(7, 7), channels=1, samples_per_epoch=30, return_index=True)
    with crossfeed.Loader(sources(paths), **kw) as ld:
        threads = list(ld)
    with crossfeed.Loader(sources(paths), executor="process", processes=2, **kw) as ld:
        procs = list(ld)
    assert len(threads) == len(procs) == 6
    for a, b in zip(threads, procs):
        assert a.keys() == b.keys() and a["image"].shape == (5, 7, 7, 1)
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])


def test_source_features_and_rename_are_checked(paths):
    tar, tfr, pq = sources(paths)
    with crossfeed.Loader([tar, tfr], batch_size=4, features=["label"]) as ld:  # one feature, from both
        assert set(next(iter(ld))) == {"label"}
    picked = crossfeed.Source(paths["tar"], rename={"cls": "label"}, features=["label"])
    with crossfeed.Loader([picked, tfr], batch_size=4) as ld:
        assert [f.name for f in ld.features] == ["label"]
    with pytest.raises(ConfigError, match=r"source 0 .*rename= names \['png'\], not features of it"):
        crossfeed.Loader([crossfeed.Source(paths["tar"], rename={"png": "image"}), tfr], batch_size=4)
    with pytest.raises(ConfigError, match=r"source 1 .* has no feature 'txt'; it has \['image', 'label'\]"):
        crossfeed.Loader([tar, tfr], batch_size=4, features=["txt"])
    with pytest.raises(ConfigError, match="share no feature"):  # no rename: jpg/cls and image/label
        crossfeed.Loader([crossfeed.Source(paths["tar"]), tfr], batch_size=4, features=None)
    with pytest.raises(ConfigError, match="two features one name"):
        crossfeed.Source(paths["tar"], rename={"jpg": "image", "png": "image"})


def test_a_mixture_feature_takes_the_more_general_shape_and_dtype():
    a = Feature("x", "int32", (3,), Encoding.TENSOR)
    b = Feature("x", "int64", (None,), Encoding.INT64)
    assert mix_feature("x", [a, b], ["a", "b"]) == Feature("x", "int64", (None,), Encoding.INT64)
    rgb = Feature("im", "uint8", (None, None, 3), Encoding.IMAGE)
    any_ = Feature("im", "uint8", (None, None, None), Encoding.IMAGE)
    assert mix_feature("im", [rgb, any_], ["a", "b"]).shape == (None, None, None)
    with pytest.raises(SchemaError, match="no source's dtype holds"):  # int64 and uint64: only float64 would
        mix_feature("x", [b, Feature("x", "uint64", (3,), Encoding.TENSOR)], ["a", "b"])
    with pytest.raises(SchemaError, match="different ranks"):
        mix_feature("x", [a, Feature("x", "int32", (3, 1), Encoding.TENSOR)], ["a", "b"])
