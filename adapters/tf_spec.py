"""The manifest's schema in TensorFlow terms: the ``tf.io.parse_example`` spec, the
``element_spec`` a reader yields, and the in-graph decoders from parsed Example fields to
tensors — each feature's codec (`crossfeed.format.codecs`) says its part. Nothing here reads data.

=========  ==================================  ===============================================
encoding   parsed as                           decoded to
=========  ==================================  ===============================================
tensor     FixedLenFeature([], string)         decode_raw (little-endian) + reshape to the
           (+ ``<name>/shape`` int64 list       schema shape, or to ``<name>/shape`` per record
           when the shape has None dims)
image      FixedLenFeature([], string)         decode_image(expand_animations=False), uint8 HWC
int64      FixedLenFeature(shape, int64)       int64 of the shape; ``(None,)``: RaggedFeature
float      FixedLenFeature(shape, float32)     float32 of the shape; ``(None,)``: RaggedFeature
bytes      FixedLenFeature(shape, string)      tf.string; ``(None,)``: RaggedFeature
=========  ==================================  ===============================================
"""

from __future__ import annotations

import dataclasses

try:
    import tensorflow as tf
except ModuleNotFoundError as e:  # one line naming the extra that installs it
    from crossfeed.errors import missing_extra

    raise missing_extra(e, "crossfeed.adapters.tf") from None

from crossfeed.adapters import int_dtypes
from crossfeed.errors import SchemaError
from crossfeed.format.schema import INDEX_KEY, Feature, Schema


def tf_dtype(f: Feature) -> tf.DType:
    return f.codec.tf_dtype(f, tf)


def select(schema: Schema, features, statistics: dict | None = None) -> list[Feature]:
    """The features to read, in schema order (``None``: all).

    Dense vs ragged: an image or tensor feature whose schema shape has None dimensions is given
    the one shape every record of the split has when the split's ``statistics`` (manifest) say
    so — dense, as the Loader and the PyTorch adapter deliver it; ragged only when shapes vary.
    """
    if features is None:
        feats = list(schema)
    else:
        unknown = [n for n in features if n not in schema.names]
        if unknown:
            raise SchemaError(f"features {unknown} are not in the dataset; it has {schema.names}")
        feats = [f for f in schema if f.name in features]
    return [_fixed_by_statistics(f, (statistics or {}).get(f.name)) for f in feats]


def _fixed_by_statistics(f: Feature, stats: dict | None) -> Feature:
    if f.codec.listed or not stats:
        return f
    known = item_shape(f)
    if None not in known:
        return f
    shapes = stats.get("shapes") or {}
    if len(shapes) != 1 or sum(shapes.values()) != stats.get("count"):
        return f  # shapes vary (or the statistics do not cover every record)
    (key,) = shapes
    try:
        shape = tuple(int(d) for d in key.split("x")) if key else ()
    except ValueError:
        return f
    if len(shape) != len(known) or any(k is not None and k != d for k, d in zip(known, shape)):
        return f
    return dataclasses.replace(f, shape=shape)


def item_shape(f: Feature) -> tuple:
    """The shape of one decoded record of ``f`` (None where it varies)."""
    return f.codec.item_shape(f)


def per_record(feats) -> bool:
    """True when decoding must run per record before batching: images, and tensors whose
    shape varies (each record carries its own ``<name>/shape``)."""
    return any(f.codec.tf_per_record(f) for f in feats)


def feature_spec(feats) -> dict:
    """``{name: tf.io.*Feature}`` for ``tf.io.parse_example`` (plus ``<name>/shape`` entries)."""
    spec = {}
    for f in feats:
        spec.update(f.codec.tf_parse_spec(f, tf))
    return spec


def element_spec(feats, *, batch_size: int | None, drop_last: bool, return_index: bool = False) -> dict:
    """What one element of the reader is: ``{name: TensorSpec | RaggedTensorSpec}``.

    Batched, the leading dimension is ``batch_size`` with drop_last, else None. A feature whose
    record shape varies is a RaggedTensor batched (ragged up to its last varying dimension).
    """
    out = {}
    lead = () if batch_size is None else ((batch_size if drop_last else None),)
    for f in feats:
        shape = item_shape(f)
        if batch_size is not None and None in shape:
            ragged_rank = 1 + max(i for i, d in enumerate(shape) if d is None)
            out[f.name] = tf.RaggedTensorSpec(lead + shape, tf_dtype(f), ragged_rank, tf.int64)
        else:
            out[f.name] = tf.TensorSpec(lead + shape, tf_dtype(f))
    if return_index:
        out[INDEX_KEY] = tf.TensorSpec(lead, tf.int64)
    return out


def token_spec(feats, options) -> dict:
    """The element_spec of a token Loader (`crossfeed.read.stages.pack`): ``pack=`` gives dense
    ``(batch_size, length)`` rows of each packed feature with ``segment_ids`` and ``positions``
    (int32; not with ``segments=False``), a static shape; ``batch_by_tokens=`` the same names, ``(None, None)`` (rows and
    width vary from batch to batch)."""
    pack = options.plan.pack
    shape = (options.batch_size, pack.length) if pack is not None else (None, None)
    out = {f.name: tf.TensorSpec(shape, tf_dtype(f)) for f in feats}
    if pack is None or pack.segments:  # Pack(segments=False): the features alone
        out["segment_ids"] = out["positions"] = tf.TensorSpec(shape, tf.int32)
    return out


def make_decoder(feats):
    """``parsed -> decoded``: runs on one record, or (when not `per_record`) on a batch."""

    def decode(parsed: dict) -> dict:
        return {f.name: f.codec.tf_decode(f, parsed[f.name], parsed, tf) for f in feats}

    return decode


def batches(records: int, opts) -> int:
    """Elements a pass yields over ``records`` records: records, or batches (a partial last batch
    counts unless ``drop_last``)."""
    if opts.batch_size is None:
        return records
    return records // opts.batch_size if opts.drop_last else -(-records // opts.batch_size)


def widen_ints(out: tf.data.Dataset) -> tf.data.Dataset:
    """``out`` with every uint16 feature as int32 and uint32/uint64 as int64, the index dtypes
    TensorFlow's and Keras's ops take (`crossfeed.adapters.int_dtypes`); unchanged without any."""
    spec = out.element_spec
    to = _widened(spec) if isinstance(spec, dict) else {}
    if not to:
        return out
    return out.map(
        lambda e: {k: (tf.cast(v, to[k]) if k in to else v) for k, v in e.items()},
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )


def _widened(spec: dict) -> dict:
    """``{name: tf.DType}`` of the features of ``spec`` that `widen_ints` casts."""
    to = {}
    for name, s in spec.items():
        target = int_dtypes.tf_dtype(s.dtype.as_numpy_dtype) if s.dtype.is_integer else None
        if target is not None:
            to[name] = tf.as_dtype(target)
    return to


def widen_spec(spec: dict) -> dict:
    """``spec`` as `widen_ints` leaves it."""
    to = _widened(spec)
    out = dict(spec)
    for name, dtype in to.items():
        s = spec[name]
        if isinstance(s, tf.RaggedTensorSpec):
            out[name] = tf.RaggedTensorSpec(s.shape, dtype, s.ragged_rank, s.row_splits_dtype)
        else:
            out[name] = tf.TensorSpec(s.shape, dtype, s.name)
    return out


def finish(out: tf.data.Dataset, opts, take_batches: int | None, cardinality: int | None = None) -> tf.data.Dataset:
    """The tail both engines share: unsigned integers past uint8 widened (`widen_ints`), the
    exact cardinality (what Keras counts steps and metrics by; checked while iterating), a fixed
    number of batches, repetition, prefetch."""
    if not getattr(opts, "keep_dtypes", False):
        out = widen_ints(out)
    if cardinality is not None:
        out = out.apply(tf.data.experimental.assert_cardinality(cardinality))
    if take_batches is not None:
        out = out.take(take_batches)
    if opts.repeat:
        out = out.repeat()
    if opts.tf_prefetch != 0:
        out = out.prefetch(tf.data.AUTOTUNE if opts.tf_prefetch is None else opts.tf_prefetch)
    return out
