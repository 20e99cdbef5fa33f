"""`crossfeed mon | stat | show ADDRESS...`: watch a stream without taking batches from trainers.

They subscribe to a server's broadcast (PUB) addresses: `serve --broadcast ADDRESS` in
distribution mode, or the main addresses of `serve --mode broadcast`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Annotated

import typer

from crossfeed.errors import CrossfeedError

logger = logging.getLogger(__name__)

Addresses = Annotated[list[str], typer.Argument(help="Broadcast addresses; brace patterns expand.")]
Keys = Annotated[Path | None, typer.Option("--keys", help="Dir with client.key_secret and server.key.")]
Timeout = Annotated[float, typer.Option("--timeout", min=0.1, help="Give up on a silent server after S s.")]


def _subscribe(addresses: list[str], keys: Path | None, timeout: float):
    from crossfeed.net.connect import connect

    return connect(
        addresses,
        keys=keys,
        broadcast=True,
        connect_timeout=timeout,
        on_loss="continue",
        heartbeat_timeout=timeout,
        heartbeat_interval=min(1.0, timeout / 4),
    )


def _nothing_received(addresses: list[str], timeout: float) -> CrossfeedError:
    return CrossfeedError(
        f"no batch received from {' '.join(addresses)} within {timeout:g}s. mon/stat/show subscribe to a "
        f"broadcast (PUB) address: the one `crossfeed serve` prints as 'broadcast … on ADDRESS' (serve "
        f"--broadcast ADDRESS, or the main address of serve --mode broadcast), not a distribution address; "
        f"check that the server runs and that the address and --keys are right"
    )


def _class_names(dataset: str | None) -> list[str] | None:
    """The class names in a dataset's manifest metadata (``class_names``), or None without --dataset."""
    if dataset is None:
        return None
    from crossfeed.read.sources.dataset import open_dataset

    with open_dataset(dataset) as ds:
        names = ds.metadata.get("class_names")
    if not names:
        raise CrossfeedError(
            f"{dataset}: its manifest metadata has no class_names; labels are shown as numbers without --dataset"
        )
    return [str(n) for n in names]


def mon(
    addresses: Addresses,
    count: Annotated[int, typer.Option("-c", "--count", min=0, help="Stop after N batches (0: never).")] = 0,
    every: Annotated[float, typer.Option("--every", min=0.1, help="Seconds between reports.")] = 1.0,
    keys: Keys = None,
    timeout: Timeout = 30.0,
) -> None:
    """Live batches/s, samples/s and MB/s of a stream."""
    from crossfeed.net.observe import Rates

    with _subscribe(addresses, keys, timeout) as stream:
        now = time.monotonic()
        total, window = Rates(now), Rates(now)
        for batch in stream:
            total.add(batch)
            window.add(batch)
            now = time.monotonic()
            if now - window.start >= every:
                b, s, mb = window.per_second(now)
                typer.echo(f"{b:10.1f} batches/s {s:12.1f} samples/s {mb:10.2f} MB/s")
                window = Rates(now)
            if count and total.batches >= count:
                break
    if not total.batches:
        raise _nothing_received(addresses, timeout)
    b, s, mb = total.per_second(time.monotonic())
    typer.echo(
        f"total: {total.batches} batches, {total.samples} samples, "
        f"{total.nbytes / 1e6:.2f} MB; {b:.1f} batches/s {s:.1f} samples/s {mb:.2f} MB/s"
    )


def stat(
    addresses: Addresses,
    count: Annotated[int, typer.Option("-c", "--count", min=1, help="Batches to look at.")] = 10,
    keys: Keys = None,
    timeout: Timeout = 30.0,
) -> None:
    """Per field over N batches: dtypes, item shapes (min/max of each dimension when they vary) and
    the values' min, max, mean and std (pixels for images, never their sizes)."""
    from crossfeed.net.observe import field_stats

    stats: dict = {}
    seen = 0
    with _subscribe(addresses, keys, timeout) as stream:
        for batch in stream:
            field_stats([batch], stats)
            seen += 1
            if seen >= count:
                break
    if not seen:
        raise _nothing_received(addresses, timeout)
    typer.echo(f"{seen} batches")
    for name, s in stats.items():
        typer.echo(s.row(name))


def show(
    addresses: Addresses,
    output: Annotated[Path, typer.Option("-o", "--output", help="PNG file to write.")],
    image: Annotated[str | None, typer.Option("--image", help="Image field (default: first N,H,W[,C]).")] = None,
    label: Annotated[str | None, typer.Option("--label", help="Label field (default: first 1-D field).")] = None,
    dataset: Annotated[
        str | None,
        typer.Option(
            "--dataset", help="Dataset served (path/URL): label indices are shown as its manifest's class names."
        ),
    ] = None,
    tile: Annotated[
        int,
        typer.Option(
            "--tile", min=8, help="Tile size in pixels; images of other sizes are resized to fit, keeping their aspect."
        ),
    ] = 96,
    skip: Annotated[int, typer.Option("--skip", min=0, help="Batches to skip first.")] = 0,
    keys: Keys = None,
    timeout: Timeout = 30.0,
) -> None:
    """Write a PNG grid of the images of one batch (any sizes), with their labels or class names."""
    from crossfeed.net.observe import image_grid

    class_names = _class_names(dataset)
    with _subscribe(addresses, keys, timeout) as stream:
        batch = None
        for i, b in enumerate(stream):
            if i >= skip:
                batch = b
                break
    if batch is None:
        raise _nothing_received(addresses, timeout)
    image_grid(batch, image=image, label=label, class_names=class_names, tile=tile).save(output, format="PNG")
    typer.echo(f"wrote {output}", err=True)


def register(app: typer.Typer) -> None:
    app.command("mon")(mon)
    app.command("stat")(stat)
    app.command("show")(show)
