"""One framework's packed rows for tests/test_pack_jax.py, in a process of its own (torch,
TensorFlow and JAX are never imported together):

    python tests/pack_framework_worker.py torch|tf|jax DATASET OUT.json

Reads one epoch of ``DATASET`` with that framework's adapter (``batch_size`` 2, ``seed`` 7,
``Pack(length=16)``, one process of world 1) and writes every batch's ``tokens``,
``segment_ids`` and ``positions`` as lists.
"""

from __future__ import annotations

import json
import sys

import numpy as np

import crossfeed

OPTS = dict(batch_size=2, seed=7, pack=crossfeed.Pack(length=16))
KEYS = ("tokens", "segment_ids", "positions")


def rows(framework: str, path: str) -> list[dict]:
    if framework == "torch":
        from crossfeed.adapters.torch import StatefulLoader, TorchDataset

        with TorchDataset(path, rank=0, world_size=1, **OPTS) as ds, StatefulLoader(ds, num_workers=0) as loader:
            return [{k: b[k].numpy() for k in KEYS} for b in loader]
    if framework == "tf":
        import crossfeed.adapters.tf as cftf

        return [{k: b[k].numpy() for k in KEYS} for b in cftf.dataset(path, **OPTS)]
    from crossfeed.adapters.jax import JaxLoader

    with JaxLoader(path, **OPTS) as loader:
        return [{k: np.asarray(b[k]) for k in KEYS} for b in loader]


if __name__ == "__main__":
    framework, path, out = sys.argv[1:]
    got = rows(framework, path)
    with open(out, "w") as f:
        json.dump([{k: np.asarray(b[k]).astype(np.int64).tolist() for k in KEYS} for b in got], f)
