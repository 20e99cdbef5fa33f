"""Growing datasets through the TensorFlow adapter: the plan engine's passes (one Loader each,
opened again every epoch) read the version the dataset was opened at, whatever is appended
between epochs."""

from __future__ import annotations

import os

import pytest
from conftest import lazy_import

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import crossfeed

cftf = lazy_import("crossfeed.adapters.tf")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # slow: TensorFlow imported


def test_the_plan_engines_passes_read_the_version_it_opened(tmp_path):
    """Pass 2 of a plan-engine dataset read the newest version (6 batches where its cardinality,
    counted on version 1, said 4); it reads version 1 again, its next epoch."""
    root = str(tmp_path / "daily")
    crossfeed.write_dataset(root, [{"x": i} for i in range(8)], num_shards=2).close()
    ds = cftf.dataset(root, batch_size=2, shuffle="none", engine="plan")
    first = sorted(int(x) for b in ds for x in b["x"].numpy())
    crossfeed.write_dataset(root, [{"x": 100 + i} for i in range(4)], append=True).close()
    second = sorted(int(x) for b in ds for x in b["x"].numpy())
    assert first == second == list(range(8))
