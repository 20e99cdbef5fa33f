"""A batch server: a Producer thread makes batches, one loop thread owns the sockets.

This module holds the server's options, its lifecycle (sockets, producer, loop thread) and its
PUB side; the ROUTER loop of distribution mode is `crossfeed.net.stream.distribute`.
Distribution (default): ROUTER; each batch goes to exactly one trainer (see `distribute`).
Epoch e's END_OF_EPOCH goes out once every batch of e is acknowledged, and no batch of e+1
leaves before it. With a finite `epochs`, END_OF_STREAM follows the last epoch.
Broadcast: PUB; every subscriber sees the stream; lossy when a subscriber falls behind.
In both modes the `broadcast` addresses (PUB) carry a copy of every batch for observers.

Security: without CURVE keys a server binds only addresses that no other machine can reach
(ipc://, loopback tcp) unless `insecure=True` says the network is trusted. An unauthenticated
peer can make libzmq buffer an unbounded multipart message below us, and can abort the process
through a ROUTER routing-id collision; with CURVE, the handshake (ZAP) rejects it before any frame.
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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from crossfeed.config import parse_size
from crossfeed.errors import ConfigError, CrossfeedError
from crossfeed.net import protocol as P
from crossfeed.net.addresses import expand_all, is_local
from crossfeed.net.keys import ServerKeys, secure_server_socket, start_authenticator
from crossfeed.net.status import loader_stats
from crossfeed.net.stream.credits import Item
from crossfeed.net.stream.distribute import Distribution
from crossfeed.net.stream.producer import BatchFactory, EpochEnd, Producer, ProducerFailed, StreamEnd

if TYPE_CHECKING:
    from zmq.auth.thread import ThreadAuthenticator

logger = logging.getLogger(__name__)


def seed_routing_ids() -> None:
    """Make the routing ids libzmq gives anonymous peers unguessable.

    A ROUTER numbers the peers that present no routing id of their own consecutively from a start
    it draws with the C library's ``rand()`` when the socket is made, and nothing seeds it: every
    server's first id is ``00 6b8b4567``. A peer that squats the id that comes next and then
    makes another connection with none aborts libzmq 4.3.5 (a collision assertion). crossfeed
    trainers present random ids of their own, so only anonymous peers draw from this sequence;
    seeding ``rand()`` from the OS's randomness before each ROUTER is made makes the next id a
    32-bit guess (the process-global ``rand()`` is used by nothing else in crossfeed). See the
    README's Security section for what remains."""
    import ctypes
    import ctypes.util
    import secrets

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        libc.srand(ctypes.c_uint(secrets.randbits(32)))
    except (OSError, AttributeError):  # no C library to reach: ids stay libzmq's defaults
        logger.warning(
            "could not seed the C library's rand(): libzmq's routing ids for anonymous peers stay predictable"
        )


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
    prefetch_bytes: int = (
        64 << 20
    )  # given as bytes or a size; (but for the first), or a size such as "64MB"; 0: no byte bound
    pub_hwm: int = 8
    heartbeat: P.Heartbeat = P.Heartbeat()
    linger: float = 5.0  # after END_OF_STREAM, how long to wait for trainers to say BYE
    server_id: str = ""
    # a trainer holding batches that acknowledges none for this long is fenced (None: never);
    # above the longest pause of a training loop between two batches (evaluation, checkpoints)
    progress_timeout: float | None = 300.0
    insecure: bool = False  # serve without CURVE on addresses other machines can reach

    def __post_init__(self) -> None:
        object.__setattr__(self, "addresses", tuple(expand_all(self.addresses)))
        if self.broadcast:
            object.__setattr__(self, "broadcast", tuple(expand_all(self.broadcast)))
        object.__setattr__(self, "mode", Mode(self.mode))
        if self.epochs is not None and self.epochs < 1:
            raise ConfigError(f"epochs must be >= 1 or None (until stopped), got {self.epochs}")
        if self.max_credit < 1 or self.prefetch < 1 or self.pub_hwm < 1:
            raise ConfigError("max_credit, prefetch and pub_hwm must be >= 1")
        object.__setattr__(self, "prefetch_bytes", parse_size(self.prefetch_bytes, "prefetch_bytes", zero=True))
        if self.progress_timeout is not None and self.progress_timeout <= self.heartbeat.interval:
            raise ConfigError(
                f"progress_timeout ({self.progress_timeout}) must be above the heartbeat interval "
                f"({self.heartbeat.interval}), or None for no progress deadline"
            )
        if not self.server_id:
            object.__setattr__(self, "server_id", f"{socket.gethostname()}:{os.getpid()}")


class Server:
    """`with Server(factory, options) as s: s.wait()`; `s.endpoints` are the bound addresses."""

    def __init__(
        self,
        factory: BatchFactory | None,
        options: ServerOptions,
        *,
        keys: ServerKeys | None = None,
        source: Callable[[list[str], Callable[[], None] | None], Any] | None = None,
    ):
        """`source(endpoints, wake)`, instead of `factory`: a started producer-like object (its
        `queue` yields Items and a StreamEnd; `stop()`) that is told the bound endpoints, e.g.
        `crossfeed.net.lease.source.LeaseSource` for `serve --dispatcher`."""
        if keys is None and not options.insecure:
            exposed = [a for a in (*options.addresses, *options.broadcast) if not is_local(a)]
            if exposed:
                raise ConfigError(
                    f"refusing to serve {', '.join(exposed)} without authentication: any machine "
                    "that reaches it could read the stream, exhaust this server's memory or abort "
                    "it. Pass CURVE keys (`crossfeed keygen`, --auth-keys), bind ipc:// or a "
                    "loopback address, or accept the risk on a trusted network with --insecure "
                    "(ServerOptions(insecure=True))"
                )
        self.options = options
        self.instance = P.new_instance()  # in every message: clients notice a restarted server
        self._factory = factory
        self._source = source
        self._keys = keys
        self._ctx = zmq.Context()
        self._auth: ThreadAuthenticator | None = None
        self._stop = threading.Event()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._distribution: Distribution | None = None
        self.endpoints: list[str] = []
        self.broadcast_endpoints: list[str] = []
        # delivered/samples/bytes: batches acknowledged by a trainer (published, in broadcast mode)
        self.stats = {
            "sent": 0,
            "acked": 0,
            "delivered": 0,
            "samples": 0,
            "bytes": 0,
            "dropped_messages": 0,
            "epochs": 0,
            "fenced": 0,
        }
        self._started = time.monotonic()

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
        if self.options.mode is Mode.DISTRIBUTE:
            self._distribution = Distribution(
                self._ctx,
                self._main,
                publish=self._publish,
                heartbeat=self.options.heartbeat,
                max_credit=self.options.max_credit,
                linger=self.options.linger,
                stats=self.stats,
                stop=self._stop,
                instance=self.instance,
                progress_timeout=self.options.progress_timeout,
                status=self.status,
            )
        wake = self._distribution.wake if self._distribution is not None else None
        if self._source is not None:
            self._producer = self._source(list(self.endpoints), wake)
        elif self._factory is not None:
            self._producer = self._start_producer(self._factory, wake)
        else:
            raise ConfigError("a Server needs a batch factory or a source of batches")
        self._thread = threading.Thread(target=self._loop, name="crossfeed-server", daemon=True)
        self._thread.start()
        return self

    def _start_producer(self, factory: BatchFactory, wake) -> Producer:
        return Producer(
            factory,
            server_id=self.options.server_id,
            epochs=self.options.epochs,
            start_epoch=self.options.start_epoch,
            prefetch=self.options.prefetch,
            prefetch_bytes=self.options.prefetch_bytes,
            on_put=wake,
        ).start()

    def _bind(self, kind: int, addresses: tuple[str, ...], out: list[str]) -> zmq.Socket:
        if kind == zmq.ROUTER:
            seed_routing_ids()
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

    @property
    def loader(self) -> Any:
        """The Loader that builds the batches (None for a factory that is not one)."""
        producer = getattr(self, "_producer", None)
        return getattr(self._factory, "loader", None) or getattr(producer, "loader", None)

    @property
    def source_stats(self) -> dict[str, int] | None:
        """The counters of a `source` (a dispatcher's leases: received, resets, dropped), else None."""
        stats = getattr(getattr(self, "_producer", None), "stats", None) if self._source is not None else None
        return dict(stats) if isinstance(stats, dict) else None

    @property
    def filtered(self) -> int:
        """Samples its Loader's filter (or a transform returning None) dropped so far (0 without one)."""
        return int(getattr(self.loader, "filtered", 0) or 0)

    def trainers(self) -> int:
        """Live trainers (distribution mode; 0 in broadcast mode)."""
        return self._distribution.trainers() if self._distribution is not None else 0

    def status(self) -> dict[str, Any]:
        """What `crossfeed top` is told (`crossfeed.net.status.ServerStatus`); any thread may ask."""
        stats = dict(self.stats)
        return {
            "v": 1,
            "kind": "server",
            "server_id": self.options.server_id[:256],
            "uptime": round(time.monotonic() - self._started, 3),
            **{k: stats[k] for k in ("delivered", "samples", "bytes", "sent", "epochs", "fenced", "dropped_messages")},
            "trainers": self.trainers(),
            "dispatched": self._source is not None,
            "filtered": self.filtered,
            "loader": loader_stats(self.loader),
        }

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
        for name in ("_main", "_pub"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close()
        if self._distribution is not None:
            self._distribution.close()
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()
        self._done.set()

    def _loop(self) -> None:
        try:
            if self._distribution is not None:
                self._distribution.run(self._producer)
            else:
                self._broadcast()
        except BaseException as e:  # reported by raise_if_failed(), never swallowed
            self._error = e
            logger.error("server %s failed: %s", self.options.server_id, e)
        finally:
            self._teardown()

    # ---- the PUB side: observers, and the loop of broadcast mode ----
    def _publish(self, frames: list) -> None:
        for sock in (self._pub, self._main if self.options.mode is Mode.BROADCAST else None):
            if sock is not None:
                try:
                    sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    pass  # broadcast is lossy by design

    def _end_stream(self, epochs: int, failed: bool = False) -> None:
        """END_OF_STREAM to the subscribers; b=1 tells them the server failed (what is missing is lost)."""
        self._publish([P.pack(P.Kind.END_OF_STREAM, epochs, int(failed), instance=self.instance)])
        if not failed:
            logger.info("stream ended after %d epochs", epochs)

    def _broadcast(self) -> None:
        hb = self.options.heartbeat
        next_beat = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + hb.interval
                self._publish([P.pack(P.Kind.HEARTBEAT, int(hb.timeout * 1000), instance=self.instance)])
            try:
                msg = self._producer.queue.get(timeout=min(hb.interval / 2, 0.1))
            except queue.Empty:
                continue
            if isinstance(msg, ProducerFailed):
                self._end_stream(self.stats["epochs"], failed=True)
                raise CrossfeedError(f"the batch source failed: {msg.message}")
            if isinstance(msg, Item):
                self._publish([P.pack(P.Kind.BATCH, msg.seq, msg.epoch, instance=self.instance), *msg.frames])
                self.stats["sent"] += 1
                self.stats["delivered"] += 1
                self.stats["samples"] += msg.num_samples
                self.stats["bytes"] += msg.nbytes
            elif isinstance(msg, EpochEnd):
                self._publish([P.pack(P.Kind.END_OF_EPOCH, msg.epoch, msg.batches, instance=self.instance)])
                self.stats["epochs"] += 1
            elif isinstance(msg, StreamEnd):
                self._end_stream(msg.epochs)
                self._stop.wait(min(self.options.linger, 1.0))  # let PUB flush the marker
                return
