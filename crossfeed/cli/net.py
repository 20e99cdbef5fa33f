"""`crossfeed serve DATASET ADDRESS...` and `crossfeed keygen DIR [NAME...]`."""

from __future__ import annotations

import contextlib
import enum
import logging
import signal
import threading
from pathlib import Path
from typing import Annotated

import typer

from crossfeed.cli.options import LOADER, with_options
from crossfeed.config import resolve_callable
from crossfeed.errors import ConfigError
from crossfeed.read.options import LoaderOptions

logger = logging.getLogger(__name__)


Metrics = Annotated[
    str | None,
    typer.Option(
        "--metrics",
        help="Serve Prometheus metrics on HOST:PORT (port 0: any free one), unauthenticated HTTP: keep it on "
        "127.0.0.1; another address needs --insecure (a trusted network).",
    ),
]


@contextlib.contextmanager
def _metrics_endpoint(address: str | None, how: str, target):
    """The Prometheus endpoint of `target` (`crossfeed.metrics.<how>`) while the block runs; its
    URL on stderr (port 0 bound a free one)."""
    if address is None:
        yield None
        return
    import crossfeed.metrics

    endpoint = getattr(crossfeed.metrics, how)(target, address)
    typer.echo(f"metrics (Prometheus, unauthenticated HTTP) on {endpoint.url}", err=True)
    try:
        yield endpoint
    finally:
        endpoint.close()


class ServeMode(str, enum.Enum):
    DISTRIBUTE = "distribute"
    BROADCAST = "broadcast"


class LoaderEpochs:
    """factory(epoch) over one `crossfeed.Loader` with the given `LoaderOptions` (batches carry
    their sample indices, for provenance — not packed rows or token budgets, whose rows hold
    pieces of several records): `set_epoch(epoch)`, then its batches."""

    def __init__(self, dataset: str, options: LoaderOptions, *, transform=None):
        from crossfeed.read.loader import Loader
        from crossfeed.read.sources.mixture_file import is_mixture_spec, load_mixture_spec

        source: str | list = dataset
        more: dict = {}
        if is_mixture_spec(dataset):  # a mixture: batches also carry "__source__"
            source, n = load_mixture_spec(dataset)
            more = {"samples_per_epoch": n}
        tokens = options.plan.pack is not None or options.plan.batch_by_tokens is not None
        self.loader = Loader(source, options.replace(return_index=not tokens, **more), transform=transform)

    def __call__(self, epoch: int):
        self.loader.set_epoch(epoch)
        return iter(self.loader)

    def close(self) -> None:
        self.loader.close()


@with_options(LOADER)
def serve(
    dataset: Annotated[str, typer.Argument(help="Dataset path or remote URL, or a mixture spec .json file.")],
    addresses: Annotated[list[str], typer.Argument(help="Addresses to bind; brace patterns expand.")],
    epochs: Annotated[int | None, typer.Option(min=1, help="End after N epochs (default: never).")] = None,
    start_epoch: Annotated[
        int,
        typer.Option(
            "--start-epoch", min=0, help="First epoch to serve (to resume a run: the same seed gives the same order)."
        ),
    ] = 0,
    transform: Annotated[str | None, typer.Option(help="module:function applied to each sample.")] = None,
    rank: Annotated[int | None, typer.Option(min=0, help="This server's share: rank R of --world-size M.")] = None,
    world_size: Annotated[
        int | None, typer.Option("--world-size", min=1, help="How many servers share the dataset.")
    ] = None,
    mode: Annotated[
        ServeMode, typer.Option(help="distribute: each batch to one trainer; broadcast: PUB.")
    ] = ServeMode.DISTRIBUTE,
    broadcast: Annotated[list[str] | None, typer.Option(help="PUB address(es) for mon/stat/show.")] = None,
    auth_keys: Annotated[
        Path | None, typer.Option("--auth-keys", help="Dir of accepted client *.key; enables CURVE.")
    ] = None,
    server_key: Annotated[
        Path | None, typer.Option("--server-key", help="Server .key_secret (default AUTH_KEYS/server.key_secret).")
    ] = None,
    heartbeat_interval: Annotated[
        float, typer.Option(min=0.01, help="Seconds between liveness messages to each trainer.")
    ] = 1.0,
    heartbeat_timeout: Annotated[
        float,
        typer.Option(
            min=0.05,
            help="Seconds of silence after which a trainer counts as gone (its unacknowledged batches go to others).",
        ),
    ] = 10.0,
    progress_timeout: Annotated[
        float,
        typer.Option(
            "--progress-timeout",
            min=0,
            help="Fence a trainer that holds batches and acknowledges none for S s (0: never); above your longest pause between batches.",
        ),
    ] = 300.0,
    insecure: Annotated[
        bool,
        typer.Option(
            "--insecure",
            help="Serve without --auth-keys on addresses other machines can reach (trusted networks only).",
        ),
    ] = False,
    endpoint_file: Annotated[Path | None, typer.Option(help="Write the bound addresses here (for scripts).")] = None,
    dispatcher: Annotated[
        str | None,
        typer.Option(help="Build the batches a `crossfeed dispatch` at this address leases (its plan rules)."),
    ] = None,
    dispatcher_keys: Annotated[
        Path | None,
        typer.Option("--dispatcher-keys", help="Dir with client.key_secret and the dispatcher's server.key (CURVE)."),
    ] = None,
    metrics: Metrics = None,
    metrics_linger: Annotated[
        float,
        typer.Option(
            "--metrics-linger",
            min=0,
            help="With --metrics: after the stream ends, keep the metrics up S s so Prometheus scrapes the final "
            "counts (SIGINT/SIGTERM end it at once).",
        ),
    ] = 0.0,
    *,
    options: LoaderOptions,
) -> None:
    """Run the Loader here and stream ready batches to trainers (`crossfeed.connect`)."""
    from crossfeed.net.keys import ServerKeys
    from crossfeed.net.protocol import Heartbeat
    from crossfeed.net.stream.server import Mode, ServerOptions

    keys = ServerKeys.from_dir(auth_keys, server_key) if auth_keys else None
    server_options = ServerOptions(
        tuple(addresses),
        broadcast=tuple(broadcast or ()),
        mode=Mode(mode.value),
        epochs=epochs,
        start_epoch=start_epoch,
        heartbeat=Heartbeat(heartbeat_interval, heartbeat_timeout),
        progress_timeout=progress_timeout or None,
        insecure=insecure,
    )
    if metrics is not None:
        from crossfeed.metrics import check_address, parse_address

        check_address(*parse_address(metrics), insecure=insecure)  # fails before anything starts
    if (rank is None) != (world_size is None):
        raise ConfigError("--rank and --world-size go together")
    if rank is not None:
        options = options.replace(rank=rank, world_size=world_size)
    fn = resolve_callable(transform, option="--transform", search_cwd=True) if transform else None
    if dispatcher is not None:
        if rank is not None or epochs is not None or start_epoch:
            raise ConfigError(
                "with --dispatcher the dispatcher owns the plan: drop --rank/--world-size/--epochs/--start-epoch"
            )
        source = dispatched_source(dataset, dispatcher, options, server_options, fn, dispatcher_keys)
        run_server(None, server_options, keys, endpoint_file, source=source, metrics=(metrics, metrics_linger))
        return
    factory = LoaderEpochs(dataset, options, transform=fn)
    try:
        run_server(factory, server_options, keys, endpoint_file, metrics=(metrics, metrics_linger))
    finally:
        factory.close()


def dispatched_source(dataset, dispatcher, local: LoaderOptions, options, transform, dispatcher_keys):
    """Server(source=...) building the leases of `dispatcher` from a Loader over `dataset` whose
    options are the dispatcher's plan (`LoaderOptions.plan_fields`, sent on joining), except how
    hard this server works and where it caches (`LOCAL_FIELDS`): this server's own."""
    from crossfeed.net.keys import ClientKeys
    from crossfeed.net.lease.source import LeaseSource
    from crossfeed.read.loader import Loader

    keys = ClientKeys.from_dir(dispatcher_keys) if dispatcher_keys else None

    def make_loader(plan: dict):
        opts = LoaderOptions.from_plan(plan, local)
        opts = opts.replace(return_index=opts.plan.pack is None)  # a packed row holds pieces of several records
        return Loader(dataset, opts, transform=transform)

    def source(endpoints, wake):
        return LeaseSource(
            dispatcher,
            make_loader,
            endpoints,
            server_id=options.server_id,
            keys=keys,
            heartbeat=options.heartbeat,
            on_put=wake,
        ).start()

    return source


def run_server(
    factory, options, keys, endpoint_file: Path | None, source=None, metrics: tuple[str | None, float] = (None, 0.0)
) -> None:
    """Serve until the stream ends or SIGINT/SIGTERM; raises CrossfeedError if the server failed.
    `metrics` (HOST:PORT, linger): Prometheus metrics of the server there while it runs, and for
    `linger` s after the stream ended (unless a signal ended it)."""
    from crossfeed.net.stream.server import Mode, Server

    stop = threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        with Server(factory, options, keys=keys, source=source) as server:
            bound = " ".join(server.endpoints + server.broadcast_endpoints)
            how = (
                "broadcast (PUB: mon/stat/show and evaluation; lossy)"
                if options.mode is Mode.BROADCAST
                else "distribution (trainers: crossfeed.connect)"
            )
            typer.echo(f"serving {how} on {' '.join(server.endpoints)}", err=True)
            if server.broadcast_endpoints:
                typer.echo(f"broadcast (PUB: mon/stat/show; lossy) on {' '.join(server.broadcast_endpoints)}", err=True)
            with _metrics_endpoint(metrics[0], "serve_server", server) as endpoint:
                if endpoint_file is not None:
                    tmp = endpoint_file.with_name(endpoint_file.name + ".tmp")
                    tmp.write_text(bound)
                    tmp.replace(endpoint_file)
                while not stop.is_set() and not server.wait(0.2):
                    pass
                if endpoint is not None and metrics[1] and not stop.is_set():
                    logger.info("the stream ended; metrics stay up for %gs", metrics[1])
                    stop.wait(metrics[1])
        server.raise_if_failed()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def keygen(
    directory: Annotated[Path, typer.Argument(help="Where to write the key files.")],
    names: Annotated[list[str] | None, typer.Argument(help="Key pair names (default: server client).")] = None,
) -> None:
    """Write CURVE key pairs NAME.key (public) and NAME.key_secret (keep private)."""
    from crossfeed.net.keys import keygen as make

    for name in names or ["server", "client"]:
        public, secret = make(directory, name)
        typer.echo(f"wrote {public} and {secret}", err=True)


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
    app.command("dispatch")(dispatch)
    app.command("keygen")(keygen)


@with_options(LOADER)
def dispatch(
    dataset: Annotated[str, typer.Argument(help="Dataset path or remote URL (its manifest sizes the plan).")],
    address: Annotated[str, typer.Argument(help="Address to bind, e.g. tcp://0.0.0.0:7870.")],
    epochs: Annotated[int, typer.Option(min=1, help="Epochs to hand out.")] = 1,
    world_size: Annotated[
        int,
        typer.Option(
            "--world-size",
            min=1,
            help="Trainers in lockstep DDP: each uses the same number of batches per epoch (the Loader's per-rank count).",
        ),
    ] = 1,
    journal: Annotated[
        Path | None,
        typer.Option(
            help="Journal file: a restarted dispatcher continues the epoch from it (default: none, a restart "
            "starts the plan over). A journal of another dataset or settings, or of a finished run, is refused."
        ),
    ] = None,
    restart: Annotated[
        bool,
        typer.Option("--restart", help="Run the plan again from its start on a --journal that holds a run."),
    ] = False,
    lease_size: Annotated[int, typer.Option("--lease-size", min=1, help="Batches per lease.")] = 8,
    window: Annotated[int, typer.Option(min=1, help="Batches leased to one server and not yet claimed.")] = 64,
    auth_keys: Annotated[
        Path | None, typer.Option("--auth-keys", help="Dir of accepted *.key (servers and trainers); enables CURVE.")
    ] = None,
    server_key: Annotated[
        Path | None, typer.Option("--server-key", help="Dispatcher .key_secret (default AUTH_KEYS/server.key_secret).")
    ] = None,
    heartbeat_interval: Annotated[float, typer.Option(min=0.01, help="Seconds between liveness messages.")] = 1.0,
    heartbeat_timeout: Annotated[
        float, typer.Option(min=0.05, help="Seconds of silence after which a server or trainer is declared dead.")
    ] = 10.0,
    insecure: Annotated[bool, typer.Option("--insecure", help="Bind a reachable address without --auth-keys.")] = False,
    endpoint_file: Annotated[Path | None, typer.Option(help="Write the bound address here (for scripts).")] = None,
    linger: Annotated[
        float, typer.Option(min=0, help="After the last epoch, seconds to keep telling latecomers it is done.")
    ] = 5.0,
    lease_timeout: Annotated[
        float,
        typer.Option(
            "--lease-timeout",
            min=0,
            help="Progress deadline of a server: one holding leased batches none of which reaches a trainer for "
            "S s is declared stalled (its leases go to the others, it rejoins under a new id), and a lease "
            "overtaken by later ones for S s is leased again (0: never). At least the heartbeat timeout; above "
            "the longest a server takes to build a batch (its first included).",
        ),
    ] = 120.0,
    claim_timeout: Annotated[
        float,
        typer.Option(
            "--claim-timeout",
            min=0,
            help="Progress deadline of a trainer: one holding claimed batches and reporting none used for S s is "
            "declared stalled (they go to the others, its client rejoins) (0: never). At least the heartbeat "
            "timeout; above the longest pause of your training loop between two batches.",
        ),
    ] = 300.0,
    metrics: Metrics = None,
    *,
    options: LoaderOptions,
) -> None:
    """Own the epoch plan and lease its batches to `serve --dispatcher` servers; every batch is
    used once across the trainers (`crossfeed.connect(dispatcher=...)`), whoever joins or dies.

    Deadlines: a server or trainer silent for --heartbeat-timeout s is declared dead; one that
    beats but makes no progress is declared stalled after --lease-timeout s (a server none of
    whose leased batches reaches a trainer) or --claim-timeout s (a trainer that reports none of
    its claimed batches used). Either way its work goes to the others and it is fenced: what it
    sends or claims afterwards under the old lease is refused."""
    from crossfeed.net.keys import ServerKeys
    from crossfeed.net.lease.book import MAX_PACKED_EPOCHS, PACKED_STRIDE
    from crossfeed.net.lease.dispatcher import DispatcherOptions, EpochCounts, LeaseDispatcher
    from crossfeed.net.protocol import Heartbeat
    from crossfeed.read.loader import Loader

    if metrics is not None:
        from crossfeed.metrics import check_address, parse_address

        check_address(*parse_address(metrics), insecure=insecure)  # fails before anything starts
    options = options.replace(rank=0, world_size=world_size)
    packed = options.plan.pack is not None
    if options.plan.batch_by_tokens is not None:
        raise typer.BadParameter(
            "token-budget (--batch-by-tokens) batches are not leased by a dispatcher yet: use crossfeed serve "
            "(one server per rank) instead",
            param_hint="--batch-by-tokens",
        )
    if packed and world_size > 1:
        raise typer.BadParameter(
            "with --pack-length the dispatcher leases the packed plan's global batches, whose number changes "
            "from epoch to epoch; lockstep DDP needs equal per-rank counts: drop --world-size, or use crossfeed "
            "serve --rank/--world-size",
            param_hint="--world-size",
        )
    if packed and epochs > MAX_PACKED_EPOCHS:
        raise typer.BadParameter(f"at most {MAX_PACKED_EPOCHS} epochs with --pack-length", param_hint="--epochs")
    loader = Loader(dataset, options.replace(num_threads=1))
    counts = None
    try:
        if packed:  # epoch e has its own count, one walk over its lengths (kept open for every epoch)
            counts = EpochCounts(lambda e: loader.rank_batch_count(0, epoch=e), epochs)
            per_rank, batches = counts(0), PACKED_STRIDE
        else:
            per_rank = loader.batch_count()
            batches = per_rank * world_size
    finally:
        if not packed:
            loader.close()
    plan = options.plan_fields()  # what every server's Loader takes from this dispatcher
    keys = ServerKeys.from_dir(auth_keys, server_key) if auth_keys else None
    dispatcher_options = DispatcherOptions(
        address,
        journal,
        epochs=epochs,
        lease_size=lease_size,
        window=max(window, lease_size),
        heartbeat=Heartbeat(heartbeat_interval, heartbeat_timeout),
        insecure=insecure,
        linger=linger,
        quota=per_rank if world_size > 1 else None,
        lease_timeout=lease_timeout or None,
        claim_timeout=claim_timeout or None,
        restart=restart,
    )
    identity = loader.pipeline.identity.fingerprint  # journaled with the plan, checked by every server
    stop = threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        with (
            LeaseDispatcher(plan, batches, dispatcher_options, keys=keys, counts=counts, identity=identity) as d,
            _metrics_endpoint(metrics, "serve_dispatcher", d),
        ):
            what = f"{per_rank} packed batches in epoch 0 (a count of its own each epoch)" if packed else None
            what = what or f"{batches} batches per epoch"
            typer.echo(f"dispatching {what}, {epochs} epochs, on {d.endpoint}", err=True)
            if endpoint_file is not None:
                tmp = endpoint_file.with_name(endpoint_file.name + ".tmp")
                tmp.write_text(d.endpoint)
                tmp.replace(endpoint_file)
            while not stop.is_set() and not d.wait(0.2):
                pass
        if d.error is not None:
            raise ConfigError(f"the dispatcher failed: {d.error}") from d.error
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if packed:
            loader.close()
