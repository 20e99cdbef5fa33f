"""The server loop of distribution mode: one ROUTER socket, each batch to exactly one trainer.

`Distribution.run(producer)` reads credits, acks, heartbeats and BYEs from the trainers, hands
batches out as their credit allows (the bookkeeping is `credits.CreditBook`'s), sends epoch
e's END_OF_EPOCH once every batch of e is acknowledged (and no batch of e+1 before it), then
END_OF_STREAM after the last epoch, and waits up to `linger` seconds for the trainers' BYE.
A copy of every batch and marker goes to `publish` (the server's observers). The producer
wakes the loop through an inproc PAIR (`wake()`) when the loop waits for a batch.

Every message out carries the server's `instance` id. A trainer declared dead (silent past the
heartbeat timeout, or past the progress deadline: see `dispatch`) is fenced: its batches go to
the others, and whatever it says afterwards is answered FENCED (and otherwise ignored). A
HEARTBEAT with a probe token from a live trainer is answered at once with the same token: that
is how a client that stalled revalidates its lease before using what it holds.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable

import zmq

from crossfeed.errors import CrossfeedError, WireError
from crossfeed.net import protocol as P
from crossfeed.net.status import StatusGate, is_status, pack_answer, request_id
from crossfeed.net.stream.credits import CreditBook, Item
from crossfeed.net.stream.producer import EpochEnd, Producer, ProducerFailed, StreamEnd

logger = logging.getLogger(__name__)
_ids = itertools.count()
_MORE, _LAST = int(zmq.NOBLOCK | zmq.SNDMORE), int(zmq.NOBLOCK)


class Distribution:
    """The ROUTER side of one server; `run(producer)` on the loop thread, `wake()` from the producer's."""

    def __init__(
        self,
        ctx: zmq.Context,
        main: zmq.Socket,
        *,
        publish: Callable[[list], None],
        heartbeat: P.Heartbeat,
        max_credit: int,
        linger: float,
        stats: dict[str, int],
        stop: threading.Event,
        instance: int,
        progress_timeout: float | None = None,
        status: Callable[[], dict] | None = None,
    ):
        self._main, self._publish = main, publish
        self._status, self._status_gate = status, StatusGate()
        self._hb, self._linger = heartbeat, linger
        self._stats, self._stop = stats, stop
        self._instance = instance
        self._progress_timeout = progress_timeout
        self._disp = CreditBook(max_credit=max_credit, timeout=heartbeat.timeout, progress_timeout=progress_timeout)
        self._log = P.RateLimitedLog(logger)
        self._waiting = False  # the loop is about to block waiting for the producer
        wake = f"inproc://crossfeed-server-wake-{next(_ids)}"
        self._wake_rx = ctx.socket(zmq.PAIR)
        self._wake_rx.bind(wake)
        self._wake_tx = ctx.socket(zmq.PAIR)
        self._wake_tx.connect(wake)

    def trainers(self) -> int:
        """Live trainers (any thread may ask: one len())."""
        return len(self._disp.peers)

    def close(self) -> None:
        """Close the wake-up pair (the server closes the ROUTER socket)."""
        self._wake_tx.close(linger=0)
        self._wake_rx.close(linger=0)

    def wake(self) -> None:
        """Called on the producer thread after each put: wake the loop if it waits for one."""
        if self._waiting:
            self._waiting = False
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # a wake-up is already queued (or the server is closing)

    def _pack(self, kind: P.Kind, a: int = 0, b: int = 0, token: int = 0) -> bytes:
        return P.pack(kind, a, b, instance=self._instance, token=token)

    def _beat(self, probe: int = 0, peer: bytes = b"", now: float = 0.0) -> bytes:
        """A HEARTBEAT telling the trainers our silence timeout and progress deadline (ms); as
        the answer to `peer`'s `probe`, b is how long we will still wait for its next ack."""
        limit = self._progress_timeout
        budget = 0 if limit is None else int(limit * 1000)
        p = self._disp.peers.get(peer) if probe else None
        if p is not None and p.unacked and limit is not None:
            budget = max(int((limit - (now - p.progress_at)) * 1000), 1)
        return self._pack(P.Kind.HEARTBEAT, int(self._hb.timeout * 1000), budget, probe)

    def run(self, producer: Producer) -> None:
        hb, disp = self._hb, self._disp
        poller = zmq.Poller()
        poller.register(self._main, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        idle_ms = int(min(hb.interval / 2, 0.1) * 1000)
        epoch_end: EpochEnd | None = None
        ending_at: float | None = None
        next_beat = 0.0
        while not self._stop.is_set():
            starving = disp.demand() > 0 and epoch_end is None and ending_at is None
            # waiting for the producer: it wakes us (see wake) as soon as it has a batch
            self._waiting = starving
            timeout = 0 if starving and not producer.queue.empty() else idle_ms
            ready = dict(poller.poll(timeout))
            self._waiting = False
            if self._wake_rx in ready:
                self._drain_wakeups()
            if self._main in ready:
                self._receive(ending_at is not None)
            now = time.monotonic()
            self._stats["fenced"] += len(disp.expire(now))
            while epoch_end is None and ending_at is None and disp.demand() > 0:
                msg = self._next_from(producer)
                if msg is None:
                    break
                if isinstance(msg, Item):
                    disp.pending.append(msg)
                    self._publish([self._pack(P.Kind.BATCH, msg.seq, msg.epoch), *msg.frames])
                elif isinstance(msg, EpochEnd):
                    epoch_end = msg
                elif isinstance(msg, StreamEnd):
                    self._end_stream(msg.epochs)
                    ending_at = now + self._linger
            while (assigned := disp.assign(now)) is not None:
                peer, item = assigned
                batch = self._pack(P.Kind.BATCH, item.seq, item.epoch, token=item.lease)
                if self._to_peer(peer, [batch, *item.frames], item):
                    self._stats["sent"] += 1
            if epoch_end is not None and disp.in_flight() == 0:
                self._end_epoch(epoch_end)
                epoch_end = None
            if now >= next_beat:
                next_beat = now + hb.interval
                beat = self._beat()
                for peer in list(disp.peers):
                    self._to_peer(peer, [beat])
                self._publish([beat])
            if ending_at is not None and (not disp.peers or now > ending_at):
                return

    def _next_from(self, producer: Producer) -> object | None:
        try:
            msg = producer.queue.get_nowait()
        except queue.Empty:
            return None
        if isinstance(msg, ProducerFailed):
            self._end_stream(self._stats["epochs"], failed=True)
            raise CrossfeedError(f"the batch source failed: {msg.message}")
        return msg

    def _to_peer(self, peer: bytes, frames: list, item: Item | None = None) -> bool:
        send = self._main.send
        try:
            # send_multipart, minus its per-frame enum arithmetic (it shows at 10k+ msg/s)
            send(peer, _MORE)
            for frame in frames[:-1]:
                send(frame, _MORE, copy=False)
            send(frames[-1], _LAST, copy=False)
            return True
        except zmq.ZMQError as e:
            # not declared dead for this: its connection may come back under the same identity,
            # and its client counts on silence (or the progress deadline) before that happens
            logger.debug("could not send to trainer %s: %s", peer.hex(), e.strerror)
            self._disp.unreachable(peer, item)
            return False

    def _drain_wakeups(self) -> None:
        while True:
            try:
                self._wake_rx.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def _receive(self, ended: bool) -> None:
        for _ in range(1000):  # bounded, so heartbeats and sends still get their turn
            try:
                frames = P.recv_bounded(self._main, max_frames=3, max_bytes=4096)
            except zmq.Again:
                return
            except WireError as e:
                self._stats["dropped_messages"] += 1
                self._log.warning("bad", "dropped a malformed message from a client: %s", e)
                continue
            try:
                self._handle(frames, ended)
            except WireError as e:
                self._stats["dropped_messages"] += 1
                self._log.warning("bad", "dropped a malformed message from a client: %s", e)

    def _handle(self, frames: list, ended: bool) -> None:
        if len(frames) < 2:
            raise WireError("control message has no frames")
        peer = frames[0].bytes
        if is_status(frames[1]):  # `crossfeed top` asks: answered whoever asks, at most RATE a second
            rid = request_id(frames[1:])
            if self._status is not None and self._status_gate.allow(time.monotonic()):
                self._to_peer(peer, pack_answer(rid, self._status()))
            return
        env = P.unpack(frames[1], P.CLIENT_KINDS)
        if len(frames) != (3 if env.kind is P.Kind.ACKS else 2):
            raise WireError(f"{env.kind.name} message has {len(frames) - 1} frames")
        disp, now = self._disp, time.monotonic()
        if disp.is_dead(peer) or (peer not in disp.peers and env.kind is not P.Kind.CREDIT):
            # declared dead (or dead and forgotten): only a CREDIT on a new identity joins
            logger.debug("fenced %s from trainer %s, not a live trainer", env.kind.name, peer.hex())
            if env.kind is not P.Kind.BYE:  # one answer per message: it cannot amplify
                self._to_peer(peer, [self._pack(P.Kind.FENCED, token=env.token)])
            return
        if env.kind is P.Kind.CREDIT:
            disp.credit(peer, env.a, now, env.b)
            if ended:
                self._to_peer(peer, [self._pack(P.Kind.END_OF_STREAM, self._stats["epochs"])])
            self._to_peer(peer, [self._beat(probe=env.token, peer=peer, now=now)])
        elif env.kind is P.Kind.ACK or env.kind is P.Kind.ACKS:
            seqs = P.unpack_acks(env, frames[2]) if env.kind is P.Kind.ACKS else (env.a,)
            disp.seen(peer, now)
            for seq in seqs:
                if (item := disp.ack(peer, seq)) is not None:
                    self._stats["acked"] += 1
                    self._stats["delivered"] += 1
                    self._stats["samples"] += item.num_samples
                    self._stats["bytes"] += item.nbytes
                else:
                    logger.debug("ack of unknown batch %d from %s", seq, peer.hex())
        elif env.kind is P.Kind.HEARTBEAT:
            disp.seen(peer, now)
            if env.token:  # a lease probe: "am I still a live trainer of yours?"
                self._to_peer(peer, [self._beat(probe=env.token, peer=peer, now=now)])
        elif env.kind is P.Kind.BYE:
            disp.leave(peer)

    def _end_epoch(self, end: EpochEnd) -> None:
        marker = self._pack(P.Kind.END_OF_EPOCH, end.epoch, end.batches)
        for peer in list(self._disp.peers):
            self._to_peer(peer, [marker])
        self._publish([marker])
        self._stats["epochs"] += 1
        logger.info("epoch %d done: %d batches delivered and acknowledged", end.epoch, end.batches)

    def _end_stream(self, epochs: int, failed: bool = False) -> None:
        """END_OF_STREAM to everyone; b=1 tells them the server failed (what is missing is lost)."""
        marker = self._pack(P.Kind.END_OF_STREAM, epochs, int(failed))
        for peer in list(self._disp.peers):
            self._to_peer(peer, [marker])
        self._publish([marker])
        if not failed:
            logger.info("stream ended after %d epochs", epochs)
