"""crossfeed for TensorFlow: a dataset as a ``tf.data.Dataset``, and input functions for
``tf.distribute``. Imports TensorFlow and the crossfeed core, never torch.

    import crossfeed.adapters.tf as cftf
    ds = cftf.dataset("data/", split="train", batch_size=64, seed=0)     # element_spec from the manifest
    dist = strategy.distribute_datasets_from_function(cftf.input_fn("data/", global_batch_size=256))

Engines
-------
========  ======================================  =============================================
engine    how                                     guarantees
========  ======================================  =============================================
native    TFRecordDataset over the shards,        TF's C++ speed, no Python per batch; runs on
          ``parse_example``, decoding in graph    remote tf.distribute workers (PS strategy).
          (decode_raw / decode_image), AUTOTUNE   Order: seeded shard shuffle + seeded shuffle
          parallel maps and prefetch              buffer (``shuffle_buffer`` records) —
                                                  deterministic for an int seed, but NOT the
                                                  plan's order; ``shuffle="none"`` reads in
                                                  index order. Resume = start the epoch again.
plan      ``Dataset.from_generator`` over a       The sample order of ``crossfeed.Loader`` and
          ``crossfeed.Loader`` (its threads       so of the PyTorch adapter for the same
          fetch and decode)                       (seed, epoch, rank, world_size, shuffle); an
                                                  exact global shuffle; O(1) mid-epoch resume
                                                  from ``state=`` (see `plan_state`); Python
                                                  transforms. Runs in the iterating process
                                                  only (not on PS remote workers).
========  ======================================  =============================================

``engine="auto"`` (the default) picks **plan** when something needs it — ``state=``,
``return_index=True`` or ``loader_options=`` (a transform, threads …), or a remote dataset whose
URL scheme TensorFlow's file systems cannot open — and **native** otherwise. A stream (an
iterable of dict batches, e.g. ``crossfeed.connect(...)``) is neither: it is wrapped as it comes.

Shapes, as the Loader and the PyTorch adapter deliver them: an image or tensor whose records all
have one shape (the manifest's statistics say so) is dense, even where the schema has None dims;
a feature whose record shape varies (variable lists, photos of different sizes) is a
``tf.RaggedTensor`` once batched. The last partial batch is kept (``drop_last=False``, the
Loader's default) and the batch dimension is None; with ``drop_last=True`` it is dropped and the
batch dimension is ``batch_size``. Each pass over a dataset is the next epoch (``epoch``,
``epoch + 1`` …; the native engine reshuffles deterministically from its seed).

Cardinality: every dataset returned here knows its exact number of elements per pass
(``ds.cardinality()``; Keras counts steps and averages metrics by it), counted by the Loader
that delivers them (``loader_options`` included) or from the manifest's record counts (native).
It is checked while iterating. Exceptions: ``state=`` (the first pass is the rest of an epoch,
later passes whole epochs) and streams without ``len()``; there it is unknown.

ParameterServerStrategy
-----------------------
Its workers run the dataset function themselves, all with ``input_pipeline_id == 0``, so nothing
shards across workers; TF's recipe is an endless dataset and a fixed number of scheduled steps::

    fn = cftf.input_fn("data/", global_batch_size=64, repeat=True, seed=None)   # native engine
    per_worker = coordinator.create_per_worker_dataset(
        lambda: strategy.distribute_datasets_from_function(fn))
    it = iter(per_worker)
    for _ in range(steps):
        coordinator.schedule(train_step, args=(it,))
    coordinator.join()

``seed=None`` lets every worker shuffle differently (with an int seed all workers read the same
order). When a worker restarts, the coordinator rebuilds its dataset from the function and its
iterator starts over from the beginning of a fresh shuffle; the steps it was running are
re-scheduled on other workers. Data is therefore seen "about uniformly", not exactly once per
epoch: PS training gives no epoch boundary. Use the plan engine on a single host, or the native
engine with MultiWorkerMirroredStrategy (``input_fn`` shards by input pipeline), for exact epochs.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import tensorflow as tf

from crossfeed.adapters import tf_native, tf_plan, tf_spec
from crossfeed.adapters.tf_options import Engine, Shuffle, TFOptions
from crossfeed.errors import ConfigError
from crossfeed.read.dataset import Dataset, open_dataset
from crossfeed.read.options import LoaderOptions, Source

__all__ = ["Engine", "Shuffle", "dataset", "element_spec", "feature_spec", "input_fn", "plan_state", "train_keras_demo"]


def _open(source, split: str | None = None) -> Dataset:
    ds = open_dataset(source)
    if split is not None and split not in ds:
        raise ConfigError(f"{ds.path}: no split {split!r}; it has {sorted(ds.splits)}")
    return ds


def _is_dataset_source(source) -> bool:
    return isinstance(source, (str, os.PathLike, Dataset))


def feature_spec(source, *, features=None) -> dict:
    """The ``tf.io.parse_example`` spec of a dataset, for plain tf.data pipelines. Tensor features
    parse as raw bytes (decode with ``tf.io.decode_raw``, little-endian), images as encoded bytes;
    a tensor whose shape varies has a ``<name>/shape`` int64 entry beside it."""
    return tf_spec.feature_spec(tf_spec.select(_open(source).schema, features))


def element_spec(
    source,
    *,
    split: str = "train",
    batch_size: int | None = None,
    drop_last: bool = False,
    features=None,
    return_index: bool = False,
) -> dict:
    """The ``element_spec`` that `dataset` yields for these options, read off the manifest."""
    ds = _open(source, split)
    feats = tf_spec.select(ds.schema, features, ds.splits[split].statistics)
    return tf_spec.element_spec(feats, batch_size=batch_size, drop_last=drop_last, return_index=return_index)


_DATASET_DEFAULTS = dict(
    split="train",
    batch_size=None,
    shuffle="global",
    seed=0,
    drop_last=False,
    features=None,
    rank=0,
    world_size=1,
    return_index=False,
)


def _is_mixture(source) -> bool:
    return isinstance(source, (list, tuple)) and bool(source) and all(isinstance(s, Source) for s in source)


def _tf_can_open(url: str) -> bool:
    try:
        tf.io.gfile.exists(url)
    except (tf.errors.UnimplementedError, tf.errors.InvalidArgumentError):
        return False
    return True


def _resolve(ds: Dataset, opts: TFOptions, *, state, loader_options) -> Engine:
    wants_plan = [
        why
        for why, on in (
            ("state=", state is not None),
            ("return_index=True", opts.return_index),
            ("loader_options=", bool(loader_options)),
        )
        if on
    ]
    if ds[opts.split].info.format != "tfrecord":  # Parquet read in place: only the Loader reads it
        if opts.engine is Engine.NATIVE:
            raise ConfigError("engine='native' reads TFRecord shards; this split is Parquet: use engine='plan'")
        return Engine.PLAN
    if opts.engine is Engine.NATIVE:
        if wants_plan:
            raise ConfigError(f"engine='native' cannot honour {', '.join(wants_plan)}; use engine='plan'")
        return Engine.NATIVE
    if opts.engine is Engine.PLAN or wants_plan:
        return Engine.PLAN
    if ds.storage.remote and not _tf_can_open(ds.storage.url(ds[opts.split].shards[0].file)):
        return Engine.PLAN
    return Engine.NATIVE


def dataset(
    source,
    *,
    split: str = "train",
    batch_size: int | None = None,
    shuffle: str | bool = "global",
    seed: int | None = 0,
    epoch: int = 0,
    drop_last: bool = False,
    features=None,
    engine: str = "auto",
    rank: int = 0,
    world_size: int = 1,
    shuffle_buffer: int = 4096,
    repeat: bool = False,
    return_index: bool = False,
    num_parallel_calls: int | None = None,
    prefetch: int | None = None,
    state: dict | None = None,
    loader_options: dict | None = None,
    element_spec: dict | None = None,
    options: LoaderOptions | None = None,
) -> tf.data.Dataset:
    """A ``tf.data.Dataset`` of ``dict`` elements (batches of ``batch_size``, or records when None).

    ``options``: a `crossfeed.LoaderOptions`, passed whole to the plan engine's Loader (then the
    keywords it covers — split, batch_size, shuffle, seed, drop_last, features, rank, world_size,
    return_index — are taken from it and must be left at their defaults). ``source`` may also be a
    mixture, a list of `crossfeed.Source` (plan engine).

    ``source``: a dataset path/URL or an open `crossfeed.Dataset`; or a stream — any iterable of
    dict batches such as ``crossfeed.connect(...)`` — whose spec is ``element_spec`` or read off
    its first batch. ``rank``/``world_size`` read one equal share (for tf.distribute use
    `input_fn`). ``state``: a ``Loader.state_dict()`` to resume from (plan engine).
    ``loader_options``: extra ``crossfeed.Loader`` keywords (plan engine); when a transform
    changes the batch, pass its ``element_spec``. See the module docstring for the engines.
    """
    tf_only = dict(
        epoch=epoch,
        engine=engine,
        shuffle_buffer=shuffle_buffer,
        repeat=repeat,
        num_parallel_calls=num_parallel_calls,
        prefetch=prefetch,
    )
    shared = dict(
        split=split,
        batch_size=batch_size,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
        features=features,
        rank=rank,
        world_size=world_size,
        return_index=return_index,
    )
    if options is not None:
        given = sorted(k for k, v in shared.items() if v != _DATASET_DEFAULTS[k])
        if given:
            raise ConfigError(f"options= carries {given}; pass them in the LoaderOptions, not both")
        if not isinstance(options, LoaderOptions):
            raise ConfigError(f"options must be a crossfeed.LoaderOptions, got {type(options).__name__}")
        opts = TFOptions.from_loader(options, **tf_only)
    else:
        opts = TFOptions(**shared, **tf_only)
    if _is_mixture(source):
        if opts.engine is Engine.NATIVE:
            raise ConfigError("a mixture is read by the plan engine; use engine='plan' or 'auto'")
        return tf_plan.build(list(source), opts, state=state, loader_options=loader_options, element_spec=element_spec)
    if not _is_dataset_source(source):
        if opts.engine is Engine.NATIVE or state is not None or loader_options:
            raise ConfigError(
                "a stream source is read as it comes: engine='native', state= and loader_options= need a dataset path"
            )
        if not hasattr(source, "__iter__"):
            raise ConfigError(
                f"source must be a dataset path, a crossfeed.Dataset or an iterable of dict batches, "
                f"got {type(source).__name__}"
            )
        return tf_plan.build_stream(source, opts, element_spec=element_spec)
    ds = _open(source, opts.split)
    if opts.loader is not None and opts.engine is Engine.AUTO:  # options passed whole: the Loader reads them
        opts = dataclasses.replace(opts, engine=Engine.PLAN)
    if _resolve(ds, opts, state=state, loader_options=loader_options) is Engine.NATIVE:
        if element_spec is not None:
            raise ConfigError(
                "element_spec= is for streams and plan-engine transforms; the native engine's comes from the manifest"
            )
        return tf_native.build(ds, opts)
    return tf_plan.build(ds, opts, state=state, loader_options=loader_options, element_spec=element_spec)


def input_fn(
    source,
    *,
    split: str = "train",
    global_batch_size: int,
    shuffle: str | bool = "global",
    seed: int | None = 0,
    epoch: int = 0,
    features=None,
    engine: str = "auto",
    shuffle_buffer: int = 4096,
    repeat: bool = False,
    num_parallel_calls: int | None = None,
    prefetch: int | None = None,
    loader_options: dict | None = None,
) -> Callable[[tf.distribute.InputContext], tf.data.Dataset]:
    """A function of ``tf.distribute.InputContext`` for ``strategy.distribute_datasets_from_function``.

    Pipeline ``input_pipeline_id`` of ``num_input_pipelines`` reads its share (whole shards when
    there are at least as many shards as pipelines, else every n-th record), batched at the
    per-replica batch size, and yields exactly ``steps × replicas-per-pipeline`` batches, with
    ``steps`` the same for every replica (so no replica waits for a batch that never comes): the
    smallest share's full global batches. With ``repeat=True`` that epoch repeats forever.
    """
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ConfigError(f"global_batch_size must be a positive int, got {global_batch_size!r}")
    ds = _open(source, split)
    common = dict(
        split=split,
        shuffle=shuffle,
        seed=seed,
        epoch=epoch,
        drop_last=True,
        features=features,
        shuffle_buffer=shuffle_buffer,
        repeat=repeat,
        num_parallel_calls=num_parallel_calls,
        prefetch=prefetch,
    )
    engine_ = _resolve(
        ds, TFOptions(batch_size=global_batch_size, engine=engine, **common), state=None, loader_options=loader_options
    )

    def fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        n, replicas = ctx.num_input_pipelines, ctx.num_replicas_in_sync
        if global_batch_size % replicas:
            raise ConfigError(
                f"global_batch_size {global_batch_size} does not divide by the {replicas} replicas "
                f"in sync; make it a multiple"
            )
        per = global_batch_size // replicas
        local = max(1, replicas // n)  # replicas fed by this pipeline, one batch each per step
        opts = TFOptions(batch_size=per, engine=engine_, rank=ctx.input_pipeline_id, world_size=n, **common)
        if engine_ is Engine.NATIVE:
            batches = min(tf_native.shares(ds[split].counts, n)[1]) // per
        else:
            with tf_plan.loader(ds, opts, loader_options) as ld:  # the Loader that will deliver
                batches = len(ld)
        steps = batches // local
        if steps == 0:
            raise ConfigError(
                f"split {split!r} has too few records for one step of global batch {global_batch_size} "
                f"over {n} input pipeline(s); use a smaller batch"
            )
        if engine_ is Engine.NATIVE:
            return tf_native.build(ds, opts, take_batches=steps * local)
        return tf_plan.build(ds, opts, take_batches=steps * local, loader_options=loader_options)

    return fn


def plan_state(
    source,
    *,
    split: str = "train",
    batch_size: int,
    seed: int = 0,
    epoch: int = 0,
    steps: int,
    shuffle: str = "global",
    world_size: int = 1,
    drop_last: bool = False,
) -> dict:
    """The ``Loader.state_dict()`` after ``steps`` batches of ``epoch`` were consumed on every rank:
    pass it as ``dataset(..., state=...)`` to resume exactly there (with the PyTorch adapter too).
    Keras users take ``steps`` from ``optimizer.iterations`` modulo the steps per epoch."""
    if not isinstance(steps, int) or steps < 0:
        raise ConfigError(f"steps must be an int >= 0, got {steps!r}")
    opts = TFOptions(
        split=split,
        batch_size=batch_size,
        shuffle=shuffle,
        seed=seed,
        epoch=epoch,
        drop_last=drop_last,
        engine=Engine.PLAN,
        world_size=world_size,
    )
    with tf_plan.loader(_open(source, split), opts) as ld:
        state = ld.state_dict()
        state["position"] = ld.sampler.position_after(0, steps)
    return state


def train_keras_demo(dataset_path, *, steps: int = 100, batch_size: int = 64, **kwargs) -> dict:
    """Train a tiny Keras model on a dataset under MirroredStrategy; see `crossfeed.adapters.tf_demo`."""
    from crossfeed.adapters.tf_demo import train_keras_demo as run

    return run(dataset_path, steps=steps, batch_size=batch_size, **kwargs)
