"""A scheduled mixture (a mixture spec file whose weights are schedules) streamed by real
processes: `crossfeed serve MIX.json` and `crossfeed dispatch MIX.json` with a
`crossfeed serve MIX.json --dispatcher` server deliver the Loader's very batches."""

from __future__ import annotations

import json

import numpy as np
import pytest
from dispatch_helpers import start_dispatcher, start_server
from net_helpers import FAST_HB, served_rows, stop

import crossfeed
from crossfeed.net import connect
from crossfeed.read.sources.mixture_file import load_mixture_spec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]  # real processes


@pytest.fixture
def spec(tmp_path):
    for name, n, offset in (("broad", 30, 0), ("hq", 5, 1000)):
        crossfeed.write_dataset(tmp_path / name, [{"id": offset + i} for i in range(n)], num_shards=2).close()
    path = tmp_path / "mix.json"
    sources = [
        {"path": "broad", "weight": {"constant": [[0, 3], [24, 1]]}},
        {"path": "hq", "weight": {"linear": [[0, 1], [24, 3]], "every": 8}},
    ]
    path.write_text(json.dumps({"sources": sources, "samples_per_epoch": 40}))
    return path


def _want(spec, epochs: int = 2):
    sources, n = load_mixture_spec(spec)
    with crossfeed.Loader(sources, batch_size=4, seed=3, samples_per_epoch=n, return_index=True) as loader:
        return [
            (e, b["__source__"].tolist(), b["__index__"].tolist(), b["id"].tolist())
            for e in range(epochs)
            for b in loader
        ]


def test_serve_streams_a_scheduled_mixture_in_the_loaders_order(tmp_path, spec):
    got = served_rows(
        tmp_path, spec, lambda m, b: (m.epoch, b["__source__"].tolist(), m.sample_ids.tolist(), b["id"].tolist())
    )
    want = _want(spec)
    assert got == want and len(got) == 20
    src = np.concatenate([s for _, s, _, _ in got])
    assert (src[24:] == 1).sum() == 42  # from sample 24 on: broad 1, hq 3 (56 samples)


def test_a_dispatcher_leases_a_scheduled_mixture_every_batch_once(tmp_path, spec):
    d, address = start_dispatcher(tmp_path, str(spec), "tcp://127.0.0.1:0", "--seed", "3", "--epochs", "1")
    procs = [d]
    try:
        procs.append(start_server(tmp_path, str(spec), address, "s0", "--threads", "1"))
        with connect(
            dispatcher=address, with_meta=True, **dict(FAST_HB, heartbeat_timeout=1.5, connect_timeout=20.0)
        ) as c:
            got = [(b["__source__"].tolist(), m.sample_ids.tolist(), b["id"].tolist()) for m, b in c]
        assert d.wait(30) == 0, (tmp_path / "d.log").read_text()[-3000:]
    finally:
        stop(*procs)
    want = [w[1:] for w in _want(spec, epochs=1)]
    assert sorted(got) == sorted(want) and len(got) == 10, (tmp_path / "s0.log").read_text()[-3000:]
