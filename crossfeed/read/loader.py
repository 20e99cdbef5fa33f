"""The Loader: the read pipeline in stages, framework-neutral.

    Sampler ──► FrameReader ──► decoder ──► transform ──► batch ──► executor ──► consumer
    (plan: batches  (Frames: checked  (dict of numpy  (user fn,    (re-stack    (threads,    (for loop, torch,
     of global       payloads, views   arrays, one     per sample)  samples)     in order,    tf, serve)
     indices)        or rows)          strategy)                                 bounded)

``Loader(source, options)`` (or ``Loader(source, batch_size=..., shuffle=..., ...)``, which makes
the `LoaderOptions`) iterates one epoch of batches, each a ``dict[str, np.ndarray]``; iterating
again runs the next epoch. The stages are a `crossfeed.read.pipeline.Pipeline` (``loader.pipeline``),
built once; the Loader is the cursor over its epochs: where it stands, its state, its stats.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Iterator

import numpy as np

from crossfeed.errors import ConfigError
from crossfeed.format.schema import INDEX_KEY, Feature
from crossfeed.read import metrics
from crossfeed.read import state as states
from crossfeed.read.options import LoaderOptions, ReadOptions, Remainder, Shuffle, Source
from crossfeed.read.pipeline import Pipeline, PlanLike
from crossfeed.read.replay import StepSamples, replay
from crossfeed.read.sources.dataset import Dataset, Split

log = logging.getLogger(__name__)

__all__ = ["INDEX_KEY", "Loader", "LoaderOptions", "ReadOptions", "Remainder", "Shuffle"]


class Loader:
    """Batches of one split, planned on integers, then fetched (see the module docstring): an
    epoch cursor over a `crossfeed.read.pipeline.Pipeline` (iteration, state, stats).

    ``options``: a `LoaderOptions`, or its fields as keywords (``batch_size``, ``shuffle``
    "global"/"block"/"none", ``seed``, ``drop_last``, ``remainder`` "pad"/"drop", ``rank``,
    ``world_size``, ``worker``, ``num_workers``, ``block_shards``, ``read=ReadOptions(...)``,
    ``on_error``, ``max_skips``, ``split``, ``features``, ``return_index``). ``transform`` maps
    each sample dict and ``batch_transform`` each batch, in the loader's threads (or its worker
    processes, with ``executor="process"``; either may be a ``"module:function"`` string). ``start``:
    ``(epoch, position)`` to begin at (``epoch=`` alone: that epoch's start). ``alloc``:
    ``alloc(shape, dtype)`` makes the batch arrays (default ``np.empty``).

    Recipes (docs/read-and-mix.md): ``filter`` — a predicate on each decoded sample (or
    ``"module:function"``) — and a ``transform`` that returns None drop the sample: its batch
    comes out shorter, the position still counts it (`filtered` counts them; ``max_filtered=``
    bounds their share). A transform whose second parameter is ``rng`` (or marked
    `crossfeed.with_rng`) gets each sample's own ``np.random.Generator``, seeded from (seed, epoch,
    sample id). ``skip=`` leaves out global steps and sample ids (`crossfeed.Skip`).

    ``batch_size=None`` (as keywords) iterates one sample at a time, as ``DataLoader(batch_size=None)``
    and an unbatched ``tf.data`` pipeline do: each item is one sample's dict — arrays without the
    batch dimension (0-d for scalars; views into the batch of one it was built as), ``str``/``bytes``
    for text, one row with ``pack=`` — and lengths, positions and states count samples
    (`sample_of`; the plan is the ``batch_size=1`` one).

    ``source``: a dataset (TFRecord, WebDataset tar or Parquet; a path, URL or `Dataset`), or a
    mixture — a list of `crossfeed.Source`, of any of those formats, their features renamed to
    one set of names (``Source("wds/", rename={"jpg": "image", "cls": "label"})``); `features`
    says what the batches hold (a mixture's shapes and dtypes are the more general of its sources').

    Iteration is a cursor over the epochs, not a restartable collection (unlike
    ``torch.utils.data.DataLoader``): ``len(loader)`` is the number of batches the *next*
    iteration yields — the whole epoch at its start, the batches left after a broken-off one; a
    new ``iter()`` after a ``break`` continues the epoch where it stopped (no sample twice, none
    missed: what `state_dict` saves); an iteration that runs to the end moves the Loader to the
    next epoch. ``set_epoch(n)`` starts epoch ``n`` from its beginning (DataLoader's restart).
    """

    def __init__(
        self,
        source,
        options: LoaderOptions | None = None,
        *,
        transform: Callable[[dict], dict] | str | None = None,
        batch_transform: Callable[[dict], dict] | str | None = None,
        start: tuple[int, int] | None = None,
        epoch: int | None = None,
        alloc: Callable | None = None,
        filter: Callable[[dict], bool] | str | None = None,
        **fields,
    ):
        # batch_size=None: one sample at a time (DataLoader(batch_size=None), tf.data unbatched)
        self.per_sample = options is None and "batch_size" in fields and fields["batch_size"] is None
        if self.per_sample:
            if fields.get("batch_by_tokens") is not None:
                raise ConfigError("batch_by_tokens= makes batches of documents; it takes a batch_size, not None")
            fields["batch_size"] = 1
        options = LoaderOptions.given(options, fields)
        if start is not None and epoch is not None:
            raise ConfigError("pass start=(epoch, position) or epoch=, not both")
        self.options = options
        self.pipeline = Pipeline.build(
            source, options, transform=transform, batch_transform=batch_transform, alloc=alloc, filter=filter
        )
        meter = self.pipeline.meter
        self._mark = meter.stats() if meter is not None else None  # the counters at the epoch's start (`log_stats`)
        epoch, position = start if start is not None else (epoch or 0, 0)
        try:
            self.start_at(epoch, position)
        except BaseException:
            self.pipeline.close()
            raise

    # -- what it reads (the pipeline's) ---------------------------------------------------------
    @property
    def sources(self) -> tuple[Source, ...] | None:
        """A mixture's sources (None: one dataset)."""
        return self.pipeline.sources

    @property
    def datasets(self) -> list[Dataset]:
        return self.pipeline.datasets

    @property
    def dataset(self) -> Dataset:
        """The dataset (a mixture's first)."""
        return self.pipeline.dataset

    @property
    def split(self) -> Split | None:
        """The split read (None for a mixture)."""
        return self.pipeline.split

    @property
    def features(self) -> tuple[Feature, ...]:
        """What the batches hold."""
        return self.pipeline.features

    @property
    def cache(self):
        """The local cache of remote shards (`crossfeed.io.cache.ShardCache`; None without ``cache_dir``)."""
        return self.pipeline.cache

    def paths(self) -> dict[str, dict[str, int]]:
        """Which path of each stage served this process's batches so far (`Pipeline.paths`);
        worker processes (``executor="process"``) count in their own processes."""
        return self.pipeline.paths()

    def stats(self) -> metrics.Stats:
        """Where the time went: the Loader's stage metrics, cumulative since it was made (see
        `crossfeed.read.metrics`; ``stats().since(earlier)`` for an interval, ``.verdict()`` for
        whether the consumer waits on input and which stage to look at). Stages that ran in
        worker processes are included: each batch brings its own."""
        return self.pipeline.stats()

    # -- plan & state -------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.options.shard.rank

    @property
    def world_size(self) -> int:
        return self.options.shard.world_size

    @property
    def worker(self) -> int:
        return self.options.shard.worker

    @property
    def num_workers(self) -> int:
        return self.options.shard.num_workers

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def skipped(self) -> int:
        return self.pipeline.skipped

    @property
    def filtered(self) -> int:
        """Samples the filter (or a transform returning None) dropped so far, here and in the
        process executor's workers (DataLoader workers count in their own processes)."""
        return self.pipeline.filtered

    def global_step(self) -> int:
        """The global step of the next batch of the plan (skipped or not): ``epoch ×
        steps_per_epoch + step`` as ``skip=`` counts steps (`crossfeed.read.skips`)."""
        return self.pipeline.global_step(self._epoch, self.position)

    def start_at(self, epoch: int, position: int = 0) -> None:
        """Begin the next iteration at sample ``position`` of epoch ``epoch`` (positions count
        the samples every rank together consumed; see `crossfeed.read.stages.sampler`)."""
        if int(epoch) < 0:
            raise ConfigError(f"epoch must be >= 0, got {epoch}")
        if not self.pipeline.within(int(epoch), int(position)):  # a packed epoch: walked no further than position
            raise ConfigError(
                f"position {position} is outside the epoch of {self.pipeline.epoch_total(int(epoch))} samples; "
                f"was the state saved for another dataset?"
            )
        self._epoch, self._position, self._delivered = int(epoch), int(position), 0

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning on the next iteration (like DistributedSampler)."""
        self.start_at(epoch, 0)

    def plan(self) -> PlanLike:
        """This rank's and worker's batches for the rest of the current epoch."""
        return self.pipeline.plan(self._epoch, self.position)

    @property
    def position(self) -> int:
        return self.pipeline.position_after(self._position, self._delivered, epoch=self._epoch)

    def batch_count(self, *, all_workers: bool = False) -> int:
        """Batches the next iteration yields: this worker's, or with ``all_workers`` the whole
        rank's (every rank yields the same number)."""
        rank = self.pipeline.rank_batch_count(self.position, epoch=self._epoch)
        if all_workers:
            return rank
        return len(range(self.worker, rank, self.num_workers))

    def rank_batch_count(self, position: int = 0, epoch: int = 0) -> int:
        """Batches each rank delivers from ``position`` to the end of epoch ``epoch``."""
        return self.pipeline.rank_batch_count(position, epoch=epoch)

    def position_after(self, position: int, rank_batches_done: int, epoch: int = 0) -> int:
        """The position after every rank delivered ``rank_batches_done`` batches from ``position``."""
        return self.pipeline.position_after(position, rank_batches_done, epoch=epoch)

    def __len__(self) -> int:
        return self.batch_count()

    # -- replay -------------------------------------------------------------------------------
    def batch_at(
        self,
        step: int,
        *,
        epoch: int | None = None,
        rank: int | None = None,
        position: int = 0,
        state: dict | None = None,
    ) -> StepSamples:
        """Which samples were in step ``step`` of rank ``rank`` (default: this Loader's), planned
        again from the seed — no record is read, nothing was logged (`crossfeed.read.replay`): a
        sequence of `crossfeed.read.replay.SampleRef` (source, shard path, record within the
        shard, global key; packed: each row's pieces), in the batch's order.

        ``epoch=E``: ``step`` is the rank's batch number within epoch ``E`` (0 first), counted
        from ``position`` — the epoch position its iteration began at; 0 unless the run resumed
        mid-epoch at another world size or batch size (a resume under the same ones continues
        the numbering). Without ``epoch``: a global step, counted from epoch 0's start, each
        epoch's steps one after the other (what ``for epoch …: for batch in loader`` counts).
        A step is the rank's batch, however many workers share the rank's batches out.

        ``state``: a saved `state_dict` of this stream (checked as `load_state_dict` checks it;
        the Loader's own position is left as it is): ``epoch`` defaults to its epoch, and a
        packed state's cursor is where the walk to a later step starts.

        O(batch) for unpacked plans. Packed plans (``pack=``) walk the epoch's lengths (integers
        only) from the packer's nearest cursor at or before the step's rows — one this process
        met, or ``state``'s: O(bins + batch) for a step at or after a state's position, however
        far into the epoch; from further back (the epoch's start at worst) without one near
        (``walked_from`` says where). ``batch_by_tokens=`` walks from the epoch's start."""
        return replay(self.pipeline, step, epoch=epoch, rank=rank, position=position, state=state)

    def samples_at(
        self,
        step: int,
        *,
        epoch: int | None = None,
        rank: int | None = None,
        position: int = 0,
        built: bool = False,
        state: dict | None = None,
    ) -> dict[str, np.ndarray]:
        """The decoded samples of a step (`batch_at`'s), as a batch of the records themselves:
        CRC-checked, no transform (`Pipeline.records`; packed: each document of the step once, in
        the order it first appears). ``built=True``: the batch exactly as iteration built it
        (transforms applied; packed: the rows)."""
        got = self.batch_at(step, epoch=epoch, rank=rank, position=position, state=state)
        if built:
            batch = self.pipeline.build_batch(self.pipeline.step_tagged(got.planned, got.epoch, got.position, got.step))
            return sample_of(batch) if self.per_sample else batch
        return self.pipeline.records(got.keys)

    def state_dict(self) -> dict:
        """Small and framework-free: resume with `load_state_dict` in any process, any world size.
        It carries the stream's identity (`crossfeed.read.identity`): a resume under other
        settings or another dataset is refused by name. A packed plan's state carries the
        packer's cursor too (``pack``: its open rows, at most ``bins``, and where it stands in the
        documents), so a resume walks on from there, not from the epoch's start."""
        return self.state_at(self._epoch, self.position)

    def state_at(self, epoch: int, position: int, *, walk: bool = True) -> dict:
        """The state of position ``position`` of epoch ``epoch`` (`state_dict`'s form). Packed:
        with ``walk=False`` the cursor is the nearest this process already knows before
        ``position`` (maybe the epoch's start) rather than one a walk there finds."""
        return states.make(self.pipeline, epoch, position, walk=walk)

    def load_state_dict(self, state: dict, *, on_change: str = "refuse") -> None:
        """Continue where ``state`` (a `state_dict`) stood. A state saved under settings that
        decide the stream differently (another dataset, seed, shuffle, packing, tail …; see
        `crossfeed.read.identity`) is refused with each difference named; with
        ``on_change="next_epoch"`` it is taken as the end of its epoch instead: the next epoch
        starts from its beginning under the new settings (the rest of the saved epoch is never
        delivered). World size, workers, threads, executor, cache and batch size may differ freely."""
        epoch, position = states.resume_point(self.pipeline, state, on_change)
        self.start_at(epoch, position)

    # -- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Generator[dict[str, np.ndarray], None, None]:
        self._position, self._delivered = self.position, 0
        step = self.num_workers if self.num_workers > 1 else 1
        one = self.per_sample
        for batch in self.pipeline.epoch(self._epoch, self._position):
            self._delivered += step
            if one and is_empty(batch):  # one sample at a time, and a filter dropped it: counted, not yielded
                continue
            yield sample_of(batch) if one else batch
        self._epoch, self._position, self._delivered = self._epoch + 1, 0, 0
        meter = self.pipeline.meter
        if meter is not None and self._mark is not None and self.options.read.log_stats:
            now = meter.stats()
            log.info("crossfeed epoch %d: %s", self._epoch - 1, now.since(self._mark).line())
            self._mark = now

    def epochs(self, count: int | None = None) -> Iterator[dict[str, np.ndarray]]:
        """The batches of ``count`` epochs in a row (None: without end), from where the Loader
        stands; `state_dict` is exact after any batch, so an endless run resumes anywhere."""
        if count is not None and count < 0:
            raise ConfigError(f"epochs must be >= 0 or None, got {count}")
        done = 0
        while count is None or done < count:
            yield from self
            done += 1

    def close(self) -> None:
        self.pipeline.close()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def is_empty(batch: dict) -> bool:
    """Whether a batch has no rows (every sample of its step was dropped by a filter)."""
    return any(len(v) == 0 for v in batch.values())


def one_sample(batch: dict, who: str) -> dict:
    """`sample_of` for a front end that counts the items it yields (the PyTorch and TF adapters'
    ``batch_size=None``): a dropped sample, which it could not account for, is a ConfigError."""
    if is_empty(batch):
        raise ConfigError(
            f"{who} with batch_size=None counts the samples it yields, and a filter (or a transform returning "
            f"None) dropped one; filter in batches (a batch_size), or iterate a crossfeed.Loader"
        )
    return sample_of(batch)


def sample_of(batch: dict) -> dict:
    """The one sample of a batch of one, as ``batch_size=None`` delivers it: each array without
    its batch dimension (a view: 0-d for a scalar), a text or ragged feature's value itself."""
    out = {}
    for k, v in batch.items():
        if isinstance(v, np.ndarray) and v.dtype != object and v.dtype.kind not in "USV":
            out[k] = v[0, ...]
        else:
            out[k] = v[0]
    return out
