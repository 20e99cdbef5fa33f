"""Stage 4 of the read pipeline: transform and batch. `BatchBuilder` makes one batch from its
sample ids — frames and decode (`crossfeed.read.stages.fetch`) → the per-sample transform →
re-stacked samples → ``__index__``/``__source__`` → the batch transform — and times each stage
(for the Loader's `crossfeed.read.metrics.Meter`, and for ``crossfeed bench``).

    ids ──► reader ──► transform (per sample) ──► collate ──► batch_transform ──► dict[str, np.ndarray]
"""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter_ns as _clock
from time import thread_time_ns as _cpu

import numpy as np

from crossfeed.errors import ConfigError
from crossfeed.format.schema import INDEX_KEY, SOURCE_KEY
from crossfeed.policy import ErrorBudget
from crossfeed.read.metrics import Meter, Tally
from crossfeed.read.stages.decode import collate
from crossfeed.read.stages.fetch import MixtureReader, SourceReader
from crossfeed.read.stages.recipes import SampleRecipe, SampleRngs, batch_rng, callable_name, epoch_of, step_of

STAGES = ("read", "decode", "transform", "batch")  # what `BatchBuilder` times, in order
_TRANSFORM_ONLY = SampleRecipe(transform=True)  # a builder given no recipe: its transform alone


class BatchBuilder:
    """One batch from its sample ids: frames → decode (`SourceReader`, or `MixtureReader`) →
    transform → batch. Runs in an executor thread; shared by the threads.

    Each batch's stages are timed (a clock read per stage boundary, not per sample) into a
    `crossfeed.read.metrics.Tally` of ``meter`` (a `crossfeed.read.metrics.Meter`), with the
    payload bytes read, when there is one. With ``timings`` (a dict), the seconds each stage took
    are added to it under `STAGES` too: ``crossfeed bench`` times the very stages the Loader runs.
    """

    def __init__(
        self,
        reader: SourceReader | MixtureReader,
        *,
        transform=None,
        batch_transform=None,
        return_index: bool = False,
        budget: ErrorBudget | None = None,
        meter: Meter | None = None,
        recipe: SampleRecipe | None = None,
    ):
        self.reader = reader
        # filters, skipped sample ids, per-sample generators (`crossfeed.read.stages.recipes`)
        self.recipe = recipe if recipe is not None and recipe.active else None
        self.epoch = 0  # the epoch of untagged ids (`recipes.tag`: the per-sample generators' key)
        self._rngs = SampleRngs()
        self._empty: dict | None = None  # a batch of no rows after the transform (`_per_sample`)
        self.meter = meter
        self.transform, self.batch_transform = transform, batch_transform
        self.return_index = return_index
        self.budget = budget
        self.alloc: Callable[..., np.ndarray] | None = (
            None  # collate's allocator (None: np.empty); a worker process's puts batches in shared memory
        )

    def __call__(
        self, indices: np.ndarray, timings: dict[str, float] | None = None, tally: Tally | None = None
    ) -> dict[str, np.ndarray]:
        """The batch of ``indices``, its stages timed into ``tally`` (None: this thread's of the
        meter, if there is one) — or with ``timings``, into a tally of its own, then ``timings``
        and the meter."""
        t = tally
        if t is None:
            if timings is not None:
                return timed_apart(self, indices, timings)
            if self.meter is not None:
                t = self.meter.tally()
        if t is not None:  # each stage boundary below: one clock read, ending a stage and beginning the next
            t.start = t.last = _clock()
        r = self.recipe
        epoch, step = epoch_of(indices, self.epoch), step_of(indices)
        indices = np.asarray(indices)  # a plain array from here (`tag`ged ids are a view)
        if r is not None and r.skip_ids is not None and len(indices):
            indices = indices[r.skip_ids.keep(indices)]  # skipped samples are never read
        batch, kept = self.reader(indices, self.budget, t)
        indices = indices[kept]
        if self.transform is not None or (r is not None and (r.filter is not None or r.rng)):
            batch, indices = self._per_sample(batch, indices, r or _TRANSFORM_ONLY, t, epoch)
        if self.return_index:
            if self.reader.mixture:  # which source, and the index within it
                starts = self.reader.starts
                src = starts[1:-1].searchsorted(indices, side="right")
                batch[SOURCE_KEY] = src
                batch[INDEX_KEY] = indices - starts.take(src)
            else:
                batch[INDEX_KEY] = indices
            if t is not None:  # not a stage: the next one (or the hand-over) starts after it
                t.last = _clock()
        if self.batch_transform is not None:
            cpu = _cpu() if t is not None else 0
            batch = call_batch_transform(self.batch_transform, batch, r, epoch, step)
            if t is not None:
                now = _clock()
                t.transform += now - t.last
                t.cpu_transform += _cpu() - cpu
                if self.transform is None:  # a batch's transforms count once
                    t.n_transform += 1
                    t.ncpu_transform += 1
                t.last = now
        return batch

    def _per_sample(self, batch: dict, indices: np.ndarray, r: SampleRecipe, t: Tally | None, epoch: int):
        """The batch after the filter and the transform, sample by sample (each transform call
        given its sample's generator when it takes one); dropped samples counted. A batch whose
        every sample was dropped keeps its features with no rows (the transform's, once it made one)."""
        cpu = _cpu() if t is not None else 0
        fn, pred, n = self.transform, r.filter, len(indices)
        alone = pred is None and fn is not None  # a transform alone (the common case): one pass
        reset = self._rngs.inline(r.seed, epoch) if r.rng and alone else None
        rng = self._rngs.keyed(r.seed, epoch) if r.rng and reset is None else None
        ids = indices.tolist()
        samples: list = []
        keep: list = []
        if alone:
            items = batch.items()
            if reset is not None:  # each sample's generator reset in the loop (`SampleRngs.inline`)
                gen, state, blank, words, key, whole = reset
                samples = [None] * n
                for i, j in enumerate(ids):
                    state[whole] = blank
                    words[key] = j
                    samples[i] = fn({k: v[i] for k, v in items}, gen)
            elif rng is not None:
                samples = [fn({k: v[i] for k, v in items}, rng(j)) for i, j in enumerate(ids)]
            else:
                samples = [fn({k: v[i] for k, v in items}) for i in range(n)]
            if set(map(type, samples)) <= {dict}:  # every sample kept
                keep = list(range(n))
            else:  # None (dropped), or not a dict: one by one
                made, samples = samples, []
                for i, s in enumerate(made):
                    if s is not None:
                        samples.append(_returned(fn, s, ids[i]))
                        keep.append(i)
        for i in range(n) if pred is not None or fn is None else ():
            s = {k: v[i] for k, v in batch.items()}
            if pred is not None and not pred(s):
                continue
            if fn is not None:
                if rng is not None:
                    s = fn(s, rng(ids[i]))
                else:
                    s = fn(s)
                if s is None:
                    continue
                _returned(fn, s, ids[i])
            samples.append(s)
            keep.append(i)
        if t is not None:
            now = _clock()
            t.transform += now - t.last
            t.n_transform += 1
            t.cpu_transform += _cpu() - cpu
            t.ncpu_transform += 1
            t.last = now
        if r.dropped is not None:
            r.dropped.add(n, n - len(samples))
        if fn is None and len(keep) < n:  # a filter alone: the decoded arrays, less the dropped rows
            take = np.asarray(keep, dtype=np.int64)
            batch = {k: v[take] if isinstance(v, np.ndarray) else [v[j] for j in keep] for k, v in batch.items()}
        elif fn is not None and samples:
            batch = {k: collate([s[k] for s in samples], alloc=self.alloc or np.empty) for k in samples[0]}
            if self._empty is None:  # what a batch of no rows holds: the transform's features (not a view)
                self._empty = {
                    k: np.empty((0, *v.shape[1:]), v.dtype) if isinstance(v, np.ndarray) else []
                    for k, v in batch.items()
                }
        elif fn is not None:  # nothing left: the transform's features, with no rows
            like = self._empty or {k: v[:0] if isinstance(v, np.ndarray) else [] for k, v in batch.items()}
            batch = {k: v.copy() if isinstance(v, np.ndarray) else [] for k, v in like.items()}
        if t is not None:
            now = _clock()
            t.batch += now - t.last
            t.n_batch += 1
            t.last = now
        return batch, indices[np.asarray(keep, dtype=np.int64)] if len(keep) < n else indices


def call_batch_transform(fn, batch: dict, r: SampleRecipe | None, epoch: int, step: int) -> dict:
    """``fn(batch)``, or — a batch transform taking ``rng`` (``r.batch_rng``) — ``fn(batch, rng)``
    with the batch's generator (`crossfeed.read.stages.recipes.batch_rng` of its epoch and global
    step: the ids' `crossfeed.read.stages.recipes.tag`); a batch without a step is refused."""
    if r is None or not r.batch_rng:
        return fn(batch)
    if step < 0:
        raise ConfigError(
            f"the batch_transform {callable_name(fn)} takes rng, a generator keyed by the batch's global step, "
            f"but this batch was built without its step; build batches by iterating the Loader (or "
            f"Loader.samples_at(step, built=True)), or make the transform take the batch alone"
        )
    return fn(batch, batch_rng(r.seed, epoch, step, r.rank))


def _returned(fn, s, sample: int) -> dict:
    """A transform's sample, refused by name unless a dict."""
    if not isinstance(s, dict):
        raise ConfigError(
            f"the transform {callable_name(fn)} returned a {type(s).__name__} for sample {sample}; "
            f"it must return the sample's dict (or None to drop it)"
        )
    return s


def timed_apart(build, ids, timings: dict[str, float]) -> dict[str, np.ndarray]:
    """``build(ids)`` timed into a tally of its own: its stage seconds added to ``timings``
    (``crossfeed bench``), and the tally to the builder's meter."""
    t = Tally()
    batch = build(ids, None, t)
    for name, s in t.seconds().items():
        timings[name] = timings.get(name, 0.0) + s
    if build.meter is not None:
        build.meter.add(t)
    return batch
