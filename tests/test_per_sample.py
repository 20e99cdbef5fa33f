"""``batch_size=None``: one sample at a time, as ``DataLoader(batch_size=None)`` and an unbatched
tf.data pipeline give them — in the Loader and the PyTorch adapter: the same samples, in the same
order, as ``batch_size=1`` without the batch dimension; lengths and states count samples; resuming
continues at the next sample."""

from __future__ import annotations

import numpy as np
import pytest

import crossfeed
from crossfeed.errors import ConfigError

N = 11


@pytest.fixture
def small(tmp_path):
    rng = np.random.default_rng(0)
    samples = [
        {"x": rng.random(3).astype(np.float32), "y": i, "name": f"n{i}".encode(), "v": np.arange(i % 4, dtype=np.int64)}
        for i in range(N)
    ]
    schema = crossfeed.Schema(
        [
            crossfeed.Feature("x", "float32", (3,), "float"),
            crossfeed.Feature("y", "int64", (), "int64"),
            crossfeed.Feature("name", "bytes", (), "bytes"),
            crossfeed.Feature("v", "int64", (None,), "tensor"),
        ]
    )
    crossfeed.write_dataset(tmp_path / "d", samples, num_shards=3, schema=schema).close()
    return str(tmp_path / "d")


def _same(sample: dict, batch: dict) -> bool:
    for k, v in batch.items():
        got = sample[k]
        if isinstance(v, np.ndarray) and v.dtype != object:
            if not (isinstance(got, np.ndarray) and got.shape == v.shape[1:] and np.array_equal(got, v[0])):
                return False
        elif not np.array_equal(np.asarray(got), np.asarray(v[0])):
            return False
    return True


def test_the_loader_yields_the_samples_of_batch_size_one_without_the_batch_dimension(small):
    with crossfeed.Loader(small, batch_size=1, seed=3) as ld:
        want = list(ld)
    with crossfeed.Loader(small, batch_size=None, seed=3) as ld:
        assert len(ld) == N
        got = list(ld)
    assert len(got) == N and all(_same(s, b) for s, b in zip(got, want))
    first = got[0]
    assert first["y"].shape == () and first["x"].shape == (3,) and isinstance(first["name"], bytes)
    assert sorted(int(s["y"]) for s in got) == list(range(N))


def test_per_sample_state_counts_samples_and_resumes_at_the_next(small):
    with crossfeed.Loader(small, batch_size=None, seed=1) as ld:
        whole = [int(s["y"]) for s in ld]
    with crossfeed.Loader(small, batch_size=None, seed=1) as ld:
        it = iter(ld)
        head = [int(next(it)["y"]) for _ in range(4)]
        state = ld.state_dict()
    assert state["position"] == 4
    with crossfeed.Loader(small, batch_size=None, seed=1) as ld:
        ld.load_state_dict(state)
        assert len(ld) == N - 4
        rest = [int(s["y"]) for s in ld]
    assert head + rest == whole


def test_per_sample_packed_rows_and_refusals(small, tmp_path):
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from token_data import write_stored_ids

    path = write_stored_ids(tmp_path / "ids")
    with crossfeed.Loader(path, batch_size=None, pack=crossfeed.Pack(length=16), seed=0) as ld:
        rows = list(ld)
    with crossfeed.Loader(path, batch_size=1, pack=crossfeed.Pack(length=16), seed=0) as ld:
        want = list(ld)
    assert len(rows) == len(want) and all(r["tokens"].shape == (16,) for r in rows)
    assert all(np.array_equal(r["segment_ids"], w["segment_ids"][0]) for r, w in zip(rows, want))
    with pytest.raises(ConfigError, match="batch_by_tokens"):
        crossfeed.Loader(small, batch_size=None, batch_by_tokens=64)
    with pytest.raises(ConfigError, match="needs batch_size"):
        crossfeed.Loader(small)  # left out: still a mistake, not per-sample


def test_torch_per_sample_matches_dataloader_conventions(small):
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from crossfeed.adapters.torch import StatefulLoader, TorchDataset

    with crossfeed.Loader(small, batch_size=None, seed=2) as ld:
        want = [int(s["y"]) for s in ld]
    with TorchDataset(small, batch_size=None, seed=2, rank=0, world_size=1) as ds:
        assert len(ds) == N
        got = list(StatefulLoader(ds, num_workers=2))
        assert [int(s["y"]) for s in got] == want
        assert got[0]["y"].shape == () and got[0]["x"].shape == (3,) and isinstance(got[0]["name"], bytes)
        # per-sample items batch like any map-style dataset's under DataLoader's own collation
        batches = list(DataLoader(ds, batch_size=4, collate_fn=lambda s: torch.stack([x["x"] for x in s])))
        assert [b.shape[0] for b in batches] == [4, 4, 3]
