"""Stage metrics through the PyTorch adapter: `TorchDataset.stats` (this process's Loaders) and
`StatefulLoader.stats` (the trainer's own wait, timed around the DataLoader, whatever its
``num_workers``). Counts and structure only; no timing is asserted."""

from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import lazy_import

import crossfeed
from crossfeed.errors import ConfigError
from crossfeed.read.metrics import STAGES

torch = lazy_import("torch")
cftorch = lazy_import("crossfeed.adapters.torch")
pytestmark = pytest.mark.slow  # torch imported

N = 24


@pytest.fixture
def small(tmp_path):
    rng = np.random.default_rng(0)
    root = tmp_path / "small"
    crossfeed.write_dataset(
        root, [{"x": rng.random(4, dtype=np.float32), "y": i} for i in range(N)], num_shards=2
    ).close()
    return root


def test_the_dataset_and_the_stateful_loader_count_the_same_batches_in_process(small):
    with cftorch.TorchDataset(small, batch_size=4, rank=0, world_size=1) as ds:
        loader = cftorch.StatefulLoader(ds, num_workers=0)
        for _ in loader:
            time.sleep(0.01)
        mine, trainer = ds.stats(), loader.stats()
    assert mine.batches == trainer.batches == 6 and mine.samples == trainer.samples == N
    assert {s for s in STAGES if mine.stages[s].count} == {"plan", "read", "decode"}
    assert trainer.stages == mine.stages and trainer.bytes == mine.bytes > 0  # the stages of the Loader that ran here
    assert trainer.epochs == 1 and trainer.consumer_seconds > 0


def test_with_dataloader_workers_the_trainer_s_wait_is_still_timed(small):
    with cftorch.TorchDataset(small, batch_size=4, rank=0, world_size=1) as ds:
        loader = cftorch.StatefulLoader(ds, num_workers=1)
        assert sum(len(b["y"]) for b in loader) == N
        st = loader.stats()
        assert ds.stats().batches == 0  # the workers' Loaders are in their processes
    assert st.batches == 6 and st.samples == N and st.wait_seconds > 0 and st.processes == 1
    assert not any(s.count for s in st.stages.values())
    assert st.verdict().bottleneck is None and "log_stats=True" in st.verdict().advice


def test_a_stream_has_no_loader_stats():
    with pytest.raises(ConfigError):
        cftorch.TorchDataset(iter([{"x": np.zeros(2)}])).stats()
