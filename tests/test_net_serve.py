"""Server and client over real sockets (tcp loopback and ipc), in one process."""

from __future__ import annotations

import collections
import threading

import numpy as np
import pytest
from net_helpers import FAST_HB, Synthetic, wait_until

from crossfeed.errors import CrossfeedError, ServerLostError
from crossfeed.net import Heartbeat, Mode, Server, ServerOptions, connect

pytestmark = pytest.mark.timeout(60)
HB = Heartbeat(0.1, 2.0)


def _address(kind, tmp_path, name="s"):
    return "tcp://127.0.0.1:0" if kind == "tcp" else f"ipc://{tmp_path}/{name}.sock"


def _no_crossfeed_threads():
    return not [t for t in threading.enumerate() if t.name.startswith("crossfeed-")]


@pytest.mark.parametrize("kind", ["tcp", "ipc"])
def test_one_client_gets_every_sample_once_per_epoch(kind, tmp_path):
    opts = ServerOptions((_address(kind, tmp_path),), epochs=3, heartbeat=HB, server_id="srv")
    with Server(Synthetic(num_samples=50, batch_size=8, shape=(2, 3)), opts) as server:
        with connect(server.endpoints, with_meta=True, **FAST_HB) as client:
            got = collections.defaultdict(list)
            for meta, batch in client:
                assert meta.server_id == "srv"
                got[meta.epoch].extend(meta.sample_ids.tolist())
                np.testing.assert_array_equal(batch["x"][:, 0, 0], meta.sample_ids.astype(np.float32))
                assert batch["name"] == [f"s{i}" for i in meta.sample_ids]
                assert batch["x"].shape[1:] == (2, 3)
            assert client.lost == []
            assert [(e, n) for _, e, n in client.epochs_ended] == [(0, 7), (1, 7), (2, 7)]
        assert server.wait(10)
        server.raise_if_failed()
    assert {e: sorted(ids) for e, ids in got.items()} == {e: list(range(50)) for e in range(3)}
    assert server.stats["acked"] == 21
    assert wait_until(_no_crossfeed_threads, 10, "threads to stop")


def test_two_clients_share_each_epoch_exactly_once():
    opts = ServerOptions(("tcp://127.0.0.1:0",), epochs=2, heartbeat=HB)
    seen: dict[int, list] = {0: [], 1: []}
    errors: list[BaseException] = []

    def trainer():
        try:
            with connect(opts_endpoints, credits=2, with_meta=True, **FAST_HB) as c:
                for meta, _ in c:
                    seen[meta.epoch].append(meta.sample_ids.tolist())
        except BaseException as e:  # reported below
            errors.append(e)

    with Server(Synthetic(num_samples=96, batch_size=4), opts) as server:
        opts_endpoints = server.endpoints
        threads = [threading.Thread(target=trainer) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads)
    assert errors == []
    for epoch, batches in seen.items():
        ids = [i for b in batches for i in b]
        assert sorted(ids) == list(range(96)), f"epoch {epoch}"


def test_one_client_reads_from_several_servers(tmp_path):
    servers = [
        Server(
            Synthetic(num_samples=30, batch_size=7, offset=1000 * k),
            ServerOptions((_address("ipc", tmp_path, f"m{k}"),), epochs=1, heartbeat=HB),
        )
        for k in range(3)
    ]
    try:
        for s in servers:
            s.start()
        with connect([s.endpoints[0] for s in servers], with_meta=True, **FAST_HB) as client:
            ids = [i for meta, _ in client for i in meta.sample_ids.tolist()]
            assert client.lost == []
    finally:
        for s in servers:
            s.close()
    assert sorted(ids) == [1000 * k + i for k in range(3) for i in range(30)]


def test_broadcast_every_subscriber_sees_the_stream():
    opts = ServerOptions(("tcp://127.0.0.1:0",), mode=Mode.BROADCAST, heartbeat=HB)
    with Server(Synthetic(num_samples=40, batch_size=4, delay=0.005), opts) as server:
        subs = [connect(server.endpoints, broadcast=True, with_meta=True, **FAST_HB) for _ in range(2)]
        try:
            for sub in subs:
                seqs = [next(sub)[0].seq for _ in range(6)]
                assert seqs == sorted(seqs) and len(set(seqs)) == 6
        finally:
            for sub in subs:
                sub.close()


def test_observers_see_copies_without_taking_batches_from_trainers():
    opts = ServerOptions(("tcp://127.0.0.1:0",), broadcast=("tcp://127.0.0.1:0",), heartbeat=HB)
    with Server(Synthetic(num_samples=16, batch_size=4), opts) as server:
        observer = connect(server.broadcast_endpoints, broadcast=True, with_meta=True, **FAST_HB)
        trainer = connect(server.endpoints, with_meta=True, **FAST_HB)
        try:
            per_epoch = collections.defaultdict(list)
            observed = []
            stop = threading.Event()

            def watch():
                for meta, _ in observer:
                    observed.append(meta.seq)
                    if len(observed) >= 3 or stop.is_set():
                        return

            t = threading.Thread(target=watch)
            t.start()
            for meta, _ in trainer:
                per_epoch[meta.epoch].extend(meta.sample_ids.tolist())
                if not t.is_alive() and len(per_epoch) > 2:
                    break
                assert meta.epoch < 200, "observer saw nothing"
            stop.set()
            t.join(10)
        finally:
            trainer.close()
            observer.close()
    assert len(observed) >= 3
    complete = [e for e in per_epoch if e < max(per_epoch)]
    for e in complete:  # the trainer still got every sample of every full epoch exactly once
        assert sorted(per_epoch[e]) == list(range(16))


def test_a_failing_batch_source_is_reported():
    def broken(epoch):
        yield {"x": np.zeros(2)}
        raise RuntimeError("disk on fire")

    server = Server(broken, ServerOptions(("tcp://127.0.0.1:0",), heartbeat=HB)).start()
    try:
        with connect(server.endpoints, **FAST_HB) as client:
            got = []
            with pytest.raises(ServerLostError, match="batch source failed") as info:
                for batch in client:  # raises, not a normal end: the server says it failed
                    got.append(batch)
            assert len(got) <= 1 and info.value.address == server.endpoints[0]
            assert [lost.reason for lost in client.lost] == ["the server reported that its batch source failed"]
        assert server.wait(10)
        with pytest.raises(CrossfeedError, match="disk on fire"):
            server.raise_if_failed()
    finally:
        server.close()


def test_closing_mid_stream_stops_every_thread():
    opts = ServerOptions(("tcp://127.0.0.1:0",), heartbeat=HB)  # endless
    with Server(Synthetic(num_samples=64, batch_size=8), opts) as server:
        with connect(server.endpoints, **FAST_HB) as client:
            for _ in range(20):
                next(client)
    assert server.wait(10)
    assert wait_until(_no_crossfeed_threads, 10, "threads to stop")


def test_serving_a_dataset_with_a_variable_length_list(tmp_path):
    """`crossfeed serve`'s batch source (the Loader) over a dataset with a ragged feature: every
    sample's list arrives intact, whatever its length (empty included)."""
    import crossfeed
    from crossfeed.net.run import LoaderEpochs

    n = 23
    crossfeed.write_dataset(
        tmp_path / "ds", [{"tokens": list(range(i % 5)), "id": i} for i in range(n)], num_shards=2
    ).close()
    factory = LoaderEpochs(str(tmp_path / "ds"), crossfeed.LoaderOptions.of(batch_size=4, seed=1, rank=0, world_size=1))
    opts = ServerOptions(("tcp://127.0.0.1:0",), epochs=2, heartbeat=HB)
    got = collections.defaultdict(set)
    kinds = set()
    try:
        with Server(factory, opts) as server:
            with connect(server.endpoints, with_meta=True, **FAST_HB) as client:
                for meta, batch in client:
                    tokens, ids = batch["tokens"], batch["id"]
                    assert len(tokens) == len(ids) == len(meta.sample_ids)
                    kinds.add(tokens.dtype == object)
                    for i, t in zip(ids.tolist(), tokens):
                        assert isinstance(t, np.ndarray) and t.dtype == np.int64
                        assert t.tolist() == list(range(i % 5)), f"sample {i}"
                        got[meta.epoch].add(i)
                assert client.lost == []
            assert server.wait(10)
            server.raise_if_failed()
    finally:
        factory.close()
    assert {e: sorted(ids) for e, ids in got.items()} == {0: list(range(n)), 1: list(range(n))}
    assert True in kinds  # the ragged form crossed the wire (not only equal-length batches)
