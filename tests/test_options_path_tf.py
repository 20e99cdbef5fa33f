"""One options path, TensorFlow: `cftf.dataset`/`input_fn`/`plan_state` make the Loader's
`LoaderOptions` from the same keywords (plus TF's own few), with the same defaults and validation;
the plan engine's Loaders put each option in its stage."""

from __future__ import annotations

import pytest
from conftest import lazy_import, requires
from options_helpers import BAD, CHANGED, IMAGES, expected, keep, landed

from crossfeed.adapters.tf_options import TFOptions
from crossfeed.errors import ConfigError
from crossfeed.read.options import LoaderOptions

cftf = lazy_import("crossfeed.adapters.tf")
tf_plan = lazy_import("crossfeed.adapters.tf_plan")
pytestmark = [
    pytest.mark.slow,
    requires("tensorflow"),
]  # slow: TensorFlow (and JAX) imported: the options path through tf.data


def test_tf_options_are_the_loaders_options_plus_tfs_own(options_data):
    want = LoaderOptions.of(**CHANGED)
    opts = TFOptions.make(None, CHANGED, engine="plan")
    assert opts.loader == want and opts.batch_size == 3 and opts.seed == 7
    from crossfeed.adapters.tf import _open

    with tf_plan.loader(_open(options_data, "val"), opts, {"transform": keep}) as loader:
        assert landed(loader) == expected(want)
    whole = TFOptions.make(want)
    assert whole.loader is want and whole.whole


def test_tf_passes_the_image_options_to_the_plan_engine(options_data):
    want = LoaderOptions.of(batch_size=3, **IMAGES)
    opts = TFOptions.make(None, {"batch_size": 3, **IMAGES})
    assert opts.loader == want
    from crossfeed.adapters.tf import _open

    with tf_plan.loader(_open(options_data, "train"), opts, {"transform": keep}) as loader:
        assert landed(loader) == expected(want)
    with pytest.raises(ConfigError, match="image_size="):  # the native engine does not fit images
        cftf.dataset(options_data, engine="native", batch_size=3, **IMAGES)


def test_tf_defaults_are_the_options_defaults(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert TFOptions.make(None, {"batch_size": 3}).loader == LoaderOptions.of(batch_size=3)
    records = TFOptions.make(None, {})  # TF's own: no batch size reads records
    assert records.batch_size is None and records.loader == LoaderOptions.of(batch_size=1)


@pytest.mark.parametrize("field, value", BAD)
def test_tf_refuses_what_the_loader_refuses(options_data, field, value):
    with pytest.raises(ConfigError) as a:
        LoaderOptions.of(**{"batch_size": 3, **{field: value}})
    with pytest.raises(ConfigError) as b:
        cftf.dataset(options_data, **{"batch_size": 3, **{field: value}})
    if (field, value) == ("seed", None):  # the Loader's words, then where TF's own shuffle takes it
        assert str(b.value).startswith(str(a.value)) and "engine='native'" in str(b.value)
    else:
        assert str(a.value) == str(b.value)


def test_seed_none_is_tfs_own_shuffle_only_when_the_native_engine_is_chosen(options_data):
    for make in (cftf.dataset, cftf.input_fn):
        size = {"batch_size": 3} if make is cftf.dataset else {"global_batch_size": 3}
        with pytest.raises(ConfigError, match="seed must be a non-negative integer, got None"):
            make(options_data, seed=None, **size)
        with pytest.raises(ConfigError, match="seed must be a non-negative integer, got None"):
            make(options_data, seed=None, engine="plan", **size)
    records = cftf.dataset(options_data, seed=None, engine="native", batch_size=3)
    assert len(list(records)) == 8  # 24 train records, a fresh order: TF's shuffle, said out loud


def test_tf_reads_what_the_loader_reads(options_data):
    """The plan engine's batches, for the changed options, are the Loader's (same order)."""
    from crossfeed.read.loader import Loader

    fields = {k: v for k, v in CHANGED.items() if k not in ("rank", "world_size")}
    got = [
        b["__index__"].numpy().tolist()
        for b in cftf.dataset(options_data, engine="plan", rank=1, world_size=2, **fields)
    ]
    with Loader(options_data, rank=1, world_size=2, **fields) as loader:
        assert got == [b["__index__"].tolist() for b in loader]
    assert len(cftf.dataset(options_data, shuffle=True, batch_size=4, engine="plan").take(1))
