"""``crossfeed convert images|csv|parquet|numpy|text INPUT... OUT [-- BEAM OPTIONS]``: a thin shell over
`crossfeed.beam_jobs.job.convert`. Shows progress (on a terminal), ends with a summary, then
verifies what it wrote. Beam is imported only when a command runs, so ``crossfeed --help`` works
without it.

INPUT is a file, a folder or a glob pattern, quoted (``'part-*.parquet'``) or expanded by the
shell; the last positional argument is OUT. Beam pipeline options go only after ``--``, e.g.
``crossfeed convert csv data.csv out -- --runner DaskRunner --dask_client_address tcp://host:8786``.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Annotated

import typer

from crossfeed.cli.options import STORAGE_OPTION, Group, OnceCommand, default_of, storage_options, with_options
from crossfeed.cli.progress import Progress
from crossfeed.errors import ConfigError
from crossfeed.policy import OnError
from crossfeed.write.options import DEFAULT_SHARD_SIZE, WriteOptions
from crossfeed.write.target import filesystem, scheme_of

log = logging.getLogger(__name__)
_BEAM_ARGS = "crossfeed.beam_args"


class _BeamCommand(OnceCommand):
    """A convert command: everything after the first ``--`` is Beam's; before it, typer's rules
    (so a stray argument is an error, not a Beam option)."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        if "--" in args:
            cut = args.index("--")
            ctx.meta[_BEAM_ARGS], args = args[cut + 1 :], args[:cut]
        else:
            ctx.meta[_BEAM_ARGS] = []
        return super().parse_args(ctx, args)


class Compress(str, enum.Enum):
    none = "none"
    gzip = "gzip"


class TokenDtype(str, enum.Enum):
    auto = "auto"
    uint16 = "uint16"
    uint32 = "uint32"


class ConvertTo(str, enum.Enum):
    png = "png"
    jpeg = "jpeg"


Src = Annotated[
    list[str],
    typer.Argument(help="Input files, folders or glob patterns (quoted or not).", metavar="INPUT", show_default=False),
]
Out = Annotated[
    str,
    typer.Argument(
        metavar="OUT",
        help="Output dataset directory or URL (s3://bucket/dir, gs://…, with --storage-option), the last argument "
        "(created; must be new or empty unless --overwrite).",
    ),
]
SplitOpt = Annotated[str, typer.Option("--split", help="The split to write everything to.")]
SplitsOpt = Annotated[str | None, typer.Option("--splits", help="Deterministic ratios, e.g. train=0.9,validation=0.1.")]
ShardsOpt = Annotated[int | None, typer.Option("--shards", min=1, help="Exactly this many shards per split.")]
SizeOpt = Annotated[
    str, typer.Option("--shard-size", help="Target shard size when --shards is not given (256MB, 1G, 1.5GiB).")
]
CompressOpt = Annotated[Compress, typer.Option("--compress", help="GZIP the shards.")]
RunnerOpt = Annotated[str | None, typer.Option("--runner", help="Beam runner (default: in-process, offline).")]
SeedOpt = Annotated[
    int, typer.Option("--seed", help="Seed of the write-time shuffle (split membership does not depend on it).")
]
OnErrorOpt = Annotated[
    OnError, typer.Option("--on-error", help="A bad record stops the job (raise) or is dropped (skip).")
]
MaxSkipsOpt = Annotated[int, typer.Option("--max-skips", min=0, help="Most bad records to skip before failing.")]
LabelOpt = Annotated[str | None, typer.Option("--label", help="Column/array stored as the feature 'label'.")]
TypesOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--types",
        help="Column types, e.g. age:int64,name:string (int64, float = float64, float32 — a narrowing, said in the "
        "summary —, string); repeatable, the types add up. Other columns keep their dtype.",
    ),
]
LabelClassesOpt = Annotated[
    bool,
    typer.Option(
        "--label-classes/--no-label-classes",
        help="Store a string --label column as class indices, names in the manifest (class_names).",
    ),
]
VerifyOpt = Annotated[bool, typer.Option("--verify/--no-verify", help="Check every record of what was written.")]
OverwriteOpt = Annotated[
    bool, typer.Option("--overwrite", help="Replace the dataset OUT holds, all of it (refused otherwise).")
]
AppendOpt = Annotated[
    bool,
    typer.Option(
        "--append",
        help="Add the converted shards to the dataset OUT holds as its next version (the old one stays "
        "readable as OUT@vN); the schema must be the dataset's.",
    ),
]

# what every convert command takes, declared once (the commands get them as one dict, `common`)
COMMON = Group(
    "common",
    {
        "split": (SplitOpt, "train"),
        "splits": (SplitsOpt, None),
        "shards": (ShardsOpt, default_of(WriteOptions, "num_shards")),
        "shard_size": (SizeOpt, f"{DEFAULT_SHARD_SIZE >> 20}MB"),  # WriteOptions' default, as a user writes it
        "compress": (CompressOpt, Compress.gzip if default_of(WriteOptions, "compress") else Compress.none),
        "runner": (RunnerOpt, None),
        "seed": (SeedOpt, 0),
        "verify": (VerifyOpt, True),
        "overwrite": (OverwriteOpt, False),
        "append": (AppendOpt, False),
        "storage_option": (STORAGE_OPTION, None),
    },
    dict,
)
# the bad-record policy of the sources that parse (images, CSV, Parquet)
BAD_RECORDS = Group(
    "bad_records",
    {
        "on_error": (OnErrorOpt, default_of(WriteOptions, "on_error")),
        "max_skips": (MaxSkipsOpt, default_of(WriteOptions, "max_skips")),
    },
    dict,
)


def register(app: typer.Typer) -> None:
    group = typer.Typer(
        help="Convert image folders, CSV, Parquet, numpy files or text into a dataset (Apache Beam).",
        no_args_is_help=True,
    )
    for fn in (images, csv, parquet, numpy, text):
        group.command(fn.__name__, cls=_BeamCommand)(fn)
    app.add_typer(group, name="convert")


@with_options(COMMON, BAD_RECORDS)
def images(
    ctx: typer.Context,
    src: Annotated[Path, typer.Argument(help="Image folder: one subdirectory per class.", metavar="INPUT")],
    out: Out,
    convert: Annotated[
        ConvertTo | None, typer.Option("--convert", help="Re-encode GIF/TIFF/RGBA/… images to this format.")
    ] = None,
    *,
    common: dict,
    bad_records: dict,
) -> None:
    """An image folder: one subdirectory per class (labels in sorted class order)."""
    _run(ctx, "images", [str(src)], out, {**common, **bad_records}, convert=convert.value if convert else None)


@with_options(COMMON, BAD_RECORDS)
def csv(
    ctx: typer.Context,
    src: Src,
    out: Out,
    label: LabelOpt = None,
    types: TypesOpt = None,
    names: Annotated[
        list[str] | None,
        typer.Option("--names", help="Column names, comma-separated (replace the header); repeatable, in order."),
    ] = None,
    header: Annotated[bool, typer.Option("--header/--no-header", help="The first line names the columns.")] = True,
    skip_rows: Annotated[int, typer.Option("--skip-rows", min=0, help="Lines to skip before the header.")] = 0,
    delimiter: Annotated[str, typer.Option("--delimiter", help="Field separator.")] = ",",
    label_classes: LabelClassesOpt = True,
    *,
    common: dict,
    bad_records: dict,
) -> None:
    """CSV files: typed columns (int64, float, string), bad rows reported with file and line."""
    _run(
        ctx,
        "csv",
        src,
        out,
        {**common, **bad_records},
        label=label,
        types=types,
        names=_joined(names),
        header=header,
        skip_rows=skip_rows,
        delimiter=delimiter,
        label_classes=label_classes,
    )


@with_options(COMMON, BAD_RECORDS)
def parquet(
    ctx: typer.Context,
    src: Src,
    out: Out,
    label: LabelOpt = None,
    types: TypesOpt = None,
    columns: Annotated[
        list[str] | None, typer.Option("--columns", help="Columns to keep, comma-separated; repeatable, in order.")
    ] = None,
    label_classes: LabelClassesOpt = True,
    *,
    common: dict,
    bad_records: dict,
) -> None:
    """Parquet files: one work unit per row group."""
    _run(
        ctx,
        "parquet",
        src,
        out,
        {**common, **bad_records},
        label=label,
        types=types,
        columns=_joined(columns),
        label_classes=label_classes,
    )


@with_options(COMMON)
def numpy(
    ctx: typer.Context,
    src: Src,
    out: Out,
    label: LabelOpt = None,
    *,
    common: dict,
) -> None:
    """.npy/.npz arrays whose first axis is the sample axis (memory-mapped)."""
    _run(ctx, "numpy", src, out, common, label=label)


@with_options(COMMON, BAD_RECORDS)
def text(
    ctx: typer.Context,
    src: Src,
    out: Out,
    tokenizer: Annotated[
        Path,
        typer.Option("--tokenizer", help="A Hugging Face tokenizers JSON file (tokenizer.json).", show_default=False),
    ],
    field: Annotated[str, typer.Option("--field", help="The JSONL field that holds each document.")] = "text",
    column: Annotated[str, typer.Option("--column", help="The Parquet/CSV column that holds each document.")] = "text",
    per_line: Annotated[
        bool, typer.Option("--per-line", help="Each line of a .txt file is a document (default: each file).")
    ] = False,
    special_tokens: Annotated[
        bool,
        typer.Option(
            "--special-tokens/--no-special-tokens",
            help="Add the tokenizer's post-processor's special tokens (as tokenizer.encode does).",
        ),
    ] = True,
    eos: Annotated[
        str | None, typer.Option("--eos", help="A token (e.g. '</s>') or id appended to every document.")
    ] = None,
    token_dtype: Annotated[
        TokenDtype,
        typer.Option(
            "--token-dtype",
            help="The tokens' dtype: auto (uint16 when the tokenizer's ids fit 16 bits, else uint32) or forced.",
        ),
    ] = TokenDtype.auto,
    max_document_bytes: Annotated[
        str,
        typer.Option(
            "--max-document-bytes",
            help="The most bytes one document (line, row, file) may hold (16MiB, 1G); a longer one is a bad record.",
        ),
    ] = "16MiB",
    *,
    common: dict,
    bad_records: dict,
) -> None:
    """Text tokenized for language models: JSONL, .txt (a document per file, or per line with
    --per-line), Parquet or CSV text columns; one record per document (tokens, id) and a lengths
    file beside each shard."""
    _run(
        ctx,
        "text",
        src,
        out,
        {**common, **bad_records},
        tokenizer=str(tokenizer),
        field=field,
        column=column,
        per_line=per_line,
        add_special_tokens=special_tokens,
        eos=eos,
        token_dtype=None if token_dtype is TokenDtype.auto else token_dtype.value,
        max_document_bytes=max_document_bytes,
    )


def _joined(values: list[str] | None) -> list[str] | None:
    """A repeatable comma-separated list option's values, in order (None when not given)."""
    if not values:
        return None
    return [n.strip() for v in values for n in v.split(",") if n.strip()]


def _check_paths(inputs: list[str], out: str) -> None:
    """Catch the shell-glob and stray-argument mistakes before any work starts."""
    hint = "usage: INPUT... OUT (OUT is the last argument; Beam options go after --)"
    if scheme_of(out) is not None:  # a URL: checked (and refused if unknown) where it is written
        return
    if os.path.isfile(out):
        raise typer.BadParameter(f"{out} is a file, not an output folder; {hint}", param_hint="OUT")
    for item in inputs:
        if os.path.isdir(item) and os.path.exists(os.path.join(item, "crossfeed.json")):
            raise typer.BadParameter(f"{item} is a crossfeed dataset, not an input; {hint}", param_hint="INPUT")
        if os.path.abspath(item) == os.path.abspath(out):
            raise typer.BadParameter(f"{item} is both an input and OUT; {hint}", param_hint="INPUT")


def _quiet_import_of_beam(verbose: bool):
    """Import the conversion job; Beam's import-time warnings on the root logger ("apitools not
    found …") are hidden unless --verbose."""
    root = logging.getLogger()
    level = root.level
    if not verbose:
        root.setLevel(logging.ERROR)
    try:
        from crossfeed.beam_jobs import job
    finally:
        root.setLevel(level)
    return job


def _run(ctx: typer.Context, kind: str, src: list[str], out: str, common: dict, **source_options) -> None:
    verbose = bool(ctx.find_root().params.get("verbose"))
    job = _quiet_import_of_beam(verbose)
    from crossfeed.beam_jobs.policy import ErrorPolicy

    logging.getLogger("apache_beam.runners.common").setLevel(logging.CRITICAL)  # our error line says it
    shard_size_from = ctx.get_parameter_source("shard_size")
    if common.get("shards") is not None and shard_size_from is not None and shard_size_from.name == "COMMANDLINE":
        raise typer.BadParameter("give --shards or --shard-size, not both", param_hint="--shard-size")
    if kind == "images" and len(src) != 1:
        raise typer.BadParameter("convert images takes one image folder", param_hint="INPUT")
    _check_paths(src, out)
    fs_options = storage_options(common["storage_option"])
    if scheme_of(out) is not None:
        try:
            filesystem(out, fs_options)  # an unknown scheme or a missing backend: before any work
        except ConfigError as e:
            raise typer.BadParameter(str(e), param_hint="OUT") from e
    write_options = WriteOptions(
        num_shards=common["shards"],
        shard_size=common["shard_size"],
        compress=common["compress"] is Compress.gzip,
        **{k: common[k] for k in ("on_error", "max_skips") if k in common},
    )
    if "on_error" in common:
        source_options["on_error"] = ErrorPolicy.of(write_options)
    options = {k: v for k, v in source_options.items() if v is not None}
    try:
        source = job.make_source(kind, src[0] if kind == "images" else src, **options)
    except ConfigError as e:
        raise typer.BadParameter(f"{e} (usage: INPUT... OUT; Beam options go after --)", param_hint="INPUT") from e
    typer.echo(f"converting {source.describe()} -> {out}", err=True)
    for line in getattr(source, "report", list)():  # what type inference decided, and why
        typer.echo(f"  {line}", err=True)

    with _interrupts_end_the_job(), Progress() as progress:
        bar = progress.phase("encoding", total=_expected_samples(source), unit="samples")  # read+encode+write shards
        result = job.convert(
            source,
            out,
            split=common["split"],
            splits=common["splits"],
            seed=common["seed"],
            runner=common["runner"],
            beam_args=list(ctx.meta.get(_BEAM_ARGS, [])),
            on_progress=lambda samples, nbytes, seconds: bar.update(samples),
            overwrite=common["overwrite"],
            options=write_options,
            storage_options=fs_options,
            append=common["append"],
        )
        bar.update(result.total_samples, result.total_samples)
        per_split = ", ".join(f"{k}: {v:,} in {result.shards[k]} shards" for k, v in result.samples.items())
        typer.echo(
            f"wrote {result.total_samples:,} samples ({per_split}), {result.num_bytes:,} bytes "
            f"in {result.seconds:.2f} s: {result.samples_per_second:,.0f} samples/s"
            + (f"; skipped {result.skipped} bad records" if result.skipped else "")
            + "".join(f"; left out {n:,} {why.replace('_', ' ')}" for why, n in sorted(result.dropped.items()))
            + (f"; narrowed {'; '.join(result.narrowed.values())}" if result.narrowed else "")
        )
        where = result.path if scheme_of(out) is not None else out  # a local OUT as the user wrote it
        _warn_empty_shards(where, list(result.samples), fs_options)
        if common["verify"]:
            _verify(where, list(result.samples), progress, fs_options)


@contextlib.contextmanager
def _interrupts_end_the_job():
    """A Ctrl-C (SIGINT) during the job ends it as the CLI documents ('interrupted', exit 130),
    however Beam reports it: its runner re-raises a KeyboardInterrupt caught in a bundle as
    ``RuntimeError: KeyboardInterrupt``, or fails later on what the interrupt left half done."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread
        return
    got = threading.Event()
    previous = signal.getsignal(signal.SIGINT)

    def interrupted(signum, frame):
        got.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupted)
    try:
        yield
    except Exception as e:
        if got.is_set():
            raise KeyboardInterrupt from e
        raise
    finally:
        signal.signal(signal.SIGINT, previous)


def _expected_samples(source) -> int | None:
    """How many samples the source holds, where it knows before reading (for the bar's ETA)."""
    if getattr(source, "num_samples", None) is not None:  # Parquet: from the file metadata
        return int(source.num_samples)
    if isinstance(getattr(source, "lengths", None), tuple):  # numpy arrays
        return int(sum(source.lengths))
    if hasattr(source, "class_names") and isinstance(getattr(source, "files", None), tuple):  # image folder
        return len(source.files)
    return None  # CSV: unknown until read


def _warn_empty_shards(path: str, splits: list[str], fs_options: dict) -> None:
    from crossfeed.read.sources.dataset import open_dataset

    with open_dataset(path, storage_options=fs_options) as ds:
        for name in splits:
            info = ds.splits[name]
            empty = sum(1 for sh in info.shards if sh.num_records == 0)
            if empty:
                typer.echo(
                    f"warning: {empty} of {len(info.shards)} shards of split {name!r} are empty (it has "
                    f"{info.num_records} records); pass fewer --shards",
                    err=True,
                )


def _verify(path: str, splits: list[str], progress: Progress, fs_options: dict) -> None:
    from crossfeed.read.sources.dataset import open_dataset
    from crossfeed.read.tools.verify import verify_dataset

    with open_dataset(path, storage_options=fs_options) as ds:
        total = sum(ds.splits[s].num_bytes for s in splits)
    bar = progress.phase("verifying", total=total, unit="bytes")
    problems: list = []
    for s in splits:
        problems += verify_dataset(path, split=s, progress=bar.callback, storage_options=fs_options)
    if problems:
        for p in problems:
            typer.echo(f"problem: {p}", err=True)
        raise typer.Exit(code=1)
    typer.echo(f"verified {path}: OK")
