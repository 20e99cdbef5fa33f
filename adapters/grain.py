"""Grain adapter: a crossfeed dataset (or a mixture) as a Grain ``RandomAccessDataSource``.

    src = GrainSource("data/", split="train")            # TFRecord, adopted tar / Parquet / TFDS
    ds = grain.MapDataset.source(src).shuffle(seed=0).map(augment).batch(256)
    loader = grain.DataLoader(data_source=src, sampler=grain.samplers.IndexSampler(len(src), ...),
                              operations=[...], worker_count=2)     # the classic API reads it too

* ``len(src)`` records; ``src[key]`` is record ``key`` of the split decoded — a ``dict`` of numpy
  arrays (strings and bytes as Python objects), exactly the values the crossfeed `Loader` gives
  for that record. Reads go through the Loader's own frames and decode stages (`Pipeline.records`) (every record's
  CRC checked, tar and Parquet read in place; one record of fixed-shape numbers from a local
  TFRecord split straight from its shard by its index entry, CRC checked too): a corrupt record
  raises `CorruptRecordError` naming its shard and offset. ``_getitems`` (Grain's batched-read
  protocol) reads many keys in one pass of those stages.
* A mixture (a list of `crossfeed.Source`): record keys run over the sources one after another,
  source 0's records first (``src.starts[i]`` is source ``i``'s first key); features are the
  mixture's (renamed, shapes and dtypes reconciled as the Loader does). The weights are a
  sampler's business, not the source's: `mix` builds Grain's own weighted mix of the sources.
* Picklable for Grain's worker processes: what travels is the source and its options; each
  process opens the dataset again on its first read.

Options: a `crossfeed.LoaderOptions` or its fields as keywords, through the Loader's one entry
point. Only what to read and how to decode it applies (``split``, ``features``, the `ReadOptions`
fields: ``decode_images``, ``image_size``, ``storage_options``, ``cache_dir`` …); order,
shuffling, sharding and batching are Grain's, and a plan or shard field away from its default is
refused by name. Never imports tensorflow or torch.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Sequence

try:
    import grain
except ModuleNotFoundError as e:  # one line naming the extra that installs it
    from crossfeed.errors import missing_extra

    raise missing_extra(e, "crossfeed.adapters.grain") from None

import numpy as np

from crossfeed.errors import ConfigError
from crossfeed.read.options import LoaderOptions, PlanOptions, ShardOptions
from crossfeed.read.pipeline import Pipeline
from crossfeed.read.sources.dataset import Dataset

__all__ = ["GrainSource", "mix"]

# the fields that say in what order, by whom or in what batches records are read: derived from
# the option groups that hold them, so a new plan or shard option is refused here without a list
_ORDER = (
    *(f.name for f in dataclasses.fields(PlanOptions)),
    *(f.name for f in dataclasses.fields(ShardOptions)),
    "return_index",
)


def _order_fields(options: LoaderOptions) -> list[str]:
    """The order fields of a whole ``options`` away from their defaults (``batch_size`` aside:
    a LoaderOptions always has one, and a random-access source never uses it)."""
    plan, shard = options.plan, options.shard
    away = [
        f.name for f in dataclasses.fields(plan) if getattr(plan, f.name) != getattr(PlanOptions(batch_size=1), f.name)
    ]
    away += [f.name for f in dataclasses.fields(shard) if getattr(shard, f.name) != getattr(ShardOptions(), f.name)]
    return [k for k in away if k != "batch_size"] + (["return_index"] if options.return_index else [])


class GrainSource:
    """A crossfeed split (or mixture) as a Grain random-access data source; see the module docstring.

    ``options``: a `crossfeed.LoaderOptions`, or its fields as keywords — not both (the Loader's
    one entry point, `LoaderOptions.given`, with its defaults and refusals; ``batch_size`` may be
    left out). What to read and how to decode it applies (``split``, ``features``, the
    `ReadOptions` fields); order, shuffling, sharding and batching are the Grain pipeline's, so
    a plan or shard field (given as a keyword, or away from its default in a whole
    LoaderOptions) is refused by name."""

    def __init__(self, source, options: LoaderOptions | None = None, **fields):
        away = sorted(set(fields) & set(_ORDER))
        if not away:
            if options is None:
                fields["batch_size"] = 1  # the Loader's entry point wants one; never used (Grain batches)
            options = LoaderOptions.given(options, fields, who="GrainSource")
            away = _order_fields(options)
        if away:
            raise ConfigError(
                f"GrainSource reads records by key, so {away} do not apply: order, shuffling, sharding and "
                f"batching are the Grain pipeline's (MapDataset.shuffle/batch, IndexSampler)"
            )
        assert options is not None  # made above whenever nothing was refused
        if isinstance(source, Dataset):  # other processes open it again by path, trusting what it was opened with
            options = options.replace(allowed_roots=(*options.read.allowed_roots, *source.allowed_roots))
            source = source.path
        self.source, self.options = source, options  # the read options (the plan's fields never used)
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._pipeline: Pipeline | None = None
        pipeline = self._open()  # every option and the dataset checked here, not in a worker
        self.features = pipeline.features
        # one record of fixed-shape numbers (the Loader's columnar layout) in a local TFRecord split:
        # the split's own record read (CRC checked) costs a third of a one-record batch
        self._direct = (
            pipeline.split is not None
            and pipeline.split.info.format == "tfrecord"
            and not pipeline.dataset.storage.remote
            and all(f.fixed and f.codec.dense for f in self.features)
        )
        self.sources = pipeline.sources  # a mixture's `crossfeed.Source`s (None: one dataset)
        self.starts = _starts(pipeline)
        self._len = int(self.starts[-1])

    def _open(self) -> Pipeline:
        """This process's read pipeline (its frames and decode stages read the records), built once."""
        if self._pipeline is not None and self._pid == os.getpid():
            return self._pipeline
        with self._lock:
            if self._pipeline is None or self._pid != os.getpid():
                # batch_size only satisfies the options: the plan is never used, only `Pipeline.records`
                options = self.options.replace(batch_size=1, shuffle="none", num_threads=0, prefetch=0)
                self._pipeline, self._pid = Pipeline.build(self.source, options), os.getpid()
        return self._pipeline

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, record_key: int) -> dict[str, np.ndarray]:
        key = self._key(record_key)
        pipeline = self._open()
        if self._direct:
            split = pipeline.split
            assert split is not None  # `_direct`: one dataset
            values = split.decode(*split.locate(key), features=[f.name for f in self.features])
            return {f.name: np.array(values[f.name], dtype=f.dtype) for f in self.features}
        batch = pipeline.records([key])
        return {k: _item(v, 0) for k, v in batch.items()}

    def _getitems(self, record_keys: Sequence[int]) -> list[dict[str, np.ndarray]]:
        """Grain's batched read: the records of ``record_keys`` in one pass of the read stages."""
        keys = np.array([self._key(k) for k in record_keys], dtype=np.int64)
        if not len(keys):
            return []
        batch = self._open().records(keys)
        items = list(batch.items())
        return [{k: _item(v, i) for k, v in items} for i in range(len(keys))]

    def _key(self, record_key) -> int:
        try:
            key = int(record_key)
        except (TypeError, ValueError):
            raise ConfigError(f"a record key is an integer in [0, {self._len}), got {record_key!r}") from None
        if not 0 <= key < self._len:
            raise IndexError(f"record key {key} is outside [0, {self._len}) of {self!r}")
        return key

    def where(self, record_key: int) -> str:
        """Where record ``record_key`` lies (shard and byte offset; a mixture's source too)."""
        return self._open().where(self._key(record_key))

    def source_of(self, record_key: int) -> int:
        """Which source of a mixture record ``record_key`` comes from (0 for one dataset)."""
        return int(np.searchsorted(self.starts, self._key(record_key), side="right") - 1)

    def __repr__(self) -> str:
        return f"GrainSource({self.source!r}, {len(self)} records)"

    # -- pickling (Grain's worker processes) ------------------------------------------------------
    def __getstate__(self):
        state = dict(self.__dict__)
        state["_pipeline"], state["_pid"], state["_lock"] = None, None, None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def close(self) -> None:
        """Close this process's open shards."""
        if self._pipeline is not None and self._pid == os.getpid():
            self._pipeline.close()
        self._pipeline = None

    def __enter__(self) -> GrainSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _item(column: np.ndarray, i: int):
    """Row ``i`` of a batch column: an array (0-d for a scalar feature; a view, no copy), or the
    Python object a string, bytes or ragged feature holds."""
    return column[i] if column.dtype == object else column[i, ...]


def _starts(pipeline: Pipeline) -> np.ndarray:
    """Each source's first record key, and the total at the end (one dataset: ``[0, N]``)."""
    return np.asarray(pipeline.starts, dtype=np.int64)


def mix(source: GrainSource, *, seed: int | None = None, weights: Sequence[float] | None = None) -> grain.MapDataset:
    """A mixture's sources mixed by their `crossfeed.Source` weights (or ``weights``) with
    Grain's own ``MapDataset.mix``: each source's records a slice of ``source``'s keys, shuffled
    with ``seed`` first when given (Grain's advice: shuffle before mixing keeps the proportions).
    Grain's mix ends when its shortest source, scaled by its weight, runs out; ``.repeat()``
    each part first for an endless mixture (Grain's semantics, not the Loader's epochs)."""
    sources = source.sources
    if sources is None:
        raise ConfigError(f"{source!r} is one dataset, not a mixture: use grain.MapDataset.source(it)")
    if weights is None:
        for i, s in enumerate(sources):
            if not isinstance(s.weight, (int, float)):  # Grain's mix weighs its parts once, for good
                raise ConfigError(
                    f"source {i} is weighted by a {type(s.weight).__name__}, which Grain's fixed-weight mix cannot "
                    f"follow; pass weights= fixed numbers, or read the scheduled mixture with crossfeed.Loader"
                )
        weights = [float(s.weight) for s in sources]  # type: ignore[arg-type]
    weights = list(weights)
    if len(weights) != len(sources):
        raise ConfigError(f"weights= gives {len(weights)} weights for a mixture of {len(sources)} sources")
    whole = grain.MapDataset.source(source)
    parts = [whole[int(a) : int(b)] for a, b in zip(source.starts[:-1], source.starts[1:])]
    if seed is not None:
        parts = [p.shuffle(seed=seed + i) for i, p in enumerate(parts)]
    return grain.MapDataset.mix(parts, weights=weights)
