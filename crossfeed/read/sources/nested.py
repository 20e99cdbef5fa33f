"""Nested mixtures: a `Source` whose path is itself a mixture — a list of sources, or a mixture
spec file — weighted as one (docs/read-and-mix.md, "Nested mixtures")::

    Loader([Source("code/", weight=1),
            Source([Source("web/", weight=3), Source("books/", weight=1)], weight=Schedule.constant([(0, 3), (S, 1)]))])

`flatten` turns the tree into its leaves before anything is planned: a leaf's weight is the
product, level by level, of its node's share among its siblings (``w / sum(siblings' w)``), times
the top level's weight. With every weight a number the leaves get integer weights (a fixed
mixture); with a `Schedule` anywhere, every leaf gets a constant schedule over every boundary of
every schedule in the tree (a linear one's step function at its ``every``), each phase's leaf
weights the lowest integers in those proportions (a phase where a linear schedule weighs and
whose weights would need more than 1000 as integers: shares of 1000, as for a flat mixture). So
the plan, the stream identity, replay, resume and serve/dispatch see a flat mixture of leaves.

Exactness: each leaf is within one sample of its share over every prefix of every phase (the
chairman schedule of the flat mixture, `crossfeed.read.stages.sampler`); a group of ``k`` leaves
(any inner mixture) is within ``k`` samples of its share — its leaves' errors add up.

Trust: a spec file is input; nesting is at most `MAX_DEPTH` levels (a spec naming itself is
caught there) and a tree at most `MAX_LEAVES` leaves.
"""

from __future__ import annotations

import json
import math
import os
from fractions import Fraction
from typing import Any

from crossfeed.errors import ConfigError
from crossfeed.read.options import Source
from crossfeed.read.schedule import MAX_PHASES, Schedule
from crossfeed.read.stages.sampler import MAX_PERIOD, RAMP_SHARES, ramp_shares

MAX_DEPTH = 8  # levels of nesting (a spec file in a spec file counts as one)
MAX_LEAVES = 256  # leaf sources of one mixture, every level together


def is_group(source: Source) -> bool:
    """Whether ``source`` is a nested mixture (its path a list of sources or a spec file)."""
    return isinstance(source.path, tuple) or is_mixture_spec(source.path)


def flatten(sources) -> tuple[Source, ...]:
    """The leaves of a mixture whose sources may be nested mixtures, weighted as the module
    docstring says; a mixture with no group is returned as it is (its weights untouched)."""
    sources = tuple(sources)
    if not any(is_group(s) for s in sources):
        return sources
    leaves: list[tuple[Source, tuple[int, ...]]] = []  # (leaf, its path of node ids)
    nodes: list[tuple[object, int | None]] = []  # node id → (weight, parent group id or None)
    groups: dict[int | None, list[int]] = {None: []}  # group id → its children's node ids
    _walk(sources, None, 0, "the mixture", leaves, nodes, groups)
    weights = [w for w, _ in nodes]
    scheduled = any(isinstance(w, Schedule) for w in weights)
    pieces: list[list[tuple[int, Any]]] = [w.pieces() if isinstance(w, Schedule) else [(0, w)] for w in weights]
    linear = [isinstance(w, Schedule) and w.kind == "linear" for w in weights]
    bounds = sorted({a for p in pieces for a, _ in p})
    if len(bounds) > MAX_PHASES:
        raise ConfigError(f"a nested mixture's schedules have {len(bounds)} phases, more than {MAX_PHASES}")
    at = [0] * len(nodes)
    per_leaf: list[list[tuple[int, int]]] = [[] for _ in leaves]
    for b in bounds:
        value: list[Fraction] = []
        for i, p in enumerate(pieces):
            while at[i] + 1 < len(p) and p[at[i] + 1][0] <= b:
                at[i] += 1
            value.append(Fraction(p[at[i]][1]).limit_denominator(1000))
        shares, ramp = [], False
        for _leaf, chain in leaves:
            share = Fraction(1)
            for i in chain:
                parent = nodes[i][1]
                total = sum(value[j] for j in groups[parent]) if parent is not None else Fraction(1)
                if parent is not None and total == 0:
                    share = Fraction(0)  # the group weighs 0 here (checked below if it is drawn)
                    break
                share *= value[i] / total if parent is not None else value[i]
            shares.append(share)
            ramp = ramp or (share > 0 and any(linear[i] for i in chain))
        for g, kids in groups.items():
            if g is not None and sum(value[j] for j in kids) == 0 and _drawn(g, value, nodes):
                raise ConfigError(
                    f"at sample {b} every source of a nested mixture is weighted 0 while the group itself "
                    f"weighs {float(value[g]):g}: one of its sources must be drawn (or weigh the group 0 there)"
                )
        ints = _integers(shares, ramp, b)
        for j, w in enumerate(ints):
            if not per_leaf[j] or per_leaf[j][-1][1] != w:
                per_leaf[j].append((b, w))
    out = []
    for (leaf, _), pts in zip(leaves, per_leaf):
        weight: Schedule | int = Schedule("constant", tuple(pts)) if scheduled else pts[0][1]
        out.append(Source(leaf.path, leaf.split, weight, leaf.rename, leaf.features, leaf.storage_options))
    return tuple(out)


def _drawn(g: int, value: list, nodes: list) -> bool:
    """Whether group node ``g`` weighs more than 0 at every level up to the top."""
    i: int | None = g
    while i is not None:
        if value[i] == 0:
            return False
        i = nodes[i][1]
    return True


def _walk(sources, parent: int | None, depth: int, where: str, leaves: list, nodes: list, groups: dict) -> None:
    if depth >= MAX_DEPTH:
        raise ConfigError(f"{where}: mixtures nested more than {MAX_DEPTH} deep (does a spec file name itself?)")
    for k, s in enumerate(sources):
        node = len(nodes)
        nodes.append((s.weight, parent))
        groups[parent].append(node)
        chain = _chain(node, nodes)
        if isinstance(s.path, tuple) or is_mixture_spec(s.path):
            inner: Any
            if isinstance(s.path, tuple):
                inner, here = s.path, f"{where} source {k}"
            else:
                if (s.split, s.rename, s.features, s.storage_options) != ("train", (), None, None):
                    raise ConfigError(f"{s.path}: a nested mixture spec file takes only weight=, not split or rename")
                inner, here = read_spec_file(s.path, depth + 1)[0], os.fspath(s.path)
            groups[node] = []
            _walk(inner, node, depth + 1, here, leaves, nodes, groups)
        else:
            leaves.append((s, chain))
            if len(leaves) > MAX_LEAVES:
                raise ConfigError(f"{where}: a nested mixture of more than {MAX_LEAVES} sources; flatten some groups")


def _chain(node: int, nodes: list) -> tuple[int, ...]:
    """The node ids from the top level down to ``node``."""
    out = []
    i: int | None = node
    while i is not None:
        out.append(i)
        i = nodes[i][1]
    return tuple(reversed(out))


def _integers(shares: list[Fraction], ramp: bool, at: int) -> list[int]:
    """One phase's leaf shares as the lowest integers in their proportions; in a phase where a
    linear schedule weighs, shares of `RAMP_SHARES` when they need more (largest remainders, each
    drawn leaf at least 1); else more than `MAX_PERIOD` is refused."""
    live = [s for s in shares if s > 0]
    if not live:
        raise ConfigError(f"at sample {at} every source of the mixture is weighted 0: one must be drawn")
    scale = math.lcm(*(s.denominator for s in live))
    ints = [int(s * scale) for s in shares]
    g = math.gcd(*ints)
    ints = [i // g for i in ints]
    if ramp and sum(ints) > RAMP_SHARES:
        ints = ramp_shares(shares)
    elif sum(ints) > MAX_PERIOD:
        raise ConfigError(
            f"a nested mixture's weights at sample {at} are too fine-grained: as integers its sources weigh "
            f"{ints}, which sum to {sum(ints)} > {MAX_PERIOD}; round the weights of its groups"
        )
    return ints


# ---- mixture spec files (`crossfeed.read.sources.mixture_file`) ----------------------------------

_KEYS = {"sources", "samples_per_epoch"}
_SOURCE_KEYS = {"path", "split", "weight", "rename", "features"}


def is_mixture_spec(path) -> bool:
    """Whether ``path`` names a mixture spec file (a ``.json`` file, not a dataset folder)."""
    return isinstance(path, (str, os.PathLike)) and str(path).endswith(".json") and os.path.isfile(path)


def read_spec_file(path, depth: int = 0) -> tuple[list[Source], object]:
    """``(sources, samples_per_epoch)`` of the mixture spec file at ``path`` as written (groups
    not flattened; `crossfeed.read.sources.mixture_file`). Nested, its ``samples_per_epoch`` is
    its own when read alone: a group's draws are the outer plan's."""
    spec = _read(path)
    return _sources(path, spec["sources"], depth), spec.get("samples_per_epoch")


MAX_SPEC_BYTES = 1 << 20  # a mixture spec file is input: read no more than this


def _read(path) -> dict:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SPEC_BYTES + 1)
        if len(data) > MAX_SPEC_BYTES:
            raise ValueError(f"more than {MAX_SPEC_BYTES} bytes")
        spec = json.loads(data)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot read the mixture spec ({e})") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("sources"), list) or not spec["sources"]:
        raise ConfigError(f'{path}: a mixture spec is {{"sources": [{{"path": ..., "weight": ...}}, ...]}}')
    if set(spec) - _KEYS:
        raise ConfigError(f"{path}: unknown keys {sorted(set(spec) - _KEYS)}; it may have {sorted(_KEYS)}")
    return spec


def _sources(path, entries: list, depth: int, where: str = "") -> list[Source]:
    if depth >= MAX_DEPTH:
        raise ConfigError(f"{path}: mixtures nested more than {MAX_DEPTH} deep")
    base = os.path.dirname(os.path.abspath(path))
    sources = []
    for i, s in enumerate(entries):
        at = f"{where}source {i}"
        if isinstance(s, dict) and "mixture" in s:  # a nested mixture: {"mixture": [...], "weight": ...}
            if set(s) - {"mixture", "weight"} or not isinstance(s["mixture"], list) or not s["mixture"]:
                raise ConfigError(
                    f'{path}: {at} is a nested mixture {{"mixture": [sources ...], "weight": ...}} and nothing else'
                )
            inner = _sources(path, s["mixture"], depth + 1, f"{at}: ")
            try:
                sources.append(Source(inner, weight=s.get("weight", 1.0)))
            except ConfigError as e:
                raise ConfigError(f"{path}: {at}: {e}") from None
            continue
        if not isinstance(s, dict) or "path" not in s or set(s) - _SOURCE_KEYS:
            raise ConfigError(
                f"{path}: {at} must be an object with 'path' and optionally {sorted(_SOURCE_KEYS - {'path'})}, "
                f'or a nested {{"mixture": [...], "weight": ...}}'
            )
        p = str(s["path"])
        if "://" not in p and not os.path.isabs(p):
            p = os.path.join(base, p)
        try:
            sources.append(Source.from_json({**s, "path": p}))
        except ConfigError as e:
            raise ConfigError(f"{path}: {at}: {e}") from None
    return sources
