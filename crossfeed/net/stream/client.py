"""`crossfeed.connect(addresses)`: batches from one or more `crossfeed serve` processes.

    with crossfeed.connect("tcp://10.0.0.{1..4}:7880") as batches:
        for batch in batches:          # dict[str, np.ndarray] (bytes/str fields: lists)
            train_step(batch)          # batches.last_meta: epoch, seq, server, sample ids

Iteration ends when every server has ended its stream (END_OF_STREAM). A server that never
answers (`connect_timeout`), goes silent (`heartbeat_timeout`), restarts (another process answers
at its address) or reports that its source failed raises `ServerLostError` naming it, unless
`on_loss="continue"`: then the client reads on from the others and `lost` lists the dropped ones.
A batch is acknowledged when the next one is asked for (or on close), so a trainer that dies
loses nothing: its server gives the unacknowledged batches to the other trainers. A trainer the
server declared dead (stalled, or no ack within the server's progress deadline) is fenced: what
it still holds is dropped unused, never yielded, and it rejoins (`fenced` counts how often).
Received arrays are read-only views of the network frames.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from crossfeed.config import parse_size
from crossfeed.errors import ConfigError, CrossfeedError, ServerLostError
from crossfeed.format import wire
from crossfeed.net import protocol as P
from crossfeed.net.addresses import expand_all
from crossfeed.net.keys import ClientKeys, as_client_keys
from crossfeed.net.stream.events import AllDone, Delivery, EpochDone, Lost, LostServer, ReceiverFailed
from crossfeed.net.stream.receiver import Receiver

logger = logging.getLogger(__name__)

# Small batches are bound by the ack round trip, so many may be in flight; large ones by the
# byte credit: 19 MB batches still travel at most 4 at a time (the last may pass the limit).
DEFAULT_CREDITS = 32
DEFAULT_CREDIT_BYTES = 64 << 20


class OnLoss(str, enum.Enum):
    """What a lost server does to the iteration: raise ServerLostError, or read on without it."""

    RAISE = "raise"
    CONTINUE = "continue"


@dataclasses.dataclass(frozen=True)
class ClientOptions:
    credits: int = DEFAULT_CREDITS  # batches in flight per server, the one being consumed included
    # and bytes in flight per server (one batch always), or a size such as "64MB"; 0: any
    credit_bytes: int = DEFAULT_CREDIT_BYTES  # given as bytes or a size; kept as bytes
    broadcast: bool = False  # subscribe to a PUB stream instead of taking a share
    heartbeat: P.Heartbeat = P.Heartbeat()
    connect_timeout: float = 60.0
    limits: wire.WireLimits = wire.DEFAULT_LIMITS
    with_meta: bool = False  # yield (BatchMeta, batch) instead of batch
    on_loss: OnLoss = OnLoss.RAISE
    # a dispatcher's trainer that has had no server for this long, and no batch yet, gets an error
    # (one that connects before its servers register waits for them: this is how long)
    server_wait: float = 600.0

    if TYPE_CHECKING:  # the constructor's signature: on_loss may be given as its string too

        def __init__(
            self,
            credits: int = DEFAULT_CREDITS,
            credit_bytes: int | str = DEFAULT_CREDIT_BYTES,
            broadcast: bool = False,
            heartbeat: P.Heartbeat = P.Heartbeat(),
            connect_timeout: float = 60.0,
            limits: wire.WireLimits = wire.DEFAULT_LIMITS,
            with_meta: bool = False,
            on_loss: OnLoss | str = OnLoss.RAISE,
            server_wait: float = 600.0,
        ) -> None: ...

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "on_loss", OnLoss(self.on_loss))
        except ValueError as e:
            raise ConfigError(f"on_loss must be 'raise' or 'continue', got {self.on_loss!r}") from e
        if isinstance(self.credits, bool) or not isinstance(self.credits, int) or not 1 <= self.credits <= 64:
            raise ConfigError(f"credits must be an integer in 1..64, got {self.credits!r}")
        object.__setattr__(self, "credit_bytes", parse_size(self.credit_bytes, "credit_bytes", zero=True))
        if (
            isinstance(self.connect_timeout, bool)
            or not isinstance(self.connect_timeout, (int, float))
            or self.connect_timeout <= 0
        ):
            raise ConfigError(f"connect_timeout must be a number of seconds > 0, got {self.connect_timeout!r}")
        if (
            not isinstance(self.server_wait, (int, float))
            or isinstance(self.server_wait, bool)
            or not (self.server_wait > 0)
        ):
            raise ConfigError(f"server_wait must be > 0 seconds, got {self.server_wait!r}")


class Client(Iterator[Any]):
    """An iterator over batches from several servers at once; `close()` or use `with`."""

    def __init__(
        self,
        addresses: str | Iterable[str],
        *,
        keys: ClientKeys | str | os.PathLike | None = None,
        options: ClientOptions = ClientOptions(),
    ):
        self.addresses = expand_all(addresses)
        self.options = options
        self._receiver = Receiver(
            self.addresses,
            keys=as_client_keys(keys),
            credits=options.credits,
            credit_bytes=options.credit_bytes,
            broadcast=options.broadcast,
            heartbeat=options.heartbeat,
            connect_timeout=options.connect_timeout,
            limits=options.limits,
        ).start()
        self._held: tuple[int, int, int] | None = None  # (server, seq, lease)
        self._finished = False
        self.last_meta: wire.BatchMeta | None = None
        self.epochs_ended: list[tuple[str, int, int]] = []  # (server address, epoch, batches)
        self.batches = 0

    @property
    def lost(self) -> list[LostServer]:
        """Servers dropped because they went silent (or never answered)."""
        return list(self._receiver.lost)

    @property
    def fenced(self) -> int:
        """How many times a server fenced this client (declared it dead; it rejoined)."""
        return self._receiver.fenced

    @property
    def stale_dropped(self) -> int:
        """Batches received under a lease the server fenced, dropped here without being yielded."""
        return self._receiver.stale_dropped

    @property
    def dropped_messages(self) -> int:
        return self._receiver.dropped_messages

    def __iter__(self) -> Client:
        return self

    def _ack_held(self) -> None:
        if self._held is not None and not self.options.broadcast:
            self._receiver.ack(*self._held)
        self._held = None

    def __next__(self) -> Any:
        self._ack_held()
        while not self._finished:
            event = self._receiver.next_event(timeout=0.1)
            if event is None:
                if not self._receiver.alive:
                    self._finished = True
                    raise CrossfeedError("the client's I/O thread stopped")
                continue
            if isinstance(event, Delivery):
                self._held = (event.server, event.meta.seq, event.lease)
                self.last_meta = event.meta
                self.batches += 1
                return (event.meta, event.batch) if self.options.with_meta else event.batch
            if isinstance(event, EpochDone):
                self.epochs_ended.append((self.addresses[event.server], event.epoch, event.batches))
            elif isinstance(event, Lost):
                if self.options.on_loss is OnLoss.RAISE:
                    raise ServerLostError(event.info.address, event.info.reason)
            elif isinstance(event, AllDone):
                self._finished = True
            elif isinstance(event, ReceiverFailed):
                self._finished = True
                raise CrossfeedError(f"client I/O failed: {event.message}")
        raise StopIteration

    def close(self) -> None:
        self._ack_held()
        self._finished = True
        self._receiver.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
