"""Packed rows in TensorFlow (a process of their own: torch and TF are not imported together):
the plan engine delivers the Loader's packed rows with a static ``(B, L)`` element_spec, and a
token-budget dataset its variable batches; the same rows as PyTorch gets for one seed (the
Loader's)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import lazy_import
from token_data import write_language, write_tokens

import crossfeed

tf = lazy_import("tensorflow")
cftf = lazy_import("crossfeed.adapters.tf")
pytestmark = pytest.mark.slow  # TensorFlow imported: Keras training


def test_tf_gets_the_loaders_packed_rows_with_a_static_shape(tmp_path):
    path = write_tokens(tmp_path / "t", np.arange(1, 60) % 23 + 1)
    opts = dict(batch_size=4, seed=2, pack=crossfeed.Pack(length=32))
    spec = cftf.element_spec(path, **opts)
    assert spec == {
        "tokens": tf.TensorSpec((4, 32), tf.int64),
        "segment_ids": tf.TensorSpec((4, 32), tf.int32),
        "positions": tf.TensorSpec((4, 32), tf.int32),
    }
    ds = cftf.dataset(path, **opts)
    assert ds.element_spec == spec
    with crossfeed.Loader(path, **opts) as ld:
        want = list(ld)
    got = [{k: v.numpy() for k, v in b.items()} for b in ds]
    assert len(got) == len(want) and all((g[k] == w[k]).all() for g, w in zip(got, want) for k in w)
    state = cftf.plan_state(path, steps=2, **opts)
    rest = [{k: v.numpy() for k, v in b.items()} for b in cftf.dataset(path, state=state, **opts)]
    assert all((g[k] == w[k]).all() for g, w in zip(rest, want[2:]) for k in w) and len(rest) == len(want) - 2
    bare = dict(opts, pack=crossfeed.Pack(length=32, segments=False))  # the features alone
    assert cftf.element_spec(path, **bare) == {"tokens": tf.TensorSpec((4, 32), tf.int64)}
    got = [{k: v.numpy() for k, v in b.items()} for b in cftf.dataset(path, **bare)]
    assert len(got) == len(want) and all(
        g.keys() == {"tokens"} and (g["tokens"] == w["tokens"]).all() for g, w in zip(got, want)
    )


def test_tf_token_budget_batches_vary_in_shape(tmp_path):
    path = write_tokens(tmp_path / "t", np.arange(1, 40) % 17 + 1)
    ds = cftf.dataset(path, batch_size=1, seed=0, batch_by_tokens=48)
    assert ds.element_spec["tokens"].shape.as_list() == [None, None]
    shapes = {tuple(b["tokens"].shape) for b in ds}
    assert len(shapes) > 1 and all(r * w <= 48 or r == 1 for r, w in shapes)


def test_keras_trains_a_step_on_packed_rows(tmp_path):
    path = write_language(tmp_path / "lm", docs=60)
    ds = cftf.dataset(path, batch_size=8, seed=0, pack=crossfeed.Pack(64))

    def pair(b):
        same = tf.cast(
            (b["segment_ids"][:, 1:] == b["segment_ids"][:, :-1]) & (b["segment_ids"][:, 1:] > 0), tf.float32
        )
        return b["tokens"][:, :-1], b["tokens"][:, 1:], same

    model = tf.keras.Sequential([tf.keras.layers.Embedding(32, 16), tf.keras.layers.Dense(32)])
    model.compile(optimizer=tf.keras.optimizers.Adam(0.05), loss=tf.keras.losses.SparseCategoricalCrossentropy(True))
    hist = model.fit(ds.map(pair).repeat(), epochs=3, steps_per_epoch=6, verbose=0)
    assert hist.history["loss"][-1] < 0.5 * hist.history["loss"][0]
