"""Who builds and who may use each batch of an epoch, as pure bookkeeping (no sockets, no clock).

The dispatcher's plan is integers: epoch `e` has `batches` batches numbered 0..batches-1 (the
Loader's plan with one rank); the global id of batch `b` of epoch `e` is `e * batches + b`, and
that is the `seq` the batch travels under. With `counts` (packed rows, whose number changes with
the epoch), epoch `e` has `counts(e)` batches (at most `batches`, which is then only the stride of
the global ids: batch `b` of epoch `e` is still `e * batches + b`; skipped steps leave an epoch
fewer, none when every step of it is skipped: it ends at once). A `quota` then scales with the
epoch: `quota * counts(e) // batches` (lockstep ranks of an epoch with skipped steps each use its
kept steps). Each batch of the current epoch is in one state:

    PENDING   nobody builds it
    LEASED    lease `lease_of[b]` of a live server builds and sends it
    CLAIMED   trainer `claimer[b]` received it and was granted it (the commit point)
    DONE      that trainer consumed it

Exactly once: a trainer uses a batch only after `claim(trainer, seq, token)` granted it, and a
claim is granted only for a batch LEASED under that very token, or already CLAIMED by the same
trainer with it (a repeated claim whose answer was lost). Each leased batch gets its own random
63-bit claim token (`Lease.tokens`), which only its server learns and sends only with the batch:
a claim proves the claimant received that batch from that server, and cannot be guessed. A
revoked lease's batches are PENDING or leased again under new tokens, so a stalled server that
wakes up is refused (fencing). Lease ids are random 63-bit numbers too.

A server that dies, stalls or leaves has its LEASED batches put back to PENDING; a trainer that
dies or stalls has its CLAIMED (not DONE) batches put back. DONE batches never go out again.
Progress deadlines (`lease_timeout`, `claim_timeout`; None: never) catch those that beat but
do not work:
    a server holding leased batches none of which is claimed for `lease_timeout` s is stalled
        (a hung transform, or a hostile server): removed and fenced as if dead;
    a lease with batches still unclaimed `lease_timeout` s after a later lease of its server
        had a batch claimed is overtaken (its batches were lost on the way, or wait unclaimed
        at a trainer whose loop hangs): revoked, its unclaimed batches leased again;
    a trainer holding claimed batches and reporting none DONE for `claim_timeout` s is
        stalled (its loop hangs while its client thread beats): removed and fenced as if dead.

Mixed speeds: each server's rate is measured from the claims of its batches (batches per second,
decayed over RATE_TAU s; `rate`). A server whose rate is known may hold HORIZON s of its own work
leased and unclaimed (at least 2 batches, at most `window`; one not yet measured: two leases), so a
slow server holds few batches and a fast one many, and new leases go to the server whose work in
hand ends soonest; at the epoch's tail (fewer batches PENDING than a lease for each of several
servers) leases are of one batch, so that the servers' last batches end together. When no batch
is PENDING (the epoch's tail, or a stalled server holding the last ones), a server with room
takes batches over from the one whose work in hand ends last among those STEAL_MARGIN times
slower than itself, if it would deliver them STEAL_MARGIN times sooner (`_steal`): the newest
lease's last batches, those its server has least likely started, are revoked from it and leased
to the faster one under new tokens, and the slow server is told which (`take_taken`, the
dispatcher's TAKEN) so that it does not build them (a copy built anyway is refused: the same
fencing as for a revoked lease). Only batches the server reports not yet started are taken
(each BEAT says how many: the tail of its newest leases, `server_progress`), so a batch is
seldom built twice; a server that reports nothing gives up nothing this way. A server that delivers nothing while it
holds work for GRACE s (and 4 of its own batch times) is stalled (`_stalled`): its rate is bounded
by 2 / (those seconds), every leased batch of it may be taken (`_stealable`), and it may hold one
batch at a time until it delivers again, so a stalled server's work moves to the others within
seconds, long before `lease_timeout` removes it. Those seconds (`quiet`) are its holds added up
since it last delivered, across epochs and work taken from it: it is judged once, not again at
each epoch's start (where it would hold each epoch's end for GRACE s). Work taken over is
counted in `counts["batches_taken_over"]`.

Durability: every change a restarted dispatcher must know (claims with their tokens, dones,
epoch advances) is appended to `records` before the change is answered; the dispatcher writes
them to its journal (fsync) before it replies. `LeaseBook.restore` replays them: leases do not
survive a restart (every LEASED batch is PENDING again, under new leases and tokens).
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import math
import secrets
from collections.abc import Callable
from typing import Any

from crossfeed.errors import ConfigError
from crossfeed.net.protocol import RateLimitedLog

logger = logging.getLogger(__name__)

PENDING, LEASED, CLAIMED, DONE = 0, 1, 2, 3
MAX_REMEMBERED = 4096  # dead ids remembered (to fence them)
LOG_BURST = 20  # lines of one kind (servers declared dead, ...) per 5 s, at most; the rest are counted
MAX_SERVERS = 4096  # live servers at once; a HELLO beyond is refused (RESET) until one goes
# a plan whose batch count changes with the epoch (packed rows): global ids e * PACKED_STRIDE + b,
# within an int64 for every epoch below MAX_PACKED_EPOCHS
PACKED_STRIDE = 1 << 32
MAX_PACKED_EPOCHS = 1 << 30
# rates (see "Mixed speeds" in the module docstring)
RATE_TAU = 2.0  # s: a server's rate is its claimed batches, decayed with this time constant
HORIZON = 0.5  # s of a server's own measured work it may hold leased (between 2 and `window` batches)
STEAL_MARGIN = 1.5  # a batch moves only if its new server would deliver it this many times sooner
GRACE = 1.0  # s a server that never delivered holds work before its work may be taken over
STEAL_SLACK = 0.02  # s, added to the new server's time (the new lease's trip)


def random_token() -> int:
    """A random 63-bit number, 1..2**63-1 (lease ids and claim tokens: unguessable, never 0)."""
    return secrets.randbelow((1 << 63) - 1) + 1


@dataclasses.dataclass
class Lease:
    id: int
    server: int
    epoch: int
    batches: list[int]  # batch numbers within the epoch
    tokens: list[int]  # the claim token of each batch (sent to its server only)
    overtaken: float | None = None  # when a later lease of its server had a batch claimed


@dataclasses.dataclass
class Member:
    """A live server or trainer as the book sees it."""

    last_seen: float
    address: str = ""  # a server's data endpoints (space separated)


class LeaseBook:
    """Leases of one epoch at a time; `epochs` None: without end."""

    def __init__(
        self,
        batches: int,
        *,
        epochs: int | None,
        lease_size: int = 4,
        window: int = 8,
        timeout: float = 10.0,
        quota: int | None = None,
        lease_timeout: float | None = None,
        claim_timeout: float | None = None,
        tokens: Callable[[], int] = random_token,
        counts: Callable[[int], int] | None = None,
    ):
        if batches < 1:
            raise ConfigError(f"an epoch needs at least one batch, got {batches}")
        if epochs is not None and epochs < 1:
            raise ConfigError(f"epochs must be >= 1 or None, got {epochs}")
        if lease_size < 1 or window < lease_size:
            raise ConfigError(f"need 1 <= lease_size ({lease_size}) <= window ({window})")
        self.batches, self.epochs = batches, epochs  # the stride of global ids (and every epoch's count)
        self._counts = counts  # epoch -> its batches (None: `batches` every epoch)
        self.lease_size, self.window, self.timeout = lease_size, window, timeout
        self.lease_timeout, self.claim_timeout = lease_timeout, claim_timeout
        self._token = tokens  # draws lease ids and claim tokens
        # lockstep DDP: each trainer uses at most `quota` batches of an epoch (equal counts per rank;
        # with `counts`, scaled by the epoch's count: `_start_epoch`)
        self._quota = self.quota = quota
        self._claims: dict[int, int] = {}  # batches of this epoch each trainer claimed
        self.epoch = 0
        self.finished = False
        # per batch of the current epoch (`_start_epoch`): its state, lease, claim token (of a
        # LEASED or CLAIMED batch) and claimer; `n` batches
        self.n = 0
        self._start_epoch()
        self.leases: dict[int, Lease] = {}  # live leases: those with a batch still LEASED under them
        self._left: dict[int, int] = {}  # lease id -> its batches still LEASED under it
        self._load: dict[int, int] = {}  # server -> batches LEASED to it (not yet claimed)
        self._by_server: dict[int, dict[int, None]] = {}  # server -> its live lease ids, oldest first
        self._idle_since: dict[int, float] = {}  # server with load -> when one of its batches was last claimed
        # server -> seconds it held work without delivering a batch, before its current hold, since
        # it last delivered one (kept across epochs and work taken back: a stalled server is judged
        # once, not again at each epoch's start; `quiet`)
        self._quiet: dict[int, float] = {}
        self._now = 0.0  # the latest clock reading any call brought (for the bookkeeping without one)
        self._holding: dict[int, int] = {}  # trainer -> its CLAIMED (not DONE) batches
        self._done_since: dict[int, float] = {}  # trainer holding some -> when it last reported one DONE
        self._done = 0  # DONE batches of this epoch
        self.servers: dict[int, Member] = {}
        self.trainers: dict[int, Member] = {}
        self.dead_servers: dict[int, None] = {}
        self.dead_trainers: dict[int, None] = {}
        self.records: list[dict[str, Any]] = []  # to journal before answering
        # what happened since this process started (`crossfeed top`, the Prometheus exporter)
        self.counts = {"leases_revoked": 0, "batches_re_leased": 0, "servers_lost": 0, "trainers_lost": 0}
        self.claimed_from: dict[int, int] = {}  # live server -> its batches claimed by trainers
        self.counts["batches_taken_over"] = 0
        self._rates: dict[int, tuple[float, float, float]] = {}  # live server -> (decayed claims, at, first claim)
        # live server -> its leased batches not yet started (its last BEAT's report, plus what
        # was leased to it since, less what was taken back): the tail of its newest leases
        self._unstarted: dict[int, int] = {}
        # server -> lease id -> its batches taken back since the dispatcher last asked (`take_taken`:
        # the server is told, so that it does not build them)
        self._taken: dict[int, dict[int, list[int]]] = {}
        self._cursor = 0  # no PENDING batch below it (a hint for `_take`)
        # what peers make happen is logged at most LOG_BURST times per 5 s per kind (a flood of fake
        # ids must not flood the log): joins, and servers or trainers leaving, dead or stalled
        self._log = RateLimitedLog(logger, burst=LOG_BURST)

    # ---- members ----
    def server_seen(self, server: int, now: float, address: str | None = None) -> bool:
        """A sign of life from `server`; False for one declared dead (it must reset and rejoin
        under a new id)."""
        self._now = max(self._now, now)
        if server in self.dead_servers:
            return False
        m = self.servers.get(server)
        if m is None:
            if address is None:
                return False  # unknown: it must say hello first
            if len(self.servers) >= MAX_SERVERS:
                self._log.warning("full", "server %016x refused: %d servers are live already", server, MAX_SERVERS)
                return False
            self.servers[server] = Member(now, address)
            self._log.log(logging.INFO, "joined", "server %016x joined at %s", server, address)
        else:
            m.last_seen = now
            if address is not None:
                m.address = address
        return True

    def trainer_seen(self, trainer: int, now: float) -> bool:
        if trainer in self.dead_trainers:
            return False
        m = self.trainers.get(trainer)
        if m is None:
            self.trainers[trainer] = Member(now)
        else:
            m.last_seen = now
        return True

    def remove_server(self, server: int, reason: str) -> int:
        """Revoke the server's leases: their unclaimed batches go back to PENDING; returns how many."""
        self.servers.pop(server, None)
        self.claimed_from.pop(server, None)
        self._rates.pop(server, None)
        self._unstarted.pop(server, None)
        self._quiet.pop(server, None)
        _remember(self.dead_servers, server)
        if reason != "left":
            self.counts["servers_lost"] += 1
        back = 0
        for lid in [lid for lid, lease in self.leases.items() if lease.server == server]:
            back += self._revoke(lid)
        self._log.log(
            logging.INFO if reason == "left" else logging.WARNING,
            "server " + reason.rsplit(" ", 1)[-1],  # left, dead, stalled: each its own budget
            "server %016x %s: %d leased batches go to the others",
            server,
            reason,
            back,
        )
        return back

    def remove_trainer(self, trainer: int, reason: str) -> int:
        """The trainer's claimed, unconsumed batches go back to PENDING; returns how many."""
        self.trainers.pop(trainer, None)
        _remember(self.dead_trainers, trainer)
        if reason != "left":
            self.counts["trainers_lost"] += 1
        back = 0
        if self._holding.pop(trainer, 0):
            del self._done_since[trainer]
            for b in range(self.n):
                if self.state[b] == CLAIMED and self.claimer[b] == trainer:
                    self._set_pending(b)
                    back += 1
        if back:
            self.records.append({"t": "unclaim", "trainer": trainer, "epoch": self.epoch})
        self._log.log(
            logging.INFO if reason == "left" else logging.WARNING,
            "trainer " + reason.rsplit(" ", 1)[-1],
            "trainer %016x %s: %d claimed batches go out again",
            trainer,
            reason,
            back,
        )
        return back

    def expire(self, now: float) -> tuple[list[int], list[int]]:
        """Servers and trainers silent for more than `timeout`, or past a progress deadline (see
        the module docstring); removed. Overtaken leases are revoked. Returns (servers, trainers)."""
        self._now = max(self._now, now)
        servers = [k for k, m in self.servers.items() if now - m.last_seen > self.timeout]
        for k in servers:
            self.remove_server(k, f"silent for more than {self.timeout:g}s, declared dead")
        trainers = [k for k, m in self.trainers.items() if now - m.last_seen > self.timeout]
        for k in trainers:
            self.remove_trainer(k, f"silent for more than {self.timeout:g}s, declared dead")
        if self.lease_timeout is not None:
            limit = self.lease_timeout
            stalled = [k for k, t in self._idle_since.items() if now - t > limit]
            for k in stalled:
                n = self._load.get(k, 0)
                self.remove_server(k, f"delivered none of its {n} leased batches for more than {limit:g}s: stalled")
            servers += stalled
            overtaken = [x for x in self.leases.values() if x.overtaken is not None and now - x.overtaken > limit]
            for lease in overtaken:
                back = self._revoke(lease.id)
                self._log.warning(
                    "overtaken",
                    "server %016x: %d batches of a lease were overtaken by later ones for more than %gs "
                    "(lost on the way, or unclaimed at a stalled trainer): leased again",
                    lease.server,
                    back,
                    limit,
                )
        if self.claim_timeout is not None:
            limit = self.claim_timeout
            stalled = [k for k, t in self._done_since.items() if now - t > limit]
            for k in stalled:
                n = self._holding[k]
                self.remove_trainer(
                    k, f"held {n} claimed batches and reported none done for more than {limit:g}s: stalled"
                )
            trainers += stalled
        return servers, trainers

    # ---- leasing ----
    def held(self, server: int) -> int:
        """Live leases of `server` (with a batch still unclaimed)."""
        return len(self._by_server.get(server, ()))

    def claims_of(self, trainer: int) -> tuple[int, int]:
        """(batches `trainer` claimed this epoch, of them claimed and not yet reported used)."""
        return self._claims.get(trainer, 0), self._holding.get(trainer, 0)

    def outstanding(self, server: int) -> int:
        """Batches leased to `server` and not yet claimed by a trainer."""
        return self._load.get(server, 0)

    def rate(self, server: int, now: float) -> float | None:
        """`server`'s batches claimed per second, decayed over RATE_TAU s (None until one is claimed)."""
        got = self._rates.get(server)
        if got is None:
            return None
        score, at, first = got
        age = max(now - first, 1e-3)
        # the decayed count of a steady rate r is r * TAU * (1 - exp(-age / TAU)): divided by that
        return score * math.exp(-max(now - at, 0.0) / RATE_TAU) / (RATE_TAU * -math.expm1(-age / RATE_TAU))

    def server_progress(self, server: int, unstarted: int, now: float) -> int:
        """`server` (live) says `unstarted` of its leased batches are not yet started. Holding more
        than twice its cap (`cap`: leased before its rate was known), it gives the excess it has
        not started back (PENDING, for whichever server asks first); returns how many."""
        self._now = max(self._now, now)
        if server not in self.servers:
            return 0
        load = self._load.get(server, 0)
        self._unstarted[server] = unstarted = min(unstarted, load)
        cap = self.cap(server, now)
        back = min(unstarted, load - cap) if load > 2 * cap else 0
        for _ in range(back):
            self._take_back(server, self._newest_leased(server))
        self._unstarted[server] -= back
        self.counts["batches_taken_over"] += back
        return back

    def quiet(self, server: int, now: float) -> float:
        """Seconds `server` has held work without delivering a batch, since it last delivered one
        (or joined): its holds added up, across epochs and work taken back from it."""
        since = self._idle_since.get(server)
        return self._quiet.get(server, 0.0) + (max(now - since, 0.0) if since is not None else 0.0)

    def _stalled(self, server: int, now: float) -> bool:
        """Has `server` held work GRACE s, and 4 of its batch times (at its rate when it last
        delivered), without delivering any?"""
        q = self.quiet(server, now)
        if q < GRACE:
            return False
        got = self._rates.get(server)
        r = self.rate(server, got[1]) if got is not None else None
        return not r or q * r > 4

    def _stealable(self, server: int, now: float) -> int:
        """How many of `server`'s leased batches may be taken back: all once it is stalled, or
        nearly (`_stalled`), else those it reports not started (none if it does not report)."""
        load = self._load.get(server, 0)
        if load and self._stalled(server, now):
            return load
        return min(self._unstarted.get(server, 0), load)

    def _count_rate(self, server: int, now: float) -> None:
        score, at, first = self._rates.get(server, (0.0, now, now))
        self._rates[server] = (score * math.exp(-max(now - at, 0.0) / RATE_TAU) + 1.0, now, first)

    def cap(self, server: int, now: float) -> int:
        """Batches `server` may hold leased and unclaimed: HORIZON s of its rate (2..window); a
        stalled one (`_stalled`) one batch at a time, until it delivers again."""
        return self._measure(server, now)[0]

    def _speed(self, server: int, now: float) -> float | None:
        """The rate to expect of `server` for the work it holds: its measured rate, or once it
        held work without delivering any for GRACE s, at most 2 / (the seconds since it last
        delivered); None (not to be judged yet): never measured, and silent for less than GRACE s."""
        return self._measure(server, now)[1]

    def _measure(self, server: int, now: float) -> tuple[int, float | None]:
        """(`cap`, `_speed`) of `server`, its rate and quiet seconds computed once (a grant
        judges every live server)."""
        r = self.rate(server, now)
        q = self.quiet(server, now)
        speed = r
        if q >= GRACE:
            speed = 2.0 / q if r is None else min(r, 2.0 / q)
            if self._stalled(server, now):
                return 1, speed
        if r is None:  # not measured yet: two leases
            return min(self.window, 2 * self.lease_size), speed
        return max(min(math.ceil(r * HORIZON), self.window), min(2, self.window)), speed

    def grant_leases(self, now: float) -> list[Lease]:
        """New leases for live servers below their cap (`cap`), the one whose work in hand ends
        soonest first; with no batch PENDING, work taken over from slow servers (`_steal`)."""
        self._now = max(self._now, now)
        out: list[Lease] = []
        if self.finished:
            return out
        load = {k: self._load.get(k, 0) for k in self.servers}
        measured = {k: self._measure(k, now) for k in self.servers}
        caps = {k: m[0] for k, m in measured.items()}
        speeds = {k: m[1] for k, m in measured.items()}

        def ends(k: int) -> float:  # when its work in hand would end (unmeasured: by its fill)
            v = speeds[k]
            if v is None:
                return load[k] / caps[k]
            return (load[k] + 1) / v if v > 0 else math.inf  # (rate 0: robbed before it delivered)

        # the epoch's tail (fewer PENDING than a lease per server, several servers): leases of one
        # batch, each to the server whose work ends soonest, so that their last batches end together
        pending = self.n - self._done - sum(load.values()) - sum(self._holding.values())
        tail = self.lease_size * len(load) if len(load) > 1 else 0
        size = self.lease_size if pending >= tail else 1

        def has_room(k: int) -> bool:  # for a lease of `size` (of its cap, if smaller)
            return caps[k] - load[k] >= min(size, caps[k])

        heap = [(ends(k), k) for k in load if has_room(k)]
        heapq.heapify(heap)
        while heap:
            _, server = heapq.heappop(heap)
            taken = self._take(min(size, caps[server] - load[server]))
            if not taken:
                return out + self._steal(load, caps, now)
            out.append(self._lease(server, taken, now))
            load[server] += len(taken)
            pending -= len(taken)
            if pending < tail:
                size = 1
            if has_room(server):
                heapq.heappush(heap, (ends(server), server))
        return out

    def _lease(self, server: int, taken: list[int], now: float) -> Lease:
        lease = Lease(self._new_lease_id(), server, self.epoch, taken, [self._token() for _ in taken])
        for b, token in zip(taken, lease.tokens):
            self.state[b], self.lease_of[b], self.token_of[b] = LEASED, lease.id, token
        self.leases[lease.id] = lease
        self._by_server.setdefault(server, {})[lease.id] = None
        self._left[lease.id] = len(taken)
        if not self._load.get(server):
            self._idle_since[server] = now  # its deadline runs from the first batch it holds
        self._load[server] = self._load.get(server, 0) + len(taken)
        if server in self._unstarted:
            self._unstarted[server] += len(taken)
        return lease

    def _steal(self, load: dict[int, int], caps: dict[int, int], now: float) -> list[Lease]:
        """No batch is PENDING: servers with room (and a measured rate) take batches over from the
        server whose work in hand ends last, while they would deliver them STEAL_MARGIN times
        sooner (see the module docstring); one lease per thief and call."""
        speed: dict[int, Any] = {k: self._speed(k, now) for k in load}  # batches/s (None: not measured yet)
        spare = {k: self._stealable(k, now) for k in load if load[k] and speed[k] is not None}
        ends = {k: load[k] / speed[k] if speed[k] else math.inf for k in spare if spare[k]}
        thieves = sorted((k for k in load if load[k] < caps[k] and self.rate(k, now)), key=lambda k: -speed[k])
        out: list[Lease] = []
        for thief in thieves:
            taken: list[int] = []
            ends.pop(thief, None)  # a thief is robbed of nothing in this call
            # only from servers STEAL_MARGIN times slower: between servers of one speed a batch
            # moved is one built twice (the first copy may be waiting for a trainer already)
            slower = {k: e for k, e in ends.items() if not speed[k] or speed[k] * STEAL_MARGIN < speed[thief]}
            while slower and load[thief] + len(taken) < caps[thief] and len(taken) < self.lease_size:
                mine = (load[thief] + len(taken) + 1) / speed[thief] + STEAL_SLACK
                victim = max(slower, key=slower.__getitem__)
                if slower[victim] <= STEAL_MARGIN * mine:
                    break
                self._take_back(victim, b := self._newest_leased(victim))
                self._rates.setdefault(victim, (0.0, now, now))  # robbed before delivering: rate 0, cap 2
                if self._unstarted.get(victim):
                    self._unstarted[victim] -= 1
                load[victim] -= 1
                spare[victim] -= 1
                if load[victim] and spare[victim]:
                    ends[victim] = slower[victim] = load[victim] / speed[victim] if speed[victim] else math.inf
                else:
                    del ends[victim], slower[victim]
                taken.append(b)
            if taken:
                self._log.log(
                    logging.INFO,
                    "taken",
                    "server %016x takes over %d leased batches of slower servers",
                    thief,
                    len(taken),
                )
                self.counts["batches_taken_over"] += len(taken)
                out.append(self._lease(thief, taken, now))
                load[thief] += len(taken)
        return out

    def _take_back(self, server: int, b: int) -> None:
        """Leased batch `b` of `server` goes back to PENDING, noted for `take_taken`."""
        self._taken.setdefault(server, {}).setdefault(self.lease_of[b], []).append(b)
        self._set_pending(b)

    def take_taken(self) -> dict[int, dict[int, list[int]]]:
        """Live server -> lease id -> the batches taken back from it since the last call (to tell it)."""
        out, self._taken = self._taken, {}
        return {k: v for k, v in out.items() if k in self.servers}

    def _newest_leased(self, server: int) -> int:
        """The last LEASED batch of `server`'s newest lease (the one it has least likely started)."""
        lid = next(reversed(self._by_server[server]))
        lease = self.leases[lid]
        for b in reversed(lease.batches):
            if self.state[b] == LEASED and self.lease_of[b] == lid:
                return b
        raise AssertionError("a live lease without a LEASED batch")  # `_unlease` drops those

    def _take(self, n: int) -> list[int]:
        taken: list[int] = []
        b = self._cursor
        while b < self.n and len(taken) < n:
            if self.state[b] == PENDING:
                taken.append(b)
            elif not taken:
                self._cursor = b + 1
            b += 1
        return taken

    def _new_lease_id(self) -> int:
        """A random id no live lease has (a clash, at odds of 2**-63 per live lease, draws again:
        each draw clashes with those odds, so the loop ends after one or two)."""
        lid = self._token()
        while lid in self.leases:
            lid = self._token()
        return lid

    def _revoke(self, lid: int) -> int:
        lease = self.leases[lid]
        back = 0
        for b in lease.batches:
            if self.state[b] == LEASED and self.lease_of[b] == lid:
                self._set_pending(b)
                back += 1
        self.counts["leases_revoked"] += 1
        self.counts["batches_re_leased"] += back
        return back

    def _unlease(self, b: int) -> None:
        """Batch `b` (LEASED) leaves its lease: claimed, or back to PENDING."""
        lid = self.lease_of[b]
        lease = self.leases[lid]
        self._load[lease.server] -= 1
        self._left[lid] -= 1
        if not self._left[lid]:
            del self._left[lid], self.leases[lid]
            mine = self._by_server[lease.server]
            del mine[lid]
            if not mine:
                del self._by_server[lease.server]
        if not self._load[lease.server]:
            since = self._idle_since.pop(lease.server)
            del self._load[lease.server]
            self._unstarted.pop(lease.server, None)
            if lease.server in self.servers:
                self._quiet[lease.server] = self._quiet.get(lease.server, 0.0) + max(self._now - since, 0.0)

    def _delivered(self, lease: Lease, now: float) -> None:
        """A batch of `lease` reached a trainer: its server made progress, and its older leases
        with batches still unclaimed were overtaken (their clock starts now, if not already)."""
        self._idle_since[lease.server] = now
        self._quiet.pop(lease.server, None)
        for lid in self._by_server[lease.server]:
            if lid == lease.id:
                return
            older = self.leases[lid]
            if older.overtaken is None:
                older.overtaken = now

    def _set_pending(self, b: int) -> None:
        if self.state[b] == LEASED:
            self._unlease(b)
        self.state[b], self.lease_of[b], self.token_of[b], self.claimer[b] = PENDING, 0, 0, 0
        self._cursor = min(self._cursor, b)

    # ---- trainers ----
    def _local(self, seq: int) -> int | None:
        """Batch number within the current epoch of global `seq`, or None if it is not of it."""
        b = seq - self.epoch * self.batches
        return b if 0 <= b < self.n and not self.finished else None

    def claim(self, trainer: int, seq: int, token: int, *, now: float) -> bool:
        """May `trainer` use batch `seq`, received with claim `token`? (see the module docstring)

        A copy refused although its token is the batch's current one (an unknown or fenced
        trainer, or one that has its `quota` of this epoch) is dropped by the trainer, so the
        batch goes back to PENDING and out again."""
        self._now = max(self._now, now)
        b = self._local(seq)
        if b is None or token <= 0:
            return False
        if self.state[b] == CLAIMED:
            return self.claimer[b] == trainer and self.token_of[b] == token
        if self.state[b] != LEASED or self.token_of[b] != token:
            return False
        self._delivered(self.leases[self.lease_of[b]], now)
        if trainer not in self.trainers or (self.quota is not None and self._claims.get(trainer, 0) >= self.quota):
            self._set_pending(b)
            return False
        server = self.leases[self.lease_of[b]].server
        if server in self.servers:
            self.claimed_from[server] = self.claimed_from.get(server, 0) + 1
            self._count_rate(server, now)
        self._unlease(b)
        self.state[b], self.claimer[b] = CLAIMED, trainer
        self._claims[trainer] = self._claims.get(trainer, 0) + 1
        if not self._holding.get(trainer):
            self._done_since[trainer] = now  # its deadline runs from the first batch it holds
        self._holding[trainer] = self._holding.get(trainer, 0) + 1
        self.records.append({"t": "claim", "trainer": trainer, "epoch": self.epoch, "b": b, "token": token})
        return True

    def done(self, trainer: int, seq: int, *, now: float) -> bool:
        """`trainer` consumed batch `seq`; True if it is (now, or already) DONE by it."""
        b = self._local(seq)
        if b is None:
            return seq < self.epoch * self.batches or self.finished  # an earlier epoch: done
        if self.state[b] == DONE:
            return self.claimer[b] == trainer
        if self.state[b] != CLAIMED or self.claimer[b] != trainer:
            return False
        self.state[b] = DONE
        self._done += 1
        self._holding[trainer] -= 1
        if self._holding[trainer]:
            self._done_since[trainer] = now
        else:
            del self._holding[trainer], self._done_since[trainer]
        self.records.append({"t": "done", "epoch": self.epoch, "b": b})
        self._maybe_advance()
        return True

    def _maybe_advance(self) -> None:
        while self._done >= self.n:  # an epoch of no batches (every step skipped) ends at once
            logger.info("epoch %d done: %d batches, each consumed once", self.epoch, self.n)
            self._clear_leases()
            self._done = 0
            self.epoch += 1
            self.records.append({"t": "epoch", "epoch": self.epoch})
            if self.epochs is not None and self.epoch >= self.epochs:
                self.finished = True
                return
            self._start_epoch()
            self._claims.clear()
            self._cursor = 0

    def epoch_batches(self, epoch: int) -> int:
        """How many batches epoch `epoch` has."""
        if self._counts is None:
            return self.batches
        n = self._counts(epoch)
        if not 0 <= n <= self.batches:
            raise ConfigError(f"epoch {epoch} has {n} batches; an epoch has 0 to {self.batches}")
        return n

    def _start_epoch(self) -> None:
        """Every batch of epoch `self.epoch` PENDING."""
        self.n = self.epoch_batches(self.epoch)
        if self._quota is not None and self._counts is not None:
            self.quota = self._quota * self.n // self.batches
        self.state = [PENDING] * self.n
        self.lease_of = [0] * self.n
        self.token_of = [0] * self.n
        self.claimer = [0] * self.n

    def _clear_leases(self) -> None:
        """Forget every lease (an epoch's end, or a restart); the caller resets the batches."""
        self.leases.clear()
        self._left.clear()
        self._load.clear()
        self._by_server.clear()
        for k, since in self._idle_since.items():  # (none hold work at an epoch's end; a restart)
            if k in self.servers:
                self._quiet[k] = self._quiet.get(k, 0.0) + max(self._now - since, 0.0)
        self._idle_since.clear()
        self._unstarted.clear()  # the servers' next BEATs report afresh

    def progress(self) -> dict[str, int]:
        counts = [0, 0, 0, 0]
        for s in self.state:
            counts[s] += 1
        return {
            "epoch": self.epoch,
            "pending": counts[PENDING],
            "leased": counts[LEASED],
            "claimed": counts[CLAIMED],
            "done": counts[DONE] if not self.finished else self.n,
        }

    # ---- journal ----
    def take_records(self) -> list[dict[str, Any]]:
        out, self.records = self.records, []
        return out

    def snapshot(self) -> list[dict[str, Any]]:
        """The records that rebuild this book's durable state (for compacting the journal)."""
        out: list[dict[str, Any]] = [{"t": "epoch", "epoch": self.epoch}]
        out += [{"t": "unclaim", "trainer": k, "epoch": -1} for k in self.dead_trainers]
        if self.finished:
            return out
        for b in range(self.n):
            if self.state[b] == CLAIMED:
                out.append(
                    {"t": "claim", "trainer": self.claimer[b], "epoch": self.epoch, "b": b, "token": self.token_of[b]}
                )
            elif self.state[b] == DONE:
                out.append({"t": "claim", "trainer": self.claimer[b], "epoch": self.epoch, "b": b, "token": 0})
                out.append({"t": "done", "epoch": self.epoch, "b": b})
        return out

    def restore(self, records: list[dict[str, Any]], now: float) -> None:
        """Replay journal `records` (see `snapshot`); the trainers that hold claims get `timeout`
        seconds from `now` to come back (and `claim_timeout` to report one DONE) before their
        batches go out again (`journal.Replay` has checked every record)."""
        for r in records:
            t = r.get("t")
            if t == "epoch":
                self.epoch = int(r["epoch"])
                self.finished = self.epochs is not None and self.epoch >= self.epochs
                if self.finished:  # no count to ask for: the batches of the last one, all PENDING
                    self.state, self.lease_of = [PENDING] * self.n, [0] * self.n
                    self.token_of, self.claimer = [0] * self.n, [0] * self.n
                else:
                    self._start_epoch()
            elif t == "unclaim":  # that trainer was declared dead: fenced, its claims go out again
                _remember(self.dead_trainers, int(r["trainer"]))
                if r.get("epoch") == self.epoch:
                    for b in range(self.n):
                        if self.state[b] == CLAIMED and self.claimer[b] == int(r["trainer"]):
                            self._set_pending(b)
            elif r.get("epoch") != self.epoch:
                continue
            elif t == "claim":
                b = int(r["b"])
                self.state[b], self.claimer[b], self.token_of[b] = CLAIMED, int(r["trainer"]), int(r["token"])
            elif t == "done":
                self.state[int(r["b"])] = DONE
        self._cursor = 0
        self._clear_leases()
        self._claims.clear()
        self._holding.clear()
        self._done_since.clear()
        self._done = sum(1 for x in self.state if x == DONE)
        for b in range(self.n):
            if self.state[b] in (CLAIMED, DONE):
                self._claims[self.claimer[b]] = self._claims.get(self.claimer[b], 0) + 1
            if self.state[b] == CLAIMED:
                self.trainers.setdefault(self.claimer[b], Member(now))
                self._holding[self.claimer[b]] = self._holding.get(self.claimer[b], 0) + 1
                self._done_since[self.claimer[b]] = now
        self.records.clear()
        if not self.finished:
            self._maybe_advance()  # the last DONE made it to the journal, the epoch's end did not


def _remember(dead: dict[int, None], key: int) -> None:
    dead[key] = None
    while len(dead) > MAX_REMEMBERED:
        dead.pop(next(iter(dead)))
