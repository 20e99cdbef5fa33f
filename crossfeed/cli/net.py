"""`crossfeed serve DATASET ADDRESS...`, `crossfeed dispatch DATASET ADDRESS` and `crossfeed keygen
DIR [NAME...]`: flags parsed into the network options (`ServerOptions`, `DispatcherOptions`, whose
defaults are the flags' defaults) and handed to `crossfeed.net.run`, which does the work."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from pathlib import Path
from typing import Annotated

import typer

from crossfeed.cli.options import LOADER, default_of, with_options
from crossfeed.config import resolve_callable
from crossfeed.errors import ConfigError
from crossfeed.net import run
from crossfeed.net.lease.dispatcher import DispatcherOptions
from crossfeed.net.protocol import Heartbeat
from crossfeed.net.stream.server import Mode, ServerOptions
from crossfeed.read.options import LoaderOptions, ReadOptions

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


def _seconds_or_none(value: float) -> float | None:
    """A deadline flag: 0 means never (None in the options)."""
    return value or None


@contextlib.contextmanager
def _stop_on_signals():
    """An Event set by SIGINT/SIGTERM while the block runs (in the main thread)."""
    stop = threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _write_endpoint_file(path: Path | None, text: str) -> None:
    if path is not None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)


@with_options(LOADER)
def serve(
    dataset: Annotated[str, typer.Argument(help="Dataset path or remote URL, or a mixture spec .json file.")],
    addresses: Annotated[list[str], typer.Argument(help="Addresses to bind; brace patterns expand.")],
    epochs: Annotated[int | None, typer.Option(min=1, help="End after N epochs (default: never).")] = default_of(
        ServerOptions, "epochs"
    ),
    start_epoch: Annotated[
        int,
        typer.Option(
            "--start-epoch", min=0, help="First epoch to serve (to resume a run: the same seed gives the same order)."
        ),
    ] = default_of(ServerOptions, "start_epoch"),
    transform: Annotated[str | None, typer.Option(help="module:function applied to each sample.")] = None,
    filter: Annotated[
        str | None,
        typer.Option(
            "--filter",
            help="module:function, a predicate on each decoded sample: False drops it (its batch comes shorter; "
            "counted). Runs here, also under --dispatcher.",
        ),
    ] = None,
    max_filtered: Annotated[
        float | None,
        typer.Option(
            "--max-filtered",
            min=0,
            max=1,
            help="Fail once --filter (or a transform returning None) drops more than this share of the samples "
            "(default: no limit).",
        ),
    ] = default_of(ReadOptions, "max_filtered"),
    rank: Annotated[int | None, typer.Option(min=0, help="This server's share: rank R of --world-size M.")] = None,
    world_size: Annotated[
        int | None, typer.Option("--world-size", min=1, help="How many servers share the dataset.")
    ] = None,
    mode: Annotated[Mode, typer.Option(help="distribute: each batch to one trainer; broadcast: PUB.")] = default_of(
        ServerOptions, "mode"
    ),
    broadcast: Annotated[list[str] | None, typer.Option(help="PUB address(es) for mon/stat/show.")] = None,
    auth_keys: Annotated[
        Path | None, typer.Option("--auth-keys", help="Dir of accepted client *.key; enables CURVE.")
    ] = None,
    server_key: Annotated[
        Path | None, typer.Option("--server-key", help="Server .key_secret (default AUTH_KEYS/server.key_secret).")
    ] = None,
    heartbeat_interval: Annotated[
        float, typer.Option(min=0.01, help="Seconds between liveness messages to each trainer.")
    ] = default_of(Heartbeat, "interval"),
    heartbeat_timeout: Annotated[
        float,
        typer.Option(
            min=0.05,
            help="Seconds of silence after which a trainer counts as gone (its unacknowledged batches go to others).",
        ),
    ] = default_of(Heartbeat, "timeout"),
    progress_timeout: Annotated[
        float,
        typer.Option(
            "--progress-timeout",
            min=0,
            help="Fence a trainer that holds batches and acknowledges none for S s (0: never); above your longest pause between batches.",
        ),
    ] = default_of(ServerOptions, "progress_timeout"),
    insecure: Annotated[
        bool,
        typer.Option(
            "--insecure",
            help="Serve without --auth-keys on addresses other machines can reach (trusted networks only).",
        ),
    ] = default_of(ServerOptions, "insecure"),
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
    """Run the Loader here and stream ready batches to trainers (`crossfeed.connect`).

    --transform and --filter run here, on every sample this server builds; a filtered sample
    leaves its batch shorter (counted). With --dispatcher the dispatcher's plan rules, and
    --skip must name the dispatcher's skip file (a server with another list is refused, the
    setting named); without one, --skip leaves out the file's steps and samples here."""
    from crossfeed.net.keys import ClientKeys, ServerKeys

    keys = ServerKeys.from_dir(auth_keys, server_key) if auth_keys else None
    server_options = ServerOptions(
        tuple(addresses),
        broadcast=tuple(broadcast or ()),
        mode=mode,
        epochs=epochs,
        start_epoch=start_epoch,
        heartbeat=Heartbeat(heartbeat_interval, heartbeat_timeout),
        progress_timeout=_seconds_or_none(progress_timeout),
        insecure=insecure,
    )
    if metrics is not None:
        from crossfeed.metrics import check_address, parse_address

        check_address(*parse_address(metrics), insecure=insecure)  # fails before anything starts
    if (rank is None) != (world_size is None):
        raise ConfigError("--rank and --world-size go together")
    if rank is not None:
        if dispatcher is not None:
            raise ConfigError(
                "with --dispatcher the dispatcher owns the plan: drop --rank/--world-size/--epochs/--start-epoch"
            )
        options = options.replace(rank=rank, world_size=world_size)
    fn = resolve_callable(transform, option="--transform", search_cwd=True) if transform else None
    keep = resolve_callable(filter, option="--filter", search_cwd=True) if filter else None
    if max_filtered is not None:
        options = options.replace(max_filtered=max_filtered)
    dkeys = ClientKeys.from_dir(dispatcher_keys) if dispatcher_keys else None
    with (
        _stop_on_signals() as stop,
        run.serving(
            dataset,
            options,
            server_options,
            transform=fn,
            filter=keep,
            keys=keys,
            dispatcher=dispatcher,
            dispatcher_keys=dkeys,
        ) as server,
    ):
        bound = " ".join(server.endpoints + server.broadcast_endpoints)
        how = (
            "broadcast (PUB: mon/stat/show and evaluation; lossy)"
            if server_options.mode is Mode.BROADCAST
            else "distribution (trainers: crossfeed.connect)"
        )
        typer.echo(f"serving {how} on {' '.join(server.endpoints)}", err=True)
        if server.broadcast_endpoints:
            typer.echo(f"broadcast (PUB: mon/stat/show; lossy) on {' '.join(server.broadcast_endpoints)}", err=True)
        with _metrics_endpoint(metrics, "serve_server", server) as endpoint:
            _write_endpoint_file(endpoint_file, bound)
            run.wait_until_done(server, stop)
            if endpoint is not None and metrics_linger and not stop.is_set():
                logger.info("the stream ended; metrics stay up for %gs", metrics_linger)
                stop.wait(metrics_linger)
    server.raise_if_failed()


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
    dataset: Annotated[
        str,
        typer.Argument(help="Dataset path or remote URL (its manifest sizes the plan), or a mixture spec .json file."),
    ],
    address: Annotated[str, typer.Argument(help="Address to bind, e.g. tcp://0.0.0.0:7870.")],
    epochs: Annotated[int, typer.Option(min=1, help="Epochs to hand out.")] = default_of(DispatcherOptions, "epochs"),
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
    lease_size: Annotated[int, typer.Option("--lease-size", min=1, help="Batches per lease.")] = default_of(
        DispatcherOptions, "lease_size"
    ),
    window: Annotated[int, typer.Option(min=1, help="Batches leased to one server and not yet claimed.")] = default_of(
        DispatcherOptions, "window"
    ),
    auth_keys: Annotated[
        Path | None, typer.Option("--auth-keys", help="Dir of accepted *.key (servers and trainers); enables CURVE.")
    ] = None,
    server_key: Annotated[
        Path | None, typer.Option("--server-key", help="Dispatcher .key_secret (default AUTH_KEYS/server.key_secret).")
    ] = None,
    heartbeat_interval: Annotated[
        float, typer.Option(min=0.01, help="Seconds between liveness messages.")
    ] = default_of(Heartbeat, "interval"),
    heartbeat_timeout: Annotated[
        float, typer.Option(min=0.05, help="Seconds of silence after which a server or trainer is declared dead.")
    ] = default_of(Heartbeat, "timeout"),
    insecure: Annotated[
        bool, typer.Option("--insecure", help="Bind a reachable address without --auth-keys.")
    ] = default_of(DispatcherOptions, "insecure"),
    endpoint_file: Annotated[Path | None, typer.Option(help="Write the bound address here (for scripts).")] = None,
    linger: Annotated[
        float, typer.Option(min=0, help="After the last epoch, seconds to keep telling latecomers it is done.")
    ] = default_of(DispatcherOptions, "linger"),
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
    ] = default_of(DispatcherOptions, "lease_timeout"),
    claim_timeout: Annotated[
        float,
        typer.Option(
            "--claim-timeout",
            min=0,
            help="Progress deadline of a trainer: one holding claimed batches and reporting none used for S s is "
            "declared stalled (they go to the others, its client rejoins) (0: never). At least the heartbeat "
            "timeout; above the longest pause of your training loop between two batches.",
        ),
    ] = default_of(DispatcherOptions, "claim_timeout"),
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
    sends or claims afterwards under the old lease is refused.

    Recipes: --skip FILE leaves its global steps out of the plan (never leased; each epoch counts
    its kept steps, packed ones with --pack-length too) and its sample ids unread; give every
    server the same --skip FILE. --weights
    NAME draws by a weights set each server reads from its copy of the dataset."""
    from crossfeed.net.keys import ServerKeys

    if metrics is not None:
        from crossfeed.metrics import check_address, parse_address

        check_address(*parse_address(metrics), insecure=insecure)  # fails before anything starts
    dispatcher_options = DispatcherOptions(
        address,
        journal,
        epochs=epochs,
        lease_size=lease_size,
        window=max(window, lease_size),
        heartbeat=Heartbeat(heartbeat_interval, heartbeat_timeout),
        insecure=insecure,
        linger=linger,
        lease_timeout=_seconds_or_none(lease_timeout),
        claim_timeout=_seconds_or_none(claim_timeout),
        restart=restart,
    )
    keys = ServerKeys.from_dir(auth_keys, server_key) if auth_keys else None

    def ready(d, plan: run.DispatchPlan) -> None:
        what = f"{plan.per_rank} packed batches in epoch 0 (a count of its own each epoch)" if plan.packed else None
        if plan.packed and options.plan.skip is not None and options.plan.skip.steps:
            what = f"{plan.per_rank} packed batches in epoch 0 (a count of its own each epoch, skipped steps left out)"
        if what is None and plan.counts is not None:
            what = f"{plan.per_rank * world_size} of {plan.batches} batches in epoch 0 (skipped steps left out)"
        what = what or f"{plan.batches} batches per epoch"
        typer.echo(f"dispatching {what}, {epochs} epochs, on {d.endpoint}", err=True)
        _write_endpoint_file(endpoint_file, d.endpoint)

    with _stop_on_signals() as stop:
        run.dispatch(
            dataset,
            options,
            dispatcher_options,
            world_size=world_size,
            keys=keys,
            stop=stop,
            on_ready=ready,
            around=lambda d: _metrics_endpoint(metrics, "serve_dispatcher", d),
        )
