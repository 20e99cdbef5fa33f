"""Stage 3 of the read pipeline: `Frames` (checked payloads) → one batch, ``dict[str, np.ndarray]``.

The strategy is chosen once per Loader from the schema (`make_decoder`):

* `ColumnarDecoder` — every requested feature a fixed-shape tensor, int64 or float: records of
  one length share one byte layout, checked and cut column-wise — one numpy pass per batch, not
  per record (`crossfeed.read.stages.layout`); big values are copied once, straight into the batch. A
  group of records whose layout does not fit (another field order, say) is parsed record by
  record into the same batch arrays: nothing is fetched twice.
* `RecordDecoder` — each record parsed on its own (`crossfeed.format.example`), JPEGs decoded by
  libjpeg-turbo (simplejpeg) straight into their row of the batch, other images with Pillow;
  with an `ImageFit` (the Loader's ``image_size``/``channels``) each image is brought to one
  size and channel count as it is decoded, so photos of any size batch into one array.

Both return ``(batch, kept)``: ``kept`` are the positions of the batch's records that made it
(all of them unless ``on_error`` dropped bad ones).

Batch form: a feature whose shape is the same for every sample of the batch is one array with a
leading batch axis. Strings and bytes, and features whose shape varies within the batch (a
variable-length list, images of different sizes), come as a 1-D ``object`` array holding one
value (``str``/``bytes``/``np.ndarray``) per sample.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import crc32c
import numpy as np

from crossfeed.errors import CrossfeedError, ExampleError, SchemaError
from crossfeed.format import example as ex
from crossfeed.format import tar

try:  # libjpeg-turbo decoding straight into numpy; Pillow is the fallback
    import simplejpeg as _simplejpeg
except ImportError:  # pragma: no cover - simplejpeg is a core dependency
    _simplejpeg = None

from crossfeed.format.schema import Feature, ImageFit, decode_image, decode_value, encoded_image
from crossfeed.read.stages.frames import Frames, PathCounts
from crossfeed.read.stages.layout import Layout, fixed_dtype


class _Recycler:
    """Batch-sized arrays, each reused once nothing but the recycler refers to it any more.

    Fresh memory is zeroed by the kernel page by page on first touch, which costs about as much
    as copying a batch of raw images into it; a consumer that lets go of its batches gets the
    same few buffers back instead. Safe by reference counting: a batch array the caller (or a
    view, a torch/TF tensor, a pending ZeroMQ send) still holds is never handed out again.
    """

    def __init__(self, keep: int = 8, min_bytes: int = 1 << 20):
        self.keep, self.min_bytes = keep, min_bytes
        self._arrays: list[np.ndarray] = []
        self._lock = threading.Lock()

    def empty(self, shape: tuple, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        if self.keep < 1 or math.prod(shape) * dtype.itemsize < self.min_bytes:
            return np.empty(shape, dtype)
        with self._lock:
            for a in self._arrays:
                # references: the list, ``a`` and getrefcount's argument — nobody else
                if a.shape == shape and a.dtype == dtype and sys.getrefcount(a) == 3:
                    return a
            a = np.empty(shape, dtype)
            self._arrays.append(a)
            if len(self._arrays) > self.keep:
                del self._arrays[0]
            return a


SPLIT_IMAGES = 512  # a batch of at least this many images is decoded by several threads at once
_pool_lock = threading.Lock()
_pool: tuple[int, ThreadPoolExecutor, int] | None = None  # (pid, pool, threads)


def _image_pool() -> tuple[ThreadPoolExecutor, int] | None:
    """One thread per core for decoding the images of big batches (so the first batch of 4096
    JPEGs does not wait on one core); per process — a forked DataLoader worker makes its own.
    ``(pool, threads)``; None on a single core."""
    global _pool
    cores = os.cpu_count() or 1
    if cores < 2:
        return None
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            threads = min(cores, 16)
            _pool = (os.getpid(), ThreadPoolExecutor(threads, thread_name_prefix="crossfeed-images"), threads)
        return _pool[1], _pool[2]


def make_decoder(
    features: Sequence[Feature],
    *,
    decode_images: bool = True,
    recycle: int = 8,
    shard_format: str = "tfrecord",
    fit: ImageFit | None = None,
) -> RecordDecoder:
    """The decoding strategy for ``features``, chosen once (see the module docstring). Up to
    ``recycle`` large batch arrays are reused once their consumer has dropped them. Tar shards
    (``shard_format="tar"``) take `TarDecoder`. ``fit``: decoded images are brought to its size
    and channels as they are decoded."""
    features = tuple(features)
    if shard_format == "tar":
        return TarDecoder(features, decode_images=decode_images, recycle=recycle, fit=fit)
    columnar = all(f.fixed and f.codec.dense for f in features)
    cls = ColumnarDecoder if columnar and features else RecordDecoder
    return cls(features, decode_images=decode_images, recycle=recycle, fit=fit)


class RecordDecoder:
    """Parses each record on its own. ``where(i)`` names record ``i`` of the batch (shard and
    offset) in errors; ``on_error`` takes a bad record's error (else it raises)."""

    columnar = False

    def __init__(
        self, features: Sequence[Feature], *, decode_images: bool = True, recycle: int = 8, fit: ImageFit | None = None
    ):
        self.features = tuple(features)
        self._recycler = _Recycler(recycle)
        self.decode_images = decode_images
        self.fit = fit  # images brought to one size and channel count as they are decoded (None: as stored)
        # images this decoder decodes are taken as views into the record (no copy of the bytes)
        self._views = {f.name for f in self.features if f.codec.image and decode_images}
        self.alloc: Callable | None = None  # where batch arrays go (None: recycled heap arrays)

    def _empty(self, shape: tuple, dtype) -> np.ndarray:
        return (self.alloc or self._recycler.empty)(shape, dtype)

    def __call__(
        self,
        frames: Frames,
        *,
        where: Callable[[int], str] = str,
        on_error: Callable[[CrossfeedError], None] | None = None,
    ) -> tuple[dict[str, np.ndarray], np.ndarray]:
        frames.verify()
        payloads = frames.as_payloads()
        return self._generic(payloads, where, on_error)

    def parse(self, payload, where: Callable[[], str]) -> dict:
        """One record's values (images undecoded: ``bytes``, or a view into the record when this
        decoder decodes them itself); errors name the record (``where()`` is only called then:
        naming a record costs an index lookup)."""
        try:
            parsed = ex.decode(payload)
            return {
                f.name: encoded_image(f, parsed)
                if f.name in self._views
                else decode_value(f, parsed, decode_images=False)
                for f in self.features
            }
        except (SchemaError, ExampleError) as e:
            raise type(e)(f"{where()}: {e}") from e

    # -- generic ------------------------------------------------------------------------------
    def _generic(self, payloads, where, on_error):
        samples, kept = [], []
        for i, p in enumerate(payloads):
            try:
                samples.append(self.parse(p, functools.partial(where, i)))
                kept.append(i)
            except (SchemaError, ExampleError) as e:
                if on_error is None:
                    raise
                on_error(e)
        kept_arr = np.asarray(kept, dtype=np.int64)
        batch: dict[str, Any] = {}
        for f in self.features:
            vals = [s[f.name] for s in samples]
            if f.codec.image and self.decode_images:
                vals, bad, whole = self._images(vals, f, lambda j, kept=kept: where(kept[j]), on_error)
                if bad:
                    keep = [j for j in range(len(vals)) if j not in bad]
                    kept_arr = kept_arr[keep]
                    samples = [samples[j] for j in keep]
                    vals = [vals[j] for j in keep]
                    for k in batch:
                        batch[k] = batch[k][keep]
                    whole = None
                if whole is not None:  # every image was decoded straight into its row
                    batch[f.name] = whole
                    continue
            if f.shape == () and f.codec.dense and f.codec.listed:  # numpy scalars
                batch[f.name] = self._empty((len(vals),), fixed_dtype(f))
                batch[f.name][:] = vals
            else:
                batch[f.name] = collate(vals, alloc=self._empty)
        return batch, kept_arr

    def _images(self, datas, f, where, on_error):
        """``(arrays, bad positions, whole)``: ``whole`` is the batch array when every image was
        decoded straight into its row of it (JPEGs of one RGB size, the common case), else None."""
        whole = self._image_batch(datas)

        def one(args):
            j, data = args
            try:
                if whole is not None and self._jpeg_into(data, whole[j]):
                    return whole[j]
                return decode_image(data if isinstance(data, bytes) else bytes(data), f, self.fit)
            except SchemaError as e:
                return SchemaError(f"{where(j)}: {e}")

        items = list(enumerate(datas))
        pooled = _image_pool() if len(items) >= SPLIT_IMAGES else None
        if pooled is None:
            results = list(map(one, items))
        else:  # a big batch: its images decoded by every core at once (libjpeg-turbo releases the GIL)
            pool, threads = pooled
            step = -(-len(items) // threads)
            parts = pool.map(
                lambda part: [one(x) for x in part], [items[i : i + step] for i in range(0, len(items), step)]
            )
            results = [r for part in parts for r in part]
        bad = set()
        for j, r in enumerate(results):
            if isinstance(r, SchemaError):
                if on_error is None:
                    raise r
                on_error(r)
                bad.add(j)
        if whole is not None and any(r.base is not whole for r in results if isinstance(r, np.ndarray)):
            whole = None
        return results, bad, whole

    def _image_batch(self, datas) -> np.ndarray | None:
        """A ``(n, h, w, 3)`` batch array sized by the first image's header, if it is a colour JPEG
        (and images are decoded as they are stored: a fit resizes each one first)."""
        header = jpeg_header(datas[0]) if datas and self.fit is None else None
        if header is None or header[2] != 3:
            return None
        return self._empty((len(datas), *header), np.uint8)

    @staticmethod
    def _jpeg_into(data, out: np.ndarray) -> bool:
        """Decode a colour JPEG of ``out``'s size straight into ``out`` (libjpeg-turbo through
        simplejpeg, GIL released: no temporary image, no copy); False if it is not one."""
        if jpeg_header(data) != out.shape:
            return False
        try:
            _simplejpeg.decode_jpeg(data, colorspace="RGB", buffer=out)
        except (ValueError, RuntimeError):  # damaged: decode_image decodes it or reports the error
            return False
        return True


class TarDecoder(RecordDecoder):
    """Stage 3 for tar shards: payloads are tar samples (``{extension: view}``, from the frame
    reader). Only how one sample is parsed differs from TFRecords (`crossfeed.format.tar.sample_values`):
    images are decoded, collated and recycled by `RecordDecoder`'s own path."""

    def parse(self, payload, where: Callable[[], str]) -> dict:
        return tar.sample_values(payload, self.features, decode_images=False, where=where)


class ColumnarDecoder(RecordDecoder):
    """Cuts fixed-layout records column-wise (see the module docstring)."""

    columnar = True

    def __init__(
        self, features: Sequence[Feature], *, decode_images: bool = True, recycle: int = 8, fit: ImageFit | None = None
    ):
        super().__init__(features, decode_images=decode_images, recycle=recycle, fit=fit)
        self._layouts: dict[int, Layout | None] = {}
        self.served = PathCounts()  # groups of records "cut" column-wise, or "parsed" record by record

    def __call__(
        self,
        frames: Frames,
        *,
        where: Callable[[int], str] = str,
        on_error: Callable[[CrossfeedError], None] | None = None,
    ) -> tuple[dict[str, np.ndarray], np.ndarray]:
        n = len(frames)
        out = {f.name: self._empty((n, *f.shape), fixed_dtype(f)) for f in self.features}
        bad: list[int] = []
        # deferred payload CRCs (big records, `Frames.unchecked`) are taken as each record is copied
        crcs = np.empty(n, dtype=np.uint32) if frames.unchecked is not None else None
        for pos, group in self._groups(frames):
            if self._cut(group, out, pos, frames.rows is not None, crcs):
                self.served.add("cut")
            else:
                frames.verify()  # every CRC, before any record is parsed (then no more to take)
                crcs = None
                self.served.add("parsed")
                self._parse_into(group, out, np.arange(n) if pos is None else pos, where, on_error, bad)
        frames.verify(crcs)
        kept = np.arange(n)
        if bad:
            kept = np.setdiff1d(kept, bad)
            out = {k: v[kept] for k, v in out.items()}
        return out, kept

    @staticmethod
    def _groups(frames: Frames):
        """``(positions or None, payloads of one length)``: a list of buffers, or a uint8 matrix."""
        if frames.rows is not None:
            return frames.rows
        payloads = frames.payloads
        if not payloads:
            return []
        lengths = np.fromiter(map(len, payloads), dtype=np.int64, count=len(payloads))
        if lengths.min() == lengths.max():  # the usual case: one length, no regrouping
            return [(None, payloads)]
        return [
            (pos, [payloads[i] for i in pos.tolist()])
            for pos in (np.flatnonzero(lengths == k) for k in np.unique(lengths).tolist())
        ]

    def _cut(self, group, out: dict[str, np.ndarray], pos, rows: bool, crcs=None) -> bool:
        """Cut a group of equal-length payloads with its layout into ``out``; False if the layout
        does not fit (nothing written then that a record-by-record parse does not overwrite).
        ``crcs`` (batch order): where cut, each payload's CRC32C goes there, taken as its big
        values are copied."""
        first = group[0]
        layout = self._layout(first.tobytes() if rows else first, len(first))
        if layout is None:
            return False
        vals = layout.cut(layout.kept_matrix(group) if rows else layout.kept_rows(group))
        if vals is None:
            return False
        for k, v in vals.items():
            if pos is None:
                out[k] = v
            else:
                out[k][pos] = v
        if rows:
            layout.copy_big_rows(group, out, slice(None) if pos is None else pos)
        else:
            layout.copy_big(group, out, np.arange(len(group)) if pos is None else pos, crcs)
            if crcs is not None and not layout.big:  # (nothing copied to take them with)
                crcs[slice(None) if pos is None else pos] = [crc32c.crc32c(p) for p in group]
        return True

    def _parse_into(self, group, out, pos: np.ndarray, where, on_error, bad: list[int]) -> None:
        for j, p in zip(pos.tolist(), group):
            try:
                vals = self.parse(p, functools.partial(where, j))
            except (SchemaError, ExampleError) as e:
                if on_error is None:
                    raise
                on_error(e)
                bad.append(j)
                continue
            for k, v in vals.items():
                out[k][j] = v

    def _layout(self, payload, length: int) -> Layout | None:
        if length not in self._layouts:
            self._layouts[length] = Layout.of(payload, self.features) if len(self._layouts) < 64 else None
        return self._layouts[length]


def jpeg_header(data) -> tuple[int, int, int] | None:
    """``(height, width, channels)`` of a JPEG from its header, or None if it is not a JPEG that
    simplejpeg (libjpeg-turbo) can decode to RGB or gray."""
    if _simplejpeg is None or bytes(data[:3]) != b"\xff\xd8\xff":
        return None
    try:
        h, w, colorspace, _ = _simplejpeg.decode_jpeg_header(data)
    except (ValueError, RuntimeError):
        return None
    if colorspace in ("Gray",):
        return h, w, 1
    return (h, w, 3) if colorspace in ("YCbCr", "RGB") else None


def collate(vals: list, *, alloc: Callable[[tuple, np.dtype], np.ndarray] = np.empty) -> np.ndarray:
    """Stack per-sample values into a batch (into ``alloc(shape, dtype)``); ragged or non-numeric
    values give an object array."""
    # numeric numpy scalars (what ``batch[k][i]`` gives for a scalar feature) stack like 0-d arrays
    if vals and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
        vals = [np.asarray(v) for v in vals]  # Python numbers from a transform stack like 0-d arrays
    if vals and all(isinstance(v, np.ndarray) or (isinstance(v, np.generic) and v.dtype.kind in "biufc") for v in vals):
        shape, dtype = vals[0].shape, vals[0].dtype
        if all(v.shape == shape and v.dtype == dtype for v in vals):
            return np.stack(vals, out=alloc((len(vals), *shape), dtype))
    out = np.empty(len(vals), dtype=object)
    for i, v in enumerate(vals):
        out[i] = v
    return out
