"""Step replay through torch: a DataLoader whose 2 worker processes share a rank's batches yields,
at its ``k``-th item, exactly the samples `Loader.batch_at(k)` names — the step is the rank's, the
workers only deal its batches out — in epoch after epoch, on every rank."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import lazy_import, requires

import crossfeed
from crossfeed.read.loader import INDEX_KEY, Loader

torch_data = lazy_import("torch.utils.data")
cftorch = lazy_import("crossfeed.adapters.torch")

pytestmark = [pytest.mark.slow, requires("torch"), pytest.mark.timeout(180)]  # worker processes


@pytest.mark.parametrize("world_size", [1, 3])
def test_a_dataloaders_steps_with_two_workers_replay_exactly(tmp_path, world_size):
    root = tmp_path / "ids"
    crossfeed.write_dataset(root, [{"id": i, "x": np.full(3, i, np.float32)} for i in range(61)], num_shards=3).close()
    for rank in range(world_size):
        opts = dict(batch_size=4, seed=3, rank=rank, world_size=world_size, return_index=True)
        ds = cftorch.TorchDataset(root, **opts)
        loader = torch_data.DataLoader(ds, batch_size=None, num_workers=2)
        with Loader(root, **opts) as replay:
            step = 0
            for epoch in range(2):
                ds.set_epoch(epoch)
                for b, batch in enumerate(loader):
                    want = replay.batch_at(step)
                    assert (want.epoch, want.step) == (epoch, b)
                    assert [s.key for s in want] == batch[INDEX_KEY].tolist()
                    np.testing.assert_array_equal(replay.samples_at(step)["id"], batch["id"].numpy())
                    step += 1
        ds.close()


@pytest.mark.parametrize("kind", ["weighted", "scheduled"])
def test_a_weighted_or_scheduled_dataloaders_steps_replay_exactly(tmp_path, kind):
    """The same through a weighted dataset (class balance) and a two-phase scheduled mixture: the
    DataLoader's 2 workers deliver, at step ``k`` over two epochs, exactly what `batch_at(k)` names."""
    root = tmp_path / "a"
    crossfeed.write_dataset(root, [{"id": i, "label": int(i < 6)} for i in range(30)], num_shards=2).close()
    if kind == "weighted":
        crossfeed.write_weights(root, balance="label")
        src, extra = root, {"weights": crossfeed.balanced("label"), "samples_per_epoch": 24}
    else:
        crossfeed.write_dataset(tmp_path / "b", [{"id": 100 + i, "label": 2} for i in range(9)]).close()
        sched = crossfeed.Schedule.constant
        src = [
            crossfeed.Source(root, weight=sched([(0, 3), (20, 1)])),
            crossfeed.Source(tmp_path / "b", weight=sched([(0, 1), (20, 3)])),
        ]
        extra = {"samples_per_epoch": 24}
    opts = dict(batch_size=4, seed=5, return_index=True, **extra)
    ds = cftorch.TorchDataset(src, **opts)
    loader = torch_data.DataLoader(ds, batch_size=None, num_workers=2)
    with Loader(src, **opts) as replay:
        step = 0
        for epoch in range(2):
            ds.set_epoch(epoch)
            for batch in loader:
                assert [s.index for s in replay.batch_at(step)] == batch[INDEX_KEY].tolist()
                np.testing.assert_array_equal(replay.samples_at(step)["id"], batch["id"].numpy())
                step += 1
        assert step == 12
    ds.close()
