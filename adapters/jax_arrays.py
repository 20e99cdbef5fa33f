"""The JAX adapter's batch assembly: one process's numpy batch (the Loader's, or a stream's) as
global ``jax.Array``\\ s laid out by a `jax.sharding.Sharding`, dense and of static shape.

    dict[str, np.ndarray] (this process's rows) ─► dense (pad_to; refuse ragged and strings)
      ─► one process: each device's rows (views) placed by jax's per-device transfer
         several:     jax.make_array_from_process_local_data(sharding, rows, global shape)
      ─► dict[str, jax.Array]

Where the time goes on CPU devices (benchmarks/bench_jax_adapter.py): not the bytes but JAX's
Python layers. ``jax.device_put`` spends about 0.15 ms of Python a call (pytree, sharding and
aval checks) before the C++ transfer (about 0.01 ms), and XLA's CPU client copies a host array
unless it is 64-byte aligned, in which case the device buffer *is* the host memory. So:

* `AlignedArrays` is the Loader's allocator here (its ``alloc`` hook): batch arrays start on a
  64-byte boundary, every shard of a batch-sharded array too when its rows are a multiple of 64
  bytes, and the devices use them in place — no copy. Safe: the jax.Array holds a reference to
  the buffer, and buffers (these, the core's recycled ones, a worker process's shared-memory
  slot) are reused only when nothing refers to them (tests/test_jax.py holds batches and checks).
* One process: `Assembler` calls ``jax._src.interpreters.pxla.batched_device_put`` (what
  ``jax.device_put`` ends in for a numpy array) with the shards ``addressable_devices_indices_map``
  gives. It is internal to jax, so it is checked once per feature and shape against
  ``jax.device_put`` (sharding, shards, values); where it is missing, fails or differs, the
  public ``jax.device_put`` is used (``fast=False`` forces that).

64-bit values become 32-bit unless ``jax_enable_x64`` is on (JAX's rule), a conversion on the host;
unsigned integers past uint8 (token ids stored as uint16/uint32) become int32, checked to fit,
unless ``keep_dtypes`` (`crossfeed.adapters.int_dtypes`).

Imports jax and the crossfeed core, never torch or tensorflow.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import threading
from collections.abc import Callable, Mapping

try:
    import jax
except ModuleNotFoundError as e:  # one line naming the extra that installs it
    from crossfeed.errors import missing_extra

    raise missing_extra(e, "crossfeed.adapters.jax") from None

import numpy as np

from crossfeed.adapters.int_dtypes import jax_dtype, widen
from crossfeed.errors import ConfigError, SchemaError
from crossfeed.format.schema import VALID_KEY, Feature
from crossfeed.read.options import MAX_BATCH_TOKENS, MAX_PACK_LENGTH

PAD_VALUE = 0  # what pad_to fills with
ALIGN = 64  # XLA's CPU client uses a host array in place (no copy) when its data is this aligned

log = logging.getLogger(__name__)


def _batched_device_put():
    """jax's per-device transfer of numpy shards, ``put(aval, sharding, shards, devices)``, and
    the aval type it takes (internal to jax: None where this jax has none)."""
    try:
        from jax._src.core import ShapedArray
        from jax._src.interpreters.pxla import batched_device_put
    except (ImportError, AttributeError):  # pragma: no cover - another jax
        return None
    return batched_device_put, ShapedArray


_PUT = _batched_device_put()


class AlignedArrays:
    """A Loader allocator (``collate``'s and the decoders' ``alloc`` hook) whose arrays of at
    least ``min_bytes`` start on a 64-byte boundary, so that CPU devices use them in place
    (smaller ones are plain ``np.empty``: copying them costs less than aligning them). Like the
    core's recycler, up to ``keep`` such buffers are reused, each only once nothing but this
    list refers to it: a batch array, a view of it, or a jax.Array made from it in place (which
    holds a reference to the buffer) keeps it out of reach. Thread-safe."""

    def __init__(self, keep: int = 8, min_bytes: int = 1 << 16):
        self.keep, self.min_bytes = keep, min_bytes
        self._buffers: list[np.ndarray] = []
        self._starts: list[int] = []  # where each buffer's aligned part starts
        self._lock = threading.Lock()

    def __call__(self, shape, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
        nbytes = math.prod(shape) * dtype.itemsize
        if dtype.hasobject or nbytes < self.min_bytes:
            return np.empty(shape, dtype)
        with self._lock:
            for i in range(len(self._buffers)):
                # references: the list and getrefcount's argument — nobody else
                if self._buffers[i].size == nbytes + ALIGN and sys.getrefcount(self._buffers[i]) == 2:
                    raw, start = self._buffers[i], self._starts[i]
                    break
            else:
                raw = np.empty(nbytes + ALIGN, np.uint8)
                start = -raw.ctypes.data % ALIGN
                if self.keep > 0:
                    self._buffers.append(raw)
                    self._starts.append(start)
                    if len(self._buffers) > self.keep:
                        del self._buffers[0], self._starts[0]
        return raw[start : start + nbytes].view(dtype).reshape(shape)


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


def check_pad_to(pad_to, batch_size: int | None = None) -> dict[str, int]:
    """``pad_to`` as ``{feature: length}``, validated: each length at most `MAX_PACK_LENGTH` (a
    padded feature is allocated whole, ``(batch, length)``) and, with ``batch_size`` (the global
    batch, where known), ``batch_size × length`` at most `MAX_BATCH_TOKENS` values."""
    if pad_to is None:
        return {}
    if not isinstance(pad_to, Mapping):
        raise ConfigError(f"pad_to must be a dict {{feature: length}}, got {type(pad_to).__name__}")
    out = {}
    for name, length in pad_to.items():
        if not isinstance(name, str) or isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ConfigError(f"pad_to: {name!r}: {length!r} is not a feature name and a length >= 1")
        if length > MAX_PACK_LENGTH:
            raise ConfigError(
                f"pad_to={{{name!r}: {length:,}}} is past the most crossfeed pads a feature to, {MAX_PACK_LENGTH:,} "
                f"(2^24)"
            )
        if batch_size is not None and batch_size * length > MAX_BATCH_TOKENS:
            raise ConfigError(
                f"pad_to={{{name!r}: {length:,}}} with batch_size={batch_size:,} is {batch_size * length:,} values a "
                f"batch, past the most crossfeed allocates, {MAX_BATCH_TOKENS:,} (2^32); lower one of them"
            )
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
    text = [f.name for f in features if f.codec.text]
    if text:
        keep = [n for n in names if n not in text]
        raise ConfigError(
            f"feature(s) {text} hold strings/bytes, which a jax.Array cannot: leave them out with "
            f"features={keep}, or turn them into numbers with a transform= (e.g. a tokenizer)"
        )
    for f in features:
        if f.fixed or f.name in pad_to:
            continue
        shapes: set[str] = set()
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


@dataclasses.dataclass
class Padder:
    """Pads a batch that a filter, a transform returning None or skipped sample ids made shorter
    back to ``rows`` (this process's share of the global batch), and adds `VALID_KEY`: a bool
    ``(rows,)`` array, True for the real samples (first, in the Loader's order), False for the
    padding after them. Padded rows hold 0 in every feature (``__index__``/``__source__`` too).

    Each feature's per-row shape and dtype (after ``pad_to``) are learnt from the first batch
    that has rows (`known`) and kept: a batch with no rows (every sample of its step dropped)
    becomes ``rows`` rows of padding of those features — not the decoded features an empty batch
    may carry when a transform never ran on it. `like` pads such a batch from what it holds,
    for when none with rows came (the caller holds empty batches back until one does)."""

    rows: int
    pad_to: Mapping[str, int] = dataclasses.field(default_factory=dict)
    alloc: Callable | None = None  # where padded arrays are built (an `AlignedArrays`: used in place)
    _rows: dict = dataclasses.field(default_factory=dict, init=False, repr=False)  # name -> (row shape, dtype)

    @property
    def known(self) -> bool:
        return bool(self._rows)

    def __call__(self, batch: Mapping) -> dict[str, np.ndarray]:
        n = _rows_of(batch)
        if n > self.rows:
            raise SchemaError(f"a batch of {n} rows where at most {self.rows} were expected")
        if n == 0 and self._rows:
            return self._padded({k: np.empty((0, *shape), dtype) for k, (shape, dtype) in self._rows.items()}, 0)
        arrays = {name: dense(name, value, self.pad_to.get(name)) for name, value in batch.items()}
        if n and not self._rows:
            self._rows = {k: (v.shape[1:], v.dtype) for k, v in arrays.items()}
        return self._padded(arrays, n)

    def like(self, batch: Mapping) -> dict[str, np.ndarray]:
        """An empty ``batch`` padded from its own arrays' shapes (no batch with rows came to learn from)."""
        return self._padded({name: dense(name, value, self.pad_to.get(name)) for name, value in batch.items()}, 0)

    def _padded(self, arrays: dict[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for name, value in arrays.items():
            if n == self.rows:
                out[name] = value
                continue
            full = (self.alloc or np.empty)((self.rows, *value.shape[1:]), value.dtype)
            full[:n] = value[:n]
            full[n:] = 0
            out[name] = full
        valid = np.zeros(self.rows, dtype=bool)
        valid[:n] = True
        out[VALID_KEY] = valid
        return out


def _rows_of(batch: Mapping) -> int:
    """The rows of a batch (its first value's length; 0 for a batch with no values)."""
    for value in batch.values():
        return len(value)
    return 0


@dataclasses.dataclass(frozen=True)
class Assembler:
    """Builds global arrays from this process's rows: ``sharding`` lays every feature out (its
    spec's first entry is the batch axis), ``world_size`` processes each hold ``local_rows`` of
    the global batch (None: whatever each batch has, for streams). ``fast``: in one process,
    place each device's rows with jax's per-device transfer (checked once per feature and
    shape against ``jax.device_put``); False: ``jax.device_put`` always. ``alloc``: where a
    64-bit feature is converted to 32 bits (an `AlignedArrays`, so that the devices use it in place)."""

    sharding: jax.sharding.Sharding
    world_size: int
    local_rows: int | None = None
    pad_to: Mapping[str, int] = dataclasses.field(default_factory=dict)
    fast: bool = True
    alloc: Callable | None = None
    keep_dtypes: bool = False  # unsigned integers as stored (else int32: `crossfeed.adapters.int_dtypes`)
    # (name, shape, dtype) -> None (jax.device_put), or [aval, devices, their indices, verified]
    _checked: dict = dataclasses.field(default_factory=dict, init=False, compare=False, repr=False)

    def __call__(self, batch: Mapping) -> dict[str, jax.Array]:
        single = jax.process_count() == 1
        out: dict = {}
        public = []  # (name, rows) for one jax.device_put call
        for name, value in batch.items():
            rows = dense(name, value, self.pad_to.get(name))
            if self.local_rows is not None and rows.shape[0] != self.local_rows:
                raise SchemaError(
                    f"feature {name!r}: a batch of {rows.shape[0]} rows where {self.local_rows} were expected "
                    f"(static shapes: partial batches must be dropped, drop_last=True; a transform that returns None "
                    f"makes them shorter: pass mask=True to pad them back, with a {VALID_KEY!r} mask)"
                )
            if not self.keep_dtypes:
                rows = widen(name, rows, jax_dtype(rows.dtype))
            if single:
                rows = self._canonical(rows)
            key = (name, rows.shape, rows.dtype)
            plan = self._checked[key] if key in self._checked else self._check(key, single)
            if not single:
                shape = (rows.shape[0] * self.world_size, *rows.shape[1:])
                out[name] = jax.make_array_from_process_local_data(self.sharding, rows, shape)
            elif plan is None:
                out[name] = None  # keeps the batch's order
                public.append((name, rows))
            elif plan[3]:  # the common case: jax's per-device transfer of this process's shards
                out[name] = _PUT[0](plan[0], self.sharding, [rows[i] for i in plan[2]], plan[1])
            else:
                out[name] = self._verify(key, rows, plan)
        if public:  # one transfer call for all of them
            placed = jax.device_put([r for _, r in public], [self.sharding] * len(public))
            out.update(zip([n for n, _ in public], placed))
        return out

    def _canonical(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` in the dtype JAX keeps (64-bit as 32-bit without jax_enable_x64)."""
        dtype = jax.dtypes.canonicalize_dtype(rows.dtype)
        if dtype == rows.dtype:
            return rows
        if self.alloc is None or rows.nbytes < 1 << 16:
            return rows.astype(dtype)
        out = self.alloc(rows.shape, dtype)
        np.copyto(out, rows, casting="unsafe")
        return out

    def _verify(self, key: tuple, rows: np.ndarray, plan: list) -> jax.Array:
        """The first batch of a feature and shape, placed both ways: the per-device transfer is
        kept only if it gives what ``jax.device_put`` gives (else that is used from now on)."""
        name = key[0]
        want = jax.device_put(rows, self.sharding)
        try:
            got = _PUT[0](plan[0], self.sharding, [rows[i] for i in plan[2]], plan[1])
            same = _same(got, want)
        except Exception as e:  # an internal call of another jax: the public one serves
            log.info("feature %r: jax's per-device transfer failed (%s); using jax.device_put", name, e)
            same = False
        if same:
            plan[3] = True
            return got
        self._checked[key] = None
        log.info("feature %r: jax's per-device transfer differs from jax.device_put; using jax.device_put", name)
        return want

    def _check(self, key: tuple, single: bool):
        """Once per feature, shape and dtype (``key``, this process's shape): the sharding fits
        it and gives this process its rows; returns how one process places it (None: ``jax.device_put``)."""
        name, local, dtype = key
        rows = local[0]
        shape = (rows * self.world_size, *local[1:])
        spec = getattr(self.sharding, "spec", None)
        if spec is not None and len(tuple(spec)) > len(shape):
            raise ConfigError(
                f"feature {name!r} has {len(shape)} dimension(s) {shape} but the sharding's spec {spec} names "
                f"{len(tuple(spec))}: use a spec no longer than the smallest feature's rank, e.g. P('batch')"
            )
        try:
            held = self.sharding.addressable_devices_indices_map(shape)
        except ValueError as e:
            raise ConfigError(f"feature {name!r} of global shape {shape} does not fit the sharding: {e}") from None
        covered: set[int] = set()
        for index in held.values():
            first = index[0] if index else slice(None)
            covered.update(range(*first.indices(shape[0])))
        if len(covered) != rows:
            raise ConfigError(
                f"the sharding gives this process {len(covered)} of the {shape[0]} rows of a global batch, but "
                f"it reads {rows} ({self.world_size} process(es) with equal shares): shard the batch axis across "
                f"every process (e.g. NamedSharding(Mesh(jax.devices(), ('batch',)), P('batch'))), or set "
                f"rank=/world_size= to match the processes the sharding spans"
            )
        plan = None
        if single and self.fast and _PUT is not None and all(v is not None for v in held.values()):
            plan = [_PUT[1](shape, dtype), list(held), list(held.values()), False]
        self._checked[key] = plan
        return plan


def _same(got, want) -> bool:
    """Whether two jax.Arrays are the same global array, laid out and committed alike."""
    if not isinstance(got, jax.Array) or got.shape != want.shape or got.dtype != want.dtype:
        return False
    if got.sharding != want.sharding or getattr(got, "_committed", None) != getattr(want, "_committed", None):
        return False
    a, b = got.addressable_shards, want.addressable_shards
    if [(s.device, s.index) for s in a] != [(s.device, s.index) for s in b]:
        return False
    return all(np.array_equal(np.asarray(x.data), np.asarray(y.data)) for x, y in zip(a, b))
