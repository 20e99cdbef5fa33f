"""Token ids stored narrow (uint16/uint32) reach JAX as int32 with `_jax.JaxLoader`'s defaults, checked
to fit (a uint32 id past 2^31 is refused by name); ``keep_dtypes=True`` keeps them as stored."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import lazy_import, requires

jax = lazy_import("jax")

from token_data import write_stored_ids  # noqa: E402

import crossfeed  # noqa: E402

_jax = lazy_import("crossfeed.adapters.jax")
from crossfeed.errors import SchemaError  # noqa: E402

jnp = lazy_import("jax.numpy")

pytestmark = [pytest.mark.slow, requires("jax")]  # JAX imported


def _one_device():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("batch",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("batch"))


def _loss(table, tokens, segments):
    logits = table[tokens[:, :-1]]  # an embedding lookup that is also the next-token logits
    target = jax.nn.one_hot(tokens[:, 1:], table.shape[1])
    same = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
    nll = -(jax.nn.log_softmax(logits) * target).sum(-1)
    return (nll * same).sum() / same.sum()


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_a_jax_step_on_packed_rows_with_the_defaults(tmp_path, dtype):
    path = write_stored_ids(tmp_path / "ids", dtype=dtype)
    opts = dict(batch_size=4, seed=1, pack=crossfeed.Pack(length=32))
    with crossfeed.Loader(path, drop_last=True, **opts) as ld:
        want = [b["tokens"] for b in ld]
    table = jnp.zeros((32, 32))
    step = jax.jit(jax.value_and_grad(_loss))
    with _jax.JaxLoader(path, sharding=_one_device(), **opts) as loader:
        got = 0
        for i, b in enumerate(loader):
            assert b["tokens"].dtype == jnp.int32
            assert np.array_equal(np.asarray(b["tokens"]), want[i].astype(np.int32))
            loss, grad = step(table, b["tokens"], b["segment_ids"])
            table = table - 0.5 * grad
            got += 1
    assert got == len(want) and np.isfinite(float(loss)) and float(jnp.abs(table).sum()) > 0


def test_a_uint32_id_past_int32_is_named_and_keep_dtypes_keeps_it(tmp_path):
    path = write_stored_ids(tmp_path / "ids", dtype="uint32", top=2**31 + 5)
    opts = dict(batch_size=4, seed=1, pack=crossfeed.Pack(length=32), sharding=_one_device())
    with _jax.JaxLoader(path, **opts) as loader:
        with pytest.raises(SchemaError, match=r"feature 'tokens'.*keep_dtypes=True"):
            list(loader)
    with _jax.JaxLoader(path, keep_dtypes=True, **opts) as loader:
        batches = list(loader)
    assert batches and all(b["tokens"].dtype == jnp.uint32 for b in batches)
    assert max(int(b["tokens"].max()) for b in batches) == 2**31 + 5
