"""A nested mixture spec file (a group of a dataset's version 1 and the delta view of what version
2 appended, brought in from a sample onward) served by a real `crossfeed serve MIX.json` process:
the client gets the Loader's very batches over the flattened leaves."""

from __future__ import annotations

import json

import pytest
from net_helpers import served_rows

import crossfeed
from crossfeed.read.sources.mixture_file import load_mixture_spec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]  # real processes


@pytest.fixture
def spec(tmp_path):
    crossfeed.write_dataset(tmp_path / "hq", [{"id": 1000 + i} for i in range(5)]).close()
    crossfeed.write_dataset(tmp_path / "daily", [{"id": i} for i in range(12)], num_shards=2).close()
    crossfeed.write_dataset(tmp_path / "daily", [{"id": 100 + i} for i in range(6)], append=True).close()
    group = {
        "mixture": [
            {"path": "daily@v1", "weight": {"constant": [[0, 1], [16, 2]]}},
            {"path": "daily@v2-v1", "weight": {"constant": [[0, 0], [16, 1]]}},
        ],
        "weight": 3,
    }
    path = tmp_path / "mix.json"
    path.write_text(json.dumps({"sources": [{"path": "hq"}, group], "samples_per_epoch": 32}))
    return path


def test_serve_streams_a_nested_spec_with_a_delta_view_in_the_loaders_order(tmp_path, spec):
    sources, n = load_mixture_spec(spec)
    assert [str(s.path).rsplit("/", 1)[1] for s in sources] == ["hq", "daily@v1", "daily@v2-v1"]
    with crossfeed.Loader(sources, batch_size=4, seed=3, samples_per_epoch=n, return_index=True) as loader:
        want = [(e, b["__source__"].tolist(), b["id"].tolist()) for e in range(2) for b in loader]
    got = served_rows(tmp_path, spec, lambda m, b: (m.epoch, b["__source__"].tolist(), b["id"].tolist()))
    assert got == want and len(got) == 16
    ids = [i for _, _, b in got for i in b]
    assert not any(100 <= i < 1000 for i in ids[:16]) and any(100 <= i < 1000 for i in ids[16:])
