"""Keras on photos of different sizes: with ``image_size=(32, 32), channels=3`` the decoder brings
every photo (JPEG or PNG, colour or gray, any size) to one shape as it decodes it, so a batch of
32 is one dense ``(32, 32, 32, 3)`` tensor — no RaggedTensor, no resize in a ``map`` — and
``model.fit`` trains on a webdataset tar alone and on the tar + TFRecord + Parquet mixture."""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import lazy_import

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from adopt_helpers import trusted_roots  # noqa: F401 (autouse: the tests' data roots are trusted)
from photo_data import CLASSES, sources, write_all

import crossfeed

tf = lazy_import("tensorflow")
cftf = lazy_import("crossfeed.adapters.tf")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # slow: TensorFlow imported


def _model():
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential(
        [
            tf.keras.Input((32, 32, 3)),
            tf.keras.layers.Rescaling(1 / 255),
            tf.keras.layers.Conv2D(4, 3, strides=2, activation="relu"),
            tf.keras.layers.GlobalAveragePooling2D(),
            tf.keras.layers.Dense(CLASSES),
        ]
    )
    model.compile("adam", tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return write_all(tmp_path_factory.mktemp("photos"))


def test_keras_fits_on_photos_of_different_sizes_from_a_webdataset_tar(paths):
    ds = cftf.dataset(paths["tar"], batch_size=32, image_size=(32, 32), channels=3, features=["jpg", "cls"])
    assert ds.element_spec["jpg"] == tf.TensorSpec((None, 32, 32, 3), tf.uint8)  # dense, not ragged
    history = _model().fit(ds.map(lambda b: (b["jpg"], b["cls"])), epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2 and np.isfinite(history.history["loss"]).all()


def test_keras_fits_on_the_mixture_of_three_formats_with_the_loaders_batches(paths):
    kw = dict(batch_size=32, seed=1, samples_per_epoch=96, image_size=(32, 32), channels=3)
    ds = cftf.dataset(sources(paths), **kw)
    assert ds.element_spec["image"] == tf.TensorSpec((None, 32, 32, 3), tf.uint8)
    assert int(ds.cardinality()) == 3
    with crossfeed.Loader(sources(paths), **kw) as ld:
        want = list(ld)
    for a, b in zip(ds, want):  # the plan engine delivers the Loader's batches
        np.testing.assert_array_equal(a["image"].numpy(), b["image"])
        np.testing.assert_array_equal(a["label"].numpy(), b["label"])
    history = _model().fit(ds.map(lambda b: (b["image"], b["label"])), epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2 and np.isfinite(history.history["loss"]).all()
    assert cftf.element_spec(paths["tar"], batch_size=32, image_size=(32, 32), channels=3)["jpg"].shape[1:] == (
        32,
        32,
        3,
    )
