"""Failures with real processes: killed trainers, killed servers, hostile messages."""

from __future__ import annotations

import collections
import logging
import os
import signal
import struct

import numpy as np
import pytest
import zmq
from net_helpers import FAST_HB, Synthetic, batches_in, child, read_endpoint, read_lines, stop, wait_until

from crossfeed.format import wire
from crossfeed.net import Heartbeat, Server, ServerOptions, connect
from crossfeed.net import protocol as P
from crossfeed.net.stream.producer import encode_item

pytestmark = pytest.mark.timeout(90)


@pytest.mark.slow
@pytest.mark.parametrize("stall_after", [1, 3])
def test_a_killed_trainers_batches_go_to_the_survivor(tmp_path, stall_after):
    n = 200
    server = child("run_server", str(tmp_path / "ep"), "tcp://127.0.0.1:0", n, 5, 1, 0.005, log=tmp_path / "server.log")
    procs = [server]
    try:
        address = read_endpoint(tmp_path / "ep", procs=procs)
        a_out, b_out = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
        a = child("run_trainer", [address], str(a_out), stall_after, log=tmp_path / "a.log")
        procs.append(a)
        wait_until(lambda: len(batches_in(a_out)) >= stall_after, 30, "trainer A's batches", procs)
        b = child("run_trainer", [address], str(b_out), log=tmp_path / "b.log")
        procs.append(b)
        wait_until(lambda: len(batches_in(b_out)) >= 2, 30, "trainer B's batches", procs)
        os.kill(a.pid, signal.SIGKILL)  # mid-epoch: A holds batches the epoch cannot end without
        assert b.wait(60) == 0, (tmp_path / "b.log").read_text()
        assert server.wait(30) == 0, (tmp_path / "server.log").read_text()
    finally:
        stop(*procs)
    a_ids = [i for batch in batches_in(a_out) for i in batch]
    b_ids = [i for batch in batches_in(b_out) for i in batch]
    assert read_lines(b_out)[-1] == "END []"  # the survivor lost no server
    assert len(b_ids) == len(set(b_ids)), "the survivor got a sample twice"
    assert set(a_ids) | set(b_ids) == set(range(n))
    if stall_after == 1:  # A acknowledged nothing: the survivor gets the whole epoch, once
        assert sorted(b_ids) == list(range(n))
    assert "unacknowledged batches go to the others" in (tmp_path / "server.log").read_text()


def test_a_killed_server_is_dropped_and_the_client_reads_on(tmp_path, caplog):
    procs = []
    try:
        procs.append(
            child("run_server", str(tmp_path / "ep1"), "tcp://127.0.0.1:0", 400, 4, 1, 0.002, log=tmp_path / "s1.log")
        )
        procs.append(
            child(
                "run_server",
                str(tmp_path / "ep2"),
                "tcp://127.0.0.1:0",
                80,
                4,
                1,
                0.002,
                "",
                [4],
                10_000,
                log=tmp_path / "s2.log",
            )
        )
        first = read_endpoint(tmp_path / "ep1", procs=procs)
        second = read_endpoint(tmp_path / "ep2", procs=procs)
        got = collections.defaultdict(list)
        with caplog.at_level(logging.WARNING, "crossfeed.net.stream.receiver"):
            with connect([first, second], with_meta=True, on_loss="continue", **FAST_HB) as client:
                for meta, _ in client:
                    source = "s1" if meta.sample_ids[0] < 10_000 else "s2"
                    got[source].extend(meta.sample_ids.tolist())
                    if source == "s1" and len(got["s1"]) == 12:
                        os.kill(procs[0].pid, signal.SIGKILL)
                lost = client.lost
        assert procs[1].wait(30) == 0
    finally:
        stop(*procs)
    assert [x.address for x in lost] == [first]
    assert "silent" in lost[0].reason and lost[0].received_batches >= 3
    assert sorted(got["s2"]) == list(range(10_000, 10_080))
    assert len(got["s1"]) == len(set(got["s1"])) and len(got["s1"]) < 400
    assert any("dropped" in r.getMessage() and first in r.getMessage() for r in caplog.records)


def test_hostile_messages_to_a_server_are_dropped_and_it_serves_on(tmp_path):
    server = child("run_server", str(tmp_path / "ep"), "tcp://127.0.0.1:0", 40, 4, 1, log=tmp_path / "server.log")
    ctx = zmq.Context()
    try:
        address = read_endpoint(tmp_path / "ep", procs=[server])
        hostile = ctx.socket(zmq.DEALER)
        hostile.linger = 0
        hostile.connect(address)
        good_envelope = P.pack(P.Kind.CREDIT, 10**12)  # absurd credit: clamped
        for msg in [
            [good_envelope],
            [b"garbage"],
            [P.pack(P.Kind.ACK, 123456)],  # ack of a batch never sent
            [good_envelope[:10]],  # truncated
            [b"XXXX" + good_envelope[4:]],  # bad magic
            [struct.pack("<4sBBHqq", b"CXFN", 9, 1, 0, 0, 0)],  # unknown version
            [struct.pack("<4sBBHqq", b"CXFN", 1, 77, 0, 0, 0)],  # unknown kind
            [P.pack(P.Kind.BATCH, 0, 0)],  # a server-only kind
            [P.pack(P.Kind.HEARTBEAT, 1)] + [b"x"] * 50,  # too many frames
            [b""],
            [b"y" * 100_000],  # oversized: the server drops the connection
        ]:
            hostile.send_multipart(msg)
        out = tmp_path / "t.jsonl"
        trainer = child("run_trainer", [address], str(out), log=tmp_path / "t.log")
        assert trainer.wait(60) == 0, (tmp_path / "t.log").read_text()
        assert server.wait(30) == 0, (tmp_path / "server.log").read_text()
    finally:
        stop(server, *(locals().get("trainer") and [trainer] or []))
        ctx.destroy(linger=0)
    assert sorted(i for b in batches_in(out) for i in b) == list(range(40))
    assert "dropped a malformed message" in (tmp_path / "server.log").read_text()


def test_hostile_messages_to_a_client_are_dropped_and_it_reads_on(tmp_path):
    ctx = zmq.Context()
    fake = ctx.socket(zmq.ROUTER)
    fake.linger = 0
    port = fake.bind_to_random_port("tcp://127.0.0.1")
    limits = wire.WireLimits(max_message_bytes=1 << 20)
    client = connect(f"tcp://127.0.0.1:{port}", limits=limits, with_meta=True, **FAST_HB)

    def next_peer(exclude=None):
        def ready():
            while fake.poll(0):
                frames = fake.recv_multipart()
                if frames[0] != exclude:
                    return frames[0]
            return None

        return wait_until(ready, 20, "a message from the client")

    try:
        peer = next_peer()
        item = encode_item(
            {"x": np.arange(6.0).reshape(2, 3), "__index__": np.array([4, 5])}, epoch=0, seq=7, server_id="fake"
        )
        frames = [f.tobytes() if isinstance(f, np.ndarray) else bytes(f) for f in item.frames]
        hostile = [
            [b"nonsense"],
            [P.pack(P.Kind.CREDIT, 1)],  # a client-only kind
            [P.pack(P.Kind.BATCH, 7, 0)] + [b"bad header", b""],
            [P.pack(P.Kind.BATCH, 8, 0)] + frames,  # envelope and batch disagree
            [P.pack(P.Kind.BATCH, 7, 0)] + frames[:-1],  # truncated
            [P.pack(P.Kind.BATCH, 7, 0), frames[0][:-3]] + frames[1:],
            [P.pack(P.Kind.END_OF_EPOCH, 0, 1), b"extra"],
            [P.pack(P.Kind.HEARTBEAT)] + [b""] * 1000,  # too many frames
        ]
        for msg in hostile:
            fake.send_multipart([peer] + msg)
        fake.send_multipart([peer, P.pack(P.Kind.BATCH, 7, 0)] + frames)
        fake.send_multipart([peer, P.pack(P.Kind.END_OF_STREAM, 1)])
        got = list(client)
        assert len(got) == 1
        meta, batch = got[0]
        assert meta.sample_ids.tolist() == [4, 5] and batch["x"].tolist() == [[0, 1, 2], [3, 4, 5]]
        assert client.dropped_messages >= len(hostile)
        assert client.lost == []
    finally:
        client.close()
        fake.close()
        ctx.term()


def test_a_server_sending_oversized_messages_is_dropped_and_the_others_read_on():
    ctx = zmq.Context()
    fake = ctx.socket(zmq.ROUTER)
    fake.linger = 0
    port = fake.bind_to_random_port("tcp://127.0.0.1")
    opts = ServerOptions(("tcp://127.0.0.1:0",), epochs=1, heartbeat=Heartbeat(0.1, 2.0))
    try:
        with Server(Synthetic(num_samples=24, batch_size=4), opts) as good:
            limits = wire.WireLimits(max_message_bytes=1 << 20)
            addresses = [f"tcp://127.0.0.1:{port}", good.endpoints[0]]
            with connect(addresses, limits=limits, with_meta=True, on_loss="continue", **FAST_HB) as client:
                assert fake.poll(20_000)
                peer = fake.recv_multipart()[0]
                fake.send_multipart([peer, P.pack(P.Kind.HEARTBEAT)])
                # over MAXMSGSIZE: libzmq closes that connection; the server goes silent to us
                fake.send_multipart([peer, b"z" * (2 << 20)])
                ids = sorted(i for meta, _ in client for i in meta.sample_ids.tolist())
                lost = client.lost
    finally:
        fake.close()
        ctx.term()
    assert ids == list(range(24))
    assert [x.address for x in lost] == [addresses[0]]


@pytest.mark.parametrize("credits", [4, pytest.param(16, marks=pytest.mark.slow)])
def test_batched_acks_redeliver_exactly_the_unacknowledged_batches(tmp_path, credits):
    n, consumed = 240, 7
    opts = ServerOptions(("tcp://127.0.0.1:0",), epochs=1, heartbeat=Heartbeat(0.1, 2.0))
    a_out, b_out = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    procs = []
    with Server(Synthetic(num_samples=n, batch_size=4), opts) as server:
        address = server.endpoints[0]
        try:
            procs.append(child("run_trainer", [address], str(a_out), consumed, credits, log=tmp_path / "a.log"))
            wait_until(lambda: len(batches_in(a_out)) >= consumed, 30, "trainer A's batches", procs)
            # A finished all but the batch it holds; their acks go out together, soon
            wait_until(lambda: server.stats["acked"] >= consumed - 1, 10, "A's acknowledgements", procs)
            assert server.stats["acked"] == consumed - 1
            os.kill(procs[0].pid, signal.SIGKILL)
            procs[0].wait(10)
            procs.append(child("run_trainer", [address], str(b_out), log=tmp_path / "b.log"))
            assert procs[1].wait(60) == 0, (tmp_path / "b.log").read_text()
            assert server.wait(30)
        finally:
            stop(*procs)
        server.raise_if_failed()
    acknowledged = {i for batch in batches_in(a_out)[: consumed - 1] for i in batch}
    b_ids = [i for batch in batches_in(b_out) for i in batch]
    assert len(b_ids) == len(set(b_ids)), "the survivor got a sample twice"
    # everything A had not acknowledged (the batch it held, what it had prefetched), nothing else
    assert sorted(b_ids) == sorted(set(range(n)) - acknowledged)
