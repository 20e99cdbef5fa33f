"""Per-sample weights through the PyTorch adapter: the Loader's very weighted (class-balanced)
batches through DataLoader worker processes."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import lazy_import, requires

import crossfeed

torch = lazy_import("torch")
cftorch = lazy_import("crossfeed.adapters.torch")

pytestmark = [pytest.mark.slow, requires("torch"), pytest.mark.timeout(180)]


def test_weighted_batches_through_dataloader_workers(tmp_path):
    root = str(tmp_path / "ds")
    crossfeed.write_dataset(root, [{"x": i, "label": i % 3 if i < 20 else 0} for i in range(30)], num_shards=3).close()
    crossfeed.write_weights(root, balance="label")
    kw = dict(batch_size=4, seed=3, samples_per_epoch=36, weights=crossfeed.balanced("label"))
    with crossfeed.Loader(root, **kw) as ld:
        want = [b["x"] for b in ld]
    ds = cftorch.TorchDataset(root, **kw)
    got = [b["x"].numpy() for b in cftorch.StatefulLoader(ds, num_workers=2)]
    assert len(got) == len(want) == 9
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    ds.close()
