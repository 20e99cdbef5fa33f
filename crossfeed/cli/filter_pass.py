"""``crossfeed filter DATASET_OR_MIX --filter module:fn --out FILE [--refill]``: a filter pass.

A thin shell over `crossfeed.filter_pass` (`crossfeed.read.tools.filter_pass`): every sample is
read once, decoded as the Loader decodes it (the same --split, --decode-images, --on-error …), the
predicate runs on it, and the ids it drops are written as a skip file the Loader reads with
``skip=FILE`` (``--skip FILE`` on the other commands). Errors are raised and turned into one line
on stderr by the CLI's one boundary (`crossfeed.cli.main`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from crossfeed.cli.options import LOADER, OnceCommand, with_options
from crossfeed.config import resolve_callable
from crossfeed.read.options import LoaderOptions


@with_options(LOADER)
def filter_command(
    dataset: Annotated[str, typer.Argument(help="Dataset path or remote URL, or a mixture spec .json file.")],
    filter: Annotated[
        str,
        typer.Option(
            "--filter",
            help="module:function, a predicate on each decoded sample: False drops it (its id goes to --out). "
            "Modules in the current folder or on PYTHONPATH are found.",
        ),
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="The skip file to write (replaced whole, atomically).")],
    refill: Annotated[
        bool,
        typer.Option(
            "--refill/--shorter",
            help="Write a refill line: the Loader closes each epoch's order up around the dropped samples, so every "
            "step is full (unpacked, unweighted plans). --shorter (the default): their steps come out shorter, and token "
            "pipelines (--pack-length, --batch-by-tokens) take the file.",
        ),
    ] = False,
    max_filtered: Annotated[
        float | None,
        typer.Option(
            "--max-filtered",
            min=0,
            max=1,
            help="Refuse (write nothing) when the filter drops more than this share of the samples.",
        ),
    ] = None,
    *,
    options: LoaderOptions,
) -> None:
    """Run a filter over every sample once and write the ids it drops as a skip file: train with
    --skip FILE (Loader(skip=FILE)) for shorter steps, or with --refill for full ones; exact on resume."""
    from crossfeed.read.sources.mixture_file import source_of
    from crossfeed.read.tools.filter_pass import filter_pass

    for name, flag in (
        ("pack", "--pack-length"),
        ("batch_by_tokens", "--batch-by-tokens"),
        ("weights", "--weights"),
        ("skip", "--skip"),
    ):
        if getattr(options.plan, name) is not None:
            raise typer.BadParameter(
                "the pass reads every stored sample once, in stored order; give it to the run that reads --out",
                param_hint=flag,
            )
    pred = resolve_callable(filter, option="--filter", search_cwd=True)
    if max_filtered is not None:
        options = options.replace(max_filtered=max_filtered)
    source, more = source_of(dataset)
    options = options.replace(**more)
    done = filter_pass(source, pred, out, refill=refill, options=options)
    how = "refilled: every step full" if refill else "shorter steps"
    typer.echo(
        f"kept {done.kept:,}, dropped {done.dropped:,} of {done.seen:,} samples; wrote {out} ({how}): "
        f"train with --skip {out}",
        err=True,
    )


def register(app: typer.Typer) -> None:
    app.command("filter", cls=OnceCommand)(filter_command)
