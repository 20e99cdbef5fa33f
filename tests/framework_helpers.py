"""Shared by the JAX multi-host and the cross-framework checkpoint tests: a small regression
dataset, the epoch order a Loader plans for it, the check that a run's batches are the plan's
from a position at some world size, and launchers for the per-framework processes
(`framework_worker`, and `jax_worker` joined by ``jax.distributed``)."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np

import crossfeed
from crossfeed.format.schema import SOURCE_KEY
from crossfeed.read.loader import INDEX_KEY

HERE = pathlib.Path(__file__).resolve().parent
SOURCE_ID = 10**6  # a mixture's sample id: source * SOURCE_ID + index


def write_xy(path, n: int, seed: int = 0) -> str:
    """``n`` samples of ``x`` (32 floats) and ``y = x @ w`` for one fixed ``w``."""
    rng = np.random.default_rng(seed)
    w = np.random.default_rng(1234).normal(size=32).astype(np.float32)
    xs = rng.normal(size=(n, 32)).astype(np.float32)
    crossfeed.write_dataset(path, [{"x": x, "y": np.float32(x @ w)} for x in xs], num_shards=2).close()
    return str(path)


def source_of(spec):
    """A run's source: a path, or a mixture given as a list of `crossfeed.Source` keyword dicts."""
    return [crossfeed.Source(**s) for s in spec] if isinstance(spec, list) else spec


def epoch_order(spec, seed: int, epoch: int = 0) -> list[int]:
    """Every sample id of one epoch in the plan's order (one uninterrupted world-1 run)."""
    with crossfeed.Loader(source_of(spec), batch_size=1, seed=seed, epoch=epoch, return_index=True) as ld:
        ids = [b[INDEX_KEY] + (b[SOURCE_KEY] * SOURCE_ID if SOURCE_KEY in b else 0) for b in ld]
    return np.concatenate(ids).tolist()


def assert_plan(steps, order: list[int], *, position: int, world: int, batch: int) -> None:
    """``steps[j][r]`` — rank ``r``'s ids at step ``j`` — are the plan's: rank ``r`` takes every
    ``world``-th sample after ``position`` (the remainder padding from the epoch's start), and
    there are as many steps as the plan has for that world size (the last partial one dropped)."""
    n = len(order)
    per_rank = -(-(n - position) // world)
    assert len(steps) == per_rank // batch, f"{len(steps)} steps, the plan has {per_rank // batch}"
    for j, ranks in enumerate(steps):
        assert len(ranks) == world
        for r, ids in enumerate(ranks):
            want = [order[(position + j * batch * world + i * world + r) % n] for i in range(batch)]
            assert list(ids) == want, f"step {j} rank {r}: {list(ids)} != {want} (from position {position})"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_frameworks(runs: list[tuple[str, list[dict]]], tmp: pathlib.Path, timeout: float = 240) -> list[list[dict]]:
    """Run each ``(framework, jobs)`` in a fresh process of its own ("torch", "tf", "jax"), the
    processes side by side; the jobs' outputs, per run."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", CUDA_VISIBLE_DEVICES="")
    procs = []
    for framework, jobs in runs:
        path = tmp / f"{framework}-jobs-{free_port()}.json"
        path.write_text(json.dumps(jobs))
        cmd = [sys.executable, str(HERE / "framework_worker.py"), framework, str(path)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env))
    errors = _wait(procs, timeout, [f for f, _ in runs])
    assert not errors, "\n".join(errors)
    return [[json.loads(pathlib.Path(j["out"]).read_text()) for j in jobs] for _, jobs in runs]


def _wait(procs: list[subprocess.Popen], timeout: float, names: list[str]) -> list[str]:
    """Wait for every process (``timeout`` each); the failures, each with its stderr's tail."""
    errors = []
    try:
        for name, p in zip(names, procs):
            _, err = p.communicate(timeout=timeout)
            if p.returncode != 0:
                errors.append(f"{name} exited {p.returncode}:\n{err[-3000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    return errors


def run_jax_hosts(runs: list[dict], tmp: pathlib.Path, *, processes: int = 2, devices: int = 2, timeout: float = 240):
    """``runs`` in ``processes`` JAX processes joined by ``jax.distributed`` on localhost, each
    with ``devices`` CPU devices; each run's outputs, one per process."""
    job = tmp / f"jax-hosts-{free_port()}.json"
    job.write_text(json.dumps({"port": free_port(), "processes": processes, "runs": runs}))
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "jax_worker.py"), str(job), str(i)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(processes)
    ]
    errors = _wait(procs, timeout, [f"JAX process {i}" for i in range(processes)])
    assert not errors, "\n".join(errors)
    return [[json.loads(pathlib.Path(f"{r['out']}.{i}").read_text()) for i in range(processes)] for r in runs]
