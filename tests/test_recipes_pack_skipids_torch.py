"""Skipped documents of a packed plan through PyTorch DataLoader workers and the process
executor: the Loader's very rows, and a StatefulLoader resumes exactly (issue 36)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import lazy_import, requires

import crossfeed
from crossfeed import Skip

torch = lazy_import("torch")
cftorch = lazy_import("crossfeed.adapters.torch")

pytestmark = [pytest.mark.slow, requires("torch"), pytest.mark.timeout(240)]


def _np(batches):
    return [{k: np.asarray(v) for k, v in b.items()} for b in batches]


def _same(got, want) -> bool:
    return len(got) == len(want) and all(all(np.array_equal(g[k], w[k]) for k in w) for g, w in zip(got, want))


@pytest.mark.parametrize("split", ["documents", "rows"])
def test_dataloader_workers_and_processes_skip_the_same_documents(tmp_path, split):
    from token_data import write_tokens

    path = write_tokens(tmp_path / "t", np.arange(1, 90) % 23 + 1)
    opts = dict(batch_size=2, seed=2, pack=crossfeed.Pack(length=32, split=split), skip=Skip(samples=[0, 4, 5, 60]))
    with crossfeed.Loader(path, **opts) as ld:
        want = list(ld)
    with crossfeed.Loader(path, executor="process", processes=2, **opts) as ld:
        assert _same(list(ld), want)
    with cftorch.TorchDataset(path, rank=0, world_size=1, **opts) as ds:
        assert len(ds) == len(want)
        loader = cftorch.StatefulLoader(ds, num_workers=2)
        got = []
        for b in loader:
            got.append(b)
            if len(got) == 3:
                state = loader.state_dict()
        loader.close()
    assert _same(_np(got), want)
    with cftorch.TorchDataset(path, rank=0, world_size=1, **opts) as ds:
        loader = cftorch.StatefulLoader(ds, num_workers=2)
        loader.load_state_dict(state)
        rest = _np(loader)
        loader.close()
    assert _same(rest, want[3:])
