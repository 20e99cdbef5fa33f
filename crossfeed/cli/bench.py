"""``crossfeed bench``: read a dataset like a trainer would and say where the time goes.

A thin shell over `crossfeed.read.tools.profile.bench_loader`; the report goes to stdout, errors to stderr
as one line with exit status 2 (the CLI's one boundary, `crossfeed.cli.main`).
"""

from __future__ import annotations

from typing import Annotated

import typer

from crossfeed.cli.options import LOADER, with_options
from crossfeed.cli.progress import Progress
from crossfeed.read.options import LoaderOptions

# Report lines the CLI leaves out: a thread "speed-up" computed against the one-thread stage
# timings is not a like-for-like measurement (the stage run re-reads warm pages), so it misleads.


@with_options(LOADER)
def bench(
    dataset: Annotated[str, typer.Argument(help="Dataset directory (or fsspec URL) holding crossfeed.json.")],
    batches: Annotated[
        int, typer.Option("--batches", "-n", min=1, help="Batches to read (fewer if the split ends first).")
    ] = 50,
    *,
    options: LoaderOptions,
) -> None:
    """Read batches like a trainer, then print samples/s, MB/s, time to first batch, peak RSS and
    the time per stage (read incl. CRC checks, decode, transform, batch)."""
    from crossfeed.read.tools.profile import bench_loader

    with Progress() as progress:
        bar = progress.phase("reading batches", total=batches, unit="batches")
        report = bench_loader(dataset, options, batches=batches, progress=bar.callback)
    for line in report.lines():
        typer.echo(line)


def register(app: typer.Typer) -> None:
    app.command("bench")(bench)
