"""`StatefulLoader(batches_per_transfer=N)`: DataLoader workers hand their batches over N at a
time in one shared-memory storage (one segment, one file descriptor passed), and the loader yields
them one by one in the dataset's order — the same batches as the Loader, whatever the group size,
the worker count, an epoch whose batches do not divide into groups, strings beside tensors, a
resume in the middle of a group, or a byte cap that cuts groups short."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import lazy_import, requires

import crossfeed
from crossfeed.errors import ConfigError
from crossfeed.read.loader import Loader

torch = lazy_import("torch")
cftorch = lazy_import("crossfeed.adapters.torch")

pytestmark = [pytest.mark.slow, requires("torch"), pytest.mark.timeout(180)]


@pytest.fixture
def ids_dataset(tmp_path):
    """103 samples (an odd count) in 3 shards: ``id``, a 3-vector equal to the id and a name."""
    root = tmp_path / "ids"
    samples = [{"id": i, "x": np.full(3, i, np.float32), "name": f"s{i}"} for i in range(103)]
    crossfeed.write_dataset(root, samples, num_shards=3).close()
    return root


def _items(loader) -> list[tuple]:
    return [(b["id"].tolist(), b["x"][:, 0].tolist(), list(b["name"])) for b in loader]


def _groups(loader) -> list[list[int]]:
    return [item[cftorch.GROUP] for item in loader.dataloader]


@pytest.mark.parametrize(("workers", "group"), [(2, 3), (2, 8), (3, 4), (1, 5), (2, 1)])
def test_groups_come_back_in_the_loaders_order(ids_dataset, workers, group):
    want = [
        (b["id"].tolist(), b["x"][:, 0].tolist(), list(b["name"])) for b in Loader(ids_dataset, batch_size=4, seed=7)
    ]
    ds = cftorch.TorchDataset(ids_dataset, batch_size=4, seed=7, rank=0, world_size=1)
    with cftorch.StatefulLoader(ds, num_workers=workers, batches_per_transfer=group) as loader:
        assert _items(loader) == want  # 26 batches: groups that do not divide them, per worker
        if group > 1:
            groups = _groups(loader)
            assert sorted(i for g in groups for i in g) == list(range(len(want)))
            assert len(groups) == sum(-(-len(range(w, len(want), workers)) // group) for w in range(workers))
            assert all(len(g) <= group for g in groups)


def test_a_group_is_one_shared_storage(ids_dataset):
    ds = cftorch.TorchDataset(ids_dataset, batch_size=4, seed=7, rank=0, world_size=1)
    with cftorch.StatefulLoader(ds, num_workers=2, batches_per_transfer=4) as loader:
        item = next(iter(loader.dataloader))
        storages = {b[k].untyped_storage().data_ptr() for b in item["batches"] for k in ("id", "x")}
        assert len(storages) == 1 and item["batches"][0]["x"].is_shared()
        assert isinstance(item["batches"][0]["name"], list)


def test_a_resume_in_the_middle_of_a_group_is_exact(ids_dataset):
    def make(workers, group):
        ds = cftorch.TorchDataset(ids_dataset, batch_size=4, seed=3, rank=0, world_size=1)
        return cftorch.StatefulLoader(ds, num_workers=workers, batches_per_transfer=group)

    with make(0, 1) as ref:
        full = _items(ref)
    for stop in (1, 5, 11):
        with make(2, 4) as first:
            got = []
            for b in first:
                got.append((b["id"].tolist(), b["x"][:, 0].tolist(), list(b["name"])))
                if len(got) == stop:
                    break
            state = first.state_dict()
        assert got == full[:stop] and state["position"] == stop * 4
        with make(2, 3) as second:
            second.load_state_dict(state)
            assert _items(second) == full[stop:]


def test_large_batches_cross_alone(ids_dataset, monkeypatch):
    monkeypatch.setattr(
        "crossfeed.adapters.torch.GROUP_BYTES", 1
    )  # forked workers inherit it: every group cut at one batch
    ds = cftorch.TorchDataset(ids_dataset, batch_size=4, seed=7, rank=0, world_size=1)
    with cftorch.StatefulLoader(ds, num_workers=2, batches_per_transfer=8, multiprocessing_context="fork") as loader:
        assert all(len(g) == 1 for g in _groups(loader))
        assert _items(loader) == _items(Loader(ids_dataset, batch_size=4, seed=7))


@pytest.mark.parametrize("bad", [0, -1, 2.0, "4", 1025])
def test_batches_per_transfer_is_checked(ids_dataset, bad):
    ds = cftorch.TorchDataset(ids_dataset, batch_size=4, rank=0, world_size=1)
    with pytest.raises(ConfigError, match="batches_per_transfer"):
        cftorch.StatefulLoader(ds, num_workers=2, batches_per_transfer=bad)
