"""One process of a multi-host JAX run on this machine, for tests/test_jax_multihost.py and
tests/test_checkpoint_frameworks.py: joins ``jax.distributed`` (CPU devices forced by the
caller's XLA_FLAGS), reads a dataset through `JaxLoader` with a batch-sharded `NamedSharding`,
trains a linear regression with ``jax.grad`` and writes what it saw as JSON.

    python tests/jax_worker.py JOB.json PROCESS_ID

JOB: ``{"port", "processes", "runs": [RUN, ...]}``, each RUN ``{"source" (a path, or a list of
Source kwargs), "batch_size" (global), "seed", "steps" (None: whole epochs), "epochs", "state_in"
(a state file to resume, or None), "out"}`` and optionally ``"filter"`` (a "module:function")
and ``"skip_samples"`` (sample ids); OUT gets ``{"ids": [[global ids of each step, in row order]],
"valid" (each step's ``__valid__`` mask, in row order, where the batches carry one), "losses",
"state", "local_rows", "devices"}`` from each process (``OUT.PROCESS_ID``).
"""

from __future__ import annotations

import json
import sys


def main(job_path: str, pid: int) -> None:
    job = json.loads(open(job_path).read())
    import jax

    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{job['port']}",
        num_processes=job["processes"],
        process_id=pid,
        initialization_timeout=60,
    )
    from jax.experimental import multihost_utils

    for run in job["runs"]:
        _run(run, pid)
    multihost_utils.sync_global_devices("done")


def _run(job: dict, pid: int) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import crossfeed
    from crossfeed.adapters.jax import JaxLoader

    source = job["source"]
    if isinstance(source, list):
        source = [crossfeed.Source(**s) for s in source]
    mesh = Mesh(np.array(jax.devices()), ("batch",))
    data_sharding = NamedSharding(mesh, P("batch"))
    replicated = NamedSharding(mesh, P())
    recipe: dict = {}
    if job.get("filter"):
        recipe["filter"] = job["filter"]
    if job.get("skip_samples"):
        recipe["skip"] = crossfeed.Skip(samples=job["skip_samples"])
    data = JaxLoader(
        source,
        batch_size=job["batch_size"],
        seed=job["seed"],
        sharding=data_sharding,
        return_index=True,
        features=["x", "y"],
        **recipe,
    )
    if job.get("state_in"):
        data.load_state_dict(json.loads(open(job["state_in"]).read()))

    @jax.jit
    def step(w, batch):
        def loss(w):
            err = (batch["x"] @ w - batch["y"]) ** 2
            if "__valid__" in batch:  # padded rows weigh 0
                valid = batch["__valid__"]
                return jnp.where(valid, err, 0).sum() / jnp.maximum(valid.sum(), 1)
            return jnp.mean(err)

        value, grad = jax.value_and_grad(loss)(w)
        return w - 0.05 * grad, value

    w = jax.device_put(jnp.zeros((32,), jnp.float32), replicated)
    ids, valid, losses, rows = [], [], [], set()
    for batch in data.epochs(job.get("epochs", 1)):
        assert batch["x"].sharding == data_sharding and batch["x"].shape[0] == job["batch_size"]
        rows.add(sum(s.data.shape[0] for s in batch["x"].addressable_shards))
        w, value = step(w, batch)
        index = batch["__index__"] + (batch["__source__"] * 10**6 if "__source__" in batch else 0)
        ids.append(np.asarray(multihost_utils.process_allgather(index, tiled=True)).tolist())
        if "__valid__" in batch:
            valid.append(np.asarray(multihost_utils.process_allgather(batch["__valid__"], tiled=True)).tolist())
        losses.append(float(value))
        if job.get("steps") is not None and len(ids) == job["steps"]:
            break
    out = {
        "ids": ids,
        "valid": valid,
        "losses": losses,
        "state": data.state_dict(),
        "local_rows": sorted(rows),
        "devices": [jax.local_device_count(), jax.device_count()],
    }
    data.close()
    with open(f"{job['out']}.{pid}", "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
