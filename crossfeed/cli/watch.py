"""`crossfeed mon | stat | show ADDRESS...`: watch a stream without taking batches from trainers.

They subscribe to a server's broadcast (PUB) addresses: `serve --broadcast ADDRESS` in
distribution mode, or the main addresses of `serve --mode broadcast`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from crossfeed.errors import CrossfeedError

logger = logging.getLogger(__name__)

Addresses = Annotated[list[str], typer.Argument(help="Broadcast addresses; brace patterns expand.")]
Keys = Annotated[Optional[Path], typer.Option("--keys", help="Dir with client.key_secret and server.key.")]
Timeout = Annotated[float, typer.Option("--timeout", min=0.1, help="Give up on a silent server after S s.")]


def _subscribe(addresses: list[str], keys: Path | None, timeout: float):
    from crossfeed.net.client import connect

    return connect(addresses, keys=keys, broadcast=True, connect_timeout=timeout, on_loss="continue",
                   heartbeat_timeout=timeout, heartbeat_interval=min(1.0, timeout / 4))


def _fail(e: CrossfeedError) -> typer.Exit:
    typer.echo(f"error: {e}", err=True)
    return typer.Exit(2)


def mon(
    addresses: Addresses,
    count: Annotated[int, typer.Option("-c", "--count", min=0, help="Stop after N batches (0: never).")] = 0,
    every: Annotated[float, typer.Option("--every", min=0.1, help="Seconds between reports.")] = 1.0,
    keys: Keys = None,
    timeout: Timeout = 30.0,
) -> None:
    """Live batches/s, samples/s and MB/s of a stream."""
    from crossfeed.net.observe import Rates

    try:
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
            b, s, mb = total.per_second(time.monotonic())
            typer.echo(f"total: {total.batches} batches, {total.samples} samples, "
                       f"{total.nbytes / 1e6:.2f} MB; {b:.1f} batches/s {s:.1f} samples/s {mb:.2f} MB/s")
    except CrossfeedError as e:
        raise _fail(e) from e


def stat(
    addresses: Addresses,
    count: Annotated[int, typer.Option("-c", "--count", min=1, help="Batches to look at.")] = 10,
    keys: Keys = None,
    timeout: Timeout = 30.0,
) -> None:
    """Per field: the dtype/shape set, min, max, mean and std over N batches."""
    from crossfeed.net.observe import field_stats

    try:
        stats: dict = {}
        seen = 0
        with _subscribe(addresses, keys, timeout) as stream:
            for batch in stream:
                field_stats([batch], stats)
                seen += 1
                if seen >= count:
                    break
        if not seen:
            raise CrossfeedError("no batch received")
        typer.echo(f"{seen} batches")
        for name, s in stats.items():
            typer.echo(s.row(name))
    except CrossfeedError as e:
        raise _fail(e) from e


def show(
    addresses: Addresses,
    output: Annotated[Path, typer.Option("-o", "--output", help="PNG file to write.")],
    image: Annotated[Optional[str], typer.Option("--image", help="Image field (default: first N,H,W[,C]).")] = None,
    label: Annotated[Optional[str], typer.Option("--label", help="Label field (default: first 1-D field).")] = None,
    skip: Annotated[int, typer.Option("--skip", min=0, help="Batches to skip first.")] = 0,
    keys: Keys = None,
    timeout: Timeout = 30.0,
) -> None:
    """Write a PNG grid of the images of one batch, with their labels."""
    from crossfeed.net.observe import image_grid

    try:
        with _subscribe(addresses, keys, timeout) as stream:
            batch = None
            for i, b in enumerate(stream):
                if i >= skip:
                    batch = b
                    break
        if batch is None:
            raise CrossfeedError("no batch received")
        image_grid(batch, image=image, label=label).save(output, format="PNG")
        typer.echo(f"wrote {output}", err=True)
    except CrossfeedError as e:
        raise _fail(e) from e


def register(app: typer.Typer) -> None:
    app.command("mon")(mon)
    app.command("stat")(stat)
    app.command("show")(show)
