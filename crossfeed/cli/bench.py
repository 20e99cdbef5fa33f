"""``crossfeed bench``: read a dataset like a trainer would and say where the time goes.

A thin shell over `crossfeed.read.profile.bench_loader`; the report goes to stdout, errors to stderr
as one line with exit status 2.
"""

from __future__ import annotations

import enum
import functools
from typing import Annotated

import typer

from crossfeed.errors import CrossfeedError


class ShuffleChoice(str, enum.Enum):
    GLOBAL = "global"
    BLOCK = "block"
    NONE = "none"


def bench(
    dataset: Annotated[str, typer.Argument(help="Dataset directory (or fsspec URL) holding crossfeed.json.")],
    split: Annotated[str, typer.Option("--split", "-s", help="Split to read.")] = "train",
    batch_size: Annotated[int, typer.Option("--batch-size", "-b", min=1, help="Samples per batch.")] = 256,
    shuffle: Annotated[ShuffleChoice, typer.Option("--shuffle", help="Order: exact global permutation, shard blocks, or file order.")] = ShuffleChoice.GLOBAL,
    threads: Annotated[int, typer.Option("--threads", "-t", min=1, help="Batches built in parallel.")] = 2,
    prefetch: Annotated[int, typer.Option("--prefetch", min=0, help="Batches kept ready beyond the ones being built.")] = 2,
    batches: Annotated[int, typer.Option("--batches", "-n", min=1, help="Batches to read (fewer if the split ends first).")] = 50,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Shuffle seed.")] = 0,
    decode_images: Annotated[bool, typer.Option("--decode-images/--no-decode-images", help="Decode JPEG/PNG features to arrays.")] = True,
) -> None:
    """Read batches like a trainer, then print samples/s, MB/s, time to first batch, peak RSS and
    the time per stage (read incl. CRC checks, decode, transform, batch)."""
    from crossfeed.read.options import LoaderOptions
    from crossfeed.read.profile import bench_loader

    options = LoaderOptions.of(split=split, batch_size=batch_size, shuffle=shuffle.value, seed=seed,
                               num_threads=threads, prefetch=prefetch, decode_images=decode_images)
    report = bench_loader(dataset, options, batches=batches)
    for line in report.lines():
        typer.echo(line)


def _one_line_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (CrossfeedError, KeyError, OSError) as e:
            message = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
            typer.echo(f"error: {message}", err=True)
            raise typer.Exit(2) from None
    return wrapper


def register(app: typer.Typer) -> None:
    app.command("bench")(_one_line_errors(bench))
