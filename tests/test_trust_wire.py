"""Issue 22 item 9: a batch whose shape holds no element but a huge other dimension.

The decoder checks each dimension, not only the product, so `(0, 2**63)` is a WireError (numpy
could not make it); and a bad message from one server never ends a client's stream from the
others: not through `connect(addresses)`, not through a dispatcher that a fake local "server"
registered with.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import struct

import numpy as np
import pytest
import zmq
from dispatch_helpers import HB, read_batches, spawn, write_dataset
from net_helpers import FAST_HB, Synthetic, stop, wait_until

from crossfeed import connect
from crossfeed.errors import WireError
from crossfeed.format import wire
from crossfeed.net import protocol as P
from crossfeed.net.stream.server import Server, ServerOptions

pytestmark = pytest.mark.timeout(120)

HUGE = [2**62, 2**63, 2**64 - 1, 2**31, 2**24 + 1]


def header(kind: int, code: int, dims, name=b"x", seq=0, sid=b"evil") -> bytes:
    """A batch header of one field (see the layout in `crossfeed.format.wire`)."""
    prefix = struct.pack("<4sHHqqqHH", wire.MAGIC, wire.VERSION, 0, 0, seq, 0, len(sid), 1) + sid
    field = struct.pack("<H", len(name)) + name + struct.pack("<BBB", kind, code, len(dims))
    return prefix + field + struct.pack(f"<{len(dims)}Q", *dims)


def zero_element(kind: int, dims, seq=0) -> list[bytes]:
    """The frames of a message whose one field declares `dims` and carries no data."""
    if kind == wire.ARRAY:
        return [header(kind, 11, dims, seq=seq), b"", b""]  # float32
    if kind == wire.RAGGED:  # one item of shape `dims`
        shapes = np.array(dims, "<u8").tobytes()
        return [header(kind, 11, (1, len(dims)), seq=seq), b"", shapes, b""]
    return [header(kind, 0, dims, seq=seq), b"", b"", b""]


@pytest.mark.parametrize("kind", [wire.ARRAY, wire.STR_OBJECT, wire.BYTES_OBJECT, wire.RAGGED])
@pytest.mark.parametrize(
    "dims",
    [(0, 2**63), (0, 2**62), (3, 0, 2**62), (2**62, 0), (0, 2**31, 2**31, 2**31), (0,) + (2**20,) * 15],
)
def test_a_zero_element_shape_with_a_huge_dimension_is_a_wire_error(kind, dims):
    with pytest.raises(WireError, match="dim|spans|limit"):
        wire.decode(zero_element(kind, dims))


def test_every_shape_of_zeros_ones_and_huge_dims_decodes_or_is_a_wire_error():
    """Shapes of up to 3 dims drawn from {0, 1, 2, the limit, just above it, huge}: each one
    decodes to an array of exactly that shape, or raises WireError; nothing else comes out."""
    limits = wire.WireLimits(max_message_bytes=1 << 12, max_items=1 << 8)
    values = [0, 1, 2, 255, 256, 257, 1023, 1024, 1025, *HUGE]
    decoded = refused = 0
    for ndim in range(4):
        for dims in itertools.product(values, repeat=ndim):
            n = int(np.prod(dims, dtype=object)) if dims else 1
            data = b"\0" * (4 * n) if n <= 1024 else b""
            for frames in (
                [header(wire.ARRAY, 11, dims), b"", data],
                [header(wire.BYTES_OBJECT, 0, dims), b"", b"\0" * (8 * n) if n <= 256 else b"", b""],
            ):
                try:
                    _, batch = wire.decode(frames, limits)
                except WireError:
                    refused += 1
                    continue
                assert batch["x"].shape == tuple(dims)
                decoded += 1
    assert decoded and refused  # both outcomes were exercised


def test_a_ragged_item_of_zero_elements_with_huge_dims_is_a_wire_error():
    for ndim in range(2, 17):
        dims = (0,) + (2**29,) * (ndim - 1)  # each dim is within the limit, their span is not
        frames = zero_element(wire.RAGGED, dims)
        if ndim == 2:
            assert wire.decode(frames)[1]["x"][0].shape == dims  # 2**29 floats may be sent
        else:
            with pytest.raises(WireError, match="spans"):
                wire.decode(frames)


# ---- a client reading from a hostile server and an honest one ----
def _fake_server(ctx: zmq.Context):
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    return sock, f"tcp://127.0.0.1:{port}"


@contextlib.contextmanager
def _fake_beside_a_real_server():
    """A client reading from a real server (24 samples) and from a raw fake one: yields the
    client, the fake's socket and the client's routing id there."""
    ctx = zmq.Context()
    fake, fake_address = _fake_server(ctx)
    opts = ServerOptions(("tcp://127.0.0.1:0",), epochs=1, heartbeat=P.Heartbeat(0.1, 2.0))
    try:
        with Server(Synthetic(num_samples=24, batch_size=4, delay=0.02), opts) as good:
            addresses = [fake_address, good.endpoints[0]]
            with connect(addresses, with_meta=True, on_loss="continue", **FAST_HB) as client:
                assert fake.poll(20_000)
                yield client, fake, fake.recv_multipart()[0]
    finally:
        fake.close()
        ctx.term()


def test_a_zero_element_message_from_one_server_does_not_end_the_stream_from_the_other():
    with _fake_beside_a_real_server() as (client, fake, peer):
        for seq, dims in enumerate([(0, 2**63), (5, 0, 2**62)]):
            for kind in (wire.ARRAY, wire.STR_OBJECT, wire.RAGGED):
                env = P.pack(P.Kind.BATCH, seq, 0, instance=7)
                fake.send_multipart([peer, env, *zero_element(kind, dims, seq=seq)])
        fake.send_multipart([peer, P.pack(P.Kind.END_OF_STREAM, 1, instance=7)])
        ids = sorted(i for meta, _ in client for i in meta.sample_ids.tolist())
        dropped = client.dropped_messages
    assert ids == list(range(24))
    assert dropped == 6


def test_an_unexpected_error_decoding_one_servers_message_drops_that_server_only(monkeypatch, caplog):
    """Defence in depth: should the decoder ever raise something other than WireError on a
    peer's bytes, that peer is dropped (counted, logged), never the whole client."""
    real = wire.decode

    def decode(frames, limits=wire.DEFAULT_LIMITS):
        meta, batch = real(frames, limits)
        if meta.server_id == "evil":
            raise ValueError("a decoder bug")
        return meta, batch

    monkeypatch.setattr(wire, "decode", decode)
    with _fake_beside_a_real_server() as (client, fake, peer):
        batch = wire.encode({"x": np.zeros(2)}, wire.BatchMeta(seq=0, server_id="evil"))
        fake.send_multipart([peer, P.pack(P.Kind.BATCH, 0, 0, instance=7), *batch])
        ids = sorted(i for meta, _ in client for i in meta.sample_ids.tolist())
        lost, dropped = client.lost, client.dropped_messages
        fake_address = client.addresses[0]  # the fake is named first
    assert ids == list(range(24))
    assert [x.address for x in lost] == [fake_address]
    assert "ValueError" in lost[0].reason and dropped == 1
    assert "a decoder bug" in caplog.text


# ---- through a dispatcher: a fake local server registers and sends such a message ----
N, BATCH = 96, 4  # 24 batches


@pytest.mark.slow
def test_a_fake_server_registered_with_the_dispatcher_does_not_kill_the_trainers(tmp_path):
    dataset = str(tmp_path / "ds")
    write_dataset(dataset, N)
    ep = tmp_path / "d.ep"
    argv = ["dispatch", dataset, "tcp://127.0.0.1:0", "--batch-size", str(BATCH), "--journal", str(tmp_path / "j")]
    argv += [*HB, "--lease-size", "2", "--window", "4", "--linger", "1", "--endpoint-file", str(ep)]
    d = spawn("cli", *argv, log=tmp_path / "d.log")
    procs = [d]
    try:
        address = wait_until(lambda: ep.exists() and ep.read_text(), 30, "the dispatcher's endpoint", [d])
        fake = spawn_fake(tmp_path, address)
        procs.append(fake)
        wait_until(lambda: (tmp_path / "fake.ready").exists(), 30, "the fake server's HELLO", procs)
        outs = [tmp_path / f"t{i}.out" for i in range(2)]
        procs += [spawn("trainer", address, str(o), 0.0, log=tmp_path / f"t{i}.log") for i, o in enumerate(outs)]
        sent = tmp_path / "fake.sent"
        wait_until(lambda: sent.exists() and len(sent.read_text().split()) >= 2, 30, "the bad batches sent", procs)
        procs.append(
            spawn("cli", "serve", dataset, "tcp://127.0.0.1:0", "--dispatcher", address, *HB, log=tmp_path / "s.log")
        )
        for i, t in enumerate(procs[2:4]):
            assert t.wait(90) == 0, (tmp_path / f"t{i}.log").read_text()[-3000:]
        assert fake.wait(30) == 0, (tmp_path / "fake.log").read_text()[-3000:]
        assert d.wait(30) == 0, (tmp_path / "d.log").read_text()[-3000:]
    finally:
        stop(*procs)
    counts = collections.Counter(i for o in outs for ids, _ in read_batches(o) for i in ids)
    assert counts == collections.Counter(range(N)), "a sample was lost or used twice"
    logs = "".join((tmp_path / f"t{i}.log").read_text() for i in range(2))
    assert "dropped a malformed message" in logs and "client I/O failed" not in logs
    assert "is no dispatcher's" in logs  # the well-formed batch under a made-up lease id


def spawn_fake(tmp_path, dispatcher: str):
    import os
    import subprocess
    import sys

    from dispatch_helpers import ROOT, TESTS

    code = f"import test_trust_wire as t; t.fake_leased_server({dispatcher!r}, {str(tmp_path)!r})"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]))
    with open(tmp_path / "fake.log", "ab") as out:
        return subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT, env=env)


def fake_leased_server(dispatcher: str, folder: str, peers: int = 2, deadline: float = 60.0) -> None:
    """(child process) Says HELLO to the dispatcher with a data endpoint, beats it, and answers
    each trainer that connects with zero-element batches under the leases it got; once `peers`
    trainers had them (or after `deadline` seconds), says BYE (its leases go to the real servers)."""
    import os
    import time

    from crossfeed.net.lease import messages as W

    ctx = zmq.Context()
    me = P.new_instance()
    control = ctx.socket(zmq.DEALER)
    control.linger = 0
    control.connect(dispatcher)
    data, endpoint = _fake_server(ctx)
    control.send_multipart(W.pack(W.Kind.HELLO, role=1, sender=me, payload=endpoint))
    open(os.path.join(folder, "fake.ready"), "w").close()
    leases: list[tuple[int, int, int]] = []  # (claim token, epoch, batch)
    answered: set[bytes] = set()
    end = time.monotonic() + deadline
    next_beat = 0.0
    while time.monotonic() < end:
        if len(answered) >= peers:
            end = min(end, time.monotonic() + 1.0)  # a last second of beats, then BYE
        if time.monotonic() >= next_beat:
            next_beat = time.monotonic() + 0.1
            control.send_multipart(W.pack(W.Kind.BEAT, role=1, sender=me))
        while control.poll(0):
            msg = W.unpack(control.recv_multipart(), frozenset(W.Kind))
            if msg.kind is W.Kind.LEASE:
                leases += [(int(token), msg.epoch, int(b)) for b, token in msg.payload]
        if data.poll(20):
            peer = data.recv_multipart()[0]
            if peer not in answered and leases:
                answered.add(peer)
                for (token, epoch, b), dims in zip(leases, [(0, 2**63), (7, 0, 2**62)]):
                    seq = epoch * (N // BATCH) + b
                    env = P.pack(P.Kind.BATCH, seq, epoch, instance=me, token=token)
                    data.send_multipart([peer, env, *zero_element(wire.ARRAY, dims, seq=seq)])
                # and a well-formed batch under a claim token no dispatcher can have made
                _token, epoch, b = leases[-1]
                meta = wire.BatchMeta(epoch=epoch, seq=epoch * (N // BATCH) + b, sample_ids=np.arange(BATCH))
                env = P.pack(P.Kind.BATCH, meta.seq, epoch, instance=me, token=2**64 - 1)
                data.send_multipart([peer, env, *wire.encode({"x": np.zeros((BATCH, 4))}, meta)])
                with open(os.path.join(folder, "fake.sent"), "a") as f:
                    f.write(peer.hex() + "\n")
    control.send_multipart(W.pack(W.Kind.BYE, role=1, sender=me))
    time.sleep(0.2)
    ctx.destroy(linger=0)
