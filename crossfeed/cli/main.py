"""Entry point of the ``crossfeed`` command. Each command group lives in its own module and adds
itself with ``register(app)``.

The one error boundary of the CLI is `_Boundary.invoke`, around every command:

* a `CrossfeedError` (what a user can cause: a bad path, option, file or address), or an OSError
  naming a file (missing, not permitted) → one line ``error: …`` on stderr, exit status 2;
* a missing optional package (an import of apache_beam, torch … that an extra installs,
  `crossfeed.errors.EXTRAS`) → one line naming the package and ``pip install 'crossfeed[extra]'``,
  exit status 2;
* a usage error (an unknown command or option, a missing or invalid argument) → one line
  ``error: …; see 'crossfeed CMD --help'``, exit status 2 (typer's own is a box of five lines);
* a closed stdout (``crossfeed info … | head``) → quiet, exit status 141 (128 + SIGPIPE);
* Ctrl-C → ``interrupted`` on stderr, exit status 130, no traceback — at any moment: while the
  CLI itself is still loading (typer, numpy, the command groups: the first second of a run), a
  SIGINT ends the process at once the same way (`_exit_interrupted`), since nothing has started
  that needs cleaning up;
* anything else is a bug in crossfeed and keeps its traceback.

Commands therefore raise and never print their own ``error:`` lines.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

EXIT_ERROR = 2
EXIT_SIGPIPE = 141
EXIT_INTERRUPTED = 130


def _exit_interrupted(signum, frame) -> None:
    """SIGINT before the boundary stands (the CLI's imports, parsing the command line): nothing
    has started, so say so and leave at once (a KeyboardInterrupt raised inside an import can come
    out as another error: numpy turns it into an ImportError)."""
    os.write(2, b"interrupted\n")
    os._exit(EXIT_INTERRUPTED)


def _interrupt_unraisable(hook):
    """``sys.unraisablehook`` while a command runs: a Ctrl-C whose KeyboardInterrupt landed where
    Python cannot raise it (a weakref callback inside an import, a finalizer) is delivered again to
    the main thread (`_thread.interrupt_main`, from a thread of its own a moment later: raised here
    it would land in this hook, unraisable again), so the boundary ends the command as any Ctrl-C, instead of
    Python printing "Exception ignored … KeyboardInterrupt" and the command running on; anything
    else goes to ``hook``."""
    import _thread
    import time

    def later() -> None:
        time.sleep(0.02)  # the hook and the callback it came from have returned by then
        _thread.interrupt_main()

    def handle(unraisable) -> None:
        if unraisable.exc_type is KeyboardInterrupt:
            threading.Thread(target=later, name="crossfeed-interrupt", daemon=True).start()
            return
        hook(unraisable)

    return handle


def _set_sigint(handler):
    """Install ``handler`` for SIGINT and return the one it replaces; None (nothing done) outside
    the main thread, where signal handlers cannot be set."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, handler)
    return previous


# Loading the CLI takes a while (the first second of a run): a Ctrl-C during it ends the process
# as the boundary would. Only where SIGINT still has Python's default handler (a program starting),
# and only until the import is done (a test process that imports the app keeps its own).
_LOADING = signal.getsignal(signal.SIGINT) is signal.default_int_handler and _set_sigint(_exit_interrupted)

import importlib  # noqa: E402  (after the handler: these imports are the slow part)
import logging  # noqa: E402
from typing import Annotated, Any, NoReturn  # noqa: E402

import typer  # noqa: E402
from typer.core import TyperGroup, TyperOption  # noqa: E402

from crossfeed.errors import CrossfeedError, missing_extra, redact  # noqa: E402

# click's exceptions where this typer takes them from (newer typer releases carry their own click)
_clickx = sys.modules[typer.BadParameter.__module__]
_UsageError: type[Exception] = _clickx.UsageError
_NoArgsIsHelp: tuple[type[Exception], ...] = tuple(c for c in (getattr(_clickx, "NoArgsIsHelpError", None),) if c)

# OSErrors that name a path the user gave: an error of the environment, not a bug.
_PATH_ERRORS = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)

# Libraries whose INFO lines are noise to a CLI user; shown with --verbose.
_NOISY = ("apache_beam", "distributed", "dask", "bokeh", "tornado", "fsspec")


def _message(e: BaseException) -> str:
    if isinstance(e, CrossfeedError):
        return str(e)
    filename = getattr(e, "filename", None)
    return redact(f"{filename}: {getattr(e, 'strerror', None)}" if filename else str(e))


def _silence_stdout() -> None:
    """After EPIPE, point stdout at /dev/null so the interpreter's final flush stays quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # not a real file (CliRunner): nothing to flush
        pass


# `crossfeed --help` lists the commands in the order of the workflow, not of registration (typer
# puts sub-groups such as `convert` after every plain command). Commands not named here come last.
COMMAND_ORDER = (
    "convert", "index", "info", "head", "verify", "weights", "bench",
    "serve", "dispatch", "mon", "stat", "show", "top", "replay", "filter", "cache", "keygen",
)  # fmt: skip


def _command(ctx) -> list[str]:
    """The command words of this invocation (``convert images``), from the group's arguments."""
    words = []
    for arg in [*getattr(ctx, "_protected_args", []), *ctx.args]:
        if arg.startswith("-"):
            continue
        words.append(arg)
        if len(words) == 2 or words[0] != "convert":
            break
    return words


def _usage_error(e: Any) -> NoReturn:  # a click UsageError (whichever click typer uses)
    """One line on stderr and exit 2 (typer would draw a box of five lines); help asked for by
    giving no arguments is shown as it is."""
    if isinstance(e, _NoArgsIsHelp):
        raise e
    where = f"; see '{e.ctx.command_path} --help'" if e.ctx is not None else ""
    typer.echo(f"error: {e.format_message().rstrip('.')}{where}", err=True)
    raise typer.Exit(e.exit_code) from None


class _Boundary(TyperGroup):
    """The top-level group: every command (and sub-group) runs inside its `invoke`."""

    def list_commands(self, ctx):
        names = super().list_commands(ctx)
        rank = {name: i for i, name in enumerate(COMMAND_ORDER)}
        return sorted(names, key=lambda n: rank.get(n, len(rank)))

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except _UsageError as e:  # a bad option before the command: `crossfeed --bogus info`
            _usage_error(e)

    def invoke(self, ctx):
        previous = _set_sigint(signal.default_int_handler)  # from here a Ctrl-C is a KeyboardInterrupt
        hook, sys.unraisablehook = sys.unraisablehook, _interrupt_unraisable(sys.unraisablehook)
        command = " ".join(["crossfeed", *_command(ctx)])  # before invoking: click consumes the arguments
        try:
            return super().invoke(ctx)
        except _UsageError as e:  # a bad command, option or argument: one line, as any error
            _usage_error(e)
        except BrokenPipeError:
            _silence_stdout()
            raise typer.Exit(EXIT_SIGPIPE) from None
        except (CrossfeedError, *_PATH_ERRORS) as e:
            typer.echo(f"error: {_message(e)}", err=True)
            raise typer.Exit(EXIT_ERROR) from None
        except ModuleNotFoundError as e:
            missing = missing_extra(e, command)
            if missing is e:
                raise  # not an extra's module: a broken install keeps its traceback
            typer.echo(f"error: {missing}", err=True)
            raise typer.Exit(EXIT_ERROR) from None
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(EXIT_INTERRUPTED) from None
        finally:
            sys.unraisablehook = hook
            if previous is not None:
                signal.signal(signal.SIGINT, previous)


# typer's rich help prints a type for every option, `<bool>` for flags too (its plain help does
# not): a flag such as --overwrite or --verify/--no-verify takes no value, so it shows no placeholder.
_option_type = TyperOption.display_type_rich


def _no_placeholder_for_flags(self: TyperOption, ctx) -> str | None:
    return None if self.is_flag else _option_type(self, ctx)


TyperOption.display_type_rich = _no_placeholder_for_flags  # type: ignore[method-assign]  # patched on purpose

app = typer.Typer(
    name="crossfeed",
    cls=_Boundary,
    help="Convert datasets once, read them from TensorFlow and PyTorch, and serve batches over the network.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def configure_logging(verbose: bool) -> None:
    """WARNING and up on stderr; INFO of crossfeed and of Beam/Dask only with ``--verbose``."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("crossfeed").setLevel(logging.INFO if verbose else logging.WARNING)
    for name in _NOISY:
        logging.getLogger(name).setLevel(logging.INFO if verbose else logging.WARNING)
    if not verbose:  # Dask configures its own loggers on import, and in the workers it spawns: tell it too
        os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")
        # records logged on the root logger itself (Beam's import-time "apitools not found") in the workers;
        # named loggers (crossfeed's too) propagate past the root's level, so their warnings still show
        os.environ.setdefault("DASK_LOGGING__ROOT", "error")


def _version(value: bool) -> None:
    if value:
        from crossfeed import __version__

        typer.echo(f"crossfeed {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show INFO logs (crossfeed, Beam, Dask).")] = False,
    version: Annotated[
        bool | None, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = None,
) -> None:
    """Convert datasets once, read them from TensorFlow and PyTorch, and serve batches over the network."""
    configure_logging(verbose)


# Command-group modules, each with register(app). Imported lazily so `crossfeed --help` stays fast
# and a missing optional extra (beam, …) only breaks the command that needs it.
GROUPS = (
    "crossfeed.cli.dataset",
    "crossfeed.cli.convert",
    "crossfeed.cli.bench",
    "crossfeed.cli.net",
    "crossfeed.cli.watch",
    "crossfeed.cli.top",
    "crossfeed.cli.cache",
    "crossfeed.cli.replay",
    "crossfeed.cli.filter_pass",
)

for _name in GROUPS:
    importlib.import_module(_name).register(app)

if _LOADING:
    signal.signal(signal.SIGINT, signal.default_int_handler)  # loaded: SIGINT as it was


def main() -> None:
    _set_sigint(_exit_interrupted)  # until the boundary stands (parsing the command line)
    try:
        app(prog_name="crossfeed")
    except SystemExit as e:
        if e.code != EXIT_INTERRUPTED:
            raise
        # interrupted: leave now, not after the interpreter joins the threads a job left running
        # (a Beam runner's workers stopped mid-step can keep a normal exit waiting)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(EXIT_INTERRUPTED)


if __name__ == "__main__":
    main()
