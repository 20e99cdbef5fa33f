"""One client's connection to one server: its socket, whether it is live, and what came from it.

`Link.open(...)` connects a DEALER (distribution: it announces the client's credit at once) or a
SUB (broadcast); `send` never blocks; `acked` sends the ACKS of consumed batches; `silence` says
why a live server should be dropped, if it should; `lose` drops it and reports a `LostServer`.
The receiver (`crossfeed.net.stream.receiver`) owns the links and polls their sockets.

Each DEALER presents a fresh random 16-byte routing id (never the libzmq-generated form, which
starts with a zero byte), so an honest trainer never takes the server's id-generation path that a
squatter could collide with. `rejoin` opens a new socket (a new id, a new `lease` number) after
the server fenced the old one; deliveries carry the lease they came under.

The lease: what a client holds from a server may reach the training loop only while the server
cannot have declared this client dead. `lease_until` bounds that by the server's progress
deadline (it starts when we first hold a batch, moves on with every ACKS sent, and is renewed by
a probe answer that says how long the server will still wait); `suspect` is set after this
process stalled (see the receiver) and cleared only by a probe answer.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os

import zmq

from crossfeed.format import wire
from crossfeed.net import protocol as P
from crossfeed.net.keys import ClientKeys, secure_client_socket
from crossfeed.net.stream.events import LostServer

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Link:
    """One server as one client sees it; touched only under the receiver's lock."""

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
    instance: int | None = None  # the server process we talk to (first message decides)
    lease: int = 0  # bumped by every rejoin; deliveries from an older lease are stale
    lease_until: float = math.inf
    suspect: bool = False
    probe: int = 0  # token of the outstanding lease probe, 0 when none
    probe_sent: float = 0.0
    server_timeout: float | None = None  # learned from the server's heartbeats (seconds)
    progress_timeout: float | None = None

    @classmethod
    def open(
        cls,
        ctx: zmq.Context,
        address: str,
        *,
        keys: ClientKeys | None,
        broadcast: bool,
        credits: int,
        credit_bytes: int,
        rcvhwm: int,
        max_message_bytes: int,
        now: float,
    ) -> Link:
        sock = ctx.socket(zmq.SUB if broadcast else zmq.DEALER)
        sock.linger = 500
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        sock.rcvhwm = rcvhwm
        if not broadcast:
            sock.setsockopt(zmq.ROUTING_ID, b"cf" + os.urandom(14))
        secure_client_socket(sock, keys)
        if broadcast:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(address)
        if not broadcast:
            sock.send(P.pack(P.Kind.CREDIT, credits, credit_bytes))
        return cls(address=address, sock=sock, started=now)

    def send(self, msg: bytes | list[bytes]) -> None:
        try:
            if isinstance(msg, list):
                self.sock.send_multipart(msg, zmq.NOBLOCK)
            else:
                self.sock.send(msg, zmq.NOBLOCK)
        except zmq.ZMQError as e:
            logger.debug("could not send to %s: %s", self.address, e)

    def close(self, *, bye: bool) -> None:
        """Say BYE first (if `bye` and still live), then close the socket."""
        if self.state == "live" and bye:
            self.send(P.pack(P.Kind.BYE))
        self.sock.close(linger=500 if self.state == "live" else 0)

    def received_batch(self, meta: wire.BatchMeta, *, track: bool, now: float) -> None:
        """Count a batch; with `track`, it is outstanding until `acked`."""
        self.received += 1
        self.samples += meta.num_samples
        self.last_epoch, self.last_seq = meta.epoch, meta.seq
        if track:
            if not self.unacked:  # the server's progress clock for us starts (at the latest) now
                self._renew(now)
            self.unacked.add(meta.seq)

    def acked(self, seqs: list[int], now: float) -> None:
        """The batches `seqs` were consumed: no longer outstanding; ACKS to a live server."""
        self.unacked.difference_update(seqs)
        if self.state == "live":
            for i in range(0, len(seqs), P.MAX_ACKS):
                self.send(P.pack_acks(seqs[i : i + P.MAX_ACKS]))
            # the server restarts its progress clock when these arrive, after `now`
            if self.unacked:
                self._renew(now)
            else:
                self.lease_until = math.inf

    def _renew(self, now: float) -> None:
        """The server will not fence us for lack of progress before `now` + its deadline; we
        count on half of it (the rest is margin for the network)."""
        limit = self.progress_timeout
        self.lease_until = math.inf if limit is None else now + limit / 2

    def heartbeat(self, env: P.Envelope) -> None:
        """The server's HEARTBEAT: its timeouts (token 0), or the answer to our probe (b = how
        many ms it will still wait for our next ack; 0: no deadline)."""
        if env.a > 0:
            self.server_timeout = env.a / 1000
        if not env.token:
            self.progress_timeout = env.b / 1000 if env.b > 0 else None
        elif env.token == self.probe:
            # we were alive in the server's eyes when it answered, which was after we asked
            self.suspect, self.probe = False, 0
            if not self.unacked or env.b <= 0:
                self.lease_until = math.inf
            else:
                self.lease_until = self.probe_sent + env.b / 1000 / 2

    def usable(self, now: float) -> bool:
        """May what this link holds reach the training loop now (else: probe first)?"""
        return not self.suspect and now <= self.lease_until

    def send_probe(self, now: float, credits: int, credit_bytes: int) -> None:
        if self.probe and now - self.probe_sent < (self.server_timeout or 1.0) / 4:
            return  # one is on its way
        self.probe, self.probe_sent = P.new_instance(), now
        self.send(P.pack(P.Kind.HEARTBEAT, credits, credit_bytes, token=self.probe))

    def rejoin(self, sock: zmq.Socket, now: float) -> None:
        """Start over on a new socket (a new identity) with the same server after a fence."""
        self.sock.close(linger=0)
        self.sock, self.started, self.heard, self.state = sock, now, False, "live"
        self.unacked.clear()
        self.lease += 1
        self.lease_until, self.suspect, self.probe = math.inf, False, 0

    def fence(self) -> None:
        """The server declared us dead: stop reading this socket until `rejoin`."""
        self.state = "fenced"
        self.unacked.clear()

    def silence(self, now: float, timeout: float, connect_timeout: float) -> str | None:
        """Why this server is to be dropped for silence, or None while it is not."""
        if self.heard and now - self.last_seen > timeout:
            return f"silent for more than {timeout:g}s"
        if not self.heard and now - self.started > connect_timeout:
            return f"no answer within {connect_timeout:g}s of connecting"
        return None

    def lose(self, reason: str, *, leased: bool = False) -> LostServer:
        """Mark the server lost and log what that costs: with ``leased`` (a dispatcher's server)
        nothing — the dispatcher grants its work to the others — else what it had not sent."""
        self.state = "lost"
        info = LostServer(
            address=self.address,
            reason=reason,
            received_batches=self.received,
            received_samples=self.samples,
            unacked_batches=len(self.unacked),
            last_epoch=self.last_epoch,
            last_seq=self.last_seq,
            answered=self.heard,
        )
        logger.warning(
            "server %s dropped (%s): %d of its batches were outstanding (received, not yet "
            "acknowledged); received %d batches / %d samples from it, last epoch %s seq %s; %s",
            self.address,
            reason,
            info.unacked_batches,
            self.received,
            self.samples,
            self.last_epoch,
            self.last_seq,
            "the dispatcher leases what it had not delivered to the other servers: nothing is lost"
            if leased
            else "what it had not sent yet is lost to this client",
        )
        return info
