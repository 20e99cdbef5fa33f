"""What a plan skips (``skip=``): global step ranges, and sample ids, given inline or in a file.

    Loader(src, batch_size=64, skip=Skip(steps=[(1200, 1300)], samples=[(0, 17), (1, 40213)]))
    Loader(src, batch_size=64, skip="skips.txt")           # the same, one entry a line

* **Steps** ``(start, end)``: the global steps ``start <= step < end`` (half-open, as ``range``) are
  not yielded, on every rank alike. A global step counts a rank's batches from the plan's start:
  ``epoch * steps_per_epoch + step`` under this world size and batch size (``steps_per_epoch``:
  ``len(loader)`` at an epoch's start, without skips) — the number a trainer's step counter shows.
  Token pipelines (``pack=``, ``batch_by_tokens=``), whose epochs may differ in steps, count the
  earlier epochs' steps summed, as `crossfeed.read.replay` does (each epoch's count is a walk of
  its lengths, once per process: `crossfeed.read.stages.recipes.FirstSteps`).
* **Samples** ``(source, index)``: a mixture's source by number (its place in the list) and the
  sample's index within it; a plain index for one dataset. A skipped sample never arrives; the
  rest of the epoch is unchanged (its batch comes out shorter). In a token pipeline a skipped
  sample is a document the packer takes as absent (length 0: never read, no tokens, the rows
  after it pack the following documents; `crossfeed.read.stages.pack.DocLengths`).
* **Refill** (``Skip(samples=…, refill=True)``): the skipped samples are taken out of each
  epoch's order and the rest close up, so every step is full (the epoch is that many samples
  shorter, so it may have fewer steps; equal steps per rank as the remainder policy gives). A
  mixture closes up each source's passes around its skipped samples (`PassOrders`); per-sample
  weights and token pipelines refuse it by name. Positions then count the closed-up order, so refill is part of the stream's identity.

A file holds one entry a line (``#`` comments, blank lines): ``INDEX``, ``SOURCE INDEX`` or
``steps START END`` as text, or JSON lines — an integer, ``[SOURCE, INDEX]``, ``{"source": S,
"index": I}`` or ``{"steps": [START, END]}``; a line ``refill`` (or ``{"refill": true}``) refills. It is read once, strictly (an error names the file and
line), and bounded (`MAX_FILE_BYTES`, `MAX_SAMPLES`, `MAX_STEP_RANGES`). The skip list is part of
the stream's identity (`crossfeed.read.identity`) by content: its step ranges, and the count and
digest of its sorted sample ids.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping

import numpy as np

from crossfeed.errors import ConfigError

MAX_FILE_BYTES = 256 << 20  # a skip file is read whole
MAX_SAMPLES = 10_000_000  # sample ids in one skip list (80 MB as int64 pairs)
MAX_STEP_RANGES = 4096  # step ranges (they go into the stream identity as a list)

__all__ = ["Skip"]


def merge_ranges(ranges) -> tuple[tuple[int, int], ...]:
    """Half-open ranges sorted and merged (overlapping or touching ones become one)."""
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((a, b) for a, b in out)


def _count(v, what: str, where: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
        raise ConfigError(f"{where}: {what} must be a non-negative integer, got {v!r}")
    return int(v)


def _step_range(r, where: str) -> tuple[int, int]:
    if isinstance(r, (str, bytes)) or not hasattr(r, "__len__") or len(r) != 2:
        raise ConfigError(f"{where}: a step range is (start, end), got {r!r}")
    lo, hi = _count(r[0], "a step", where), _count(r[1], "a step", where)
    if hi <= lo:
        raise ConfigError(
            f"{where}: step range ({lo}, {hi}) is empty; it is half-open: (start, end) skips start … end-1"
        )
    return lo, hi


def _sample(v, where: str) -> tuple[int, int]:
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        return 0, _count(v, "a sample index", where)
    if isinstance(v, Mapping) and set(v) == {"source", "index"}:
        return _count(v["source"], "a source", where), _count(v["index"], "a sample index", where)
    if not isinstance(v, (str, bytes, Mapping)) and hasattr(v, "__len__") and len(v) == 2:
        return _count(v[0], "a source", where), _count(v[1], "a sample index", where)
    raise ConfigError(f"{where}: a sample id is INDEX or (SOURCE, INDEX), got {v!r}")


def _pairs(samples) -> np.ndarray:
    """Sample ids as an ``(n, 2)`` int64 array of ``(source, index)``: from a list of ids (`_sample`),
    an array of plain indices (one dataset), or an ``(n, 2)`` array."""
    if samples is None:
        return np.zeros((0, 2), np.int64)
    if isinstance(samples, np.ndarray) and samples.dtype.kind in "iu" and samples.ndim in (1, 2):
        if samples.ndim == 1:
            return np.stack([np.zeros(len(samples), np.int64), samples.astype(np.int64)], axis=1)
        if samples.shape[1] == 2:
            return samples.astype(np.int64)
    if isinstance(samples, (str, bytes, Mapping)) or not hasattr(samples, "__iter__"):
        raise ConfigError(f"skip samples: a list of INDEX or (SOURCE, INDEX), got {samples!r:.80}")
    return np.asarray([_sample(v, "skip samples") for v in samples], dtype=np.int64).reshape(-1, 2)


def _read_file(path: str) -> tuple[list[tuple[int, int]], list[tuple[int, int]], bool]:
    """``(steps, samples, refill)`` of a skip file (module docstring), parsed strictly."""
    try:
        size = os.path.getsize(path)
        if size > MAX_FILE_BYTES:
            raise ConfigError(f"skip file {path} is {size:,} bytes, more than {MAX_FILE_BYTES:,}; split it up")
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"skip file {path}: cannot read it ({e})") from None
    steps: list[tuple[int, int]] = []
    samples: list[tuple[int, int]] = []
    refill = False
    for n, line in enumerate(text.splitlines(), 1):
        where = f"skip file {path}, line {n}"
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if line[0] in "[{":
            try:
                v = json.loads(line)
            except ValueError as e:
                raise ConfigError(f"{where}: not JSON ({e}): {line[:80]!r}") from None
            if isinstance(v, dict) and set(v) == {"steps"}:
                steps.append(_step_range(v["steps"], where))
            elif v == {"refill": True}:
                refill = True
            else:
                samples.append(_sample(v, where))
        else:
            words = line.split()
            if words == ["refill"]:
                refill = True
            elif words[0] == "steps" and len(words) == 3:
                steps.append(_step_range([_int(w, where) for w in words[1:]], where))
            elif len(words) in (1, 2):
                samples.append(
                    _sample([_int(w, where) for w in words] if len(words) == 2 else _int(words[0], where), where)
                )
            else:
                raise ConfigError(
                    f"{where}: expected 'INDEX', 'SOURCE INDEX', 'steps START END' or 'refill', got {line[:80]!r}"
                )
        if len(samples) > MAX_SAMPLES or len(steps) > MAX_STEP_RANGES:
            raise ConfigError(f"{where}: more than {MAX_SAMPLES:,} samples or {MAX_STEP_RANGES} step ranges")
    return steps, samples, refill


def _int(word: str, where: str) -> int:
    try:
        return int(word, 10)
    except ValueError:
        raise ConfigError(f"{where}: {word!r} is not an integer") from None


@dataclasses.dataclass(frozen=True)
class Skip:
    """A skip list (module docstring): ``steps``, merged half-open global step ranges;
    ``samples``, an ``(n, 2)`` int64 array of ``(source, index)``, sorted and unique (compared by
    `digest`). Make one with `of` (or the constructor, which takes lists)."""

    steps: tuple[tuple[int, int], ...] = ()
    samples: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 2), np.int64), compare=False)
    refill: bool = False  # skipped samples leave the order, the rest close up: every step full
    digest: str = dataclasses.field(default="", init=False)

    def __post_init__(self):
        steps = [_step_range(r, "skip steps") for r in self.steps]
        if len(steps) > MAX_STEP_RANGES:
            raise ConfigError(f"skip steps: {len(steps)} ranges, more than {MAX_STEP_RANGES}; merge them")
        object.__setattr__(self, "steps", merge_ranges(steps))
        if not isinstance(self.refill, bool):
            raise ConfigError(f"skip refill: True or False, got {self.refill!r}")
        s = _pairs(self.samples)
        if s.ndim != 2 or s.shape[1] != 2 or s.dtype.kind not in "iu" or (s < 0).any():
            raise ConfigError(f"skip samples: an (n, 2) array of non-negative (source, index), got {s.dtype}{s.shape}")
        if len(s) > MAX_SAMPLES:
            raise ConfigError(f"skip samples: {len(s):,} ids, more than {MAX_SAMPLES:,}")
        s = np.unique(s.astype(np.int64), axis=0) if len(s) else np.zeros((0, 2), np.int64)
        s.setflags(write=False)
        object.__setattr__(self, "samples", s)
        h = hashlib.sha256(np.ascontiguousarray(s, dtype="<i8").tobytes()).hexdigest()[:16]
        object.__setattr__(self, "digest", f"{len(s)} sha256:{h}")

    @classmethod
    def of(cls, value) -> Skip | None:
        """A `Skip` from what ``skip=`` takes: a `Skip`, a path of a skip file, or a mapping with
        any of ``steps`` (ranges), ``samples`` (ids) and ``file`` (a path). None stays None."""
        if value is None or isinstance(value, Skip):
            return value
        if isinstance(value, (str, os.PathLike)):
            value = {"file": os.fspath(value)}
        if not isinstance(value, Mapping) or not set(value) <= {"steps", "samples", "file", "refill"}:
            raise ConfigError(
                "skip= takes a crossfeed.Skip(steps=[(start, end)], samples=[(source, index)], refill=False), a skip "
                f"file's path, or a dict with 'steps', 'samples', 'refill' and/or 'file'; got {value!r:.120}"
            )
        steps, samples = list(value.get("steps") or ()), _pairs(value.get("samples"))
        refill = value.get("refill", False)
        if value.get("file") is not None:
            more_steps, more, file_refill = _read_file(os.fspath(value["file"]))
            steps += more_steps
            samples = np.concatenate([samples, np.asarray(more, dtype=np.int64).reshape(-1, 2)])
            refill = refill or file_refill
        return cls(tuple(steps), samples, refill=refill)

    def __bool__(self) -> bool:
        return bool(self.steps) or len(self.samples) > 0

    def to_json(self) -> dict:
        """``{"steps": [[start, end], …], "samples": [[source, index], …]}`` and ``"refill": true``
        when set (`of` reads it back)."""
        out: dict = {"steps": [list(r) for r in self.steps], "samples": self.samples.tolist()}
        if self.refill:
            out["refill"] = True
        return out

    def ids(self, starts: np.ndarray, where: list[str] | None = None) -> np.ndarray:
        """The skipped samples as sorted global ids: ``starts[source] + index`` (``starts``: each
        source's first global id, and the total at the end). A source or index out of range is
        a ConfigError naming it."""
        starts = np.asarray(starts, dtype=np.int64)
        k = len(starts) - 1
        src, idx = self.samples[:, 0], self.samples[:, 1]
        if len(src) and int(src.max()) >= k:
            bad = int(src[src >= k][0])
            raise ConfigError(f"skip samples: source {bad} does not exist; there are {k} source(s), numbered from 0")
        size = starts[1:] - starts[:-1]
        over = idx >= size[src]
        if over.any():
            s, i = (int(x) for x in self.samples[np.flatnonzero(over)[0]])
            name = f" ({where[s]})" if where else ""
            raise ConfigError(f"skip samples: source {s}{name} has {int(size[s]):,} samples; index {i} is past its end")
        out = np.sort(starts[src] + idx)
        out.setflags(write=False)
        return out
