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


def test_two_hosts_pad_their_filtered_shares_to_one_global_shape(tmp_path):
    """A filter and skipped sample ids on two hosts: each pads its own share back to 4 rows, so
    every step is one global (8,) shape; the valid rows of host r's half are the Loader's
    filtered batch of rank r of 2, in order, padded with 0 (the worker's step takes the masked loss)."""
    import crossfeed

    data = write_xy(tmp_path / "xy", 64)
    skipped = [3, 17, 40]
    run = dict(
        source=data,
        batch_size=8,
        seed=SEED,
        steps=None,
        epochs=1,
        state_in=None,
        out=str(tmp_path / "masked"),
        filter="recipe_helpers:positive_y",
        skip_samples=skipped,
    )
    (per_process,) = run_jax_hosts([run], tmp_path)
    assert per_process[0]["ids"] == per_process[1]["ids"] and per_process[0]["valid"] == per_process[1]["valid"]
    assert per_process[0]["state"] == per_process[1]["state"]
    ids, valid = per_process[0]["ids"], per_process[0]["valid"]
    assert len(ids) == len(valid) == 8 and all(len(r) == 8 and len(v) == 8 for r, v in zip(ids, valid))
    for rank in range(2):
        kw = dict(batch_size=4, seed=SEED, rank=rank, world_size=2, return_index=True, drop_last=True)
        with crossfeed.Loader(
            data, filter="recipe_helpers:positive_y", skip=crossfeed.Skip(samples=skipped), **kw
        ) as ld:
            want = [b["__index__"].tolist() for b in ld]
        assert len(want) == 8
        for step, (row, mask, w) in enumerate(zip(ids, valid, want)):
            half, ok = row[rank * 4 : rank * 4 + 4], mask[rank * 4 : rank * 4 + 4]
            assert ok == [True] * len(w) + [False] * (4 - len(w)), (step, rank)
            assert half[: len(w)] == w and all(i == 0 for i in half[len(w) :]), (step, rank)
    kept = sorted(i for row, mask in zip(ids, valid) for i, ok in zip(row, mask) if ok)
    assert kept and not set(kept) & set(skipped) and len(kept) == len(set(kept)) < 64
