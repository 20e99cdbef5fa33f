"""Stage 4 of the read pipeline: transform and batch. `BatchBuilder` makes one batch from its
sample ids — frames and decode (`crossfeed.read.stages.fetch`) → the per-sample transform →
re-stacked samples → ``__index__``/``__source__`` → the batch transform — and times each stage
(for the Loader's `crossfeed.read.metrics.Meter`, and for ``crossfeed bench``).

    ids ──► reader ──► transform (per sample) ──► collate ──► batch_transform ──► dict[str, np.ndarray]
"""

from __future__ import annotations

import time

import numpy as np

from crossfeed.format.schema import INDEX_KEY, SOURCE_KEY
from crossfeed.policy import ErrorBudget
from crossfeed.read.metrics import Meter
from crossfeed.read.stages.decode import collate
from crossfeed.read.stages.fetch import MixtureReader, SourceReader

STAGES = ("read", "decode", "transform", "batch")  # what `BatchBuilder` times, in order


class BatchBuilder:
    """One batch from its sample ids: frames → decode (`SourceReader`, or `MixtureReader`) →
    transform → batch. Runs in an executor thread; shared by the threads.

    Each batch's stages are timed (a clock read per stage, not per sample) and added to ``meter``
    (a `crossfeed.read.metrics.Meter`, with the payload bytes read) when there is one. With
    ``timings`` (a dict), the seconds each stage took are added to it under `STAGES` too:
    ``crossfeed bench`` times the very stages the Loader runs.
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
    ):
        self.reader = reader
        self.meter = meter
        self.transform, self.batch_transform = transform, batch_transform
        self.return_index = return_index
        self.budget = budget
        self.alloc = None  # collate's allocator (None: np.empty); a worker process's puts batches in shared memory

    def __call__(self, indices: np.ndarray, timings: dict[str, float] | None = None) -> dict[str, np.ndarray]:
        tick = _Ticker() if timings is not None or self.meter is not None else None
        batch, kept = self.reader(indices, self.budget, tick)
        indices = indices[kept]
        if self.transform is not None:
            samples = [self.transform({k: v[i] for k, v in batch.items()}) for i in range(len(indices))]
            if tick:
                tick("transform")
            if samples:
                batch = {k: collate([s[k] for s in samples], alloc=self.alloc or np.empty) for k in samples[0]}
            if tick:
                tick("batch")
        if self.return_index:
            if isinstance(self.reader, MixtureReader):
                starts = self.reader.starts
                src = starts[1:-1].searchsorted(indices, side="right")
                batch[SOURCE_KEY] = src
                batch[INDEX_KEY] = indices - starts.take(src)
            else:
                batch[INDEX_KEY] = indices
        if self.batch_transform is not None:
            if tick:
                tick(None)
            batch = self.batch_transform(batch)
            if tick:
                tick("transform")
        if tick:
            if timings is not None:
                for name, ns in tick.ns.items():
                    timings[name] = timings.get(name, 0.0) + ns / 1e9
            if self.meter is not None:
                self.meter.built(tick.ns, tick.bytes)
        return batch


class _Ticker:
    """Adds the nanoseconds since the last tick to ``ns[name]`` (None: not counted); the readers
    add the payload bytes they read to ``bytes``."""

    def __init__(self):
        self.ns: dict[str, int] = {}
        self.bytes = 0
        self.last = time.perf_counter_ns()

    def __call__(self, name: str | None) -> None:
        now = time.perf_counter_ns()
        if name is not None:
            self.ns[name] = self.ns.get(name, 0) + now - self.last
        self.last = now
