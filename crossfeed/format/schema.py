"""The schema: each feature's name, dtype, shape and encoding, and the mapping between a
sample (``dict`` of numpy arrays, scalars, bytes, str) and a ``tf.train.Example``.

Encodings (how a feature is stored in the Example, and so how plain tf.data reads it):

=========  ======================  ===========================================================
encoding   Example field           read back as
=========  ======================  ===========================================================
tensor     bytes_list, 1 value     numpy array of ``dtype``/``shape`` (zero-copy view); a shape
           (raw little-endian)     with ``None`` dims stores ``<name>/shape`` as an int64 list
image      bytes_list, 1 value     the encoded JPEG/PNG bytes, decoded to uint8 HWC by readers
int64      int64_list              int64 array of ``shape`` (``()`` is a scalar)
float      float_list              float32 array of ``shape``
bytes      bytes_list              ``bytes``/``str`` (dtype "bytes"/"string"), or a list of them
=========  ======================  ===========================================================
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from crossfeed.errors import SchemaError
from crossfeed.format import example as ex

SHAPE_SUFFIX = "/shape"
# the numeric dtypes a tensor feature may store, by name: the one list (manifest checks, adoption, encoders)
NUMERIC_DTYPES = frozenset(
    ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
    + ("float16", "float32", "float64", "complex64", "complex128")
)
INT_TYPES = tuple(sorted((np.dtype(n).type for n in NUMERIC_DTYPES if np.dtype(n).kind in "iu"), key=str))
INDEX_KEY = "__index__"  # a batch key, never a feature: the sample indices of the batch
SOURCE_KEY = "__source__"  # a batch key of mixtures: the source (position in the list) of each sample


class Encoding(str, enum.Enum):
    TENSOR = "tensor"
    IMAGE = "image"
    INT64 = "int64"
    FLOAT = "float"
    BYTES = "bytes"


_KIND = {
    Encoding.TENSOR: ex.BYTES,
    Encoding.IMAGE: ex.BYTES,
    Encoding.INT64: ex.INT64,
    Encoding.FLOAT: ex.FLOAT,
    Encoding.BYTES: ex.BYTES,
}


@dataclass(frozen=True)
class Feature:
    """One feature of a dataset. ``shape`` may hold ``None`` for a dimension that varies."""

    name: str
    dtype: str
    shape: tuple[int | None, ...]
    encoding: Encoding

    def __post_init__(self):
        object.__setattr__(self, "encoding", Encoding(self.encoding))
        object.__setattr__(self, "shape", tuple(None if d is None else int(d) for d in self.shape))
        if not self.name or self.name.endswith(SHAPE_SUFFIX):
            raise SchemaError(f"feature name {self.name!r} is empty or ends with {SHAPE_SUFFIX!r}; rename it")
        if self.encoding in (Encoding.TENSOR, Encoding.IMAGE):
            np.dtype(self.dtype)  # raises TypeError on nonsense
        if self.encoding is Encoding.INT64 and self.dtype != "int64":
            raise SchemaError(f"feature {self.name!r}: int64 encoding stores dtype int64, not {self.dtype}")
        if self.encoding is Encoding.FLOAT and self.dtype != "float32":
            raise SchemaError(f"feature {self.name!r}: float encoding stores dtype float32, not {self.dtype}")
        if self.encoding is Encoding.BYTES and self.dtype not in ("bytes", "string"):
            raise SchemaError(f"feature {self.name!r}: bytes encoding takes dtype 'bytes' or 'string'")

    @property
    def fixed(self) -> bool:
        """True when every record has the same shape (no ``None`` dimension)."""
        return None not in self.shape

    @property
    def fixed_shape(self) -> tuple[int, ...]:
        """``shape`` of a `fixed` feature, typed as such (a shape with a ``None`` dimension: SchemaError)."""
        if not self.fixed:
            raise SchemaError(f"feature {self.name!r}: shape {list(self.shape)} varies; a fixed shape is needed here")
        return tuple(d for d in self.shape if d is not None)

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "encoding": self.encoding.value}

    @classmethod
    def from_json(cls, d: Mapping) -> Feature:
        try:
            return cls(d["name"], d["dtype"], tuple(d["shape"]), Encoding(d["encoding"]))
        except (KeyError, TypeError, ValueError) as e:
            raise SchemaError(f"bad feature entry {dict(d)!r}: {e}") from e


class Schema(tuple):
    """An ordered tuple of `Feature` with lookup by name."""

    def __new__(cls, features=()):
        feats = tuple(features)
        names = [f.name for f in feats]
        if len(set(names)) != len(names):
            raise SchemaError(f"duplicate feature names in {names}")
        return super().__new__(cls, feats)

    def __getitem__(self, key):
        if isinstance(key, str):
            for f in self:
                if f.name == key:
                    return f
            raise KeyError(f"no feature {key!r}; the schema has {self.names}")
        return super().__getitem__(key)

    @property
    def names(self) -> list[str]:
        return [f.name for f in self]

    def to_json(self) -> list[dict]:
        return [f.to_json() for f in self]

    @classmethod
    def from_json(cls, items) -> Schema:
        return cls(Feature.from_json(d) for d in items)


# ---- inference ---------------------------------------------------------------------------------


def infer_feature(name: str, value) -> Feature:
    """The feature a sample value implies (see the module table)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return Feature(name, "bytes", (), Encoding.BYTES)
    if isinstance(value, str):
        return Feature(name, "string", (), Encoding.BYTES)
    if isinstance(value, (list, tuple)):
        if all(isinstance(v, (bytes, str)) for v in value) and value:
            return Feature(name, "string" if isinstance(value[0], str) else "bytes", (len(value),), Encoding.BYTES)
        value = np.asarray(value)
        if value.ndim != 1:
            raise SchemaError(f"feature {name!r}: nested lists are not supported; pass a numpy array")
        return _scalar_feature(name, value.dtype, (len(value),))
    arr = np.asarray(value)
    if arr.ndim == 0:
        return _scalar_feature(name, arr.dtype, ())
    if arr.dtype.kind not in "biufc":
        raise SchemaError(
            f"feature {name!r}: arrays of dtype {arr.dtype} cannot be stored; use numeric arrays, bytes or str"
        )
    return Feature(name, arr.dtype.newbyteorder("=").name, arr.shape, Encoding.TENSOR)


def _scalar_feature(name: str, dtype: np.dtype, shape) -> Feature:
    if dtype.kind in "biu":
        return Feature(name, "int64", shape, Encoding.INT64)
    if dtype.kind == "f":
        return Feature(name, "float32", shape, Encoding.FLOAT)
    if dtype.kind in "SU":
        return Feature(name, "string" if dtype.kind == "U" else "bytes", shape, Encoding.BYTES)
    raise SchemaError(f"feature {name!r}: values of dtype {dtype} cannot be stored")


def widen(old: Feature, new: Feature) -> Feature:
    """The feature that covers both; list lengths may vary, tensor shapes may not."""
    if old == new:
        return old
    for a, b in ((old, new), (new, old)):  # an empty list fits any list kind
        if (
            a.shape == (0,)
            and len(b.shape) == 1
            and a.encoding is not Encoding.TENSOR
            and b.encoding is not Encoding.TENSOR
        ):
            return Feature(b.name, b.dtype, (None,), b.encoding)
    if old.encoding != new.encoding or old.dtype != new.dtype or len(old.shape) != len(new.shape):
        raise SchemaError(
            f"feature {old.name!r} changed from {old.dtype}{list(old.shape)} ({old.encoding.value}) to "
            f"{new.dtype}{list(new.shape)} ({new.encoding.value}); make every sample agree or pass schema="
        )
    if old.encoding is Encoding.TENSOR and not shape_fits(new.shape, old.shape):
        raise SchemaError(
            f"tensor feature {old.name!r} changed shape from {old.shape} to {new.shape}; to store "
            f"variable shapes pass schema= with None for the varying dimensions"
        )
    shape = tuple(a if a == b else None for a, b in zip(old.shape, new.shape))
    return Feature(old.name, old.dtype, shape, old.encoding)


_VALUE_KINDS = {  # what a feature decodes to: mixture sources must agree on it, not on how it is stored
    Encoding.TENSOR: "numeric",
    Encoding.INT64: "numeric",
    Encoding.FLOAT: "numeric",
    Encoding.IMAGE: "image",
    Encoding.BYTES: "bytes",
}


def item_shape(f: Feature) -> tuple:
    """The shape of one decoded value of ``f`` (an image's is ``(H, W, C)``, None where unknown)."""
    if f.encoding is Encoding.IMAGE and len(f.shape) != 3:
        return (None, None, None)
    return tuple(f.shape)


def mix_feature(name: str, defs: list[Feature], where: list[str]) -> Feature:
    """The one feature, named ``name``, that covers a mixture's sources' definitions ``defs``
    (``where[i]`` names source ``i`` in errors): they must decode to the same kind of value
    (numbers, images, bytes or strings) of one rank; dimensions that differ become None, and
    numbers take the one dtype every source's casts to safely (int32 and int64: int64)."""
    first = defs[0]
    kinds = {_VALUE_KINDS[d.encoding] for d in defs}
    strings = {d.dtype for d in defs if d.encoding is Encoding.BYTES}
    shapes = [item_shape(d) for d in defs]

    def refuse(why: str) -> SchemaError:
        got = "; ".join(f"{w} has {d.name!r} {d.encoding.value} {d.dtype}{list(d.shape)}" for w, d in zip(where, defs))
        return SchemaError(
            f"feature {name!r} cannot be mixed: {why} ({got}); pass features= without it, or rename= another "
            f"feature of the odd source to {name!r}"
        )

    if len(kinds) > 1 or len(strings) > 1:
        raise refuse("the sources decode it to different kinds of values")
    if len({len(sh) for sh in shapes}) > 1:
        raise refuse("the sources give it different ranks")
    dtype = first.dtype
    if kinds == {"numeric"}:
        fits = [d for d in defs if all(np.can_cast(np.dtype(o.dtype), np.dtype(d.dtype), "safe") for o in defs)]
        if not fits:
            raise refuse("no source's dtype holds every source's values")
        first, dtype = fits[0], fits[0].dtype
    shape = tuple(dims[0] if len(set(dims)) == 1 else None for dims in zip(*shapes))
    return Feature(name, dtype, shape, first.encoding)


def shape_fits(shape, pattern) -> bool:
    return len(shape) == len(pattern) and all(p is None or p == s for s, p in zip(shape, pattern))


def _region(f: Feature, parsed: dict) -> tuple[int, memoryview]:
    """``(kind, list region)`` of feature ``f`` in ``example.decode`` output, kind checked."""
    if f.name not in parsed:
        raise SchemaError(f"record has no feature {f.name!r}; it has {sorted(parsed)}")
    kind, region = parsed[f.name]
    if kind and not len(region) and f.encoding is not Encoding.TENSOR:
        kind = 0  # an empty list matches any kind
    if kind not in (0, _KIND[f.encoding]):
        raise SchemaError(
            f"feature {f.name!r} is a {ex.KIND_NAMES[kind]} in the record, the schema expects {f.encoding.value}"
        )
    return kind, region


def encoded_image(f: Feature, parsed: dict) -> memoryview | bytes:
    """The encoded bytes of image feature ``f`` as a view into the record (no copy; ``b""`` for
    an empty feature, which fails to decode with a clear error)."""
    kind, region = _region(f, parsed)
    vals = ex.kind_values(kind, region)
    return vals[0] if len(vals) == 1 else b""


def decode_value(f: Feature, parsed: dict, *, decode_images: bool = True):
    """One feature's value from ``example.decode`` output."""
    kind, region = _region(f, parsed)
    if kind and f.shape == () and f.encoding in (Encoding.INT64, Encoding.FLOAT):
        v = ex.scalar_value(kind, region)
        if v is not None:
            return v
    vals = ex.kind_values(kind, region)
    if f.encoding is Encoding.TENSOR:
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
    if f.encoding is Encoding.IMAGE:
        data = bytes(vals[0]) if len(vals) == 1 else b""
        return decode_image(data, f) if decode_images else data
    if f.encoding is Encoding.BYTES:
        raw = [bytes(v) for v in vals]
        items: list = [b.decode("utf-8") for b in raw] if f.dtype == "string" else raw
        if f.shape == ():
            if len(items) != 1:
                raise SchemaError(f"feature {f.name!r} must hold one value, got {len(items)}")
            return items[0]
        return items
    arr = np.asarray(vals, dtype=np.int64 if f.encoding is Encoding.INT64 else np.float32)
    if f.fixed:
        if arr.size != math.prod(f.fixed_shape):
            raise SchemaError(f"feature {f.name!r} holds {arr.size} values, the schema says shape {list(f.shape)}")
        return arr.reshape(f.shape)
    return arr


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _spng(data) -> np.ndarray | None:
    """An 8-bit gray, gray+alpha, RGB or RGBA PNG decoded by libspng (pyspng: ~6× Pillow on small
    images), as ``(H, W, C)``; None for any other PNG (palette, 16-bit, …: Pillow decodes those as
    it always has) or when pyspng is missing."""
    if len(data) < 33 or bytes(data[12:16]) != b"IHDR" or data[24] != 8 or data[25] not in (0, 2, 4, 6):
        return None
    try:
        import pyspng
    except ImportError:
        return None
    try:
        arr = pyspng.load(data if isinstance(data, bytes) else bytes(data))
    except Exception:  # damaged: Pillow decodes it or says what is wrong
        return None
    return arr[:, :, None] if arr.ndim == 2 else arr


@dataclass(frozen=True)
class ImageFit:
    """What decoded images are brought to (the Loader's ``image_size``, ``channels``, ``resize``):
    ``size`` ``(H, W)`` or None, ``channels`` 1, 3, 4 or None, ``mode`` "stretch" (scaled, aspect
    ratio not kept), "crop" (scaled to cover, centre cut) or "pad" (scaled to fit, zero border)."""

    size: tuple[int, int] | None = None
    channels: int | None = None
    mode: str = "stretch"

    def feature(self, f: Feature) -> Feature:
        """``f`` as its images come out: ``(H, W, C)`` with this fit's size and channels."""
        if f.encoding is not Encoding.IMAGE:
            return f
        h, w, c = item_shape(f)
        h, w = self.size or (h, w)
        return Feature(f.name, "uint8", (h, w, self.channels or c), f.encoding)

    def __call__(self, arr: np.ndarray, name: str = "image") -> np.ndarray:
        """``arr`` (uint8 ``(h, w, c)``) at this fit's size and channels; itself when it already is."""
        from PIL import Image

        h, w, c = arr.shape
        size = self.size or (h, w)
        if size == (h, w) and self.channels in (None, c):
            return arr
        if arr.dtype != np.uint8 or c not in _MODES:
            raise SchemaError(
                f"feature {name!r}: image_size/channels act on 8-bit images of 1 to 4 channels, got {arr.dtype} "
                f"with {c} channels; leave image_size and channels unset and resize in a transform"
            )
        im = Image.fromarray(arr[:, :, 0] if c == 1 else arr, _MODES[c])
        if self.channels not in (None, c):
            im = im.convert(_MODES[self.channels])
        if size != (h, w):
            im = self._resize(im, size)
        out = np.asarray(im)
        return out.reshape(*out.shape[:2], -1)

    def _resize(self, im, size: tuple[int, int]):
        from PIL import Image

        (H, W), (w, h) = size, im.size
        if self.mode == "stretch":
            return im.resize((W, H), Image.Resampling.BILINEAR)
        if self.mode == "crop":  # the centre region of the target's aspect ratio, scaled in one step
            cw, ch = min(w, h * W / H), min(h, w * H / W)
            box = ((w - cw) / 2, (h - ch) / 2, (w + cw) / 2, (h + ch) / 2)
            return im.resize((W, H), Image.Resampling.BILINEAR, box=box)
        scale = min(H / h, W / w)  # pad
        inner = im.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.Resampling.BILINEAR)
        out = Image.new(im.mode, (W, H))
        out.paste(inner, ((W - inner.size[0]) // 2, (H - inner.size[1]) // 2))
        return out


_MODES = {1: "L", 2: "LA", 3: "RGB", 4: "RGBA"}  # Pillow's modes by channel count


def decode_image(data: bytes, f: Feature | None = None, fit: ImageFit | None = None) -> np.ndarray:
    """Encoded JPEG/PNG → uint8 array (H, W, C); grayscale keeps C = 1. With ``fit``, brought to
    its size and channels (a large JPEG is decoded at the smallest scale libjpeg-turbo offers
    that still covers the size: less work for the same result up to rounding)."""
    if fit is None:
        return _decode(data, f)
    name = f.name if f is not None else "image"
    return fit(_decode(data, f, fit.size), name)


def _decode(data, f: Feature | None, at_least: tuple[int, int] | None = None) -> np.ndarray:
    import io

    from PIL import Image

    if bytes(data[:8]) == PNG_MAGIC:
        arr = _spng(data)
        if arr is not None:
            return arr
    if bytes(data[:3]) == b"\xff\xd8\xff":
        try:
            import simplejpeg

            h, w, colorspace, _ = simplejpeg.decode_jpeg_header(data)
            if colorspace in ("YCbCr", "RGB", "Gray"):
                mins = {} if at_least is None else {"min_height": at_least[0], "min_width": at_least[1]}
                arr = simplejpeg.decode_jpeg(data, colorspace="GRAY" if colorspace == "Gray" else "RGB", **mins)
                return arr if arr.ndim == 3 else arr[:, :, None]
        except (ImportError, ValueError, RuntimeError):
            pass  # Pillow decodes it, or says what is wrong
    try:
        with Image.open(io.BytesIO(data)) as im:
            arr = np.asarray(im)
    except Exception as e:  # Pillow raises many types for bad data
        name = f.name if f is not None else "image"
        raise SchemaError(f"feature {name!r}: cannot decode image ({e})") from e
    return arr[:, :, None] if arr.ndim == 2 else arr


def infer_schema(samples) -> Schema:
    """The schema covering an iterable of samples (list lengths widen to ``None``)."""
    feats: dict[str, Feature] = {}
    for s in samples:
        for k, v in s.items():
            f = infer_feature(k, v)
            feats[k] = widen(feats[k], f) if k in feats else f
    return Schema(feats.values())
