"""One client's connection to one server: its socket, whether it is live, and what came from it.

`Link.open(...)` connects a DEALER (distribution: it announces the client's credit at once) or a
SUB (broadcast); `send` never blocks; `acked` sends the ACKS of consumed batches; `silence` says
why a live server should be dropped, if it should; `lose` drops it and reports a `LostServer`.
The receiver (`crossfeed.net.receiver`) owns the links and polls their sockets.
"""

from __future__ import annotations

import dataclasses
import logging

import zmq

from crossfeed.net import wire
from crossfeed.net import protocol as P
from crossfeed.net.events import LostServer
from crossfeed.net.keys import ClientKeys, secure_client_socket

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

    def received_batch(self, meta: wire.BatchMeta, *, track: bool) -> None:
        """Count a batch; with `track`, it is outstanding until `acked`."""
        self.received += 1
        self.samples += meta.num_samples
        self.last_epoch, self.last_seq = meta.epoch, meta.seq
        if track:
            self.unacked.add(meta.seq)

    def acked(self, seqs: list[int]) -> None:
        """The batches `seqs` were consumed: no longer outstanding; ACKS to a live server."""
        self.unacked.difference_update(seqs)
        if self.state == "live":
            for i in range(0, len(seqs), P.MAX_ACKS):
                self.send(P.pack_acks(seqs[i : i + P.MAX_ACKS]))

    def silence(self, now: float, timeout: float, connect_timeout: float) -> str | None:
        """Why this server is to be dropped for silence, or None while it is not."""
        if self.heard and now - self.last_seen > timeout:
            return f"silent for more than {timeout:g}s"
        if not self.heard and now - self.started > connect_timeout:
            return f"no answer within {connect_timeout:g}s of connecting"
        return None

    def lose(self, reason: str) -> LostServer:
        self.state = "lost"
        info = LostServer(
            address=self.address, reason=reason, received_batches=self.received,
            received_samples=self.samples, unacked_batches=len(self.unacked),
            last_epoch=self.last_epoch, last_seq=self.last_seq,
        )
        logger.warning(
            "server %s dropped (%s): %d of its batches were outstanding (received, not yet "
            "acknowledged); received %d batches / %d samples from it, last epoch %s seq %s; "
            "what it had not sent yet is lost to this client",
            self.address, reason, info.unacked_batches, self.received, self.samples,
            self.last_epoch, self.last_seq,
        )
        return info
