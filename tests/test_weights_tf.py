"""Per-sample weights through the TensorFlow adapter: ``cftf.dataset(path, weights=NAME)`` gives
the Loader's very weighted batches — the native engine (TensorFlow's own shard reader, chosen
by default for local TFRecords) cannot draw by weight, so ``weights=`` picks the plan engine, and
``engine="native"`` with ``weights=`` is refused by name (it read the dataset unweighted, silently)."""

from __future__ import annotations

import os

import pytest
from conftest import lazy_import

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import crossfeed
from crossfeed.errors import ConfigError

cftf = lazy_import("crossfeed.adapters.tf")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # slow: TensorFlow imported


def test_a_weighted_tf_dataset_is_the_loaders_weighted_stream(tmp_path):
    root = tmp_path / "d"
    crossfeed.write_dataset(root, [{"x": i, "w": i % 4} for i in range(30)], num_shards=2).close()
    crossfeed.write_weights(root, feature="w")
    kw = dict(batch_size=4, seed=3, samples_per_epoch=43, weights="w")
    with crossfeed.Loader(root, **kw) as loader:
        want = [b["x"].tolist() for b in loader]
    with crossfeed.Loader(root, **kw) as loader:
        it = iter(loader)
        for _ in range(3):
            next(it)
        state = loader.state_dict()
    assert [b["x"].numpy().tolist() for b in cftf.dataset(str(root), **kw)] == want
    assert [b["x"].numpy().tolist() for b in cftf.dataset(str(root), state=state, **kw)] == want[3:]
    with pytest.raises(ConfigError, match="engine='native' cannot honour weights="):
        cftf.dataset(str(root), engine="native", **kw)
