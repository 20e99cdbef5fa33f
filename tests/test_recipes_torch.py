"""Recipes through the PyTorch adapter: the per-sample generators, filters and skips give the
Loader's very samples, byte for byte, through DataLoader workers 0 or 2, and a StatefulLoader
resumes exactly in the middle of a filtered, skipped epoch."""

from __future__ import annotations

import numpy as np
import pytest
import recipe_helpers as rh
from conftest import lazy_import, requires

import crossfeed
from crossfeed import Skip

torch = lazy_import("torch")
cftorch = lazy_import("crossfeed.adapters.torch")

pytestmark = [pytest.mark.slow, requires("torch"), pytest.mark.timeout(240)]
SKIP = Skip(steps=[(17, 19)], samples=[5, 6, 40])
KW = dict(batch_size=8, seed=13, return_index=True, skip=SKIP, transform=rh.augment_even, epoch=1)


def _np(batches):
    return [{k: np.asarray(v) for k, v in b.items()} for b in batches]


def test_dataloader_workers_get_the_loaders_samples_byte_for_byte(tmp_path):
    data = rh.write(tmp_path / "d")
    with crossfeed.Loader(data, **KW) as ld:
        want = list(ld)
        assert len(want) == 13
    for workers in (0, 2):
        got = _np(cftorch.StatefulLoader(cftorch.TorchDataset(data, **KW), num_workers=workers))
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert a["__index__"].tolist() == b["__index__"].tolist()
            assert a["noise"].tobytes() == b["noise"].tobytes() and a["shift"].tobytes() == b["shift"].tobytes()


def test_a_stateful_loader_resumes_a_filtered_skipped_epoch_exactly(tmp_path):
    data = rh.write(tmp_path / "d")
    kw = {**KW, "transform": None, "filter": rh.keep_even}
    with crossfeed.Loader(data, **kw) as ld:
        want = [b["__index__"].tolist() for b in ld]
    first = cftorch.StatefulLoader(cftorch.TorchDataset(data, **kw), num_workers=2)
    it = iter(first)
    head = [next(it)["__index__"].tolist() for _ in range(5)]
    state = first.state_dict()
    first.close()
    second = cftorch.StatefulLoader(cftorch.TorchDataset(data, **kw), num_workers=0)
    second.load_state_dict(state)
    rest = [b["__index__"].tolist() for b in second]
    assert head + rest == want


def test_one_sample_at_a_time_the_torch_adapter_refuses_a_dropped_sample_by_name(tmp_path):
    data = rh.write(tmp_path / "d")
    ds = cftorch.TorchDataset(data, batch_size=None, shuffle="none", filter=rh.keep_even)
    with pytest.raises(crossfeed.ConfigError, match="TorchDataset with batch_size=None counts the samples"):
        list(cftorch.StatefulLoader(ds, num_workers=0))


def _same(got, want) -> bool:
    return len(got) == len(want) and all(all(np.array_equal(g[k], w[k]) for k in w) for g, w in zip(got, want))


def _run_and_resume(path, opts, stop: int = 3) -> tuple[list, list]:
    """A StatefulLoader (2 workers) over a whole epoch, its state saved after ``stop`` batches;
    then the rest of the epoch from that state in a fresh one: (every batch, the rest)."""
    with cftorch.TorchDataset(path, rank=0, world_size=1, **opts) as ds:
        loader = cftorch.StatefulLoader(ds, num_workers=2)
        got = []
        for b in loader:
            got.append(b)
            if len(got) == stop:
                state = loader.state_dict()
        loader.close()
    with cftorch.TorchDataset(path, rank=0, world_size=1, **opts) as ds:
        loader = cftorch.StatefulLoader(ds, num_workers=2)
        loader.load_state_dict(state)
        rest = _np(loader)
        loader.close()
    return _np(got), rest


@pytest.mark.parametrize("split", ["documents", "rows"])
def test_dataloader_workers_skip_the_loaders_packed_steps_and_resume(tmp_path, split):
    from token_data import write_tokens

    path = write_tokens(tmp_path / "t", np.arange(1, 90) % 23 + 1)
    opts = dict(batch_size=2, seed=2, pack=crossfeed.Pack(length=32, split=split), skip=Skip(steps=[(1, 3), (6, 7)]))
    with crossfeed.Loader(path, **{**opts, "skip": None}) as ld:
        plain = list(ld)
    want = plain[:1] + plain[3:6] + plain[7:]
    with cftorch.TorchDataset(path, rank=0, world_size=1, **opts) as ds:
        assert len(ds) == len(want)
    got, rest = _run_and_resume(path, opts)
    assert _same(got, want)
    assert _same(rest, want[3:])


@pytest.mark.parametrize("split", ["documents", "rows"])
def test_dataloader_workers_and_processes_skip_the_same_documents(tmp_path, split):
    """Skipped documents of a packed plan: the Loader's very rows through the process executor
    and DataLoader workers, and a StatefulLoader resumes exactly."""
    from token_data import write_tokens

    path = write_tokens(tmp_path / "t", np.arange(1, 90) % 23 + 1)
    opts = dict(batch_size=2, seed=2, pack=crossfeed.Pack(length=32, split=split), skip=Skip(samples=[0, 4, 5, 60]))
    with crossfeed.Loader(path, **opts) as ld:
        want = list(ld)
    with crossfeed.Loader(path, executor="process", processes=2, **opts) as ld:
        assert _same(list(ld), want)
    with cftorch.TorchDataset(path, rank=0, world_size=1, **opts) as ds:
        assert len(ds) == len(want)
    got, rest = _run_and_resume(path, opts)
    assert _same(got, want)
    assert _same(rest, want[3:])
