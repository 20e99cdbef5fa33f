"""A stream's identity: everything that decides which samples arrive in which order.

A Loader's state (and so every adapter's, and what ``serve``/``dispatch`` plan from) carries it,
and resuming checks it: a state saved under one setting is refused under another, naming each
setting that differs ("pack length was 256, is 512"), instead of training on the wrong samples.

What is in it (`StreamIdentity.of`): each source's dataset by content (its manifest's SHA-256, not
its path; a delta view ``path@v3-v2``: both versions' manifests), split, weight, renames and features; the plan (shuffle, seed, block_shards, remainder,
drop_last, samples_per_epoch) — a mixture's weights (a nested mixture's: its flattened leaves,
`crossfeed.read.sources.nested`, so an equivalent nesting is the same stream) including their `Schedule`\ s (whose
future may change on resume: `resume_differences`); per-sample weights (the set's name and its
weights file's SHA-256, ``weights``); packing (length, split, bins, long, weights_by, features, pad_id) and
batch_by_tokens; the decode options that change values (decode_images, image_size, channels,
resize); a skip list (``skip=``: its global step ranges, and its sample ids by count and
digest, and whether they are refilled, ``skip refill`` — adding step ranges that lie wholly after the resume point is allowed, see
`skip_steps_added`). What is *not* in it may change on resume without loss, because the plan re-splits what is
left: world size and rank, DataLoader workers, executor, threads, processes, prefetch, cache,
timeouts, on_error, return_index, and the batch size (a position counts samples, rows or documents,
never batches) — except under batch_by_tokens, whose budget is the batch.

The fingerprint is the first 16 hex digits of the SHA-256 of the settings as canonical JSON: the
same in every process, machine and framework.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping

from crossfeed.errors import ConfigError
from crossfeed.read.schedule import Schedule
from crossfeed.read.skips import merge_ranges

VERSION = 1
MAX_SETTINGS = 4096  # a state read from a file is bounded before it is compared
_SCALARS = (str, int, float, bool, type(None))


@dataclasses.dataclass(frozen=True)
class StreamIdentity:
    """``settings``: ``{readable name: JSON value}`` (see the module docstring)."""

    settings: Mapping

    @property
    def fingerprint(self) -> str:
        text = json.dumps(dict(self.settings), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def to_json(self) -> dict:
        return {"version": VERSION, "fingerprint": self.fingerprint, "settings": dict(self.settings)}

    @classmethod
    def from_json(cls, d, where: str = "the state's identity") -> StreamIdentity:
        """Parsed strictly: a dict of the fields `to_json` writes, names to JSON scalars or lists of
        them, the fingerprint matching the settings."""
        if not isinstance(d, Mapping) or set(d) != {"version", "fingerprint", "settings"}:
            raise ConfigError(f"{where} is not a stream identity (version, fingerprint, settings): {_short(d)}")
        if d["version"] != VERSION:
            raise ConfigError(f"{where} has version {d['version']!r}; this crossfeed reads version {VERSION}")
        settings = d["settings"]
        if not isinstance(settings, Mapping) or len(settings) > MAX_SETTINGS:
            raise ConfigError(f"{where}: its settings are not a mapping of at most {MAX_SETTINGS} entries")
        for k, v in settings.items():
            if not isinstance(k, str) or not _json_value(v):
                raise ConfigError(f"{where}: setting {_short(k)} has a value that is not plain JSON: {_short(v)}")
        me = cls(dict(settings))
        if d["fingerprint"] != me.fingerprint:
            raise ConfigError(
                f"{where}: its fingerprint {_short(d['fingerprint'])} does not match its settings "
                f"({me.fingerprint}): the state was edited or damaged"
            )
        return me

    def differences(self, now: StreamIdentity) -> list[str]:
        """Each setting that differs, as "<name> was <saved>, is <now>" (self: the saved one)."""
        out = []
        for k in sorted(set(self.settings) | set(now.settings)):
            a, b = self.settings.get(k, _ABSENT), now.settings.get(k, _ABSENT)
            if a != b:
                out.append(f"{k} was {_show(a)}, is {_show(b)}")
        return out

    def weights_differ_only(self, now: StreamIdentity) -> bool:
        """Whether ``now`` differs from ``self`` in its sources' weights (schedules) and nothing else."""
        keys = {k for k in set(self.settings) | set(now.settings) if self.settings.get(k) != now.settings.get(k)}
        return bool(keys) and all(k.startswith("source ") and k.endswith(" weight") for k in keys)

    def resume_differences(self, now: StreamIdentity, at: int) -> list[str]:
        """`differences` of a state saved under ``self`` resumed under ``now`` at global sample
        ``at`` (``epoch × samples per epoch + position``), less a mixture schedule's changes to
        its future: the one change to a stream a resume allows. The rule, local and explicit:
        every phase of the saved mixture that began before ``at`` (its start and integer weights,
        `crossfeed.read.stages.sampler.mixture_phases`) is a phase of the new one, and the new one
        has no other phase beginning before ``at`` — so the samples before ``at`` and the draws
        they made are the same; phases from ``at`` on may be appended, changed or removed, and
        the running phase may end at ``at`` or later. A packed plan's position counts rows: its
        caller passes the documents the walk consumed to emit the rows before it
        (`crossfeed.read.pipeline.Pipeline.schedule_point`), which those rows depend on alone. A
        change to a phase that has begun is refused by name."""
        diffs = self.differences(now)
        if not self.weights_differ_only(now):
            return diffs
        from crossfeed.read.stages.sampler import mixture_phases  # the plan's own phases

        n = int(self.settings.get("sources") or 0)
        old_w = [self.settings.get(f"source {i} weight") for i in range(n)]
        new_w = [now.settings.get(f"source {i} weight") for i in range(n)]
        if not any(isinstance(w, list) for w in old_w) or not any(isinstance(w, list) for w in new_w):
            return diffs  # a fixed-weight mixture plans otherwise: no schedule to extend
        try:
            old = mixture_phases([Schedule.from_identity(w) if isinstance(w, list) else w for w in old_w])
            new = mixture_phases([Schedule.from_identity(w) if isinstance(w, list) else w for w in new_w])
        except (ConfigError, TypeError, ValueError):
            return diffs
        began_old = [p for p in old if p[0] < at]
        began_new = [p for p in new if p[0] < at]
        if began_old == began_new:
            return []
        for j, p in enumerate(began_old):
            q = began_new[j] if j < len(began_new) else None
            if p != q:
                return [
                    f"the mixture schedule's phase {j} (from sample {p[0]}, weights {list(p[1])}) began before the "
                    f"resume position (sample {at}) and would be "
                    + (f"from sample {q[0]} with weights {list(q[1])}" if q else "gone")
                    + f"; only phases from sample {at} on may change"
                ]
        q = began_new[len(began_old)]
        return [
            f"the new mixture schedule adds a phase at sample {q[0]} (weights {list(q[1])}), before the resume "
            f"position (sample {at}); only phases from sample {at} on may change"
        ]

    @classmethod
    def of(cls, options, datasets, sources, features, *, sample_weights=None) -> StreamIdentity:
        """The identity of a pipeline over ``datasets`` (one, or a mixture's ``sources``) under
        ``options`` (`LoaderOptions`), whose batches hold ``features``; ``sample_weights``: the
        weights file a ``weights=`` set opened (`crossfeed.format.weights.CumulativeWeights`)."""
        plan, read = options.plan, options.read
        s: dict = {}
        if sources is None:
            s["dataset"] = dataset_id(datasets[0])
            s["split"] = options.split
        else:
            for i, (ds, src) in enumerate(zip(datasets, sources)):
                s[f"source {i} dataset"] = dataset_id(ds)
                s[f"source {i} split"] = src.split
                s[f"source {i} weight"] = src.weight.identity() if isinstance(src.weight, Schedule) else src.weight
                s[f"source {i} rename"] = [list(p) for p in src.rename]
                s[f"source {i} features"] = None if src.features is None else list(src.features)
            s["sources"] = len(sources)
            s["samples per epoch"] = plan.samples_per_epoch
        if plan.weights is not None:  # which samples arrive, how often: the set's name and its bytes
            w = getattr(sample_weights, "digest", None)
            if isinstance(sample_weights, list):  # a mixture's: each source's set
                w = ",".join(x.digest for x in sample_weights)
            s["weights"] = f"{plan.weights} sha256:{w}" if w else plan.weights
            s["samples per epoch"] = plan.samples_per_epoch
        s["features"] = [f.name for f in features]
        s["shuffle"] = plan.shuffle.value
        s["seed"] = plan.seed
        s["block shards"] = plan.block_shards
        s["remainder"] = plan.remainder.value
        s["drop last"] = plan.drop_last
        if plan.pack is not None:
            p = plan.pack
            s.update(
                {
                    "pack length": p.length,
                    "pack split": p.split.value,
                    "pack bins": p.bins,
                    "pack long": p.long.value,
                    "pack weights by": p.weights_by.value,
                    "pack pad id": p.pad_id,
                }
            )
        else:
            s["pack length"] = None  # unpacked: positions count samples (documents), not rows
        if plan.batch_by_tokens is not None:
            s["batch by tokens"] = plan.batch_by_tokens
        skip = getattr(plan, "skip", None)
        if skip is not None:  # absent without one: identities saved before skips stay the same
            s["skip steps"] = [list(r) for r in skip.steps]
            s["skip samples"] = skip.digest
            if skip.refill and len(skip.samples):  # absent unless it acts: the closed-up order's positions differ
                s["skip refill"] = True
        s["decode images"] = read.decode_images
        if read.image_size is not None or read.channels is not None:
            s["image size"] = None if read.image_size is None else list(read.image_size)
            s["channels"] = read.channels
            s["resize"] = read.resize.value
        return cls(s)


def dataset_id(ds) -> str:
    """A dataset by content: its manifest's SHA-256 (the manifest names every shard's checksum);
    a delta view (``path@v3-v2``) by both versions' manifests."""
    since = getattr(ds, "since_sha256", None)
    if since is not None and ds.manifest_sha256 is not None:
        return f"sha256:{ds.manifest_sha256} since sha256:{since}"
    if ds.manifest_sha256 is not None:
        return f"sha256:{ds.manifest_sha256}"
    text = json.dumps(ds.manifest.to_json(), sort_keys=True, separators=(",", ":"))
    return f"sha256:{hashlib.sha256(text.encode()).hexdigest()}"


class _Absent:
    def __repr__(self) -> str:
        return "unset"


_ABSENT = _Absent()


def _show(v) -> str:
    if v is _ABSENT:
        return "unset"
    if isinstance(v, str) and v.startswith("sha256:"):
        return f"dataset {v[7:19]}…"
    return _short(v)


def _short(v, n: int = 80) -> str:
    text = repr(v)
    return text if len(text) <= n else text[: n - 1] + "…"


def _json_value(v, depth: int = 0) -> bool:
    if isinstance(v, _SCALARS):
        return True
    if isinstance(v, list) and depth < 3 and len(v) <= MAX_SETTINGS:
        return all(_json_value(x, depth + 1) for x in v)
    return False


def skip_steps_added(saved: StreamIdentity, now: StreamIdentity, from_step: int) -> bool:
    """Whether ``now`` differs from ``saved`` only by skipped step ranges added wholly at or
    after global step ``from_step`` (where the resume starts): the loss-spike workflow (stop,
    skip the coming steps N…M, resume) — what was delivered before is unchanged, so the resume
    is exact. Removing or moving a range, or one reaching back before ``from_step``, is not."""
    a, b = dict(saved.settings), dict(now.settings)
    old, new = a.pop("skip steps", []), b.pop("skip steps", [])
    for d in (a, b):  # no skipped samples: as without a skip list
        if isinstance(d.get("skip samples"), str) and d["skip samples"].startswith("0 "):
            del d["skip samples"]
    if a != b or not isinstance(old, list) or not isinstance(new, list) or old == new:
        return False
    try:
        before = {(int(lo), int(hi)) for lo, hi in old}
        after = {(int(lo), int(hi)) for lo, hi in new}
    except (TypeError, ValueError):
        return False
    covered = merge_ranges(after)
    # every saved range still skipped; every step newly skipped lies at or after from_step
    if not all(_within(r, covered) for r in before):
        return False
    old_cover = merge_ranges(before)
    for lo, hi in covered:
        for x, _ in _minus((lo, hi), old_cover):
            if x < from_step:
                return False
    return True


def _within(r, cover) -> bool:
    return any(lo <= r[0] and r[1] <= hi for lo, hi in cover)


def _minus(r, cover) -> list[tuple[int, int]]:
    """The parts of half-open ``r`` outside the merged ranges ``cover``."""
    out, (lo, hi) = [], r
    for a, b in cover:
        if b <= lo or a >= hi:
            continue
        if a > lo:
            out.append((lo, a))
        lo = max(lo, b)
    if lo < hi:
        out.append((lo, hi))
    return out


def follow_tail(options, state):
    """``options`` with the state's ``drop_last`` (how its epochs' tails were cut), for a front end
    whose user did not choose one: a state saved by the JAX adapter (which always drops the last
    partial batch) resumes in PyTorch or TF with their defaults to the same stream. A state without
    an identity, or one that says nothing else, leaves ``options`` as they are."""
    ident = state.get("identity") if isinstance(state, Mapping) else None
    if not isinstance(ident, Mapping) or not isinstance(ident.get("settings"), Mapping):
        return options
    saved = ident["settings"].get("drop last")
    if isinstance(saved, bool) and saved != options.plan.drop_last:
        return options.replace(drop_last=saved)
    return options
