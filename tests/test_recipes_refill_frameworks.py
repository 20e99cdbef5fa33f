"""Refilled skips (``Skip(samples=…, refill=True)``) through the frameworks: PyTorch DataLoader
workers 0 and 2 get the Loader's very batches, every step full, and a StatefulLoader resumes
in the middle exactly; the TF plan engine and the JAX adapter (whose global arrays keep their
static shapes, so it takes refilled skips) give the same batches."""

from __future__ import annotations

import numpy as np
import pytest
import recipe_helpers as rh
from conftest import lazy_import, requires

import crossfeed
from crossfeed import Skip

torch = lazy_import("torch")
cftorch = lazy_import("crossfeed.adapters.torch")
cftf = lazy_import("crossfeed.adapters.tf")
cfjax = lazy_import("crossfeed.adapters.jax")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
GONE = [5, 6, 40, 77, 101]
KW = dict(batch_size=8, seed=13, return_index=True, skip=Skip(samples=GONE, refill=True), epoch=1)


def _want(data, **kw):
    with crossfeed.Loader(data, **{**KW, **kw}) as ld:
        return [b["__index__"].tolist() for b in ld]


@requires("torch")
def test_dataloader_workers_get_the_loaders_refilled_steps_and_resume_exactly(tmp_path):
    data = rh.write(tmp_path / "d")
    want = _want(data)
    assert [len(b) for b in want] == [8] * 14 + [3]  # 115 samples: every step full but the tail
    assert not {i for b in want for i in b} & set(GONE)
    for workers in (0, 2):
        got = [
            np.asarray(b["__index__"]).tolist()
            for b in cftorch.StatefulLoader(cftorch.TorchDataset(data, **KW), num_workers=workers)
        ]
        assert got == want
    first = cftorch.StatefulLoader(cftorch.TorchDataset(data, **KW), num_workers=2)
    it = iter(first)
    head = [np.asarray(next(it)["__index__"]).tolist() for _ in range(5)]
    state = first.state_dict()
    first.close()
    second = cftorch.StatefulLoader(cftorch.TorchDataset(data, **KW), num_workers=2)
    second.load_state_dict(state)
    rest = [np.asarray(b["__index__"]).tolist() for b in second]
    assert head + rest == want


@requires("tensorflow")
def test_the_tf_plan_engine_gives_the_loaders_refilled_steps(tmp_path):
    data = rh.write(tmp_path / "d")
    got = [b["__index__"].numpy().tolist() for b in cftf.dataset(data, engine="plan", **KW)]
    assert got == _want(data)


@requires("jax")
def test_the_jax_adapter_takes_refilled_skips(tmp_path):
    data = rh.write(tmp_path / "d")
    kw = {**KW, "drop_last": True}
    with cfjax.JaxLoader(data, **kw) as jl:
        batches = list(jl)
    got = [np.asarray(b["__index__"]).tolist() for b in batches]
    assert got == _want(data, drop_last=True) and len(got) == 14
    assert not any("__valid__" in b for b in batches)  # refilled steps are full: no mask to pad them
    with pytest.raises(crossfeed.ConfigError, match="static shapes"):  # not refilled: shorter, so a mask
        cfjax.JaxLoader(data, **{**kw, "skip": Skip(samples=GONE)}, mask=False)
