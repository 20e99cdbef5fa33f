"""`crossfeed.connect(...)`: a trainer's batches, from servers named directly (`Client`,
`crossfeed.net.stream`) or found through a dispatcher's leases (`LeasedClient`, `crossfeed.net.lease`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from crossfeed.errors import ConfigError
from crossfeed.format import wire
from crossfeed.net import protocol as P
from crossfeed.net.keys import ClientKeys, as_client_keys
from crossfeed.net.lease.client import LeasedClient
from crossfeed.net.stream.client import DEFAULT_CREDIT_BYTES, DEFAULT_CREDITS, Client, ClientOptions, OnLoss


def connect(
    addresses: str | Iterable[str] | None = None,
    *,
    dispatcher: str | None = None,
    keys: ClientKeys | str | os.PathLike | None = None,
    credits: int = DEFAULT_CREDITS,
    credit_bytes: int = DEFAULT_CREDIT_BYTES,
    broadcast: bool = False,
    heartbeat_interval: float = 1.0,
    heartbeat_timeout: float = 10.0,
    connect_timeout: float = 60.0,
    limits: wire.WireLimits = wire.DEFAULT_LIMITS,
    with_meta: bool = False,
    on_loss: OnLoss | str = OnLoss.RAISE,
) -> Client | Any:
    """A `Client` reading from every server in `addresses` (brace patterns expand).

    `keys`: a `ClientKeys` or a directory holding `client.key_secret` and `server.key`.
    `credits` / `credit_bytes`: how many batches / bytes each server may have in flight to this
    client (received, not yet consumed); the server sends the next batch while both allow it.
    `on_loss`: "raise" (default): a server that never answers, goes silent, restarts or fails
    raises `ServerLostError`; "continue": read on from the others, `client.lost` lists it.
    `dispatcher`: instead of `addresses`, a `crossfeed dispatch` address: the servers it leases
    work to are found through it, and every batch is used exactly once across its trainers
    (`crossfeed.net.lease.client`; `keys` serve for the dispatcher and the servers alike).
    """
    one_of = "pass server addresses or dispatcher=, not both (nor neither)"
    if (addresses is None) == (dispatcher is None):
        raise ConfigError(one_of)
    options = ClientOptions(
        credits=credits,
        credit_bytes=credit_bytes,
        broadcast=broadcast,
        heartbeat=P.Heartbeat(heartbeat_interval, heartbeat_timeout),
        connect_timeout=connect_timeout,
        limits=limits,
        with_meta=with_meta,
        on_loss=on_loss,
    )
    if dispatcher is not None:
        return LeasedClient(dispatcher, keys=as_client_keys(keys), options=options)
    if addresses is None:  # (refused above)
        raise ConfigError(one_of)
    return Client(addresses, keys=keys, options=options)
