"""Recipes through the TF plan engine and the JAX adapter: the same samples (ids, per-sample
generators' draws) as the Loader, with a filter and a skip list, byte for byte."""

from __future__ import annotations

import numpy as np
import pytest
import recipe_helpers as rh
from conftest import lazy_import, requires

import crossfeed
from crossfeed import Skip

tf = lazy_import("tensorflow")
cftf = lazy_import("crossfeed.adapters.tf")
cfjax = lazy_import("crossfeed.adapters.jax")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
SKIP = Skip(steps=[(2, 4)], samples=[5, 6, 40])
KW = dict(batch_size=8, seed=13, return_index=True, skip=SKIP, drop_last=True)


def _want(data, **kw):
    with crossfeed.Loader(data, **{**KW, **kw}) as ld:
        return list(ld)


@requires("tensorflow")
def test_the_tf_plan_engine_gives_the_loaders_augmented_samples(tmp_path):
    data = rh.write(tmp_path / "d")
    want = _want(data, transform=rh.augment_even)
    spec = {
        "x": tf.TensorSpec((None, 3), tf.int32),
        "label": tf.TensorSpec((None,), tf.int64),
        "noise": tf.TensorSpec((None, 4), tf.float64),
        "shift": tf.TensorSpec((None,), tf.int64),
        "__index__": tf.TensorSpec((None,), tf.int64),
    }
    ds = cftf.dataset(data, engine="plan", loader_options={"transform": rh.augment_even}, element_spec=spec, **KW)
    got = [{k: v.numpy() for k, v in b.items()} for b in ds]
    assert len(got) == len(want) == 13
    for a, b in zip(got, want):
        assert a["__index__"].tolist() == b["__index__"].tolist()
        assert a["noise"].tobytes() == b["noise"].tobytes() and a["shift"].tobytes() == b["shift"].tobytes()
    plain = cftf.dataset(data, engine="plan", loader_options={"filter": rh.keep_even}, **KW)
    got = [b["__index__"].numpy().tolist() for b in plain]
    assert got == [b["__index__"].tolist() for b in _want(data, filter=rh.keep_even)]


@requires("jax")
def test_the_jax_adapter_gives_the_loaders_augmented_samples(tmp_path):
    data = rh.write(tmp_path / "d")
    steps = {**KW, "skip": Skip(steps=[(2, 4)])}  # whole steps: the global arrays keep their shapes
    with crossfeed.Loader(data, transform=rh.augment, **steps) as ld:
        want = list(ld)
    with cfjax.JaxLoader(data, transform=rh.augment, **steps) as jl:
        got = [{k: np.asarray(v) for k, v in b.items()} for b in jl]
    assert len(got) == len(want) == 13
    for a, b in zip(got, want):
        assert a["__index__"].tolist() == b["__index__"].tolist()
        assert a["noise"].tobytes() == b["noise"].astype(a["noise"].dtype).tobytes()  # float32 unless jax_enable_x64
    with pytest.raises(crossfeed.ConfigError, match="static shapes"):  # filtered batches are padded, or refused
        cfjax.JaxLoader(data, filter=rh.keep_even, mask=False, **KW)
