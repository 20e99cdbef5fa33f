"""``crossfeed replay DATASET_OR_MIX --step N``: which samples were in a step, and their bytes.

A thin shell over `crossfeed.Loader.batch_at` (`crossfeed.read.replay`): the step is planned again
from the options (or a saved Loader state, whose packed cursor a packed walk starts from), nothing
logged during training is needed. Errors are
raised and turned into one line on stderr by the CLI's one boundary (`crossfeed.cli.main`).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Annotated

import numpy as np
import typer

from crossfeed.cli.options import LOADER, OnceCommand, with_options
from crossfeed.errors import ConfigError, redact
from crossfeed.read.options import LoaderOptions


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether option ``name`` was given on the command line (not its default)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")


def _read_state(path: Path) -> dict:
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"--state {path}: cannot read a saved Loader state ({e}); pass the JSON of state_dict()"
        ) from None
    if not isinstance(state, dict) or "position" not in state:
        raise ConfigError(f"--state {path}: not a Loader state_dict() (no position); pass the JSON of state_dict()")
    return state


def _from_state(ctx: typer.Context, state: dict, path: Path, options: LoaderOptions) -> LoaderOptions:
    """``options`` with the seed, batch size and epoch size (``samples_per_epoch``, which no flag
    sets) the state carries; a seed or batch size given on the command line that differs is
    refused by name."""
    changes = {}
    for field, flag, now in (
        ("seed", "--seed", options.plan.seed),
        ("batch_size", "--batch-size", options.plan.batch_size),
    ):
        saved = state.get(field)
        if saved is None:
            continue
        if _given(ctx, field) and saved != now:
            raise ConfigError(
                f"{flag} {now} differs from the {field} {saved} of --state {path}; leave {flag} out to take the "
                f"state's, or replay without --state"
            )
        changes[field] = saved
    ident = state.get("identity")
    settings = ident.get("settings") if isinstance(ident, dict) else None
    spe = settings.get("samples per epoch") if isinstance(settings, dict) else None
    if spe is not None and options.plan.samples_per_epoch is None:  # no flag sets it: the run's epoch size
        changes["samples_per_epoch"] = spe
    try:
        return options.replace(**changes) if changes else options
    except ConfigError as e:
        raise ConfigError(f"--state {path}: {e}") from None


def _check_identity(saved: dict, path, loader) -> None:
    """Refuse a state saved for another stream, naming each difference (the options to fix); a
    mixture schedule changed from the state's position on is the same stream, as on resume."""
    from crossfeed.read.identity import StreamIdentity

    if saved.get("identity") is None:
        return  # a state of version 1: `load_state_dict` checks its seed and size
    ident = StreamIdentity.from_json(saved["identity"])
    try:  # where the state stands: a mixture schedule's phases from there on may have changed
        epoch, position = int(saved.get("epoch") or 0), int(saved.get("position") or 0)
        at = epoch * loader.pipeline.total + position
    except (TypeError, ValueError):
        epoch, position, at = 0, 0, 0  # `load_state_dict` names the bad field
    if ident.weights_differ_only(loader.pipeline.identity):  # packed: the documents before the state's row
        at = loader.pipeline.schedule_point(epoch, position, saved.get("pack"))
    diffs = ident.resume_differences(loader.pipeline.identity, at)
    if diffs:
        raise ConfigError(
            f"--state {path} was saved for another stream: {'; '.join(diffs)}; give the dataset and options the "
            f"run had (--shuffle, --seed, --pack-length …)"
        )


def _plain(value):
    """A decoded feature value as an array ``np.load`` reads without pickle (bytes as uint8)."""
    if isinstance(value, bytes):
        return np.frombuffer(value, dtype=np.uint8), "bytes"
    if isinstance(value, str):
        return np.array(value), "str"
    arr = np.asarray(value)
    if arr.dtype == object:
        arr = np.asarray(list(value))
    return arr, None


def _dump(loader, got, out: Path) -> list[str]:
    """Each sample (packed: each document) decoded into ``out/NNNN.npz``, and ``out/step.json``
    (the step and its samples, each with its file). Returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    keys = got.keys
    records = loader.pipeline.records(keys)
    files, kinds = {}, {}
    for i, key in enumerate(keys.tolist()):
        arrays = {}
        for name, values in records.items():
            arrays[name], kind = _plain(values[i])
            if kind is not None:
                kinds[name] = kind
        name = f"{i:04d}.npz"
        np.savez(out / name, **arrays)
        files[key] = name
    meta = got.to_json()
    for s in meta["samples"]:
        s["file"] = files[s["key"]]
    meta["encoded_as"] = kinds  # features stored as bytes (uint8) or str (a 0-d unicode array)
    (out / "step.json").write_text(json.dumps(meta, indent=1) + "\n")
    return [*files.values(), "step.json"]


@with_options(LOADER)
def replay(
    ctx: typer.Context,
    dataset: Annotated[str, typer.Argument(help="Dataset path or remote URL, or a mixture spec .json file.")],
    step: Annotated[
        int,
        typer.Option(
            "--step",
            "-n",
            min=0,
            help="The step to replay: the rank's batch number within --epoch (0 first), or without --epoch a "
            "global step counted from epoch 0's start.",
        ),
    ],
    epoch: Annotated[
        int | None,
        typer.Option(
            "--epoch", min=0, help="Count --step within this epoch (default: a global step; --state's epoch)."
        ),
    ] = None,
    position: Annotated[
        int,
        typer.Option(
            "--position",
            min=0,
            help="With --epoch: the epoch position the run's iteration began at, which --step counts from (a run "
            "resumed at another world size or batch size: its state's position; default: the epoch's start).",
        ),
    ] = 0,
    rank: Annotated[int, typer.Option("--rank", min=0, help="The rank whose step it is.")] = 0,
    world_size: Annotated[int, typer.Option("--world-size", min=1, help="Ranks the run had.")] = 1,
    state: Annotated[
        Path | None,
        typer.Option(
            "--state",
            help="A saved Loader state_dict() (JSON): its seed, batch size and epoch are taken, and its stream "
            "identity must match the options given. Packed: the walk to a step after it starts at its cursor "
            "(O(bins + batch), not from the epoch's start).",
        ),
    ] = None,
    dump: Annotated[
        Path | None,
        typer.Option(
            "--dump", help="Write each decoded sample to DIR/NNNN.npz (packed: each document), and DIR/step.json."
        ),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object per sample instead of a table.")
    ] = False,
    *,
    options: LoaderOptions,
) -> None:
    """Which samples were in step N of a rank: source, shard file, record in it and global key, planned
    again from the seed (no record is read, nothing logged during training); --dump writes them decoded."""
    from crossfeed.read.loader import Loader
    from crossfeed.read.replay import take_state

    if rank >= world_size:
        raise typer.BadParameter(f"rank {rank} is not below --world-size {world_size}", param_hint="--rank")
    if position and epoch is None and state is None:
        raise typer.BadParameter(
            "--position counts --step within one epoch: give --epoch (or --state) too", param_hint="--position"
        )
    saved = _read_state(state) if state is not None else None
    if saved is not None:
        assert state is not None
        options = _from_state(ctx, saved, state, options)
        if epoch is None and saved.get("epoch") is not None:
            epoch = saved["epoch"]
            if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
                raise ConfigError(f"--state {state}: its epoch must be an integer >= 0, got {epoch!r}")
    options = options.replace(rank=rank, world_size=world_size, num_threads=0, prefetch=0, executor="thread")
    from crossfeed.read.sources.mixture_file import source_of

    source, more = source_of(dataset)
    options = options.replace(**more)
    with Loader(source, options) as loader:
        if saved is not None:
            _check_identity(saved, state, loader)
            try:  # checked; a packed state's cursor is where the walk to a later step starts
                take_state(loader.pipeline, saved)
            except ConfigError as e:
                raise ConfigError(f"--state {state}: {e}") from None
        try:
            got = loader.batch_at(step, epoch=epoch, position=position)
        except ConfigError as e:
            raise ConfigError(f"--step {step}: {e}") from None
        if as_json:
            for i, s in enumerate(got):
                line = {"epoch": got.epoch, "step": got.step, "rank": got.rank, "i": i, **s.to_json()}
                line["source"], line["path"] = redact(line["source"]), redact(line["path"])
                typer.echo(json.dumps(line))
        else:
            _table(got, options)
        if dump is not None:
            written = _dump(loader, got, dump)
            typer.echo(f"wrote {len(written) - 1} samples and step.json to {dump}", err=True)


def _table(got, options: LoaderOptions) -> None:
    plan = options.plan
    typer.echo(
        f"epoch {got.epoch} step {got.step} of rank {got.rank}/{got.world_size}: {len(got)} "
        f"{'pieces' if got.packed else 'samples'} (batch size {plan.batch_size}, seed {plan.seed}, "
        f"shuffle {plan.shuffle.value})"
    )
    head = ["#", "row", "tokens"] if got.packed else ["#"]
    rows = [[*head, "source", "path", "record", "key"]]
    for i, s in enumerate(got):
        base = s.source.rstrip("/")
        root = re.sub(r"@v\d{1,6}$", "", base)  # a pinned version (path@vN): its files lie in path
        rel = s.path[len(root) + 1 :] if s.path.startswith(root + "/") else redact(s.path)  # within its dataset
        cells = [str(i), str(s.row), f"{s.start}+{s.count}"] if got.packed else [str(i)]
        name = redact(f"{s.source_index}:{os.path.basename(base)}")
        rows.append([*cells, name, rel, str(s.record), str(s.key)])
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        typer.echo("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())


def register(app: typer.Typer) -> None:
    app.command("replay", cls=OnceCommand)(replay)
