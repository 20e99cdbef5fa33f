"""`crossfeed serve MIX.json`: a mixture served over a real socket, in the Loader's order."""

from __future__ import annotations

import json

import numpy as np
import pytest
from net_helpers import served_rows

import crossfeed
from crossfeed.errors import ConfigError
from crossfeed.read.sources.mixture_file import load_mixture_spec

pytestmark = pytest.mark.timeout(90)


def _source(root, name: str, n: int, offset: int):
    crossfeed.write_dataset(root / name, [{"id": offset + i} for i in range(n)], num_shards=2).close()


def test_serve_streams_a_mixture_in_the_loaders_order(tmp_path):
    _source(tmp_path, "big", 30, 0)
    _source(tmp_path, "small", 5, 1000)
    spec = tmp_path / "mix.json"
    spec.write_text(
        json.dumps({"sources": [{"path": "big", "weight": 3}, {"path": "small", "weight": 1}], "samples_per_epoch": 40})
    )
    got = served_rows(
        tmp_path, spec, lambda m, b: (m.epoch, b["__source__"].tolist(), m.sample_ids.tolist(), b["id"].tolist())
    )
    sources, n = load_mixture_spec(spec)
    with crossfeed.Loader(sources, batch_size=4, seed=3, samples_per_epoch=n, return_index=True) as loader:
        want = [
            (e, b["__source__"].tolist(), b["__index__"].tolist(), b["id"].tolist()) for e in (0, 1) for b in loader
        ]
    assert sorted(got) == sorted(want) and len(got) == 20  # the same batches, each sent once
    for epoch in (0, 1):  # one trainer: in the plan's order
        assert [g for g in got if g[0] == epoch] == [w for w in want if w[0] == epoch]
    src = np.concatenate([s for _, s, _, _ in got])
    assert np.bincount(src).tolist() == [60, 20]  # weights 3:1 over 80 samples


def test_a_bad_mixture_spec_is_a_clear_error(tmp_path):
    spec = tmp_path / "mix.json"
    spec.write_text(json.dumps({"sources": [{"path": "a", "weight": 0}]}))
    with pytest.raises(ConfigError, match="mix.json: source 0: .*positive"):
        load_mixture_spec(spec)
    spec.write_text(json.dumps({"sources": [{"path": "a"}], "epochs": 3}))
    with pytest.raises(ConfigError, match="unknown keys \\['epochs'\\]"):
        load_mixture_spec(spec)
    spec.write_text("{")
    with pytest.raises(ConfigError, match="mix.json: cannot read"):
        load_mixture_spec(spec)
