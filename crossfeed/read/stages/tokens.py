"""The fast path of packed token batches: records checked a whole shard at a time, values
sliced straight out of the shards' bytes.

A token dataset written by crossfeed (`crossfeed.write_dataset`, `crossfeed convert text`) whose
schema is exactly the packed features, each a raw tensor, stores every document as the same
``tf.train.Example`` bytes but for its values and a few length prefixes: a record of ``n``
tokens is ``gap₀ values₀ gap₁ … gapₖ``, the gaps a function of ``n`` alone. `RecordModel` learns
that function once per schema — it parses the encoder's bytes of one probe document into a tree
of length-delimited fields whose leaves are constants, a feature's values, or ``n`` itself, and
checks that the tree rebuilds the encoder's bytes exactly for probes on every side of the
varint width steps — and then writes the expected gaps of any number of records at once, in
numpy.

`TokenShards` checks each shard's layout on the first batch of this process that touches it, all
its records at once: every framed record's header (its length and the length's CRC), and every
record's bytes outside its value slots equal to those of the length its lengths file gives — so
a record holds exactly the planned number of values (a lengths file that does not belong to the
records is found here). A shard that passes is kept as one byte span with each record's value
offsets, payload range and stored payload CRC; a batch checks the payload CRC of each record it
reads (one C call per record, as the frame stage does) and then cuts its pieces straight out of
the span (one ``bytes.join`` over C slices per feature, no per-document Python bytecode). A shard
whose layout check fails (another writer's layout, lengths that lie), and a batch with a record
whose CRC does not match, go the Loader's general way (read and decode per batch), which names
the record or skips it under ``on_error``. Remote shards read by range take that way too.
"""

from __future__ import annotations

import threading

import crc32c as _crc32c
import numpy as np

from crossfeed.errors import CrossfeedError
from crossfeed.format import example as ex
from crossfeed.format.frames import FRAMING, bad_headers, gather, out_of_bounds, stored_crcs
from crossfeed.format.tfrecord import HEADER, mask
from crossfeed.read.stages.frames import ALL_INDEX_MAX, Span

# probes: every side of the varint steps of a length prefix (2^7, 2^14, 2^21 bytes) for any value width
PROBES = (0, 1, 2, 3, 5, 31, 32, 33, 63, 64, 127, 128, 129, 1001, 2047, 2048, 2049, 4095, 4096, 4097, 16383, 16384)
PROBES += (16385, 65535, 65536, 65537)
BASE = 1001  # the probe whose bytes are parsed into the tree


def varint_widths(v: np.ndarray) -> np.ndarray:
    """Bytes of the varint of each (non-negative) value."""
    w = np.ones(len(v), dtype=np.int64)
    x = v >> 7
    while len(x) and x.max() > 0:
        w += x > 0
        x = x >> 7
    return w


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


class RecordModel:
    """The bytes of a record of ``n`` values per feature, for the schemas it fits (`of`):
    ``ops(ns)`` is the record as a sequence of ``("c", bytes)`` constants, ``("v", values)``
    varints (one value per record) and ``("val", feature)`` value slots."""

    def __init__(self, tree: list, sizes: list[int]):
        self.tree, self.sizes = tree, sizes

    @classmethod
    def of(cls, schema, names: list[str]) -> RecordModel | None:
        """The model of records of ``schema`` (whose features must be exactly ``names``, each a
        raw tensor), checked against the encoder at every probe; None where it does not fit."""
        from crossfeed.format.encode import encoder_for

        if sorted(schema.names) != sorted(names):
            return None
        dtypes = [np.dtype(schema[n].dtype) for n in names]
        encode = encoder_for(schema).encode

        def sample(n: int) -> tuple[dict, list[bytes]]:
            marks = [bytes([0x41 + i]) * (n * dt.itemsize) for i, dt in enumerate(dtypes)]
            return {name: np.frombuffer(m, dt) for name, dt, m in zip(names, dtypes, marks)}, marks

        try:
            values, marks = sample(BASE)
            tree = _parse(bytes(encode(values)), marks, BASE)
            if tree is None:
                return None
            model = cls(tree, [dt.itemsize for dt in dtypes])
            for n in PROBES:
                values, marks = sample(n)
                if model.build(n, marks) != bytes(encode(values)):
                    return None
        except (CrossfeedError, ValueError, TypeError, OverflowError):  # a schema the probes cannot encode
            return None
        return model

    def ops(self, ns: np.ndarray) -> tuple[list, np.ndarray]:
        """The records of ``ns`` values each: their ops (adjacent constants joined) and byte lengths."""
        ops, total = _emit(self.tree, ns, self.sizes)
        joined: list = []
        for op in ops:
            if op[0] == "c" and joined and joined[-1][0] == "c":
                joined[-1] = ("c", joined[-1][1] + op[1])
            elif op[0] != "c" or op[1]:
                joined.append(op)
        return joined, total

    def build(self, n: int, marks: list[bytes]) -> bytes:
        """One record's bytes (``marks``: each feature's value bytes), from the model alone."""
        ops, _ = self.ops(np.array([n], dtype=np.int64))
        out = []
        for kind, arg in ops:
            out.append(arg if kind == "c" else _varint(int(arg[0])) if kind == "v" else marks[arg])
        return b"".join(out)


def _parse(buf: bytes, marks: list[bytes], n: int) -> list | None:
    """``buf`` as protobuf fields: ``("c", bytes)`` runs of constant fields and ``("f", tag
    bytes, leaf)`` length-delimited ones, a leaf being ``("msg", fields)``, ``("val", i)``,
    ``("n",)`` (the varint of ``n``) or ``("c", bytes)``; None: not a message."""
    items: list = []
    pos, end = 0, len(buf)
    try:
        while pos < end:
            tag, p = ex.read_varint(buf, pos, end)
            field, wire = tag >> 3, tag & 7
            if field == 0:
                return None
            if wire == 2:
                size, q = ex.read_varint(buf, p, end)
                if q + size > end:
                    return None
                items.append(("f", buf[pos:p], _leaf(buf[q : q + size], marks, n)))
                pos = q + size
                continue
            if wire == 0:
                _, q = ex.read_varint(buf, p, end)
            elif wire in (1, 5):
                q = p + (8 if wire == 1 else 4)
                if q > end:
                    return None
            else:
                return None
            items.append(("c", buf[pos:q]))
            pos = q
    except CrossfeedError:
        return None
    return items


def _leaf(content: bytes, marks: list[bytes], n: int) -> tuple:
    if content in marks:
        return ("val", marks.index(content))
    if content == _varint(n):
        return ("n",)
    sub = _parse(content, marks, n) if content else None
    return ("msg", sub) if sub is not None else ("c", content)


def _emit(items: list, ns: np.ndarray, sizes: list[int]) -> tuple[list, np.ndarray]:
    ops: list = []
    total = np.zeros(len(ns), dtype=np.int64)
    for item in items:
        if item[0] == "c":
            ops.append(item)
            total += len(item[1])
            continue
        _, tag, leaf = item
        if leaf[0] == "msg":
            inner, size = _emit(leaf[1], ns, sizes)
        elif leaf[0] == "val":
            inner, size = [leaf], ns * sizes[leaf[1]]
        elif leaf[0] == "n":
            inner, size = [("v", ns)], varint_widths(ns)
        else:
            inner, size = [leaf], np.full(len(ns), len(leaf[1]), dtype=np.int64)
        ops += [("c", tag), ("v", size), *inner]
        total += len(tag) + varint_widths(size) + size
    return ops, total


class TokenShards:
    """The checked shards of one split of token records (see the module docstring): ``at(ids)``
    gives each record's value offsets in the span of the checked shards, its records' payload CRCs
    checked, or None where the general way must read them."""

    def __init__(self, frames, model: RecordModel, lengths, source: int, features: int):
        self.frames, self.model, self.lengths, self.source = frames, model, lengths, source
        self.split = frames.split
        self.k = features
        self.starts = np.asarray(self.split.starts, dtype=np.int64)
        shards = len(self.starts) - 1
        # shard → (records, k + 3): value offsets, payload start (in its own bytes), payload size and
        # stored masked CRC of each record; False: the general way
        self._at = [None] * shards
        self._arrays: dict[int, np.ndarray] = {}
        empty = Span({}, shards)
        self.current = (empty, memoryview(empty.u8))  # the span of the checked shards and its view: replaced whole
        # a split of at most ALL_INDEX_MAX records: one table of every record's value offsets in its
        # shard (-1: the shard not checked yet), so a batch's offsets are one gather
        self._table = (
            np.full((len(self.split), features + 3), -1, dtype=np.int64) if len(self.split) <= ALL_INDEX_MAX else None
        )
        self._lock = threading.Lock()

    @classmethod
    def of(cls, reader, lengths, names: list[str]) -> TokenShards | None:
        """For a Loader's one-source reader of TFRecord shards whose schema `RecordModel` fits."""
        frames = getattr(reader, "frames", None)
        split = getattr(frames, "split", None)
        if getattr(reader, "mixture", True) or split is None or split.info.format != "tfrecord":
            return None
        if not hasattr(frames, "_buffer"):
            return None
        model = RecordModel.of(split.dataset.schema, list(names))
        return None if model is None else cls(frames, model, lengths, 0, len(names))

    def at(self, ids: np.ndarray) -> tuple[np.ndarray, memoryview] | None:
        """``(len(ids), k)`` offsets of each record's values per feature in the returned view of
        the checked shards' bytes, every record's payload CRC checked; None: the general way (a
        shard not checked whole, or a record whose CRC does not match)."""
        shard = np.searchsorted(self.starts, ids, side="right") - 1
        rows = None
        if self._table is not None:
            span, view = self.current
            rel = self._table[ids]
            if len(rel) and int(rel.min()) >= 0 and (span.base[shard] >= 0).all():
                rows = rel
        if rows is None:
            present = np.unique(shard).tolist()
            for s in present:
                if self._at[s] is None:
                    self._check(s)
                if self._at[s] is False:
                    return None
            span, view = self.current
            if self._table is not None:
                rows = self._table[ids]
            else:
                rows = np.empty((len(ids), self.k + 3), dtype=np.int64)
                for s in present:
                    m = shard == s
                    rows[m] = self._at[s][ids[m] - self.starts[s]]
        base = span.base[shard]
        k = self.k
        once = np.empty(len(ids), dtype=bool)  # each record's payload CRC, once (a record's pieces are adjacent)
        once[:1] = True
        np.not_equal(ids[1:], ids[:-1], out=once[1:])
        checked = rows[once]
        lo = checked[:, k] + base[once]
        payloads = map(view.__getitem__, map(slice, lo.tolist(), (lo + checked[:, k + 1]).tolist()))
        crcs = np.fromiter(map(_crc32c.crc32c, payloads), dtype=np.uint32, count=len(checked))
        if (mask(crcs) != checked[:, k + 2]).any():
            return None
        return rows[:, :k] + base[:, None], view

    def _check(self, s: int) -> None:
        with self._lock:
            if self._at[s] is not None:
                return
            got = self._checked(s)
            self._at[s] = False if got is None else got
            if got is not None:
                span = Span(self._arrays, len(self._at))
                self.current = (span, memoryview(span.u8))
                if self._table is not None:
                    self._table[self.starts[s] : self.starts[s + 1]] = got

    def _checked(self, s: int) -> np.ndarray | None:
        """Shard ``s``'s record table (see ``_at``), its layout checked; None: it goes the general way."""
        try:
            buf = self.frames._buffer(s)
        except CrossfeedError:
            return None
        if buf is None:
            return None
        index = self.split.index(s)
        u8 = np.frombuffer(buf, dtype=np.uint8)
        if not len(index):
            self._arrays[s] = u8
            return np.zeros((0, self.k + 3), dtype=np.int64)
        offs, lens = index[:, 0].astype(np.int64), index[:, 1].astype(np.int64)
        if out_of_bounds(offs, lens, len(u8)).any() or bad_headers(gather(u8, offs, HEADER), lens).any():
            return None
        ns = np.asarray(self.lengths.shard(self.source, s), dtype=np.int64)
        if len(ns) != len(offs):
            return None
        start, size = offs + HEADER, lens - FRAMING
        ops, total = self.model.ops(ns)
        if (total != size).any():
            return None
        last = len(u8) - 1
        pos = start.copy()
        at = np.zeros((len(ns), self.k + 3), dtype=np.int64)
        at[:, self.k], at[:, self.k + 1], at[:, self.k + 2] = start, size, stored_crcs(u8, offs, lens)
        for kind, arg in ops:
            if kind == "c":
                want = np.frombuffer(arg, dtype=np.uint8)
                if (gather(u8, np.minimum(pos, last - len(want) + 1), len(want)) != want).any():
                    return None
                pos += len(want)
            elif kind == "v":
                widths = varint_widths(arg)
                top = int(widths.max())
                shift = 7 * np.arange(top)
                want = ((arg[:, None] >> shift) & 0x7F) | np.where(np.arange(top) < widths[:, None] - 1, 0x80, 0)
                got = u8[np.minimum(pos[:, None] + np.arange(top), last)]
                if ((got != want) & (np.arange(top) < widths[:, None])).any():
                    return None
                pos += widths
            else:
                at[:, arg] = pos
                pos += ns * self.model.sizes[arg]
        self._arrays[s] = u8
        return at
