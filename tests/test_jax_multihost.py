"""The JAX adapter on two hosts for real: two processes on this machine joined by
``jax.distributed`` (2 CPU devices each, gloo collectives), a batch-sharded `NamedSharding`
over all 4 devices, a linear regression trained with ``jax.grad``. Each step's global batch is
the one the Loader plans for a world of two, sample for sample (process 0's share in rows 0-3,
process 1's in rows 4-7); every sample comes once per epoch; both hosts take the same number of
steps (a remainder included) and agree on the state; the loss falls."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from framework_helpers import assert_plan, epoch_order, run_jax_hosts, write_xy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs jax"),
]  # slow: two JAX hosts (multihost)
SEED = 3


def test_two_hosts_train_on_the_loaders_shares(tmp_path):
    even = write_xy(tmp_path / "even", 64)
    odd = write_xy(tmp_path / "odd", 70, seed=5)  # 35 a rank: 8 steps of 4, 3 samples a rank dropped
    runs = [
        dict(source=even, batch_size=8, seed=SEED, steps=None, epochs=3, state_in=None, out=str(tmp_path / "even")),
        dict(source=odd, batch_size=8, seed=SEED, steps=None, epochs=1, state_in=None, out=str(tmp_path / "odd")),
    ]
    (even_out, odd_out) = run_jax_hosts(runs, tmp_path)
    for per_process in (even_out, odd_out):
        assert [p["devices"] for p in per_process] == [[2, 4], [2, 4]]
        assert all(p["local_rows"] == [4] for p in per_process)  # each host holds its half of every batch
        assert per_process[0]["ids"] == per_process[1]["ids"] and per_process[0]["state"] == per_process[1]["state"]
    ids = even_out[0]["ids"]
    assert len(ids) == 3 * 8
    for epoch in range(3):
        steps = ids[epoch * 8 : (epoch + 1) * 8]
        assert sorted(i for row in steps for i in row) == list(range(64))  # every sample once an epoch
        assert_plan([[r[:4], r[4:]] for r in steps], epoch_order(even, SEED, epoch), position=0, world=2, batch=4)
    assert even_out[0]["state"] == dict(even_out[0]["state"], epoch=3, position=0)
    losses = np.array(even_out[0]["losses"])
    assert losses[-8:].mean() < 0.5 * losses[:8].mean(), losses
    # the remainder: both hosts stop after the same 8 steps, with the plan's samples
    odd_ids = odd_out[0]["ids"]
    assert_plan([[r[:4], r[4:]] for r in odd_ids], epoch_order(odd, SEED), position=0, world=2, batch=4)
