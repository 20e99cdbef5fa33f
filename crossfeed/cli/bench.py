"""``crossfeed bench``: read a dataset like a trainer would and say where the time goes.

A thin shell over `crossfeed.read.profile.bench_loader`; the report goes to stdout, errors to stderr
as one line with exit status 2 (the CLI's one boundary, `crossfeed.cli.main`).
"""

from __future__ import annotations

from typing import Annotated

import typer

from crossfeed.cli.common import CacheDirOpt, CacheLimitOpt
from crossfeed.cli.progress import Progress
from crossfeed.read.plan import Shuffle

# Report lines the CLI leaves out: a thread "speed-up" computed against the one-thread stage
# timings is not a like-for-like measurement (the stage run re-reads warm pages), so it misleads.


def bench(
    dataset: Annotated[str, typer.Argument(help="Dataset directory (or fsspec URL) holding crossfeed.json.")],
    split: Annotated[str, typer.Option("--split", "-s", help="Split to read.")] = "train",
    batch_size: Annotated[int, typer.Option("--batch-size", "-b", min=1, help="Samples per batch.")] = 256,
    shuffle: Annotated[
        Shuffle, typer.Option("--shuffle", help="Order: exact global permutation, shard blocks, or file order.")
    ] = Shuffle.GLOBAL,
    threads: Annotated[int, typer.Option("--threads", "-t", min=1, help="Batches built in parallel.")] = 2,
    prefetch: Annotated[
        int, typer.Option("--prefetch", min=0, help="Batches kept ready beyond the ones being built.")
    ] = 2,
    batches: Annotated[
        int, typer.Option("--batches", "-n", min=1, help="Batches to read (fewer if the split ends first).")
    ] = 50,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Shuffle seed.")] = 0,
    decode_images: Annotated[
        bool, typer.Option("--decode-images/--no-decode-images", help="Decode JPEG/PNG features to arrays.")
    ] = True,
    cache_dir: CacheDirOpt = None,
    cache_limit: CacheLimitOpt = None,
) -> None:
    """Read batches like a trainer, then print samples/s, MB/s, time to first batch, peak RSS and
    the time per stage (read incl. CRC checks, decode, transform, batch)."""
    from crossfeed.read.options import LoaderOptions
    from crossfeed.read.profile import bench_loader

    options = LoaderOptions.of(
        split=split,
        batch_size=batch_size,
        shuffle=shuffle.value,
        seed=seed,
        num_threads=threads,
        prefetch=prefetch,
        decode_images=decode_images,
        cache_dir=cache_dir,
        cache_limit=cache_limit,
    )
    with Progress() as progress:
        bar = progress.phase("reading batches", total=batches, unit="batches")
        report = bench_loader(dataset, options, batches=batches, progress=bar.callback)
    for line in report.lines():
        typer.echo(line)


def register(app: typer.Typer) -> None:
    app.command("bench")(bench)
