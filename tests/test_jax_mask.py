"""The JAX adapter with filters and skipped sample ids: each process's shortened batch is padded
back to its fixed share of the global batch, with a ``__valid__`` mask. The valid rows are the
Loader's filtered batches exactly (same samples, same order, the same per-sample generator
draws), every step has the one shape (steps whose every sample was dropped included, the
epoch's first among them), a resume mid-epoch from the JaxLoader's state gives the same, and a
jitted step with the masked loss compiles once and weighs padded rows 0. Several CPU devices are
forced when this module imports jax first (as tests/test_jax.py does)."""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import numpy as np
import pytest
import recipe_helpers as rh
from conftest import lazy_import, requires

import crossfeed
from crossfeed import Skip
from crossfeed.format.schema import VALID_KEY

jax = lazy_import("jax")
jnp = lazy_import("jax.numpy")
cfjax = lazy_import("crossfeed.adapters.jax")

pytestmark = [pytest.mark.slow, requires("jax")]
SKIP = Skip(steps=[(2, 4)], samples=[5, 6, 40])
KW = dict(batch_size=8, seed=13, return_index=True, skip=SKIP)
RECIPES = {
    "filter": dict(filter=rh.keep_even),
    "transform-none-rng": dict(transform=rh.augment_even, mask=True),
    "most-dropped": dict(filter=rh.drop_most),  # the epoch's first step loses every sample
    # ... and its empty batch holds the decoded features, not the transform's (noise, shift)
    "most-dropped-transform": dict(transform=rh.augment_tenth, mask=True),
    # worker processes: batches in shared-memory slots, each worker's empty batches its own
    "transform-none-rng-process": dict(transform=rh.augment_even, mask=True, executor="process", processes=2),
}


def _loader(data, recipe, **kw):
    recipe = {k: v for k, v in recipe.items() if k not in ("mask", "executor", "processes")}
    with crossfeed.Loader(data, drop_last=True, **{**KW, **recipe, **kw}) as ld:
        return list(ld)


def _host(batch) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in batch.items()}


def _check_step(got: dict, want: dict, rows: int) -> None:
    """``got`` (a padded JAX batch, on the host) holds ``want`` (the Loader's) in its valid rows
    first, then zero padding; every array has ``rows`` rows."""
    valid = got[VALID_KEY]
    n = len(want["__index__"])
    assert valid.dtype == np.bool_ and valid.tolist() == [True] * n + [False] * (rows - n)
    assert set(got) == set(want) | {VALID_KEY} or n == 0
    for k, v in got.items():
        assert v.shape[0] == rows, k
        if k == VALID_KEY:
            continue
        assert not v[n:].any(), f"{k}: padded rows are not 0"
        if k in want:
            mine = np.asarray(want[k]).astype(v.dtype)  # 64-bit as 32 unless jax_enable_x64
            assert v[:n].tobytes() == mine.tobytes(), k


@pytest.mark.parametrize("name", list(RECIPES))
def test_valid_rows_are_the_loaders_filtered_batches_and_every_step_has_one_shape(tmp_path, name):
    data = rh.write(tmp_path / "d")
    recipe = RECIPES[name]
    want = _loader(data, recipe)
    with cfjax.JaxLoader(data, **KW, **recipe) as jl:
        assert jl.mask and len(jl) == len(want) == 13
        arrays = list(jl)
        assert all(a[VALID_KEY].sharding == arrays[0]["x"].sharding for a in arrays)
        got = [_host(b) for b in arrays]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        _check_step(g, w, 8)
    shapes = {tuple((k, v.shape, v.dtype.str) for k, v in sorted(g.items())) for g in got}
    assert len(shapes) == 1, shapes  # one shape, one dtype for every step: jit compiles once
    if name.startswith("most-dropped"):
        assert not got[0][VALID_KEY].any() and got[1][VALID_KEY].any()  # held until the shapes were known
        if name == "most-dropped-transform":  # the Loader's empty step never met the transform's features
            assert "noise" not in want[0] and {"noise", "shift"} <= set(got[0])
    if name.startswith("transform-none-rng"):  # the per-sample generators' draws, byte for byte
        assert {"noise", "shift"} <= set(got[0])
        assert sum(int(g[VALID_KEY].sum()) for g in got) == sum(len(w["__index__"]) for w in want) > 0


@pytest.mark.parametrize("taken", [1, 5])
def test_a_resume_mid_epoch_gives_the_same_padded_steps(tmp_path, taken):
    data = rh.write(tmp_path / "d")
    recipe = dict(filter=rh.drop_most)
    full = _loader(data, recipe)
    with cfjax.JaxLoader(data, device_prefetch=2, **KW, **recipe) as jl:
        it = iter(jl)
        first = [_host(next(it)) for _ in range(taken)]
        state = jl.state_dict()
        it.close()
    with crossfeed.Loader(data, drop_last=True, **KW, **recipe) as ld:  # the Loader's state after as many steps
        it = iter(ld)
        for _ in range(taken):
            next(it)
        assert state == ld.state_dict()  # skipped steps (2, 3) and dropped samples counted alike
        it.close()
    with cfjax.JaxLoader(data, **KW, **recipe) as again:
        again.load_state_dict(state)
        assert len(again) == len(full) - taken
        rest = [_host(b) for b in again]
    assert len(first) + len(rest) == len(full)
    for g, w in zip(first + rest, full):
        _check_step(g, w, 8)


def test_a_jitted_step_weighs_padded_rows_zero_and_compiles_once(tmp_path):
    data = rh.write(tmp_path / "d")
    traced = []

    @jax.jit
    def step(w, batch):
        traced.append(1)
        x = batch["x"].astype(jnp.float32)
        err = (x @ w - batch["label"].astype(jnp.float32)) ** 2
        valid = batch[VALID_KEY]
        loss = jnp.where(valid, err, 0).sum() / jnp.maximum(valid.sum(), 1)
        return w - 1e-5 * jax.grad(lambda w: jnp.mean(jnp.where(valid, (x @ w) ** 2, 0)))(w), loss

    with cfjax.JaxLoader(data, filter=rh.keep_even, **KW) as jl:
        replicated = jax.sharding.NamedSharding(jl.sharding.mesh, jax.sharding.PartitionSpec())
        w = jax.device_put(jnp.ones(3, jnp.float32), replicated)  # as the step returns it: no second trace
        for batch in jl:
            host = _host(batch)
            keep = host[VALID_KEY]
            expect = ((host["x"][keep].astype(np.float32) @ np.asarray(w) - host["label"][keep]) ** 2).mean()
            w, loss = step(w, batch)
            np.testing.assert_allclose(float(loss), expect, rtol=1e-5)
    assert len(traced) == 1


def test_what_mask_takes_and_refuses(tmp_path):
    data = rh.write(tmp_path / "d")
    plain = dict(batch_size=8, seed=13, return_index=True)
    with crossfeed.Loader(data, drop_last=True, **plain) as ld:
        want = list(ld)
    with cfjax.JaxLoader(data, mask=True, **plain) as jl:  # nothing dropped: every row valid
        got = [_host(b) for b in jl]
    assert len(got) == len(want) and all(g[VALID_KEY].all() for g in got)
    for g, w in zip(got, want):
        _check_step(g, w, 8)
    with cfjax.JaxLoader(data, **plain) as jl:  # off unless something makes batches shorter
        assert not jl.mask and VALID_KEY not in next(iter(jl))
    with pytest.raises(crossfeed.ConfigError, match="filter= and skipped sample ids not refilled make batches shorter"):
        cfjax.JaxLoader(data, filter=rh.keep_even, mask=False, **KW)
    with pytest.raises(crossfeed.ConfigError, match="mask must be"):
        cfjax.JaxLoader(data, mask="yes", **plain)
    with cfjax.JaxLoader(data, transform=rh.drop_odd, **plain) as jl:  # a transform may drop: mask=True says so
        with pytest.raises(crossfeed.SchemaError, match="mask=True"):
            next(iter(jl))
