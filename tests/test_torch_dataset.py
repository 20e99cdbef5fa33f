"""TorchDataset and StatefulLoader in one process (plus real DataLoader worker processes)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import lazy_import, run_python

import crossfeed
from crossfeed.errors import ConfigError
from crossfeed.read.loader import Loader
from crossfeed.read.options import PlanOptions

torch = lazy_import("torch")
torch_data = lazy_import("torch.utils.data")
cftorch = lazy_import("crossfeed.adapters.torch")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(120),
]  # slow: torch imported, worker processes (spawn), fresh interpreters


@pytest.fixture
def ids_dataset(tmp_path):
    """103 samples (an odd count) in 3 shards: ``id`` and a 3-vector equal to the id."""
    root = tmp_path / "ids"
    crossfeed.write_dataset(root, [{"id": i, "x": np.full(3, i, np.float32)} for i in range(103)], num_shards=3).close()
    return root


def _ids(batches) -> list[list[int]]:
    return [b["id"].tolist() for b in batches]


def _flat(batches) -> list[int]:
    return [i for b in batches for i in b]


def test_batches_are_tensors_sharing_the_loaders_arrays(mixed_dataset):
    path, samples = mixed_dataset
    seen = []

    def keep(batch):  # the Loader's numpy batch, before conversion (runs in the Loader's threads)
        seen.append(batch)
        return batch

    ds = cftorch.TorchDataset(path, batch_size=7, shuffle="none", batch_transform=keep, rank=0, world_size=1)
    batches = list(ds)
    assert len(batches) == len(ds) == 5
    b = batches[0]
    raw = next(r for r in seen if r["label"].tolist() == b["label"].tolist())  # built in parallel threads
    assert b["image"].dtype == torch.uint8 and b["image"].shape == (7, 4, 5, 3)
    assert b["label"].dtype == torch.int64 and b["score"].dtype == torch.float32
    for key in ("image", "label", "score"):
        assert np.shares_memory(b[key].numpy(), raw[key])  # torch.from_numpy: no copy
    assert isinstance(b["name"], list) and all(isinstance(s, str) for s in b["name"])
    assert isinstance(b["tokens"], list) and all(isinstance(t, torch.Tensor) for t in b["tokens"])  # ragged
    for bt in batches:
        for i, label in enumerate(bt["label"].tolist()):
            s = samples[label]
            assert bt["name"][i] == s["name"] and bt["tokens"][i].tolist() == s["tokens"]
            assert torch.equal(bt["image"][i], torch.from_numpy(s["image"]))
    ds.close()


def test_to_torch_handles_read_only_and_negative_strides():
    ro = np.arange(6, dtype=np.float32)
    ro.flags.writeable = False
    flipped = np.arange(4)[::-1]
    out = cftorch.to_torch({"ro": ro, "flip": flipped, "s": np.array(["a", "b"]), "l": [b"x", b"y"], "n": np.int64(3)})
    assert np.shares_memory(out["ro"].numpy(), ro)
    assert out["flip"].tolist() == [3, 2, 1, 0]
    assert out["s"] == ["a", "b"] and out["l"] == [b"x", b"y"] and out["n"].item() == 3
    with pytest.raises(ConfigError, match="'t'"):
        cftorch.to_torch({"t": np.array(["2020-01-01"], dtype="datetime64[D]")})


@pytest.mark.parametrize("keep", [False, True])
def test_to_torch_shared_lays_a_batch_in_one_shared_storage(keep):
    ro = np.arange(5, dtype=np.uint32)
    ro.flags.writeable = False
    batch = {
        "tokens": ro,
        "seg": np.arange(6, dtype=np.int32).reshape(2, 3)[:, ::-1],  # not contiguous
        "mask": np.array([True, False, True]),
        "x": np.float16(1.5),
        "empty": np.zeros((0, 4), dtype=np.float64),
        "name": np.array(["a", "b"]),
        "big": np.array([2**64 - 1], dtype=np.uint64),
    }
    plain = cftorch.to_torch(batch, keep_dtypes=keep)
    shared = cftorch.to_torch(batch, keep_dtypes=keep, shared=True)
    assert shared.keys() == plain.keys() and shared["name"] == ["a", "b"]
    numeric = [k for k in batch if k != "name"]
    for k in numeric:
        assert shared[k].dtype == plain[k].dtype and shared[k].shape == plain[k].shape, k
        assert torch.equal(shared[k], plain[k]), k
    assert len({shared[k].untyped_storage().data_ptr() for k in numeric}) == 1
    assert shared["tokens"].is_shared() and not np.shares_memory(shared["tokens"].numpy(), ro)
    assert shared["tokens"].dtype == (torch.uint32 if keep else torch.int64)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_workers_yield_exactly_the_ranks_batches_in_order(ids_dataset, world_size):
    """DataLoader's round-robin over 2 worker processes gives each rank's Loader sequence."""
    per_rank = []
    for rank in range(world_size):
        ds = cftorch.TorchDataset(ids_dataset, batch_size=5, seed=11, rank=rank, world_size=world_size)
        expected = _ids(Loader(ids_dataset, batch_size=5, seed=11, rank=rank, world_size=world_size))
        assert _ids(torch_data.DataLoader(ds, batch_size=None, num_workers=0)) == expected
        assert _ids(torch_data.DataLoader(ds, batch_size=None, num_workers=2)) == expected
        assert len(ds) == len(expected) == len(torch_data.DataLoader(ds, batch_size=None, num_workers=2))
        per_rank.append(expected)
        ds.close()
    assert len({len(b) for b in per_rank}) == 1  # every rank the same number of batches
    ids = [i for r in per_rank for i in _flat(r)]
    pad = -103 % world_size
    assert sorted(set(ids)) == list(range(103)) and len(ids) == 103 + pad


@pytest.mark.parametrize("context", [None, "spawn"])
def test_set_epoch_reaches_persistent_workers(ids_dataset, context):
    ds = cftorch.TorchDataset(ids_dataset, batch_size=8, seed=5, rank=0, world_size=1)
    loader = torch_data.DataLoader(
        ds, batch_size=None, num_workers=2, persistent_workers=True, multiprocessing_context=context
    )
    orders = []
    for epoch in (0, 1, 2, 0):
        ds.set_epoch(epoch)
        orders.append(_flat(_ids(loader)))
    for order in orders:
        assert sorted(order) == list(range(103))
    assert orders[0] != orders[1] != orders[2] and orders[3] == orders[0]
    ds.set_epoch(1)
    assert _flat(_ids(ds)) == orders[1]  # the main process agrees with the workers
    ds.close()


def _run(loader, stop=None):
    out = []
    for b in loader:
        out.append(b["id"].tolist())
        if len(out) == stop:
            break
    return out


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_loader_resumes_exactly_from_every_checkpoint(ids_dataset, num_workers):
    def make(workers):
        return cftorch.StatefulLoader(
            cftorch.TorchDataset(ids_dataset, batch_size=6, seed=3, rank=0, world_size=1),
            num_workers=workers,
            persistent_workers=workers > 0,
        )

    with make(0) as ref:
        full = _run(ref)
        assert ref.state_dict()["epoch"] == 1 and ref.state_dict()["position"] == 0
        next_epoch = _run(ref)
    assert sorted(_flat(full)) == list(range(103)) and sorted(_flat(next_epoch)) == list(range(103))
    stops = range(1, len(full)) if num_workers == 0 else (1, 5, len(full) - 1)
    for k in stops:
        with make(num_workers) as first:
            assert _run(first, stop=k) == full[:k]
            state = first.state_dict()
        assert state["epoch"] == 0 and state["position"] == k * 6
        with make(2 - num_workers) as second:  # the other worker count: the plan does not care
            second.load_state_dict(state)
            assert len(second) == len(full) - k
            assert _run(second) == full[k:]
            assert _run(second) == next_epoch  # then on to the next epoch as usual


def test_state_resumes_at_another_world_size(ids_dataset):
    """Saved by 2 ranks after 4 steps, resumed by 3: together they finish the same epoch."""
    cfg = dict(batch_size=5, seed=9)
    loaders = [cftorch.StatefulLoader(cftorch.TorchDataset(ids_dataset, rank=r, world_size=2, **cfg)) for r in range(2)]
    before = [_run(ld, stop=4) for ld in loaders]
    states = [ld.state_dict() for ld in loaders]
    assert states[0] == states[1] and states[0]["position"] == 4 * 5 * 2
    after = []
    for r in range(3):
        ld = cftorch.StatefulLoader(cftorch.TorchDataset(ids_dataset, rank=r, world_size=3, **cfg))
        ld.load_state_dict(states[0])
        after.append(_run(ld))
    assert len({len(a) for a in after}) == 1
    ids = _flat(sum(before, [])) + _flat(sum(after, []))
    assert set(ids) == set(range(103)) and len(ids) == 103 + (-(103 - 40) % 3)


def test_options_are_validated(ids_dataset, monkeypatch):
    with pytest.raises(ConfigError, match="batch_size"):
        cftorch.TorchDataset(ids_dataset)
    with pytest.raises(ConfigError, match="shuffle"):
        cftorch.TorchDataset(ids_dataset, batch_size=4, shuffle="sometimes")
    with pytest.raises(ConfigError, match="rank"):
        cftorch.TorchDataset(ids_dataset, batch_size=4, rank=2, world_size=2)
    ds = cftorch.TorchDataset(ids_dataset, batch_size=4, seed=1, rank=0, world_size=1)
    with pytest.raises(ConfigError, match="batch_size"):
        cftorch.StatefulLoader(ds, batch_size=4)
    with pytest.raises(ConfigError, match="shuffle"):
        cftorch.StatefulLoader(ds, shuffle=True)
    with pytest.raises(ConfigError, match="epoch"):
        ds.set_epoch(-1)
    other = cftorch.TorchDataset(ids_dataset, batch_size=4, seed=2, rank=0, world_size=1)
    with pytest.raises(ConfigError, match="seed"):
        ds.load_state_dict(other.state_dict())
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    env = cftorch.TorchDataset(ids_dataset, batch_size=4)
    assert (env.rank, env.world_size) == (1, 2)
    assert len(env) == 13  # ceil(ceil(103 / 2) / 4)


def _stream(n=20, batch=6):
    for start in range(0, n, batch):
        ids = np.arange(start, min(n, start + batch))
        x = ids.astype(np.float32)
        x.flags.writeable = False  # like arrays received from the network
        yield {"id": ids, "x": x, "name": [f"s{i}" for i in ids]}


def test_a_stream_source_is_converted_without_splitting():
    ds = cftorch.TorchDataset(_stream())
    got = list(torch_data.DataLoader(ds, batch_size=None))
    assert _flat(_ids(got)) == list(range(20))
    assert got[0]["x"].dtype == torch.float32 and got[0]["name"] == [f"s{i}" for i in range(6)]
    with pytest.raises(TypeError):
        len(ds)
    with pytest.raises(ConfigError, match="num_workers=0"):
        list(torch_data.DataLoader(cftorch.TorchDataset(_stream()), batch_size=None, num_workers=1))


def test_a_stream_source_goes_through_stateful_loader():
    # the README says streams are sources: StatefulLoader(TorchDataset(stream), num_workers=0) reads it
    with cftorch.StatefulLoader(cftorch.TorchDataset(_stream()), num_workers=0) as loader:
        got = list(loader)
        assert _flat(_ids(got)) == list(range(20))
        with pytest.raises(ConfigError, match="stream"):
            loader.state_dict()  # a stream has no position to save


def test_a_crossfeed_connect_stream_is_a_source():
    from net_helpers import FAST_HB, Synthetic

    from crossfeed.net import Heartbeat, Server, ServerOptions, connect

    # generous heartbeats: on a busy 2-core machine a 2 s silence is not a dead server
    slow = dict(FAST_HB, heartbeat_interval=0.5, heartbeat_timeout=60.0, connect_timeout=60.0)
    hb = Heartbeat(slow["heartbeat_interval"], slow["heartbeat_timeout"])
    opts = ServerOptions(("tcp://127.0.0.1:0",), epochs=1, heartbeat=hb)
    with Server(Synthetic(num_samples=40, batch_size=8), opts) as server:
        with connect(server.endpoints, with_meta=True, **slow) as client:
            got = list(torch_data.DataLoader(cftorch.TorchDataset(client), batch_size=None))
        assert server.wait(60)
    ids = []
    for meta, batch in got:  # with_meta streams keep their (meta, batch) pairs
        assert isinstance(batch["x"], torch.Tensor) and batch["x"].shape[1:] == (4,)
        assert batch["x"][:, 0].tolist() == meta.sample_ids.astype(np.float32).tolist()
        assert batch["name"] == [f"s{i}" for i in meta.sample_ids]
        ids += meta.sample_ids.tolist()
    assert sorted(ids) == list(range(40))


def test_the_adapter_never_imports_tensorflow(ids_dataset):
    proc = run_python(
        """
        import sys
        from crossfeed.adapters.torch import StatefulLoader, TorchDataset
        import crossfeed.adapters.torch_demo
        with StatefulLoader(TorchDataset(sys.argv[1], batch_size=8, rank=0, world_size=1), num_workers=1) as loader:
            n = sum(len(b["id"]) for b in loader)
            loader.state_dict()
        assert n == 103, n
        bad = sorted(m for m in sys.modules if m.split(".")[0] in ("tensorflow", "keras", "tf_keras"))
        print("TF:", bad)
        """,
        str(ids_dataset),
    )
    assert "TF: []" in proc.stdout


def test_position_after_matches_what_the_plan_consumed(ids_dataset):
    """The StatefulLoader's position formula is the core's: after k rank batches (of the two
    ranks in lockstep) the plan's remaining samples are exactly the unseen ones."""
    cfg = PlanOptions(batch_size=5, seed=4)
    ds = cftorch.TorchDataset(ids_dataset, batch_size=5, seed=4, rank=0, world_size=2)
    assert ds.loader.options.plan == cfg
    with cftorch.StatefulLoader(ds, num_workers=2) as loader:
        _run(loader, stop=3)
        assert loader.state_dict()["position"] == ds.loader.position_after(0, 3) == 30


def _double_x(sample: dict) -> dict:
    return dict(sample, x=sample["x"] * 2)


def test_a_per_sample_transform_keeps_scalars_as_tensors(ids_dataset):
    """The Loader's per-sample transform sees numpy scalars; they must batch as numbers again."""
    ds = cftorch.TorchDataset(ids_dataset, batch_size=10, shuffle="none", transform=_double_x, rank=0, world_size=1)
    for b in torch_data.DataLoader(ds, batch_size=None, num_workers=1):
        assert b["id"].dtype == torch.int64 and b["x"].shape == (len(b["id"]), 3)
        assert torch.equal(b["x"][:, 0], 2 * b["id"].float())


def test_a_mixture_through_dataloader_workers_is_the_loaders_sequence(ids_dataset, tmp_path):
    crossfeed.write_dataset(
        tmp_path / "few", [{"id": 1000 + i, "x": np.full(3, i, np.float32)} for i in range(9)], num_shards=2
    ).close()
    sources = [crossfeed.Source(ids_dataset, weight=2), crossfeed.Source(tmp_path / "few", weight=1)]
    kw = dict(batch_size=6, seed=4, samples_per_epoch=90, rank=0, world_size=1, return_index=True)
    with Loader(sources, **kw) as loader:
        want = [(b["__source__"].tolist(), b["__index__"].tolist(), b["id"].tolist()) for b in loader]
    ds = cftorch.TorchDataset(sources, **kw)
    with cftorch.StatefulLoader(ds, num_workers=2) as dl:
        got = [(b["__source__"].tolist(), b["__index__"].tolist(), b["id"].tolist()) for b in dl]
    assert got == want and len(got) == 15
    assert sum(s.count(1) for s, _, _ in got) == 30  # a third of the samples from the small source
