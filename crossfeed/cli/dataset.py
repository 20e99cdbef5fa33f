"""``crossfeed index | info | verify | head``: look after datasets on disk.

Thin shells over `crossfeed.write.adopt`, `crossfeed.read.verify` and `crossfeed.read.dataset`. Diagnostics go to
stderr; a bad path or a broken file is one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
from collections.abc import Iterator
from typing import Annotated

import numpy as np
import typer

from crossfeed.errors import CrossfeedError

PROGRESS_MIN_BYTES = 64 << 20  # show a progress bar from this dataset size on

DatasetArg = Annotated[str, typer.Argument(help="Dataset directory (or fsspec URL) holding crossfeed.json.")]
SplitOpt = Annotated[str | None, typer.Option("--split", "-s", help="Only this split (default: all).")]


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def _one_line_errors(fn):
    """Turn the errors a user can cause (bad path, broken file) into one line on stderr, exit 2."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (CrossfeedError, OSError) as e:
            _fail(str(e) if isinstance(e, CrossfeedError) else f"{getattr(e, 'filename', None) or ''} {e.strerror or e}".strip())
    return wrapper


@contextlib.contextmanager
def _progress(total: int, label: str) -> Iterator:
    """A progress bar on stderr for large jobs (a no-op callback for small ones)."""
    if total < PROGRESS_MIN_BYTES:
        yield lambda n: None
        return
    with typer.progressbar(length=total, label=label, file=sys.stderr) as bar:
        yield bar.update


def index(
    path: Annotated[str, typer.Argument(help="Directory of TFRecord shards (plain or GZIP) written by any tool.")],
    split: Annotated[str, typer.Option("--split", "-s", help="Split of shards whose names carry none (all shards with --no-split-from-name).")] = "train",
    split_from_name: Annotated[bool, typer.Option("--split-from-name/--no-split-from-name", help="Take the split from '<split>-SSSSS-of-NNNNN' file names.")] = True,
    force: Annotated[bool, typer.Option("--force", "-f", help="Rebuild the index files and manifest of an indexed dataset.")] = False,
) -> None:
    """Adopt TFRecord shards: check every record, write .idx files and the manifest (crossfeed.json)."""
    import os

    from crossfeed.write.adopt import index_dataset, is_shard_name

    total = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if is_shard_name(n)) if os.path.isdir(path) else 0
    with _progress(total, "indexing") as advance:
        manifest = index_dataset(path, split=split, split_from_name=split_from_name, force=force, progress=advance)
    counts = ", ".join(f"{k}: {v.num_records} records in {len(v.shards)} shards" for k, v in manifest.splits.items())
    typer.echo(f"indexed {path}: {counts}; features {', '.join(manifest.schema.names)}")


def info(dataset: DatasetArg,
         as_json: Annotated[bool, typer.Option("--json", help="Print the manifest as JSON.")] = False) -> None:
    """Show a dataset's splits, record counts, sizes, schema and metadata."""
    from crossfeed.read.dataset import open_dataset

    with open_dataset(dataset) as ds:
        if as_json:
            typer.echo(ds.manifest.dumps().rstrip())
            return
        typer.echo(f"dataset {ds.path}")
        typer.echo("splits:")
        for name, s in sorted(ds.splits.items()):
            typer.echo(f"  {name:<12} {s.num_records:>12,} records {len(s.shards):>5} shards {_size(s.num_bytes):>10}")
        typer.echo("features:")
        for f in ds.schema:
            shape = "(" + ", ".join("?" if d is None else str(d) for d in f.shape) + ("," if len(f.shape) == 1 else "") + ")"
            typer.echo(f"  {f.name:<20} {f.dtype:<8} {shape:<16} {f.encoding.value}")
        if ds.metadata:
            typer.echo("metadata:")
            for k, v in sorted(ds.metadata.items()):
                typer.echo(f"  {k}: {json.dumps(v)}")


def verify(dataset: DatasetArg, split: SplitOpt = None) -> None:
    """Check every record's CRC, every index entry, counts and sha256 against the manifest.
    Lists every problem found; exits 1 if there is any."""
    from crossfeed.read.dataset import open_dataset
    from crossfeed.read.verify import verify_dataset

    with open_dataset(dataset) as ds:
        names = [split] if split is not None and split in ds.splits else list(ds.splits)
        total = sum(ds.splits[n].num_bytes for n in names)
        records = sum(ds.splits[n].num_records for n in names)
        shards = sum(len(ds.splits[n].shards) for n in names)
    with _progress(total, "verifying") as advance:
        shown = [0]

        def progress(done: int, _total: int) -> None:  # verify reports totals, the bar takes steps
            advance(done - shown[0])
            shown[0] = done

        problems = verify_dataset(dataset, split=split, progress=progress)
    if problems:
        for p in problems:
            typer.echo(f"BAD {p}", err=True)
        bad = len({p.file.removesuffix(".idx") for p in problems})
        typer.echo(f"{len(problems)} problems in {bad} of {shards} shards", err=True)
        raise typer.Exit(1)
    typer.echo(f"ok: {records:,} records in {shards} shards ({_size(total)}) verified")


def head(dataset: DatasetArg, n: Annotated[int, typer.Option("-n", "--num", min=0, help="How many samples.")] = 5,
         split: SplitOpt = None) -> None:
    """Show the first samples of a split: shape, dtype and small values; bytes truncated."""
    from crossfeed.read.dataset import open_dataset

    with open_dataset(dataset) as ds:
        name = split or ("train" if "train" in ds.splits else sorted(ds.splits)[0])
        s = ds[name] if name in ds.splits else _fail(f"{ds.path}: no split {name!r}; it has {sorted(ds.splits)}")
        for i in range(min(n, len(s))):
            typer.echo(f"[{name} {i}]")
            for key, value in s[i].items():
                typer.echo(f"  {key}: {_show(value)}")


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


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def register(app: typer.Typer) -> None:
    for fn in (index, info, verify, head):
        app.command(fn.__name__)(_one_line_errors(fn))
