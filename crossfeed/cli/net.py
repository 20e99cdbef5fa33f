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
from crossfeed.read.plan import Shuffle

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
        rank=0 if rank is None else rank,
        world_size=1 if world_size is None else world_size,
        cache_dir=cache_dir,
        cache_limit=cache_limit,
    )
    factory = LoaderEpochs(dataset, loader_options, transform=resolve_function(transform) if transform else None)
    try:
        run_server(factory, options, keys, endpoint_file)
    finally:
        factory.close()


def run_server(factory, options, keys, endpoint_file: Path | None) -> None:
    """Serve until the stream ends or SIGINT/SIGTERM; raises CrossfeedError if the server failed."""
    from crossfeed.net.server import Mode, Server

    stop = threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        with Server(factory, options, keys=keys) as server:
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
    app.command("keygen")(keygen)
