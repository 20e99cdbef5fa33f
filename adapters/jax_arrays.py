"""The JAX adapter's batch assembly: one process's numpy batch (the Loader's, or a stream's) as
global ``jax.Array``\\ s laid out by a `jax.sharding.Sharding`, dense and of static shape.

    dict[str, np.ndarray] (this process's rows) ─► dense (pad_to; refuse ragged and strings)
      ─► jax.make_array_from_process_local_data(sharding, rows, global shape) ─► dict[str, jax.Array]

The numpy arrays are handed to JAX as they are (views into the Loader's batch, no copy made
here); JAX copies them to the devices. In one process the global batch is all local, so one
``jax.device_put`` call places every feature (the same layout, one dispatch). 64-bit values become 32-bit unless ``jax_enable_x64`` is
on (JAX's rule), which costs a conversion on the host.

Imports jax and the crossfeed core, never torch or tensorflow.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
import numpy as np

from crossfeed.errors import ConfigError, SchemaError
from crossfeed.format.schema import Encoding, Feature

PAD_VALUE = 0  # what pad_to fills with


def default_sharding() -> jax.sharding.NamedSharding:
    """The batch axis split over every device of every process (plain data parallelism)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("batch",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("batch"))


def batch_shards(sharding: jax.sharding.Sharding) -> int | None:
    """How many pieces a `NamedSharding` cuts the batch axis into (None: not a NamedSharding)."""
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return None
    spec = tuple(sharding.spec)
    axes = spec[0] if spec else None
    if axes is None:
        return 1
    axes = axes if isinstance(axes, tuple) else (axes,)
    return math.prod(sharding.mesh.shape[a] for a in axes)


def check_pad_to(pad_to) -> dict[str, int]:
    """``pad_to`` as ``{feature: length}``, validated."""
    if pad_to is None:
        return {}
    if not isinstance(pad_to, Mapping):
        raise ConfigError(f"pad_to must be a dict {{feature: length}}, got {type(pad_to).__name__}")
    out = {}
    for name, length in pad_to.items():
        if not isinstance(name, str) or isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ConfigError(f"pad_to: {name!r}: {length!r} is not a feature name and a length >= 1")
        out[name] = int(length)
    return out


def check_features(features: tuple[Feature, ...], pad_to: dict[str, int], statistics: list[dict]) -> None:
    """Refuse, before anything is read, what would not be one dense numeric shape in every batch:
    strings and bytes, and a feature whose shape has a None dimension that the split statistics
    of every source (``statistics``: one ``{feature: stats}`` per source, under the batch's
    names) do not show to be one shape for every record — unless ``pad_to`` pads it. (A batch
    that happens to hold equal shapes would otherwise pass, and the next change the shape.)"""
    names = [f.name for f in features]
    unknown = sorted(set(pad_to) - set(names))
    if unknown:
        raise ConfigError(f"pad_to names {unknown}, which the batches do not hold; they hold {names}")
    text = [f.name for f in features if f.encoding is Encoding.BYTES]
    if text:
        keep = [n for n in names if n not in text]
        raise ConfigError(
            f"feature(s) {text} hold strings/bytes, which a jax.Array cannot: leave them out with "
            f"features={keep}, or turn them into numbers with a transform= (e.g. a tokenizer)"
        )
    for f in features:
        if f.fixed or f.name in pad_to:
            continue
        shapes = set()
        for stats in statistics:
            st = stats.get(f.name) or {}
            seen = st.get("shapes") or {}
            shapes.update(seen if sum(seen.values()) == st.get("count") else {"unknown": 0})
        if len(shapes) != 1:
            raise ConfigError(
                f"feature {f.name!r} has shape {f.shape} and its records' shapes vary or are not recorded "
                f"({sorted(shapes)[:4]}): a jax.Array is dense and of one shape; pass pad_to={{{f.name!r}: length}} "
                f"(pads with {PAD_VALUE}, truncates longer ones), image_size=/channels= for images, or leave it out "
                f"with features="
            )


def dense(name: str, value, length: int | None) -> np.ndarray:
    """One feature of a batch as a numeric array of one shape: as it is, or padded/truncated on
    its first per-sample axis to ``length`` (pad_to). Ragged values and strings raise."""
    if not isinstance(value, np.ndarray):
        value = np.asarray(value) if not isinstance(value, (list, tuple)) else _stacked(value)
    if value.dtype == object:
        items = list(value)
        if items and isinstance(items[0], (str, bytes)):
            raise SchemaError(_text(name))
        if length is None:
            shapes = sorted({np.shape(a) for a in items})
            raise SchemaError(
                f"feature {name!r} varies in shape from sample to sample ({shapes[:4]}…): a jax.Array is dense; "
                f"pass pad_to={{{name!r}: length}} (pads with {PAD_VALUE}, truncates longer ones), give the "
                f"dataset image_size=/channels= for images, or leave it out with features="
            )
        return _pad_items(name, [np.asarray(a) for a in items], length)
    if value.dtype.kind not in "biufc":
        raise SchemaError(_text(name) if value.dtype.kind in "USO" else f"feature {name!r} has dtype {value.dtype}")
    if length is None:
        return value
    if value.ndim < 2:
        raise ConfigError(f"pad_to: feature {name!r} is a scalar per sample; pad_to applies to lists and arrays")
    have = value.shape[1]
    if have >= length:
        return value[:, :length]
    out = np.full((value.shape[0], length, *value.shape[2:]), PAD_VALUE, dtype=value.dtype)
    out[:, :have] = value
    return out


def _stacked(items) -> np.ndarray:
    out = np.empty(len(items), dtype=object)
    for i, v in enumerate(items):
        out[i] = v
    try:
        return np.stack([np.asarray(v) for v in items]) if len({np.shape(v) for v in items}) == 1 else out
    except (TypeError, ValueError):
        return out


def _pad_items(name: str, items: list[np.ndarray], length: int) -> np.ndarray:
    if any(a.ndim == 0 for a in items):
        raise ConfigError(f"pad_to: feature {name!r} has scalar samples; pad_to applies to lists and arrays")
    rest = {a.shape[1:] for a in items}
    if len(rest) > 1:
        raise SchemaError(
            f"feature {name!r} varies beyond its first axis ({sorted(rest)[:4]}): pad_to pads the first axis "
            f"only; bring the rest to one shape with a transform="
        )
    if items and items[0].dtype.kind not in "biufc":
        raise SchemaError(_text(name))
    dtype = np.result_type(*items) if items else np.float32
    out = np.full((len(items), length, *(rest.pop() if rest else ())), PAD_VALUE, dtype=dtype)
    for i, a in enumerate(items):
        n = min(len(a), length)
        out[i, :n] = a[:n]
    return out


def _text(name: str) -> str:
    return (
        f"feature {name!r} holds strings/bytes, which a jax.Array cannot: leave it out with features=, "
        f"or turn it into numbers with a transform="
    )


@dataclasses.dataclass(frozen=True)
class Assembler:
    """Builds global arrays from this process's rows: ``sharding`` lays every feature out (its
    spec's first entry is the batch axis), ``world_size`` processes each hold ``local_rows`` of
    the global batch (None: whatever each batch has, for streams)."""

    sharding: jax.sharding.Sharding
    world_size: int
    local_rows: int | None = None
    pad_to: Mapping[str, int] = dataclasses.field(default_factory=dict)
    _checked: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def __call__(self, batch: Mapping) -> dict[str, jax.Array]:
        names, rows, shapes = [], [], []
        for name, value in batch.items():
            dense_rows = dense(name, value, self.pad_to.get(name))
            n = dense_rows.shape[0]
            if self.local_rows is not None and n != self.local_rows:
                raise SchemaError(
                    f"feature {name!r}: a batch of {n} rows where {self.local_rows} were expected "
                    f"(static shapes: partial batches must be dropped, drop_last=True)"
                )
            shape = (n * self.world_size, *dense_rows.shape[1:])
            self._check(name, shape, n)
            names.append(name)
            rows.append(dense_rows)
            shapes.append(shape)
        if jax.process_count() == 1:  # one process holds the global batch: one transfer call for all features
            return dict(zip(names, jax.device_put(rows, [self.sharding] * len(rows))))
        return {n: jax.make_array_from_process_local_data(self.sharding, r, s) for n, r, s in zip(names, rows, shapes)}

    def _check(self, name: str, shape: tuple, rows: int) -> None:
        """Once per feature and shape: the sharding fits it, and gives this process ``rows`` rows."""
        key = (name, shape)
        if key in self._checked:
            return
        spec = getattr(self.sharding, "spec", None)
        if spec is not None and len(tuple(spec)) > len(shape):
            raise ConfigError(
                f"feature {name!r} has {len(shape)} dimension(s) {shape} but the sharding's spec {spec} names "
                f"{len(tuple(spec))}: use a spec no longer than the smallest feature's rank, e.g. P('batch')"
            )
        try:
            held = self.sharding.addressable_devices_indices_map(shape).values()
        except ValueError as e:
            raise ConfigError(f"feature {name!r} of global shape {shape} does not fit the sharding: {e}") from None
        covered = set()
        for index in held:
            first = index[0] if index else slice(None)
            covered.update(range(*first.indices(shape[0])))
        if len(covered) != rows:
            raise ConfigError(
                f"the sharding gives this process {len(covered)} of the {shape[0]} rows of a global batch, but "
                f"it reads {rows} ({self.world_size} process(es) with equal shares): shard the batch axis across "
                f"every process (e.g. NamedSharding(Mesh(jax.devices(), ('batch',)), P('batch'))), or set "
                f"rank=/world_size= to match the processes the sharding spans"
            )
        self._checked[key] = True
