"""`crossfeed dispatch`: the process that owns the epoch plan and leases its batches to servers.

One ROUTER socket (CURVE like `serve` when keys are given) speaks `leasewire` with both sides:
servers say HELLO (their data endpoints) and BEAT, and get LEASEs of batch numbers to build and
stream, each with its claim token; trainers BEAT (and learn the live servers' endpoints, a page
per BEAT), CLAIM each batch they receive quoting the token that came with it, and report it DONE
once used. Progress deadlines (`lease_timeout`, `claim_timeout`, see `LeaseBook`) take the work
of a server or a trainer that beats but does not deliver, or does not use what it holds, to
the others. The bookkeeping is `leases.LeaseBook`'s; every change it makes is journaled
(append + fsync) before any answer leaves, so a restarted dispatcher continues the epoch: DONE
batches are never served again, CLAIMED ones stay with their trainer, and every lease of the
previous process is revoked (its unclaimed batches are leased again, under new ids and tokens).

While the dispatcher is down nothing is lost or repeated, but nothing new is claimed either:
trainers use only the batches already granted to them, servers finish what they hold (trainers
then wait), and no server or trainer can be declared dead. A journal on a disk that loses
fsync'ed data (or a journal deleted between runs) voids the guarantee for the epoch in progress;
a damaged one (a record that fails its checksum or its checks, see `journal`) stops a starting
dispatcher with `JournalError` naming the line, rather than serve a used batch again.

Every message is validated (`leasewire.unpack`, `LeaseBook` refuses unknown ids, wrong claim
tokens and out-of-range batch numbers); a malformed one is counted and dropped, and so is one
whose handling raises anything else (logged with its traceback, rate-limited): nothing a peer
sends ends the dispatcher (a status answer too long for a message lists fewer entries).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import zmq

from crossfeed.errors import ConfigError, WireError
from crossfeed.net import protocol as P
from crossfeed.net.addresses import is_local
from crossfeed.net.keys import ServerKeys, secure_server_socket, start_authenticator
from crossfeed.net.lease import messages as W
from crossfeed.net.lease.book import LeaseBook
from crossfeed.net.lease.journal import Journal
from crossfeed.net.status import MAX_LISTED, StatusGate, is_status, pack_answer, request_id

logger = logging.getLogger(__name__)

SERVER, TRAINER = 1, 2  # the `c` of BEAT and BYE: who speaks
SNAPSHOT = 0.5  # seconds between refreshes of `LeaseDispatcher.snapshot`
Counts = Callable[[int], int]  # epoch -> its batches, where that changes with the epoch (packed rows)


class EpochCounts:
    """`counts(epoch)` for a plan whose batch count changes with the epoch (packed rows): `count`
    (one walk over the epoch's lengths, integers only) kept for the last few epochs, and the next
    epoch's walked ahead in a thread, so that an epoch's end seldom waits for a walk in the
    dispatcher's loop (where servers and trainers would go unheard meanwhile)."""

    def __init__(self, count: Counts, epochs: int | None = None):
        self._count, self._epochs = count, epochs  # epochs: none is walked ahead past the last
        self._known: dict[int, int] = {}
        self._lock = threading.Lock()
        self._ahead: dict[int, threading.Thread] = {}

    def __call__(self, epoch: int) -> int:
        ahead = self._ahead.pop(epoch, None)
        if ahead is not None:
            ahead.join()
        with self._lock:
            got = self._known.get(epoch)
        if got is None:
            got = self._walk(epoch)
        last = self._epochs is not None and epoch + 1 >= self._epochs
        if not last and epoch + 1 not in self._known and epoch + 1 not in self._ahead:
            t = threading.Thread(target=self._walk, args=(epoch + 1,), name="crossfeed-epoch-count", daemon=True)
            self._ahead[epoch + 1] = t
            t.start()
        return got

    def _walk(self, epoch: int) -> int:
        got = self._count(epoch)
        with self._lock:
            self._known[epoch] = got
            while len(self._known) > 4:
                del self._known[min(self._known)]
        return got


@dataclasses.dataclass(frozen=True)
class DispatcherOptions:
    address: str
    journal: Path | None = None  # None: no journal (a restarted dispatcher starts the plan over)
    epochs: int | None = 1
    lease_size: int = 8  # batches per lease
    window: int = 64  # batches leased to one server and not yet claimed, at most
    heartbeat: P.Heartbeat = P.Heartbeat()
    linger: float = 5.0  # after the last epoch, how long to keep answering (FINISHED)
    insecure: bool = False
    quota: int | None = None  # lockstep DDP: batches each trainer uses per epoch
    # a server holding leased batches none of which reaches a trainer for this long is stalled
    # (and a lease overtaken by a later one of its server for this long is leased again); None: never
    lease_timeout: float | None = 120.0
    # a trainer holding claimed batches and reporting none used for this long is stalled; None: never
    claim_timeout: float | None = 300.0
    # run the plan again from its start on a journal that holds a run of it (finished or not)
    restart: bool = False

    def __post_init__(self) -> None:
        if self.epochs is not None and self.epochs < 1:
            raise ConfigError(f"epochs must be >= 1 or None, got {self.epochs}")
        if not 1 <= self.lease_size <= self.window:
            raise ConfigError(f"need 1 <= lease_size ({self.lease_size}) <= window ({self.window})")
        if self.lease_size > W.MAX_ITEMS:
            raise ConfigError(f"lease_size ({self.lease_size}) must be at most {W.MAX_ITEMS} (batches in one LEASE)")
        for name in ("lease_timeout", "claim_timeout"):
            value = getattr(self, name)
            if value is not None and not value >= self.heartbeat.timeout:
                raise ConfigError(
                    f"{name} ({value}) must be at least the heartbeat timeout ({self.heartbeat.timeout}), "
                    "or None for no progress deadline"
                )


def recover(
    plan: dict, batches: int, options: DispatcherOptions, now: float, counts: Counts | None = None
) -> tuple[LeaseBook, Journal]:
    """The book of this plan as its journal left it (see `replay`), and the journal, compacted
    to that state (with its plan line: a restart reads the same plan)."""
    if options.restart:  # explicit: the journal's run (of this plan or another) is set aside
        book, journal, _ = replay(plan, batches, dataclasses.replace(options, journal=None), now, counts)
        journal = Journal(options.journal, plan=journal.plan, counts=counts) if options.journal else journal
        journal.compact(book.snapshot())
        if options.journal is not None:
            logger.info("--restart: the plan starts over; journal %s written afresh", options.journal)
        return book, journal
    book, journal, records = replay(plan, batches, options, now, counts)
    if records and book.finished:
        raise ConfigError(
            f"journal {options.journal} holds a finished run of this plan (every one of its {options.epochs} "
            "epochs done): a dispatcher started on it would give its trainers nothing. Pass --restart to run "
            "the plan again from its start (the journal starts over), or another --journal"
        )
    journal.compact(book.snapshot())
    if records:
        logger.info("continuing from journal %s: %s", options.journal, book.progress())
    return book, journal


def replay(
    plan: dict, batches: int, options: DispatcherOptions, now: float, counts: Counts | None = None
) -> tuple[LeaseBook, Journal, int]:
    """The book of this plan as its journal left it, the journal, and how many records it held;
    `counts`: each epoch's batches where they change with the epoch (`batches` is then the stride
    of the global ids, see `LeaseBook`).

    Every record is checked before it is replayed (`Journal.read`: checksums, fields, order); a
    damaged one stops the dispatcher with `JournalError` naming its line. Leases do not survive
    (see `LeaseBook.restore`); the trainers holding claims get a heartbeat timeout from `now`."""
    book = LeaseBook(
        batches,
        epochs=options.epochs,
        lease_size=options.lease_size,
        window=options.window,
        timeout=options.heartbeat.timeout,
        quota=options.quota,
        lease_timeout=options.lease_timeout,
        claim_timeout=options.claim_timeout,
        counts=counts,
    )
    journal = Journal(
        options.journal, plan={"t": "plan", "batches": batches, "epochs": options.epochs, **plan}, counts=counts
    )
    records = journal.read()
    book.restore(records, now)
    return book, journal, len(records)


class LeaseDispatcher:
    """`with LeaseDispatcher(plan, batches, options) as d: d.wait()`; `d.endpoint` is bound."""

    def __init__(
        self,
        plan: dict,
        batches: int,
        options: DispatcherOptions,
        *,
        keys: ServerKeys | None = None,
        counts: Counts | None = None,
        identity: str | Mapping | None = None,
    ):
        """``identity``: the stream's fingerprint (`crossfeed.read.identity`), or its whole
        identity (`StreamIdentity.to_json`): the fingerprint is journaled with the plan (a journal
        of another stream is refused, naming both) and sent to every server, which refuses to
        serve another stream; the whole identity's settings go with it in WELCOME (``"stream"``)
        when they fit a message, so that the server names each setting that differs."""
        settings = None
        if isinstance(identity, Mapping):
            settings, identity = identity.get("settings"), identity.get("fingerprint")
        if identity is not None:
            plan = {**plan, "identity": identity}
        welcome = json.dumps(plan)
        if settings is not None and len((full := json.dumps({**plan, "stream": settings})).encode()) <= W.MAX_TEXT:
            welcome = full
        if len(welcome.encode()) > W.MAX_TEXT:
            raise ConfigError(
                f"the dispatcher's plan is {len(welcome.encode()):,} bytes of JSON, more than one message holds "
                f"({W.MAX_TEXT:,}): fewer features or sources"
            )
        self._welcome = welcome
        if keys is None and not options.insecure and not is_local(options.address):
            raise ConfigError(
                f"refusing to dispatch on {options.address} without authentication: pass CURVE keys "
                "(--auth-keys), bind ipc:// or loopback, or --insecure on a trusted network"
            )
        self.options, self.plan, self.batches = options, plan, batches
        self.instance = P.new_instance()
        self.book, self.journal = recover(plan, batches, options, time.monotonic(), counts)
        # claim_messages, done_messages: the trainers' (each claims or reports several batches)
        self.stats = {
            "dropped_messages": 0,
            "leases": 0,
            "granted": 0,
            "refused": 0,
            "claim_messages": 0,
            "done_messages": 0,
        }
        self._started = time.monotonic()
        self._status_gate = StatusGate()
        self._waits: dict[int, tuple[float, float]] = {}  # trainer id -> (its last wait share, when reported)
        self.snapshot: dict = self.status()  # refreshed by the loop every SNAPSHOT s (for exporters)
        self._keys = keys
        self._ctx = zmq.Context()
        self._auth = start_authenticator(self._ctx, keys) if keys is not None else None
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.linger = 0
        secure_server_socket(self._sock, keys)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.MAXMSGSIZE, W.MAX_MESSAGE)
        try:
            self._sock.bind(P.bind_address(options.address))
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ConfigError(f"cannot bind {options.address}: {e}") from e
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._routes: dict[int, bytes] = {}  # server id -> its routing id
        self._trainer_routes: dict[int, bytes] = {}  # trainer id -> its routing id (to tell them FINISHED)
        self._pages: dict[int, int] = {}  # trainer id -> where its next SERVERS page starts
        self._out: list[tuple[bytes, list]] = []  # answers, sent once the journal holds the changes
        self._log = P.RateLimitedLog(logger)
        self._stop = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="crossfeed-dispatcher", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> LeaseDispatcher:
        self._thread.start()
        return self

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        else:
            self._close_sockets()

    def __enter__(self) -> LeaseDispatcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _close_sockets(self) -> None:
        self._sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()
        self.journal.close()

    # ---- the loop ----
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # reported through `error`, never swallowed
            self.error = e
            logger.exception("dispatcher failed")
        finally:
            self._close_sockets()
            self._done.set()

    def _loop(self) -> None:
        hb, book = self.options.heartbeat, self.book
        finished_at: float | None = None
        next_report, last_report, next_snapshot = 0.0, None, 0.0
        while not self._stop.is_set():
            if self._sock.poll(int(min(hb.interval / 2, 0.05) * 1000)):
                self._receive()
            now = time.monotonic()
            gone, dead = book.expire(now)
            for server in gone:
                self._routes.pop(server, None)
            for trainer in dead:
                self._trainer_routes.pop(trainer, None)
                self._pages.pop(trainer, None)
                self._waits.pop(trainer, None)
            leases = book.grant_leases(now)
            self.journal.append(book.take_records())  # durable before anyone hears of it
            if self.journal.due():
                self.journal.compact(book.snapshot())
            for lease in leases:
                self.stats["leases"] += 1
                msg = W.pack(
                    W.Kind.LEASE,
                    lease=lease.id,
                    epoch=lease.epoch,
                    batches=self.batches,
                    payload=list(zip(lease.batches, lease.tokens)),
                    instance=self.instance,
                )
                self._out.append((self._routes[lease.server], msg))
            for server, taken_back in book.take_taken().items():  # so that it does not build them
                route = self._routes.get(server)
                for lid, batches in taken_back.items():
                    if route is not None:
                        taken = W.pack(W.Kind.TAKEN, lease=lid, payload=batches, instance=self.instance)
                        self._out.append((route, taken))
            self._flush()
            if now >= next_snapshot:
                next_snapshot = now + SNAPSHOT
                self.snapshot = self.status()
            if now >= next_report:
                next_report = now + 2.0
                report = (book.progress(), len(book.servers), len(book.trainers))
                if report != last_report:
                    last_report = report
                    logger.info("progress %s; %d servers, %d trainers live", *report)
            if book.finished and finished_at is None:
                finished_at = now
                logger.info(
                    "every epoch is done (%d batches granted in %d CLAIM messages, %d DONE messages; %d journal "
                    "writes); answering FINISHED for %.1fs",
                    self.stats["granted"],
                    self.stats["claim_messages"],
                    self.stats["done_messages"],
                    self.journal.syncs,
                    self.options.linger,
                )
                for route in self._routes.values():
                    self._send(route, W.pack(W.Kind.FINISHED, instance=self.instance))
                timeout_ms = int(self.options.heartbeat.timeout * 1000)
                for route in self._trainer_routes.values():  # c=0: confirms no BEAT
                    self._send(
                        route,
                        W.pack(W.Kind.SERVERS, finished=1, timeout_ms=timeout_ms, instance=self.instance, payload=""),
                    )
            if finished_at is not None and now - finished_at > self.options.linger:
                return

    def _receive(self) -> None:
        for _ in range(1000):
            try:
                frames = P.recv_bounded(self._sock, 3, W.MAX_MESSAGE)
            except zmq.Again:
                return
            except WireError as e:
                self._bad(e)
                continue
            try:
                if len(frames) < 2:
                    raise WireError("message without an envelope")
                self._handle(frames[0].bytes, frames[1:])
            except WireError as e:
                self._bad(e)
            except Exception as e:  # a bug met on a peer's bytes: that message goes, not the dispatcher
                self.stats["dropped_messages"] += 1
                self._log.log(logging.ERROR, "broken", "a message could not be handled; dropped it", exc_info=e)

    def _bad(self, error: Exception) -> None:
        self.stats["dropped_messages"] += 1
        self._log.warning("bad", "dropped a malformed message: %s", error)

    def _handle(self, route: bytes, frames: list) -> None:
        if is_status(frames[0]):  # `crossfeed top` asks: answered whoever asks, at most RATE a second
            rid = request_id(frames)
            if self._status_gate.allow(time.monotonic()):
                self._send(route, pack_answer(rid, self.status()))
            return
        msg = W.unpack(frames, W.SERVER_KINDS | W.TRAINER_KINDS)
        if msg.sender == 0:
            raise WireError("sender id 0")
        now, book = time.monotonic(), self.book
        role = SERVER if msg.kind is W.Kind.HELLO else TRAINER if msg.kind in (W.Kind.CLAIM, W.Kind.DONE) else msg.role
        if role == SERVER:
            if msg.wait_permille:
                raise WireError("a server's BEAT reports a trainer's wait")
            if msg.kind is W.Kind.HELLO:
                address = " ".join(W.endpoints(msg.payload))
                if not book.server_seen(msg.sender, now, address):
                    self._reply(route, W.Kind.RESET)
                    return
                self._routes[msg.sender] = route
                self._reply(route, W.Kind.WELCOME, batches=self.batches, payload=self._welcome)
            elif msg.kind is W.Kind.BYE:
                if msg.sender in book.servers:
                    book.remove_server(msg.sender, "left")
                self._routes.pop(msg.sender, None)
            elif not book.server_seen(msg.sender, now):
                self._reply(route, W.Kind.RESET)
            elif book.finished:
                self._reply(route, W.Kind.FINISHED)
            elif msg.kind is W.Kind.BEAT and (unstarted := W.decode_unstarted(msg.sent_ms)) is not None:
                book.server_progress(msg.sender, unstarted, now)
            return
        if role != TRAINER:
            raise WireError(f"{msg.kind.name} names role {msg.role}, expected {SERVER} or {TRAINER}")
        if msg.kind is W.Kind.BYE:
            self._trainer_routes.pop(msg.sender, None)
            self._pages.pop(msg.sender, None)
            self._waits.pop(msg.sender, None)
            if msg.sender in book.trainers:
                book.remove_trainer(msg.sender, "left")
            return
        self._trainer_routes[msg.sender] = route
        if not book.trainer_seen(msg.sender, now):
            self._reply(route, W.Kind.RESET)
            return
        if msg.kind is W.Kind.BEAT:
            wait = W.decode_wait(msg.wait_permille)
            if wait is not None:  # not reported: the last report stands (with its age)
                self._waits[msg.sender] = (wait, now)
            servers = self._page(msg.sender)
            self._reply(
                route,
                W.Kind.SERVERS,
                finished=int(book.finished),
                timeout_ms=int(self.options.heartbeat.timeout * 1000),
                sent_ms=msg.sent_ms,
                payload=servers,
            )
        elif msg.kind is W.Kind.CLAIM:
            self.stats["claim_messages"] += 1
            answers = [
                (int(seq), int(token), int(book.claim(msg.sender, int(seq), int(token), now=now)))
                for seq, token in msg.payload
            ]
            granted = sum(ok for _, _, ok in answers)
            self.stats["granted"] += granted
            self.stats["refused"] += len(answers) - granted
            self._reply(route, W.Kind.GRANTS, payload=answers)
        elif msg.kind is W.Kind.DONE:
            self.stats["done_messages"] += 1
            confirmed = [int(seq) for seq in msg.payload if book.done(msg.sender, int(seq), now=now)]
            self._reply(route, W.Kind.DONE_OK, finished=int(book.finished), payload=confirmed)

    def status(self) -> dict:
        """What `crossfeed top` is told (`crossfeed.net.status.DispatcherStatus`), built on the
        loop's thread (other threads read `snapshot`): at most MAX_LISTED servers and trainers,
        the least recently heard first."""
        book, now = self.book, time.monotonic()
        servers = sorted(book.servers.items(), key=lambda kv: kv[1].last_seen)[:MAX_LISTED]
        trainers = sorted(book.trainers.items(), key=lambda kv: kv[1].last_seen)[:MAX_LISTED]
        rates: dict[int, Any] = {k: book.rate(k, now) for k in book.servers}  # batches/s (None: not yet)
        total = sum(r for r in rates.values() if r)
        return {
            "v": 1,
            "kind": "dispatcher",
            "uptime": round(now - self._started, 3),
            "epoch": book.epoch,
            "epochs": book.epochs,
            "batches": book.n,
            "finished": book.finished,
            "progress": book.progress(),
            "counters": {
                **{k: self.stats[k] for k in ("leases", "granted", "refused", "dropped_messages")},
                **book.counts,
            },
            "servers": [
                {
                    "id": f"{k:016x}",
                    "address": m.address,
                    "age": round(max(now - m.last_seen, 0.0), 3),
                    "leases": book.held(k),
                    "leased": book.outstanding(k),
                    "claimed": book.claimed_from.get(k, 0),
                    "rate": None if rates[k] is None else round(rates[k], 3),
                    "share": round(min(rates[k] / total, 1.0), 4) if total and rates[k] is not None else None,
                }
                for k, m in servers
            ],
            "servers_total": len(book.servers),
            "trainers": [
                {"id": f"{k:016x}", "age": round(max(now - m.last_seen, 0.0), 3)}
                | dict(zip(("claimed", "holding"), book.claims_of(k)))
                | self._wait_of(k, now)
                for k, m in trainers
            ],
            "trainers_total": len(book.trainers),
        }

    def _wait_of(self, trainer: int, now: float) -> dict:
        """The status fields of `trainer`'s last reported wait share: "wait" in [0, 1] and
        "wait_age" in seconds, both None until it reports one."""
        if trainer not in self._waits:
            return {"wait": None, "wait_age": None}
        wait, at = self._waits[trainer]
        return {"wait": wait, "wait_age": round(max(now - at, 0.0), 3)}

    def _page(self, trainer: int) -> str:
        """The next page of live servers' endpoints for `trainer`: as many servers as fit in one
        SERVERS message, starting where its last page ended (each server's registration is
        bounded by `W.endpoints`, so no server can crowd the others out of every page)."""
        members = list(self.book.servers.values())
        if not members:
            return ""
        start = self._pages.get(trainer, 0) % len(members)
        page: list[str] = []
        size = 0
        for i in range(len(members)):
            address = members[(start + i) % len(members)].address
            size += len(address.encode()) + 1
            if size - 1 > W.MAX_TEXT:
                break
            page.append(address)
        self._pages[trainer] = start + len(page)
        return " ".join(page)

    def _reply(self, route: bytes, kind: W.Kind, payload=None, **slots: int) -> None:
        self._out.append((route, W.pack(kind, instance=self.instance, payload=payload, **slots)))

    def _flush(self) -> None:
        out, self._out = self._out, []
        for route, frames in out:
            self._send(route, frames)

    def _send(self, route: bytes, frames: list) -> None:
        try:
            self._sock.send_multipart([route, *frames], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # gone (or not reading): its silence will tell
            logger.debug("could not send to %s: %s", route.hex(), e)
