"""Decode: record payloads → one batch, ``dict[str, np.ndarray]``.

Two paths:

* **Fixed layout** (every requested feature a fixed-shape tensor, int64 or float): records of
  equal length share one byte layout — the same feature names, tags and length prefixes at the
  same places, only the values differ. The layout is read off one record; every other record of
  that length is checked against it (all non-value bytes equal, varint continuation bits as
  expected) and its values are cut out column-wise — one numpy pass per batch, not per record.
* **Generic**: each record parsed on its own (`crossfeed.example`), images decoded with Pillow
  in a thread pool, values stacked.

Batch form: a feature whose shape is the same for every sample of the batch is one array with a
leading batch axis. Strings and bytes, and features whose shape varies within the batch (a
variable-length list, images of different sizes), come as a 1-D ``object`` array holding one
value (``str``/``bytes``/``np.ndarray``) per sample.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from crossfeed import example as ex
from crossfeed.errors import CrossfeedError, ExampleError, SchemaError
from crossfeed.schema import Encoding, Feature, decode_image, decode_value

_COLUMNAR_MAX_LEN = 4096  # records up to this size are cut column-wise; larger ones one by one


@dataclass(frozen=True)
class _Slot:
    feature: Feature
    start: int
    stop: int
    widths: tuple[int, ...] = ()  # int64: byte width of each varint


@dataclass(frozen=True)
class Layout:
    length: int
    slots: tuple[_Slot, ...]
    skeleton: np.ndarray  # byte positions outside the values
    first: bytes

    @classmethod
    def of(cls, payload, features: Sequence[Feature]) -> Layout | None:
        try:
            sp = ex.spans(payload)
        except ExampleError:
            return None
        buf = bytes(payload)
        slots, covered = [], np.zeros(len(buf), dtype=bool)
        for f in features:
            if f.name not in sp:
                return None
            kind, s, e = sp[f.name]
            if kind == 0 or e - s < 2 or buf[s] != 0x0A:
                return None
            n, pos = ex._read_varint(buf, s + 1, e)
            if pos + n != e:
                return None  # more than one value field (unpacked, or several bytes values)
            count = int(np.prod(f.shape, dtype=np.int64))
            if f.encoding is Encoding.TENSOR and n != count * np.dtype(f.dtype).itemsize:
                return None
            if f.encoding is Encoding.FLOAT and n != 4 * count:
                return None
            widths: tuple[int, ...] = ()
            if f.encoding is Encoding.INT64:
                widths, p = [], pos
                while p < e:
                    q = ex._read_varint(buf, p, e)[1]
                    widths.append(q - p)
                    p = q
                if len(widths) != count:
                    return None
                widths = tuple(widths)
            slots.append(_Slot(f, pos, e, widths))
            covered[pos:e] = True
        return cls(len(buf), tuple(slots), np.flatnonzero(~covered), buf)

    def cut(self, rows: np.ndarray) -> dict[str, np.ndarray] | None:
        """Values of ``rows`` (``(g, length)`` uint8), or None if a row does not match."""
        first = np.frombuffer(self.first, dtype=np.uint8)
        if self.skeleton.size and not np.array_equal(rows[:, self.skeleton], np.broadcast_to(first[self.skeleton], (len(rows), self.skeleton.size))):
            return None
        out = {}
        g = len(rows)
        for sl in self.slots:
            f = sl.feature
            block = rows[:, sl.start : sl.stop]
            if f.encoding is Encoding.INT64:
                vals = _varints(block, sl.widths)
                if vals is None:
                    return None
                out[f.name] = vals.reshape((g, *f.shape))
            else:
                dt = "<f4" if f.encoding is Encoding.FLOAT else np.dtype(f.dtype).newbyteorder("<")
                arr = np.ascontiguousarray(block).view(dt).reshape((g, *f.shape))
                out[f.name] = arr.astype(arr.dtype.newbyteorder("="), copy=False)
        return out


def _varints(block: np.ndarray, widths: tuple[int, ...]) -> np.ndarray | None:
    cols, p = [], 0
    for w in widths:
        b = block[:, p : p + w].astype(np.uint64)
        cont = b >= 0x80
        expect = np.zeros(w, dtype=bool)
        expect[:-1] = True
        if not np.array_equal(cont, np.broadcast_to(expect, cont.shape)):
            return None
        v = np.zeros(len(block), dtype=np.uint64)
        for j in range(w):
            v |= (b[:, j] & np.uint64(0x7F)) << np.uint64(7 * j)
        cols.append(v.view(np.int64))
        p += w
    return np.stack(cols, axis=1) if cols else np.zeros((len(block), 0), np.int64)


class BatchDecoder:
    """Turns a list of payloads into a batch. ``image_pool`` (an Executor) decodes images in
    parallel; ``where(i)`` names record ``i`` (shard and offset) in errors."""

    def __init__(self, features: Sequence[Feature], *, decode_images: bool = True, image_pool=None):
        self.features = tuple(features)
        self.decode_images = decode_images
        self.image_pool = image_pool
        self.fixed = all(f.fixed and f.encoding in (Encoding.TENSOR, Encoding.INT64, Encoding.FLOAT) for f in self.features)
        self._layouts: dict[int, Layout | None] = {}

    def __call__(self, payloads: Sequence, *, where: Callable[[int], str] = str,
                 on_error: Callable[[CrossfeedError], None] | None = None) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """``(batch, kept)``: ``kept`` are the positions of ``payloads`` that made it into the
        batch (all of them unless ``on_error`` skipped some)."""
        if self.fixed and payloads:
            got = self._fixed(payloads)
            if got is not None:
                return got, np.arange(len(payloads))
        return self._generic(payloads, where, on_error)

    # -- fixed layout -------------------------------------------------------------------------
    def _fixed(self, payloads) -> dict[str, np.ndarray] | None:
        lengths = np.fromiter(map(len, payloads), dtype=np.int64, count=len(payloads))
        n = len(payloads)
        out = {f.name: np.empty((n, *f.shape), dtype=np.int64 if f.encoding is Encoding.INT64 else
                                ("float32" if f.encoding is Encoding.FLOAT else f.dtype)) for f in self.features}
        for length in np.unique(lengths).tolist():
            pos = np.flatnonzero(lengths == length)
            layout = self._layout(payloads[int(pos[0])], length)
            if layout is None:
                return None
            if length <= _COLUMNAR_MAX_LEN:
                group = [payloads[i] for i in pos.tolist()]
                rows = np.frombuffer(b"".join(group), dtype=np.uint8).reshape(len(group), length)
                vals = layout.cut(rows)
                if vals is None:
                    return None
                for k, v in vals.items():
                    out[k][pos] = v
            else:
                for i in pos.tolist():
                    if not self._one_large(layout, payloads[i], out, i):
                        return None
        return out

    def _layout(self, payload, length: int) -> Layout | None:
        if length not in self._layouts:
            self._layouts[length] = Layout.of(payload, self.features) if len(self._layouts) < 64 else None
        return self._layouts[length]

    @staticmethod
    def _one_large(layout: Layout, payload, out, i: int) -> bool:
        p = np.frombuffer(payload, dtype=np.uint8)
        first = np.frombuffer(layout.first, dtype=np.uint8)
        if not np.array_equal(p[layout.skeleton], first[layout.skeleton]):
            return False
        for sl in layout.slots:
            f = sl.feature
            block = p[sl.start : sl.stop]
            if f.encoding is Encoding.INT64:
                vals = _varints(block[None, :], sl.widths)
                if vals is None:
                    return False
                out[f.name][i] = vals.reshape(f.shape)
            else:
                dt = "<f4" if f.encoding is Encoding.FLOAT else np.dtype(f.dtype).newbyteorder("<")
                out[f.name][i] = block.view(dt).reshape(f.shape)
        return True

    # -- generic ------------------------------------------------------------------------------
    def _generic(self, payloads, where, on_error):
        samples, kept = [], []
        for i, p in enumerate(payloads):
            try:
                parsed = ex.decode(p)
                samples.append({f.name: decode_value(f, parsed, decode_images=False) for f in self.features})
                kept.append(i)
            except (SchemaError, ExampleError) as e:
                err = type(e)(f"{where(i)}: {e}")
                if on_error is None:
                    raise err from e
                on_error(err)
        kept_arr = np.asarray(kept, dtype=np.int64)
        batch = {}
        for f in self.features:
            vals = [s[f.name] for s in samples]
            if f.encoding is Encoding.IMAGE and self.decode_images:
                vals, bad = self._images(vals, f, [where(i) for i in kept], on_error)
                if bad:
                    keep = [j for j in range(len(vals)) if j not in bad]
                    kept_arr = kept_arr[keep]
                    samples = [samples[j] for j in keep]
                    vals = [vals[j] for j in keep]
                    for k in batch:
                        batch[k] = batch[k][keep]
            batch[f.name] = collate(vals)
        return batch, kept_arr

    def _images(self, datas, f, wheres, on_error):
        def one(args):
            j, data = args
            try:
                return decode_image(data, f)
            except SchemaError as e:
                return SchemaError(f"{wheres[j]}: {e}")

        results = list(self.image_pool.map(one, enumerate(datas))) if self.image_pool else list(map(one, enumerate(datas)))
        bad = set()
        for j, r in enumerate(results):
            if isinstance(r, SchemaError):
                if on_error is None:
                    raise r
                on_error(r)
                bad.add(j)
        return results, bad


def collate(vals: list) -> np.ndarray:
    """Stack per-sample values into a batch; ragged or non-numeric values give an object array."""
    if vals and all(isinstance(v, np.ndarray) for v in vals):
        shape = vals[0].shape
        if all(v.shape == shape and v.dtype == vals[0].dtype for v in vals):
            return np.stack(vals)
    out = np.empty(len(vals), dtype=object)
    for i, v in enumerate(vals):
        out[i] = v
    return out
