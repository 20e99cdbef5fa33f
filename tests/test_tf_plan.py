"""The TensorFlow adapter's plan engine (order = the Loader's), resumption, streams and input_fn."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import lazy_import

import crossfeed
from crossfeed import ConfigError
from crossfeed.read.loader import Loader

tf = lazy_import("tensorflow")
cftf = lazy_import("crossfeed.adapters.tf")
pytestmark = pytest.mark.slow  # TensorFlow imported


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """41 samples in 3 uneven shards: x (float32 tensor), label, tokens (variable), name (str)."""
    root = tmp_path_factory.mktemp("plan")
    samples = [
        {"x": np.full((2,), i, np.float32), "label": i, "tokens": list(range(i % 3)), "name": f"n{i}"}
        for i in range(41)
    ]
    crossfeed.write_dataset(root, samples, shard_size=300).close()
    assert len(crossfeed.open_dataset(root)["train"].shards) >= 3
    return root


def _ids(ds) -> list[int]:
    return [int(i) for b in ds for i in b["__index__"].numpy()]


def _loader_ids(root, **kw) -> list[int]:
    with Loader(root, return_index=True, **kw) as ld:
        return [int(i) for b in ld for i in b["__index__"]]


@pytest.mark.parametrize("shuffle", ["global", "block", "none"])
@pytest.mark.parametrize("seed,epoch", [(0, 0), (7, 3)])
def test_plan_order_equals_the_loaders(data, shuffle, seed, epoch):
    kw = dict(batch_size=4, shuffle=shuffle, seed=seed, epoch=epoch, drop_last=True)
    got = _ids(cftf.dataset(data, engine="plan", return_index=True, **kw))
    assert got == _loader_ids(data, rank=0, world_size=1, **kw)
    assert sorted(got) == sorted(set(got)) and len(got) == 40


def test_plan_order_per_rank_and_partial_batches(data):
    for rank in range(3):
        kw = dict(batch_size=5, seed=11, rank=rank, world_size=3, drop_last=False)
        assert _ids(cftf.dataset(data, return_index=True, **kw)) == _loader_ids(data, **kw)  # auto → plan


def test_each_pass_is_the_next_epoch(data):
    ds = cftf.dataset(data, batch_size=8, seed=2, engine="plan", return_index=True)
    first, second = _ids(ds), _ids(ds)
    kw = dict(batch_size=8, seed=2, rank=0, world_size=1)  # both keep the partial batch by default
    assert first == _loader_ids(data, epoch=0, **kw) and second == _loader_ids(data, epoch=1, **kw)


def test_plan_values_and_spec(data):
    ds = cftf.dataset(data, batch_size=4, seed=1, engine="plan", return_index=True)
    assert ds.element_spec == cftf.element_spec(data, batch_size=4, return_index=True)
    sizes = []
    for b in ds:
        idx = b["__index__"].numpy()
        labels = b["label"].numpy()
        np.testing.assert_array_equal(b["x"].numpy()[:, 0], labels)
        assert b["tokens"].to_list() == [list(range(v % 3)) for v in labels]
        assert b["name"].numpy().tolist() == [f"n{v}".encode() for v in labels]
        sizes.append(len(idx))
    assert set(sizes[:-1]) == {4} and 1 <= sizes[-1] <= 4  # the partial last batch is kept, as in the Loader


def test_resume_mid_epoch_from_plan_state(data):
    kw = dict(batch_size=4, seed=5, epoch=1)
    full = _ids(cftf.dataset(data, engine="plan", return_index=True, **kw))
    state = cftf.plan_state(data, steps=3, **kw)
    assert state["position"] == 12 and state["epoch"] == 1
    rest = cftf.dataset(data, state=state, return_index=True, **kw)  # auto → plan
    assert _ids(rest) == full[12:]
    with Loader(data, return_index=True, rank=0, world_size=1, **kw) as ld:
        ld.load_state_dict(state)  # the same state resumes the Loader (and the PyTorch adapter)
        assert [int(i) for b in ld for i in b["__index__"]] == full[12:]


def test_stream_of_batches_infers_its_spec(data):
    with Loader(data, batch_size=6, seed=0, rank=0, world_size=1) as ld:
        batches = list(ld)
    ds = cftf.dataset(batches)
    spec = ds.element_spec
    assert spec["x"] == tf.TensorSpec([None, 2], tf.float32)
    assert spec["name"] == tf.TensorSpec([None], tf.string)
    assert isinstance(spec["tokens"], tf.RaggedTensorSpec)
    got = list(ds)
    assert len(got) == len(batches)
    for g, b in zip(got, batches):
        np.testing.assert_array_equal(g["label"].numpy(), b["label"])
        assert g["tokens"].to_list() == [t.tolist() for t in b["tokens"]]
    explicit = {"label": tf.TensorSpec([None], tf.int64)}
    assert list(cftf.dataset(batches, element_spec=explicit).element_spec) == ["label"]
    with pytest.raises(ConfigError, match="native"):
        cftf.dataset(batches, engine="native")


def test_network_stream_from_connect(data, tmp_path):
    net = pytest.importorskip("crossfeed.net")

    def factory(epoch):
        with Loader(
            data,
            batch_size=8,
            seed=0,
            epoch=epoch,
            rank=0,
            world_size=1,
            drop_last=True,
            features=["x", "label", "name"],
        ) as ld:  # the wire carries no ragged lists
            yield from ld

    opts = net.ServerOptions((f"ipc://{tmp_path}/tf.sock",), epochs=1, heartbeat=net.Heartbeat(0.1, 5.0))
    with net.Server(factory, opts) as server:
        with crossfeed.connect(server.endpoints, heartbeat_interval=0.1, heartbeat_timeout=5.0) as client:
            ds = cftf.dataset(client)
            assert ds.element_spec["x"] == tf.TensorSpec([None, 2], tf.float32)
            assert ds.element_spec["name"] == tf.TensorSpec([None], tf.string)
            labels = sorted(int(v) for b in ds for v in b["label"].numpy())
    assert len(labels) == 40 and len(set(labels)) == 40


@pytest.mark.parametrize("engine", ["native", "plan"])
@pytest.mark.parametrize("pipelines", [1, 2, 5])
def test_input_fn_gives_every_replica_the_same_steps(data, engine, pipelines):
    replicas = 2 * pipelines  # two replicas fed by each input pipeline
    fn = cftf.input_fn(data, global_batch_size=2 * replicas, seed=4, engine=engine)
    per_pipeline = []
    for i in range(pipelines):
        ctx = tf.distribute.InputContext(
            num_input_pipelines=pipelines, input_pipeline_id=i, num_replicas_in_sync=replicas
        )
        labels = [b["label"].numpy().tolist() for b in fn(ctx)]
        assert all(len(x) == 2 for x in labels)  # the per-replica batch
        assert len(labels) % 2 == 0  # whole steps for both local replicas
        per_pipeline.append([v for x in labels for v in x])
    assert len({len(p) for p in per_pipeline}) == 1
    flat = [v for p in per_pipeline for v in p]
    assert len(flat) == len(set(flat))  # disjoint shares
    assert len(flat) == 41 // (2 * replicas) * 2 * replicas or engine == "native"
    assert len(flat) >= 41 - 3 * 2 * replicas


def test_input_fn_checks_the_global_batch(data):
    with pytest.raises(ConfigError, match="global_batch_size"):
        cftf.input_fn(data, global_batch_size=0)
    fn = cftf.input_fn(data, global_batch_size=5)
    with pytest.raises(ConfigError, match="divide"):
        fn(tf.distribute.InputContext(1, 0, 2))
    with pytest.raises(ConfigError, match="too few"):
        cftf.input_fn(data, global_batch_size=64)(tf.distribute.InputContext(1, 0, 1))


def test_loader_options_pass_whole_and_mixtures_read_in_the_loaders_order(tmp_path):
    """`options=` (one LoaderOptions) reaches the plan engine's Loader unchanged, and a mixture
    of sources comes out of TensorFlow in the Loader's order, with __source__/__index__."""
    import crossfeed

    for name, n, off in (("a", 40, 0), ("b", 9, 1000)):
        crossfeed.write_dataset(
            tmp_path / name, [{"id": off + i, "x": np.full(3, i, np.float32)} for i in range(n)], num_shards=2
        ).close()
    opts = crossfeed.LoaderOptions.of(batch_size=6, seed=3, shuffle="block", return_index=True, num_threads=1)
    with Loader(tmp_path / "a", opts) as ld:
        want = [b["__index__"].tolist() for b in ld]
    ds = cftf.dataset(tmp_path / "a", options=opts)
    assert ds.cardinality().numpy() == len(want)
    assert [b["__index__"].tolist() for b in ds.as_numpy_iterator()] == want
    with pytest.raises(crossfeed.ConfigError, match="options= carries"):
        cftf.dataset(tmp_path / "a", options=opts, batch_size=7)
    sources = [crossfeed.Source(tmp_path / "a", weight=3), crossfeed.Source(tmp_path / "b", weight=1)]
    mix = crossfeed.LoaderOptions.of(batch_size=5, seed=1, samples_per_epoch=50, return_index=True)
    with Loader(sources, mix) as ld:
        want = [(b["__source__"].tolist(), b["id"].tolist()) for b in ld]
    got = [(b["__source__"].tolist(), b["id"].tolist()) for b in cftf.dataset(sources, options=mix).as_numpy_iterator()]
    assert got == want and len(got) == 10


def test_stats_sum_every_pass_of_a_plan_engine_dataset(data):
    ds = cftf.dataset(data, batch_size=8, seed=2, engine="plan")
    first = sum(1 for _ in ds)
    after_one = cftf.stats(ds)
    assert after_one.batches == first > 0 and after_one.stages["decode"].count == first
    second = sum(1 for _ in ds.take(2))  # a pass broken off: what it delivered is counted
    total = cftf.stats(ds)
    assert first + second <= total.batches <= first + second + 8  # plus what the pass built ahead
    assert str(total.verdict())
    with pytest.raises(ConfigError, match="plan engine"):
        cftf.stats(ds.map(lambda b: b))
    with pytest.raises(ConfigError, match="plan engine"):
        cftf.stats(cftf.dataset(data, batch_size=8, engine="native"))
