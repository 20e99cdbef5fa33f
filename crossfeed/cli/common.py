"""Options that several commands share, declared once."""

from __future__ import annotations

from typing import Annotated

import typer

CacheDirOpt = Annotated[
    str | None, typer.Option("--cache-dir", help="Cache remote shards here (default: $CROSSFEED_CACHE_DIR).")
]
CacheLimitOpt = Annotated[str | None, typer.Option("--cache-limit", help="Keep the cache under this size, e.g. 50GB.")]
