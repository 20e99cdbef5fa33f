"""``crossfeed convert images|csv|parquet|numpy SRC OUT``: a thin shell over
`crossfeed.beam_jobs.job.convert`. Shows live progress, ends with a summary, then verifies what it
wrote. Beam is imported only when a command runs, so ``crossfeed --help`` works without it.

Beam pipeline options go after ``--``, e.g.
``crossfeed convert csv data.csv out -- --runner DaskRunner --dask_client_address tcp://host:8786``.
"""

from __future__ import annotations

import enum
import logging
from pathlib import Path
from typing import Annotated, Optional

import typer

from crossfeed.errors import ConfigError

_CTX = {"allow_extra_args": True, "ignore_unknown_options": True}


class Compress(str, enum.Enum):
    none = "none"
    gzip = "gzip"


class OnError(str, enum.Enum):
    raise_ = "raise"
    skip = "skip"


class ConvertTo(str, enum.Enum):
    png = "png"
    jpeg = "jpeg"


Src = Annotated[Path, typer.Argument(exists=True, help="Input file or directory.")]
Out = Annotated[Path, typer.Argument(help="Output dataset directory (created; must be new or empty unless --overwrite).")]
SplitOpt = Annotated[str, typer.Option("--split", help="The split to write everything to.")]
SplitsOpt = Annotated[Optional[str], typer.Option("--splits", help="Deterministic ratios, e.g. train=0.9,validation=0.1.")]
ShardsOpt = Annotated[Optional[int], typer.Option("--shards", min=1, help="Exactly this many shards per split.")]
SizeOpt = Annotated[str, typer.Option("--shard-size", help="Target shard size when --shards is not given (256MB, 1G).")]
CompressOpt = Annotated[Compress, typer.Option("--compress", help="GZIP the shards.")]
RunnerOpt = Annotated[Optional[str], typer.Option("--runner", help="Beam runner (default: in-process, offline).")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed of the write-time shuffle (split membership does not depend on it).")]
OnErrorOpt = Annotated[OnError, typer.Option("--on-error", help="A bad record stops the job (raise) or is dropped (skip).")]
MaxSkipsOpt = Annotated[Optional[int], typer.Option("--max-skips", min=0, help="Most bad records to skip before failing.")]
LabelOpt = Annotated[Optional[str], typer.Option("--label", help="Column/array stored as the feature 'label'.")]
VerifyOpt = Annotated[bool, typer.Option("--verify/--no-verify", help="Check every record of what was written.")]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace the dataset OUT holds, all of it (refused otherwise).")]


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="Convert image folders, CSV, Parquet or numpy files into a dataset (Apache Beam).",
                        no_args_is_help=True)
    group.command("images", context_settings=_CTX)(images)
    group.command("csv", context_settings=_CTX)(csv)
    group.command("parquet", context_settings=_CTX)(parquet)
    group.command("numpy", context_settings=_CTX)(numpy)
    app.add_typer(group, name="convert")


def images(ctx: typer.Context, src: Src, out: Out, split: SplitOpt = "train", splits: SplitsOpt = None,
           shards: ShardsOpt = None, shard_size: SizeOpt = "256MB", compress: CompressOpt = Compress.none,
           runner: RunnerOpt = None, seed: SeedOpt = 0, on_error: OnErrorOpt = OnError.raise_,
           max_skips: MaxSkipsOpt = None, verify: VerifyOpt = True, overwrite: OverwriteOpt = False,
           convert: Annotated[Optional[ConvertTo], typer.Option("--convert", help="Re-encode GIF/TIFF/RGBA/… images to this format.")] = None,
           ) -> None:
    """An image folder: one subdirectory per class (labels in sorted class order)."""
    _run(ctx, "images", src, out, locals(), convert=convert.value if convert else None)


def csv(ctx: typer.Context, src: Src, out: Out, split: SplitOpt = "train", splits: SplitsOpt = None,
        shards: ShardsOpt = None, shard_size: SizeOpt = "256MB", compress: CompressOpt = Compress.none,
        runner: RunnerOpt = None, seed: SeedOpt = 0, on_error: OnErrorOpt = OnError.raise_,
        max_skips: MaxSkipsOpt = None, verify: VerifyOpt = True, overwrite: OverwriteOpt = False, label: LabelOpt = None,
        types: Annotated[Optional[str], typer.Option("--types", help="Column types, e.g. age:int64,name:string.")] = None,
        names: Annotated[Optional[str], typer.Option("--names", help="Column names, comma-separated (replace the header).")] = None,
        header: Annotated[bool, typer.Option("--header/--no-header", help="The first line names the columns.")] = True,
        skip_rows: Annotated[int, typer.Option("--skip-rows", min=0, help="Lines to skip before the header.")] = 0,
        delimiter: Annotated[str, typer.Option("--delimiter", help="Field separator.")] = ",",
        ) -> None:
    """CSV files: typed columns (int64, float, string), bad rows reported with file and line."""
    _run(ctx, "csv", src, out, locals(), label=label, types=types, names=names, header=header,
         skip_rows=skip_rows, delimiter=delimiter)


def parquet(ctx: typer.Context, src: Src, out: Out, split: SplitOpt = "train", splits: SplitsOpt = None,
            shards: ShardsOpt = None, shard_size: SizeOpt = "256MB", compress: CompressOpt = Compress.none,
            runner: RunnerOpt = None, seed: SeedOpt = 0, on_error: OnErrorOpt = OnError.raise_,
            max_skips: MaxSkipsOpt = None, verify: VerifyOpt = True, overwrite: OverwriteOpt = False, label: LabelOpt = None,
            types: Annotated[Optional[str], typer.Option("--types", help="Column types, e.g. age:int64,name:string.")] = None,
            columns: Annotated[Optional[str], typer.Option("--columns", help="Columns to keep, comma-separated.")] = None,
            ) -> None:
    """Parquet files: one work unit per row group."""
    _run(ctx, "parquet", src, out, locals(), label=label, types=types, columns=columns)


def numpy(ctx: typer.Context, src: Src, out: Out, split: SplitOpt = "train", splits: SplitsOpt = None,
          shards: ShardsOpt = None, shard_size: SizeOpt = "256MB", compress: CompressOpt = Compress.none,
          runner: RunnerOpt = None, seed: SeedOpt = 0, verify: VerifyOpt = True, overwrite: OverwriteOpt = False, label: LabelOpt = None,
          ) -> None:
    """.npy/.npz arrays whose first axis is the sample axis (memory-mapped)."""
    _run(ctx, "numpy", src, out, locals(), label=label)


def _run(ctx: typer.Context, kind: str, src: Path, out: Path, common: dict, **source_options) -> None:
    from crossfeed.beam_jobs.job import convert, make_source  # lazy: needs apache_beam
    from crossfeed.beam_jobs.policy import ErrorPolicy

    logging.getLogger("apache_beam.runners.common").setLevel(logging.CRITICAL)  # our error line says it
    if common.get("shards") is not None and ctx.get_parameter_source("shard_size").name == "COMMANDLINE":
        raise typer.BadParameter("give --shards or --shard-size, not both", param_hint="--shard-size")
    if "on_error" in common:
        source_options["on_error"] = ErrorPolicy(common["on_error"].value, common["max_skips"])
    try:
        source = make_source(kind, str(src), **{k: v for k, v in source_options.items() if v is not None})
    except ConfigError as e:
        raise typer.BadParameter(str(e), param_hint="SRC") from e
    typer.echo(f"converting {source.describe()} -> {out}", err=True)

    def progress(samples: int, nbytes: int, seconds: float) -> None:
        rate = samples / seconds if seconds > 0 else 0.0
        typer.echo(f"\r  {samples:,} samples, {nbytes / 1e6:,.1f} MB, {rate:,.0f} samples/s", err=True, nl=False)

    result = convert(source, out, split=common["split"], splits=common["splits"], num_shards=common["shards"],
                     shard_size=common["shard_size"], compress=common["compress"] is Compress.gzip, seed=common["seed"],
                     max_skips=common.get("max_skips"), runner=common["runner"], beam_args=list(ctx.args),
                     on_progress=progress, overwrite=common["overwrite"])
    typer.echo("", err=True)
    per_split = ", ".join(f"{k}: {v:,} in {result.shards[k]} shards" for k, v in result.samples.items())
    typer.echo(f"wrote {result.total_samples:,} samples ({per_split}), {result.num_bytes:,} bytes "
               f"in {result.seconds:.2f} s: {result.samples_per_second:,.0f} samples/s"
               + (f"; skipped {result.skipped} bad records" if result.skipped else ""))
    if common["verify"]:
        _verify(str(out), list(result.samples))


def _verify(path: str, splits: list[str]) -> None:
    try:
        from crossfeed.read.verify import verify_dataset
    except ImportError:
        verify_dataset = None
    problems: list = []
    if verify_dataset is not None:
        for s in splits:
            problems += verify_dataset(path, split=s)
    else:  # read back every record of what was written, checking its CRCs
        from crossfeed import open_dataset

        with open_dataset(path) as ds:
            for s in splits:
                sp = ds[s]
                for shard, n in enumerate(sp.counts.tolist()):
                    for k in range(n):
                        sp.payload(shard, k)
    if problems:
        for p in problems:
            typer.echo(f"problem: {p}", err=True)
        raise typer.Exit(code=1)
    typer.echo(f"verified {path}: OK")
