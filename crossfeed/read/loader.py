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
import numbers
from collections.abc import Callable, Generator, Iterator

import numpy as np

from crossfeed.errors import ConfigError
from crossfeed.format.schema import INDEX_KEY, Feature
from crossfeed.read import metrics
from crossfeed.read.identity import StreamIdentity
from crossfeed.read.options import LoaderOptions, ReadOptions, Remainder, Shuffle, Source
from crossfeed.read.pipeline import Pipeline, PlanLike
from crossfeed.read.replay import StepSamples, replay
from crossfeed.read.sources.dataset import Dataset, Split

log = logging.getLogger(__name__)
STATE_VERSION = 2  # 2: the stream's identity (`crossfeed.read.identity`); 1 is read, unchecked

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
            source, options, transform=transform, batch_transform=batch_transform, alloc=alloc
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
        self, step: int, *, epoch: int | None = None, rank: int | None = None, position: int = 0
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

        O(batch) for unpacked plans. Packed plans (``pack=``, ``batch_by_tokens=``) walk the
        epoch's lengths up to the step (integers only; O(1) packed replay arrives with the
        packed-state work)."""
        return replay(self.pipeline, step, epoch=epoch, rank=rank, position=position)

    def samples_at(
        self,
        step: int,
        *,
        epoch: int | None = None,
        rank: int | None = None,
        position: int = 0,
        built: bool = False,
    ) -> dict[str, np.ndarray]:
        """The decoded samples of a step (`batch_at`'s), as a batch of the records themselves:
        CRC-checked, no transform (`Pipeline.records`; packed: each document of the step once, in
        the order it first appears). ``built=True``: the batch exactly as iteration built it
        (transforms applied; packed: the rows)."""
        got = self.batch_at(step, epoch=epoch, rank=rank, position=position)
        if built:
            batch = self.pipeline.build_batch(got.planned)
            return sample_of(batch) if self.per_sample else batch
        return self.pipeline.records(got.keys)

    def state_dict(self) -> dict:
        """Small and framework-free: resume with `load_state_dict` in any process, any world size.
        It carries the stream's identity (`crossfeed.read.identity`): a resume under other
        settings or another dataset is refused by name."""
        state = {
            "version": STATE_VERSION,
            "seed": self.options.plan.seed,
            "epoch": self._epoch,
            "position": self.position,
            "num_samples": self.pipeline.total,
            "batch_size": self.options.plan.batch_size,
            "identity": self.pipeline.identity.to_json(),
        }
        where = self.pipeline.source_positions(self._epoch, self.position)  # for people: where each source stands
        if where is not None:
            state["sources"] = where
        return state

    def load_state_dict(self, state: dict, *, on_change: str = "refuse") -> None:
        """Continue where ``state`` (a `state_dict`) stood. A state saved under settings that
        decide the stream differently (another dataset, seed, shuffle, packing, tail …; see
        `crossfeed.read.identity`) is refused with each difference named; with
        ``on_change="next_epoch"`` it is taken as the end of its epoch instead: the next epoch
        starts from its beginning under the new settings (the rest of the saved epoch is never
        delivered). World size, workers, threads, executor, cache and batch size may differ freely."""
        if on_change not in ("refuse", "next_epoch"):
            raise ConfigError(f"on_change must be 'refuse' or 'next_epoch', got {on_change!r}")
        if not isinstance(state, dict) or state.get("version") not in (1, STATE_VERSION):
            got = state.get("version") if isinstance(state, dict) else type(state).__name__
            raise ConfigError(f"loader state version {got!r} is not {STATE_VERSION}")
        try:
            seed, num, epoch, position = (
                state["seed"],
                state["num_samples"],
                int(state["epoch"]),
                int(state["position"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"loader state is missing or has a bad field: {e}") from None
        for field in ("epoch", "position"):  # 1.5 or "5" would be taken as 1 or 5, silently
            if isinstance(state[field], bool) or not isinstance(state[field], numbers.Integral):
                raise ConfigError(f"loader state's {field} must be an integer, got {state[field]!r}")
        now = self.pipeline.identity
        if state["version"] == 1:  # saved before identities: only its seed and size can be checked
            log.warning(
                "a loader state of version 1 carries no stream identity: only its seed and dataset size are "
                "checked; save a new state to have every setting checked on resume"
            )
            diffs = []
        else:
            # a mixture schedule's future may change (a phase appended): `resume_differences`
            at = epoch * self.pipeline.total + position
            diffs = StreamIdentity.from_json(state.get("identity")).resume_differences(now, at)
        if not diffs and (seed != self.options.plan.seed or num != self.pipeline.total):
            diffs = [f"seed was {seed}, is {self.options.plan.seed}"] if seed != self.options.plan.seed else []
            diffs += [f"samples per epoch were {num}, are {self.pipeline.total}"] if num != self.pipeline.total else []
        if diffs:
            if on_change == "refuse":
                raise ConfigError(
                    "this state belongs to another stream: " + "; ".join(diffs) + ". Resume with the saved "
                    "settings and data" + self._kept_version_hint(state) + ", or pass on_change='next_epoch' to "
                    "start the next epoch with the new ones"
                )
            log.warning(
                "resuming under changed settings (%s): epoch %d ends here, epoch %d starts under the new settings",
                "; ".join(diffs),
                epoch,
                epoch + 1,
            )
            epoch, position = (epoch + 1, 0) if position > 0 else (epoch, 0)
        self.start_at(epoch, position)

    def _kept_version_hint(self, state: dict) -> str:
        """Where a state of another stream was saved on an earlier version of a dataset read here
        (its manifest's SHA-256 is one the dataset's ``versions`` pins): the ``path@vN`` to resume on."""
        ident = state.get("identity")
        settings = ident.get("settings") if isinstance(ident, dict) else None
        if not isinstance(settings, dict):
            return ""
        saved = {v for v in settings.values() if isinstance(v, str) and v.startswith("sha256:")}
        for ds in self.pipeline.datasets:
            for version, sha in ds.manifest.versions:
                if f"sha256:{sha}" in saved:
                    return f" (it was saved on version {version} of {ds.path}: resume on '{ds.path}@v{version}')"
        return ""

    # -- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Generator[dict[str, np.ndarray], None, None]:
        self._position, self._delivered = self.position, 0
        step = self.num_workers if self.num_workers > 1 else 1
        one = self.per_sample
        for batch in self.pipeline.epoch(self._epoch, self._position):
            self._delivered += step
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
