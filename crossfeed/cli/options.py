"""Options that several commands share, declared once, and the decorator that gives them to a
command.

A `Group` is a set of typer options and how their values become what the command receives:
`LOADER` (``serve``, ``dispatch``, ``bench``) becomes one `crossfeed.LoaderOptions` — the same
object, defaults and validation as ``crossfeed.Loader`` — and `CONVERT` (the four ``convert``
commands) a dict of the conversion's common settings. ``@with_options(LOADER)`` adds the group's
options to a command's signature (typer reads it) and hands the command ``options=...``::

    @with_options(LOADER)
    def bench(dataset: str, *, options: LoaderOptions) -> None: ...
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import json
from collections.abc import Callable
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

from crossfeed.policy import OnError
from crossfeed.read.options import LoaderOptions, Pack, PackSplit, PlanOptions, ReadOptions, Remainder, Resize, Shuffle


def default_of(cls, name: str):
    """A field's default, read off its dataclass: the CLI never re-states the library's."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


@dataclasses.dataclass(frozen=True)
class Group:
    """Typer options (``name: (Annotated type, default)``) delivered to a command as one value,
    under the keyword ``into``, made by ``build`` from their values."""

    into: str
    params: dict[str, tuple[Any, Any]]
    build: Callable[[dict], Any]


def with_options(*groups: Group):
    """Add the groups' options to a typer command; it receives each group's value by keyword."""

    def wrap(fn):
        sig = inspect.signature(fn, eval_str=True)
        taken = {g.into for g in groups}
        own = [p for p in sig.parameters.values() if p.name not in taken]
        added = [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
            for g in groups
            for name, (annotation, default) in g.params.items()
        ]

        @functools.wraps(fn)
        def command(*args, **values):
            for g in groups:
                values[g.into] = g.build({name: values.pop(name) for name in g.params})
            return fn(*args, **values)

        params = own + added
        command.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]  # read by inspect
        command.__annotations__ = {p.name: p.annotation for p in params if p.annotation is not p.empty}
        del command.__wrapped__  # typer must read the signature above, not fn's
        return command

    return wrap


class OnceCommand(TyperCommand):
    """A command whose options take one value each unless declared repeatable: an option given
    twice is refused (click would keep the last one silently); a repeatable one (``--types``,
    ``--feature``, ``--storage-option``) accumulates."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        once = {}
        for p in self.params:
            if getattr(p, "param_type_name", "") == "option" and not p.multiple and not getattr(p, "count", False):
                for opt in (*p.opts, *p.secondary_opts):
                    once[opt] = p
        seen: dict[str, str] = {}
        for a in args:
            if a == "--":
                break
            name = a.split("=", 1)[0]
            param = once.get(name)
            if param is None or param.name is None:
                continue
            if param.name in seen:
                raise typer.BadParameter(
                    f"given more than once ({seen[param.name]} before); give it once", param_hint=name
                )
            seen[param.name] = name
        return super().parse_args(ctx, args)


def _value(v):
    return v.value if isinstance(v, enum.Enum) else v


def _loader_options(v: dict) -> LoaderOptions:
    """The CLI's loader values as one `LoaderOptions`. A command-line process is not a trainer:
    RANK/WORLD_SIZE are not its share (rank 0 of 1 unless a command says otherwise)."""
    return LoaderOptions.of(
        split=v["split"],
        batch_size=v["batch_size"],
        shuffle=_value(v["shuffle"]),
        seed=v["seed"],
        drop_last=v["drop_last"],
        remainder=_value(v["remainder"]),
        block_shards=v["block_shards"],
        num_threads=v["threads"],
        prefetch=v["prefetch"],
        executor="thread" if v["procs"] is None else "process",
        processes=v["procs"] or default_of(ReadOptions, "processes"),
        decode_images=v["decode_images"],
        image_size=v["image_size"],
        channels=v["channels"],
        resize=_value(v["resize"]),
        on_error=_value(v["on_error"]),
        max_skips=v["max_skips"],
        cache_dir=v["cache_dir"],
        cache_limit=v["cache_limit"],
        allowed_roots=tuple(v["allow_root"] or ()),
        read_timeout=v["read_timeout"],
        storage_options=storage_options(v["storage_option"]),
        log_stats=v["log_stats"],
        pack=_pack(v),
        batch_by_tokens=v["batch_by_tokens"],
        weights=v["weights"],
        skip=v["skip"],
        rank=0,
        world_size=1,
    )


def _pack(v: dict) -> dict | None:
    """``--pack-length`` (with ``--pack-features``, ``--pack-split``) as `Pack`'s fields, or None."""
    if v["pack_length"] is None:
        given = [flag for flag, key in (("--pack-features", "pack_features"), ("--pack-split", "pack_split")) if v[key]]
        if given:
            raise typer.BadParameter(f"{' and '.join(given)} need --pack-length", param_hint="--pack-length")
        return None
    features = tuple(f for item in v["pack_features"] or () for f in item.split(",") if f)
    return {
        "length": v["pack_length"],
        "features": features or default_of(Pack, "features"),
        "split": _value(v["pack_split"] or default_of(Pack, "split")),
    }


# where a dataset's data_root outside it may lie (the library's allowed_roots), for every command that reads one
ALLOW_ROOT = Annotated[
    list[str] | None,
    typer.Option(
        "--allow-root",
        help="Read a dataset's data_root (crossfeed index --index-dir) under this directory or URL, though it lies "
        "outside the dataset (repeatable; also $CROSSFEED_ALLOWED_ROOTS, comma-separated).",
    ),
]


def storage_options(values: list[str] | None) -> dict:
    """``--storage-option KEY=VALUE`` values as fsspec's ``storage_options``: each VALUE is JSON
    when it parses (``anon=false``, ``max_concurrency=4``), else a string; a dotted KEY nests
    (``client_kwargs.region_name=eu-west-1`` → ``{"client_kwargs": {"region_name": "eu-west-1"}}``)."""
    out: dict = {}
    for item in values or ():
        key, eq, text = item.partition("=")
        parts = key.strip().split(".")
        if not eq or not all(parts):
            raise typer.BadParameter(
                f"{item!r} is not KEY=VALUE; e.g. --storage-option endpoint_url=http://127.0.0.1:9000",
                param_hint="--storage-option",
            )
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        into = out
        for i, part in enumerate(parts[:-1]):
            into = into.setdefault(part, {})
            if not isinstance(into, dict):
                raise typer.BadParameter(
                    f"{item!r}: {'.'.join(parts[: i + 1])} is already given a value", param_hint="--storage-option"
                )
        if parts[-1] in into:
            raise typer.BadParameter(f"{item!r}: {key} is given twice", param_hint="--storage-option")
        into[parts[-1]] = value
    return out


def _checked(values: list[str] | None) -> list[str] | None:
    storage_options(values)  # refused while the command line is parsed (typer hands on the strings)
    return values


# fsspec's options for a remote dataset (the library's storage_options), for every command that reads one
STORAGE_OPTION = Annotated[
    list[str] | None,
    typer.Option(
        "--storage-option",
        callback=_checked,
        metavar="KEY=VALUE",
        help="An fsspec option for a remote dataset (repeatable), e.g. endpoint_url=http://127.0.0.1:9000, "
        "anon=true, client_kwargs.region_name=eu-west-1 (a dotted KEY nests); VALUE is JSON when it parses, else "
        "a string. What is not given comes from the standard environment and config files (AWS_*, ~/.aws, "
        "GOOGLE_APPLICATION_CREDENTIALS); see docs/storage.md.",
    ),
]

BATCH_SIZE = 32  # the command line's batch size unless --batch-size says otherwise (the library requires one)

LOADER = Group(
    "options",
    {
        "split": (
            Annotated[str, typer.Option("--split", "-s", help="Split to read.")],
            default_of(LoaderOptions, "split"),
        ),
        "batch_size": (
            Annotated[int, typer.Option("--batch-size", "-b", min=1, help="Samples per batch.")],
            BATCH_SIZE,
        ),
        "shuffle": (
            Annotated[
                Shuffle, typer.Option("--shuffle", help="Order: exact global permutation, shard blocks, or file order.")
            ],
            default_of(PlanOptions, "shuffle"),
        ),
        "seed": (
            Annotated[int, typer.Option("--seed", min=0, help="Shuffle seed (the same seed gives the same order).")],
            default_of(PlanOptions, "seed"),
        ),
        "drop_last": (
            Annotated[bool, typer.Option("--drop-last/--keep-last", help="Drop a last partial batch.")],
            default_of(PlanOptions, "drop_last"),
        ),
        "remainder": (
            Annotated[
                Remainder,
                typer.Option(
                    "--remainder", help="Over several ranks: pad the epoch's tail from its start, or drop it."
                ),
            ],
            default_of(PlanOptions, "remainder"),
        ),
        "block_shards": (
            Annotated[int, typer.Option("--block-shards", min=1, help="With --shuffle block: shards read together.")],
            default_of(PlanOptions, "block_shards"),
        ),
        "threads": (
            Annotated[int, typer.Option("--threads", "-t", min=0, help="Loader threads building batches in parallel.")],
            default_of(ReadOptions, "num_threads"),
        ),
        "prefetch": (
            Annotated[int, typer.Option("--prefetch", min=0, help="Batches kept ready beyond the ones being built.")],
            default_of(ReadOptions, "prefetch"),
        ),
        "procs": (
            Annotated[
                int | None,
                typer.Option(
                    "--procs",
                    min=1,
                    help="Build batches in N worker processes (shared memory) instead of threads: for Python transforms.",
                ),
            ],
            None,
        ),
        "decode_images": (
            Annotated[
                bool, typer.Option("--decode-images/--no-decode-images", help="Decode JPEG/PNG features to arrays.")
            ],
            default_of(ReadOptions, "decode_images"),
        ),
        "image_size": (
            Annotated[
                str | None,
                typer.Option("--image-size", help="Bring decoded images to HxW (e.g. 224x224) as they are decoded."),
            ],
            None,
        ),
        "channels": (
            Annotated[
                int | None,
                typer.Option("--channels", help="Convert decoded images to 1 (gray), 3 (RGB) or 4 channels."),
            ],
            None,
        ),
        "resize": (
            Annotated[
                Resize,
                typer.Option("--resize", help="How images reach --image-size: stretch, crop (centre) or pad."),
            ],
            default_of(ReadOptions, "resize"),
        ),
        "on_error": (
            Annotated[OnError, typer.Option("--on-error", help="A bad record stops the reader (raise) or is skipped.")],
            default_of(ReadOptions, "on_error"),
        ),
        "max_skips": (
            Annotated[int, typer.Option("--max-skips", min=0, help="With --on-error skip: most records to skip.")],
            default_of(ReadOptions, "max_skips"),
        ),
        "cache_dir": (
            Annotated[
                str | None,
                typer.Option("--cache-dir", help="Cache remote shards here (default: $CROSSFEED_CACHE_DIR)."),
            ],
            None,
        ),
        "cache_limit": (
            Annotated[str | None, typer.Option("--cache-limit", help="Keep the cache under this size, e.g. 50GB.")],
            None,
        ),
        "log_stats": (
            Annotated[
                bool,
                typer.Option(
                    "--log-stats/--no-log-stats",
                    help="Log each epoch's stage times and verdict (is the consumer waiting on input?) at INFO.",
                ),
            ],
            default_of(ReadOptions, "log_stats"),
        ),
        "pack_length": (
            Annotated[
                int | None,
                typer.Option(
                    "--pack-length",
                    min=1,
                    help="Pack token documents into rows of this many tokens (batches of (batch, length) plus "
                    "segment_ids and positions; docs/sequences.md).",
                ),
            ],
            None,
        ),
        "pack_features": (
            Annotated[
                list[str] | None,
                typer.Option(
                    "--pack-features",
                    help="With --pack-length: the token features packed together (comma-separated or repeated; "
                    "default: tokens).",
                ),
            ],
            None,
        ),
        "pack_split": (
            Annotated[
                PackSplit | None,
                typer.Option(
                    "--pack-split",
                    help="With --pack-length: best-fit whole documents into rows (documents), or concatenate and "
                    "chunk (rows).",
                ),
            ],
            None,
        ),
        "batch_by_tokens": (
            Annotated[
                int | None,
                typer.Option(
                    "--batch-by-tokens",
                    min=1,
                    help="Without packing: batches of whole documents holding at most this many tokens per rank, "
                    "padding counted (the batch size varies; docs/sequences.md).",
                ),
            ],
            None,
        ),
        "weights": (
            Annotated[
                str | None,
                typer.Option(
                    "--weights",
                    help="Draw each sample in proportion to the weights set NAME (written by `crossfeed weights`; "
                    "balance-LABEL for class balance).",
                ),
            ],
            None,
        ),
        "skip": (
            Annotated[
                str | None,
                typer.Option(
                    "--skip",
                    metavar="FILE",
                    help="Leave out the global steps and sample ids a skip file lists (one a line: INDEX, "
                    "SOURCE INDEX or 'steps START END'; docs/read-and-mix.md). A dispatcher leases no skipped step "
                    "(packed plans too) and its servers are given the same file: a server whose skip list differs "
                    "is refused by name.",
                ),
            ],
            default_of(PlanOptions, "skip"),
        ),
        "allow_root": (ALLOW_ROOT, None),
        "storage_option": (STORAGE_OPTION, None),
        "read_timeout": (
            Annotated[
                float | None,
                typer.Option(
                    "--read-timeout",
                    help="Seconds each remote read may stall before it fails (default: $CROSSFEED_READ_TIMEOUT, else 60).",
                ),
            ],
            None,
        ),
    },
    _loader_options,
)
