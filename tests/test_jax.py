"""The JAX adapter in one process: batches equal the Loader's sample for sample, laid out by the
sharding; the state is the consumer's (not the prefetcher's) and resumes exactly; errors of the
prefetch thread reach the consumer; dense-only rules (strings, ragged, pad_to) and the
batch-size checks; streams. Several CPU devices are forced when this module imports jax first."""

from __future__ import annotations

import dataclasses
import os
import threading
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import numpy as np
import pytest
from conftest import lazy_import
from loader_helpers import ids_of

import crossfeed
from crossfeed.errors import ConfigError, SchemaError

jax = lazy_import("jax")
jax_sharding = lazy_import("jax.sharding")
cfjax = lazy_import("crossfeed.adapters.jax")
pytestmark = pytest.mark.slow  # JAX imported

DENSE = ["image", "label", "score"]


def _mesh_sharding(n: int | None = None) -> jax_sharding.NamedSharding:
    devices = jax.devices()[: n or jax.device_count()]
    return jax_sharding.NamedSharding(
        jax_sharding.Mesh(np.array(devices), ("batch",)), jax_sharding.PartitionSpec("batch")
    )


def _loader_batches(path, **kw):
    with crossfeed.Loader(path, drop_last=True, **kw) as loader:
        return list(loader)


def test_batches_equal_the_loaders_sample_for_sample(mixed_dataset):
    path, samples = mixed_dataset
    n = min(4, jax.device_count())
    sharding = _mesh_sharding(n)
    kw = dict(batch_size=4 * n if n > 1 else 4, seed=5, features=DENSE, return_index=True)
    with cfjax.JaxLoader(path, sharding=sharding, **kw) as data:
        got = list(data)
    want = _loader_batches(path, **kw)
    assert len(got) == len(want) == 30 // kw["batch_size"]
    for g, w in zip(got, want):
        assert set(g) == set(w)
        for k in w:
            assert isinstance(g[k], jax.Array) and g[k].sharding == sharding
            np.testing.assert_array_equal(np.asarray(g[k]), w[k])
        shards = g["image"].addressable_shards
        assert len(shards) == n and all(s.data.shape[0] == kw["batch_size"] // n for s in shards)
        images = [samples[i]["image"] for i in np.asarray(g["label"]).tolist()]  # label i: the i-th sample
        np.testing.assert_array_equal(np.asarray(g["image"]), np.stack(images))


def test_a_mixture_equals_the_loaders(tmp_path):
    a = crossfeed.write_dataset(tmp_path / "a", [{"v": np.float32(i)} for i in range(20)], num_shards=2)
    b = crossfeed.write_dataset(tmp_path / "b", [{"v": np.float32(100 + i)} for i in range(12)], num_shards=1)
    a.close(), b.close()
    sources = [crossfeed.Source(tmp_path / "a", weight=2), crossfeed.Source(tmp_path / "b")]
    kw = dict(batch_size=4, seed=2, return_index=True)
    with cfjax.JaxLoader(sources, sharding=_mesh_sharding(1), **kw) as data:
        got = list(data)
    want = _loader_batches(sources, **kw)
    assert len(got) == len(want) == 8
    for g, w in zip(ids_of([{k: np.asarray(v) for k, v in b.items()} for b in got]), ids_of(want)):
        np.testing.assert_array_equal(g, w)


def test_state_is_the_consumers_not_the_prefetchers_and_resumes_exactly(mixed_dataset):
    path, _ = mixed_dataset
    built = []

    def count(batch):
        built.append(len(batch["label"]))
        return batch

    kw = dict(batch_size=2, seed=9, features=DENSE, return_index=True, shuffle="global")
    full = ids_of(_loader_batches(path, **kw))
    data = cfjax.JaxLoader(path, sharding=_mesh_sharding(1), device_prefetch=3, batch_transform=count, **kw)
    it = iter(data)
    taken = [np.asarray(next(it)["__index__"]) for _ in range(4)]
    deadline = time.monotonic() + 30
    while len(built) < 4 + 3 and time.monotonic() < deadline:  # the prefetcher fills its queue
        time.sleep(0.01)
    assert len(built) >= 4 + 3, "the prefetch thread did not run ahead"
    state = data.state_dict()
    assert state["position"] == 4 * 2 and state["epoch"] == 0
    assert data.loader.state_dict()["position"] > state["position"]  # the Loader itself is further on
    it.close()
    # the same object continues where the consumer stopped, not where the prefetcher did
    rest_here = [np.asarray(b["__index__"]) for b in data]
    data.close()
    with cfjax.JaxLoader(path, sharding=_mesh_sharding(1), **kw) as again:
        again.load_state_dict(state)
        assert len(again) == len(full) - 4
        rest_there = [np.asarray(b["__index__"]) for b in again]
    for rest in (rest_here, rest_there):
        assert len(rest) == len(full) - 4
        for a, b in zip(taken + rest, full):
            np.testing.assert_array_equal(a, b)


def test_epochs_run_on_across_the_boundary(mixed_dataset):
    path, _ = mixed_dataset
    with cfjax.JaxLoader(
        path, batch_size=5, seed=1, features=["label"], return_index=True, sharding=_mesh_sharding(1)
    ) as data:
        batches = [np.asarray(b["__index__"]) for b in data.epochs(2)]
        assert data.state_dict()["epoch"] == 2 and data.state_dict()["position"] == 0
    assert len(batches) == 12
    first, second = np.concatenate(batches[:6]), np.concatenate(batches[6:])
    assert sorted(first) == sorted(second) == list(range(30))  # every sample once per epoch
    assert not np.array_equal(first, second)  # each epoch its own order
    with crossfeed.Loader(path, batch_size=5, seed=1, epoch=1, return_index=True, features=["label"]) as ld:
        np.testing.assert_array_equal(second, np.concatenate(ids_of(ld)))


def test_an_error_in_the_prefetch_thread_reaches_the_consumer(mixed_dataset):
    path, _ = mixed_dataset
    seen = []

    def boom(batch):
        seen.append(1)
        if len(seen) == 3:
            raise RuntimeError("transform failed on batch 3")
        return batch

    data = cfjax.JaxLoader(
        path, batch_size=3, features=DENSE, batch_transform=boom, sharding=_mesh_sharding(1), device_prefetch=2
    )
    got = []
    with pytest.raises(RuntimeError, match="transform failed on batch 3"):
        for b in data:
            got.append(b)
    assert len(got) == 2
    assert not any(t.name == "crossfeed-jax-prefetch" for t in threading.enumerate())
    data.close()


def test_breaking_off_and_close_stop_the_thread(mixed_dataset):
    path, _ = mixed_dataset
    data = cfjax.JaxLoader(path, batch_size=2, features=DENSE, sharding=_mesh_sharding(1), device_prefetch=2)
    for _ in data:
        break
    data.close()
    assert not any(t.name == "crossfeed-jax-prefetch" for t in threading.enumerate())


def test_strings_and_ragged_features_are_refused_by_name(mixed_dataset):
    path, _ = mixed_dataset
    with pytest.raises(ConfigError, match=r"\['name'\].*features="):
        cfjax.JaxLoader(path, batch_size=4)
    with pytest.raises(ConfigError, match="'tokens' has shape \\(None,\\).*vary.*pad_to"):
        cfjax.JaxLoader(path, batch_size=2, features=["label", "tokens"], sharding=_mesh_sharding(1))
    # a transform may make anything dense, so the batches are checked too
    with cfjax.JaxLoader(path, batch_size=10, features=["tokens"], transform=dict, sharding=_mesh_sharding(1)) as data:
        with pytest.raises(SchemaError, match="'tokens' varies in shape.*pad_to"):
            next(iter(data))
    with pytest.raises(ConfigError, match=r"pad_to names \['nope'\]"):
        cfjax.JaxLoader(path, batch_size=4, features=["tokens"], pad_to={"nope": 2})


@pytest.mark.parametrize("length", [2, 5])
def test_pad_to_pads_with_zero_and_truncates(mixed_dataset, length):
    path, samples = mixed_dataset
    with cfjax.JaxLoader(
        path, batch_size=6, features=["tokens", "label"], pad_to={"tokens": length}, sharding=_mesh_sharding(1)
    ) as d:
        batches = list(d)
    assert len(batches) == 5
    for b in batches:
        tokens = np.asarray(b["tokens"])
        assert tokens.shape == (6, length)
        for row, i in zip(tokens, np.asarray(b["label"]).tolist()):
            want = np.zeros(length, np.int64)
            t = np.asarray(samples[i]["tokens"][:length])
            want[: len(t)] = t
            np.testing.assert_array_equal(row, want)


def test_batch_size_is_global_and_checked(mixed_dataset):
    path, _ = mixed_dataset
    with pytest.raises(ConfigError, match="does not divide by the 3 processes"):
        cfjax.JaxLoader(path, batch_size=4, rank=0, world_size=3, features=DENSE)
    if jax.device_count() >= 2:
        with pytest.raises(ConfigError, match="does not divide by the 2 devices"):
            cfjax.JaxLoader(path, batch_size=3, sharding=_mesh_sharding(2), features=DENSE)
    with pytest.raises(ConfigError, match="drop_last=True"):
        cfjax.JaxLoader(path, batch_size=4, drop_last=False, features=DENSE)
    with pytest.raises(ConfigError, match="drop_last=True"):
        cfjax.JaxLoader(path, crossfeed.LoaderOptions.of(batch_size=4, features=DENSE))
    # one process claiming to be rank 0 of 2, but holding every device of the sharding
    with cfjax.JaxLoader(path, batch_size=4, rank=0, world_size=2, features=DENSE, sharding=_mesh_sharding(1)) as data:
        assert data.local_batch_size == 2 and data.loader.options.plan.batch_size == 2
        with pytest.raises(ConfigError, match="gives this process 4 of the 4 rows.*reads 2"):
            next(iter(data))


def test_options_passed_whole_read_batch_size_as_global(mixed_dataset):
    path, _ = mixed_dataset
    opts = crossfeed.LoaderOptions.of(batch_size=6, drop_last=True, seed=4, features=DENSE, return_index=True)
    with cfjax.JaxLoader(path, opts, sharding=_mesh_sharding(1)) as data:
        got = ids_of([{k: np.asarray(v) for k, v in b.items()} for b in data])
    assert [len(g) for g in got] == [6] * 5
    for a, b in zip(got, ids_of(_loader_batches(path, batch_size=6, seed=4, features=DENSE, return_index=True))):
        np.testing.assert_array_equal(a, b)


def test_a_stream_becomes_global_arrays(mixed_dataset):
    path, _ = mixed_dataset
    with crossfeed.Loader(path, batch_size=4, features=DENSE, drop_last=True, seed=0) as ld:
        batches = list(ld)
    data = cfjax.JaxLoader(iter(batches), sharding=_mesh_sharding(1))
    got = list(data)
    assert len(got) == len(batches)
    for g, w in zip(got, batches):
        np.testing.assert_array_equal(np.asarray(g["image"]), w["image"])
    with pytest.raises(ConfigError, match="stream source has no state"):
        data.state_dict()
    short = [batches[0], {k: v[:3] for k, v in batches[1].items()}]
    with pytest.raises(SchemaError, match="3 rows where 4 were expected"):
        list(cfjax.JaxLoader(iter(short), batch_size=4, sharding=_mesh_sharding(1)))
    with pytest.raises(ConfigError, match="a stream is read as its servers send it"):
        cfjax.JaxLoader(iter(batches), seed=3)


# -- zero copy: batch buffers the devices use in place, never changed under a held batch --------


def _photos(tmp_path, n: int = 96):
    """Raw 64×64×3 uint8 images (a batch of 8 is 98 KB: the allocator's aligned, recycled size) and
    their index as label."""
    rng = np.random.default_rng(1)
    images = [rng.integers(0, 255, (64, 64, 3), dtype=np.uint8) for _ in range(n)]
    path = tmp_path / "photos"
    crossfeed.write_dataset(path, [{"image": im, "label": i} for i, im in enumerate(images)], num_shards=2).close()
    return path, np.stack(images)


def _in(pointer: int, buffers) -> bool:
    return any(b.ctypes.data <= pointer < b.ctypes.data + b.nbytes for b in buffers)


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_a_held_batch_is_never_changed_by_later_batches(tmp_path, executor):
    """Buffers are reused (the adapter's aligned allocator; a worker process's shared-memory slots)
    and the devices use them in place: a batch the consumer still holds must keep its values
    while later batches are built, whichever batches it drops meanwhile."""
    path, images = _photos(tmp_path)
    kw = dict(batch_size=8, seed=4, shuffle="global", executor=executor, prefetch=4)
    want = _loader_batches(path, **dict(kw, executor="thread"))
    with cfjax.JaxLoader(path, sharding=_mesh_sharding(1), device_prefetch=3, **kw) as data:
        held, in_place = [], 0
        for epoch in range(3):  # later epochs reuse the buffers earlier ones dropped
            for i, batch in enumerate(data):
                if i % 3 == 0:
                    held.append((epoch, i, batch))  # kept; the others are dropped at once
                in_place += _in(batch["image"].unsafe_buffer_pointer(), data._alloc._buffers)
                for e, j, kept in held:  # every held batch, after each new one
                    labels = np.asarray(kept["label"])
                    np.testing.assert_array_equal(np.asarray(kept["image"]), images[labels])
                    if e == 0:
                        np.testing.assert_array_equal(labels, want[j]["label"])
        assert len(held) == 12
    if executor == "thread":  # the devices did use the Loader's buffers in place
        assert in_place >= 30


@pytest.mark.parametrize("layout", ["batch", "batch x model"])
def test_the_per_device_transfer_equals_device_put(tmp_path, layout):
    """In one process each device's rows go through jax's per-device transfer (internal to jax,
    checked once per feature against jax.device_put); ``fast=False`` is jax.device_put always.
    Both give the same global arrays, shards and shardings — a batch axis split over every
    device, or over 2 of a 2×2 mesh and replicated over the other axis."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (XLA_FLAGS forced when this module imports jax first)")
    path, images = _photos(tmp_path, 48)
    if layout == "batch":
        sharding = _mesh_sharding(4)
    else:
        sharding = jax_sharding.NamedSharding(
            jax_sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("batch", "model")),
            jax_sharding.PartitionSpec("batch"),
        )
    kw = dict(batch_size=8, seed=2, features=["image", "label"], sharding=sharding)
    with cfjax.JaxLoader(path, **kw) as fast, cfjax.JaxLoader(path, **kw) as public:
        public._assemble = dataclasses.replace(public._assemble, fast=False)
        pairs = list(zip(fast, public))
        plans = fast._assemble._checked
    assert len(pairs) == 6
    assert plans and all(plan is not None and plan[3] for plan in plans.values())  # checked, and kept
    for a, b in pairs:
        for k in ("image", "label"):
            assert a[k].sharding == b[k].sharding == sharding and a[k].dtype == b[k].dtype
            assert [(s.device, s.index) for s in a[k].addressable_shards] == [
                (s.device, s.index) for s in b[k].addressable_shards
            ]
            np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]))
        np.testing.assert_array_equal(np.asarray(a["image"]), images[np.asarray(a["label"])])


@pytest.mark.timeout(120)
def test_a_crossfeed_serve_stream_becomes_global_arrays(tmp_path):
    """A real `crossfeed serve` (ipc:// in tmp_path) read through `crossfeed.connect` and fed to
    JaxLoader: every served batch arrives as global arrays equal to the Loader's batch of the
    same samples (the server's plan), laid out by the sharding."""
    from net_helpers import FAST_HB, child, read_endpoint, stop

    from crossfeed.net import connect

    path, images = _photos(tmp_path, 40)
    ep = tmp_path / "ep"
    proc = child(
        "cli",
        "serve",
        str(path),
        f"ipc://{tmp_path}/serve.ipc",
        *("--batch-size", "8", "--seed", "6", "--epochs", "1", "--drop-last"),
        *("--heartbeat-interval", "0.1", "--heartbeat-timeout", "2", "--endpoint-file", str(ep)),
        log=tmp_path / "serve.log",
    )
    n = min(4, jax.device_count())
    sharding = _mesh_sharding(n)
    try:
        address = read_endpoint(ep, procs=[proc])
        with connect(address, with_meta=True, **FAST_HB) as client:
            got = [(meta.sample_ids.tolist(), batch) for meta, batch in cfjax.JaxLoader(client, sharding=sharding)]
        assert proc.wait(30) == 0, (tmp_path / "serve.log").read_text()
    finally:
        stop(proc)
    want = {tuple(b["__index__"].tolist()): b for b in _loader_batches(path, batch_size=8, seed=6, return_index=True)}
    assert len(got) == len(want) == 5
    for ids, batch in got:
        w = want[tuple(ids)]
        for k in ("image", "label"):
            assert isinstance(batch[k], jax.Array) and batch[k].sharding == sharding and batch[k].shape[0] == 8
            np.testing.assert_array_equal(np.asarray(batch[k]), w[k])
        assert len(batch["image"].addressable_shards) == n
        np.testing.assert_array_equal(np.asarray(batch["image"]), images[np.asarray(batch["label"])])


def test_no_prefetch_thread_by_default_on_cpu_devices(mixed_dataset):
    """CPU devices use the Loader's arrays in place: nothing to overlap, so no thread by default."""
    path, _ = mixed_dataset
    with cfjax.JaxLoader(path, batch_size=2, features=DENSE, sharding=_mesh_sharding(1)) as data:
        assert data.device_prefetch == 0
        next(iter(data))
        assert not any(t.name == "crossfeed-jax-prefetch" for t in threading.enumerate())
    with pytest.raises(ConfigError, match="device_prefetch must be"):
        cfjax.JaxLoader(path, batch_size=2, features=DENSE, device_prefetch=-1)


def test_a_failing_or_different_per_device_transfer_falls_back_to_device_put(mixed_dataset, monkeypatch):
    """The internal transfer is checked on each feature's first batch: where it raises or gives
    another array, jax.device_put places that feature from then on, and the batches are right."""
    from crossfeed.adapters import jax_arrays

    path, _ = mixed_dataset
    put, aval = jax_arrays._PUT

    def broken(*args):
        raise TypeError("another jax")

    def wrong(aval_, sharding, shards, devices):  # every value one more
        return put(aval_, sharding, [s + 1 for s in shards], devices)

    kw = dict(batch_size=6, seed=1, features=["label"], sharding=_mesh_sharding(1))
    want = [b["label"] for b in _loader_batches(path, **{k: v for k, v in kw.items() if k != "sharding"})]
    for fake in (broken, wrong):
        monkeypatch.setattr(jax_arrays, "_PUT", (fake, aval))
        with cfjax.JaxLoader(path, **kw) as data:
            got = [np.asarray(b["label"]) for b in data]
            assert list(data._assemble._checked.values()) == [None]  # jax.device_put from now on
        assert len(got) == len(want) == 5
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


def test_stats_time_the_training_loop_with_or_without_device_prefetch(mixed_dataset):
    path, _ = mixed_dataset
    for ahead in (None, 2):
        with cfjax.JaxLoader(
            path, batch_size=4, features=DENSE, device_prefetch=ahead, sharding=_mesh_sharding(1)
        ) as jl:
            n = sum(1 for _ in jl)
            stats = jl.stats()
        assert stats.batches == n > 0 and stats.epochs == 1
        assert stats.stages["decode"].count >= n  # the Loader's own stages, as it ran them
        assert stats.wait_seconds > 0 and str(stats.verdict())
