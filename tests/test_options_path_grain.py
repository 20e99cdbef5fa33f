"""One options path, Grain: `_grain.GrainSource` takes a `LoaderOptions`, or its fields as keywords,
through the Loader's entry point (`LoaderOptions.given`): what to read and how to decode it
(``split``, ``features``, the `ReadOptions` fields) with the Loader's defaults and refusals; the
order fields (the plan and shard groups) belong to the Grain pipeline and are refused by name."""

from __future__ import annotations

import pytest
from conftest import lazy_import, requires
from options_helpers import BAD  # noqa: E402

_grain = lazy_import("crossfeed.adapters.grain")
from crossfeed.errors import ConfigError  # noqa: E402
from crossfeed.read.options import LoaderOptions  # noqa: E402

pytestmark = [pytest.mark.slow, requires("grain")]  # Grain imported

READ = dict(
    split="val",
    features=["x"],
    decode_images=False,
    on_error="skip",
    max_skips=5,
    read_timeout=5,
    storage_options={"anon": True},
    cache_limit="1MB",
)
ORDER = {"batch_size", "shuffle", "seed", "remainder", "block_shards", "rank", "batch_by_tokens", "pack"}


def test_grain_takes_the_reading_options_as_keywords_or_whole(options_data):
    want = LoaderOptions.of(batch_size=1, **READ)
    with _grain.GrainSource(options_data, **READ) as src:
        assert src.options == want and len(src) == 30 and set(src[0]) == {"x"}
    with _grain.GrainSource(options_data, want) as src:
        assert src.options == want and len(src) == 30
    with _grain.GrainSource(options_data, LoaderOptions.of(batch_size=64, split="val")) as src:  # batch_size: Grain's
        assert len(src) == 30


def test_grain_defaults_are_the_options_defaults(options_data):
    with _grain.GrainSource(options_data) as src:
        assert src.options == LoaderOptions.of(batch_size=1)


@pytest.mark.parametrize("field, value", BAD)
def test_grain_refuses_every_bad_value_by_name(options_data, field, value):
    """A reading option's bad value with the Loader's own message; an order option (which has no
    meaning for a random-access source) by its name, whatever its value."""
    with pytest.raises(ConfigError) as b:
        _grain.GrainSource(options_data, **{field: value})
    if field in ORDER:
        assert field in str(b.value) and "Grain pipeline" in str(b.value)
    else:
        with pytest.raises(ConfigError) as a:
            LoaderOptions.of(**{"batch_size": 3, **{field: value}})
        assert str(a.value) == str(b.value)


def test_grain_refuses_order_options_given_whole_and_both_forms_at_once(options_data):
    with pytest.raises(ConfigError, match=r"\['seed'\]"):
        _grain.GrainSource(options_data, LoaderOptions.of(batch_size=4, seed=3))
    with pytest.raises(ConfigError, match="not both"):
        _grain.GrainSource(options_data, LoaderOptions.of(batch_size=4), features=["x"])
