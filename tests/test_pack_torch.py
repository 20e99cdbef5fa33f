"""Packed rows in PyTorch: `TorchDataset` and `StatefulLoader` deliver the Loader's packed rows as
``(B, L)`` tensors with their masks (with DataLoader workers, and resumed mid-epoch), and a small
language model learns from them with the segment mask keeping documents apart."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import lazy_import
from token_data import write_language, write_tokens

import crossfeed

torch = lazy_import("torch")
cftorch = lazy_import("crossfeed.adapters.torch")
pytestmark = pytest.mark.slow  # torch imported: training

OPTS = dict(batch_size=4, seed=2, pack=crossfeed.Pack(length=32))


def _equal(torch_batches, numpy_batches) -> bool:
    return len(torch_batches) == len(numpy_batches) and all(
        t.keys() == n.keys() and all(torch.equal(t[k], torch.from_numpy(np.asarray(n[k]))) for k in n)
        for t, n in zip(torch_batches, numpy_batches)
    )


def test_torch_gets_the_loaders_packed_rows_with_workers_and_resumes(tmp_path):
    path = write_tokens(tmp_path / "t", np.arange(1, 60) % 23 + 1)
    with crossfeed.Loader(path, **OPTS) as ld:
        want = list(ld)
    with cftorch.TorchDataset(path, rank=0, world_size=1, **OPTS) as ds:
        loader = cftorch.StatefulLoader(ds, num_workers=2)
        got = []
        for b in loader:
            assert b["tokens"].shape == (4, 32) and b["segment_ids"].dtype == torch.int32
            # the worker's batch crossed the queue as one shared-memory storage, not three
            storages = {b[k].untyped_storage().data_ptr() for k in ("tokens", "segment_ids", "positions")}
            assert len(storages) == 1 and b["tokens"].is_shared()
            got.append(b)
            if len(got) == 3:
                state = loader.state_dict()
        assert _equal(got, want) and len(ds) == len(want)
        loader.close()
    with cftorch.TorchDataset(path, rank=0, world_size=1, **OPTS) as ds:
        loader = cftorch.StatefulLoader(ds, num_workers=1)
        loader.load_state_dict(state)
        assert _equal(list(loader), want[3:])
        loader.close()


def next_token_model(vocab: int):
    """Embedding, then a linear layer back to the vocabulary (built in the test: collecting this
    module imports no torch)."""
    return torch.nn.Sequential(torch.nn.Embedding(vocab, 32), torch.nn.Linear(32, vocab))


def masked_loss(model, batch) -> torch.Tensor:
    """Next-token cross entropy where the next token is of the same document (segment_ids)."""
    tokens, seg = batch["tokens"].long(), batch["segment_ids"]
    logits = model(tokens[:, :-1])
    same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
    loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
    return (loss * same).sum() / same.sum()


def test_a_small_language_model_learns_from_packed_rows(tmp_path):
    torch.manual_seed(0)
    path = write_language(tmp_path / "lm")
    model = next_token_model(32)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    losses = []
    with cftorch.TorchDataset(path, rank=0, world_size=1, batch_size=8, seed=0, pack=crossfeed.Pack(64)) as ds:
        loader = cftorch.StatefulLoader(ds, num_workers=0)
        for _ in range(4):  # epochs
            for batch in loader:
                loss = masked_loss(model, batch)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
    assert len(losses) >= 20
    assert np.mean(losses[-5:]) < 0.25 * np.mean(losses[:3])
    assert np.mean(losses[:3]) == pytest.approx(np.log(32), rel=0.3)  # it started from chance
