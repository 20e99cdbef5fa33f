"""Entry point of the ``crossfeed`` command. Each command group lives in its own module and adds
itself with ``register(app)``; errors of the CrossfeedError family print one line, exit 2."""

from __future__ import annotations

import importlib
import logging
import sys

import typer

from crossfeed.errors import CrossfeedError

app = typer.Typer(
    name="crossfeed",
    help="Convert datasets once, read them from TensorFlow and PyTorch, and serve batches over the network.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Command-group modules, each with register(app). Imported lazily so `crossfeed --help` stays fast
# and a missing optional extra (beam, …) only breaks the command that needs it.
GROUPS = (
    "crossfeed.cli.dataset",
    "crossfeed.cli.convert",
    "crossfeed.cli.bench",
    "crossfeed.cli.net",
    "crossfeed.cli.watch",
    "crossfeed.cli.cache",
)

for _name in GROUPS:
    importlib.import_module(_name).register(app)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        app()
    except CrossfeedError as e:
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
