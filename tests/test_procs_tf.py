"""The TensorFlow plan engine with executor="process": the same batches as with threads."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import lazy_import

import crossfeed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]  # slow: TensorFlow imported, worker processes
tf = lazy_import("tensorflow")
cftf = lazy_import("crossfeed.adapters.tf")


def _rows(ds) -> list[tuple]:
    return [
        (b["__index__"].tolist(), b["label"].tolist(), b["x"][:, 0].tolist(), b["tokens"].to_list(), b["name"].tolist())
        for b in ({k: (v if isinstance(v, tf.RaggedTensor) else v.numpy()) for k, v in batch.items()} for batch in ds)
    ]


def test_plan_engine_reads_through_worker_processes(tmp_path):
    samples = [
        {"x": np.full((2,), i, np.float32), "label": i, "tokens": list(range(i % 3)), "name": f"n{i}"}
        for i in range(23)
    ]
    crossfeed.write_dataset(tmp_path, samples, num_shards=3).close()
    kw = dict(batch_size=4, seed=5, return_index=True)
    want = _rows(cftf.dataset(tmp_path, loader_options={"batch_transform": "procs_helpers:add_one"}, **kw))
    procs = {"executor": "process", "processes": 2, "batch_transform": "procs_helpers:add_one"}
    ds = cftf.dataset(tmp_path, loader_options=procs, **kw)
    assert _rows(ds) == want and len(want) == 6
    assert [i - 1 for b in want for i in b[1]] == [int(x) for b in want for x in b[2]]  # the batch transform ran
    opts = crossfeed.LoaderOptions.of(batch_size=4, seed=5, return_index=True, executor="process", processes=2)
    assert [r[0] for r in _rows(cftf.dataset(tmp_path, options=opts))] == [r[0] for r in want]
