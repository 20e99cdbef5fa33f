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

    fn = cftf.input_fn("data/", global_batch_size=64, repeat=True, seed=None, engine="native")
    per_worker = coordinator.create_per_worker_dataset(
        lambda: strategy.distribute_datasets_from_function(fn))
    it = iter(per_worker)
    for _ in range(steps):
        coordinator.schedule(train_step, args=(it,))
    coordinator.join()

``seed=None`` (with ``engine="native"`` said: an unseeded order is never picked for you) lets every
worker shuffle differently (with an int seed all workers read the same order). When a worker restarts, the coordinator rebuilds its dataset from the function and its
iterator starts over from the beginning of a fresh shuffle; the steps it was running are
re-scheduled on other workers. Data is therefore seen "about uniformly", not exactly once per
epoch: PS training gives no epoch boundary. Use the plan engine on a single host, or the native
engine with MultiWorkerMirroredStrategy (``input_fn`` shards by input pipeline), for exact epochs.
"""

from __future__ import annotations

from collections.abc import Callable

try:
    import tensorflow as tf
except ModuleNotFoundError as e:  # one line naming the extra that installs it
    from crossfeed.errors import missing_extra

    raise missing_extra(e, "crossfeed.adapters.tf") from None

from crossfeed.adapters import tf_native, tf_plan, tf_spec
from crossfeed.adapters.tf_options import Engine, TFOptions
from crossfeed.errors import ConfigError
from crossfeed.read.options import LoaderOptions, Shuffle
from crossfeed.read.pipeline import SourceKind, classify, sources_of
from crossfeed.read.sources.dataset import Dataset, open_dataset

__all__ = ["Engine", "Shuffle", "dataset", "element_spec", "feature_spec", "input_fn", "plan_state", "stats"]


def _open(source, split: str | None = None, opts: TFOptions | None = None) -> Dataset:
    read = None if opts is None else opts.loader.read
    ds = open_dataset(
        source,
        allowed_roots=() if read is None else read.allowed_roots,
        read_timeout=None if read is None else read.read_timeout,
        storage_options=None if read is None else read.storage_options,
    )
    if split is not None and split not in ds:
        raise ConfigError(f"{ds.path}: no split {split!r}; it has {sorted(ds.splits)}")
    return ds


def feature_spec(source, *, features=None) -> dict:
    """The ``tf.io.parse_example`` spec of a dataset, for plain tf.data pipelines. Tensor features
    parse as raw bytes (decode with ``tf.io.decode_raw``, little-endian), images as encoded bytes;
    a tensor whose shape varies has a ``<name>/shape`` int64 entry beside it."""
    return tf_spec.feature_spec(tf_spec.select(_open(source).schema, features))


def element_spec(source, options: LoaderOptions | None = None, *, keep_dtypes: bool = False, **fields) -> dict:
    """The ``element_spec`` that `dataset` yields for these options (as `dataset` takes them),
    read off the manifest."""
    spec = _stored_spec(source, options, fields)
    return spec if keep_dtypes else tf_spec.widen_spec(spec)


def _stored_spec(source, options: LoaderOptions | None, fields: dict) -> dict:
    opts = TFOptions.make(options, fields)
    ds = _open(source, opts.split, opts)
    plan = opts.loader.plan
    if plan.pack is not None or plan.batch_by_tokens is not None:
        with tf_plan.loader(ds, opts) as ld:  # the features the token Loader reads, as it reads them
            return tf_spec.token_spec(ld.features, opts.loader)
    feats = tf_spec.select(ds.schema, opts.features, ds.splits[opts.split].statistics)
    fit = opts.loader.read.image_fit
    if fit is not None:  # images come at the fit's size and channels
        feats = [fit.feature(f) for f in feats]
    return tf_spec.element_spec(
        feats, batch_size=opts.batch_size, drop_last=opts.drop_last, return_index=opts.return_index
    )


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
            ("image_size=/channels=", opts.loader.read.image_fit is not None),
            ("log_stats=True", opts.loader.read.log_stats),  # the Loader's stage metrics: the plan engine's
            (
                "pack=/batch_by_tokens=",
                opts.loader.plan.pack is not None or opts.loader.plan.batch_by_tokens is not None,
            ),
            ("weights=", opts.loader.plan.weights is not None),  # drawn by weight: the Loader's plan
            # TF's own file systems read the shards natively: fsspec's options do not reach them
            ("storage_options=", bool(opts.loader.read.storage_options) and ds.storage.remote),
        )
        if on
    ]
    if ds[opts.split].info.format != "tfrecord":  # tar shards read in place: TFRecordDataset cannot
        wants_plan.append(f"{ds[opts.split].info.format} shards")
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
    options: LoaderOptions | None = None,
    *,
    engine: str = "auto",
    epoch: int = 0,
    shuffle_buffer: int = 4096,
    repeat: bool = False,
    num_parallel_calls: int | None = None,
    tf_prefetch: int | None = None,
    keep_dtypes: bool = False,
    state: dict | None = None,
    loader_options: dict | None = None,
    element_spec: dict | None = None,
    **fields,
) -> tf.data.Dataset:
    """A ``tf.data.Dataset`` of ``dict`` elements (batches of ``batch_size``, or records when it is
    left out).

    ``options``: a `crossfeed.LoaderOptions`, passed whole to the plan engine's Loader; or its
    fields as keywords (``split``, ``batch_size``, ``shuffle``, ``seed``, ``drop_last``,
    ``features``, ``rank``, ``world_size``, ``return_index``, ``num_threads`` …), with the
    Loader's defaults and validation — not both. TensorFlow's own: ``batch_size`` left out (or
    None) reads records; ``seed=None`` with ``engine="native"`` shuffles differently on every
    worker (refused otherwise, as every front end refuses it);
    ``tf_prefetch`` is tf.data's prefetch (None: AUTOTUNE), ``prefetch`` the Loader's. Unsigned
    integers past uint8 (token ids stored as uint16/uint32) arrive as int32 (uint16) or int64,
    what Keras embeddings and sparse losses take; ``keep_dtypes=True`` keeps them as stored
    (`crossfeed.adapters.int_dtypes`). ``source`` may
    also be a mixture, a list of `crossfeed.Source` (plan engine).

    ``source``: a dataset path/URL or an open `crossfeed.Dataset`; or a stream — any iterable of
    dict batches such as ``crossfeed.connect(...)`` — whose spec is ``element_spec`` or read off
    its first batch. ``rank``/``world_size`` read one equal share (for tf.distribute use
    `input_fn`). ``state``: a ``Loader.state_dict()`` to resume from (plan engine).
    ``loader_options``: extra ``crossfeed.Loader`` keywords for the plan engine (``transform``,
    ``batch_transform``, or option fields); when a transform changes the batch, pass its
    ``element_spec``. See the module docstring for the engines.
    """
    opts = TFOptions.make(
        options,
        fields,
        epoch=epoch,
        engine=engine,
        shuffle_buffer=shuffle_buffer,
        repeat=repeat,
        num_parallel_calls=num_parallel_calls,
        tf_prefetch=tf_prefetch,
        keep_dtypes=keep_dtypes,
    )
    kind = classify(source)
    if kind is SourceKind.MIXTURE:
        if opts.engine is Engine.NATIVE:
            raise ConfigError("a mixture is read by the plan engine; use engine='plan' or 'auto'")
        mixture = list(sources_of(source) or ())
        return tf_plan.build(mixture, opts, state=state, loader_options=loader_options, element_spec=element_spec)
    if kind is SourceKind.STREAM:
        if opts.engine is Engine.NATIVE or state is not None or loader_options:
            raise ConfigError(
                "a stream source is read as it comes: engine='native', state= and loader_options= need a dataset path"
            )
        return tf_plan.build_stream(source, opts, element_spec=element_spec)
    ds = _open(source, opts.split, opts)
    if opts.whole and opts.engine is Engine.AUTO:  # options passed whole: the Loader reads them
        opts = opts.replace(engine=Engine.PLAN)
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
    global_batch_size: int,
    engine: str = "auto",
    epoch: int = 0,
    shuffle_buffer: int = 4096,
    repeat: bool = False,
    num_parallel_calls: int | None = None,
    tf_prefetch: int | None = None,
    keep_dtypes: bool = False,
    loader_options: dict | None = None,
    **fields,
) -> Callable[[tf.distribute.InputContext], tf.data.Dataset]:
    """A function of ``tf.distribute.InputContext`` for ``strategy.distribute_datasets_from_function``.

    Pipeline ``input_pipeline_id`` of ``num_input_pipelines`` reads its share (whole shards when
    there are at least as many shards as pipelines, else every n-th record), batched at the
    per-replica batch size, and yields exactly ``steps × replicas-per-pipeline`` batches, with
    ``steps`` the same for every replica (so no replica waits for a batch that never comes): the
    smallest share's full global batches. With ``repeat=True`` that epoch repeats forever.
    ``fields``: Loader options (``split``, ``shuffle``, ``seed``, ``features`` …) as for `dataset`;
    the batch size, rank and world size are the input context's.
    """
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ConfigError(f"global_batch_size must be a positive int, got {global_batch_size!r}")
    taken = sorted(k for k in ("batch_size", "rank", "world_size", "drop_last") if k in fields)
    if taken:
        raise ConfigError(f"input_fn sets {taken} from the input context and global_batch_size; leave them out")
    tf_fields = dict(
        epoch=epoch,
        shuffle_buffer=shuffle_buffer,
        repeat=repeat,
        num_parallel_calls=num_parallel_calls,
        tf_prefetch=tf_prefetch,
        keep_dtypes=keep_dtypes,
    )
    base = TFOptions.make(
        None,
        {**fields, "batch_size": global_batch_size, "drop_last": True, "rank": 0, "world_size": 1},
        engine=engine,
        **tf_fields,
    )
    ds = _open(source, base.split, base)
    engine_ = _resolve(ds, base, state=None, loader_options=loader_options)

    def fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        n, replicas = ctx.num_input_pipelines, ctx.num_replicas_in_sync
        if global_batch_size % replicas:
            raise ConfigError(
                f"global_batch_size {global_batch_size} does not divide by the {replicas} replicas "
                f"in sync; make it a multiple"
            )
        per = global_batch_size // replicas
        local = max(1, replicas // n)  # replicas fed by this pipeline, one batch each per step
        opts = base.replace(batch_size=per, engine=engine_, rank=ctx.input_pipeline_id, world_size=n)
        if engine_ is Engine.NATIVE:
            batches = min(tf_native.shares(ds[opts.split].counts, n)[1]) // per
        else:
            with tf_plan.loader(ds, opts, loader_options) as ld:  # the Loader that will deliver
                batches = len(ld)
        steps = batches // local
        if steps == 0:
            raise ConfigError(
                f"split {opts.split!r} has too few records for one step of global batch {global_batch_size} "
                f"over {n} input pipeline(s); use a smaller batch"
            )
        if engine_ is Engine.NATIVE:
            return tf_native.build(ds, opts, take_batches=steps * local)
        return tf_plan.build(ds, opts, take_batches=steps * local, loader_options=loader_options)

    return fn


def stats(ds: tf.data.Dataset):
    """The stage metrics (`crossfeed.read.metrics.Stats`) of every pass so far over ``ds``, a
    dataset `dataset` returned with the plan engine: the Loader of each pass, summed (``.verdict()``
    says whether the training loop waits on input). The native engine reads the shards with
    TensorFlow's own ops: it has no Loader to time (use ``tf.data.experimental.AUTOTUNE`` stats or the
    TensorFlow profiler there), and ``stats`` raises for it."""
    passes = tf_plan.PASSES.get(ds)
    if passes is None:
        raise ConfigError(
            "stats() takes a dataset crossfeed.adapters.tf.dataset(...) returned with the plan engine (engine='plan', "
            "or any option only the plan engine has), itself — not one derived from it with .map/.batch"
        )
    return passes.stats()


def plan_state(source, options: LoaderOptions | None = None, *, steps: int, epoch: int = 0, **fields) -> dict:
    """The ``Loader.state_dict()`` after ``steps`` batches of ``epoch`` were consumed on every rank:
    pass it as ``dataset(..., state=...)`` to resume exactly there (with the PyTorch adapter too).
    ``options``/``fields``: the Loader options of the run (``batch_size``, ``seed``, ``shuffle``,
    ``world_size`` …). Keras users take ``steps`` from ``optimizer.iterations`` modulo the steps
    per epoch."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ConfigError(f"steps must be an int >= 0, got {steps!r}")
    if options is None:
        if "world_size" in fields:
            fields.setdefault("rank", 0)  # the state is the plan's: every rank's is the same
        if fields.get("batch_size") is None:
            raise ConfigError("plan_state needs batch_size= (or a LoaderOptions)")
    opts = TFOptions.make(options, fields, epoch=epoch, engine=Engine.PLAN)
    with tf_plan.loader(_open(source, opts.split, opts), opts) as ld:
        state = ld.state_at(ld.epoch, ld.position_after(0, steps, epoch=epoch))
    return state
