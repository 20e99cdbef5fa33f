"""The plan engine and stream sources: Python batches turned into a ``tf.data.Dataset``.

    crossfeed.Loader (plan → fetch → decode → batch, its own workers)   yields dict[str, np.ndarray]
      ─► to_tensors (ragged where shapes vary) ─► Dataset.from_generator(output_signature)
      ─► [take] ─► [repeat] ─► prefetch                                 yields `element_spec` dicts

A stream (``crossfeed.connect(...)`` or any iterable of dict batches) takes the same path without
the Loader. Both run the generator in the Python process that iterates the dataset, so neither
works on ParameterServerStrategy's remote workers; use the native engine there.
"""

from __future__ import annotations

import itertools
import threading
import weakref

import numpy as np
import tensorflow as tf

from crossfeed.adapters import tf_spec
from crossfeed.adapters.tf_options import TFOptions
from crossfeed.errors import ConfigError, SchemaError
from crossfeed.format.schema import INDEX_KEY, SOURCE_KEY, Schema


def _to_ragged(items, spec: tf.RaggedTensorSpec):
    rr = spec.ragged_rank
    arrays = [np.asarray(a) for a in items]
    nested = [
        np.concatenate([np.full(int(np.prod(a.shape[:k])), a.shape[k], np.int64) for a in arrays]) for k in range(rr)
    ]
    dtype = object if spec.dtype == tf.string else spec.dtype.as_numpy_dtype
    values = np.concatenate([a.reshape((-1,) + a.shape[rr:]).astype(dtype, copy=False) for a in arrays])
    return tf.RaggedTensor.from_nested_row_lengths(values, nested, validate=False)


def to_tensors(batch, spec: dict) -> dict:
    """One Python batch (``dict`` of arrays, lists of arrays, lists of str/bytes) as the
    values ``spec`` promises; a missing key or a value that does not fit raises SchemaError."""
    out = {}
    for name, s in spec.items():
        if name not in batch:
            raise SchemaError(
                f"batch has no {name!r}; it has {sorted(batch)} (the element_spec expects {sorted(spec)})"
            )
        v = batch[name]
        try:
            if isinstance(s, tf.RaggedTensorSpec):
                out[name] = v if isinstance(v, tf.RaggedTensor) else _to_ragged(v, s)
            elif s.dtype == tf.string:
                out[name] = np.array(list(v), dtype=object) if s.shape.rank > 1 else np.asarray(v, dtype=object)
            else:
                out[name] = np.asarray(v, dtype=s.dtype.as_numpy_dtype)
        except (ValueError, TypeError) as e:
            raise SchemaError(f"batch value {name!r} does not fit {s}: {e}") from e
    return out


def infer_spec(batch) -> dict:
    """An element_spec read off one dict batch: the leading (batch) dimension becomes None, and
    a list of arrays of different shapes becomes ragged."""
    spec = {}
    for name, v in batch.items():
        if isinstance(v, (tf.Tensor, tf.RaggedTensor)):
            spec[name] = tf.type_spec_from_value(v)._unbatch()._batch(None)
            continue
        if isinstance(v, np.ndarray) and v.dtype == object:
            v = list(v)  # the Loader's and connect()'s form for strings and varying shapes
        if isinstance(v, (list, tuple)) and v and not isinstance(v[0], (str, bytes)):
            arrays = [np.asarray(a) for a in v]
            shapes = {a.shape for a in arrays}
            if len(shapes) > 1:
                ranks = {len(s) for s in shapes}
                if len(ranks) > 1:
                    raise SchemaError(f"batch value {name!r} mixes arrays of ranks {sorted(ranks)}; pass element_spec=")
                dims = [d if len({s[i] for s in shapes}) == 1 else None for i, d in enumerate(arrays[0].shape)]
                rr = 1 + max(i for i, d in enumerate(dims) if d is None)
                spec[name] = tf.RaggedTensorSpec([None, *dims], _np_to_tf(arrays[0].dtype), rr, tf.int64)
                continue
        arr = np.asarray(v)
        if arr.ndim == 0:
            raise SchemaError(f"batch value {name!r} is a scalar; a batch holds one value per sample")
        spec[name] = tf.TensorSpec([None, *arr.shape[1:]], _np_to_tf(arr.dtype))
    return spec


def _np_to_tf(dtype: np.dtype) -> tf.DType:
    return tf.string if dtype.kind in "OSU" else tf.as_dtype(dtype)


def from_batches(
    make_iter, spec: dict, opts: TFOptions, *, take_batches: int | None = None, cardinality: int | None = None
) -> tf.data.Dataset:
    """``from_generator`` over ``make_iter(pass_number)`` (called once per pass over the dataset),
    which yields ``cardinality`` batches per pass when known."""
    passes = itertools.count()
    lock = threading.Lock()

    def gen():
        with lock:
            n = next(passes)
        it = make_iter(n)
        try:
            for batch in it:
                yield to_tensors(batch, spec)
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    out = tf.data.Dataset.from_generator(gen, output_signature=spec)
    return tf_spec.finish(out, opts, take_batches, cardinality)


def build(
    ds,
    opts: TFOptions,
    *,
    state: dict | None = None,
    take_batches: int | None = None,
    loader_options: dict | None = None,
    element_spec: dict | None = None,
) -> tf.data.Dataset:
    """The plan engine: pass ``n`` over the dataset iterates the Loader at epoch ``opts.epoch + n``
    (the first pass resumed from ``state``, a ``Loader.state_dict()``, when given). ``ds``: an
    open dataset, or a mixture (a list of `crossfeed.Source`)."""
    from crossfeed.read.identity import follow_tail
    from crossfeed.read.loader import Loader
    from crossfeed.read.loader import one_sample as sample_of

    options, calls = opts.loader_options(loader_options)
    if state is not None and not opts.tail_chosen:  # drop_last not given: the state's tail (a JAX state's)
        options = follow_tail(options, state)
    source = ds if isinstance(ds, (list, tuple)) else ds.path
    first_epoch = opts.epoch if state is None else int(state["epoch"])
    # Every pass has the same number of batches, counted by the very Loader that delivers them;
    # except after state=, whose first pass is the rest of an epoch: no one cardinality then.
    tokens = options.plan.pack is not None or options.plan.batch_by_tokens is not None
    with Loader(source, options, start=(first_epoch, 0), **calls) as counter:
        # a token Loader's batches per epoch vary with the epoch (its rows depend on the order)
        cardinality = len(counter) if state is None and not tokens else None
        feats = counter.features  # as the batches hold them: renamed, reconciled, images fitted
        stats = _statistics(counter)
        source = counter.pipeline.pinned_source()  # every pass reads this version, whatever is appended
    if element_spec is None and tokens:
        element_spec = tf_spec.token_spec(feats, options)
    one = not opts.batched  # batch_size=None: records one by one, as the native engine gives them
    if element_spec is None and tokens and one:  # one packed row at a time
        element_spec = {k: tf.TensorSpec(s.shape[1:], s.dtype) for k, s in tf_spec.token_spec(feats, options).items()}
    if element_spec is None:
        chosen = tf_spec.select(Schema(feats), None, stats)
        # a filter or skipped samples shorten batches: their leading dimension is not fixed then
        skip = options.plan.skip
        shortened = calls.get("filter") is not None or (skip is not None and len(skip.samples) > 0)
        element_spec = tf_spec.element_spec(
            chosen,
            batch_size=opts.batch_size,
            drop_last=options.plan.drop_last and not shortened,
            return_index=options.return_index,
        )
        if counter.sources is not None and options.return_index:
            element_spec[SOURCE_KEY] = tf.TensorSpec(element_spec[INDEX_KEY].shape, tf.int64)

    passes = Passes()

    def make_iter(n: int):
        loader = Loader(source, options, start=(first_epoch + n, 0), **calls)  # its own files: passes may overlap
        if n == 0 and state is not None:
            loader.load_state_dict(state)
        it = _closing(loader, passes)
        return _samples(it, sample_of) if one else it

    out = from_batches(make_iter, element_spec, opts, take_batches=take_batches, cardinality=cardinality)
    PASSES[out] = passes
    return out


class Passes:
    """The Loaders of one plan-engine dataset's passes: the stats of those done (folded) and of
    those running, summed (`crossfeed.adapters.tf.stats`)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._live: list = []
        self._done = None  # the folded Stats of the closed passes

    def opened(self, loader) -> None:
        with self._lock:
            self._live.append(loader)

    def closed(self, loader) -> None:
        from crossfeed.read.metrics import combine

        stats = loader.stats()
        with self._lock:
            if loader in self._live:
                self._live.remove(loader)
                self._done = stats if self._done is None else combine([self._done, stats])

    def stats(self):
        from crossfeed.read.metrics import Stats, combine

        with self._lock:
            parts = ([self._done] if self._done is not None else []) + [ld.stats() for ld in self._live]
        return combine(parts) if parts else Stats()


# the plan-engine datasets `build` made → their passes (an entry goes with its dataset)
PASSES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _statistics(loader) -> dict:
    """The manifest's per-feature statistics behind ``loader``'s batches, under their names: a
    mixture's only where every source's say its records have one and the same shape (each source
    is a split of its own, its features perhaps renamed)."""
    if loader.sources is None:
        return loader.dataset.splits[loader.options.split].statistics
    per = [
        {src.name_of(k): v for k, v in ds.splits[src.split].statistics.items()}
        for ds, src in zip(loader.datasets, loader.sources)
    ]
    out = {}
    for f in loader.features:
        shapes = [(st.get(f.name) or {}).get("shapes") or {} for st in per]
        counts: list = [(st.get(f.name) or {}).get("count") for st in per]  # ints where the shapes agree
        if (
            all(len(sh) == 1 and sum(sh.values()) == c for sh, c in zip(shapes, counts))
            and len({next(iter(sh)) for sh in shapes}) == 1
        ):
            out[f.name] = {"shapes": {next(iter(shapes[0])): sum(counts)}, "count": sum(counts)}
    return out


def _samples(it, sample_of):
    """The samples of ``it``'s batches of one (``batch_size=None``); closing it closes ``it``."""
    try:
        for batch in it:
            yield sample_of(batch, "the TF plan engine")
    finally:
        it.close()


class _closing:
    """Iterate a Loader once and close it when done (or when the generator is dropped)."""

    def __init__(self, loader, passes: Passes | None = None):
        self._loader, self._passes = loader, passes
        self._it = iter(loader)
        if passes is not None:
            passes.opened(loader)

    def __iter__(self):
        return self._it

    def close(self) -> None:
        if self._passes is not None:
            self._passes.closed(self._loader)
        self._loader.close()


def loader(ds, opts: TFOptions, loader_options: dict | None = None):
    """The Loader the plan engine iterates for ``opts`` (to count batches or make a state): the
    same options object `build` gives its Loaders."""
    from crossfeed.read.loader import Loader

    options, calls = opts.loader_options(loader_options)
    return Loader(ds if isinstance(ds, (list, tuple)) else ds.path, options, start=(opts.epoch, 0), **calls)


def build_stream(source, opts: TFOptions, *, element_spec: dict | None = None) -> tf.data.Dataset:
    """A stream of dict batches (``crossfeed.connect(...)``, or any iterable) as a dataset.

    The spec is, in order of preference: ``element_spec``; the stream's own ``schema`` (a
    crossfeed `Schema`, batch dimension None); else read off the first batch, which is kept and
    delivered. Each pass over the dataset calls ``iter(source)`` again.
    """
    from crossfeed.format.schema import Schema

    first: list = []
    if element_spec is None and isinstance(getattr(source, "schema", None), Schema):
        feats = tf_spec.select(source.schema, opts.features)  # a stream has no statistics
        element_spec = tf_spec.element_spec(feats, batch_size=1, drop_last=False)
    if element_spec is None:
        it = iter(source)
        try:
            first.append(next(it))
        except StopIteration:
            raise ConfigError(
                "the stream ended before its first batch; pass element_spec= to build the "
                "dataset without reading from it"
            ) from None
        element_spec = infer_spec(first[0])
        if opts.features is not None:
            element_spec = {k: element_spec[k] for k in opts.features}
    else:
        it = None

    def make_iter(n: int):
        if n == 0 and it is not None:
            return itertools.chain(first, it)
        return iter(source)

    try:  # a stream that knows its length (batches per pass) has a cardinality
        cardinality = len(source)
    except TypeError:  # no len(), or one that says it has none
        cardinality = None
    return from_batches(make_iter, dict(element_spec), opts, cardinality=cardinality)
