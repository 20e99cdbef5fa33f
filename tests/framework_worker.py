"""One framework's side of tests/test_checkpoint_frameworks.py, in a process of its own (torch
and TensorFlow are never imported together):

    python tests/framework_worker.py torch|tf|jax JOBS.json

Each job ``{"source", "seed", "batch" (per rank), "world", "steps" (None: to the epoch's end),
"state_in" (a state file, or None), "state_out" (or None), "out", "defaults" (True: torch and TF
without drop_last=, their default)}`` reads with that framework's
adapter as each rank ``0..world-1`` in turn, resuming ``state_in``, and writes ``{"steps":
[[ids of rank r at step j, for each r] for each j], "state": the state after "steps" batches}``.
JAX runs one process of one device here (world 1); its multi-host side is `jax_worker`.
"""

from __future__ import annotations

import json
import sys

from framework_helpers import SOURCE_ID, source_of

FEATURES = ["x", "y"]


def _ids(batch) -> list[int]:
    import numpy as np

    index = np.asarray(batch["__index__"]).astype(np.int64)
    if "__source__" in batch:
        index = index + np.asarray(batch["__source__"]).astype(np.int64) * SOURCE_ID
    return index.tolist()


def _rank_torch(job, rank, state):
    from crossfeed.adapters.torch import StatefulLoader, TorchDataset

    ds = TorchDataset(
        source_of(job["source"]),
        batch_size=job["batch"],
        seed=job["seed"],
        rank=rank,
        world_size=job["world"],
        **({} if job.get("defaults") else {"drop_last": True}),  # defaults: the adapter's own
        return_index=True,
        features=FEATURES,
    )
    with StatefulLoader(ds, num_workers=0) as loader:
        if state is not None:
            loader.load_state_dict(state)
        ids = []
        for batch in loader:
            ids.append(_ids(batch))
            if len(ids) == job["steps"]:
                break
        return ids, loader.state_dict()


def _rank_tf(job, rank, state):
    import crossfeed.adapters.tf as cftf

    kw = dict(
        batch_size=job["batch"],
        seed=job["seed"],
        world_size=job["world"],
        **({} if job.get("defaults") else {"drop_last": True}),  # defaults: the adapter's own
        features=FEATURES,
    )
    ds = cftf.dataset(source_of(job["source"]), engine="plan", rank=rank, return_index=True, state=state, **kw)
    ids = []
    for batch in ds:
        ids.append(_ids({k: v.numpy() for k, v in batch.items()}))
        if len(ids) == job["steps"]:
            break
    saved = None
    if job["state_out"] and state is None:  # TF saves the plan's state after so many steps
        source = source_of(job["source"])
        if isinstance(source, list):  # plan_state takes one dataset: a mixture's is the Loader's own
            import crossfeed

            with crossfeed.Loader(source, rank=0, return_index=True, **kw) as ld:
                ld.start_at(0, ld.position_after(0, len(ids)))
                saved = ld.state_dict()
        else:
            saved = cftf.plan_state(source, steps=len(ids), **kw)
    return ids, saved


def _rank_jax(job, rank, state):
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from crossfeed.adapters.jax import JaxLoader

    assert job["world"] == 1, "one JAX process reads world 1 here; jax_worker runs several"
    sharding = NamedSharding(Mesh(jax.devices()[:1], ("batch",)), P("batch"))
    with JaxLoader(
        source_of(job["source"]),
        batch_size=job["batch"],
        seed=job["seed"],
        sharding=sharding,
        return_index=True,
        features=FEATURES,
    ) as data:
        if state is not None:
            data.load_state_dict(state)
        ids = []
        for batch in data:
            ids.append(_ids(batch))
            if len(ids) == job["steps"]:
                break
        return ids, data.state_dict()


def main(framework: str, jobs_path: str) -> None:
    rank_run = {"torch": _rank_torch, "tf": _rank_tf, "jax": _rank_jax}[framework]
    for job in json.loads(open(jobs_path).read()):
        state = json.loads(open(job["state_in"]).read()) if job.get("state_in") else None
        per_rank, saved = [], None
        for rank in range(job["world"]):
            ids, st = rank_run(job, rank, state)
            per_rank.append(ids)
            saved = saved if saved is not None else st
        if job.get("state_out"):
            with open(job["state_out"], "w") as f:
                json.dump(saved, f)  # JSON: what a checkpoint beside the model holds
        steps = [list(ranks) for ranks in zip(*per_rank)]
        with open(job["out"], "w") as f:
            json.dump({"steps": steps, "state": saved}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
