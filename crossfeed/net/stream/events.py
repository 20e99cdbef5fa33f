"""What a client's receiver reports (see `receiver.Receiver.next_event`), and what it knows of
a server it dropped (`LostServer`, kept in `Receiver.lost` and `Client.lost`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from crossfeed.format import wire


@dataclasses.dataclass(frozen=True)
class Delivery:
    server: int
    meta: wire.BatchMeta
    batch: dict[str, Any]
    lease: int = 0  # the link's lease it came under: stale (and dropped) once that link rejoined
    token: int = 0  # the BATCH envelope's token: the dispatcher's claim token (0 without a dispatcher)


@dataclasses.dataclass(frozen=True)
class EpochDone:
    server: int
    epoch: int
    batches: int


@dataclasses.dataclass(frozen=True)
class AllDone:
    pass


@dataclasses.dataclass(frozen=True)
class ReceiverFailed:
    message: str


@dataclasses.dataclass(frozen=True)
class LostServer:
    """What a client knows about a server it dropped."""

    address: str
    reason: str
    received_batches: int
    received_samples: int
    unacked_batches: int
    last_epoch: int | None
    last_seq: int | None
    answered: bool = True  # False: it never answered (unreachable, or not a server)


@dataclasses.dataclass(frozen=True)
class Lost:
    """A server was dropped (silent, never answered, restarted, or its source failed)."""

    server: int
    info: LostServer
