"""The client's sockets: one per server, heartbeats both ways, acks batched.

`next_event()` yields, in arrival order:
    Delivery(server, meta, batch)      a decoded batch (arrays view the received frames)
    EpochDone(server, epoch, batches)  that server's END_OF_EPOCH
    Lost(server, info)                 that server was dropped (also kept in `lost`)
    AllDone()                          every server has ended or been dropped
    ReceiverFailed(message)            the receiver itself broke; nothing follows

Fencing: a Delivery is handed out only while its link's lease holds (`Link.usable`): after this
process stalled (a gap between two pumps longer than half the server's silence budget) or past
half the server's progress deadline, `next_event` first asks the server (a probe) and waits for
the answer. A server that declared us dead answers FENCED: every Delivery of that link still
queued is dropped (the server gave those batches to others), nothing of it is acknowledged, and
the link rejoins under a new identity at the next `next_event` (the user asking for more).
A server that answers with another instance id restarted: it is dropped, never merged.

Whoever holds the lock "pumps" the sockets (reads, decodes, sends acks and heartbeats): the
user thread itself inside `next_event()` when it has nothing to return (no thread hand-off per
batch), and a keep-alive thread every `interval / 2` so heartbeats flow and acks go out while
the user thread is busy training. `ack()` only notes a consumed batch; notes go out together
in one ACKS message when the user thread runs dry, after every `credits // 2` of them, or at the
next keep-alive tick, whichever comes first (so the server holds no batch for long that was
consumed, and its redelivery after a death covers exactly the unacknowledged ones).

A malformed message (WireError) is dropped and counted (`dropped_messages`), and its server read
on; a message whose handling raises anything else drops its server (counted, logged with the
traceback, reported as Lost): what one server sends never ends the stream from the others.

A dropped server's socket is closed at once (its queued deliveries stay usable), and where
servers come and go (`add`, a dispatcher's) a dropped link is forgotten once nothing queued
refers to it: a trainer holds at most MAX_LINKS live links and MAX_LOST dropped ones' reports,
however many servers were announced, preempted or unreachable over its life.

This module holds that polling loop; the events are defined in `crossfeed.net.stream.events`, and one
server's connection (socket, liveness, what came from it) is `crossfeed.net.stream.link.Link`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

import zmq

from crossfeed.errors import WireError
from crossfeed.format import wire
from crossfeed.net import protocol as P
from crossfeed.net.keys import ClientKeys
from crossfeed.net.stream.events import AllDone, Delivery, EpochDone, Lost, LostServer, ReceiverFailed
from crossfeed.net.stream.link import Link

logger = logging.getLogger(__name__)
MAX_LINKS = 256  # live server links of one receiver (each a socket, ~2 fds); `add` refuses more
MAX_LOST = 1024  # reports of dropped servers kept in `lost` (the latest)


class Receiver:
    """The sockets to every server of one client; `start()`, `next_event()`, `ack()`, `close()`."""

    def __init__(
        self,
        addresses: list[str],
        *,
        keys: ClientKeys | None,
        credits: int,
        credit_bytes: int = 0,
        broadcast: bool,
        heartbeat: P.Heartbeat,
        connect_timeout: float,
        limits: wire.WireLimits,
    ):
        self.addresses = addresses
        self._keys, self._credits, self._broadcast = keys, credits, broadcast
        self._credit_bytes = credit_bytes
        self._hb, self._connect_timeout, self._limits = heartbeat, connect_timeout, limits
        self._buffer = 8 if broadcast else credits * len(addresses) + 1
        self._ack_every = max(credits // 2, 1)
        self._tick = min(heartbeat.interval / 2, 0.1)
        self._events: collections.deque[Any] = collections.deque()  # appended under the lock
        self._acks: collections.deque[tuple[int, int, int]] = collections.deque()  # (server, seq, lease)
        self.lost: collections.deque[LostServer] = collections.deque(maxlen=MAX_LOST)
        self.dropped_messages = 0
        self.fenced = 0  # how many times a server fenced this client (it rejoined each time)
        self.stale_dropped = 0  # deliveries dropped unused because their lease was fenced
        self._log = P.RateLimitedLog(logger)
        self._ctx = zmq.Context()
        self._lock = threading.Lock()  # held by whoever pumps the sockets
        self._stop = threading.Event()
        self._links: dict[int, Link] = {}  # index (never reused) -> link; events name the index
        self._next_index = 0
        self._forget: set[int] = set()  # dropped links to forget once no queued event names them
        self._poller = zmq.Poller()
        self._polled: set[zmq.Socket] = set()
        self._next_beat = 0.0
        self._last_pump = time.monotonic()
        self._done_signalled = False
        self._failed = False
        self._closed = False
        self.open_ended = False  # True: no AllDone (servers are added as a dispatcher announces them)
        self._thread = threading.Thread(target=self._keep_alive, name="crossfeed-client", daemon=True)

    def start(self) -> Receiver:
        try:
            now = time.monotonic()
            for a in self.addresses:
                self._links[self._new_index()] = self._open(a, now)
        except Exception as e:  # reported by the first next_event(), like any later failure
            self._fail(e)
        self._thread.start()
        return self

    def _new_index(self) -> int:
        self._next_index += 1
        return self._next_index - 1

    def add(self, address: str) -> int | None:
        """Connect one more server (a dispatcher announced it); returns its index, or None while
        MAX_LINKS links are live (the caller tries again later)."""
        with self._lock:
            live = self._live()
            if live >= MAX_LINKS:
                return None
            link = self._open(address, time.monotonic())
            index = self._new_index()
            self._links[index] = link
            self._buffer = self._credits * (live + 1) + 1
            return index

    def _live(self) -> int:
        return sum(link.state in ("live", "fenced") for link in self._links.values())

    def address_of(self, index: int) -> str:
        """The address of server `index` (or a placeholder for one dropped and forgotten)."""
        link = self._links.get(index)
        return link.address if link is not None else f"(dropped server #{index})"

    @property
    def links(self) -> int:
        """Links held: live, fenced, ended, and dropped ones not yet forgotten (see the module docstring)."""
        return len(self._links)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._failed

    def ack(self, server: int, seq: int, lease: int = 0) -> None:
        """Note that batch `seq` of `server` was consumed; it is acknowledged soon (see above)."""
        self._acks.append((server, seq, lease))
        if len(self._acks) >= self._ack_every and self._lock.acquire(blocking=False):
            try:  # keep the server's window open without waiting for the queue to run dry
                self._pump(0.0)
            finally:
                self._lock.release()

    def next_event(self, timeout: float) -> Any | None:
        """The next event; pumps the sockets on this thread while there is none (or while the
        next Delivery waits for its lease to be confirmed); None after `timeout` seconds."""
        event = self._ready_event()
        if event is not None:
            return event
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if not self._lock.acquire(timeout=max(remaining, 0.0)):
                return self._ready_event()
            try:
                self._rejoin_fenced()
                event = self._ready_event(locked=True)
                if event is None:
                    self._pump(max(min(remaining, self._tick), 0.0))
                    event = self._ready_event(locked=True)
            finally:
                self._lock.release()
            if event is not None:
                return event
            if remaining <= 0 or self._failed or self._closed:
                return None

    def _ready_event(self, locked: bool = False) -> Any | None:
        """The head event if it may be handed out now; stale deliveries are dropped. A Delivery
        whose lease needs confirming stays queued (with `locked`, a probe is sent for it)."""
        while self._events:
            event = self._events[0]
            if not isinstance(event, Delivery) or self._broadcast:
                return self._events.popleft()
            link = self._links.get(event.server)
            if link is None:  # dropped and forgotten (nothing queued named it): not leased either
                return self._events.popleft()
            if event.lease != link.lease or link.state == "fenced":
                self._events.popleft()
                self.stale_dropped += 1
                continue
            now = time.monotonic()
            if link.state == "live":
                if now - self._last_pump > self._stall_limit(link):
                    link.suspect = True  # we stalled: the server may have declared us dead
                if not link.usable(now):
                    if locked:
                        link.send_probe(now, self._credits, self._credit_bytes)
                    return None
            return self._events.popleft()
        return None

    def _stall_limit(self, link: Link) -> float:
        """A pause longer than this may have let the server declare us dead (half of what its
        silence timeout leaves after one heartbeat interval)."""
        timeout = link.server_timeout or self._hb.timeout
        return max((timeout - self._hb.interval) / 2, self._tick)

    def _rejoin_fenced(self) -> None:
        now = time.monotonic()
        for link in self._links.values():
            if link.state == "fenced":
                link.rejoin(self._open(link.address, now).sock, now)
                logger.warning("rejoined %s under a new identity after it fenced us", link.address)

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("client keep-alive thread did not stop within %.1fs", timeout)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if not self._failed:
                try:
                    self._flush_acks()
                except Exception:  # closing anyway; what was not acknowledged is redelivered
                    logger.exception("could not send the last acknowledgements")
            for link in self._links.values():
                link.close(bye=not self._broadcast)
            self._ctx.term()

    # ---- pumping (with the lock held) ----
    def _keep_alive(self) -> None:
        while not self._stop.wait(self._tick):
            if self._lock.acquire(timeout=self._tick):
                try:
                    self._pump(0.0)
                finally:
                    self._lock.release()
            if self._failed or self._closed:
                return

    def _fail(self, error: Exception) -> None:
        logger.error("client I/O failed: %s: %s", type(error).__name__, error, exc_info=error)
        self._failed = True
        self._events.append(ReceiverFailed(f"{type(error).__name__}: {error}"))

    def _pump(self, wait: float) -> None:
        """Send due acks and heartbeats, read what has come (waiting up to `wait` seconds for
        something), notice silent servers. Never raises: a failure becomes ReceiverFailed."""
        if self._failed or self._closed:
            return
        now = time.monotonic()
        for link in self._links.values():
            if link.state == "live" and now - self._last_pump > self._stall_limit(link):
                link.suspect = True  # sticky until a probe answers: see _ready_event
        self._last_pump = now
        try:
            self._flush_acks()
            self._read(wait)
            self._flush_acks()
            self._housekeeping(time.monotonic())
        except Exception as e:  # crosses to the user thread wrapped
            self._fail(e)

    def _read(self, wait: float) -> None:
        room = len(self._events) < self._buffer
        # a link we asked for a lease probe is read even when full: its answer frees the queue
        want = {link.sock for link in self._links.values() if link.state == "live" and (room or link.probe)}
        if want != self._polled:
            for sock in self._polled - want:
                self._poller.unregister(sock)
            for sock in want - self._polled:
                self._poller.register(sock, zmq.POLLIN)
            self._polled = want
        if not want:
            if wait > 0 and not self._events:
                self._stop.wait(min(wait, self._tick))  # nothing to read: do not spin
            return
        # wake in time for the next heartbeat and liveness check
        wait = min(wait, max(self._next_beat - time.monotonic(), 0.0), self._tick)
        ready = self._poller.poll(int(wait * 1000)) if wait > 0 else self._poller.poll(0)
        if not ready:
            return
        ready_socks = {sock for sock, _ in ready}
        for i, link in list(self._links.items()):
            if link.sock in ready_socks and link.state == "live":
                self._drain(i, link)

    def _housekeeping(self, now: float) -> None:
        if now >= self._next_beat:
            self._next_beat = now + self._hb.interval
            for link in self._links.values():
                if link.state == "live" and not self._broadcast:
                    link.send(P.pack(P.Kind.HEARTBEAT, self._credits, self._credit_bytes))
        for link in list(self._links.values()):
            if link.state == "live":
                reason = link.silence(now, self._hb.timeout, self._connect_timeout)
                if reason is not None:
                    self._lose(link, reason)
        if self.open_ended:  # more servers may come (a dispatcher's): never all done
            self._forget_dropped()
            return
        if not self._done_signalled and all(link.state in ("ended", "lost") for link in self._links.values()):
            self._done_signalled = True
            self._events.append(AllDone())

    def _forget_dropped(self) -> None:
        """Forget the dropped links no queued event names any more (their sockets are closed
        already; an ack of one of their deliveries is ignored, see `_flush_acks`)."""
        if not self._forget:
            return
        named = {getattr(e, "server", None) for e in self._events}
        for index in [i for i in self._forget if i not in named]:
            self._forget.discard(index)
            self._links.pop(index, None)

    def _open(self, address: str, now: float) -> Link:
        return Link.open(
            self._ctx,
            address,
            keys=self._keys,
            broadcast=self._broadcast,
            credits=self._credits,
            credit_bytes=self._credit_bytes,
            rcvhwm=self._buffer if self._broadcast else 1000,
            max_message_bytes=self._limits.max_message_bytes,
            now=now,
        )

    def _flush_acks(self) -> None:
        """One ACKS message per server for the consumed batches noted since the last flush."""
        if not self._acks:
            return
        by_server: dict[int, list[int]] = {}
        while self._acks:
            server, seq, lease = self._acks.popleft()
            link = self._links.get(server)
            if link is not None and lease == link.lease:  # an older lease's batches went to others
                by_server.setdefault(server, []).append(seq)
        now = time.monotonic()
        for server, seqs in by_server.items():
            self._links[server].acked(seqs, now)

    def _drain(self, index: int, link: Link) -> None:
        for _ in range(self._buffer + 16):
            try:
                frames = P.recv_bounded(link.sock, self._limits.max_frames + 1, self._limits.max_message_bytes)
            except zmq.Again:
                return
            except WireError as e:
                self._bad(link, e)
                continue
            try:
                self._handle(index, link, frames)
            except WireError as e:
                self._bad(link, e)
            except Exception as e:  # a bug met on one server's bytes: that server goes, not the client
                self._broken(link, e)
            if link.state != "live" or len(self._events) >= self._buffer:
                return

    def _bad(self, link: Link, error: WireError) -> None:
        self.dropped_messages += 1
        self._log.warning(link.address, "dropped a malformed message from %s: %s", link.address, error)

    def _broken(self, link: Link, error: Exception) -> None:
        """A message of `link` raised something other than WireError (a decoder bug met on a
        peer's bytes): that server is dropped and counted, the client reads on from the others."""
        self.dropped_messages += 1
        logger.error("a message from %s could not be handled; dropping that server", link.address, exc_info=error)
        if link.state == "live":
            self._lose(link, f"its message could not be handled ({type(error).__name__}: {error})")

    def _lose(self, link: Link, reason: str) -> None:
        """Drop `link`: reported (`lost`, a Lost event), its socket closed at once (what it
        delivered stays queued and usable)."""
        info = link.lose(reason, leased=self.open_ended)  # open-ended: a dispatcher's servers
        self.lost.append(info)
        index = next(i for i, x in self._links.items() if x is link)
        self._events.append(Lost(index, info))
        if link.sock in self._polled:
            self._poller.unregister(link.sock)
            self._polled.discard(link.sock)
        link.sock.close(linger=0)
        self._forget.add(index)

    def _handle(self, index: int, link: Link, frames: list) -> None:
        env = P.unpack(frames[0], P.SERVER_KINDS)
        if env.kind is P.Kind.BATCH:
            meta, batch = wire.decode(frames[1:], self._limits)
            if meta.seq != env.a or meta.epoch != env.b:
                raise WireError(f"envelope says seq {env.a} epoch {env.b}, batch says {meta.seq} {meta.epoch}")
        elif len(frames) != 1:
            raise WireError(f"{env.kind.name} carries {len(frames) - 1} unexpected frames")
        if link.instance is None:
            link.instance = env.instance
        elif env.instance != link.instance:
            self._lose(
                link,
                (
                    f"restarted: a new server process (instance {env.instance:016x}, was "
                    f"{link.instance:016x}) answers there; its stream is not this one's continuation"
                ),
            )
            return
        now = time.monotonic()
        link.last_seen, link.heard = now, True
        if env.kind is P.Kind.BATCH:
            link.received_batch(meta, track=not self._broadcast, now=now)
            self._events.append(Delivery(index, meta, batch, link.lease, env.token))
        elif env.kind is P.Kind.HEARTBEAT:
            link.heartbeat(env)
        elif env.kind is P.Kind.FENCED:
            self._fence(index, link)
        elif env.kind is P.Kind.END_OF_EPOCH:
            self._events.append(EpochDone(index, env.a, env.b))
        elif env.kind is P.Kind.END_OF_STREAM:
            if not self._broadcast:
                link.send(P.pack(P.Kind.BYE))
            if env.b:
                self._lose(link, "the server reported that its batch source failed")
            else:
                link.state = "ended"
                logger.info("server %s ended its stream after %d epochs", link.address, env.a)

    def _fence(self, index: int, link: Link) -> None:
        """The server declared us dead: what we hold of it is dropped unused (by _ready_event,
        which never hands out a Delivery of a fenced link); we rejoin when the user asks next."""
        held = sum(1 for e in list(self._events) if isinstance(e, Delivery) and e.server == index)
        self.fenced += 1
        link.fence()
        logger.warning(
            "server %s fenced this client (declared it dead after a stall or no progress): the "
            "%d batches it sent here and we had not used went to other trainers; dropped unused",
            link.address,
            held,
        )
