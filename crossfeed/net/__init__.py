"""The network data plane: `crossfeed serve` (Server) streams batches to `connect()` (Client).

Modules: `protocol` (control envelopes), `dispatch` (credit/ack bookkeeping), `producer`
(batch source thread), `server` (options, lifecycle, PUB side), `distribute` (the ROUTER loop),
`receiver` (client I/O loop), `link` (one server's connection), `events` (what the receiver
reports), `client`, `addresses` (brace expansion), `keys` (CURVE), `observe` (statistics for
mon/stat/show). With a dispatcher (`crossfeed dispatch`): `leases` (lease and claim bookkeeping),
`journal` (its fsync'ed journal), `leasewire` (its messages), `dispatcher` (its process),
`lease_source` (a server's side: `serve --dispatcher`), `leased_client` (`connect(dispatcher=)`).
`run`: serving and dispatching a dataset as library calls (`run.serve(dataset, LoaderOptions,
ServerOptions)`, `run.dispatch(dataset, LoaderOptions, DispatcherOptions)`), what the commands run.
"""

from crossfeed.net.connect import connect
from crossfeed.net.keys import ClientKeys, ServerKeys, keygen
from crossfeed.net.lease.dispatcher import DispatcherOptions
from crossfeed.net.protocol import Heartbeat
from crossfeed.net.stream.client import Client, ClientOptions, OnLoss
from crossfeed.net.stream.events import LostServer
from crossfeed.net.stream.server import Mode, Server, ServerOptions

__all__ = [
    "Client",
    "ClientKeys",
    "ClientOptions",
    "DispatcherOptions",
    "Heartbeat",
    "LostServer",
    "Mode",
    "OnLoss",
    "Server",
    "ServerKeys",
    "ServerOptions",
    "connect",
    "keygen",
]
