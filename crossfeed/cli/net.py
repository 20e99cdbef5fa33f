"""`crossfeed serve DATASET ADDRESS...` and `crossfeed keygen DIR [NAME...]`."""

from __future__ import annotations

import enum
import importlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from crossfeed.cli.common import CacheDirOpt, CacheLimitOpt
from crossfeed.errors import ConfigError
from crossfeed.read.options import LoaderOptions
from crossfeed.read.plan import Remainder, Shuffle

logger = logging.getLogger(__name__)


class ServeMode(str, enum.Enum):
    DISTRIBUTE = "distribute"
    BROADCAST = "broadcast"


def resolve_function(spec: str) -> Callable[..., Any]:
    """`package.module:function` -> the function. Modules in the current directory are found, as
    with ``python -m``."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"--transform {spec!r}: expected module:function, e.g. mypkg.aug:augment")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(
            f"--transform {spec!r}: cannot import {module_name} ({e}); run from the folder "
            f"holding {module_name.split('.')[0]}.py or add that folder to PYTHONPATH"
        ) from e
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ConfigError(f"--transform {spec!r}: {module_name} has no attribute {attr!r}")
    if not callable(fn):
        raise ConfigError(f"--transform {spec!r} is not callable")
    return fn


class LoaderEpochs:
    """factory(epoch) over one `crossfeed.Loader` with the given `LoaderOptions` (batches carry
    their sample indices, for provenance): `set_epoch(epoch)`, then its batches."""

    def __init__(self, dataset: str, options: LoaderOptions, *, transform=None):
        from crossfeed.read.loader import Loader
        from crossfeed.read.mixture_spec import is_mixture_spec, load_mixture_spec

        source, more = dataset, {}
        if is_mixture_spec(dataset):  # a mixture: batches also carry "__source__"
            source, n = load_mixture_spec(dataset)
            more = {"samples_per_epoch": n}
        self.loader = Loader(source, options.replace(return_index=True, **more), transform=transform)

    def __call__(self, epoch: int):
        self.loader.set_epoch(epoch)
        return iter(self.loader)

    def close(self) -> None:
        self.loader.close()


def serve(
    dataset: Annotated[str, typer.Argument(help="Dataset path or remote URL, or a mixture spec .json file.")],
    addresses: Annotated[list[str], typer.Argument(help="Addresses to bind; brace patterns expand.")],
    split: Annotated[str, typer.Option(help="Split to serve.")] = "train",
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Samples per batch sent.")] = 32,
    shuffle: Annotated[Shuffle, typer.Option(help="Shuffle mode.")] = Shuffle.GLOBAL,
    seed: Annotated[int, typer.Option(help="Shuffle seed.")] = 0,
    epochs: Annotated[int | None, typer.Option(min=1, help="End after N epochs (default: never).")] = None,
    start_epoch: Annotated[
        int,
        typer.Option(
            "--start-epoch", min=0, help="First epoch to serve (to resume a run: the same seed gives the same order)."
        ),
    ] = 0,
    transform: Annotated[str | None, typer.Option(help="module:function applied to each sample.")] = None,
    workers: Annotated[int, typer.Option(min=1, help="Loader threads building batches in parallel.")] = 2,
    procs: Annotated[
        int | None,
        typer.Option(
            "--procs",
            min=1,
            help="Build batches in N worker processes (shared memory) instead of --workers threads: for Python transforms.",
        ),
    ] = None,
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
    cache_dir: CacheDirOpt = None,
    cache_limit: CacheLimitOpt = None,
) -> None:
    """Run the Loader here and stream ready batches to trainers (`crossfeed.connect`)."""
    from crossfeed.net.keys import ServerKeys
    from crossfeed.net.protocol import Heartbeat
    from crossfeed.net.server import Mode, ServerOptions

    keys = ServerKeys.from_dir(auth_keys, server_key) if auth_keys else None
    options = ServerOptions(
        tuple(addresses),
        broadcast=tuple(broadcast or ()),
        mode=Mode(mode.value),
        epochs=epochs,
        start_epoch=start_epoch,
        heartbeat=Heartbeat(heartbeat_interval, heartbeat_timeout),
        progress_timeout=progress_timeout or None,
        insecure=insecure,
    )
    if (rank is None) != (world_size is None):
        raise ConfigError("--rank and --world-size go together")
    loader_options = LoaderOptions.of(  # a server is not a trainer: RANK/WORLD_SIZE are not its share
        split=split,
        batch_size=batch_size,
        shuffle=shuffle.value,
        seed=seed,
        num_threads=workers,
        executor="thread" if procs is None else "process",
        processes=procs or 1,
        rank=0 if rank is None else rank,
        world_size=1 if world_size is None else world_size,
        cache_dir=cache_dir,
        cache_limit=cache_limit,
    )
    fn = resolve_function(transform) if transform else None
    if dispatcher is not None:
        if rank is not None or epochs is not None or start_epoch:
            raise ConfigError(
                "with --dispatcher the dispatcher owns the plan: drop --rank/--world-size/--epochs/--start-epoch"
            )
        source = dispatched_source(dataset, dispatcher, loader_options, options, fn, dispatcher_keys)
        run_server(None, options, keys, endpoint_file, source=source)
        return
    factory = LoaderEpochs(dataset, loader_options, transform=fn)
    try:
        run_server(factory, options, keys, endpoint_file)
    finally:
        factory.close()


def dispatched_source(dataset, dispatcher, loader_options, options, transform, dispatcher_keys):
    """Server(source=...) building the leases of `dispatcher` from a Loader over `dataset` whose
    plan options (split, batch size, shuffle, seed) are the dispatcher's, and whose executor
    (--workers threads or --procs processes) is this server's."""
    from crossfeed.net.keys import ClientKeys
    from crossfeed.net.lease_source import LeaseSource
    from crossfeed.read.loader import Loader

    keys = ClientKeys.from_dir(dispatcher_keys) if dispatcher_keys else None

    def make_loader(plan: dict):
        return Loader(
            dataset,
            LoaderOptions.of(
                split=plan["split"],
                batch_size=int(plan["batch_size"]),
                shuffle=plan["shuffle"],
                seed=int(plan["seed"]),
                remainder=plan.get("remainder", "pad"),
                num_threads=loader_options.read.num_threads,
                executor=loader_options.read.executor,
                processes=loader_options.read.processes,
                cache_dir=loader_options.read.cache_dir,
                cache_limit=loader_options.read.cache_limit,
                return_index=True,
            ),
            transform=transform,
        )

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


def run_server(factory, options, keys, endpoint_file: Path | None, source=None) -> None:
    """Serve until the stream ends or SIGINT/SIGTERM; raises CrossfeedError if the server failed."""
    from crossfeed.net.server import Mode, Server

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
            if endpoint_file is not None:
                tmp = endpoint_file.with_name(endpoint_file.name + ".tmp")
                tmp.write_text(bound)
                tmp.replace(endpoint_file)
            while not stop.is_set() and not server.wait(0.2):
                pass
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


def dispatch(
    dataset: Annotated[str, typer.Argument(help="Dataset path or remote URL (its manifest sizes the plan).")],
    address: Annotated[str, typer.Argument(help="Address to bind, e.g. tcp://0.0.0.0:7870.")],
    split: Annotated[str, typer.Option(help="Split to serve.")] = "train",
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Samples per batch.")] = 32,
    shuffle: Annotated[Shuffle, typer.Option(help="Shuffle mode.")] = Shuffle.GLOBAL,
    seed: Annotated[int, typer.Option(help="Shuffle seed.")] = 0,
    epochs: Annotated[int, typer.Option(min=1, help="Epochs to hand out.")] = 1,
    world_size: Annotated[
        int,
        typer.Option(
            "--world-size",
            min=1,
            help="Trainers in lockstep DDP: each uses the same number of batches per epoch (the Loader's per-rank count).",
        ),
    ] = 1,
    remainder: Annotated[
        Remainder, typer.Option(help="With --world-size: pad the epoch's tail from its start, or drop it.")
    ] = Remainder.PAD,
    journal: Annotated[
        Path, typer.Option(help="Journal file: a restarted dispatcher continues the epoch from it.")
    ] = Path("crossfeed-dispatch.journal"),
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
) -> None:
    """Own the epoch plan and lease its batches to `serve --dispatcher` servers; every batch is
    used once across the trainers (`crossfeed.connect(dispatcher=...)`), whoever joins or dies."""
    from crossfeed.net.dispatcher import DispatcherOptions, LeaseDispatcher
    from crossfeed.net.keys import ServerKeys
    from crossfeed.net.protocol import Heartbeat
    from crossfeed.read.loader import Loader

    plan = {"split": split, "batch_size": batch_size, "shuffle": shuffle.value, "seed": seed}
    plan |= {"world_size": world_size, "remainder": remainder.value}
    opts = LoaderOptions.of(
        split=split, batch_size=batch_size, shuffle=shuffle.value, seed=seed, remainder=remainder.value, num_threads=1
    )
    with Loader(dataset, opts.replace(rank=0, world_size=world_size)) as loader:
        per_rank = loader.batch_count()
    batches = per_rank * world_size
    keys = ServerKeys.from_dir(auth_keys, server_key) if auth_keys else None
    options = DispatcherOptions(
        address,
        journal,
        epochs=epochs,
        lease_size=lease_size,
        window=max(window, lease_size),
        heartbeat=Heartbeat(heartbeat_interval, heartbeat_timeout),
        insecure=insecure,
        linger=linger,
        quota=per_rank if world_size > 1 else None,
    )
    stop = threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        with LeaseDispatcher(plan, batches, options, keys=keys) as d:
            typer.echo(f"dispatching {batches} batches per epoch, {epochs} epochs, on {d.endpoint}", err=True)
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
