"""``crossfeed index | info | verify | head``: look after datasets on disk.

Thin shells over `crossfeed.write.adopt.index`, `crossfeed.read.tools.verify` and `crossfeed.read.sources.dataset`. Errors
are raised and turned into one line on stderr by the CLI's one boundary (`crossfeed.cli.main`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import numpy as np
import typer

from crossfeed.cli.options import ALLOW_ROOT, STORAGE_OPTION, OnceCommand, storage_options
from crossfeed.cli.progress import Progress
from crossfeed.errors import redact

DatasetArg = Annotated[str, typer.Argument(help="Dataset directory (or fsspec URL) holding crossfeed.json.")]
SplitOpt = Annotated[str | None, typer.Option("--split", "-s", help="Only this split (default: all).")]


def index(
    path: Annotated[
        str,
        typer.Argument(
            help="Directory of TFRecord shards (plain or GZIP), a TFDS data directory, WebDataset .tar shards or "
            "Parquet files, written by any tool."
        ),
    ],
    split: Annotated[
        str,
        typer.Option(
            "--split", "-s", help="Split of shards whose names carry none (all shards with --no-split-from-name)."
        ),
    ] = "train",
    split_from_name: Annotated[
        bool,
        typer.Option(
            "--split-from-name/--no-split-from-name", help="Take the split from '<split>-SSSSS-of-NNNNN' file names."
        ),
    ] = True,
    force: Annotated[
        bool, typer.Option("--force", "-f", help="Rebuild the index files and manifest of an indexed dataset.")
    ] = False,
    feature: Annotated[
        list[str] | None,
        typer.Option(
            "--feature",
            help="Declare what a feature's bytes are: NAME=ENCODING[:DTYPE[:SHAPE]], e.g. image=tensor:uint8:224,224,3 "
            "or jpeg=image (repeatable); checked against every record. Parquet: picks the columns to index "
            "(a bare NAME: its type inferred).",
        ),
    ] = None,
    index_dir: Annotated[
        str | None,
        typer.Option(
            "--index-dir",
            help="Write crossfeed.json and the .idx files here and leave the data directory untouched "
            "(read-only or remote data, e.g. a bucket URL); open this directory as the dataset.",
        ),
    ] = None,
    storage_option: STORAGE_OPTION = None,
    lengths: Annotated[
        list[str] | None,
        typer.Option(
            "--lengths",
            help="Write the per-record lengths of this integer array feature (token ids) beside each shard "
            "(NAME.len), for sequence packing; TFRecord and Parquet (repeatable).",
        ),
    ] = None,
) -> None:
    """Adopt data in place: TFRecord shards or a TFDS prepared dataset (check every record, write .idx files),
    WebDataset tars (index the samples) or Parquet files (row groups from the footers), then write the manifest
    (crossfeed.json)."""
    import os

    from crossfeed.format.parquet import is_parquet_name
    from crossfeed.write.adopt.index import index_dataset, is_shard_name

    total = (
        sum(
            os.path.getsize(os.path.join(path, n))
            for n in os.listdir(path)
            if is_shard_name(n) or n.endswith(".tar") or is_parquet_name(n)
        )
        if os.path.isdir(path)
        else 0
    )
    with Progress() as progress:
        bar = progress.phase("indexing", total=total, unit="bytes")
        manifest = index_dataset(
            path,
            split=split,
            split_from_name=split_from_name,
            force=force,
            progress=bar.callback,
            features=feature,
            index_dir=index_dir,
            storage_options=storage_options(storage_option),
            lengths=lengths,
        )
    if any(s.format == "parquet" for s in manifest.splits.values()):  # what each column became, and why
        for line in (manifest.metadata.get("inferred_types") or {}).values():
            typer.echo(f"column {line}", err=True)
    counts = ", ".join(f"{k}: {v.num_records} records in {len(v.shards)} shards" for k, v in manifest.splits.items())
    where = f" (manifest and indexes in {index_dir})" if index_dir else ""
    typer.echo(
        f"indexed {path}{where}: {counts}; features {', '.join(manifest.schema.names)}"
        + (f"; lengths of {', '.join(manifest.lengths)} beside each shard (.len)" if manifest.lengths else "")
    )
    if index_dir is not None and manifest.data_root is not None:
        from crossfeed.io import roots

        data = roots.resolve(manifest.data_root)
        if not roots.within(data, os.path.abspath(index_dir)):
            typer.echo(
                f"to read it, allow its data directory (it lies outside {index_dir}): {roots.how_to_allow(data)}"
            )
    if index_dir is None and any(
        s.format == "parquet" and not sh.file.endswith(".arrow") for s in manifest.splits.values() for sh in s.shards
    ):
        typer.echo(
            f"note: crossfeed.json now sits beside the Parquet files, and pyarrow.dataset({path!r}) fails on it (it "
            f"opens every file of a directory): give pyarrow the *.parquet files, or index with --index-dir DIR to "
            f"leave {path} Parquet-only",
            err=True,
        )


def info(
    dataset: DatasetArg,
    as_json: Annotated[bool, typer.Option("--json", help="Print the manifest as JSON.")] = False,
    allow_root: ALLOW_ROOT = None,
    storage_option: STORAGE_OPTION = None,
) -> None:
    """Show a dataset's splits, record counts, sizes, schema and metadata."""
    from crossfeed.read.sources.dataset import open_dataset

    with open_dataset(dataset, allowed_roots=allow_root or (), storage_options=storage_options(storage_option)) as ds:
        if as_json:
            typer.echo(ds.manifest.dumps().rstrip())
            return
        typer.echo(f"dataset {redact(ds.path)}")
        if ds.manifest.versions:  # a growing dataset: its earlier versions stay readable as PATH@vN
            kept = ", ".join(f"v{v}" for v, _ in ds.manifest.versions)
            typer.echo(f"version {ds.version} (earlier versions kept: {kept})")
        if ds.manifest.data_root is not None:
            typer.echo(f"data    {redact(ds.manifest.data_root)} (shards read in place)")
        typer.echo("splits:")
        for name, s in sorted(ds.splits.items()):
            typer.echo(f"  {name:<12} {s.num_records:>12,} records {len(s.shards):>5} shards {_size(s.num_bytes):>10}")
        typer.echo("features:")
        for f in ds.schema:
            shape = (
                "("
                + ", ".join("?" if d is None else str(d) for d in f.shape)
                + ("," if len(f.shape) == 1 else "")
                + ")"
            )
            typer.echo(f"  {f.name:<20} {f.dtype:<8} {shape:<16} {f.encoding.value}")
        from crossfeed.read.tools.lengths import length_percentiles, percentiles_line

        for name, s in sorted(ds.splits.items()):
            counted = list(ds.manifest.lengths or ())  # features with lengths files: percentiles from them
            if s.statistics or counted:
                typer.echo(f"statistics ({name}):")
                for feature, st in (s.statistics or {}).items():
                    typer.echo(f"  {feature:<20} {_stats_line(st)}")
                    if isinstance(st.get("lengths"), dict) and feature not in counted:
                        counted.append(feature)
                    if isinstance(st.get("lengths"), dict):
                        typer.echo(f"  {'':<20} {_lengths_line(st['lengths'])}")
                for feature in counted:
                    p = length_percentiles(ds[name], feature)
                    if p is not None:
                        typer.echo(f"  {feature:<20} {percentiles_line(p)}")
        if ds.metadata:
            typer.echo("metadata:")
            for k, v in sorted(ds.metadata.items()):
                typer.echo(f"  {k}: {json.dumps(v)}")


def verify(
    dataset: DatasetArg, split: SplitOpt = None, allow_root: ALLOW_ROOT = None, storage_option: STORAGE_OPTION = None
) -> None:
    """Check every record's CRC, every index entry, counts and sha256 against the manifest.
    Lists every problem found; exits 1 if there is any. A remote dataset's shards are downloaded
    once each, one at a time, into $TMPDIR and checked there."""
    from crossfeed.read.sources.dataset import open_dataset
    from crossfeed.read.tools.verify import verify_dataset

    allowed, fs_options = tuple(allow_root or ()), storage_options(storage_option)
    with open_dataset(dataset, allowed_roots=allowed, storage_options=fs_options) as ds:
        names = [ds[split].name] if split is not None else list(ds.splits)  # an unknown split raises here
        total = sum(ds.splits[n].num_bytes for n in names)
        records = sum(ds.splits[n].num_records for n in names)
        shards = sum(len(ds.splits[n].shards) for n in names)
        tar_splits = [n for n in names if ds.splits[n].format == "tar"]
        parquet = any(ds.splits[n].format == "parquet" for n in names)
    with Progress() as progress:
        bar = progress.phase("verifying", total=total, unit="bytes")
        problems = verify_dataset(
            dataset,
            split=split,
            progress=bar.callback,
            allowed_roots=allowed,
            storage_options=storage_options(storage_option),
        )
    if problems:
        for p in problems:
            typer.echo(f"BAD {p}", err=True)
        bad = len({p.file.removesuffix(".idx").removesuffix(".len") for p in problems})
        typer.echo(f"{len(problems)} problems in {bad} of {shards} shards", err=True)
        raise typer.Exit(1)
    typer.echo(f"ok: {records:,} records in {shards} shards ({_size(total)}) verified")
    if tar_splits:
        from crossfeed.read.tools.verify_tar import CANNOT

        typer.echo(f"note: {CANNOT} (tar headers checked)", err=True)
    if parquet:
        from crossfeed.read.sources.parquet import VERIFY_NOTE

        typer.echo(f"note: {VERIFY_NOTE}")


def head(
    dataset: DatasetArg,
    n: Annotated[int, typer.Option("-n", "--num", min=0, help="How many samples.")] = 5,
    split: Annotated[
        str | None,
        typer.Option(
            "--split", "-s", help="Split to show (default: train, or the first split by name when there is no train)."
        ),
    ] = None,
    allow_root: ALLOW_ROOT = None,
    storage_option: STORAGE_OPTION = None,
    tokenizer: Annotated[
        Path | None,
        typer.Option(
            "--tokenizer",
            help="The tokenizer.json the tokens were made with, to show them as text (default: the file the "
            "manifest records, when it lies beside the dataset or here).",
        ),
    ] = None,
) -> None:
    """Show the first samples of a split: shape, dtype and small values; bytes truncated; token ids
    as text too when the dataset records its tokenizer (`crossfeed convert text`) and it is found."""
    from crossfeed.read.sources.dataset import open_dataset

    with open_dataset(dataset, allowed_roots=allow_root or (), storage_options=storage_options(storage_option)) as ds:
        name = split or ("train" if "train" in ds.splits else sorted(ds.splits)[0])
        s = ds[name]
        decode, note = _token_decoder(ds, tokenizer)
        if note:
            typer.echo(note, err=True)
        for i in range(min(n, len(s))):
            typer.echo(f"[{name} {i}]")
            for key, value in s[i].items():
                typer.echo(f"  {key}: {_show(value)}")
                if decode is not None and key == "tokens":
                    typer.echo(f"  {'':<{len(key)}}  text: {_text(decode(np.asarray(value).tolist()))}")


def _token_decoder(ds, given: Path | None):
    """``(decode, note)``: the tokenizer's ``decode`` for the ``tokens`` feature when the manifest
    records a tokenizer and its file is found (``given``, else the recorded name beside the dataset
    or in the current directory) with the recorded sha256; else None and, where a tokenizer is
    recorded, one line saying why the tokens are not shown as text."""
    import hashlib

    from crossfeed.errors import ConfigError, require

    meta = ds.metadata.get("tokenizer") if isinstance(ds.metadata, dict) else None
    if not isinstance(meta, dict) or "tokens" not in ds.schema.names:
        if given is not None:
            raise ConfigError(
                f"--tokenizer {given}: the dataset has no tokens feature made by `crossfeed convert text`"
            )
        return None, None
    recorded, sha = str(meta.get("file") or ""), meta.get("sha256")
    if given is not None:
        candidates = [given]
    elif recorded and os.path.basename(recorded) == recorded and not ds.storage.remote:
        candidates = [Path(ds.path) / recorded, Path(recorded)]
    else:
        candidates = []
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        if given is not None:
            raise ConfigError(f"--tokenizer {given}: no such file")
        return None, f"note: tokens shown as ids: pass --tokenizer {recorded or 'tokenizer.json'} to see them as text"
    data = path.read_bytes()
    if sha and hashlib.sha256(data).hexdigest() != sha:
        msg = f"{path} is not the tokenizer the tokens were made with (its sha256 differs from the manifest's {sha[:12]}…)"
        if given is not None:
            raise ConfigError(f"--tokenizer {msg}")
        return None, f"note: tokens shown as ids: {msg}"
    tokenizers = require("tokenizers", "decoding tokens (crossfeed head)")
    tok = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
    return (lambda ids: tok.decode(ids, skip_special_tokens=False)), None


def _text(text: str, limit: int = 120) -> str:
    return repr(text[:limit]) + ("…" if len(text) > limit else "")


def _stats_line(st: dict) -> str:
    """``count 1,797  min 0  max 16  mean 4.88  shapes 8x8x1 ×1,797`` from a manifest statistics entry."""
    parts = [f"count {st.get('count', 0):,}"]
    if "min" in st:
        parts.append(f"min {st['min']:g}  max {st['max']:g}  mean {st['mean']:.4g}")
    shapes = st.get("shapes") or {}
    if shapes:
        top = sorted(shapes.items(), key=lambda kv: -kv[1])
        text = ", ".join(f"{k} ×{v:,}" for k, v in top[:3])
        distinct = int(st.get("distinct_shapes", len(top)))  # a manifest keeps the commonest 20
        rest = sum(v for _, v in top[3:]) + int(st.get("other_shapes_count", 0))
        parts.append(f"shapes {text}" + (f" (+{distinct - 3:,} more, ×{rest:,})" if distinct > 3 else ""))
    return "  ".join(parts)


def _lengths_line(st: dict) -> str:
    """``lengths: 1,000 records, 51,380 in all, min 2  mean 51.4  max 75; 1 ×3, 2-3 ×20, …`` from
    a feature's `LengthStats` entry (a tokenized dataset's tokens per document)."""
    text = f"lengths: {st.get('count', 0):,} records, {st.get('total', 0):,} in all"
    if "min" in st:
        text += f", min {st['min']:,}  mean {st['mean']:.1f}  max {st['max']:,}"
    hist = st.get("histogram") or {}
    if hist:
        text += "; " + ", ".join(f"{k} ×{v:,}" for k, v in hist.items())
    return text


def _show(v) -> str:
    if isinstance(v, (bytes, str)):
        return f"{type(v).__name__}[{len(v)}] {v[:32]!r}{'…' if len(v) > 32 else ''}"
    if isinstance(v, list):
        return f"list[{len(v)}] [" + ", ".join(_show(x) for x in v[:4]) + (", …]" if len(v) > 4 else "]")
    arr = np.asarray(v)
    if arr.size <= 8:
        return f"{arr.dtype}{list(arr.shape)} {arr.tolist()}"
    flat = arr.ravel()
    return f"{arr.dtype}{list(arr.shape)} [{', '.join(str(x) for x in flat[:6].tolist())}, …] min {flat.min()} max {flat.max()}"


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def weights(
    path: DatasetArg,
    feature: Annotated[
        str | None, typer.Option("--feature", help="Weigh each record by this scalar numeric feature's value.")
    ] = None,
    balance: Annotated[
        str | None,
        typer.Option(
            "--balance",
            help="Weigh records so that every class of this scalar feature (a label) has the same total weight; "
            "read it with Loader(..., weights=crossfeed.balanced(LABEL)).",
        ),
    ] = None,
    resolution: Annotated[
        int,
        typer.Option("--resolution", help="Weights are integers: a float weight becomes round(value × resolution)."),
    ] = 1,
    name: Annotated[
        str | None,
        typer.Option("--name", help="Name of the weights set (default: the feature's; balance-LABEL for --balance)."),
    ] = None,
    split: SplitOpt = None,
) -> None:
    """Write per-sample weights beside a local dataset (weights/NAME.json and one .cw file a split), read
    by Loader(..., weights=NAME): each sample drawn in proportion to its weight."""
    from crossfeed.read.tools.weights import write_weights

    meta = write_weights(
        path,
        feature=feature,
        balance=balance,
        resolution=resolution,
        name=name,
        splits=None if split is None else [split],
    )
    parts = ", ".join(f"{k}: {v.num_records:,} records, {v.total:,} slots" for k, v in meta.splits.items())
    how = f"class balance over {meta.feature!r}" if meta.kind == "balance" else f"feature {meta.feature!r}"
    typer.echo(f"wrote weights set {meta.name!r} of {path} ({how}): {parts}; read it with weights={meta.name!r}")


def register(app: typer.Typer) -> None:
    for fn in (index, info, verify, head, weights):
        app.command(fn.__name__, cls=OnceCommand)(fn)
