"""A two-phase token-weighted packed mixture through PyTorch: a `StatefulLoader` (2 DataLoader
workers) delivers the Loader's rows, phase after phase, and resumes mid-run exactly."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import lazy_import, requires
from test_recipes_torch import _run_and_resume, _same
from token_data import write_tokens

import crossfeed
from crossfeed import Pack, Schedule

torch = lazy_import("torch")
pytestmark = [pytest.mark.slow, requires("torch"), pytest.mark.timeout(240)]


def test_a_two_phase_token_mixture_through_a_stateful_loader_resumes_exactly(tmp_path):
    web = write_tokens(tmp_path / "web", np.arange(1, 60) % 23 + 1, source=0, num_shards=2)
    books = write_tokens(tmp_path / "books", np.arange(1, 30) % 17 + 5, source=1, num_shards=2)
    mix = [  # broad then annealing on books, at the 40th document drawn
        crossfeed.Source(web, weight=Schedule.constant([(0, 3), (40, 1)])),
        crossfeed.Source(books, weight=Schedule.constant([(0, 1), (40, 4)])),
    ]
    opts = dict(batch_size=2, seed=3, samples_per_epoch=80, pack=Pack(length=32, weights_by="tokens"))
    with crossfeed.Loader(mix, **opts) as ld:
        want = list(ld)
    got, rest = _run_and_resume(mix, opts, stop=len(want) // 2)
    assert _same(got, want)
    assert _same(rest, want[len(want) // 2 :])
