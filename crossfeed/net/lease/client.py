"""`crossfeed.connect(dispatcher=...)`: batches from whichever servers a dispatcher leases work to.

    with crossfeed.connect(dispatcher="tcp://10.0.0.1:7870", keys="keys/") as batches:
        for batch in batches:
            train_step(batch)

The client beats the dispatcher (`leasewire`) and connects every server it announces, as they
join (a server that dies is simply dropped: the dispatcher gives its work to the others).
Every batch that arrives is CLAIMed at the dispatcher, quoting the claim token its server sent
with it (proof that this client received it), and reaches the training loop only once granted:
a batch of a revoked lease (its server was declared dead or stalled, left, or the dispatcher
restarted) or one another trainer holds is refused and dropped here (acknowledged to its
server, never yielded), and so is a second copy of a batch this client already used (and so is
one whose lease id no dispatcher can have made: a server's message never ends the stream). The
deliveries already received are claimed together (one CLAIM for all of them). A used batch is
reported DONE (again until confirmed) with the next message to the dispatcher (a CLAIM or a BEAT),
or as soon as the training loop asks for a batch and none is granted yet: one DONE for the
batches used meanwhile. Grants are used
only while this client's own standing with the dispatcher is recent (a BEAT answered within
half its silence timeout), and after the training loop was away longer than that only once a
BEAT sent after it came back is answered (the dispatcher's claim deadline may have declared
this client stalled meanwhile): one the dispatcher declared dead or stalled drops what it was
granted. Iteration ends when the dispatcher says every epoch is done (what is still granted
then is a stale copy, dropped).

Each BEAT also tells the dispatcher how much of the training loop's time goes to waiting for
input (`crossfeed top` shows it per trainer): from the first batch returned on, the time spent
inside `__next__` (from the call to the batch's return) is waiting, the time between returning a
batch and the next call is the trainer's own step. Once a window holds at least WAIT_WINDOW s of
both, the next BEAT carries waiting / (waiting + step) (`wait_ratio`) and a new window starts; the
other BEATs (and every BEAT before the first batch or after the stream ended) report nothing.
A loop stuck waiting reports 1; one that stopped asking for batches (but is still open), 0.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import zmq

from crossfeed.errors import CrossfeedError, WireError
from crossfeed.format import wire
from crossfeed.net import protocol as P
from crossfeed.net.keys import ClientKeys
from crossfeed.net.lease import messages as W
from crossfeed.net.stream.events import Delivery, Lost, ReceiverFailed
from crossfeed.net.stream.receiver import MAX_LINKS, Receiver

logger = logging.getLogger(__name__)
TRAINER = 2
TOKEN_END = 1 << 63  # claim tokens travel in the dispatcher's signed 64-bit slots
CLAIM_RETRY = 1.0  # seconds before an unanswered claim is sent again
WAIT_WINDOW = 1.0  # seconds of the training loop's time over which one BEAT's wait share is measured
MAX_BACKOFF = 300.0  # seconds, at most, before an announced server that never answered is tried again
MAX_UNANSWERED = 4096  # such servers remembered (the oldest forgotten first)
DRAIN = 64  # deliveries already received, taken at once before their (one) CLAIM goes out


class LeasedClient(Iterator[Any]):
    def __init__(self, dispatcher: str, *, keys: ClientKeys | None, options):
        self.dispatcher, self.options = dispatcher, options
        self._hb: P.Heartbeat = options.heartbeat
        self._receiver = Receiver(
            [],
            keys=keys,
            credits=options.credits,
            credit_bytes=options.credit_bytes,
            broadcast=False,
            heartbeat=options.heartbeat,
            connect_timeout=options.connect_timeout,
            limits=options.limits,
        )
        self._receiver.open_ended = True
        self._receiver.start()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.linger = 500
        self._sock.setsockopt(zmq.MAXMSGSIZE, W.MAX_MESSAGE)
        from crossfeed.net.keys import secure_client_socket

        secure_client_socket(self._sock, keys)
        self._sock.connect(dispatcher)
        self._lock = threading.Lock()  # the dispatcher socket and the state below
        self._id = P.new_instance()
        self._servers: dict[str, int] = {}  # address -> receiver index of its live link
        # address -> (times it never answered in a row, when it may be connected again): an
        # unreachable announced endpoint is tried again after connect_timeout, 2x, 4x... MAX_BACKOFF
        self._unanswered: dict[str, tuple[int, float]] = {}
        # (seq, lease) -> (delivery, when its claim was sent): copies of one batch under two leases
        # (one revoked) are two entries; the dispatcher grants at most one of them
        self._awaiting: dict[tuple[int, int], tuple[Delivery, float]] = {}
        self._granted: collections.deque[Delivery] = collections.deque()
        self._seen: set[int] = set()  # seqs granted to (and so used by) this client
        self._done: set[int] = set()  # used, DONE not yet confirmed
        self._unsent: set[int] = set()  # of those, the ones whose DONE was not sent yet
        self._held: Delivery | None = None
        self._confirmed_at = -1.0  # send time of the last BEAT the dispatcher answered
        self._returned_at = time.monotonic()  # when the training loop last got a batch
        self._beat_ms = 0  # the sent_ms of our last BEAT (strictly increasing)
        self._back_at = -1.0  # the loop came back after a long absence: grants wait for a BEAT from then on
        self._timeout = self._hb.timeout  # the dispatcher's silence timeout, once it tells us
        self._next_beat = 0.0
        self._finished = False
        self._closed = False
        self._serverless_since: float | None = time.monotonic()  # since when no server is connected (None: one is)
        self._joined_finished: bool | None = None  # the dispatcher's first answer said the plan was done
        # the wait window: the loop's phase ("wait" in __next__, "step" outside, None before the
        # first batch and after the end), since when it is not yet counted, and what was counted
        self._phase: str | None = None
        self._mark = 0.0
        self._waited = self._stepped = 0.0
        self.wait_ratio: float | None = None  # the last window's share of waiting (the last BEAT's)
        self.last_meta: wire.BatchMeta | None = None
        self.batches = 0
        self.refused = 0  # deliveries the dispatcher refused (revoked lease, or another's)
        self.duplicates = 0  # second copies of batches this client already used
        self.resets = 0
        self._log = P.RateLimitedLog(logger)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep_alive, name="crossfeed-leased-client", daemon=True)
        self._thread.start()

    # ---- iteration ----
    def __iter__(self) -> LeasedClient:
        return self

    def __next__(self) -> Any:
        with self._lock:
            now = time.monotonic()
            if self._phase is not None:
                self._count(now)
                self._phase = "wait"
            if now - self._returned_at > self._timeout / 2:  # away long: ask before using a grant
                self._back_at = (self._beat_ms + 1) / 1000
                self._next_beat = 0.0  # a BEAT now (after the DONE below: the same socket, in order)
        if self._held is not None:  # its DONE goes with the next message to the dispatcher (see _pump)
            held, self._held = self._held, None
            self._receiver.ack(held.server, held.meta.seq, held.lease)
            with self._lock:
                self._done.add(held.meta.seq)
                self._unsent.add(held.meta.seq)
        while True:
            if not self._receiver.alive:
                raise CrossfeedError("the client's I/O thread stopped")
            if not self._granted:  # what came meanwhile is claimed with the DONE below (one journal write for both)
                self._drain(self._receiver.next_event(timeout=0.0))
            with self._lock:
                self._pump(force_done=not self._granted)  # about to wait: what was used is reported now
                now = time.monotonic()
                standing = now - self._confirmed_at < self._timeout / 2 and self._confirmed_at >= self._back_at
                if self._granted and standing:
                    granted = self._granted.popleft()
                    self._held = granted
                    self.last_meta = granted.meta
                    self.batches += 1
                    self._returned_at = now
                    self._count(now)
                    self._phase = "step"
                    return (granted.meta, granted.batch) if self.options.with_meta else granted.batch
                if self._finished and not self._granted:  # every batch is done: no DONE to confirm
                    self._count(now)
                    self._phase = None
                    if self.batches == 0 and not self._joined_finished:  # others used every batch: said
                        logger.warning(
                            "the dispatcher at %s finished its plan and this trainer received no batch: the other "
                            "trainers used every one",
                            self.dispatcher,
                        )
                    elif self.batches == 0:  # never silent: a trainer that joined a finished plan is told why
                        raise CrossfeedError(
                            f"the dispatcher at {self.dispatcher} says every epoch of its plan is done, and this "
                            "trainer received no batch: the plan had finished when it joined (a new run needs a new "
                            "plan: start the dispatcher with --restart, or another --journal)"
                        )
                    raise StopIteration
                if self._servers:
                    self._serverless_since = None
                elif self._serverless_since is None:
                    self._serverless_since = now
                elif now - self._serverless_since > self.options.server_wait and self.batches == 0:
                    raise CrossfeedError(
                        f"no server joined the dispatcher at {self.dispatcher} in {self.options.server_wait:g} s "
                        "(ClientOptions.server_wait): start `crossfeed serve DATASET --dispatcher ...` for it, "
                        "or raise server_wait"
                    )
            if self._awaiting and not self._granted:  # a grant is due: wait on the dispatcher
                with self._lock:
                    self._sock.poll(2)
            else:
                self._drain(self._receiver.next_event(timeout=0.02))

    def _drain(self, event: Any) -> None:
        """Handle `event` and those already received after it (DRAIN at most): every delivery
        among them is claimed in one CLAIM (sent by the next `_pump`), not one each."""
        for _ in range(DRAIN):
            if event is None:
                return
            self._on_event(event)
            event = self._receiver.next_event(timeout=0.0)
        if event is not None:
            self._on_event(event)

    def _on_event(self, event: Any) -> None:
        if isinstance(event, Delivery):
            seq = event.meta.seq
            if not 0 < event.token < TOKEN_END:  # no dispatcher made that token: never claimable
                with self._lock:
                    self.refused += 1
                    self._receiver.ack(event.server, seq, event.lease)
                self._log.warning(
                    "token",
                    "dropped batch %d from %s: its claim token %d is no dispatcher's",
                    seq,
                    self._receiver.address_of(event.server),
                    event.token,
                )
                return
            with self._lock:
                if seq in self._seen or (seq, event.token) in self._awaiting:
                    self.duplicates += 1
                    self._receiver.ack(event.server, seq, event.lease)
                    return
                self._awaiting[seq, event.token] = (event, 0.0)  # claimed by the next _pump
        elif isinstance(event, Lost):
            with self._lock:
                for address, index in list(self._servers.items()):
                    if index == event.server:
                        del self._servers[address]  # connected afresh if it is announced again
                address = event.info.address
                if event.info.answered:
                    self._unanswered.pop(address, None)
                else:  # unreachable (or not a server): connected again only after a backoff
                    failures = self._unanswered.pop(address, (0, 0.0))[0] + 1
                    delay = min(self.options.connect_timeout * 2 ** min(failures - 1, 16), MAX_BACKOFF)
                    self._unanswered[address] = (failures, time.monotonic() + delay)
                    while len(self._unanswered) > MAX_UNANSWERED:
                        del self._unanswered[next(iter(self._unanswered))]
        elif isinstance(event, ReceiverFailed):
            raise CrossfeedError(f"client I/O failed: {event.message}")

    # ---- the dispatcher (with the lock held) ----
    def _count(self, now: float) -> None:
        """Count the loop's time since the mark in its phase (see the module docstring)."""
        if self._phase == "wait":
            self._waited += now - self._mark
        elif self._phase == "step":
            self._stepped += now - self._mark
        self._mark = now

    def _wait_slot(self, now: float) -> int:
        """A BEAT's `wait_permille`: the window's share of waiting once it is WAIT_WINDOW s long
        (a new window starts), else 0 (not reported)."""
        self._count(now)
        total = self._waited + self._stepped
        if total < WAIT_WINDOW:
            return 0
        self.wait_ratio = self._waited / total
        self._waited = self._stepped = 0.0
        return W.encode_wait(self.wait_ratio)

    def _send(self, kind: W.Kind, payload=None, **slots: int) -> None:
        try:
            self._sock.send_multipart(
                W.pack(kind, role=TRAINER, sender=self._id, payload=payload, **slots), zmq.NOBLOCK
            )
        except zmq.ZMQError as e:
            logger.debug("could not send %s to the dispatcher: %s", kind.name, e)

    def _pump(self, force_done: bool = False) -> None:
        if self._closed:
            return
        now = time.monotonic()
        beat = now >= self._next_beat
        due = [key for key, (_ev, sent) in self._awaiting.items() if now - sent > CLAIM_RETRY]
        # used batches are reported with the next message that goes anyway (a BEAT, a CLAIM), or
        # when the loop is about to wait (`force_done`): one DONE for several batches, not one each;
        # each BEAT repeats those not yet confirmed (before the BEAT: its answer then vouches for them)
        report = self._done if beat else self._unsent if force_done or due else ()
        if report:
            done = sorted(report)
            self._unsent.clear()
            for i in range(0, len(done), W.MAX_ITEMS):
                self._send(W.Kind.DONE, payload=done[i : i + W.MAX_ITEMS])
        if beat:
            self._next_beat = now + self._hb.interval
            self._beat_ms = max(int(now * 1000), self._beat_ms + 1)
            self._send(W.Kind.BEAT, sent_ms=self._beat_ms, wait_permille=self._wait_slot(now))
        for i in range(0, len(due), W.MAX_ITEMS):
            self._send(W.Kind.CLAIM, payload=due[i : i + W.MAX_ITEMS])
        for key in due:
            self._awaiting[key] = (self._awaiting[key][0], now)
        for _ in range(100):
            try:
                frames = P.recv_bounded(self._sock, 2, W.MAX_MESSAGE)
            except zmq.Again:
                return
            except WireError as e:
                logger.warning("dropped a malformed message from the dispatcher: %s", e)
                continue
            try:
                self._handle(W.unpack(frames, W.TO_TRAINER))
            except WireError as e:
                logger.warning("dropped a malformed message from the dispatcher: %s", e)

    def _handle(self, msg: W.Message) -> None:
        if msg.kind is W.Kind.SERVERS:
            self._confirmed_at = max(self._confirmed_at, msg.sent_ms / 1000)
            if msg.timeout_ms > 0:
                self._timeout = msg.timeout_ms / 1000
            self._finished = bool(msg.finished)
            if self._joined_finished is None:
                self._joined_finished = self._finished
            if self._finished:  # every batch is done: what we hold or await are copies
                for ev in [*(ev for ev, _ in self._awaiting.values()), *self._granted]:
                    self._receiver.ack(ev.server, ev.meta.seq, ev.lease)
                self._awaiting.clear()
                self._granted.clear()
                self._done.clear()
                self._unsent.clear()
            now = time.monotonic()
            for address in msg.payload.split() if msg.payload else ():
                if address in self._servers or now < self._unanswered.get(address, (0, 0.0))[1]:
                    continue
                try:  # one bad address is skipped; the page's others are still connected
                    W.endpoints(address)
                    index = self._receiver.add(address)
                except (WireError, zmq.ZMQError) as e:
                    self._log.warning(
                        "address", "skipped server address %r announced by the dispatcher: %s", address[:80], e
                    )
                    continue
                if index is None:  # as many links as a trainer holds: the next page tries again
                    self._log.warning(
                        "links", "not connecting %s yet: %d server links are live already", address[:80], MAX_LINKS
                    )
                    break
                self._servers[address] = index
                logger.info("connected server %s (announced by the dispatcher)", address)
        elif msg.kind is W.Kind.GRANTS:
            for seq, token, ok in msg.payload:
                entry = self._awaiting.pop((int(seq), int(token)), None)
                if entry is None:
                    continue
                ev = entry[0]
                if ok and int(seq) not in self._seen:
                    self._seen.add(int(seq))
                    self._granted.append(ev)
                else:
                    self.refused += 1
                    self._receiver.ack(ev.server, ev.meta.seq, ev.lease)
        elif msg.kind is W.Kind.DONE_OK:
            self._done.difference_update(int(s) for s in msg.payload)
            self._unsent.intersection_update(self._done)
            self._finished = self._finished or bool(msg.finished)
            if self._finished:
                self._done.clear()
                self._unsent.clear()
        elif msg.kind is W.Kind.RESET:
            self._reset()

    def _reset(self) -> None:
        """The dispatcher declared us dead: what it granted us and we did not use went to others."""
        self.resets += 1
        dropped = list(self._granted)
        for ev in dropped:
            self._receiver.ack(ev.server, ev.meta.seq, ev.lease)
            self._seen.discard(ev.meta.seq)
        self._granted.clear()
        for key, (ev, _sent) in list(self._awaiting.items()):  # claimed afresh under the new id
            self._awaiting[key] = (ev, 0.0)
        self._done.clear()  # confirmed or not, the dispatcher decided about them
        self._unsent.clear()
        self._id = P.new_instance()
        self._confirmed_at = -1.0
        self._next_beat = 0.0
        logger.warning(
            "the dispatcher declared this client dead: %d batches granted and not used were dropped; rejoined",
            len(dropped),
        )

    def _keep_alive(self) -> None:
        while not self._stop.wait(min(self._hb.interval / 2, 0.1)):
            with self._lock:
                self._pump()

    # ---- closing ----
    @property
    def trainer_id(self) -> str:
        """This client's id as the dispatcher (and `crossfeed top`) lists it; a new one after a RESET."""
        return f"{self._id:016x}"

    @property
    def lost(self) -> list:
        return list(self._receiver.lost)

    @property
    def dropped_messages(self) -> int:
        """Malformed messages from servers, dropped (see `Receiver`); the dispatcher's are logged."""
        return self._receiver.dropped_messages

    def close(self) -> None:
        if self._closed:
            return
        self._stop.set()
        self._thread.join(5)
        with self._lock:
            if self._held is not None:
                self._receiver.ack(self._held.server, self._held.meta.seq, self._held.lease)
                self._done.add(self._held.meta.seq)
                self._held = None
            self._unsent |= self._done  # the last chance: every DONE not yet confirmed
            if self._unsent:
                self._pump(force_done=True)
            self._send(W.Kind.BYE)
            self._phase = None
            self._closed = True
            self._sock.close(linger=500)
        self._ctx.term()
        self._receiver.close()

    def __enter__(self) -> LeasedClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
