"""Token ids stored narrow (uint16/uint32, as ``convert text`` stores them) reach PyTorch as
int64 by default — what ``nn.Embedding`` and ``cross_entropy`` take — and as stored with
``keep_dtypes=True`` (`crossfeed.adapters.int_dtypes`)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import lazy_import, requires

torch = lazy_import("torch")

from token_data import write_stored_ids  # noqa: E402

import crossfeed  # noqa: E402

_torch = lazy_import("crossfeed.adapters.torch")

pytestmark = [pytest.mark.slow, requires("torch")]  # torch imported

OPTS = dict(batch_size=4, seed=1, pack=crossfeed.Pack(length=32), rank=0, world_size=1)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_an_embedding_and_cross_entropy_step_on_packed_rows_with_the_defaults(tmp_path, dtype):
    path = write_stored_ids(tmp_path / "ids", dtype=dtype)
    torch.manual_seed(0)
    embed, head = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32)
    opt = torch.optim.SGD([*embed.parameters(), *head.parameters()], lr=0.5)
    with crossfeed.Loader(path, **OPTS) as ld:
        want = [b["tokens"] for b in ld]
    assert want[0].dtype == np.dtype(dtype)  # the Loader delivers them as stored
    losses = []
    with _torch.TorchDataset(path, **OPTS) as ds:
        loader = _torch.StatefulLoader(ds)
        for i, b in enumerate(loader):
            tokens = b["tokens"]
            assert tokens.dtype == torch.int64 and b["segment_ids"].dtype == torch.int32
            assert np.array_equal(tokens.numpy(), want[i].astype(np.int64))
            logits = head(embed(tokens[:, :-1]))
            loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), tokens[:, 1:])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        loader.close()
    assert len(losses) == len(want) and np.isfinite(losses).all() and embed.weight.grad is not None


def test_keep_dtypes_hands_the_stored_ids_over(tmp_path):
    path = write_stored_ids(tmp_path / "ids", dtype="uint16")
    with _torch.TorchDataset(path, keep_dtypes=True, **OPTS) as ds:
        b = next(iter(ds))
    assert b["tokens"].dtype == torch.uint16
    with pytest.raises(RuntimeError):  # what the default spares a user
        torch.nn.Embedding(32, 4)(b["tokens"])
