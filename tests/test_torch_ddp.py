"""Real DDP training (gloo on CPU, 2 processes, optional DataLoader workers) over a TorchDataset.

Each rank is this file run as a script (``python test_torch_ddp.py CONFIG_JSON``): it trains a
small linear classifier with DistributedDataParallel through `StatefulLoader` and writes what it
saw (sample ids per step, losses, the loader's state) to a JSON file the test then checks.
A rank that takes a different number of steps would hang its peer in all-reduce: the subprocess
timeout turns that into a failure.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

NUM_FEATURES, NUM_CLASSES = 8, 3
RUN_TIMEOUT = 120


def make_dataset(root: Path, n: int, num_shards: int) -> Path:
    """``n`` samples: ``id``, 8 float32 features, a label that a linear model can learn."""
    import crossfeed

    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, NUM_FEATURES)).astype(np.float32)
    w = rng.normal(size=(NUM_FEATURES, NUM_CLASSES)).astype(np.float32)
    labels = (x @ w).argmax(axis=1)
    samples = [{"id": i, "x": x[i], "label": int(labels[i])} for i in range(n)]
    crossfeed.write_dataset(root, samples, num_shards=num_shards).close()
    return root


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ddp(tmp_path: Path, name: str, world_size: int = 2, **config) -> list[dict]:
    """Run one DDP job of ``world_size`` ranks; returns each rank's report."""
    port = _free_port()
    procs, outs = [], []
    for rank in range(world_size):
        out = tmp_path / f"{name}-rank{rank}.json"
        cfg = dict(config, out=str(out))
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            GLOO_SOCKET_IFNAME="lo",
            OMP_NUM_THREADS="1",
        )
        log = open(tmp_path / f"{name}-rank{rank}.log", "wb")
        procs.append(
            subprocess.Popen([sys.executable, __file__, json.dumps(cfg)], env=env, stdout=log, stderr=subprocess.STDOUT)
        )
        log.close()
        outs.append(out)
    try:
        for p in procs:
            p.wait(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise AssertionError(
            f"DDP job {name} did not finish in {RUN_TIMEOUT}s (a hang?):\n" + _logs(tmp_path, name)
        ) from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        raise AssertionError(f"DDP job {name} failed:\n" + _logs(tmp_path, name))
    return [json.loads(o.read_text()) for o in outs]


def _logs(tmp_path: Path, name: str) -> str:
    return "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(tmp_path.glob(f"{name}-rank*.log")))


def _rank_main(cfg: dict) -> None:
    """One DDP rank: train through the epoch (or ``stop_after`` steps) and report."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from crossfeed.adapters.torch import StatefulLoader, TorchDataset

    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ds = TorchDataset(cfg["data"], batch_size=cfg["batch_size"], seed=cfg.get("seed", 7), features=["id", "x", "label"])
    assert (ds.rank, ds.world_size) == (dist.get_rank(), dist.get_world_size())
    workers = cfg["num_workers"]
    loader = StatefulLoader(ds, num_workers=workers, pin_memory=True, persistent_workers=workers > 0)
    if cfg.get("resume"):
        loader.load_state_dict(json.loads(Path(cfg["resume"]).read_text()))
    model = DistributedDataParallel(torch.nn.Linear(NUM_FEATURES, NUM_CLASSES))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    report = {"rank": dist.get_rank(), "len": len(loader), "ids": [], "losses": [], "state": None}
    for batch in loader:
        loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["label"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        report["ids"].append(batch["id"].tolist())
        report["losses"].append(loss.item())
        if len(report["ids"]) == cfg.get("stop_after"):
            break
    report["state"] = loader.state_dict()
    steps = torch.tensor([len(report["ids"])])
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)  # a rank with fewer steps would hang in training already
    report["max_steps"] = int(steps)
    loader.close()
    dist.barrier()  # both ranks leave gloo together: a rank tearing down mid-exchange aborts the other
    dist.destroy_process_group()
    Path(cfg["out"]).write_text(json.dumps(report))
    # The report is written; skip interpreter teardown, where torch's C++ threads can abort a
    # process on a loaded machine ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# -- tests ------------------------------------------------------------------------------------------
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # slow: 2-process DDP training


def _all_ids(reports) -> list[int]:
    return [i for r in reports for step in r["ids"] for i in step]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_ddp_epoch_sees_every_sample_once_with_equal_steps(tmp_path, num_workers):
    data = make_dataset(tmp_path / "data", n=640, num_shards=4)
    reports = run_ddp(tmp_path, f"epoch{num_workers}", data=str(data), batch_size=16, num_workers=num_workers)
    steps = [len(r["ids"]) for r in reports]
    assert steps == [20, 20] and [r["len"] for r in reports] == steps
    ids = _all_ids(reports)
    assert sorted(ids) == list(range(640))  # every id exactly once across ranks and workers
    for r in reports:
        first, last = np.mean(r["losses"][:4]), np.mean(r["losses"][-4:])
        assert last < 0.7 * first, (first, last)
        assert r["state"]["epoch"] == 1 and r["state"]["position"] == 0  # the epoch ended: next one


def test_ddp_resume_mid_epoch_in_a_fresh_process_group(tmp_path):
    data = make_dataset(tmp_path / "data", n=480, num_shards=3)
    full = run_ddp(tmp_path, "full", data=str(data), batch_size=12, num_workers=0)
    k = 7  # stopped while 2 workers had prefetched batches beyond step k
    part = run_ddp(tmp_path, "part", data=str(data), batch_size=12, num_workers=2, stop_after=k)
    assert part[0]["state"] == part[1]["state"]
    assert part[0]["state"]["position"] == k * 12 * 2
    state = tmp_path / "state.json"
    state.write_text(json.dumps(part[0]["state"]))
    # resumed with yet another worker count: the plan does not depend on it
    rest = run_ddp(tmp_path, "rest", data=str(data), batch_size=12, num_workers=1, resume=str(state))
    for f, p, r in zip(full, part, rest):
        assert p["ids"] == f["ids"][:k]
        assert r["ids"] == f["ids"][k:]  # per rank, the same batches in the same order
        assert r["len"] == len(f["ids"]) - k
    assert sorted(_all_ids(part) + _all_ids(rest)) == list(range(480))


def test_ddp_uneven_count_more_workers_than_shards(tmp_path):
    data = make_dataset(tmp_path / "data", n=1001, num_shards=2)
    reports = run_ddp(tmp_path, "uneven", data=str(data), batch_size=16, num_workers=3)
    steps = [len(r["ids"]) for r in reports]
    assert steps[0] == steps[1] == reports[0]["max_steps"] == 32  # ceil(ceil(1001 / 2) / 16)
    ids = _all_ids(reports)
    assert len(ids) == 1002 and set(ids) == set(range(1001))  # one sample repeated to even the ranks
    for r in reports:
        assert sum(len(s) for s in r["ids"]) == 501


if __name__ == "__main__":
    _rank_main(json.loads(sys.argv[1]))
