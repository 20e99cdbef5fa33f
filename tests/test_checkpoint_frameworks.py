"""One checkpoint, three frameworks: the state a PyTorch, TensorFlow or JAX adapter saves after
k steps — one JSON dict, the Loader's — resumes in either other adapter at exactly the next
sample, for one dataset and a mixture, at the same or another world size (JAX at two as two
processes joined by ``jax.distributed``). Each framework runs in a process of its own; every
run's sample ids are checked against the plan of one uninterrupted world-1 epoch."""

from __future__ import annotations

import importlib.util
import json

import pytest
from framework_helpers import assert_plan, epoch_order, run_frameworks, run_jax_hosts, write_xy

# each framework is imported in its own process only (never torch and tensorflow together)
pytestmark = [
    pytest.mark.slow,  # a fresh interpreter per framework
    pytest.mark.skipif(
        any(importlib.util.find_spec(m) is None for m in ("torch", "tensorflow", "jax")),
        reason="needs torch, tensorflow and jax installed",
    ),
]

SEED = 7


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("frameworks")
    single = write_xy(tmp / "single", 40)
    mixture = [{"path": write_xy(tmp / "a", 24, seed=1), "weight": 2}, {"path": write_xy(tmp / "b", 16, seed=2)}]
    return tmp, {"single": single, "mixture": mixture}


def _job(tmp, case, source, framework, **kw):
    name = f"{framework}-{case}-{kw.get('tag', 'save')}"
    job = dict(source=source, seed=SEED, state_in=None, state_out=None, out=str(tmp / f"{name}.out"))
    job.update({k: v for k, v in kw.items() if k != "tag"})
    return job


def test_a_state_saved_by_any_adapter_resumes_in_the_others(cases):
    tmp, sources = cases
    orders = {case: epoch_order(src, SEED) for case, src in sources.items()}
    # saved: torch at world 1 after 3 steps of 4, JAX at world 1 after 2 of 4, TF at world 2 after 4 of 2 each
    saves = {
        "torch": dict(batch=4, world=1, steps=3),
        "jax": dict(batch=4, world=1, steps=2),
        "tf": dict(batch=2, world=2, steps=4),
    }
    # resumed: each framework from the others' states, at another world size where it can
    resumes = {
        "tf": [("torch", 2, 2), ("jax", 1, 4)],
        "torch": [("jax", 2, 2), ("tf", 1, 4)],
        "jax": [("torch", 1, 4), ("tf", 1, 4)],
    }
    states = {(f, case): str(tmp / f"{f}-{case}.state") for f in saves for case in sources}
    # processes side by side in each group; each state is saved a group before another framework resumes it
    schedule = [
        [("jax", True, False), ("torch", True, False)],
        [("tf", True, True)],
        [("torch", False, True), ("jax", False, True)],
    ]
    for group in schedule:
        runs, checks = [], []
        for framework, save, resume in group:
            jobs, mine = [], []
            for case, src in sources.items():
                if save:
                    how = saves[framework]
                    jobs.append(_job(tmp, case, src, framework, state_out=states[framework, case], **how))
                    mine.append((case, None, how["world"], how["batch"]))
                for saver, world, batch in resumes[framework] if resume else ():
                    jobs.append(
                        _job(
                            tmp,
                            case,
                            src,
                            framework,
                            tag=f"from-{saver}",
                            batch=batch,
                            world=world,
                            steps=None,
                            state_in=states[saver, case],
                        )
                    )
                    mine.append((case, saver, world, batch))
            runs.append((framework, jobs))
            checks.append(mine)
        for outs, mine in zip(run_frameworks(runs, tmp), checks):
            for out, (case, saver, world, batch) in zip(outs, mine):
                if saver is None:
                    assert_plan_prefix(out["steps"], orders[case], world=world, batch=batch)
                    assert out["state"]["position"] == len(out["steps"]) * world * batch
                    continue
                position = saves[saver]["steps"] * saves[saver]["batch"] * saves[saver]["world"]
                assert json.loads(open(states[saver, case]).read())["position"] == position
                assert_plan(out["steps"], orders[case], position=position, world=world, batch=batch)
    # JAX on two hosts (2 devices each, global batch 8) resumes what torch saved at world 1
    runs = [
        dict(
            source=src,
            batch_size=8,
            seed=SEED,
            steps=None,
            epochs=1,
            state_in=states["torch", case],
            out=str(tmp / f"jax-hosts-{case}"),
        )
        for case, src in sources.items()
    ]
    for (case, _), per_process in zip(sources.items(), run_jax_hosts(runs, tmp)):
        ids = per_process[0]["ids"]
        assert all(p["ids"] == ids for p in per_process)  # every host sees the same global batches
        steps = [[row[:4], row[4:]] for row in ids]  # rows 0-3: process 0's share, 4-7: process 1's
        assert_plan(steps, orders[case], position=12, world=2, batch=4)


def assert_plan_prefix(steps, order, *, world, batch):
    """The first steps of a run from the epoch's start are the plan's."""
    for j, ranks in enumerate(steps):
        for r, ids in enumerate(ranks):
            assert list(ids) == [order[j * batch * world + i * world + r] for i in range(batch)]


def test_jax_torch_tf_round_trips_with_each_adapters_defaults_give_one_stream(tmp_path):
    """JAX always drops an epoch's last partial batch; its state says so, and PyTorch and TF left
    at their defaults follow it: JAX → torch (world 2) → JAX, and JAX → TF, are the one stream of
    the plan, with the tail cut the same way (42 samples: a partial batch at every batch size here)."""
    src = write_xy(tmp_path / "odd", 42)
    order = epoch_order(src, SEED)
    jax_state, torch_state = str(tmp_path / "jax.state"), str(tmp_path / "torch.state")

    def job(framework, tag, **kw):
        return _job(tmp_path, "odd", src, framework, tag=tag, defaults=True, **kw)

    (saved,) = run_frameworks([("jax", [job("jax", "save", batch=4, world=1, steps=2, state_out=jax_state)])], tmp_path)
    assert saved[0]["state"]["identity"]["settings"]["drop last"] is True
    torch_run, tf_run = run_frameworks(
        [
            ("torch", [job("torch", "from-jax", batch=2, world=2, steps=3, state_in=jax_state, state_out=torch_state)]),
            ("tf", [job("tf", "from-jax", batch=4, world=1, steps=None, state_in=jax_state)]),
        ],
        tmp_path,
    )
    assert_plan(tf_run[0]["steps"], order, position=8, world=1, batch=4)
    assert_plan_prefix_from(torch_run[0]["steps"], order, position=8, world=2, batch=2)
    assert torch_run[0]["state"]["position"] == 20
    ((back,),) = run_frameworks(
        [("jax", [job("jax", "from-torch", batch=4, world=1, steps=None, state_in=torch_state)])], tmp_path
    )
    assert_plan(back["steps"], order, position=20, world=1, batch=4)


def assert_plan_prefix_from(steps, order, *, position, world, batch):
    for j, ranks in enumerate(steps):
        for r, ids in enumerate(ranks):
            assert list(ids) == [order[position + j * batch * world + i * world + r] for i in range(batch)]
