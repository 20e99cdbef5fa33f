"""Parquet files read in place through the PyTorch adapter: a DataLoader with 2 worker processes
yields the Loader's batches, with pyarrow's values."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import lazy_import
from parquet_data import ROWS, assert_row_equal, oracle, write_pyarrow_files

from crossfeed.read.loader import INDEX_KEY, Loader
from crossfeed.write.adopt.index import index_dataset

torch = lazy_import("torch")
torch_data = lazy_import("torch.utils.data")
cftorch = lazy_import("crossfeed.adapters.torch")
pytestmark = pytest.mark.slow  # torch imported, worker processes


def test_two_workers_yield_the_loaders_batches_with_pyarrow_values(tmp_path):
    paths = write_pyarrow_files(tmp_path)
    index_dataset(tmp_path)
    expected = oracle(paths)
    kw = dict(batch_size=8, seed=4, shuffle="global", features=["id", "vec", "text"], return_index=True)
    with Loader(tmp_path, **kw) as loader:
        want = [b[INDEX_KEY].tolist() for b in loader]
    ds = cftorch.TorchDataset(tmp_path, rank=0, world_size=1, **kw)
    got = []
    for b in torch_data.DataLoader(ds, batch_size=None, num_workers=2):
        assert isinstance(b["vec"], torch.Tensor) and b["vec"].shape[1:] == (3,)
        ids = b[INDEX_KEY].tolist()
        for j, i in enumerate(ids):
            assert_row_equal(b["vec"][j].numpy(), expected["vec"][i], "vec", f"row {i}")
            assert b["text"][j] == expected["text"][i]
        np.testing.assert_array_equal(b["id"].numpy(), ids)  # the id column is the row number
        got.append(ids)
    ds.close()
    assert got == want and sorted(i for b in got for i in b) == list(range(sum(ROWS)))
