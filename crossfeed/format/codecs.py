"""Feature kinds: one `Codec` object per `Encoding` owns everything that depends on the kind —
which values and Arrow types become it (inference), the dtypes it stores, its ``tf.train.Example``
entries (a plain reference encoder and the compiled per-value/per-column fast paths), one value
decoded from a parsed record, what the columnar readers may do with it, its TensorFlow parse spec,
dtype and in-graph decoding, and how a Parquet/Arrow column maps onto it. Call sites ask
``feature.codec`` (or `codec_of`) instead of switching on the encoding; adding a kind is one
`Codec` subclass registered here (plus its `Encoding` value, which manifests store).

The five kinds (see `crossfeed.format.schema` for the table of how each is stored):
`TENSOR`, `IMAGE`, `INT64`, `FLOAT`, `BYTES` are the codec objects."""

from __future__ import annotations

import enum
import math
import struct
import sys
from typing import Any

import numpy as np

from crossfeed.errors import SchemaError
from crossfeed.format import example as ex
from crossfeed.format.images import decode_image

SHAPE_SUFFIX = "/shape"
# the numeric dtypes a tensor feature may store, by name: the one list (manifest checks, adoption, encoders)
NUMERIC_DTYPES = frozenset(
    ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
    + ("float16", "float32", "float64", "complex64", "complex128")
)
INT_TYPES = tuple(sorted((np.dtype(n).type for n in NUMERIC_DTYPES if np.dtype(n).kind in "iu"), key=str))


class Encoding(str, enum.Enum):
    """A feature kind's name, as manifests store it; `codec_of` gives its `Codec`."""

    TENSOR = "tensor"
    IMAGE = "image"
    INT64 = "int64"
    FLOAT = "float"
    BYTES = "bytes"


def shape_fits(shape, pattern) -> bool:
    return len(shape) == len(pattern) and all(p is None or p == s for s, p in zip(shape, pattern))


_LITTLE = sys.byteorder == "little"
_NP_INTS = frozenset(INT_TYPES)
FLOAT_SCALARS = {float: np.float64, np.float64: np.float64, np.float32: np.float32}
INT_SCALARS = {int: np.int64, **{t: t for t in _NP_INTS}}
_pack_f32 = struct.Struct("<f").pack


def _prefix_cache(make, limit: int = 4096):
    """``get(n)``: ``make(n)`` remembered for up to ``limit`` distinct ``n``."""
    cache: dict[int, bytes] = {}

    def get(n: int) -> bytes:
        p = cache.get(n)
        if p is None:
            p = make(n)
            if len(cache) < limit:
                cache[n] = p
        return p

    return get


def _bytes_prefix(name: str):
    """``pfx(n)``: the entry bytes before an ``n``-byte value of a one-value bytes list."""
    return lambda n: ex.entry_prefix(name, ex.BYTES, 1 + len(ex.varint(n)) + n) + b"\x0a" + ex.varint(n)


class Codec:
    """One feature kind. Class attributes say what the kind is; methods take the `Feature`
    (``f``) they act for. A codec object is a singleton per kind (pickles as its kind)."""

    encoding: Encoding
    wire: int  # the Example list kind it is stored as (example.BYTES / INT64 / FLOAT)
    value_kind: str  # what a value decodes to: "numeric", "image" or "bytes" (mixture sources must agree)
    dense = False  # decodes to a numpy array of `dtype(f)`: a fixed shape batches as one array, columnar
    listed = False  # a list of values (int64/float/bytes): an empty list fits any kind, lengths may vary
    strict_shape = False  # values' shapes do not widen to None on inference (a varying shape is declared);
    # its entries are never empty (other kinds' empty entries match whatever list kind a record tags)
    stored_dtype: str | None = None  # the one dtype this kind stores; None: the feature's own dtype
    dtypes: frozenset | None = None  # the dtypes a feature of this kind may declare (None: any numpy dtype)
    manifest_dtypes: frozenset = frozenset()  # the dtypes a manifest (untrusted input) may name for it
    image = False  # values are encoded images (decoded to uint8/uint16 HWC by readers)
    text = False  # values are bytes or str
    arrow: str  # how a Parquet/Arrow column maps onto it: "binary", "number" or "tensor"
    default_dtype: str | None = None  # a declared feature's dtype when none is given (None: it must be)
    default_shape: tuple = ()  # a declared feature's shape when none is given

    def __repr__(self) -> str:
        return f"<codec {self.encoding.value}>"

    def __reduce__(self):
        return codec_of, (self.encoding.value,)

    # -- the feature --------------------------------------------------------------------------
    def check(self, f) -> None:
        """Raise `SchemaError` when ``f``'s dtype is not one this kind stores."""
        if self.dtypes is None:
            np.dtype(f.dtype)  # raises TypeError on nonsense
        elif f.dtype not in self.dtypes:
            want = " or ".join(repr(d) for d in sorted(self.dtypes))
            raise SchemaError(f"feature {f.name!r}: {self.encoding.value} encoding stores dtype {want}, not {f.dtype}")

    def dtype(self, f) -> np.dtype:
        """The numpy dtype a dense value of ``f`` decodes to."""
        return np.dtype(self.stored_dtype or f.dtype)

    def slots(self, f) -> tuple[str, ...]:
        """The Example entries one value of ``f`` takes (a varying tensor adds ``<name>/shape``)."""
        return (f.name,)

    def item_shape(self, f) -> tuple:
        """The shape of one decoded value of ``f`` (None where unknown)."""
        return tuple(f.shape)

    def packed_dtype(self, f) -> np.dtype | None:
        """For the columnar reader: the little-endian dtype of the packed value bytes of a fixed
        ``f`` (each record's values at one place), or None when they are varints or not numbers."""
        return None

    # -- encoding -----------------------------------------------------------------------------
    def encode_reference(self, f, v, out: dict) -> None:
        """Validate one value and add its ``(kind, list message)`` entries to ``out``: the plain
        path every fast path matches byte for byte."""
        raise NotImplementedError

    def compile(self, fc) -> None:
        """Install fast paths on ``fc`` (an `encode_codec.FeatureCodec`): ``fc.one`` per value,
        ``fc.column`` per column (None where the column is not one it vectorises). Default: none."""

    # -- decoding -----------------------------------------------------------------------------
    def decode(self, f, kind: int, region, parsed: dict, decode_images: bool = True):
        """One value of ``f`` from its checked ``(kind, region)`` in ``example.decode`` output."""
        raise NotImplementedError

    # -- TensorFlow (``tf`` is the module: nothing here imports it) ---------------------------
    def tf_dtype(self, f, tf):
        return tf.as_dtype(np.dtype(f.dtype))

    def tf_parse_spec(self, f, tf) -> dict:
        """``{entry name: tf.io.*Feature}`` for ``tf.io.parse_example``."""
        if not f.fixed and self.listed:
            if len(f.shape) != 1:
                raise SchemaError(
                    f"feature {f.name!r}: {self.encoding.value} lists with shape {list(f.shape)} are not "
                    f"supported; only one varying dimension, (None,)"
                )
            return {f.name: tf.io.RaggedFeature(self.tf_dtype(f, tf), row_splits_dtype=tf.int64)}
        return {f.name: tf.io.FixedLenFeature(list(f.shape), self.tf_dtype(f, tf))}

    def tf_per_record(self, f) -> bool:
        """True when in-graph decoding must run per record before batching."""
        return False

    def tf_decode(self, f, value, parsed: dict, tf):
        """The parsed entry ``value`` of ``f`` decoded in the graph (one record or a batch)."""
        return value


class _NumberList(Codec):
    """int64 / float: a packed list of numbers, decoded to an array of ``shape``."""

    value_kind = "numeric"
    dense = True
    listed = True
    arrow = "number"

    _encode_list: Any  # each number kind's own encoder of an array (int64: varints, float: float32)

    def check(self, f) -> None:
        if f.dtype != self.stored_dtype:
            raise SchemaError(
                f"feature {f.name!r}: {self.encoding.value} encoding stores dtype {self.stored_dtype}, not {f.dtype}"
            )

    def encode_reference(self, f, v, out: dict) -> None:
        arr = np.asarray(v)
        if not shape_fits(arr.shape, f.shape):
            raise SchemaError(f"feature {f.name!r}: got shape {list(arr.shape)}, the schema says {list(f.shape)}")
        out[f.name] = (self.wire, self._encode_list(arr))

    def decode(self, f, kind, region, parsed, decode_images=True):
        if kind and f.shape == ():
            v = ex.scalar_value(kind, region)
            if v is not None:
                return v
        arr = np.asarray(ex.kind_values(kind, region), dtype=self.stored_dtype)
        if f.fixed:
            if arr.size != math.prod(f.shape):
                raise SchemaError(f"feature {f.name!r} holds {arr.size} values, the schema says shape {list(f.shape)}")
            return arr.reshape(f.shape)
        return arr


class Int64Codec(_NumberList):
    encoding = Encoding.INT64
    wire = ex.INT64
    stored_dtype = default_dtype = "int64"
    dtypes = manifest_dtypes = frozenset(("int64",))
    _encode_list = staticmethod(ex.encode_int64_list)

    def compile(self, fc) -> None:
        f, generic = fc.f, fc.generic
        # entry of a one-value list whose varint has L bytes: prefix[L] + varint
        prefix = [b""] + [ex.entry_prefix(f.name, ex.INT64, 2 + n) + b"\x0a" + bytes((n,)) for n in range(1, 11)]
        if f.shape == () or f.shape in ((1,), (None,)):
            small = [prefix[len(v)] + v for v in ex.VARINTS[:1024]]
        if f.shape == ():
            lo, hi = -(1 << 63), 1 << 64

            def one(v):
                t = type(v)
                if t is int or t in _NP_INTS:
                    x = int(v)
                    if 0 <= x < 1024:
                        return small[x]
                    if lo <= x < hi:
                        vb = ex.varint(x)
                        return prefix[len(vb)] + vb
                return generic(v)

            fc.one = one

        def column(col, n):
            arr = fc.numeric_column(col, n, "iub", INT_SCALARS)
            if arr is None or arr.shape[1] != 1:
                return None
            arr = arr[:, 0]
            u = arr.astype(np.uint64) if arr.dtype.kind == "u" else arr.astype(np.int64).view(np.uint64)
            lens, vb = ex.varint_matrix(u)
            lengths = np.unique(lens)
            groups = []
            for L in lengths.tolist():
                idx = np.flatnonzero(lens == L) if len(lengths) > 1 else None
                rows = vb[:, :L] if idx is None else vb[idx, :L]
                ((pieces, _),) = fc.rows(prefix[L], rows, len(rows))
                groups.append((idx, pieces[0]))
            if len(groups) == 1:
                entries = groups[0][1]
            else:
                obj = np.empty(n, dtype=object)
                for idx, vals in groups:
                    part = np.empty(len(vals), dtype=object)
                    part[:] = vals
                    obj[idx] = part
                entries = obj.tolist()
            return [([entries], lens + np.array([len(p) for p in prefix], dtype=np.int64)[lens])]

        fc.column = column


class FloatCodec(_NumberList):
    encoding = Encoding.FLOAT
    wire = ex.FLOAT
    stored_dtype = default_dtype = "float32"
    dtypes = manifest_dtypes = frozenset(("float32",))
    _encode_list = staticmethod(ex.encode_float_list)

    def packed_dtype(self, f) -> np.dtype | None:
        return np.dtype("<f4")

    def compile(self, fc) -> None:
        f, generic = fc.f, fc.generic
        if f.shape == ():
            pre = ex.entry_prefix(f.name, ex.FLOAT, 6) + b"\x0a\x04"

            def one(v):
                t = type(v)
                if t is float or t is np.float64:
                    try:
                        return pre + _pack_f32(v)
                    except OverflowError:  # numpy stores inf; let it
                        pass
                elif t is np.float32 and _LITTLE:
                    return pre + v.tobytes()
                return generic(v)

            fc.one = one

        def column(col, n):
            arr = fc.numeric_column(col, n, "fiub", FLOAT_SCALARS)
            if arr is None:
                return None
            k = arr.shape[1]
            pre = ex.entry_prefix(f.name, ex.FLOAT, 1 + len(ex.varint(4 * k)) + 4 * k) + b"\x0a" + ex.varint(4 * k)
            return fc.rows(pre, np.ascontiguousarray(arr, dtype="<f4").view(np.uint8), n)

        fc.column = column


class BytesCodec(Codec):
    """``bytes``/``str`` (dtype "bytes"/"string"), or a list of them."""

    encoding = Encoding.BYTES
    wire = ex.BYTES
    value_kind = "bytes"
    listed = True
    text = True
    dtypes = manifest_dtypes = frozenset(("bytes", "string"))
    arrow = "binary"
    default_dtype = "bytes"

    def check(self, f) -> None:
        if f.dtype not in self.dtypes:
            raise SchemaError(f"feature {f.name!r}: bytes encoding takes dtype 'bytes' or 'string'")

    def dtype(self, f) -> np.dtype:
        return np.dtype(object)  # bytes / str objects

    def tf_dtype(self, f, tf):
        return tf.string

    def encode_reference(self, f, v, out: dict) -> None:
        vals = [v] if not f.shape else list(v)
        out[f.name] = (ex.BYTES, ex.encode_bytes_list([x.encode() if isinstance(x, str) else bytes(x) for x in vals]))

    def compile(self, fc) -> None:
        f, generic = fc.f, fc.generic
        if f.shape != ():
            return
        pfx = _prefix_cache(_bytes_prefix(f.name))

        def one(v):
            t = type(v)
            if t is str:
                b = v.encode()
            elif t is bytes:
                b = v
            else:
                return generic(v)
            return pfx(len(b)) + b

        fc.one = one

        def column(col, n):
            if not isinstance(col, list) or not n:
                return None
            types = set(map(type, col))
            if types == {str}:
                data = [s.encode() for s in col]
            elif types == {bytes}:
                data = col
            else:
                return None
            lens = np.fromiter(map(len, data), np.int64, n)
            prefixes = list(map(pfx, lens.tolist()))
            plens = np.fromiter(map(len, prefixes), np.int64, n)
            return [([prefixes, data], lens + plens)]

        fc.column = column

    def decode(self, f, kind, region, parsed, decode_images=True):
        items: list = [bytes(v) for v in ex.kind_values(kind, region)]
        if f.dtype == "string":
            items = [b.decode("utf-8") for b in items]
        if f.shape == ():
            if len(items) != 1:
                raise SchemaError(f"feature {f.name!r} must hold one value, got {len(items)}")
            return items[0]
        return items


class ImageCodec(Codec):
    """An encoded JPEG/PNG, one bytes value; readers decode it to uint8 (or uint16) HWC."""

    encoding = Encoding.IMAGE
    wire = ex.BYTES
    value_kind = "image"
    image = True
    manifest_dtypes = frozenset(("uint8", "uint16"))
    arrow = "binary"
    default_dtype = "uint8"
    default_shape = (None, None, None)

    def item_shape(self, f) -> tuple:
        return tuple(f.shape) if len(f.shape) == 3 else (None, None, None)

    def tf_dtype(self, f, tf):
        return tf.uint16 if f.dtype == "uint16" else tf.uint8

    def tf_parse_spec(self, f, tf) -> dict:
        return {f.name: tf.io.FixedLenFeature([], tf.string)}

    def tf_per_record(self, f) -> bool:
        return True

    def tf_decode(self, f, value, parsed, tf):
        shape = self.item_shape(f)
        channels, dtype = shape[2] or 0, self.tf_dtype(f, tf)

        def other():
            return tf.io.decode_image(value, channels=channels, dtype=dtype, expand_animations=False)

        if dtype == tf.uint8:  # JPEG with the accurate integer IDCT: the pixels the Loader (libjpeg, PIL) decodes
            img = tf.cond(
                tf.io.is_jpeg(value),
                lambda: tf.io.decode_jpeg(value, channels=channels, dct_method="INTEGER_ACCURATE"),
                other,
            )
        else:
            img = other()
        return tf.ensure_shape(img, shape)

    def encode_reference(self, f, v, out: dict) -> None:
        out[f.name] = (ex.BYTES, ex.encode_bytes_list([bytes(v)]))

    def compile(self, fc) -> None:
        generic = fc.generic
        pfx = _prefix_cache(_bytes_prefix(fc.f.name), 64)

        def one(v):
            if type(v) is bytes:
                return pfx(len(v)) + v
            return generic(v)

        fc.one = one

    def decode(self, f, kind, region, parsed, decode_images=True):
        vals = ex.kind_values(kind, region)
        data = bytes(vals[0]) if len(vals) == 1 else b""
        return decode_image(data, f) if decode_images else data


# decode_raw has no unsigned 32/64-bit out_type: read the signed twin and bitcast
_RAW_TWINS = {"uint32": "int32", "uint64": "int64"}


class TensorCodec(Codec):
    """A numpy array as its raw little-endian bytes (one bytes value); a shape with None dims
    also stores ``<name>/shape`` as an int64 list."""

    encoding = Encoding.TENSOR
    wire = ex.BYTES
    value_kind = "numeric"
    dense = True
    strict_shape = True
    manifest_dtypes = NUMERIC_DTYPES
    arrow = "tensor"
    default_shape = (None,)

    def slots(self, f) -> tuple[str, ...]:
        return (f.name,) if f.fixed else (f.name, f.name + SHAPE_SUFFIX)

    def packed_dtype(self, f) -> np.dtype | None:
        return np.dtype(f.dtype).newbyteorder("<")

    def tf_parse_spec(self, f, tf) -> dict:
        spec = {f.name: tf.io.FixedLenFeature([], tf.string)}
        if not f.fixed:
            spec[f.name + SHAPE_SUFFIX] = tf.io.FixedLenFeature([len(f.shape)], tf.int64)
        return spec

    def tf_per_record(self, f) -> bool:
        return not f.fixed

    def tf_decode(self, f, value, parsed, tf):
        dt = self.tf_dtype(f, tf)
        twin = _RAW_TWINS.get(dt.name)
        flat = tf.io.decode_raw(value, tf.as_dtype(twin) if twin else dt, little_endian=True)
        if twin:
            flat = tf.bitcast(flat, dt)
        if not f.fixed:  # one record, its own shape
            return tf.ensure_shape(tf.reshape(flat, parsed[f.name + SHAPE_SUFFIX]), f.shape)
        lead = tf.shape(value)  # () for one record, (B,) for a batch
        return tf.reshape(flat, tf.concat([lead, tf.constant(f.shape, tf.int32)], 0))

    def encode_reference(self, f, v, out: dict) -> None:
        arr = np.asarray(v)
        if arr.dtype.newbyteorder("=") != np.dtype(f.dtype) or not shape_fits(arr.shape, f.shape):  # any byte order
            raise SchemaError(
                f"feature {f.name!r}: got {arr.dtype}{list(arr.shape)}, the schema says {f.dtype}{list(f.shape)}"
            )
        out[f.name] = (
            ex.BYTES,
            ex.encode_bytes_list([np.ascontiguousarray(arr, arr.dtype.newbyteorder("<")).tobytes()]),
        )
        if not f.fixed:
            out[f.name + SHAPE_SUFFIX] = (ex.INT64, ex.encode_int64_list(arr.shape))

    def compile(self, fc) -> None:
        f, generic = fc.f, fc.generic
        if not _LITTLE:
            return
        if not f.fixed:
            fc.column = _varying_column(f)
            return
        dt = np.dtype(f.dtype)
        nbytes = dt.itemsize * int(np.prod(f.shape, dtype=np.int64))
        pre = ex.entry_prefix(f.name, ex.BYTES, 1 + len(ex.varint(nbytes)) + nbytes) + b"\x0a" + ex.varint(nbytes)
        shape = f.shape

        def one(v):
            if type(v) is np.ndarray and v.dtype == dt and v.dtype.byteorder in "=|" and v.shape == shape:
                return pre + v.tobytes()
            return generic(v)

        fc.one = one

        def column(col, n):
            if (
                not isinstance(col, np.ndarray)
                or col.dtype != dt
                or col.dtype.byteorder not in "=|"
                or col.shape[1:] != shape
                or not nbytes
            ):
                return None
            return fc.rows(pre, np.ascontiguousarray(col).reshape(n, -1).view(np.uint8), n)

        fc.column = column

    def decode(self, f, kind, region, parsed, decode_images=True):
        vals = ex.kind_values(kind, region)
        if len(vals) != 1:
            raise SchemaError(f"tensor feature {f.name!r} must hold exactly one bytes value, got {len(vals)}")
        if not f.fixed and f.name + SHAPE_SUFFIX not in parsed:
            raise SchemaError(
                f"tensor feature {f.name!r} has a variable shape but the record has no {f.name + SHAPE_SUFFIX!r}"
            )
        shape = f.shape if f.fixed else tuple(ex.int64_values(parsed[f.name + SHAPE_SUFFIX][1]).tolist())
        dt = np.dtype(f.dtype).newbyteorder("<")
        try:
            return np.frombuffer(vals[0], dtype=dt).reshape(shape)
        except ValueError as e:
            raise SchemaError(
                f"tensor feature {f.name!r}: {len(vals[0])} bytes do not fit {f.dtype}{list(shape)}"
            ) from e


def _varying_column(f):
    """The column encoder of a variable-shape tensor feature (a document's tokens): a record's
    entries are a prefix and its ``/shape`` entry that depend on its shape alone (made once per
    shape, kept in a bounded table) and the array's own bytes, joined once into the payload — no
    per-value work. Bytes are `TensorCodec.encode_reference`'s. None (the per-value path, and its
    errors) unless every value is a C-contiguous array of the schema's dtype in native (little)
    byte order whose shape fits."""
    dt = np.dtype(f.dtype)
    ndim = len(f.shape)
    shape_name = f.name + SHAPE_SUFFIX
    memo: dict[tuple, tuple[bytes, bytes, int, int]] = {}

    def heads(shape: tuple):
        if len(shape) != ndim or not shape_fits(shape, f.shape):
            return None
        nbytes = dt.itemsize * math.prod(shape)
        raw = b"\x0a" + ex.varint(nbytes)  # the BytesList's one value: tag, length (the bytes follow)
        pre = ex.entry_prefix(f.name, ex.BYTES, len(raw) + nbytes) + raw
        shp = ex.entry(shape_name, ex.INT64, ex.encode_int64_list(shape))
        if len(memo) >= 1 << 16:
            memo.clear()
        got = memo[shape] = (pre, shp, len(pre) + nbytes, len(shp))
        return got

    def column(col, n):
        vals = col if isinstance(col, list) else list(col)
        if not n or not all(isinstance(v, np.ndarray) and v.dtype == dt and v.flags.c_contiguous for v in vals):
            return None
        get = memo.get
        hs = [get(v.shape) or heads(v.shape) for v in vals]
        if None in hs:
            return None
        pres, shps, pre_sizes, shp_sizes = zip(*hs)
        return [
            ([list(pres), vals], np.array(pre_sizes, dtype=np.int64)),
            ([list(shps)], np.array(shp_sizes, dtype=np.int64)),
        ]

    return column


TENSOR = TensorCodec()
IMAGE = ImageCodec()
INT64 = Int64Codec()
FLOAT = FloatCodec()
BYTES = BytesCodec()
CODECS: dict[Encoding, Codec] = {c.encoding: c for c in (TENSOR, IMAGE, INT64, FLOAT, BYTES)}


def codec_of(encoding) -> Codec:
    """The codec of ``encoding`` (an `Encoding`, its string value, or a codec)."""
    if isinstance(encoding, Codec):
        return encoding
    try:
        return CODECS[Encoding(encoding)]
    except ValueError:
        raise SchemaError(f"unknown encoding {encoding!r}; the kinds are {[e.value for e in CODECS]}") from None


# ---- inference: which kind a value or a column type becomes -------------------------------------


def number_codec(dtype: str) -> Codec:
    """The kind numbers of numpy dtype name ``dtype`` are stored as: int64 and float32 keep their
    Example list encodings, every other dtype is a tensor of its own dtype."""
    return INT64 if dtype == "int64" else FLOAT if dtype == "float32" else TENSOR


def infer_value(name: str, value) -> tuple[Codec, str, tuple]:
    """``(codec, dtype, shape)`` a sample value implies (the table of `crossfeed.format.schema`)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return BYTES, "bytes", ()
    if isinstance(value, str):
        return BYTES, "string", ()
    if isinstance(value, (list, tuple)):
        if all(isinstance(v, (bytes, str)) for v in value) and value:
            return BYTES, ("string" if isinstance(value[0], str) else "bytes"), (len(value),)
        value = np.asarray(value)
        if value.ndim != 1:
            raise SchemaError(f"feature {name!r}: nested lists are not supported; pass a numpy array")
        return _list_kind(name, value.dtype, (len(value),))
    arr = np.asarray(value)
    if arr.ndim == 0:
        return _list_kind(name, arr.dtype, ())
    if arr.dtype.kind not in "biufc":
        raise SchemaError(
            f"feature {name!r}: arrays of dtype {arr.dtype} cannot be stored; use numeric arrays, bytes or str"
        )
    return TENSOR, arr.dtype.newbyteorder("=").name, arr.shape


def _list_kind(name: str, dtype: np.dtype, shape) -> tuple[Codec, str, tuple]:
    if dtype.kind in "biu":
        return INT64, "int64", shape
    if dtype.kind == "f":
        return FLOAT, "float32", shape
    if dtype.kind in "SU":
        return BYTES, ("string" if dtype.kind == "U" else "bytes"), shape
    raise SchemaError(f"feature {name!r}: values of dtype {dtype} cannot be stored")
