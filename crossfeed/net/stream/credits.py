"""Credit-based work distribution, as pure bookkeeping (no sockets, no clock of its own).

A peer (trainer) grants credit = how many batches it allows in flight, and optionally how many
bytes (one batch is always allowed, however large). `assign()` hands the
oldest pending batch to the next peer (round robin) that has room and remembers it as unacked
until `ack()`. A peer that dies (`kill()`, or silent past the timeout in `expire()`) has its
unacked batches put back at the front of the queue, oldest first, for the others; anything it
says afterwards is ignored (the server answers it FENCED).

Progress deadline: a peer that holds unacknowledged batches and acknowledges none of them for
`progress_timeout` seconds (its training loop hangs while its network thread still heartbeats)
is declared dead the same way, so the epoch never waits on it forever.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
from typing import Any

logger = logging.getLogger(__name__)

MAX_REMEMBERED_DEAD = 4096


@dataclasses.dataclass
class Item:
    """One encoded batch: `frames` are the `crossfeed.format.wire` buffers, sent as they are."""

    seq: int
    epoch: int
    frames: list[Any]
    num_samples: int
    nbytes: int = 0
    lease: int = 0  # the dispatcher's claim token of this batch, the BATCH envelope's token (0: no dispatcher)


@dataclasses.dataclass
class _Peer:
    credit: int
    last_seen: float
    credit_bytes: int = 0  # 0: no byte limit
    unacked: dict[int, Item] = dataclasses.field(default_factory=dict)
    unacked_bytes: int = 0
    progress_at: float = 0.0  # last ack, or when it last went from holding nothing to holding some
    reachable: bool = True  # False after a send to it failed, until it speaks again

    @property
    def room(self) -> int:
        if not self.reachable:
            return 0
        if self.credit_bytes and self.unacked_bytes >= self.credit_bytes:
            return 0
        return max(self.credit - len(self.unacked), 0)


class CreditBook:
    """Who may receive what; the server loop drives it and does the sending."""

    def __init__(self, *, max_credit: int, timeout: float, progress_timeout: float | None = None):
        self.max_credit = max_credit
        self.timeout = timeout
        self.progress_timeout = progress_timeout
        self.peers: dict[bytes, _Peer] = {}
        self.pending: collections.deque[Item] = collections.deque()
        self._dead: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._turn = 0

    # ---- what peers say ----
    def is_dead(self, peer: bytes) -> bool:
        return peer in self._dead

    def seen(self, peer: bytes, now: float) -> bool:
        """Note a sign of life; False (and nothing noted) for a peer declared dead."""
        if peer in self._dead:
            return False
        p = self.peers.get(peer)
        if p is not None:
            p.last_seen, p.reachable = now, True
        return True

    def credit(self, peer: bytes, n: int, now: float, nbytes: int = 0) -> bool:
        """`peer` allows `n` batches and (unless `nbytes` is 0) `nbytes` bytes in flight."""
        if peer in self._dead:
            return False
        n = min(max(int(n), 0), self.max_credit)
        nbytes = max(int(nbytes), 0)
        p = self.peers.get(peer)
        if p is None:
            self.peers[peer] = _Peer(credit=n, last_seen=now, credit_bytes=nbytes)
        else:
            p.credit, p.credit_bytes, p.last_seen, p.reachable = n, nbytes, now, True
        return True

    def ack(self, peer: bytes, seq: int) -> Item | None:
        """`peer` consumed batch `seq`. A trainer consumes in arrival order, which is the order
        we sent in, so its batches sent before `seq` and still unacknowledged never arrived (a
        connection reset under them, the trainer reconnected under the same identity): they go
        back to the front of the queue at once instead of holding up the epoch's end."""
        p = self.peers.get(peer)
        if p is None or seq not in p.unacked:
            return None
        skipped = list(itertools.takewhile(lambda s: s != seq, p.unacked))
        item = p.unacked.pop(seq)
        p.unacked_bytes -= item.nbytes
        p.progress_at = p.last_seen
        if skipped:
            for s in reversed(skipped):
                lost = p.unacked.pop(s)
                p.unacked_bytes -= lost.nbytes
                self.pending.appendleft(lost)
            logger.warning(
                "trainer %s acknowledged batch %d but never batches %s sent to it before: "
                "they were lost in transit and go out again",
                peer.hex(),
                seq,
                skipped,
            )
        return item

    def unreachable(self, peer: bytes, item: Item | None = None) -> None:
        """A send to `peer` failed (its connection is down, maybe coming back under the same
        identity): `item` was not sent and goes back to the front of the queue; nothing more is
        sent to it until it speaks again. Only silence or the progress deadline declare it dead,
        the two things its lease accounts for."""
        p = self.peers.get(peer)
        if p is None:
            return
        p.reachable = False
        if item is not None and p.unacked.pop(item.seq, None) is not None:
            p.unacked_bytes -= item.nbytes
            self.pending.appendleft(item)

    # ---- deaths ----
    def kill(self, peer: bytes, reason: str) -> int:
        """Forget `peer`, requeue its unacked batches at the front; returns how many."""
        p = self.peers.pop(peer, None)
        self._dead[peer] = None
        while len(self._dead) > MAX_REMEMBERED_DEAD:
            self._dead.popitem(last=False)
        if p is None:
            return 0
        items = sorted(p.unacked.values(), key=lambda i: i.seq, reverse=True)
        for item in items:
            self.pending.appendleft(item)
        level = logging.INFO if reason == "left" else logging.WARNING
        logger.log(
            level,
            "trainer %s %s: %d unacknowledged batches go to the others",
            peer.hex(),
            reason,
            len(items),
        )
        return len(items)

    def leave(self, peer: bytes) -> int:
        """A peer said BYE: like a death, but it may connect again under a new identity."""
        return self.kill(peer, "left")

    def expire(self, now: float) -> list[bytes]:
        silent = [k for k, p in self.peers.items() if now - p.last_seen > self.timeout]
        for k in silent:
            self.kill(k, f"silent for more than {self.timeout:g}s, declared dead")
        limit = self.progress_timeout
        stuck = [] if limit is None else [k for k, p in self.peers.items() if p.unacked and now - p.progress_at > limit]
        for k in stuck:
            self.kill(k, f"acknowledged nothing for more than {limit:g}s, fenced")
        return silent + stuck

    # ---- sending ----
    def demand(self) -> int:
        """How many more batches the live peers could take right now."""
        return max(sum(p.room for p in self.peers.values()) - len(self.pending), 0)

    def assign(self, now: float | None = None) -> tuple[bytes, Item] | None:
        """The next (peer, batch) to send; `now` starts the peer's progress clock if it held none."""
        if not self.pending or not self.peers:
            return None
        keys = list(self.peers)
        for i in range(len(keys)):
            k = keys[(self._turn + i) % len(keys)]
            p = self.peers[k]
            if p.room:
                item = self.pending.popleft()
                if not p.unacked:
                    p.progress_at = p.last_seen if now is None else now
                p.unacked[item.seq] = item
                p.unacked_bytes += item.nbytes
                self._turn = (self._turn + i + 1) % len(keys)
                return k, item
        return None

    def in_flight(self) -> int:
        return len(self.pending) + sum(len(p.unacked) for p in self.peers.values())
