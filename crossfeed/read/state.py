"""A Loader's state: what `crossfeed.read.loader.Loader.state_dict` saves and `load_state_dict`
resumes from — small, framework-free JSON-able dicts, read strictly (a state file crosses a trust
boundary: every field checked, its identity compared setting by setting).

Versions: 3 adds a packed plan's cursor (``pack``: the packer's open rows and document position);
2 the stream's identity (`crossfeed.read.identity`), read as 3 without a cursor; 1 is read,
unchecked (a warning says so).
"""

from __future__ import annotations

import logging
import numbers
from typing import Any

from crossfeed.errors import ConfigError
from crossfeed.read.identity import StreamIdentity, skip_steps_added

log = logging.getLogger("crossfeed.read.loader")
STATE_VERSION = 3
READ_VERSIONS = (1, 2, 3)


def make(pipeline: Any, epoch: int, position: int, *, walk: bool = True) -> dict:
    """The state of position ``position`` of epoch ``epoch`` of ``pipeline``'s stream (a packed
    plan's cursor: see `crossfeed.read.loader.Loader.state_at`)."""
    state = {
        "version": STATE_VERSION,
        "seed": pipeline.options.plan.seed,
        "epoch": int(epoch),
        "position": int(position),
        "num_samples": pipeline.total,
        "batch_size": pipeline.options.plan.batch_size,
        "identity": pipeline.identity.to_json(),
    }
    where = pipeline.source_positions(epoch, position)  # for people: where each source stands
    if where is not None:
        state["sources"] = where
    cursor = pipeline.resume_state(epoch, position, walk=walk)
    if cursor is not None:
        state["pack"] = cursor
    return state


def resume_point(pipeline: Any, state: Any, on_change: str) -> tuple[int, int]:
    """Where ``pipeline``'s stream continues from ``state``: ``(epoch, position)``, as
    `crossfeed.read.loader.Loader.load_state_dict` says; a packed cursor is handed to the
    pipeline on the way."""
    if on_change not in ("refuse", "next_epoch"):
        raise ConfigError(f"on_change must be 'refuse' or 'next_epoch', got {on_change!r}")
    if not isinstance(state, dict) or state.get("version") not in READ_VERSIONS:
        got = state.get("version") if isinstance(state, dict) else type(state).__name__
        raise ConfigError(
            f"loader state version {got!r} is not one this crossfeed reads ({', '.join(map(str, READ_VERSIONS))}); "
            f"save it again with this version, or resume with the crossfeed that saved it"
        )
    try:
        seed, num, epoch, position = (
            state["seed"],
            state["num_samples"],
            int(state["epoch"]),
            int(state["position"]),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"loader state is missing or has a bad field: {e}") from None
    for field in ("epoch", "position"):  # 1.5 or "5" would be taken as 1 or 5, silently
        if isinstance(state[field], bool) or not isinstance(state[field], numbers.Integral):
            raise ConfigError(f"loader state's {field} must be an integer, got {state[field]!r}")
    now, plan = pipeline.identity, pipeline.options.plan
    if state["version"] == 1:  # saved before identities: only its seed and size can be checked
        log.warning(
            "a loader state of version 1 carries no stream identity: only its seed and dataset size are "
            "checked; save a new state to have every setting checked on resume"
        )
        diffs = []
    else:
        # a mixture schedule's future may change (a phase appended): `resume_differences`;
        # so may the skipped steps after the resume point (`skip_steps_added`)
        saved = StreamIdentity.from_json(state.get("identity"))
        at = epoch * pipeline.total + position
        if saved.weights_differ_only(now):  # a packed plan's position counts rows: the documents before them
            at = pipeline.schedule_point(epoch, position, state.get("pack"))
        diffs = saved.resume_differences(now, at)
        if diffs and skip_steps_added(saved, now, pipeline.global_step(epoch, position)):
            diffs = []  # skipped steps added after the resume point: the past is unchanged
    if not diffs and (seed != plan.seed or num != pipeline.total):
        diffs = [f"seed was {seed}, is {plan.seed}"] if seed != plan.seed else []
        diffs += [f"samples per epoch were {num}, are {pipeline.total}"] if num != pipeline.total else []
    if diffs:
        if on_change == "refuse":
            raise ConfigError(
                "this state belongs to another stream: " + "; ".join(diffs) + ". Resume with the saved "
                "settings and data" + _kept_version_hint(pipeline, state) + ", or pass on_change='next_epoch' to "
                "start the next epoch with the new ones"
            )
        log.warning(
            "resuming under changed settings (%s): epoch %d ends here, epoch %d starts under the new settings",
            "; ".join(diffs),
            epoch,
            epoch + 1,
        )
        epoch, position = (epoch + 1, 0) if position > 0 else (epoch, 0)
    elif state.get("pack") is not None:  # a packed state's cursor: checked, then walked on from
        if state["version"] < 3:
            raise ConfigError(f"loader state pack: a version {state['version']} state carries no packed cursor")
        pipeline.resume_from(state["pack"], epoch, position)
    return epoch, position


def _kept_version_hint(pipeline: Any, state: dict) -> str:
    """Where a state of another stream was saved on an earlier version of a dataset read here
    (its manifest's SHA-256 is one the dataset's ``versions`` pins): the ``path@vN`` to resume on."""
    ident = state.get("identity")
    settings = ident.get("settings") if isinstance(ident, dict) else None
    if not isinstance(settings, dict):
        return ""
    saved = {v for v in settings.values() if isinstance(v, str) and v.startswith("sha256:")}
    for ds in pipeline.datasets:
        for version, sha in ds.manifest.versions:
            if f"sha256:{sha}" in saved:
                return f" (it was saved on version {version} of {ds.path}: resume on '{ds.path}@v{version}')"
    return ""
