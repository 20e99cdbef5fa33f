"""A scheduled mixture through the framework adapters: PyTorch (DataLoader worker processes,
resumed with another worker count), TensorFlow and JAX deliver the Loader's very batches, phase
boundaries and all."""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import lazy_import, requires

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import crossfeed
from crossfeed import Schedule, Source

torch = lazy_import("torch")
cftorch = lazy_import("crossfeed.adapters.torch")
tf = lazy_import("tensorflow")
cftf = lazy_import("crossfeed.adapters.tf")
cfjax = lazy_import("crossfeed.adapters.jax")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # slow: a framework imported, worker processes
KW = dict(batch_size=4, seed=2, samples_per_epoch=44, return_index=True)
KEYS = ("__source__", "__index__", "id")


@pytest.fixture(scope="module")
def mix(tmp_path_factory):
    root = tmp_path_factory.mktemp("sched")
    for name, n, offset in (("broad", 40, 0), ("hq", 7, 1000), ("new", 5, 2000)):
        rows = [{"x": np.full(2, offset + i, np.float32), "id": offset + i} for i in range(n)]
        crossfeed.write_dataset(root / name, rows, num_shards=2).close()
    return [  # a broad mix; new data from sample 20; annealing on hq from sample 36 (epoch 0's end is 44)
        Source(root / "broad", weight=Schedule.constant([(0, 3), (36, 1)])),
        Source(root / "hq", weight=Schedule.linear([(0, 1), (36, 3)], every=12)),
        Source(root / "new", weight=Schedule.constant([(0, 0), (20, 1)])),
    ]


def _loader_batches(mix, epochs: int = 2, **kw) -> list[dict]:
    with crossfeed.Loader(mix, **dict(KW, **kw)) as ld:
        return [{k: b[k] for k in KEYS} for _ in range(epochs) for b in ld]


def _same(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        for k in KEYS:
            np.testing.assert_array_equal(np.asarray(a[k]), b[k], err_msg=k)


@requires("torch")
def test_torch_dataloader_workers_deliver_the_loaders_batches_and_resume_with_other_workers(mix):
    want = _loader_batches(mix)
    ds = cftorch.TorchDataset(mix, **KW)
    loader = cftorch.StatefulLoader(ds, num_workers=2)
    got = [{k: b[k].numpy() for k in KEYS} for _ in range(2) for b in loader]
    _same(got, want)
    it = iter(loader)  # epoch 2: stop after 5 batches (past the phase boundaries), resume with 1 worker
    first = [{k: b[k].numpy() for k in KEYS} for b in (next(it) for _ in range(5))]
    state = loader.state_dict()
    ds.close()
    ds2 = cftorch.TorchDataset(mix, **KW)
    resumed = cftorch.StatefulLoader(ds2, num_workers=1)
    resumed.load_state_dict(state)
    rest = [{k: b[k].numpy() for k in KEYS} for b in resumed]
    ds2.close()
    with crossfeed.Loader(mix, **KW) as ld:
        ld.set_epoch(2)
        third = [{k: b[k] for k in KEYS} for b in ld]
    _same(first + rest, third)


@requires("tensorflow")
def test_tensorflow_delivers_the_loaders_batches(mix):
    want = _loader_batches(mix, epochs=1)
    got = [{k: v.numpy() for k, v in b.items()} for b in cftf.dataset(mix, **KW)]
    _same(got, want)


@requires("jax")
def test_jax_delivers_the_loaders_batches(mix):
    want = _loader_batches(mix, epochs=1, drop_last=True)
    with cfjax.JaxLoader(mix, **KW) as jl:
        got = [{k: np.asarray(v) for k, v in b.items()} for b in jl]
    _same(got, want)
