"""Data recipes in the read pipeline: filters, per-sample randomness and skips — each a pure
function of integers (seed, epoch, global sample id, global step), so exact across resume, ranks,
DataLoader workers, executors and frameworks (docs/read-and-mix.md, "Filters, skips and
per-sample randomness").

* `sample_rngs`: each sample's ``np.random.Generator`` — Philox keyed by ``(global sample id,
  a hash of (seed, epoch))``: a transform that takes ``rng`` gets the same stream for the same
  sample in the same epoch wherever and whenever it runs.
* `batch_rng`: each batch's ``np.random.Generator`` for a ``batch_transform`` that takes ``rng``
  (token pipelines' randomness: MLM masking of packed rows) — Philox keyed by ``(the batch's
  global step, a hash of (seed, epoch, rank))``, the step as ``skip=`` and replay count it.
* `Dropped`: the samples filters dropped (``filter=``, a transform returning None) and the
  `max_filtered` budget.
* `SkipIds`: a skip list's sample ids, sorted: ``keep(ids)`` is O(batch · log skipped).
* `StepSkipSampler`: a sampler whose plans leave out skipped global steps, on every rank alike;
  its batch counts and positions count the steps it yields (unpacked plans, and token plans:
  ``pack=``, ``batch_by_tokens=``, whose skipped steps are walked past, never built).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import threading
from collections.abc import Callable, Iterator

import numpy as np

from crossfeed.errors import ConfigError

RNG_STREAM = 0x726E67  # "rng": the per-sample generators' own seed stream, apart from the plan's
BATCH_RNG_STREAM = 0x62726E67  # "brng": the per-batch generators' (a batch_transform taking rng)
FILTER_MIN_SEEN = 100  # the filter budget is checked once this many samples were seen (a share needs some)


def with_rng(fn: Callable) -> Callable:
    """Mark ``fn`` as a transform that takes ``(sample, rng)`` whatever its parameters are named
    (a transform whose second parameter is named ``rng`` needs no mark). Returns ``fn`` itself,
    so it still imports by reference in worker processes (mark it where it is defined, or name
    the parameter ``rng``, for ``executor="process"``)."""
    if not callable(fn):
        raise ConfigError(f"with_rng marks a transform function, got {type(fn).__name__}")
    try:
        fn.__crossfeed_rng__ = True  # type: ignore[attr-defined]
    except AttributeError:
        raise ConfigError(f"with_rng cannot mark {fn!r}; name its second parameter rng instead") from None
    return fn


def wants_rng(fn: Callable | None) -> bool:
    """Whether a transform takes the per-sample generator: marked `with_rng`, or a second
    positional parameter named ``rng``."""
    if fn is None:
        return False
    if getattr(fn, "__crossfeed_rng__", False):
        return True
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 and positional[1].name == "rng"


def epoch_key(seed: int, epoch: int) -> int:
    """The high word of every sample's Philox key in one epoch."""
    words = [int(seed) & 0xFFFFFFFF, int(seed) >> 32, int(epoch), RNG_STREAM]
    return int(np.random.SeedSequence(words).generate_state(1, np.uint64)[0])


def sample_rng(seed: int, epoch: int, sample: int) -> np.random.Generator:
    """The generator of global sample ``sample`` in ``epoch`` of a plan seeded ``seed`` (what a
    transform taking ``rng`` gets: reproduce one sample's augmentation with it)."""
    return np.random.Generator(np.random.Philox(key=np.array([int(sample), epoch_key(seed, epoch)], np.uint64)))


@functools.lru_cache(maxsize=64)
def batch_key(seed: int, epoch: int, rank: int) -> int:
    """The high word of every batch's Philox key of one rank in one epoch (kept: one an epoch)."""
    words = [int(seed) & 0xFFFFFFFF, int(seed) >> 32, int(epoch), int(rank), BATCH_RNG_STREAM]
    return int(np.random.SeedSequence(words).generate_state(1, np.uint64)[0])


def batch_rng(seed: int, epoch: int, step: int, rank: int = 0) -> np.random.Generator:
    """The generator of rank ``rank``'s batch at global step ``step`` (``epoch × steps_per_epoch +
    step``, skipped steps counted: `crossfeed.read.skips`, `crossfeed.Loader.batch_at`) in
    ``epoch`` of a plan seeded ``seed`` — what a ``batch_transform`` taking ``rng`` gets: reproduce
    one batch's masking with it. A new generator per batch: the transform may keep it."""
    if int(step) < 0:
        raise ConfigError(f"a batch's generator needs its global step (>= 0), got {step}")
    return np.random.Generator(
        np.random.Philox(key=np.array([int(step), batch_key(int(seed), int(epoch), int(rank))], np.uint64))
    )


def sample_rngs(seed: int, epoch: int, ids: np.ndarray) -> Iterator[np.random.Generator]:
    """`sample_rng` of each of ``ids``, the epoch's key computed once."""
    key = np.array([0, epoch_key(seed, epoch)], np.uint64)
    for i in np.asarray(ids, dtype=np.int64).tolist():
        key[0] = i
        yield np.random.Generator(np.random.Philox(key=key))


class EpochIds(np.ndarray):
    """A batch's sample ids tagged with their epoch (`tag`): the builder keys the per-sample
    generators by it, and the process executor sends it with the ids, so batches of different
    epochs in one pass (a dispatcher's leases) each get their own. ``step``: the batch's global
    step (-1: not known), the key of a batch transform's generator (`batch_rng`)."""

    epoch: int = 0
    step: int = -1

    def __array_finalize__(self, obj) -> None:
        self.epoch = getattr(obj, "epoch", 0)  # views and slices keep it
        self.step = getattr(obj, "step", -1)


def tag(ids: np.ndarray, epoch: int, step: int = -1) -> np.ndarray:
    """``ids`` (a view) carrying ``epoch`` and the batch's global ``step`` (`EpochIds`)."""
    out = np.asarray(ids).view(EpochIds)
    out.epoch, out.step = int(epoch), int(step)
    return out


def step_of(ids) -> int:
    """The global step ``ids`` were tagged with (-1: none)."""
    return int(getattr(ids, "step", -1))


def epoch_of(ids, default: int) -> int:
    """The epoch ``ids`` were tagged with, else ``default``."""
    return int(getattr(ids, "epoch", default))


class SampleRngs:
    """Each sample's generator, cheaply: one Philox generator per thread, its key and counter
    reset for each sample, so its draws are `sample_rng`'s. The reset writes the bit generator's
    state in place (`PhiloxRewind`: a 96-byte copy and the key's word) where numpy's layout is the expected one, else
    through ``state`` (~2-3 µs: a new generator is ~10x that). A generator is the sample's for
    the transform's call: the next sample's call resets it (``copy.deepcopy(rng)`` keeps one)."""

    def __init__(self):
        self._local = threading.local()

    def keyed(self, seed: int, epoch: int) -> Callable[[int], np.random.Generator]:
        """``rng(sample)``: this thread's generator reset to ``sample``'s of ``epoch`` (a batch's
        samples, one call each: the per-thread lookups done once)."""
        self.generator(seed, epoch, 0)
        local = self._local
        rewind, gen, k1 = local.rewind, local.gen, local.epoch[1]
        if rewind is None:
            return lambda sample: self.generator(seed, epoch, sample)
        blank, state, words, key, whole = rewind.blank(k1), rewind.bytes, rewind.q, rewind.KEY, rewind.WHOLE

        def rng(sample: int) -> np.random.Generator:
            state[whole] = blank
            words[key] = sample
            return gen

        return rng

    def inline(self, seed: int, epoch: int) -> tuple | None:
        """What `keyed`'s ``rng`` does, for a loop to do it in place (a call a sample costs about as
        much as the reset): ``(gen, state, blank, words, key, whole)`` — ``state[whole] = blank;
        words[key] = sample`` resets ``gen`` (this thread's) to ``sample``'s generator of
        ``epoch``. None where the reset goes through numpy's ``state`` (then `keyed`)."""
        self.generator(seed, epoch, 0)
        local = self._local
        rewind = local.rewind
        if rewind is None:
            return None
        return local.gen, rewind.bytes, rewind.blank(local.epoch[1]), rewind.q, rewind.KEY, rewind.WHOLE

    def generator(self, seed: int, epoch: int, sample: int) -> np.random.Generator:
        local = self._local
        if getattr(local, "gen", None) is None:
            local.bg = np.random.Philox(key=np.zeros(2, np.uint64))
            local.gen, local.state, local.epoch = np.random.Generator(local.bg), local.bg.state, (None, 0)
            local.rewind = PhiloxRewind.of(local.bg)
        if local.epoch[0] != (seed, epoch):
            local.epoch = ((seed, epoch), epoch_key(seed, epoch))
        rewind = local.rewind
        if rewind is not None:
            rewind(sample, local.epoch[1])
            return local.gen
        bg, st = local.bg, local.state
        inner = st["state"]
        inner["key"][0], inner["key"][1] = sample, local.epoch[1]
        inner["counter"][:] = 0
        st["buffer_pos"], st["has_uint32"], st["uinteger"] = 4, 0, 0
        bg.state = st
        return local.gen


class PhiloxRewind:
    """Resets one ``np.random.Philox`` to key ``(k0, k1)``, counter 0 and an empty buffer — what
    ``bg.state = …`` does — with a copy of 96 bytes where numpy keeps that state and the key's word: through the
    bit generator's ``ctypes.state_address``, numpy's ``philox_state`` (two pointers, then ``int
    buffer_pos``, ``uint64 buffer[4]``, ``int has_uint32``, ``uint32 uinteger``), followed in the
    object by the key (2 words) and the counter (4 words) the pointers point to. `of` makes one
    only when that layout is checked to be this numpy's: the pointers pointing just there, inside
    the bit generator object, every field read there equal to ``bg.state``'s after draws that
    change each, and a reset's draws equal to a new ``Philox``'s; otherwise None (the caller sets
    ``state``). The bit generator is kept alive with it."""

    WORDS = 12  # uint64 words from buffer_pos to the counter's end
    POS, HAS32, KEY, CTR = 0, 5, 6, 8  # words: buffer_pos (int, low half), has_uint32 (low half), key, counter
    WHOLE = slice(None)  # ``bytes[WHOLE] = …``: a slice made once (a sample's reset is ~40 ns)

    def __init__(self, bg: np.random.Philox, words):
        self.bg, self.words = bg, words  # the state's words (a ctypes array over the bit generator's memory)
        self.bytes = memoryview(words).cast("B")
        self.q = self.bytes.cast("Q")  # the same words, written faster than through ctypes
        self._k1: int | None = None
        self._blank = b""

    def blank(self, k1: int) -> bytes:
        """The state's 96 bytes after a reset to key ``(0, k1)``: the buffer spent (``buffer_pos``
        = 4, PHILOX_BUFFER_SIZE: the next draw computes a block), no half-spent word, counter 0."""
        if k1 != self._k1:
            t = np.zeros(self.WORDS, np.uint64)
            t[self.POS], t[self.KEY + 1] = 4, k1
            self._blank, self._k1 = t.tobytes(), k1
        return self._blank

    def __call__(self, k0: int, k1: int) -> None:
        self.bytes[self.WHOLE] = self.blank(k1)
        self.q[self.KEY] = k0

    @classmethod
    def of(cls, bg: np.random.Philox) -> PhiloxRewind | None:
        try:
            return cls._checked(bg)
        except Exception:  # any surprise in numpy's internals: the portable way
            return None

    @classmethod
    def _checked(cls, bg: np.random.Philox) -> PhiloxRewind | None:
        import ctypes
        import sys

        if sys.byteorder != "little" or ctypes.sizeof(ctypes.c_void_p) != 8:
            return None
        lo = id(bg)  # the object's memory (CPython), which holds the state, the key and the counter
        hi = lo + sys.getsizeof(bg)
        addr = int(bg.ctypes.state_address)
        start, end = addr + 16, addr + 16 + 8 * cls.WORDS
        if not (lo <= addr and end <= hi):
            return None
        ptrs = (ctypes.c_void_p * 2).from_address(addr)
        if (ptrs[0], ptrs[1]) != (start + 8 * cls.CTR, start + 8 * cls.KEY):
            return None
        words = (ctypes.c_uint64 * cls.WORDS).from_address(start)
        view = np.ctypeslib.as_array(words)
        half = view.view(np.uint32)
        gen = np.random.Generator(bg)
        for draw in (lambda: None, lambda: gen.integers(0, 7, dtype=np.uint32), lambda: bg.random_raw(5)):
            draw()
            st = bg.state
            inner = st["state"]
            if not (
                np.array_equal(view[cls.CTR :], inner["counter"])
                and np.array_equal(view[cls.KEY : cls.CTR], inner["key"])
                and int(half[2 * cls.POS]) == st["buffer_pos"]
                and int(half[2 * cls.HAS32]) == st["has_uint32"]
            ):
                return None
        rewind = cls(bg, words)
        for k0, k1 in ((3, 0x9E3779B97F4A7C15), (2**63 + 5, 1)):
            gen.integers(0, 7, dtype=np.uint32)  # a half-spent word and buffer, to be forgotten
            rewind(k0, k1)
            want = np.random.Generator(np.random.Philox(key=np.array([k0, k1], np.uint64)))
            same = (
                gen.integers(0, 2**32, 3, dtype=np.uint32).tolist()
                == want.integers(0, 2**32, 3, dtype=np.uint32).tolist()
            )
            if not same or gen.standard_normal(9).tolist() != want.standard_normal(9).tolist():
                return None
        return rewind


class Dropped:
    """Samples seen and dropped by filters (``filter=`` or a transform returning None) in this
    process; thread-safe. ``max_share``: past it (once `FILTER_MIN_SEEN` samples were seen) a
    ConfigError naming the filter and the share."""

    def __init__(self, max_share: float | None, name: str):
        self.max_share, self.name = max_share, name
        self.seen = self.dropped = 0
        self._lock = threading.Lock()

    def add(self, seen: int, dropped: int) -> None:
        with self._lock:
            self.seen += seen
            self.dropped += dropped
            seen, dropped = self.seen, self.dropped
        if self.max_share is not None and dropped and seen >= FILTER_MIN_SEEN and dropped > self.max_share * seen:
            raise ConfigError(
                f"the {self.name} dropped {dropped:,} of {seen:,} samples ({dropped / seen:.1%}), more than "
                f"max_filtered={self.max_share:g} ({self.max_share:.1%}); check the filter, or raise max_filtered"
            )


def callable_name(fn) -> str:
    """A readable name of a filter or transform for messages: ``filter mod:fn``."""
    if isinstance(fn, str):
        return fn
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


class SkipIds:
    """A skip list's global sample ids, sorted (`crossfeed.read.skips.Skip.ids`). ``keep(ids)``
    looks them up in a byte per id of the skipped ids' range where that range is dense enough
    (at most `DENSE_BYTES_PER_ID` bytes per skipped id, or `DENSE_MIN` bytes: memory stays
    O(skipped ids)) — one gather, O(batch) — else by binary search, O(batch · log skipped)."""

    DENSE_BYTES_PER_ID = 64
    DENSE_MIN = 1 << 20

    def __init__(self, ids: np.ndarray):
        self.ids = np.asarray(ids, dtype=np.int64)
        self._lo, self._flags = 0, None
        if len(self.ids):
            lo = int(self.ids[0])
            span = int(self.ids[-1]) + 1 - lo
            if span <= max(self.DENSE_MIN, self.DENSE_BYTES_PER_ID * len(self.ids)):
                # kept or not, id ``lo + i`` at ``i + 1``; the first and the last: every id outside
                # the range (a clipped take lands there)
                flags = np.ones(span + 2, dtype=bool)
                flags[self.ids - (lo - 1)] = False
                self._lo, self._flags = lo - 1, flags

    def __len__(self) -> int:
        return len(self.ids)

    def keep(self, ids: np.ndarray) -> np.ndarray:
        """A mask of ``ids`` not skipped."""
        ids = np.asarray(ids, dtype=np.int64)
        flags = self._flags
        if flags is not None:  # one gather: an id outside the range clips to an end, kept
            return flags.take(ids - self._lo, mode="clip")
        s = self.ids
        if not len(s):
            return np.ones(len(ids), dtype=bool)
        at = np.searchsorted(s, ids)
        hit = s[np.minimum(at, len(s) - 1)] == ids
        return ~hit


# ---- skipped steps ------------------------------------------------------------------------------


class Kept:
    """Of ``total`` consecutive plan batches (numbered 0 …), those outside the merged half-open
    ``skipped`` ranges (local numbers), by rank: `plan_batch` maps the j-th kept one to its
    plan number in O(ranges)."""

    def __init__(self, total: int, skipped: list[tuple[int, int]]):
        self.total = total
        self.skipped = [(max(0, a), min(total, b)) for a, b in skipped if b > 0 and a < total]
        self.count = total - sum(b - a for a, b in self.skipped)

    def plan_batch(self, j: int) -> int:
        b = j
        for lo, hi in self.skipped:
            if b >= lo:
                b += hi - lo
            else:
                break
        return b


@dataclasses.dataclass
class StepSkipPlan:
    """A `crossfeed.read.stages.sampler.Plan` with skipped steps left out: worker ``w`` of ``K``
    takes the kept batches ``w, w+K, …`` of its rank (as a plan without skips does)."""

    inner: object  # the rank's whole plan (worker 0 of 1), random access
    kept: Kept
    worker: int = 0
    num_workers: int = 1
    random_access = True

    def batch_ids(self) -> range:
        return range(self.worker, self.kept.count, self.num_workers)

    def batch(self, j: int) -> np.ndarray:
        return self.inner.batch(self.kept.plan_batch(j))  # type: ignore[attr-defined]

    def __len__(self) -> int:
        return len(self.batch_ids())

    def __iter__(self) -> Iterator[np.ndarray]:
        return map(self.batch, self.batch_ids())

    @property
    def order(self):
        return self.inner.order  # type: ignore[attr-defined]


class StepSkipWalk:
    """A plan walked in order (a token plan's `crossfeed.read.stages.pack.PackPlan`) with skipped
    steps left out: each run of kept plan batches is walked from its own first batch's position
    (``inner.position_after``, then ``inner.plan`` there: the packer walks on from its nearest
    cursor, so a skipped step's batch is never encoded, built nor read). Worker ``w`` of ``K``
    takes the kept batches ``w, w+K, …`` of its rank, as `StepSkipPlan` does."""

    random_access = False

    def __init__(self, inner, epoch: int, position: int, kept: Kept, worker: int = 0, num_workers: int = 1):
        self.inner, self.epoch, self.position, self.kept = inner, epoch, position, kept
        self.worker, self.num_workers = worker, num_workers

    def __len__(self) -> int:
        return len(range(self.worker, self.kept.count, self.num_workers))

    def runs(self) -> Iterator[tuple[int, int]]:
        """The kept plan batches as half-open runs ``(lo, hi)`` (numbers from ``position``)."""
        lo = 0
        for a, b in self.kept.skipped:
            if a > lo:
                yield lo, a
            lo = max(lo, b)
        if lo < self.kept.total:
            yield lo, self.kept.total

    def __iter__(self) -> Iterator[np.ndarray]:
        j, K = 0, self.num_workers  # j: kept batches before the run
        for lo, hi in self.runs():
            start = self.inner.position_after(self.position, lo, epoch=self.epoch)
            plan = self.inner.plan(self.epoch, start)
            # the run's batch g is kept batch j + g: this worker's are g ≡ worker − j (mod K)
            plan.worker, plan.num_workers = (self.worker - j) % K, K
            yield from itertools.islice(iter(plan), len(range(plan.worker, hi - lo, K)))
            j += hi - lo


class StepSkipWalker:
    """A dispatcher's packed leases of a plan with skipped steps (`crossfeed.net.lease.source`):
    kept step ``j`` of epoch ``e`` (numbered without the skipped ones, as the dispatcher counts
    them) is plan batch ``kept(e).plan_batch(j)`` of the walk over the epoch's rows
    (`crossfeed.read.stages.pack.PackWalker`, which passes a skipped step's rows as integers:
    never encoded, built nor read). The epoch's `Kept` is found once per epoch (O(ranges); its
    step count is the one ``len(loader)`` walks once per process), so a kept step costs what a
    packed lease without skips does."""

    def __init__(self, walker, skips: StepSkipSampler):
        self.walker, self.skips = walker, skips
        self._kept: tuple[int, Kept] | None = None  # (epoch, its kept steps)

    @property
    def restarts(self) -> int:
        return self.walker.restarts

    def plan_batch(self, epoch: int, j: int) -> int:
        """The plan batch (skipped steps counted) of kept step ``j`` of ``epoch``."""
        if self._kept is None or self._kept[0] != epoch:
            self._kept = (epoch, self.skips.kept(epoch, 0))
        kept = self._kept[1]
        if not 0 <= j < kept.count:
            raise ConfigError(
                f"packed batch {j} of epoch {epoch} lies past the epoch's {kept.count} kept steps here: serve the "
                "same dataset, with the same --skip, that the dispatcher plans"
            )
        return kept.plan_batch(j)

    def batch(self, epoch: int, j: int) -> np.ndarray:
        return self.walker.batch(epoch, self.plan_batch(epoch, j))


def uniform_epochs(sampler) -> bool:
    """Whether every epoch of ``sampler``'s plan has the same number of steps: an unpacked plan,
    or ``split="rows"`` packing of one dataset (its rows are the lengths' sum cut in rows)."""
    if getattr(sampler, "budget", None) is not None:
        return False  # batch_by_tokens: each epoch's order groups its documents its own way
    if getattr(sampler, "pack", None) is None:
        return True
    return sampler.exact_rows(0) is not None


class FirstSteps:
    """The global step of each epoch's first batch (``epoch_start(e)``): ``e · S`` where every
    epoch has the same ``S`` steps a rank (`uniform_epochs`), else the earlier epochs' steps
    summed — what a trainer's step counter shows and `crossfeed.read.replay` counts. Cost: an
    epoch's step count is ``rank_batch_count(0, e)``: O(1) for unpacked plans; for a packed one
    (best-fit packing, a mixture) or ``batch_by_tokens`` one walk of that epoch's lengths
    (integers only, no record read; what ``len(loader)`` needs anyway), once per epoch and
    process (kept: one integer an epoch)."""

    def __init__(self, sampler):
        self.sampler = sampler
        self._uniform: bool | None = None  # asked when first needed (split="rows" sums the lengths files)
        self._counts: list[int] = []  # steps of epochs 0, 1, … (non-uniform plans)
        self._lock = threading.Lock()

    def epoch_start(self, epoch: int) -> int:
        if epoch == 0:
            return 0
        if self._uniform is None:
            self._uniform = uniform_epochs(self.sampler)
        if self._uniform:
            return epoch * self.sampler.rank_batch_count(0, epoch=epoch)
        with self._lock:
            while len(self._counts) < epoch:
                self._counts.append(self.sampler.rank_batch_count(0, epoch=len(self._counts)))
            return sum(self._counts[:epoch])

    def global_step(self, epoch: int, position: int) -> int:
        """The global step of the plan batch at ``position`` of ``epoch`` (skipped or not)."""
        S = self.sampler.rank_batch_count(0, epoch=epoch)
        return self.epoch_start(epoch) + S - self.sampler.rank_batch_count(position, epoch=epoch)


class StepSkipSampler:
    """A `crossfeed.read.stages.sampler.Sampler` (or a token plan's
    `crossfeed.read.stages.pack.PackSampler`) whose plans leave out the global steps of ``steps``
    (merged half-open ranges; `crossfeed.read.skips`). Global step of a rank's plan batch ``b``
    from ``position`` of epoch ``e``: ``first(e) + (S − R) + b``, with ``S`` the rank's batches in
    the whole epoch, ``R`` those from ``position`` and ``first(e)`` the epoch's first global step
    (`FirstSteps`: ``e·S`` for unpacked plans) — the same on every rank. Its batch counts and
    positions count the batches it yields; a position after ``d`` of them is the plan's after the
    plan batch that was the d-th kept. A token plan is walked in order (`StepSkipWalk`); counting
    its epoch's steps costs what ``len(loader)`` does (`FirstSteps`)."""

    def __init__(self, inner, steps: tuple[tuple[int, int], ...]):
        self.inner, self.steps = inner, steps
        self.options, self.total, self.shard = inner.options, inner.total, inner.shard
        self.first = FirstSteps(inner)

    def kept(self, epoch: int, position: int) -> Kept:
        R = self.inner.rank_batch_count(position, epoch)
        base = self.first.global_step(epoch, position)
        return Kept(R, [(lo - base, hi - base) for lo, hi in self.steps if hi > base and lo < base + R])

    def global_step(self, epoch: int, position: int) -> int:
        """The global step of the next plan batch from ``position`` (skipped or not)."""
        return self.first.global_step(epoch, position)

    def plan(self, epoch: int, position: int = 0) -> StepSkipPlan | StepSkipWalk:
        whole = self.inner.plan(epoch, position)
        sh = self.inner.shard
        if not getattr(whole, "random_access", False):  # a token plan: walked run by run
            return StepSkipWalk(self.inner, epoch, position, self.kept(epoch, position), sh.worker, sh.num_workers)
        if sh.num_workers > 1:
            whole = dataclasses.replace(whole, worker=0, num_workers=1, _chunk={})
        return StepSkipPlan(whole, self.kept(epoch, position), sh.worker, sh.num_workers)

    def epoch_total(self, epoch: int = 0) -> int:
        return self.inner.epoch_total(epoch)

    def within(self, epoch: int, position: int) -> bool:
        return self.inner.within(epoch, position)

    def rank_batch_count(self, position: int = 0, epoch: int = 0) -> int:
        return self.kept(epoch, position).count

    def position_after(self, position: int, rank_batches_done: int, epoch: int = 0) -> int:
        if rank_batches_done <= 0:
            return position
        kept = self.kept(epoch, position)
        done = min(rank_batches_done, kept.count)
        plan_done = kept.plan_batch(done - 1) + 1 if done else 0
        if done == kept.count:
            plan_done = kept.total  # skipped steps at the epoch's end are passed too
        return self.inner.position_after(position, plan_done, epoch)

    def source_positions(self, epoch: int, position: int):
        return self.inner.source_positions(epoch, position)


@dataclasses.dataclass
class SampleRecipe:
    """What `crossfeed.read.stages.batch.BatchBuilder` applies per sample besides the transform:
    ``filter`` (a predicate on the decoded sample), ``rng`` (the transform takes each sample's
    generator, keyed by ``seed``), ``skip_ids`` (never read) and ``dropped`` (the count and budget);
    ``batch_rng``: the batch transform takes each batch's generator (`batch_rng`, keyed by
    ``seed``, the batch's epoch and step, and ``rank``)."""

    filter: Callable | None = None
    rng: bool = False
    batch_rng: bool = False
    rank: int = 0
    seed: int = 0
    skip_ids: SkipIds | None = None
    dropped: Dropped | None = None
    transform: bool = False  # there is a transform (which may return None: dropped)

    @property
    def active(self) -> bool:
        return self.filter is not None or self.rng or self.skip_ids is not None or self.transform or self.batch_rng
