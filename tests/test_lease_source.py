"""`LeaseSource` (the producing side of `serve --dispatcher`) against a scripted dispatcher on a
real ROUTER socket: a batch the executor is building when its lease goes void (RESET) is built
but never offered; the leases after the rejoin are served."""

from __future__ import annotations

import json
import queue
import threading
import time

import pytest
import zmq

import crossfeed
from crossfeed.net.lease import messages as W
from crossfeed.net.lease.source import LeaseSource
from crossfeed.net.protocol import Heartbeat
from crossfeed.net.stream.producer import StreamEnd
from crossfeed.read.loader import Loader
from crossfeed.read.options import LoaderOptions

pytestmark = pytest.mark.timeout(60)

N, BATCH, INSTANCE = 16, 4, 77


class Gate:
    """A transform that holds the batch holding sample label 0 until released."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, sample: dict) -> dict:
        if int(sample["label"]) == 0:
            self.entered.set()
            assert self.release.wait(30), "the test never released the gate"
        return sample


class Dispatcher:
    """A ROUTER that speaks the dispatcher's side by hand."""

    def __init__(self, ctx: zmq.Context):
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.bind("tcp://127.0.0.1:*")
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def hello(self, not_from: int = 0) -> tuple[bytes, int]:
        """Wait for a HELLO from a sender other than `not_from`: (route, sender)."""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.sock.poll(100):
                route, *frames = self.sock.recv_multipart()
                msg = W.unpack(frames, W.SERVER_KINDS)
                if msg.kind is W.Kind.HELLO and msg.sender != not_from:
                    return route, msg.sender
        raise AssertionError("no HELLO from the lease source")

    def send(self, route: bytes, kind: W.Kind, payload=None, **slots) -> None:
        self.sock.send_multipart([route, *W.pack(kind, instance=INSTANCE, payload=payload, **slots)])


def take(source: LeaseSource):
    try:
        return source.queue.get(timeout=20)
    except queue.Empty:
        raise AssertionError("the lease source offered nothing") from None


def test_a_batch_of_a_lease_voided_while_it_is_built_is_dropped(tmp_path):
    path = str(tmp_path / "ds")
    crossfeed.write_dataset(path, ({"label": i} for i in range(N)), num_shards=1).close()
    gate = Gate()
    plan = {"split": "train", "batch_size": BATCH, "shuffle": "none", "seed": 0, "world_size": 1}

    def make_loader(p: dict) -> Loader:
        opts = LoaderOptions.of(
            split=p["split"], batch_size=p["batch_size"], shuffle=p["shuffle"], seed=p["seed"], num_threads=1
        )
        return Loader(path, opts.replace(return_index=True), transform=gate)

    ctx = zmq.Context()
    d = Dispatcher(ctx)
    source = LeaseSource(
        d.address, make_loader, ["tcp://127.0.0.1:1"], server_id="s", heartbeat=Heartbeat(0.05, 5.0)
    ).start()
    try:
        batches = N // BATCH
        route, first = d.hello()
        d.send(route, W.Kind.WELCOME, batches=batches, payload=json.dumps(plan))
        d.send(
            route, W.Kind.LEASE, lease=1, epoch=0, batches=batches, payload=[[0, 101]]
        )  # lease 1: batch 0 (labels 0..3)
        assert gate.entered.wait(20), "batch 0 was never built"
        d.send(route, W.Kind.RESET)  # lease 1 is void while batch 0 is in the executor
        route, _second = d.hello(not_from=first)  # it rejoined under a new id
        gate.release.set()
        d.send(route, W.Kind.WELCOME, batches=batches, payload=json.dumps(plan))
        d.send(
            route, W.Kind.LEASE, lease=2, epoch=0, batches=batches, payload=[[2, 202], [1, 201]]
        )  # (batch, claim token) pairs
        items = [take(source), take(source)]
        # each batch goes out with its claim token (Item.lease: the BATCH envelope's token)
        assert [(it.lease, it.seq) for it in items] == [(202, 2), (201, 1)], "a batch of the void lease was offered"
        assert source.stats["dropped"] == 1 and source.stats["resets"] == 1
        d.send(route, W.Kind.FINISHED)
        assert isinstance(take(source), StreamEnd)
    finally:
        gate.release.set()
        source.stop()
        ctx.destroy(linger=0)
    assert source.queue.empty()
    assert source.stats["built"] == 3


def test_batches_taken_back_are_not_built(tmp_path):
    """TAKEN (the dispatcher gave those batches of a lease to a faster server): they leave the
    source's queue of work unbuilt; the lease's other batches are built and offered."""
    path = str(tmp_path / "ds")
    n = 32 * BATCH
    crossfeed.write_dataset(path, ({"label": i} for i in range(n)), num_shards=1).close()
    gate = Gate()
    plan = {"split": "train", "batch_size": BATCH, "shuffle": "none", "seed": 0, "world_size": 1}

    def make_loader(p: dict) -> Loader:
        opts = LoaderOptions.of(split=p["split"], batch_size=p["batch_size"], shuffle=p["shuffle"], num_threads=1)
        return Loader(path, opts.replace(return_index=True), transform=gate)

    ctx = zmq.Context()
    d = Dispatcher(ctx)
    source = LeaseSource(
        d.address, make_loader, ["tcp://127.0.0.1:1"], server_id="s", heartbeat=Heartbeat(0.05, 5.0)
    ).start()
    try:
        route, _ = d.hello()
        d.send(route, W.Kind.WELCOME, batches=32, payload=json.dumps(plan))
        d.send(route, W.Kind.LEASE, lease=5, epoch=0, batches=32, payload=[[b, 100 + b] for b in range(32)])
        assert gate.entered.wait(20), "batch 0 was never built"  # the rest wait behind it
        d.send(route, W.Kind.TAKEN, lease=5, payload=list(range(24, 32)))
        d.send(route, W.Kind.TAKEN, lease=6, payload=[0, 1])  # another lease's: nothing of ours
        deadline = time.monotonic() + 20
        while source.stats["taken_back"] < 8 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert source.stats["taken_back"] == 8, source.stats
        gate.release.set()
        seqs = [take(source).seq for _ in range(24)]
        assert seqs == list(range(24))
        d.send(route, W.Kind.FINISHED)
        assert isinstance(take(source), StreamEnd)
    finally:
        gate.release.set()
        source.stop()
        ctx.destroy(linger=0)
    assert source.stats["built"] == 24
