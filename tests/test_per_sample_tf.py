"""``batch_size=None`` in TensorFlow: both engines yield records (the native engine always did;
the plan engine now too), with one element_spec, and the plan engine's records are the Loader's
``batch_size=None`` samples in its order."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import lazy_import, requires

tf = lazy_import("tensorflow")

from test_per_sample import N, small  # noqa: E402, F401

import crossfeed  # noqa: E402

cftf = lazy_import("crossfeed.adapters.tf")

pytestmark = [pytest.mark.slow, requires("tensorflow")]  # TensorFlow imported


def test_both_engines_yield_records_the_plan_engine_in_the_loaders_order(small):  # noqa: F811
    native = cftf.dataset(small, engine="native", shuffle="none")
    plan = cftf.dataset(small, engine="plan", seed=4)
    assert native.element_spec == plan.element_spec
    assert plan.element_spec["x"].shape == (3,) and plan.element_spec["y"].shape == ()
    with crossfeed.Loader(small, batch_size=None, seed=4) as ld:
        want = list(ld)
    got = list(plan)
    assert len(got) == N == int(plan.cardinality())
    for g, w in zip(got, want):
        assert int(g["y"]) == int(w["y"]) and np.array_equal(g["x"].numpy(), w["x"])
        assert g["name"].numpy() == w["name"] and np.array_equal(g["v"].numpy(), w["v"])
    assert sorted(int(r["y"]) for r in native) == list(range(N))
