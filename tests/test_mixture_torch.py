"""The photo mixture (tar + TFRecord + Parquet, renamed; photos of many sizes, some gray) at
``image_size=(32, 32), channels=3`` through the PyTorch adapter: dense ``(B, 32, 32, 3)`` uint8
tensors, the Loader's very batches, through DataLoader worker processes, into real training steps."""

from __future__ import annotations

import numpy as np
import pytest
from adopt_helpers import trusted_roots  # noqa: F401 (autouse: the tests' data roots are trusted)
from conftest import lazy_import
from photo_data import CLASSES, sources, write_all

import crossfeed

torch = lazy_import("torch")
torch_data = lazy_import("torch.utils.data")
cftorch = lazy_import("crossfeed.adapters.torch")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]  # slow: torch imported, worker processes
KW = dict(batch_size=8, seed=5, samples_per_epoch=40, image_size=(32, 32), channels=3, return_index=True)


def test_photos_of_any_size_train_a_torch_model_from_the_loaders_batches(tmp_path):
    mix = sources(write_all(tmp_path))
    with crossfeed.Loader(mix, **KW) as ld:
        want = list(ld)
    ds = cftorch.TorchDataset(mix, **KW)
    got = list(cftorch.StatefulLoader(ds, num_workers=2))
    assert len(got) == len(want) == 5
    for a, b in zip(got, want):
        assert a["image"].shape == (8, 32, 32, 3) and a["image"].dtype == torch.uint8
        for k in b:
            np.testing.assert_array_equal(a[k].numpy(), b[k])
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, stride=2), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.LazyLinear(CLASSES)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for batch in torch_data.DataLoader(ds, batch_size=None):
        x = batch["image"].permute(0, 3, 1, 2).float() / 255
        loss = torch.nn.functional.cross_entropy(model(x), batch["label"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert torch.isfinite(loss)
    ds.close()
