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

Everything that depends on the encoding is its codec's (`crossfeed.format.codecs`, ``Feature.codec``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from crossfeed.errors import SchemaError
from crossfeed.format import example as ex
from crossfeed.format.codecs import (  # noqa: F401  (NUMERIC_DTYPES, INT_TYPES, SHAPE_SUFFIX: re-exported)
    INT_TYPES,
    NUMERIC_DTYPES,
    SHAPE_SUFFIX,
    Codec,
    Encoding,
    codec_of,
    infer_value,
    shape_fits,
)
from crossfeed.format.images import decode_image  # noqa: F401  (re-exported)

INDEX_KEY = "__index__"  # a batch key, never a feature: the sample indices of the batch
SOURCE_KEY = "__source__"  # a batch key of mixtures: the source (position in the list) of each sample
VALID_KEY = "__valid__"  # a batch key of fixed-shape batches (JaxLoader): True for a real sample, False for padding


@dataclass(frozen=True)
class Feature:
    """One feature of a dataset. ``shape`` may hold ``None`` for a dimension that varies."""

    name: str
    dtype: str
    shape: tuple[int | None, ...]  # given as any sequence; kept as a tuple
    encoding: Encoding  # an Encoding, its value, or a codec (e.g. ``codecs.INT64``)

    if TYPE_CHECKING:  # the constructor's signature: it takes an Encoding, its value or a codec

        def __init__(
            self, name: str, dtype: str, shape: Sequence[int | None], encoding: Encoding | Codec | str
        ) -> None: ...

    def __post_init__(self):
        enc = self.encoding
        object.__setattr__(self, "encoding", enc.encoding if isinstance(enc, Codec) else Encoding(enc))
        object.__setattr__(self, "shape", tuple(None if d is None else int(d) for d in self.shape))
        if not self.name or self.name.endswith(SHAPE_SUFFIX):
            raise SchemaError(f"feature name {self.name!r} is empty or ends with {SHAPE_SUFFIX!r}; rename it")
        self.codec.check(self)

    @property
    def codec(self) -> Codec:
        """The `Codec` of this feature's kind: everything that depends on the encoding."""
        return _CODECS[self.encoding]

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


_CODECS = {e: codec_of(e) for e in Encoding}


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
    codec, dtype, shape = infer_value(name, value)
    return Feature(name, dtype, shape, codec.encoding)


def widen(old: Feature, new: Feature) -> Feature:
    """The feature that covers both; list lengths may vary, tensor shapes may not."""
    if old == new:
        return old
    for a, b in ((old, new), (new, old)):  # an empty list fits any list kind
        if a.shape == (0,) and len(b.shape) == 1 and not a.codec.strict_shape and not b.codec.strict_shape:
            return Feature(b.name, b.dtype, (None,), b.encoding)
    if old.encoding != new.encoding or old.dtype != new.dtype or len(old.shape) != len(new.shape):
        raise SchemaError(
            f"feature {old.name!r} changed from {old.dtype}{list(old.shape)} ({old.encoding.value}) to "
            f"{new.dtype}{list(new.shape)} ({new.encoding.value}); make every sample agree or pass schema="
        )
    if old.codec.strict_shape and not shape_fits(new.shape, old.shape):
        raise SchemaError(
            f"tensor feature {old.name!r} changed shape from {old.shape} to {new.shape}; to store "
            f"variable shapes pass schema= with None for the varying dimensions"
        )
    shape = tuple(a if a == b else None for a, b in zip(old.shape, new.shape))
    return Feature(old.name, old.dtype, shape, old.encoding)


def item_shape(f: Feature) -> tuple:
    """The shape of one decoded value of ``f`` (an image's is ``(H, W, C)``, None where unknown)."""
    return f.codec.item_shape(f)


def mix_feature(name: str, defs: list[Feature], where: list[str]) -> Feature:
    """The one feature, named ``name``, that covers a mixture's sources' definitions ``defs``
    (``where[i]`` names source ``i`` in errors): they must decode to the same kind of value
    (numbers, images, bytes or strings) of one rank; dimensions that differ become None, and
    numbers take the one dtype every source's casts to safely (int32 and int64: int64)."""
    first = defs[0]
    kinds = {d.codec.value_kind for d in defs}
    strings = {d.dtype for d in defs if d.codec.text}
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


def _region(f: Feature, parsed: dict, codec: Codec) -> tuple[int, memoryview]:
    """``(kind, list region)`` of feature ``f`` in ``example.decode`` output, kind checked."""
    if f.name not in parsed:
        raise SchemaError(f"record has no feature {f.name!r}; it has {sorted(parsed)}")
    kind, region = parsed[f.name]
    if kind and not len(region) and not codec.strict_shape:
        kind = 0  # an empty list matches any kind
    if kind not in (0, codec.wire):
        raise SchemaError(
            f"feature {f.name!r} is a {ex.KIND_NAMES[kind]} in the record, the schema expects {f.encoding.value}"
        )
    return kind, region


def encoded_image(f: Feature, parsed: dict) -> memoryview | bytes:
    """The encoded bytes of image feature ``f`` as a view into the record (no copy; ``b""`` for
    an empty feature, which fails to decode with a clear error)."""
    kind, region = _region(f, parsed, f.codec)
    vals = ex.kind_values(kind, region)
    return vals[0] if len(vals) == 1 else b""


def decode_value(f: Feature, parsed: dict, *, decode_images: bool = True):
    """One feature's value from ``example.decode`` output."""
    codec = _CODECS[f.encoding]
    kind, region = _region(f, parsed, codec)
    return codec.decode(f, kind, region, parsed, decode_images)


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
        if not f.codec.image:
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


def infer_schema(samples) -> Schema:
    """The schema covering an iterable of samples (list lengths widen to ``None``)."""
    feats: dict[str, Feature] = {}
    for s in samples:
        for k, v in s.items():
            f = infer_feature(k, v)
            feats[k] = widen(feats[k], f) if k in feats else f
    return Schema(feats.values())
