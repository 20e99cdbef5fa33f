"""TorchDataset over the process executor: the same tensors as with threads, sharing the slots'
memory, and a tensor kept across the epoch is never overwritten by a recycled slot."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import lazy_import

import crossfeed

torch = lazy_import("torch")
torch_data = lazy_import("torch.utils.data")
cftorch = lazy_import("crossfeed.adapters.torch")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]  # slow: torch imported, worker processes


def test_torch_dataset_reads_through_worker_processes(tmp_path):
    root = tmp_path / "ids"
    crossfeed.write_dataset(root, [{"id": i, "x": np.full(3, i, np.float32)} for i in range(53)], num_shards=3).close()
    want = [
        b["id"].tolist()
        for b in torch_data.DataLoader(cftorch.TorchDataset(root, batch_size=4, seed=1), batch_size=None)
    ]
    ds = cftorch.TorchDataset(root, batch_size=4, seed=1, executor="process", processes=2)
    got, kept = [], []
    for b in torch_data.DataLoader(ds, batch_size=None):
        assert isinstance(b["x"], torch.Tensor)
        got.append(b["id"].tolist())
        kept.append(b["x"][:, 0])  # a view of the slot, held past its batch
    assert got == want
    for ids, x in zip(got, kept):
        assert x.tolist() == [float(i) for i in ids]  # no slot was reused under a live tensor
