"""Packed rows in JAX (`JaxLoader(path, batch_size=B, pack=Pack(L))`): the Loader's rows as dense
``(B, L)`` jax.Arrays, resumable; and one seed gives the same rows in torch, TensorFlow and JAX
(each framework in a process of its own, `pack_framework_worker`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import lazy_import
from pack_framework_worker import KEYS, OPTS
from token_data import write_tokens

import crossfeed
from crossfeed.errors import ConfigError

jax = lazy_import("jax")
cfjax = lazy_import("crossfeed.adapters.jax")
pytestmark = pytest.mark.slow  # a fresh interpreter per framework

LENGTHS = [5, 9, 30, 2, 17, 8, 40, 3, 11, 25, 1, 14, 6, 19, 33, 4]


def loader_rows(path, drop_last: bool = True) -> list[dict]:
    with crossfeed.Loader(path, drop_last=drop_last, **OPTS) as ld:
        return [{k: b[k].astype(np.int64) for k in KEYS} for b in ld]


def _one_device():
    """A sharding on one device: the batch of 2 fits however many devices this process has
    (another test module may have forced 4 before jax started)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("batch",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("batch"))


def test_jax_loader_packs_the_loaders_rows_and_resumes(tmp_path):
    path = write_tokens(tmp_path / "t", LENGTHS)
    want = loader_rows(path)
    assert len(want) > 3
    with cfjax.JaxLoader(path, sharding=_one_device(), **OPTS) as jl:
        assert len(jl) == len(want)
        got = []
        for b in jl:
            assert all(isinstance(b[k], jax.Array) and b[k].shape == (2, 16) for k in KEYS)
            got.append({k: np.asarray(b[k]).astype(np.int64) for k in KEYS})
            if len(got) == 2:
                state = jl.state_dict()
        rest = list(jl)  # the next epoch: other rows
    assert [{k: v.tolist() for k, v in b.items()} for b in got] == [{k: v.tolist() for k, v in b.items()} for b in want]
    assert (
        rest
        and len(rest) != len(want)
        or any(not np.array_equal(np.asarray(a["tokens"]), b["tokens"]) for a, b in zip(rest, want))
    )
    with cfjax.JaxLoader(path, sharding=_one_device(), **OPTS) as jl:
        jl.load_state_dict(state)
        again = [{k: np.asarray(b[k]).astype(np.int64).tolist() for k in KEYS} for b in jl]
    assert again == [{k: v.tolist() for k, v in b.items()} for b in want[2:]]


def test_jax_loader_refuses_token_budgets(tmp_path):
    path = write_tokens(tmp_path / "t", LENGTHS)
    with pytest.raises(ConfigError, match="varying shape"):
        cfjax.JaxLoader(path, batch_size=1, batch_by_tokens=64)


@pytest.mark.timeout(300)
def test_one_seed_gives_the_same_packed_rows_in_torch_tf_and_jax(tmp_path):
    path = write_tokens(tmp_path / "t", LENGTHS)
    every = [{k: v.tolist() for k, v in b.items()} for b in loader_rows(path, drop_last=False)]
    assert len(loader_rows(path)) == len(every) - 1  # JAX keeps shapes static: the last partial batch dropped
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(
        os.environ,
        CUDA_VISIBLE_DEVICES="",
        TF_CPP_MIN_LOG_LEVEL="3",
        XLA_FLAGS="--xla_force_host_platform_device_count=1",
    )
    procs = {}
    for fw in ("torch", "tf", "jax"):
        cmd = [sys.executable, os.path.join(here, "pack_framework_worker.py"), fw, path, str(tmp_path / f"{fw}.json")]
        procs[fw] = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    for fw, p in procs.items():
        _, err = p.communicate(timeout=280)
        assert p.returncode == 0, f"{fw}: {err[-2000:]}"
    for fw in procs:
        got = json.loads((tmp_path / f"{fw}.json").read_text())
        assert got == (every[:-1] if fw == "jax" else every), fw
