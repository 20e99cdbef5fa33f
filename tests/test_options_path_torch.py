"""One options path, PyTorch: `TorchDataset` makes the Loader's `LoaderOptions` from the same
keywords, with the same defaults and validation, and its Loaders put each option in its stage."""

from __future__ import annotations

import pytest
from conftest import lazy_import
from options_helpers import BAD, CHANGED, IMAGES, expected, keep, landed

from crossfeed.errors import ConfigError
from crossfeed.read.options import LoaderOptions

cftorch = lazy_import("crossfeed.adapters.torch")
pytestmark = pytest.mark.slow  # torch imported: the options path through the torch adapter


def test_torch_dataset_builds_the_loaders_options(options_data):
    want = LoaderOptions.of(**CHANGED)
    with cftorch.TorchDataset(options_data, transform=keep, **CHANGED) as ds:
        assert ds.options == want
        assert landed(ds.loader) == expected(want)
    with cftorch.TorchDataset(options_data, LoaderOptions.of(**CHANGED), transform=keep) as ds:
        assert ds.options == want


def test_torch_dataset_passes_the_image_options(options_data):
    want = LoaderOptions.of(batch_size=3, **IMAGES)
    with cftorch.TorchDataset(options_data, transform=keep, batch_size=3, **IMAGES) as ds:
        assert ds.options == want and landed(ds.loader) == expected(want)


def test_torch_defaults_are_the_options_defaults(options_data, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with cftorch.TorchDataset(options_data, batch_size=3) as ds:
        assert ds.options == LoaderOptions.of(batch_size=3)


@pytest.mark.parametrize("field, value", BAD)
def test_torch_refuses_what_the_loader_refuses(options_data, field, value):
    with pytest.raises(ConfigError) as a:
        LoaderOptions.of(**{"batch_size": 3, **{field: value}})
    with pytest.raises(ConfigError) as b:
        cftorch.TorchDataset(options_data, **{"batch_size": 3, **{field: value}})
    assert str(a.value) == str(b.value)
