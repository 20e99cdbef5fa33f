"""A batch server: a Producer thread makes batches, one loop thread owns the sockets.

Distribution (default): ROUTER; each batch goes to exactly one trainer (see `dispatch`).
Epoch e's END_OF_EPOCH goes out once every batch of e is acknowledged, and no batch of e+1
leaves before it. With a finite `epochs`, END_OF_STREAM follows the last epoch.
Broadcast: PUB; every subscriber sees the stream; lossy when a subscriber falls behind.
In both modes the `broadcast` addresses (PUB) carry a copy of every batch for observers.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import queue
import socket
import threading
import time

import itertools

import zmq

from crossfeed.errors import ConfigError, CrossfeedError, WireError
from crossfeed.net import protocol as P
from crossfeed.net.addresses import expand_all
from crossfeed.net.dispatch import Dispatcher, Item
from crossfeed.net.keys import ServerKeys, secure_server_socket, start_authenticator
from crossfeed.net.producer import BatchFactory, EpochEnd, Producer, ProducerFailed, StreamEnd

logger = logging.getLogger(__name__)
_ids = itertools.count()
_MORE, _LAST = int(zmq.NOBLOCK | zmq.SNDMORE), int(zmq.NOBLOCK)


class Mode(str, enum.Enum):
    DISTRIBUTE = "distribute"
    BROADCAST = "broadcast"


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    addresses: tuple[str, ...]
    broadcast: tuple[str, ...] = ()
    mode: Mode = Mode.DISTRIBUTE
    epochs: int | None = None
    start_epoch: int = 0
    max_credit: int = 64
    prefetch: int = 32  # encoded batches made ahead of demand, at most `prefetch_bytes` of them
    prefetch_bytes: int = 64 << 20  # (but for the first); 0: no byte bound
    pub_hwm: int = 8
    heartbeat: P.Heartbeat = P.Heartbeat()
    linger: float = 5.0  # after END_OF_STREAM, how long to wait for trainers to say BYE
    server_id: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "addresses", tuple(expand_all(self.addresses)))
        if self.broadcast:
            object.__setattr__(self, "broadcast", tuple(expand_all(self.broadcast)))
        object.__setattr__(self, "mode", Mode(self.mode))
        if self.epochs is not None and self.epochs < 1:
            raise ConfigError(f"epochs must be >= 1 or None (until stopped), got {self.epochs}")
        if self.max_credit < 1 or self.prefetch < 1 or self.pub_hwm < 1:
            raise ConfigError("max_credit, prefetch and pub_hwm must be >= 1")
        if self.prefetch_bytes < 0:
            raise ConfigError(f"prefetch_bytes must be >= 0 (0: no byte bound), got {self.prefetch_bytes}")
        if not self.server_id:
            object.__setattr__(self, "server_id", f"{socket.gethostname()}:{os.getpid()}")


class Server:
    """`with Server(factory, options) as s: s.wait()`; `s.endpoints` are the bound addresses."""

    def __init__(self, factory: BatchFactory, options: ServerOptions, *, keys: ServerKeys | None = None):
        self.options = options
        self._factory = factory
        self._keys = keys
        self._ctx = zmq.Context()
        self._auth = None
        self._stop = threading.Event()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._log = P.RateLimitedLog(logger)
        self.endpoints: list[str] = []
        self.broadcast_endpoints: list[str] = []
        self.stats = {"sent": 0, "acked": 0, "dropped_messages": 0, "epochs": 0}
        self._waiting = False  # the loop is about to block waiting for the producer

    # ---- lifecycle ----
    def start(self) -> Server:
        try:
            if self._keys is not None:
                self._auth = start_authenticator(self._ctx, self._keys)
            main_type = zmq.ROUTER if self.options.mode is Mode.DISTRIBUTE else zmq.PUB
            self._main = self._bind(main_type, self.options.addresses, self.endpoints)
            self._pub = None
            if self.options.broadcast:
                self._pub = self._bind(zmq.PUB, self.options.broadcast, self.broadcast_endpoints)
        except BaseException:
            self._teardown()
            raise
        # the producer wakes the loop through this pair when the loop waits for a batch
        wake = f"inproc://crossfeed-server-wake-{next(_ids)}"
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_rx.bind(wake)
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        self._wake_tx.connect(wake)
        self._producer = Producer(
            self._factory, server_id=self.options.server_id, epochs=self.options.epochs,
            start_epoch=self.options.start_epoch, prefetch=self.options.prefetch,
            prefetch_bytes=self.options.prefetch_bytes, on_put=self._wake_loop,
        ).start()
        self._thread = threading.Thread(target=self._loop, name="crossfeed-server", daemon=True)
        self._thread.start()
        return self

    def _bind(self, kind: int, addresses: tuple[str, ...], out: list[str]) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.linger = 500
        secure_server_socket(sock, self._keys)
        if kind == zmq.ROUTER:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.MAXMSGSIZE, 4096)  # we only ever receive control messages
        else:
            sock.sndhwm = self.options.pub_hwm
        for a in addresses:
            try:
                sock.bind(P.bind_address(a))
            except zmq.ZMQError as e:
                sock.close(linger=0)
                raise ConfigError(f"cannot bind {a}: {e}") from e
            out.append(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        return sock

    def wait(self, timeout: float | None = None) -> bool:
        """True once the server has finished (stream ended, stopped or failed)."""
        return self._done.wait(timeout)

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise CrossfeedError(f"server {self.options.server_id} failed: {self._error}") from self._error

    def close(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("server loop did not stop within %.1fs", timeout)
        elif self._thread is None:
            self._teardown()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _teardown(self) -> None:
        if self._ctx.closed:
            return
        producer = getattr(self, "_producer", None)
        if producer is not None:
            producer.stop()
        for name in ("_main", "_pub", "_wake_tx", "_wake_rx"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close(linger=0 if name.startswith("_wake") else None)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()
        self._done.set()

    def _loop(self) -> None:
        try:
            if self.options.mode is Mode.DISTRIBUTE:
                self._distribute()
            else:
                self._broadcast()
        except BaseException as e:  # reported by raise_if_failed(), never swallowed
            self._error = e
            logger.error("server %s failed: %s", self.options.server_id, e)
        finally:
            self._teardown()

    # ---- sending helpers ----
    def _publish(self, frames: list) -> None:
        for sock in (self._pub, self._main if self.options.mode is Mode.BROADCAST else None):
            if sock is not None:
                try:
                    sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    pass  # broadcast is lossy by design

    def _to_peer(self, peer: bytes, frames: list) -> bool:
        send = self._main.send
        try:
            # send_multipart, minus its per-frame enum arithmetic (it shows at 10k+ msg/s)
            send(peer, _MORE)
            for frame in frames[:-1]:
                send(frame, _MORE, copy=False)
            send(frames[-1], _LAST, copy=False)
            return True
        except zmq.ZMQError as e:
            self._disp.kill(peer, f"unreachable ({e.strerror})")
            return False

    def _wake_loop(self) -> None:
        """Called on the producer thread after each put: wake the loop if it waits for one."""
        if self._waiting:
            self._waiting = False
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # a wake-up is already queued (or the server is closing)

    def _next_from_producer(self) -> object | None:
        try:
            msg = self._producer.queue.get_nowait()
        except queue.Empty:
            return None
        if isinstance(msg, ProducerFailed):
            self._end_stream(self.stats["epochs"], failed=True)
            raise CrossfeedError(f"the batch source failed: {msg.message}")
        return msg

    # ---- distribution ----
    def _distribute(self) -> None:
        hb = self.options.heartbeat
        self._disp = disp = Dispatcher(max_credit=self.options.max_credit, timeout=hb.timeout)
        poller = zmq.Poller()
        poller.register(self._main, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        idle_ms = int(min(hb.interval / 2, 0.1) * 1000)
        epoch_end: EpochEnd | None = None
        ending_at: float | None = None
        next_beat = 0.0
        while not self._stop.is_set():
            starving = disp.demand() > 0 and epoch_end is None and ending_at is None
            # waiting for the producer: it wakes us (see _wake_loop) as soon as it has a batch
            self._waiting = starving
            timeout = 0 if starving and not self._producer.queue.empty() else idle_ms
            ready = dict(poller.poll(timeout))
            self._waiting = False
            if self._wake_rx in ready:
                self._drain_wakeups()
            if self._main in ready:
                self._receive(ending_at is not None)
            now = time.monotonic()
            disp.expire(now)
            while epoch_end is None and ending_at is None and disp.demand() > 0:
                msg = self._next_from_producer()
                if msg is None:
                    break
                if isinstance(msg, Item):
                    disp.pending.append(msg)
                    self._publish([P.pack(P.Kind.BATCH, msg.seq, msg.epoch), *msg.frames])
                elif isinstance(msg, EpochEnd):
                    epoch_end = msg
                elif isinstance(msg, StreamEnd):
                    self._end_stream(msg.epochs)
                    ending_at = now + self.options.linger
            while (assigned := disp.assign()) is not None:
                peer, item = assigned
                if self._to_peer(peer, [P.pack(P.Kind.BATCH, item.seq, item.epoch), *item.frames]):
                    self.stats["sent"] += 1
            if epoch_end is not None and disp.in_flight() == 0:
                self._end_epoch(epoch_end)
                epoch_end = None
            if now >= next_beat:
                next_beat = now + hb.interval
                beat = P.pack(P.Kind.HEARTBEAT)
                for peer in list(disp.peers):
                    self._to_peer(peer, [beat])
                self._publish([beat])
            if ending_at is not None and (not disp.peers or now > ending_at):
                return

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
                self.stats["dropped_messages"] += 1
                self._log.warning("bad", "dropped a malformed message from a client: %s", e)
                continue
            try:
                self._handle(frames, ended)
            except WireError as e:
                self.stats["dropped_messages"] += 1
                self._log.warning("bad", "dropped a malformed message from a client: %s", e)

    def _handle(self, frames: list, ended: bool) -> None:
        if len(frames) < 2:
            raise WireError("control message has no frames")
        peer = frames[0].bytes
        env = P.unpack(frames[1], P.CLIENT_KINDS)
        if len(frames) != (3 if env.kind is P.Kind.ACKS else 2):
            raise WireError(f"{env.kind.name} message has {len(frames) - 1} frames")
        disp, now = self._disp, time.monotonic()
        if disp.is_dead(peer):
            logger.debug("ignored %s from trainer %s, declared dead", env.kind.name, peer.hex())
            return
        if env.kind is P.Kind.CREDIT or (env.kind is P.Kind.HEARTBEAT and peer not in disp.peers):
            # a HEARTBEAT carries the credit too, so a client that reconnected resumes
            disp.credit(peer, env.a, now, env.b)
            if ended:
                self._to_peer(peer, [P.pack(P.Kind.END_OF_STREAM, self.stats["epochs"])])
        elif env.kind is P.Kind.ACK or env.kind is P.Kind.ACKS:
            seqs = P.unpack_acks(env, frames[2]) if env.kind is P.Kind.ACKS else (env.a,)
            disp.seen(peer, now)
            for seq in seqs:
                if disp.ack(peer, seq) is not None:
                    self.stats["acked"] += 1
                else:
                    logger.debug("ack of unknown batch %d from %s", seq, peer.hex())
        elif env.kind is P.Kind.HEARTBEAT:
            disp.seen(peer, now)
        elif env.kind is P.Kind.BYE:
            disp.leave(peer)

    def _end_epoch(self, end: EpochEnd) -> None:
        marker = P.pack(P.Kind.END_OF_EPOCH, end.epoch, end.batches)
        for peer in list(self._disp.peers):
            self._to_peer(peer, [marker])
        self._publish([marker])
        self.stats["epochs"] += 1
        logger.info("epoch %d done: %d batches delivered and acknowledged", end.epoch, end.batches)

    def _end_stream(self, epochs: int, failed: bool = False) -> None:
        """END_OF_STREAM to everyone; b=1 tells them the server failed (what is missing is lost)."""
        marker = P.pack(P.Kind.END_OF_STREAM, epochs, int(failed))
        for peer in list(self._disp.peers) if self.options.mode is Mode.DISTRIBUTE else []:
            self._to_peer(peer, [marker])
        self._publish([marker])
        if not failed:
            logger.info("stream ended after %d epochs", epochs)

    # ---- broadcast ----
    def _broadcast(self) -> None:
        hb = self.options.heartbeat
        next_beat = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + hb.interval
                self._publish([P.pack(P.Kind.HEARTBEAT)])
            try:
                msg = self._producer.queue.get(timeout=min(hb.interval / 2, 0.1))
            except queue.Empty:
                continue
            if isinstance(msg, ProducerFailed):
                self._end_stream(self.stats["epochs"], failed=True)
                raise CrossfeedError(f"the batch source failed: {msg.message}")
            if isinstance(msg, Item):
                self._publish([P.pack(P.Kind.BATCH, msg.seq, msg.epoch), *msg.frames])
                self.stats["sent"] += 1
            elif isinstance(msg, EpochEnd):
                self._publish([P.pack(P.Kind.END_OF_EPOCH, msg.epoch, msg.batches)])
                self.stats["epochs"] += 1
            elif isinstance(msg, StreamEnd):
                self._end_stream(msg.epochs)
                self._stop.wait(min(self.options.linger, 1.0))  # let PUB flush the marker
                return
