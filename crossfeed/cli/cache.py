"""``crossfeed cache ls|prune|clear``: look after the local cache of remote shards.

The directory is ``--dir``, else ``$CROSSFEED_CACHE_DIR``; see `crossfeed.io.cache`.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Annotated

import typer

from crossfeed.errors import ConfigError

cache_app = typer.Typer(help="Inspect and manage the local cache of remote shards.", no_args_is_help=True)

DirOpt = Annotated[Path | None, typer.Option("--dir", help="Cache directory (default: $CROSSFEED_CACHE_DIR).")]


def _cache(directory: Path | None):
    from crossfeed.io.cache import ENV, ShardCache

    root = directory or os.environ.get(ENV)
    if not root:
        raise ConfigError(f"no cache directory: pass --dir or set {ENV}")
    if not os.path.isdir(root):
        raise ConfigError(f"{root}: no such cache directory")
    return ShardCache(root)


@cache_app.command("ls")
def ls(directory: DirOpt = None) -> None:
    """List the cached shards (sha256, size, last use), least recently used first, and the total."""
    cache = _cache(directory)
    entries = sorted(cache.entries(), key=lambda e: e.last_used)
    for e in entries:
        when = datetime.datetime.fromtimestamp(e.last_used).strftime("%Y-%m-%d %H:%M:%S")
        typer.echo(f"{e.name[:16]}…  {e.size / 1e6:12,.1f} MB  {when}")
    typer.echo(f"{len(entries)} shards, {sum(e.size for e in entries) / 1e6:,.1f} MB in {cache.root}")


@cache_app.command("prune")
def prune(
    limit: Annotated[str, typer.Argument(help="Size to keep, such as 20GB (least recently used go first).")],
    directory: DirOpt = None,
) -> None:
    """Remove least-recently-used shards until the cache is under LIMIT."""
    freed = _cache(directory).prune(limit)
    typer.echo(f"freed {freed / 1e6:,.1f} MB")


@cache_app.command("clear")
def clear(directory: DirOpt = None) -> None:
    """Remove every cached shard."""
    freed = _cache(directory).clear()
    typer.echo(f"freed {freed / 1e6:,.1f} MB")


def register(app: typer.Typer) -> None:
    app.add_typer(cache_app, name="cache")
