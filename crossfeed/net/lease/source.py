"""The producing side of `serve --dispatcher`: batches built from the dispatcher's leases.

A thread holds one DEALER to the dispatcher: it says HELLO (this server's data endpoints),
learns the plan (WELCOME: split, batch size, shuffle, seed and the epoch's batch count, which
must match what the local dataset gives), beats every heartbeat interval, and builds the batch
numbers of each LEASE with a Loader over the local copy of the dataset (batch `b` of epoch `e`
is batch `b // W` of rank `b % W` in the Loader's plan for `W` ranks, W = the plan's world_size,
1 unless the trainers are lockstep DDP ranks; fetched, decoded, filtered and transformed as the
Loader does, each sample's generator keyed by the lease's epoch). A plan with skipped steps is
leased without them: batch `b` of epoch `e` is then the epoch's kept step `b // W` (its plan step
`Kept.plan_batch(b // W)`) of rank `b % W`; the skip list is this server's own (``--skip``), and
WELCOME's identity (with its settings, to name what differs) must be this server's.
A packed plan (`pack`, one rank) has a batch count of its own each epoch, and its global ids a
fixed stride (`book.PACKED_STRIDE`, which WELCOME carries as the batch count): batch `b` of
epoch `e` is the plan's `b`-th batch of rows, found by one forward walk over the epoch's rows
(`PackWalker`; a batch behind the walk, leased again after a server died, walks on from the
nearest packer cursor before it, not from the epoch's start). With skipped steps a packed
epoch's count is its kept steps, and batch `b` is its kept step `b`: plan batch
`Kept.plan_batch(b)` of the walk (`StepSkipWalker`), whose skipped rows are walked past as
integers, never built. Each batch goes to the server's queue as an `Item` with seq `e * batches + b` and the
batch's claim token (from the LEASE; it travels in the BATCH envelope's token, to the one trainer
the batch goes to, which quotes it when it claims the batch). Yields, like `Producer`:
    Item(seq, epoch, frames, n, lease)   one encoded batch
    StreamEnd(epochs)                    the dispatcher said FINISHED
    ProducerFailed(message)              building failed; nothing follows

The batches are built by the Loader's executor (`--threads` threads or `--procs` worker
processes), in a second thread that feeds it the batches of the leases already received, in
order (look-ahead bounded by the executor's window and the server's queue), while this thread
keeps beating and reading the dispatcher.

RESET (the dispatcher declared us dead, or restarted without knowing us): the leases not yet
built are dropped and we say HELLO under a new id; a batch of a void lease that the executor
was already building is dropped when it is done, never offered; what was already sent is
refused to the trainers by the dispatcher (their claims quote revoked tokens), never used twice.
Each BEAT tells the dispatcher how many leased batches are not yet started (`_todo`, the last
ones received): it may take them back for a faster server (`LeaseBook`, "Mixed speeds") and says
which (TAKEN): they leave `_todo` unbuilt (a straggler spent its time building batches that
would be refused, and fell behind on its own); one it took back and this server builds anyway
(started meanwhile) is refused to the trainers, never used twice.
`stop()` says BYE first: the dispatcher gives our unclaimed batches to the other servers.
"""

from __future__ import annotations

import collections
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from crossfeed.errors import ConfigError, WireError
from crossfeed.net import protocol as P
from crossfeed.net.keys import ClientKeys, secure_client_socket
from crossfeed.net.lease import messages as W
from crossfeed.net.lease.book import PACKED_STRIDE
from crossfeed.net.stream.producer import Prefetch, ProducerFailed, StreamEnd, encode_item, put_until
from crossfeed.read.identity import StreamIdentity
from crossfeed.read.stages.recipes import StepSkipSampler, tag
from crossfeed.read.stages.sampler import Sampler

if TYPE_CHECKING:
    from crossfeed.read.loader import Loader

logger = logging.getLogger(__name__)
SERVER = 1

# builds the Loader for the dispatcher's plan (`LoaderOptions.plan_fields`, a dict of option fields) -> Loader
LoaderFactory = Callable[[dict], "Loader"]


def _differences(fingerprint, settings, ours: StreamIdentity) -> str:
    """What differs between the dispatcher's stream (its ``settings`` as WELCOME carried them,
    checked like a saved state's) and ``ours``, by name; the generic reasons without them."""
    try:
        theirs = StreamIdentity.from_json(
            {"version": 1, "fingerprint": fingerprint, "settings": settings}, "the dispatcher's identity"
        )
    except ConfigError:
        return "another dataset, another version of it, or other settings"
    diffs = theirs.differences(ours)  # "<name> was <the dispatcher's>, is <this server's>"
    if not diffs:
        return "other settings"
    return "was: the dispatcher's, is: this server's: " + "; ".join(diffs)


def advertised(endpoints: list[str]) -> str:
    """Bound endpoints as other machines reach them (a wildcard host becomes this host's name)."""
    out = []
    for e in endpoints:
        for wild in ("tcp://0.0.0.0:", "tcp://*:"):
            if e.startswith(wild):
                e = f"tcp://{socket.getfqdn()}:" + e[len(wild) :]
        out.append(e)
    return " ".join(out)


class LeaseSource:
    def __init__(
        self,
        dispatcher: str,
        make_loader: LoaderFactory,
        endpoints: list[str],
        *,
        server_id: str,
        keys: ClientKeys | None = None,
        heartbeat: P.Heartbeat = P.Heartbeat(),
        prefetch: int = 8,
        on_put: Callable[[], None] | None = None,
    ):
        self._dispatcher, self._make_loader, self._keys = dispatcher, make_loader, keys
        self._endpoints = advertised(endpoints)
        self._server_id, self._hb, self._on_put = server_id, heartbeat, on_put
        self.queue = Prefetch(prefetch)
        # (join, lease, epoch, b, batches, token), join: the `_joins` count when the lease came
        self._todo: collections.deque[tuple[int, int, int, int, int, int]] = collections.deque()
        self._todo_lock = threading.Lock()  # a TAKEN filters `_todo` while the builder pops it
        self._joins = 0  # bumped by each RESET: tasks of an earlier join are void
        self._work = threading.Event()  # set when leases arrive
        self._loader: Loader | None = None
        self._samplers: list[Sampler] = []
        self._walker: Any = None  # a `PackWalker`: a packed plan's batches (builder thread only)
        self._plans: dict[tuple[int, int], Any] = {}  # (rank, epoch) -> Plan (builder thread only)
        self._skips: StepSkipSampler | None = None  # a plan with skipped steps (leased without them)
        self._kept: tuple[int, Any] | None = None  # (epoch, its `Kept` steps) (builder thread only)
        self._builder: threading.Thread | None = None
        self._halt = threading.Event()  # stops the builder thread
        self._batches = 0
        self._id = P.new_instance()
        self._instance = 0  # the dispatcher process we talk to
        self._welcomed = False
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._thread = threading.Thread(target=self._run, name="crossfeed-lease-source", daemon=True)
        self.stats = {"leases": 0, "built": 0, "resets": 0, "dropped": 0, "passes": 0, "taken_back": 0}

    @property
    def loader(self) -> Loader | None:
        """The Loader building the leases (None until the dispatcher welcomed us)."""
        return self._loader

    def start(self) -> LeaseSource:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ---- the thread ----
    def _open(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.linger = 500
        sock.setsockopt(zmq.MAXMSGSIZE, W.MAX_MESSAGE)
        secure_client_socket(sock, self._keys)
        sock.connect(self._dispatcher)
        return sock

    def _send(self, sock: zmq.Socket, kind: W.Kind, payload=None, **slots: int) -> None:
        try:
            sock.send_multipart(W.pack(kind, role=SERVER, sender=self._id, payload=payload, **slots), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            logger.debug("could not send %s to the dispatcher: %s", kind.name, e)

    def _run(self) -> None:
        sock = self._open()
        next_beat = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + self._hb.interval
                    if self._welcomed:  # with the leased batches not yet started (the dispatcher may take them back)
                        self._send(sock, W.Kind.BEAT, unstarted=W.encode_unstarted(len(self._todo)))
                    else:
                        self._send(sock, W.Kind.HELLO, self._endpoints)
                if self._builder is not None and not self._builder.is_alive():
                    return  # building failed: ProducerFailed is queued, nothing follows
                if sock.poll(int(min(self._hb.interval / 2, 0.05) * 1000)):
                    if self._receive(sock):
                        return
        except Exception as e:  # crosses to the server loop wrapped, never swallowed
            logger.exception("serving the dispatcher's leases failed")
            self._halt_builder()
            self._put(ProducerFailed(f"{type(e).__name__}: {e}"))
        finally:
            if self._welcomed:
                self._send(sock, W.Kind.BYE)  # hand back what we hold (the server is stopping)
            sock.close(linger=500)
            self._ctx.term()
            self._halt_builder()
            if self._loader is not None:
                self._loader.close()
            logger.info("lease source done: %s", self.stats)

    def _halt_builder(self) -> None:
        self._halt.set()
        self._work.set()
        if self._builder is not None and self._builder is not threading.current_thread():
            self._builder.join(30)
            if self._builder.is_alive():
                logger.warning("the batch builder did not stop in 30 s; closing the Loader under it")

    def _receive(self, sock: zmq.Socket) -> bool:
        """Handle what the dispatcher sent; True once it said FINISHED."""
        for _ in range(100):
            try:
                frames = P.recv_bounded(sock, 2, W.MAX_MESSAGE)
            except zmq.Again:
                return False
            except WireError as e:
                logger.warning("dropped a malformed message from the dispatcher: %s", e)
                continue
            try:
                msg = W.unpack(frames, W.TO_SERVER)
            except WireError as e:
                logger.warning("dropped a malformed message from the dispatcher: %s", e)
                continue
            if msg.instance != self._instance:
                if self._instance:
                    logger.warning("the dispatcher restarted: our leases are void, joining afresh")
                    self._reset()
                self._instance = msg.instance
            if msg.kind is W.Kind.WELCOME:
                self._welcome(msg)
            elif msg.kind is W.Kind.LEASE:
                if not self._welcomed or msg.batches != self._batches or msg.epoch < 0:
                    logger.warning("dropped a lease that does not fit the plan we were welcomed with")
                    continue
                pairs = [(int(b), int(token)) for b, token in msg.payload]
                if any(not 0 <= b < self._batches or token <= 0 for b, token in pairs):
                    logger.warning(
                        "dropped lease %d: batch numbers outside 0..%d, or tokens not positive",
                        msg.lease,
                        self._batches - 1,
                    )
                    continue
                self.stats["leases"] += 1
                self._todo.extend((self._joins, msg.lease, msg.epoch, b, msg.batches, t) for b, t in pairs)
                self._work.set()
            elif msg.kind is W.Kind.TAKEN:  # batches of a lease given to a faster server: not to build
                gone = {int(b) for b in msg.payload}
                with self._todo_lock:
                    before = len(self._todo)
                    self._todo = collections.deque(t for t in self._todo if t[1] != msg.lease or t[3] not in gone)
                    self.stats["taken_back"] += before - len(self._todo)
            elif msg.kind is W.Kind.RESET:
                logger.warning("the dispatcher does not know us (declared dead, or restarted): joining afresh")
                self._reset()
            elif msg.kind is W.Kind.FINISHED:
                logger.info("the dispatcher says every epoch is done")
                self._halt_builder()  # nothing may follow the end
                self._put(StreamEnd(0))
                return True
        return False

    def _reset(self) -> None:
        self.stats["resets"] += 1
        self._joins += 1  # before the clear: the builder drops what it still takes of the old join
        self._todo.clear()
        self._id = P.new_instance()
        self._welcomed = False

    def _welcome(self, msg: W.Message) -> None:
        try:
            plan = json.loads(msg.payload)
        except ValueError as e:
            raise WireError(f"the dispatcher's plan is not JSON: {e}") from e
        if not isinstance(plan, dict):
            raise WireError(f"the dispatcher's plan is not an object of options: {type(plan).__name__}")
        world = plan.get("world_size", 1)
        if isinstance(world, bool) or not isinstance(world, int) or not 1 <= world <= 1 << 16:
            raise WireError(f"the dispatcher's plan names world_size {world!r}")
        identity = plan.pop("identity", None)  # the stream the dispatcher plans (`crossfeed.read.identity`)
        settings = plan.pop("stream", None)  # its settings, to name what differs (absent: too long to send)
        if self._loader is None:
            self._loader = self._make_loader(plan)
            ours = self._loader.pipeline.identity
            if identity is not None and identity != ours.fingerprint:
                raise ConfigError(
                    f"the dispatcher plans stream {str(identity)[:32]!r}; this server's dataset and options give "
                    f"{ours.fingerprint!r} ({_differences(identity, settings, ours)}): serve the same "
                    "dataset, by content, that the dispatcher plans, with the same --skip and --weights"
                )
            if self._loader.options.plan.pack is not None:  # batch b of epoch e (kept step b): its rows, walked
                if world != 1 or msg.batches != PACKED_STRIDE:
                    raise ConfigError(
                        f"the dispatcher's packed plan names world_size {world} and a stride of {msg.batches} "
                        f"batches; this server leases packed batches for world_size 1 with a stride of {PACKED_STRIDE}"
                    )
                self._walker = self._loader.pipeline.walker()
                mine = msg.batches
            else:
                # one dataset's shards, or a mixture's sources (weights or schedules) planned alike
                self._samplers = [self._loader.pipeline.rank_sampler(r, world) for r in range(world)]
                mine = world * self._samplers[0].rank_batch_count()
                # skipped steps: the dispatcher leases only the kept ones, numbered without the others
                self._skips = self._loader.pipeline.step_skips
            if mine != msg.batches:
                raise ConfigError(
                    f"the dispatcher's plan has {msg.batches} batches per epoch, this server's dataset gives "
                    f"{mine} with the same options: serve the same dataset the dispatcher plans"
                )
            self._batches = msg.batches
            self._builder = threading.Thread(
                target=self._build, args=(self._loader,), name="crossfeed-lease-builder", daemon=True
            )
            self._builder.start()
        self._welcomed = True
        logger.info("joined the dispatcher at %s as %016x", self._dispatcher, self._id)

    # ---- the builder thread ----
    def _build(self, loader) -> None:
        """Build the leased batches through the Loader's pipeline (`Pipeline.batches`), one pass per run of leases
        already received (a pass ends when none is left), and hand them to the server in order."""
        taken: collections.deque = collections.deque()  # the tasks in the executor, in order
        try:
            while not self._halt.is_set():
                self._work.wait(0.1)
                self._work.clear()
                if not self._todo:
                    continue
                taken.clear()
                self.stats["passes"] += 1
                for batch in loader.pipeline.batches(self._indices(taken)):
                    task = taken.popleft()
                    if self._halt.is_set():
                        return
                    self._offer(task, batch)
        except Exception as e:  # crosses to the server loop wrapped, never swallowed
            if self._halt.is_set():  # the Loader was closed under a batch: we are stopping
                return
            where = ""
            if taken:  # the batch whose result was awaited
                _, lease, epoch, b, _, _ = taken[0]
                where = f" (building batch {b} of epoch {epoch}, lease {lease})"
            logger.exception("building the dispatcher's leases failed%s", where)
            self._put(ProducerFailed(f"{type(e).__name__}{where}: {e}"))

    def _indices(self, taken: collections.deque):
        """The sample ids of each leased batch still to build (of the current join), until none
        is left: only leases already received are built ahead."""
        world = len(self._samplers)  # batch b is batch b // world of rank b % world
        while not self._halt.is_set():
            with self._todo_lock:
                if not self._todo:
                    return
                task = self._todo.popleft()
            if task[0] != self._joins:
                continue
            _, _, epoch, b, _, _ = task
            if self._walker is not None:
                taken.append(task)
                yield self._walker.batch(epoch, b)
                continue
            key = (b % world, epoch)
            plan = self._plans.get(key)
            if plan is None:  # one Plan per rank and epoch: it keeps the order's chunk it last evaluated
                if len(self._plans) >= 2 * world:
                    self._plans.clear()
                plan = self._plans[key] = self._samplers[b % world].plan(epoch, 0)
            step = b // world
            if self._skips is not None:  # the epoch's kept step `step` is plan step `kept.plan_batch(step)`
                if self._kept is None or self._kept[0] != epoch:
                    self._kept = (epoch, self._skips.kept(epoch, 0))
                step = self._kept[1].plan_batch(step)
            taken.append(task)
            yield tag(plan.batch(step), epoch)  # its epoch keys the per-sample generators

    def _offer(self, task: tuple[int, int, int, int, int, int], batch) -> None:
        """Hand a built batch to the server, unless its lease went void meanwhile (RESET)."""
        join, lease, epoch, b, batches, token = task
        item = encode_item(batch, epoch=epoch, seq=epoch * batches + b, server_id=self._server_id)
        item.lease = token  # Item.lease travels as the BATCH envelope's token: the batch's claim token
        self.stats["built"] += 1
        if not put_until(self.queue, item, self._halt, self._on_put, void=lambda: join != self._joins):
            if join != self._joins:
                self.stats["dropped"] += 1
                logger.debug("dropped batch %d of void lease %d", b, lease)

    def _put(self, item) -> None:
        put_until(self.queue, item, self._stop, self._on_put)
