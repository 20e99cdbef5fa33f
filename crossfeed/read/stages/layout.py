"""The fixed-layout fast path of decoding: records of equal length whose features are all
fixed-shape tensors, int64 or float share one byte layout — the same feature names, tags and
length prefixes at the same places, only the values differ. `Layout.of` reads the layout off one
record; `Layout.cut` checks a whole ``(records, length)`` byte matrix against it (every non-value
byte equal, varint continuation bits as expected) and cuts the values out column-wise, one numpy
pass per batch; large values are copied record by record straight into the batch."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import crc32c
import numpy as np

from crossfeed.errors import ExampleError
from crossfeed.format import example as ex
from crossfeed.format.schema import Feature

_BIG = 512  # a tensor/float value at least this many bytes is copied record by record, straight into the batch
_LITTLE = sys.byteorder == "little"


@dataclass(frozen=True)
class _Slot:
    feature: Feature
    start: int
    stop: int
    widths: tuple[int, ...] = ()  # int64: byte width of each varint


@dataclass(frozen=True)
class Layout:
    """The byte layout shared by records of one length.

    The "kept" bytes of a record are all but its big values: ``ranges`` of the record, joined.
    ``slots`` and ``skeleton`` are positions in the kept bytes (so a batch of kept bytes is a
    ``(g, kept)`` matrix cut column-wise); ``big`` slots are positions in the record.
    """

    length: int
    slots: tuple[_Slot, ...]
    skeleton: np.ndarray  # kept-byte positions outside the values
    first: bytes  # kept bytes of the record the layout was read off
    big: tuple[_Slot, ...] = ()
    ranges: tuple[tuple[int, int], ...] = ()
    expect: np.ndarray | None = None  # ``first``'s bytes at ``skeleton``: what every record must have there

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
            n, pos = ex.read_varint(buf, s + 1, e)
            if pos + n != e:
                return None  # more than one value field (unpacked, or several bytes values)
            count = int(np.prod(f.fixed_shape, dtype=np.int64))
            packed = f.codec.packed_dtype(f)  # None: varints
            if packed is not None and n != count * packed.itemsize:
                return None
            widths: tuple[int, ...] = ()
            if packed is None:
                each: list[int] = []
                p = pos
                while p < e:
                    q = ex.read_varint(buf, p, e)[1]
                    each.append(q - p)
                    p = q
                if len(each) != count:
                    return None
                widths = tuple(each)
            slots.append(_Slot(f, pos, e, widths))
            covered[pos:e] = True
        wanted = {f.name for f in features}
        for name, (_, s, e) in sp.items():  # features not read: their values are no part of the layout
            if name not in wanted:
                covered[s:e] = True  # (their entries' lengths stay in it, so the values cannot move)
        big = tuple(
            sorted(
                (
                    sl
                    for sl in slots
                    if sl.feature.codec.packed_dtype(sl.feature) is not None and sl.stop - sl.start >= _BIG and _LITTLE
                ),
                key=lambda sl: sl.start,
            )
        )
        keep = np.ones(len(buf), dtype=bool)
        for sl in big:
            keep[sl.start : sl.stop] = False
        kept_at = np.cumsum(keep) - 1  # record position → kept position (for kept bytes)
        small = tuple(
            _Slot(sl.feature, int(kept_at[sl.start]), int(kept_at[sl.start]) + sl.stop - sl.start, sl.widths)
            for sl in slots
            if sl not in big
        )
        edges = [0, *[x for sl in big for x in (sl.start, sl.stop)], len(buf)]
        ranges = tuple((a, b) for a, b in zip(edges[::2], edges[1::2]) if b > a)
        skeleton = kept_at[np.flatnonzero(~covered & keep)]
        first = buf if not big else bytes(np.frombuffer(buf, np.uint8)[keep])
        return cls(len(buf), small, skeleton, first, big, ranges, np.frombuffer(first, np.uint8)[skeleton].copy())

    def kept_rows(self, payloads: Sequence) -> np.ndarray:
        """The kept bytes of records of this layout's length, as a ``(g, kept)`` uint8 matrix."""
        if not self.big:
            data = b"".join(payloads)
        else:
            data = b"".join([p[a:b] for p in payloads for a, b in self.ranges])
        return np.frombuffer(data, dtype=np.uint8).reshape(len(payloads), -1)

    def kept_matrix(self, rows: np.ndarray) -> np.ndarray:
        """`kept_rows` for payloads given as the rows of a ``(g, length)`` uint8 matrix."""
        if not self.big:
            return rows
        return np.concatenate([rows[:, a:b] for a, b in self.ranges], axis=1) if self.ranges else rows[:, :0]

    def copy_big_rows(self, rows: np.ndarray, out: dict[str, np.ndarray], pos) -> None:
        """`copy_big` for payloads given as the rows of a ``(g, length)`` uint8 matrix."""
        for sl in self.big:
            dst = out[sl.feature.name]
            dst.reshape(len(dst), -1).view(np.uint8)[pos] = rows[:, sl.start : sl.stop]

    def copy_big(self, payloads: Sequence, out: dict[str, np.ndarray], pos: np.ndarray, crcs=None) -> None:
        """Copy each record's big values straight into its row of the batch arrays (no other copy).
        ``crcs`` (a uint32 array): also the CRC32C of each whole payload, taken just before its
        values are copied, so that the copy reads bytes the CRC has just brought into cache."""
        for n, sl in enumerate(self.big):
            dst = out[sl.feature.name]
            rows = dst.reshape(len(dst), -1).view(np.uint8)  # native = little-endian here (see _LITTLE)
            width = sl.stop - sl.start
            take = crcs is not None and n == 0  # ``crcs`` in batch order, like ``pos``
            for i, p in zip(pos.tolist(), payloads):
                if take:
                    crcs[i] = crc32c.crc32c(p)
                rows[i] = np.frombuffer(p, np.uint8, width, sl.start)

    def cut(self, rows: np.ndarray) -> dict[str, np.ndarray] | None:
        """Small values of ``rows`` (``(g, kept)`` uint8), or None if a row does not match."""
        if self.skeleton.size and not (rows[:, self.skeleton] == self.expect).all():
            return None
        out = {}
        g = len(rows)
        for sl in self.slots:
            f = sl.feature
            block = rows[:, sl.start : sl.stop]
            dt = f.codec.packed_dtype(f)
            if dt is None:
                vals = _varints(block, sl.widths)
                if vals is None:
                    return None
                out[f.name] = vals.reshape((g, *f.shape))
            else:
                arr = np.ascontiguousarray(block).view(dt).reshape((g, *f.shape))
                out[f.name] = arr.astype(arr.dtype.newbyteorder("="), copy=False)
        return out


def fixed_dtype(f: Feature) -> np.dtype:
    return f.codec.dtype(f)


def _varints(block: np.ndarray, widths: tuple[int, ...]) -> np.ndarray | None:
    """The int64 values of varints of the given byte ``widths`` laid side by side in each row of
    ``block``; None if a continuation bit is not where the widths say."""
    if widths and max(widths) == 1:  # the usual case (small labels, ids < 128): one byte each
        if (block >= 0x80).any():
            return None
        return block.astype(np.int64)
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
