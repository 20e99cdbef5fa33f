"""The client's I/O thread: one socket per server, heartbeats both ways, acks forwarded.

Puts on `events`, in arrival order:
    Delivery(server, meta, batch)      a decoded batch (arrays view the received frames)
    EpochDone(server, epoch, batches)  that server's END_OF_EPOCH
    AllDone()                          every server has ended or been dropped
    ReceiverFailed(message)            the thread itself broke; nothing follows
The user thread sends acks through `ack()`; a batch is acked once it has been consumed.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import struct
import threading
import time
from typing import Any

import zmq

from crossfeed import wire
from crossfeed.errors import WireError
from crossfeed.net import protocol as P
from crossfeed.net.keys import ClientKeys, secure_client_socket

logger = logging.getLogger(__name__)

_CMD = struct.Struct("<Biq")
_ACK, _CLOSE = 1, 2
_ids = itertools.count()


@dataclasses.dataclass(frozen=True)
class Delivery:
    server: int
    meta: wire.BatchMeta
    batch: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class EpochDone:
    server: int
    epoch: int
    batches: int


@dataclasses.dataclass(frozen=True)
class AllDone:
    pass


@dataclasses.dataclass(frozen=True)
class ReceiverFailed:
    message: str


@dataclasses.dataclass(frozen=True)
class LostServer:
    """What a client knows about a server it dropped."""

    address: str
    reason: str
    received_batches: int
    received_samples: int
    unacked_batches: int
    last_epoch: int | None
    last_seq: int | None


@dataclasses.dataclass
class _Link:
    address: str
    sock: zmq.Socket
    started: float
    last_seen: float = 0.0
    heard: bool = False
    state: str = "live"  # live | ended | lost
    received: int = 0
    samples: int = 0
    last_epoch: int | None = None
    last_seq: int | None = None
    unacked: set[int] = dataclasses.field(default_factory=set)


class Receiver:
    def __init__(
        self,
        addresses: list[str],
        *,
        keys: ClientKeys | None,
        credits: int,
        broadcast: bool,
        heartbeat: P.Heartbeat,
        connect_timeout: float,
        limits: wire.WireLimits,
    ):
        self.addresses = addresses
        self._keys, self._credits, self._broadcast = keys, credits, broadcast
        self._hb, self._connect_timeout, self._limits = heartbeat, connect_timeout, limits
        self._buffer = 8 if broadcast else credits * len(addresses) + 1
        self.events: queue.Queue[Any] = queue.Queue()
        self.lost: list[LostServer] = []
        self.dropped_messages = 0
        self._log = P.RateLimitedLog(logger)
        self._ctx = zmq.Context()
        self._cmd_address = f"inproc://crossfeed-client-{next(_ids)}"
        self._cmd_in = self._ctx.socket(zmq.PAIR)
        self._cmd_in.bind(self._cmd_address)
        self._cmd_out = self._ctx.socket(zmq.PAIR)
        self._cmd_out.connect(self._cmd_address)
        self._cmd_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="crossfeed-client", daemon=True)
        self._closed = False

    def start(self) -> Receiver:
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def ack(self, server: int, seq: int) -> None:
        with self._cmd_lock:
            if not self._closed:
                self._cmd_out.send(_CMD.pack(_ACK, server, seq))

    def close(self, timeout: float = 5.0) -> None:
        with self._cmd_lock:
            if self._closed:
                return
            self._closed = True
            if self._thread.is_alive():
                self._cmd_out.send(_CMD.pack(_CLOSE, 0, 0))
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("client I/O thread did not stop within %.1fs", timeout)
        self._cmd_out.close(linger=0)
        if not self._thread.is_alive():
            self._cmd_in.close(linger=0)
            self._ctx.term()

    # ---- the I/O thread ----
    def _open(self, address: str, now: float) -> _Link:
        sock = self._ctx.socket(zmq.SUB if self._broadcast else zmq.DEALER)
        sock.linger = 500
        sock.setsockopt(zmq.MAXMSGSIZE, self._limits.max_message_bytes)
        sock.rcvhwm = self._buffer if self._broadcast else 1000
        secure_client_socket(sock, self._keys)
        if self._broadcast:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(address)
        if not self._broadcast:
            sock.send(P.pack(P.Kind.CREDIT, self._credits))
        return _Link(address=address, sock=sock, started=now)

    def _run(self) -> None:
        links: list[_Link] = []
        try:
            now = time.monotonic()
            links = [self._open(a, now) for a in self.addresses]
            self._loop(links)
        except Exception as e:  # crosses to the user thread wrapped
            logger.exception("client I/O thread failed")
            self.events.put(ReceiverFailed(f"{type(e).__name__}: {e}"))
        finally:
            for link in links:
                if link.state == "live" and not self._broadcast:
                    self._send(link, P.pack(P.Kind.BYE))
                link.sock.close(linger=500 if link.state == "live" else 0)

    def _send(self, link: _Link, msg: bytes) -> None:
        try:
            link.sock.send(msg, zmq.NOBLOCK)
        except zmq.ZMQError as e:
            logger.debug("could not send to %s: %s", link.address, e)

    def _loop(self, links: list[_Link]) -> None:
        hb = self._hb
        next_beat = 0.0
        done_signalled = False
        while True:
            poller = zmq.Poller()
            poller.register(self._cmd_in, zmq.POLLIN)
            room = self.events.qsize() < self._buffer
            by_sock = {}
            for i, link in enumerate(links):
                if link.state == "live" and room:
                    poller.register(link.sock, zmq.POLLIN)
                    by_sock[link.sock] = i
            ready = dict(poller.poll(int(min(hb.interval / 2, 0.1) * 1000)))
            if self._cmd_in in ready and self._commands(links):
                return
            for sock, i in by_sock.items():
                if sock in ready:
                    self._drain(i, links[i])
            now = time.monotonic()
            if now >= next_beat and not self._broadcast:
                next_beat = now + hb.interval
                for link in links:
                    if link.state == "live":
                        self._send(link, P.pack(P.Kind.HEARTBEAT, self._credits))
            for link in links:
                if link.state == "live":
                    self._check_alive(link, now)
            if not done_signalled and all(link.state != "live" for link in links):
                done_signalled = True
                self.events.put(AllDone())

    def _commands(self, links: list[_Link]) -> bool:
        """Forward queued acks; True when asked to close."""
        while True:
            try:
                op, server, seq = _CMD.unpack(self._cmd_in.recv(zmq.NOBLOCK))
            except zmq.Again:
                return False
            if op == _CLOSE:
                return True
            link = links[server]
            link.unacked.discard(seq)
            if link.state == "live":
                self._send(link, P.pack(P.Kind.ACK, seq))

    def _check_alive(self, link: _Link, now: float) -> None:
        if link.heard and now - link.last_seen > self._hb.timeout:
            self._lose(link, f"silent for more than {self._hb.timeout:g}s")
        elif not link.heard and now - link.started > self._connect_timeout:
            self._lose(link, f"no answer within {self._connect_timeout:g}s of connecting")

    def _lose(self, link: _Link, reason: str) -> None:
        link.state = "lost"
        info = LostServer(
            address=link.address, reason=reason, received_batches=link.received,
            received_samples=link.samples, unacked_batches=len(link.unacked),
            last_epoch=link.last_epoch, last_seq=link.last_seq,
        )
        self.lost.append(info)
        logger.warning(
            "server %s dropped (%s): %d of its batches were outstanding (received, not yet "
            "acknowledged); received %d batches / %d samples from it, last epoch %s seq %s; "
            "what it had not sent yet is lost to this client",
            link.address, reason, info.unacked_batches, link.received, link.samples,
            link.last_epoch, link.last_seq,
        )

    def _drain(self, index: int, link: _Link) -> None:
        for _ in range(self._buffer + 16):
            try:
                frames = P.recv_bounded(
                    link.sock, self._limits.max_frames + 1, self._limits.max_message_bytes
                )
            except zmq.Again:
                return
            except WireError as e:
                self._bad(link, e)
                continue
            try:
                self._handle(index, link, frames)
            except WireError as e:
                self._bad(link, e)
            if link.state != "live" or self.events.qsize() >= self._buffer:
                return

    def _bad(self, link: _Link, error: WireError) -> None:
        self.dropped_messages += 1
        self._log.warning(link.address, "dropped a malformed message from %s: %s", link.address, error)

    def _handle(self, index: int, link: _Link, frames: list) -> None:
        env = P.unpack(frames[0], P.SERVER_KINDS)
        if env.kind is P.Kind.BATCH:
            meta, batch = wire.decode(frames[1:], self._limits)
            if meta.seq != env.a or meta.epoch != env.b:
                raise WireError(f"envelope says seq {env.a} epoch {env.b}, batch says {meta.seq} {meta.epoch}")
        elif len(frames) != 1:
            raise WireError(f"{env.kind.name} carries {len(frames) - 1} unexpected frames")
        link.last_seen, link.heard = time.monotonic(), True
        if env.kind is P.Kind.BATCH:
            link.received += 1
            link.samples += meta.num_samples
            link.last_epoch, link.last_seq = meta.epoch, meta.seq
            if not self._broadcast:
                link.unacked.add(meta.seq)
            self.events.put(Delivery(index, meta, batch))
        elif env.kind is P.Kind.END_OF_EPOCH:
            self.events.put(EpochDone(index, env.a, env.b))
        elif env.kind is P.Kind.END_OF_STREAM:
            if not self._broadcast:
                self._send(link, P.pack(P.Kind.BYE))
            if env.b:
                self._lose(link, "the server reported that its batch source failed")
            else:
                link.state = "ended"
                logger.info("server %s ended its stream after %d epochs", link.address, env.a)
