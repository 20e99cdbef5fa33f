"""Mixture schedules: a source's weight that changes over training (docs/read-and-mix.md,
"Mixture schedules").

    Source("web/", weight=Schedule.constant([(0, 3), (900_000, 1)]))     # phases: 3, then 1
    Source("hq/", weight=Schedule.constant([(0, 1), (900_000, 3)]))
    Source("code/", weight=Schedule.linear([(0, 0), (500_000, 2)], every=10_000))  # a ramp, in steps

The unit is the plan's: **samples of the mixture consumed since training began** — the global
position ``epoch × samples_per_epoch + position`` that a Loader's state holds. A step is
``batch_size × world_size`` samples (while an epoch is a whole number of steps): give boundaries
in steps with ``per_step=`` that global batch, and they are kept as samples (so the batch size
may still change on resume). A weight may be 0 in a phase: the source is not drawn there (new
data brought in from a step onward); every phase needs one positive weight over the mixture.

``constant``: ``[(0, w0), (b1, w1), …]`` — weight ``w_i`` from sample ``b_i`` until the next
boundary (the last one holds for ever). ``linear``: the same points, linearly interpolated between
them and held at the last one; the plan stays on integers by evaluating the line as a step
function, one step (a phase) per ``every`` samples, each at the line's value at its start (and
the last point's value from the last point on; a phase's weights that would need more than 1000
as integers are rounded to shares of 1000). A mixture's phases (every source's boundaries
together; `crossfeed.read.stages.sampler.mixture_phases`) are each planned as a mixture of their
own from their start: every prefix of every phase holds each source within one sample of its share.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from crossfeed.errors import ConfigError

KINDS = ("constant", "linear")
MAX_POINTS = 4096  # points of one schedule (a nested mixture's leaf may hold a phase for every boundary)
MAX_PHASES = 4096  # phases of a mixture, every source's together (a linear ramp: one per ``every``)
MAX_SAMPLE = 1 << 62  # a boundary (and ``every``): the plan counts samples since the start on int64


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A source's weight over the samples consumed (see the module docstring). Make one with
    `constant` or `linear`; ``points``: ``((sample, weight), …)``, the first at sample 0."""

    kind: str
    points: tuple[tuple[int, float], ...]
    every: int = 0  # linear: samples per step of the evaluated line (0 for constant)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConfigError(f"a schedule is 'constant' or 'linear', got {self.kind!r}")
        pts = self.points
        if isinstance(pts, (str, bytes)) or not isinstance(pts, Sequence) or not pts or len(pts) > MAX_POINTS:
            raise ConfigError(
                f"a {self.kind} schedule is a list of 1 to {MAX_POINTS} (sample, weight) points, got {_short(pts)}"
            )
        out = []
        for p in pts:
            if isinstance(p, (str, bytes)) or not isinstance(p, Sequence) or len(p) != 2:
                raise ConfigError(f"a schedule point is a (sample, weight) pair, got {_short(p)}")
            at, w = p
            if isinstance(at, bool) or not isinstance(at, int) or not 0 <= at < MAX_SAMPLE:
                raise ConfigError(
                    f"a schedule point's sample must be an integer in [0, 2^62), got {_short(at)} (in {_short(pts)})"
                )
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w < float("inf"):
                raise ConfigError(f"a schedule weight must be a number >= 0, got {w!r} (in {_short(pts)})")
            out.append((int(at), float(w) if isinstance(w, float) else int(w)))
        if out[0][0] != 0:
            raise ConfigError(f"a schedule starts at sample 0, its first point is at {out[0][0]} (in {_short(pts)})")
        starts = [a for a, _ in out]
        if any(b <= a for a, b in zip(starts, starts[1:])):
            raise ConfigError(f"a schedule's points must be at increasing samples, got {starts}")
        object.__setattr__(self, "points", tuple(out))
        if self.kind == "linear":
            if isinstance(self.every, bool) or not isinstance(self.every, int) or not 1 <= self.every < MAX_SAMPLE:
                raise ConfigError(
                    f"a linear schedule needs every= a positive number of samples below 2^62, got {_short(self.every)}"
                )
        elif self.every != 0:
            raise ConfigError("every= is a linear schedule's; a constant one changes only at its points")

    @classmethod
    def constant(cls, points, *, per_step: int = 1) -> Schedule:
        """Piecewise constant: ``[(0, w0), (b1, w1), …]``; ``per_step``: the boundaries are
        steps of this many samples (the global batch, ``batch_size × world_size``)."""
        return cls("constant", _scaled(points, per_step))

    @classmethod
    def linear(cls, points, *, every: int, per_step: int = 1) -> Schedule:
        """Piecewise linear through ``[(0, w0), (b1, w1), …]``, evaluated as a step function of
        ``every`` samples (or steps, with ``per_step``) per step (see the module docstring)."""
        return cls("linear", _scaled(points, per_step), _positive(every, "every") * _positive(per_step, "per_step"))

    def pieces(self) -> list[tuple[int, float]]:
        """The schedule as piecewise-constant ``(start sample, weight)`` pieces, the first at 0."""
        if self.kind == "constant":
            return list(self.points)
        out: list[tuple[int, float]] = []
        for (a, wa), (b, wb) in zip(self.points, self.points[1:]):
            for x in range(a, b, self.every):
                v = wa + (wb - wa) * (x - a) / (b - a)
                if not math.isfinite(v):  # (wb - wa) * (x - a) overflowed: the same line, divided first
                    v = wa + (wb - wa) * ((x - a) / (b - a))
                out.append((x, v))
                if len(out) > MAX_PHASES:
                    raise ConfigError(
                        f"a linear schedule of {self.points[-1][0]} samples in steps of every={self.every} has more "
                        f"than {MAX_PHASES} phases; make every= larger"
                    )
        out.append(self.points[-1])
        return out

    def to_json(self) -> dict:
        """As a mixture file writes it: ``{"constant": [[0, 3], [1000, 1]]}`` or
        ``{"linear": [[0, 1], [1000, 3]], "every": 100}`` (samples)."""
        pts = [list(p) for p in self.points]
        return {"constant": pts} if self.kind == "constant" else {"linear": pts, "every": self.every}

    @classmethod
    def from_json(cls, d, where: str = "a schedule") -> Schedule:
        if not isinstance(d, Mapping) or not (set(d) == {"constant"} or set(d) == {"linear", "every"}):
            raise ConfigError(
                f'{where} is {{"constant": [[sample, weight], ...]}} or '
                f'{{"linear": [[sample, weight], ...], "every": samples}}, got {_short(d)}'
            )
        kind = "constant" if "constant" in d else "linear"
        pts = d[kind]
        if not isinstance(pts, list) or not all(isinstance(p, list) for p in pts):
            raise ConfigError(f"{where}: its points are a list of [sample, weight] pairs, got {_short(pts)}")
        return cls(kind, tuple(tuple(p) for p in pts), d.get("every", 0))

    def identity(self) -> list:
        """The schedule as a stream identity's setting (`crossfeed.read.identity`)."""
        return [self.kind, self.every, [list(p) for p in self.points]]

    @classmethod
    def from_identity(cls, v) -> Schedule:
        kind, every, pts = v
        return cls(kind, tuple(tuple(p) for p in pts), every)


def _positive(n, name: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"{name}= must be a positive integer, got {n!r}")
    return n


def _scaled(points, per_step: int) -> tuple:
    per_step = _positive(per_step, "per_step")
    if isinstance(points, (str, bytes)) or not isinstance(points, Sequence):
        raise ConfigError(f"a schedule is a list of (step, weight) points, got {_short(points)}")
    out = []
    for p in points:
        if isinstance(p, Sequence) and len(p) == 2 and isinstance(p[0], int) and not isinstance(p[0], bool):
            out.append((p[0] * per_step, p[1]))
        else:
            out.append(p)  # refused by name in __post_init__
    return tuple(out)


def _short(v, n: int = 80) -> str:
    text = repr(v)
    return text if len(text) <= n else text[: n - 1] + "…"
