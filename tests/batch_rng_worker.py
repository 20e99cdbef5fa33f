"""One framework's packed batches with a masking ``batch_transform`` taking ``rng`` for
tests/test_batch_rng_frameworks.py, in a process of its own (torch, TensorFlow and JAX are never
imported together):

    python tests/batch_rng_worker.py torch|torch2|tf|jax DATASET OUT.json

Reads one epoch of ``DATASET`` (`OPTS`) with that framework's adapter (``torch2``: DataLoader
workers 2, its state saved after 3 batches and the rest read from it by a fresh one) and writes
every batch's ``draw`` and ``mask`` as lists.
"""

from __future__ import annotations

import json
import sys

import numpy as np

import crossfeed

OPTS = dict(batch_size=2, seed=7, pack=crossfeed.Pack(length=32), epoch=1, drop_last=True)  # JAX: static shapes
KEYS = ("tokens", "mask", "draw")


def rows(framework: str, path: str) -> list[dict]:
    from test_batch_rng import mask  # by reference: DataLoader workers import it too

    if framework.startswith("torch"):
        from crossfeed.adapters.torch import StatefulLoader, TorchDataset

        workers = 2 if framework == "torch2" else 0
        with TorchDataset(path, rank=0, world_size=1, batch_transform=mask, **OPTS) as ds:
            loader = StatefulLoader(ds, num_workers=workers)
            got = []
            for b in loader:
                got.append({k: b[k].numpy() for k in KEYS})
                if len(got) == 3:
                    state = loader.state_dict()
            loader.close()
        if workers:  # and the rest again from the state after 3 batches, in a fresh loader
            with TorchDataset(path, rank=0, world_size=1, batch_transform=mask, **OPTS) as ds:
                loader = StatefulLoader(ds, num_workers=workers)
                loader.load_state_dict(state)
                got += [{k: b[k].numpy() for k in KEYS} for b in loader]
                loader.close()
        return got
    if framework == "tf":
        import tensorflow as tf

        import crossfeed.adapters.tf as cftf

        spec = {
            "tokens": tf.TensorSpec((2, 32), tf.int64),
            "segment_ids": tf.TensorSpec((2, 32), tf.int32),
            "positions": tf.TensorSpec((2, 32), tf.int32),
            "mask": tf.TensorSpec((2, 32), tf.bool),
            "draw": tf.TensorSpec((2, 3), tf.int64),
        }
        ds = cftf.dataset(path, element_spec=spec, loader_options={"batch_transform": mask}, **OPTS)
        return [{k: b[k].numpy() for k in KEYS} for b in ds]
    from crossfeed.adapters.jax import JaxLoader

    with JaxLoader(path, batch_transform=mask, **OPTS) as loader:
        return [{k: np.asarray(b[k]) for k in KEYS} for b in loader]


if __name__ == "__main__":
    framework, path, out = sys.argv[1:]
    got = rows(framework, path)
    with open(out, "w") as f:
        json.dump([{k: np.asarray(b[k]).astype(np.int64).tolist() for k in KEYS} for b in got], f)
