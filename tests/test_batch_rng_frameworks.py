"""A masking ``batch_transform`` taking ``rng`` over packed rows draws the Loader's very masks
through PyTorch (DataLoader workers 0 and 2, and a resume from a StatefulLoader's state),
TensorFlow and JAX — each framework in a process of its own (`batch_rng_worker`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from batch_rng_worker import KEYS, OPTS
from conftest import requires
from test_batch_rng import mask
from token_data import write_tokens

import crossfeed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # a fresh interpreter per framework
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> str:
    return write_tokens(tmp_path_factory.mktemp("batch-rng-fw") / "t", np.arange(1, 90) % 23 + 1)


@pytest.mark.parametrize(
    "framework",
    [
        pytest.param("torch", marks=requires("torch")),
        pytest.param("torch2", marks=requires("torch")),
        pytest.param("tf", marks=requires("tensorflow")),
        pytest.param("jax", marks=requires("jax")),
    ],
)
def test_each_framework_draws_the_loaders_masks(tokens, tmp_path, framework):
    with crossfeed.Loader(tokens, batch_transform=mask, **OPTS) as ld:
        want = [{k: np.asarray(b[k]).astype(np.int64).tolist() for k in KEYS} for b in ld]
    assert len(want) > 4 and len({json.dumps(w["draw"]) for w in want}) == len(want)
    out = tmp_path / "got.json"
    # one JAX device: other tests' XLA_FLAGS (several host devices) must not split the batch of 2
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "batch_rng_worker.py"), framework, tokens, str(out)],
        capture_output=True,
        text=True,
        timeout=500,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(out.read_text())
    if framework == "torch2":  # the epoch, then its rest from the state after 3 batches
        assert got == want + want[3:]
    else:
        assert got == want
