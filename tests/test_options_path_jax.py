"""One options path, JAX: `_jax.JaxLoader` makes the Loader's `LoaderOptions` through the Loader's own
entry point (`LoaderOptions.given`) — ``batch_size``, ``rank`` and ``world_size`` are options
fields, not its own — with the same defaults (but ``drop_last``, its one choice, and the share,
JAX's processes) and the same refusals; its Loader puts each option in its stage."""

from __future__ import annotations

import pytest
from conftest import lazy_import, requires

jax = lazy_import("jax")

from options_helpers import BAD, CHANGED, expected, keep, landed  # noqa: E402

_jax = lazy_import("crossfeed.adapters.jax")
from crossfeed.errors import ConfigError  # noqa: E402
from crossfeed.read.loader import Loader  # noqa: E402
from crossfeed.read.options import LoaderOptions  # noqa: E402

pytestmark = [pytest.mark.slow, requires("jax")]  # JAX imported

GLOBAL = {**CHANGED, "batch_size": 2 * CHANGED["batch_size"]}  # JAX's batch_size is the global batch


def _one_device():
    """A batch sharding over one device, whatever device count another module forced."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    return NamedSharding(Mesh(jax.devices()[:1], ("batch",)), P("batch"))


def test_jax_builds_the_loaders_options_as_keywords_or_whole(options_data):
    want = LoaderOptions.of(**CHANGED)  # this process's share of the global batch
    with _jax.JaxLoader(options_data, transform=keep, sharding=_one_device(), **GLOBAL) as data:
        assert data.options == want and data.global_batch_size == GLOBAL["batch_size"]
        assert (data.rank, data.world_size) == (CHANGED["rank"], CHANGED["world_size"])
        assert landed(data.loader) == expected(want)
    with _jax.JaxLoader(options_data, LoaderOptions.of(**GLOBAL), transform=keep, sharding=_one_device()) as data:
        assert data.options == want and landed(data.loader) == expected(want)


def test_jax_defaults_are_the_options_defaults_but_drop_last_and_the_share(options_data):
    share = {"rank": jax.process_index(), "world_size": jax.process_count()}
    with _jax.JaxLoader(options_data, batch_size=2, sharding=_one_device()) as data:
        assert data.options == LoaderOptions.of(batch_size=2 // share["world_size"], drop_last=True, **share)
    whole = LoaderOptions.of(batch_size=2, drop_last=True, rank=0, world_size=1)
    with _jax.JaxLoader(options_data, whole, sharding=_one_device()) as data:
        assert data.options == whole.replace(**share)


@pytest.mark.parametrize("field, value", BAD)
def test_jax_refuses_what_the_loader_refuses(options_data, field, value):
    with pytest.raises(ConfigError) as a:
        LoaderOptions.of(**{"batch_size": 4, **{field: value}})
    with pytest.raises(ConfigError) as b:
        _jax.JaxLoader(options_data, **{"batch_size": 4, **{field: value}})
    assert str(a.value) == str(b.value)


def test_jax_and_the_loader_refuse_options_and_keywords_together_alike(options_data):
    opts = LoaderOptions.of(batch_size=4, drop_last=True)
    with pytest.raises(ConfigError) as a:
        Loader(options_data, opts, batch_size=4)
    with pytest.raises(ConfigError) as b:
        _jax.JaxLoader(options_data, opts, batch_size=4)
    assert str(a.value) == str(b.value) and "not both" in str(b.value)
    with pytest.raises(ConfigError, match="JaxLoader needs batch_size="):
        _jax.JaxLoader(options_data, seed=1)
