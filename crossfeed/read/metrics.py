"""Stage metrics of a Loader, always on: where the time goes, and whether the trainer waits.

Every batch is timed stage by stage with ``time.perf_counter_ns`` — one clock read per stage
boundary (it ends one stage and begins the next), never per sample — into a `Tally` of the
Loader's `Meter`: plain int slots, one tally per writing thread, no lock and no dict per batch,
summed when ``stats()`` asks. The counters are cumulative over the Loader's life (like
Prometheus counters). ``Loader.stats()`` returns them as a frozen `Stats`;
``stats.since(earlier)`` is the difference of two, ``stats.verdict()`` the `Verdict`.

    plan ──► read ──► decode ──► transform ──► batch ──► handover ──► consumer
    (sampler) (frames, (payloads (transform,   (collate  (built batch    wait: asking for a batch
               cache)   → arrays) batch_transform) samples) → consumer)    until it came; consumer:
                                                                         its own time between batches

Stages run where the executor runs them: on worker threads (their seconds summed over the
threads), or in worker processes, which send each batch's stage times back with the batch
(`Meter.drain` there, `Meter.merge` here). The transform stage also counts the CPU time its
thread spent (``time.thread_time_ns``, two reads a batch): a transform that waits (sleeps, I/O,
the GIL released) is told from one that computes, and the verdict's advice follows — more
threads for the first, worker processes for the second. ``wait_ratio = wait / (wait + consumer)``: the share
of the consumer's time spent waiting for input.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import TypeGuard

from crossfeed.errors import ConfigError

STAGES = ("plan", "read", "decode", "transform", "batch", "handover")
BUILD = STAGES[:-1]  # the stages that make a batch (the verdict's "build time"; handover delivers it)
INPUT_BOUND = 0.10  # a consumer waiting this share of its time or more is input-bound
CPU_STAGES = ("transform",)  # the stages whose thread CPU time is counted too (`StageStat.cpu_seconds`)
# a stage on the CPU less than this share of its time mostly waits (sleep, I/O). Threads share one
# GIL: n threads that compute in Python are each on the CPU about 1/n of their time, so a thread's
# share is scaled by the threads first (`Stats.busy`).
WAITING = 0.15

# The overhead benchmark's switch (benchmarks/bench_stats_overhead.py) and nothing else's: a Loader
# made while it is False times nothing, running the code paths it ran before metrics existed.
ENABLED = True


@dataclasses.dataclass(frozen=True)
class StageStat:
    """Seconds a stage took (summed over the threads or processes that ran it) and how many times
    it ran (batches; per source of a mixture whose sources are read apart); ``cpu_seconds``: the
    CPU time its threads spent in it (`CPU_STAGES` only, and only when every run of it was
    measured; None: not known)."""

    seconds: float = 0.0
    count: int = 0
    cpu_seconds: float | None = None

    def __post_init__(self):
        if self.seconds < 0 or self.count < 0 or (self.cpu_seconds is not None and self.cpu_seconds < 0):
            raise ConfigError(f"a stage's seconds and count are >= 0, got {self.seconds}, {self.count}")

    @property
    def cpu_share(self) -> float | None:
        """CPU time over wall time (None: not measured, or no time): near 1 computing, near 0 waiting."""
        if self.cpu_seconds is None or self.seconds <= 0:
            return None
        return min(1.0, self.cpu_seconds / self.seconds)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Is the consumer waiting on input, and which stage to look at. ``str(verdict)`` says it in
    a sentence: "input-bound: the trainer waited 38% of the time; decode takes 71% of build time
    on 2 threads; try …" or "not input-bound: the trainer waited 2% of the time"."""

    input_bound: bool
    wait_ratio: float
    bottleneck: str | None  # the build stage that took the most time (None: none was timed)
    share: float  # its share of the build time
    advice: str
    workers: str = ""  # where the batches were built: "2 threads", "4 worker processes" …

    def __post_init__(self):
        if not 0.0 <= self.wait_ratio <= 1.0 or not 0.0 <= self.share <= 1.0:
            raise ConfigError(f"wait_ratio and share are fractions, got {self.wait_ratio}, {self.share}")
        if self.bottleneck is not None and self.bottleneck not in BUILD:
            raise ConfigError(f"bottleneck must be one of {BUILD} or None, got {self.bottleneck!r}")

    def __str__(self) -> str:
        waited = f"the trainer waited {self.wait_ratio:.0%} of the time"
        if not self.input_bound:
            return f"not input-bound: {waited}"
        out = f"input-bound: {waited}"
        if self.bottleneck is not None:
            out += f"; {self.bottleneck} takes {self.share:.0%} of build time on {self.workers}"
        return f"{out}; {self.advice}" if self.advice else out


@dataclasses.dataclass(frozen=True)
class Stats:
    """A Loader's counters (cumulative since it was made; `since` for an interval).

    ``batches``/``samples``: delivered to the consumer; ``bytes``: record payload bytes the read
    stage read (prefetched batches included); ``stages``: `StageStat` per name of `STAGES`;
    ``wait_seconds``: the consumer's time between asking for a batch and getting it;
    ``consumer_seconds``: its own time between batches; ``elapsed_seconds``: wall time since the
    Loader was made; ``threads``/``processes``: what built the batches (0 threads and 0
    processes: the consumer's own thread); ``cache_*``: shard cache opens served from the cache,
    downloads, and bytes downloaded; ``epochs``: epochs iterated to their end."""

    batches: int = 0
    samples: int = 0
    bytes: int = 0
    stages: Mapping[str, StageStat] = dataclasses.field(default_factory=dict)
    wait_seconds: float = 0.0
    consumer_seconds: float = 0.0
    elapsed_seconds: float = 0.0
    threads: int = 0
    processes: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    cache_bytes: int = 0
    epochs: int = 0

    def __post_init__(self):
        unknown = set(self.stages) - set(STAGES)
        if unknown:
            raise ConfigError(f"unknown stages {sorted(unknown)}; the stages are {STAGES}")
        full = {s: self.stages.get(s, StageStat()) for s in STAGES}
        object.__setattr__(self, "stages", MappingProxyType(full))

    @property
    def wait_ratio(self) -> float:
        """wait / (wait + consumer): the share of the consumer's time spent waiting for batches."""
        total = self.wait_seconds + self.consumer_seconds
        return min(1.0, max(0.0, self.wait_seconds / total)) if total > 0 else 0.0

    @property
    def build_seconds(self) -> float:
        return sum(self.stages[s].seconds for s in BUILD)

    def since(self, previous: Stats) -> Stats:
        """The counters of the interval from ``previous`` (an earlier `stats()` of the same
        Loader) to this one; ``threads``/``processes`` are this one's."""
        if not isinstance(previous, Stats):
            raise ConfigError(f"since() takes an earlier Stats, got {type(previous).__name__}")
        stages = {
            s: StageStat(
                max(0.0, self.stages[s].seconds - previous.stages[s].seconds),
                max(0, self.stages[s].count - previous.stages[s].count),
                _cpu_sum([self.stages[s], previous.stages[s]], sign=-1),
            )
            for s in STAGES
        }
        diff = {
            f.name: max(type(v)(0), v - getattr(previous, f.name))
            for f in dataclasses.fields(self)
            if f.name not in ("stages", "threads", "processes")
            for v in [getattr(self, f.name)]
        }
        return Stats(**diff, stages=stages, threads=self.threads, processes=self.processes)

    def as_dict(self) -> dict[str, float | int]:
        """Flat and JSON-able, with stable keys (what an exporter publishes): every field,
        ``stage_<name>_seconds``/``stage_<name>_count`` per stage, and ``wait_ratio``."""
        out: dict[str, float | int] = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "stages"
        }
        for s in STAGES:
            out[f"stage_{s}_seconds"] = self.stages[s].seconds
            out[f"stage_{s}_count"] = self.stages[s].count
        out["wait_ratio"] = self.wait_ratio
        return out

    def workers(self) -> str:
        """Where the batches were built, in words."""
        if self.processes:
            return f"{self.processes} worker process{'es' if self.processes != 1 else ''}"
        if self.threads:
            return f"{self.threads} thread{'s' if self.threads != 1 else ''}"
        return "the consumer's thread"

    def busy(self, stage: str) -> float | None:
        """How much of ``stage``'s time was computing (None: not measured): its CPU share, times
        the threads that shared one GIL (a GIL-bound stage on n threads is on the CPU ~1/n of its
        time per thread), at most 1. Below `WAITING`: the stage mostly waited."""
        share = self.stages[stage].cpu_share
        if share is None:
            return None
        return min(1.0, share * (1 if self.processes else max(self.threads, 1)))

    def verdict(self) -> Verdict:
        """Input-bound (the consumer waited `INPUT_BOUND` of its time or more) or not, the build
        stage that took the most time, and what to try."""
        build = self.build_seconds
        bottleneck = max(BUILD, key=lambda s: self.stages[s].seconds) if build > 0 else None
        share = min(1.0, self.stages[bottleneck].seconds / build) if bottleneck else 0.0
        ratio = self.wait_ratio
        bound = ratio >= INPUT_BOUND
        advice = _advice(bottleneck, self) if bound else "the input keeps up: the time is the consumer's own"
        return Verdict(bound, ratio, bottleneck, share, advice, self.workers())

    def line(self, *, verdict: bool = True) -> str:
        """One line for a log: batches, rate, wait, each build stage's share (and the verdict)."""
        build = self.build_seconds
        shares = " ".join(
            f"{s} {self.stages[s].seconds / build:.0%}" for s in BUILD if build > 0 and self.stages[s].count
        )
        busy = self.wait_seconds + self.consumer_seconds  # the consumer's time with the Loader
        rate = self.samples / busy if busy > 0 else 0.0
        per = self.stages["handover"].seconds / max(self.stages["handover"].count, 1) * 1e3
        out = (
            f"{self.batches} batches ({self.samples} samples, {self.bytes / 1e6:.1f} MB) in "
            f"{busy:.2f} s, {rate:,.0f} samples/s; waited {self.wait_seconds:.2f} s "
            f"({self.wait_ratio:.0%}); build {build:.2f} s on {self.workers()}: {shares or '-'}; "
            f"handover {per:.2f} ms/batch"
        )
        if self.cache_hits or self.cache_misses:
            out += f"; cache {self.cache_hits} hits, {self.cache_misses} misses ({self.cache_bytes / 1e6:.1f} MB)"
        return f"{out}; {self.verdict()}" if verdict else out


def _cpu_sum(stats, sign: int = 1) -> float | None:
    """The sum of the `StageStat`\ s' CPU seconds (``sign=-1``: the first less the rest), None when
    any that ran is unknown (one that never ran counts 0)."""
    values = [0.0 if st.count == 0 and st.cpu_seconds is None else st.cpu_seconds for st in stats]
    if any(v is None for v in values) or not any(st.count for st in stats):
        return None
    first, *rest = values
    return max(0.0, first + sign * sum(rest))


def _advice(stage: str | None, st: Stats) -> str:
    more = "more processes, or more serve processes" if st.processes else "executor='process' or more num_threads"
    if stage == "decode":
        return f"try {more}"
    if stage == "transform":
        cpu = st.stages["transform"].cpu_share
        # a transform that waits (sleep, I/O: the GIL released): more threads overlap the waits
        busy = st.busy("transform")
        if cpu is not None and busy is not None and busy < WAITING:
            more = f"processes (now {st.processes})" if st.processes else f"num_threads (now {st.threads})"
            return (
                f"the transform waits most of its time (on the CPU {cpu:.0%} of it: sleep or I/O, the GIL "
                f"released): try more {more} and more prefetch"
            )
        if st.processes:
            return "try more processes, more serve processes, or a vectorised batch_transform"
        return "Python transforms hold the GIL: try executor='process' or more serve processes"
    if stage == "batch":
        return "re-stacking per-sample transform outputs: a batch_transform on the whole batch avoids it"
    if stage == "read":
        if st.cache_misses:
            return f"reading records ({st.cache_misses} shard downloads): a warm cache_dir, more prefetch or shuffle='block'"
        return f"reading records: shuffle='block' for sequential reads, more prefetch, or {more}"
    if stage == "plan":
        return "planning the batches: shuffle='block' or larger batches"
    return "no build stage was timed here (DataLoader workers or servers build the batches: log_stats=True logs theirs)"


def combine(parts: Iterable[Stats]) -> Stats:
    """The sum of several Loaders' stats (one process's DataLoader-worker Loaders, say): counters
    added, the longest ``elapsed_seconds``, the most threads and processes."""
    parts = list(parts)
    if not parts:
        return Stats()
    stages = {
        s: StageStat(
            sum(p.stages[s].seconds for p in parts),
            sum(p.stages[s].count for p in parts),
            _cpu_sum([p.stages[s] for p in parts]),
        )
        for s in STAGES
    }
    summed = {
        f.name: sum(getattr(p, f.name) for p in parts)
        for f in dataclasses.fields(Stats)
        if f.name not in ("stages", "elapsed_seconds", "threads", "processes")
    }
    return Stats(
        **summed,
        stages=stages,
        elapsed_seconds=max(p.elapsed_seconds for p in parts),
        threads=max(p.threads for p in parts),
        processes=max(p.processes for p in parts),
    )


_CLOCK = time.perf_counter_ns
CPU_CLOCK = time.thread_time_ns  # this thread's CPU time
# a Tally's slots: nanoseconds per stage, a count per stage (`_N`), the CPU nanoseconds of the
# `CPU_STAGES` and how many of their runs were measured (`_CPU`, `_NCPU`), the other counters, and
# two scratch stamps of the batch being built (when it began, and when its last stage ended)
_N = {s: f"n_{s}" for s in STAGES}
_CPU = {s: f"cpu_{s}" for s in CPU_STAGES}
_NCPU = {s: f"ncpu_{s}" for s in CPU_STAGES}
_SUMS = (
    *STAGES,
    *_N.values(),
    *_CPU.values(),
    *_NCPU.values(),
    "bytes",
    "batches",
    "samples",
    "wait",
    "consumer",
    "epochs",
)


class Tally:
    """One writer's counters: plain ints, added to without a lock by whoever owns it — a thread
    that builds batches (`Meter.tally`: one per thread), or the consumer's iteration of the Loader
    (`Meter.own`: one iteration at a time) — and summed by `Meter.stats` when asked (an int slot
    is read whole; a read while a batch is being built sees that batch in part).

    The hot path shares its clock reads: each stage boundary is one ``perf_counter_ns`` that ends
    one stage and begins the next (``last``); ``start`` is when the current batch's build began.
    Stage ``s`` adds to the slots ``s`` (ns) and ``n_s`` (count); ``wait``/``consumer`` are ns."""

    __slots__ = (*_SUMS, "start", "last")
    # the slots, spelled out for the type checker (`_SUMS` builds them)
    plan: int
    read: int
    decode: int
    transform: int
    batch: int
    handover: int
    n_plan: int
    n_read: int
    n_decode: int
    n_transform: int
    n_batch: int
    n_handover: int
    bytes: int
    batches: int
    samples: int
    wait: int
    consumer: int
    epochs: int
    cpu_transform: int
    ncpu_transform: int
    start: int
    last: int

    def __init__(self) -> None:
        for k in self.__slots__:
            setattr(self, k, 0)

    @classmethod
    def started(cls) -> Tally:
        t = cls()
        t.start = t.last = _CLOCK()
        return t

    def tick(self, stage: str) -> None:
        """End stage ``stage`` now (the time since ``last``), counted once more (the slow,
        general form of what the hot path writes inline)."""
        now = _CLOCK()
        setattr(self, stage, getattr(self, stage) + now - self.last)
        setattr(self, _N[stage], getattr(self, _N[stage]) + 1)
        self.last = now

    def seconds(self) -> dict[str, float]:
        """Seconds per stage that ran."""
        return {s: getattr(self, s) / 1e9 for s in STAGES if getattr(self, _N[s])}


def _total(tallies: Iterable[Tally]) -> dict[str, int]:
    out = dict.fromkeys(_SUMS, 0)
    for t in tallies:
        for k in _SUMS:
            out[k] += getattr(t, k)
    return out


class Meter:
    """The counters behind `Stats`: `Tally` objects, one per writer (so adding takes no lock and
    no dict: a batch's timing is a few clock reads and int adds), summed by `stats` when asked.
    ``cache``: the Loader's `ShardCache` (its counters are read from it); ``threads``/``processes``:
    what builds the batches, for the report."""

    def __init__(self, *, cache=None, threads: int = 0, processes: int = 0):
        self.cache, self.threads, self.processes = cache, threads, processes
        self._lock = threading.Lock()
        self._t0 = _CLOCK()
        self._local = threading.local()
        # the consumer's iteration (its wait and own time, the plan, the hand-over, and the batches
        # built in its thread); what worker processes reported (`merge`) and `add`-ed tallies, under
        # the lock; and each thread's that built batches (`tally`)
        self.own, self._merged = Tally(), Tally()
        self._tallies = [self.own, self._merged]
        self._cache = [0, 0, 0]  # cache hits, misses, bytes that worker processes reported
        self._drained = (dict.fromkeys(_SUMS, 0), (0, 0, 0))  # the totals at the last `drain`

    # -- adding -------------------------------------------------------------------------------
    def tally(self) -> Tally:
        """This thread's tally (made on its first batch): a thread that builds batches adds to it."""
        try:
            return self._local.tally
        except AttributeError:
            t = self._local.tally = Tally()
            with self._lock:
                self._tallies.append(t)
            return t

    def add(self, t: Tally) -> None:
        """Add a finished tally (a batch timed apart: ``crossfeed bench``'s)."""
        with self._lock:
            m = self._merged
            for k in _SUMS:
                setattr(m, k, getattr(m, k) + getattr(t, k))

    def timed(self, items: Iterable) -> Iterator:
        """``items`` (the plan: batch ids as they are made, by one thread at a time), each
        ``next`` timed as the plan stage (into `own`)."""
        t, clock = self.own, _CLOCK
        then = clock()
        for item in items:
            now = clock()
            t.plan += now - then
            t.n_plan += 1
            yield item
            then = clock()

    # The consumer's side, for a loop of its own around the batches (the PyTorch adapter's; the
    # Loader's own loop writes `own` inline): one iteration at a time, so into `own`.
    def delivered(self, batch, asked: int, done: int | None = None) -> int:
        """The consumer got ``batch``, having asked at ``asked`` (ns); ``done``: when it was built
        (its hand-over is timed from there). Returns now."""
        now, t = _CLOCK(), self.own
        t.wait += now - asked
        t.batches += 1
        t.samples += batch_rows(batch)
        if done is not None:
            t.handover += now - done if now > done else 0
            t.n_handover += 1
        return now

    def consumed(self, since: int) -> int:
        """The consumer asks for the next batch, having had the last one since ``since``. Returns now."""
        now = _CLOCK()
        self.own.consumer += now - since
        return now

    def ended(self, asked: int) -> None:
        """The epoch ended: the consumer asked at ``asked`` and got the end."""
        self.own.wait += _CLOCK() - asked
        self.own.epochs += 1

    # -- worker processes ---------------------------------------------------------------------
    def drain(self) -> dict:
        """What was built here since the last drain, as JSON values: a worker process sends it
        with each batch for the parent's `merge`."""
        cache = _cache_counters(self.cache)
        with self._lock:
            now = _total(self._tallies)
            (was, cached), self._drained = self._drained, (now, cache)
        d = {k: now[k] - was[k] for k in _SUMS}
        return {
            "ns": {s: d[s] for s in STAGES if d[_N[s]]},
            "n": {s: d[_N[s]] for s in STAGES if d[_N[s]]},
            "cpu": {s: [d[_CPU[s]], d[_NCPU[s]]] for s in CPU_STAGES if d[_NCPU[s]]},
            "bytes": d["bytes"],
            "cache": [a - b for a, b in zip(cache, cached)],
        }

    def merge(self, d, done: int | None = None) -> None:
        """Add what a worker process `drain`-ed (checked: ints under known names only; anything
        else is ignored). ``done``: when the worker finished the batch (perf_counter_ns, one clock
        for every process of the machine): its hand-over is timed from there."""
        now = _CLOCK()
        if not isinstance(d, dict):
            return
        ns, n, cache = d.get("ns"), d.get("n"), d.get("cache")
        with self._lock:
            m = self._merged
            for got, name in ((ns, str), (n, _N.__getitem__)):
                for s, v in (got if isinstance(got, dict) else {}).items():
                    if s in _N and _count(v):
                        setattr(m, name(s), getattr(m, name(s)) + v)
            cpu = d.get("cpu")
            for s, v in (cpu if isinstance(cpu, dict) else {}).items():
                if s in _CPU and isinstance(v, list) and len(v) == 2 and all(map(_count, v)):
                    setattr(m, _CPU[s], getattr(m, _CPU[s]) + v[0])
                    setattr(m, _NCPU[s], getattr(m, _NCPU[s]) + v[1])
            if _count(d.get("bytes")):
                m.bytes += d["bytes"]
            if isinstance(cache, list) and len(cache) == 3 and all(map(_count, cache)):
                self._cache = [a + b for a, b in zip(self._cache, cache)]
            if _count(done):
                m.handover += max(now - done, 0)
                m.n_handover += 1

    # -- reading ------------------------------------------------------------------------------
    def stats(self) -> Stats:
        hits, misses, nbytes = _cache_counters(self.cache)
        with self._lock:
            c = _total(self._tallies)
            ch, cm, cb = self._cache
        return Stats(
            batches=c["batches"],
            samples=c["samples"],
            bytes=c["bytes"],
            stages={s: StageStat(c[s] / 1e9, c[_N[s]], _cpu_of(c, s)) for s in STAGES},
            wait_seconds=c["wait"] / 1e9,
            consumer_seconds=c["consumer"] / 1e9,
            elapsed_seconds=(_CLOCK() - self._t0) / 1e9,
            threads=self.threads,
            processes=self.processes,
            cache_hits=ch + hits,
            cache_misses=cm + misses,
            cache_bytes=cb + nbytes,
            epochs=c["epochs"],
        )


def _cpu_of(c: dict, stage: str) -> float | None:
    """A stage's CPU seconds from the summed slots: known when every run of it was measured."""
    if stage not in _CPU or not c[_N[stage]] or c[_NCPU[stage]] != c[_N[stage]]:
        return None
    return c[_CPU[stage]] / 1e9


def _count(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _cache_counters(cache) -> tuple[int, int, int]:
    if cache is None:
        return 0, 0, 0
    return cache.hits, cache.downloads, cache.downloaded_bytes


def batch_rows(batch) -> int:
    """Samples in a batch: the length of its first value (0 if it has none, or not a dict)."""
    try:
        for v in batch.values():
            return len(v)
    except (AttributeError, TypeError):
        pass
    return 0
