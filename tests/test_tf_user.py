"""The TensorFlow adapter on a new user's data: exact cardinality (Keras metrics), input_fn counting
with loader_options, and the same shapes and samples as the Loader (dense when the manifest says
every record has one shape; ragged photos; the partial last batch kept). Imports TF, never torch."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import lazy_import
from user_data import crossfeed as run_cli
from user_data import digits_folder, photos_folder

import crossfeed

tf = lazy_import("tensorflow")
cftf = lazy_import("crossfeed.adapters.tf")
pytestmark = pytest.mark.slow  # TensorFlow imported: the user walkthrough


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """21 grayscale 32×32 PNG digits: train 10, validation 11 (not a multiple of the batch)."""
    root = tmp_path_factory.mktemp("digits")
    digits_folder(root / "png")
    proc = run_cli("convert", "images", root / "png", root / "ds", "--splits", "train=0.6,validation=0.4")
    assert proc.returncode == 0, proc.stderr
    return str(root / "ds")


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    root = tmp_path_factory.mktemp("photos")
    photos_folder(root / "jpg")
    proc = run_cli("convert", "images", root / "jpg", root / "ds")
    assert proc.returncode == 0, proc.stderr
    return str(root / "ds")


def _loader_batches(path, **kw) -> list[dict]:
    with crossfeed.Loader(path, **kw) as ld:
        return list(ld)


@pytest.mark.parametrize("engine", ["native", "plan"])
def test_keras_validation_accuracy_is_exact(digits, engine):
    keras = tf.keras
    bs = 4
    n_val = len(crossfeed.open_dataset(digits)["validation"])

    def xy(b):
        return tf.cast(b["image"], tf.float32) / 255.0, b["label"]

    train = cftf.dataset(digits, split="train", batch_size=bs, seed=0, engine=engine, features=["image", "label"])
    val = cftf.dataset(
        digits, split="validation", batch_size=bs, shuffle="none", engine=engine, features=["image", "label"]
    )
    assert int(val.cardinality()) == -(-n_val // bs) == 3  # exact, not unknown (-2)
    assert int(train.cardinality()) == 3
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((32, 32, 1)), keras.layers.Flatten(), keras.layers.Dense(3)])
    model.compile(
        optimizer=keras.optimizers.SGD(0.05),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    history = model.fit(train.map(xy), validation_data=val.map(xy), epochs=1, verbose=0, shuffle=False)

    batches = _loader_batches(digits, split="validation", batch_size=n_val, shuffle="none")
    images, labels = batches[0]["image"].astype(np.float32) / 255.0, batches[0]["label"]
    by_hand = float(np.mean(np.argmax(model.predict_on_batch(images), axis=1) == labels))
    assert history.history["val_accuracy"][0] == pytest.approx(by_hand, abs=1e-6)


def test_input_fn_counts_with_the_loader_that_delivers(tmp_path):
    # 1001 samples, 2 pipelines, per-replica batch 167, remainder="drop": 500 samples each → 2 batches
    crossfeed.write_dataset(tmp_path / "d", [{"x": np.float32(i), "label": i} for i in range(1001)]).close()
    fn = cftf.input_fn(str(tmp_path / "d"), global_batch_size=334, loader_options={"remainder": "drop"})
    for pipeline in range(2):
        ctx = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=pipeline, num_replicas_in_sync=2)
        ds = fn(ctx)
        sizes = [int(b["label"].shape[0]) for b in ds]
        assert int(ds.cardinality()) == len(sizes) == 2 and sizes == [167, 167]


@pytest.mark.parametrize("engine", ["native", "plan"])
def test_same_shapes_and_samples_as_the_loader_dense(digits, engine):
    want = _loader_batches(digits, split="validation", batch_size=4, shuffle="none")
    got = list(cftf.dataset(digits, split="validation", batch_size=4, shuffle="none", engine=engine))
    assert len(got) == len(want) == 3  # the partial last batch is kept by both
    for g, w in zip(got, want):
        assert not isinstance(g["image"], tf.RaggedTensor)  # every record is 32×32×1: dense
        assert tuple(g["image"].shape) == w["image"].shape
        np.testing.assert_array_equal(g["image"].numpy(), w["image"])
        np.testing.assert_array_equal(g["label"].numpy(), w["label"])
    assert cftf.element_spec(digits, split="validation", batch_size=4)["image"].shape.as_list() == [None, 32, 32, 1]


@pytest.mark.parametrize("engine", ["native", "plan"])
def test_same_samples_as_the_loader_ragged_photos(photos, engine):
    want = _loader_batches(photos, batch_size=3, shuffle="none")
    got = list(cftf.dataset(photos, batch_size=3, shuffle="none", engine=engine))
    assert len(got) == len(want) == 4
    for g, w in zip(got, want):
        assert isinstance(g["image"], tf.RaggedTensor)  # sizes differ: ragged in TF, a list in the Loader
        for a, b in zip(g["image"].to_list(), list(w["image"])):
            np.testing.assert_array_equal(np.asarray(a, np.uint8), b)
