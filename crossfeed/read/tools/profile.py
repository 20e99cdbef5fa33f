"""Is the input pipeline the bottleneck? Measure a `Loader` the way a trainer reads it.

`bench_loader` makes two passes over the same split, with the caller's `LoaderOptions`:

1. **End to end**: the Loader delivers ``batches`` batches; gives samples/s, MB/s of records
   read, time to first batch (from opening the dataset) and the peak RSS of the process.
2. **Stage by stage**: the same batches built again on one thread by the Loader's own
   pipeline (`Pipeline.build_batch`) — the very stages the Loader runs — each stage timed on its own: ``read``
   (locate records, mmap / range reads, every header and payload CRC), ``decode`` (payloads →
   arrays, images included), ``transform`` (the per-sample ``transform`` and
   ``batch_transform``) and ``batch`` (re-stacking samples after a per-sample transform).
   Their sum is the CPU cost of a batch on one core.

The first pass's own stage metrics (`crossfeed.read.metrics`: as run, on the Loader's threads or
processes) and their verdict — which stage a trainer would wait on — close the report.

No timing here is asserted anywhere; the numbers are for people.
"""

from __future__ import annotations

import itertools
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from crossfeed.errors import ConfigError
from crossfeed.read.loader import Loader
from crossfeed.read.metrics import Stats
from crossfeed.read.options import LoaderOptions
from crossfeed.read.pipeline import Pipeline
from crossfeed.read.stages.batch import STAGES


@dataclass(frozen=True)
class StageTimes:
    """Seconds spent per stage over ``batches`` batches of ``samples`` samples, on one thread."""

    seconds: dict[str, float]
    batches: int
    samples: int

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.total if self.total > 0 else float("inf")


@dataclass(frozen=True)
class BenchReport:
    """What `bench_loader` measured."""

    split: str
    batch_size: int
    shuffle: str
    threads: int
    batches: int
    samples: int
    seconds: float  # end to end, first batch to last (time to first batch excluded)
    first_batch_s: float  # from opening the dataset to the first batch
    record_bytes: int  # framed record bytes of the delivered samples
    peak_rss: int  # bytes, of the whole process
    stages: StageTimes
    notes: list[str] = field(default_factory=list)
    paths: dict = field(default_factory=dict)  # `Loader.paths()`: which fast paths served the batches
    stats: Stats | None = None  # the end-to-end pass's `Loader.stats()`
    # token datasets (lengths files, or pack=/batch_by_tokens=): (feature, tokens delivered, of them
    # in the first batch) — real tokens, padding not counted; None for other datasets
    tokens: tuple[str, int, int] | None = None

    @property
    def samples_per_s(self) -> float:
        # the first batch's samples are not in ``seconds``
        timed = self.samples - self.samples / max(self.batches, 1)
        return timed / self.seconds if self.seconds > 0 else float("inf")

    @property
    def tokens_per_s(self) -> float | None:
        """Real tokens (padding not counted) per second, end to end; None for other datasets."""
        if self.tokens is None:
            return None
        _, total, first = self.tokens
        return (total - first) / self.seconds if self.seconds > 0 else float("inf")

    @property
    def mb_per_s(self) -> float:
        return self.record_bytes / 1e6 * self.samples_per_s / max(self.samples, 1)

    def lines(self) -> list[str]:
        """The report as text lines (what ``crossfeed bench`` prints)."""
        st = self.stages
        out = [
            f"split {self.split}: {self.batches} batches of {self.batch_size} ({self.samples:,} samples), "
            f"shuffle {self.shuffle}, {self.threads} threads",
            f"throughput      {self.samples_per_s:>12,.0f} samples/s   {self.mb_per_s:>9,.1f} MB/s of records",
            *(
                [
                    f"tokens          {self.tokens_per_s:>12,.0f} tokens/s    of {self.tokens[0]!r} ({self.tokens[1]:,} "
                    f"tokens, padding not counted)"
                ]
                if self.tokens is not None
                else []
            ),
            f"first batch     {self.first_batch_s:>12.3f} s (opening the dataset included)",
            f"peak RSS        {self.peak_rss / 2**20:>12,.0f} MiB (process; mmap'd shard pages count while touched)",
            f"where the time goes (one thread, {st.batches} batches, {st.samples_per_s:,.0f} samples/s):",
        ]
        for name in STAGES:
            s = st.seconds.get(name, 0.0)
            share = s / st.total if st.total > 0 else 0.0
            per = s / max(st.samples, 1) * 1e6
            out.append(
                f"  {name:10s} {s * 1e3 / max(st.batches, 1):>10.2f} ms/batch {per:>10.2f} µs/sample {share:>7.1%}"
            )
        out.append(
            f"the pipeline keeps up with a trainer that needs up to {self.samples_per_s:,.0f} samples/s "
            f"({self.samples_per_s / self.batch_size:,.1f} steps/s at batch {self.batch_size}); a faster "
            f"trainer waits on input"
        )
        for stage, served in self.paths.items():
            if served:
                out.append(f"{stage} paths     " + ", ".join(f"{k} ×{v}" for k, v in sorted(served.items())))
        if self.stats is not None:
            out.append(f"as run          {self.stats.line(verdict=False)}")
            out.append(
                f"verdict         {self.stats.verdict()} (bench's consumer only counts, so it always waits: "
                f"the stage named is the one a trainer would wait on)"
            )
        out += self.notes
        return out


def _peak_rss() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def bench_loader(
    source,
    options: LoaderOptions,
    *,
    batches: int = 50,
    transform: Callable[[dict], dict] | None = None,
    batch_transform: Callable[[dict], dict] | None = None,
    stage_batches: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> BenchReport:
    """Measure reading ``batches`` batches (see the module docstring); ``stage_batches``
    (default: ``min(batches, 20)``) batches are built again one stage at a time. ``progress(done,
    total)`` is called after each batch read end to end."""
    if batches < 1:
        raise ConfigError(f"batches must be >= 1, got {batches}")
    t0 = time.perf_counter()
    with Loader(source, options, transform=transform, batch_transform=batch_transform) as loader:
        plan = loader.plan()  # the iteration below does not finish the epoch: the same plan
        first_s, done, samples, t1 = None, 0, 0, t0
        counted = _token_feature(loader)
        tokens = first_tokens = 0
        for batch in loader:
            if counted is not None:
                tokens += _tokens(batch, counted)
            if first_s is None:
                t1 = time.perf_counter()
                first_s = t1 - t0
                first_tokens = tokens
            samples += _batch_len(batch)
            done += 1
            if progress is not None:
                progress(done, batches)
            if done >= batches:
                break
        seconds = time.perf_counter() - t1
        stats = loader.stats()  # before the stage pass below, which runs the same builder again
        if plan.random_access:  # the records of the batches delivered (`Plan.batch`)
            ids: Any = plan
            delivered = (
                np.concatenate([ids.batch(b) for b in ids.batch_ids()[:done]]) if done else np.zeros(0, np.int64)
            )
            nbytes = loader.pipeline.record_bytes(delivered)
        else:  # packed rows: pieces of documents, the payload bytes the Loader read for them
            nbytes = stats.bytes
        stages = _stage_times(loader.pipeline, plan, stage_batches or min(batches, 20))
        paths = loader.paths()
        notes = []
        if done < batches:
            notes.append(f"note: the split has only {done} batches; asked for {batches}")
        if loader.dataset.storage.remote:
            notes.append("note: remote data — 'read' includes network transfers")
    read = options.read
    return BenchReport(
        options.split,
        options.batch_size,
        options.plan.shuffle.value,
        read.num_threads,
        done,
        samples,
        seconds,
        first_s or 0.0,
        nbytes,
        _peak_rss(),
        stages,
        notes,
        paths,
        stats,
        None if counted is None else (counted, tokens, first_tokens),
    )


def _token_feature(loader: Loader) -> str | None:
    """The feature whose tokens bench counts: the first lengths feature of a token dataset (its
    manifest's ``lengths``, or the packed features), when the batches hold it."""
    plan = loader.options.plan
    names = [f.name for f in loader.features]
    candidates = list(plan.pack.features or ()) if plan.pack is not None and plan.pack.features else []
    for ds in loader.datasets:
        candidates += list(ds.manifest.lengths or ())
    return next((n for n in candidates if n in names), None)


def _tokens(batch: dict, name: str) -> int:
    """Real tokens of ``name`` in a batch: where ``segment_ids`` mark them (packed rows, token
    budgets), else every value of every sample."""
    seg = batch.get("segment_ids")
    if isinstance(seg, np.ndarray):
        return int(np.count_nonzero(seg))
    v = batch[name]
    if isinstance(v, np.ndarray) and v.dtype != object:
        return int(v.size)
    return int(sum(np.size(x) for x in v))


def _batch_len(batch: dict) -> int:
    for v in batch.values():
        return len(v)
    return 0


def _stage_times(pipeline: Pipeline, plan, n: int) -> StageTimes:
    """Build ``n`` of the plan's batches on this thread with the Loader's own pipeline, timing each stage."""
    secs = dict.fromkeys(STAGES, 0.0)
    done = samples = 0
    for indices in itertools.islice(plan, n):
        batch = pipeline.build_batch(indices, timings=secs)
        done += 1
        samples += _batch_len(batch)
    return StageTimes(secs, done, samples)
