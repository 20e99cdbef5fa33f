"""Growing datasets through the PyTorch adapter: a TorchDataset reads the version it opened, in its
DataLoader worker processes too, whatever is appended meanwhile."""

from __future__ import annotations

import pytest
from conftest import lazy_import, requires

import crossfeed

cftorch = lazy_import("crossfeed.adapters.torch")

pytestmark = [pytest.mark.slow, requires("torch"), pytest.mark.timeout(180)]


def test_dataloader_workers_read_the_version_the_dataset_was_opened_at(tmp_path):
    """A TorchDataset opens its dataset when made (its length, its options checked): DataLoader
    workers, which open it again, read that version even when the dataset is appended to before
    they start — they read the new version, so ``len`` said 4 batches and 6 came (and workers
    starting on either side of an append would mix two plans)."""
    root = str(tmp_path / "daily")
    crossfeed.write_dataset(root, [{"x": i, "s": f"v{i}"} for i in range(8)], num_shards=2).close()
    crossfeed.write_dataset(tmp_path / "b", [{"x": 50 + i, "s": "b"} for i in range(4)]).close()
    mixture = [crossfeed.Source(root, weight=2), crossfeed.Source(tmp_path / "b")]
    one = cftorch.TorchDataset(root, batch_size=2, shuffle="none")
    mix = cftorch.TorchDataset(mixture, batch_size=2, shuffle="none")
    assert len(one) == 4 and len(mix) == 6
    crossfeed.write_dataset(root, [{"x": 100 + i, "s": "n"} for i in range(4)], append=True).close()
    got = [b["x"].tolist() for b in cftorch.StatefulLoader(one, num_workers=2)]
    assert len(got) == 4 and sorted(x for b in got for x in b) == list(range(8))
    got = [b["x"].tolist() for b in cftorch.StatefulLoader(mix, num_workers=2)]
    assert len(got) == 6 and sorted(x for b in got for x in b) == [*range(8), *range(50, 54)]
    one.close()
    mix.close()
