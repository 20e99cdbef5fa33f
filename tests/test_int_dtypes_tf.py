"""Token ids stored narrow reach TensorFlow as int32 (uint16) or int64 (uint32) by default, on
both engines — what a Keras ``Embedding`` and sparse loss take; ``keep_dtypes=True`` keeps them."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import lazy_import, requires

tf = lazy_import("tensorflow")

from token_data import write_stored_ids  # noqa: E402

import crossfeed  # noqa: E402

cftf = lazy_import("crossfeed.adapters.tf")

pytestmark = [pytest.mark.slow, requires("tensorflow")]  # TensorFlow imported


@pytest.mark.parametrize(("dtype", "want"), [("uint16", "int32"), ("uint32", "int64")])
def test_a_keras_embedding_step_on_packed_rows_with_the_defaults(tmp_path, dtype, want):
    path = write_stored_ids(tmp_path / "ids", dtype=dtype)
    ds = cftf.dataset(path, batch_size=8, seed=0, pack=crossfeed.Pack(32))
    assert ds.element_spec["tokens"].dtype == getattr(tf, want)
    with crossfeed.Loader(path, batch_size=8, seed=0, pack=crossfeed.Pack(32)) as ld:
        first = next(iter(ld))["tokens"]
    assert np.array_equal(next(iter(ds))["tokens"].numpy(), first.astype(np.int64))

    def pair(b):
        return b["tokens"][:, :-1], b["tokens"][:, 1:]

    model = tf.keras.Sequential([tf.keras.layers.Embedding(32, 8), tf.keras.layers.Dense(32)])
    model.compile(optimizer="sgd", loss=tf.keras.losses.SparseCategoricalCrossentropy(True))
    hist = model.fit(ds.map(pair), epochs=1, verbose=0)
    assert np.isfinite(hist.history["loss"][0])


def test_the_native_engine_widens_records_and_keep_dtypes_keeps_them(tmp_path):
    path = write_stored_ids(tmp_path / "ids", dtype="uint16")
    native = cftf.dataset(path, engine="native", shuffle="none")
    assert native.element_spec["tokens"].dtype == tf.int32
    kept = cftf.dataset(path, engine="native", shuffle="none", keep_dtypes=True)
    assert kept.element_spec["tokens"].dtype == tf.uint16
    assert [r["tokens"].numpy().tolist() for r in native] == [r["tokens"].numpy().tolist() for r in kept]
