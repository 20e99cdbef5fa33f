"""`crossfeed.connect(...)`: a trainer's batches, from servers named directly (`Client`,
`crossfeed.net.stream`) or found through a dispatcher's leases (`LeasedClient`, `crossfeed.net.lease`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from typing import Any

from crossfeed.errors import ConfigError
from crossfeed.net import protocol as P
from crossfeed.net.keys import ClientKeys, as_client_keys
from crossfeed.net.lease.client import LeasedClient
from crossfeed.net.stream.client import Client, ClientOptions


def connect(
    addresses: str | Iterable[str] | None = None,
    *,
    dispatcher: str | None = None,
    keys: ClientKeys | str | os.PathLike | None = None,
    options: ClientOptions | None = None,
    **fields: Any,
) -> Client | Any:
    """A `Client` reading from every server in `addresses` (brace patterns expand).

    How it reads is one `ClientOptions`: pass it whole (``options=``) or its fields as keywords
    (``credits=8, credit_bytes="16MB", on_loss="continue"`` …; ``heartbeat_interval`` /
    ``heartbeat_timeout`` stand for ``heartbeat=Heartbeat(interval, timeout)``), not both; the
    defaults are `ClientOptions`'s.

    `keys`: a `ClientKeys` or a directory holding `client.key_secret` and `server.key`.
    `credits` / `credit_bytes`: how many batches / bytes (a count or a size such as "64MB") each
    server may have in flight to this client (received, not yet consumed); the server sends the
    next batch while both allow it.
    `on_loss`: "raise" (default): a server that never answers, goes silent, restarts or fails
    raises `ServerLostError`; "continue": read on from the others, `client.lost` lists it.
    `dispatcher`: instead of `addresses`, a `crossfeed dispatch` address: the servers it leases
    work to are found through it, and every batch is used exactly once across its trainers
    (`crossfeed.net.lease.client`; `keys` serve for the dispatcher and the servers alike).
    """
    one_of = "pass server addresses or dispatcher=, not both (nor neither)"
    if (addresses is None) == (dispatcher is None):
        raise ConfigError("pass server addresses or dispatcher=, not both (nor neither)")
    options = client_options(options, fields)
    if dispatcher is not None:
        return LeasedClient(dispatcher, keys=as_client_keys(keys), options=options)
    if addresses is None:  # (refused above)
        raise ConfigError(one_of)
    return Client(addresses, keys=keys, options=options)


_HEARTBEAT = {"heartbeat_interval": "interval", "heartbeat_timeout": "timeout"}


def client_options(options: ClientOptions | None, fields: dict) -> ClientOptions:
    """``options`` whole, or ``fields`` (keywords of `ClientOptions`, and ``heartbeat_interval``
    / ``heartbeat_timeout``) made into one — not both; an unknown keyword names the known ones."""
    if options is not None:
        if fields:
            raise ConfigError(f"pass either a ClientOptions or keywords, not both (got {sorted(fields)})")
        if not isinstance(options, ClientOptions):
            raise ConfigError(f"options must be a ClientOptions, got {type(options).__name__}")
        return options
    known = {f.name for f in dataclasses.fields(ClientOptions)}
    unknown = sorted(set(fields) - known - set(_HEARTBEAT))
    if unknown:
        raise ConfigError(f"unknown connect option(s) {unknown}; the options are {sorted(known | set(_HEARTBEAT))}")
    beat = {_HEARTBEAT[k]: fields.pop(k) for k in list(fields) if k in _HEARTBEAT}
    if beat:
        if "heartbeat" in fields:
            raise ConfigError("pass heartbeat= or heartbeat_interval/heartbeat_timeout, not both")
        fields["heartbeat"] = P.Heartbeat(**beat)
    return ClientOptions(**fields)
