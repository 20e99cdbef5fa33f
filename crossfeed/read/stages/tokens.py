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

`TokenShards` checks the records a block of 1,024 at a time, on the first batch of this process
that touches the block (its pages mapped in one call first), all of them at once: every framed
record's header and payload CRC (the frame stage's checks, for the block's records together
rather than the batch's: once per process), and every record's bytes outside its value slots
equal to those of the length its lengths file gives — so a record holds exactly the planned
number of values (a lengths file that does not belong to the records is found here). A checked
block's records enter one table of the split (their value offsets; splits of at most
``ALL_INDEX_MAX`` records); a batch then cuts its pieces straight out of the mapped shards (one
``bytes.join`` over C slices per feature, no per-document Python bytecode). A block whose check
fails (a corrupt record, another writer's layout, lengths that lie) is never sliced: its
records go the Loader's general way (read and decode per batch), which names the record or
skips it under ``on_error``. Remote shards read by range, mixtures and larger splits take that
way too. The shards are memory-mapped read-only and never rewritten in place (a rewrite is a
new generation of files), so bytes checked once stay checked.
"""

from __future__ import annotations

import mmap
import threading

import crc32c as _crc32c
import numpy as np

from crossfeed.errors import CrossfeedError
from crossfeed.format import example as ex
from crossfeed.format.frames import (
    FRAMING,
    bad_headers,
    bad_payloads,
    gather,
    out_of_bounds,
    payload_views,
    stored_crcs,
)
from crossfeed.format.tfrecord import HEADER
from crossfeed.read.stages.frames import ALL_INDEX_MAX, Span

# probes: every side of the varint steps of a length prefix (2^7, 2^14, 2^21 bytes) for any value width
PROBES: tuple[int, ...] = (0, 1, 2, 3, 5, 31, 32, 33, 63, 64, 127, 128, 129, 1001, 2047, 2048, 2049, 4095, 4096)
PROBES += (4097, 16383, 16384, 16385, 65535, 65536, 65537)
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
    """The bytes of a record of ``n`` values per packed feature, for the schemas it fits (`of`):
    ``ops(ns)`` is the record — or, where the schema has other features (a document's id), the
    packed features' map entries at its end — as a sequence of ``("c", bytes)`` constants,
    ``("v", values)`` varints (one value per record) and ``("val", feature)`` value slots.
    ``prefix``: None, or the key headers of the other features' map entries, which come first
    (keys are written sorted) and whose contents are skipped by their length prefixes."""

    def __init__(self, tree: list, sizes: list[int], prefix: list[bytes] | None = None):
        self.tree, self.sizes, self.prefix = tree, sizes, prefix

    @classmethod
    def of(cls, schema, names: list[str]) -> RecordModel | None:
        """The model of records of ``schema`` whose packed features ``names`` are raw tensors
        (any other features' map entries must sort before theirs), checked against the encoder
        at every probe; None where it does not fit."""
        from crossfeed.format.encode import encoder_for

        if not set(names) <= set(schema.names):
            return None
        dtypes = [np.dtype(schema[n].dtype) for n in names]
        others = {f.name: _probe_value(f) for f in schema if f.name not in names}
        encode = encoder_for(schema).encode

        def sample(n: int) -> tuple[dict, list[bytes]]:
            marks = [bytes([0x41 + i]) * (n * dt.itemsize) for i, dt in enumerate(dtypes)]
            return {**others, **{name: np.frombuffer(m, dt) for name, dt, m in zip(names, dtypes, marks)}}, marks

        try:
            values, marks = sample(BASE)
            whole = bytes(encode(values))
            prefix = None
            if others:
                got = _split_entries(whole, names)
                if got is None:
                    return None
                prefix, at = got
                whole = whole[at:]
            tree = _parse(whole, marks, BASE)
            if tree is None:
                return None
            model = cls(tree, [dt.itemsize for dt in dtypes], prefix)
            for n in PROBES:
                values, marks = sample(n)
                record = bytes(encode(values))
                if prefix is not None:
                    got = _split_entries(record, names)
                    if got is None or got[0] != prefix:
                        return None
                    record = record[got[1] :]
                if model.build(n, marks) != record:
                    return None
        except (CrossfeedError, ValueError, TypeError, OverflowError, KeyError):  # a schema the probes cannot encode
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


def _probe_value(f):
    """A value of feature ``f`` to encode probes with (the model skips it: any value does)."""
    if f.codec.dense:
        return np.zeros(tuple(1 if d is None else d for d in f.shape), np.dtype(f.dtype))
    return "x" if f.dtype == "string" else b"x"


def _split_entries(record: bytes, names: list[str]) -> tuple[list[bytes], int] | None:
    """``(key headers of the leading map entries that are not ``names``', where the first of
    theirs starts)``: the record is one Features message whose entries of other features all come
    first; None otherwise."""
    try:
        if record[:1] != b"\n":
            return None
        size, pos = ex.read_varint(record, 1, len(record))
        if pos + size != len(record):
            return None
        prefix, theirs = [], None
        while pos < len(record):
            if record[pos] != 0x0A:
                return None
            size, q = ex.read_varint(record, pos + 1, len(record))
            if record[q] != 0x0A:
                return None
            klen, k = ex.read_varint(record, q + 1, len(record))
            key = record[k : k + klen].decode()
            mine = any(key == n or key.startswith(n + "/") for n in names)
            if mine and theirs is None:
                theirs = pos
            elif not mine:
                if theirs is not None:  # another feature's entry after ours: no fixed tail
                    return None
                prefix.append(record[q : k + klen])
            pos = q + size
    except (CrossfeedError, IndexError, UnicodeDecodeError):
        return None
    return (prefix, theirs) if theirs is not None else None


MADV_POPULATE_READ = 22  # Linux 5.14+: map a range's pages in one call (Python's mmap does not name it)


def _populate(buf, lo: int, hi: int) -> None:
    """Map the pages of bytes ``lo:hi`` of a memory-mapped shard into this process at once: the
    block's records are about to be read, and one call costs far less than a page fault per page.
    A no-op where the kernel or the buffer cannot (not an mmap, an older kernel)."""
    madvise = getattr(buf, "madvise", None)
    if madvise is None or hi <= lo:
        return
    page = mmap.PAGESIZE
    start = lo - lo % page
    try:
        madvise(MADV_POPULATE_READ, start, hi - start)
    except (OSError, ValueError):
        pass


def read_varints(u8: np.ndarray, pos: np.ndarray, last: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The varints at ``pos`` of ``u8`` (at most 5 bytes each): values, widths and whether each is whole."""
    b = u8[np.minimum(pos[:, None] + np.arange(5), last)].astype(np.int64)
    ends = b < 0x80
    width = np.argmax(ends, axis=1) + 1
    within = np.arange(5) < width[:, None]
    values = (((b & 0x7F) << (7 * np.arange(5))) * within).sum(axis=1)
    return values, width, np.asarray(ends.any(axis=1))


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

    BLOCK = 1024  # records checked at once: a batch's first touch costs blocks, not whole shards
    # shards up to this size are checked whole (`_whole`: one CRC32C call, ~6 ms here); a larger
    # one block by block, so a first batch does not read gigabytes of shards it barely touches
    WHOLE_MAX = 64 << 20

    def __init__(self, frames, model: RecordModel, lengths, source: int, features: int):
        self.frames, self.model, self.lengths, self.source = frames, model, lengths, source
        self.split = frames.split
        self.k = features
        self.starts = np.asarray(self.split.starts, dtype=np.int64)
        shards = len(self.starts) - 1
        # every record's value addresses in this process (its shard's mapped bytes' address plus
        # its offsets in them), once its block is checked (-1 before; -2: the general way): a batch's
        # offsets in the span are one gather and one subtraction
        self._table = np.full((len(self.split), features), -1, dtype=np.int64)
        self._arrays: dict[int, np.ndarray] = {}  # the mapped shards
        empty = Span({}, shards)
        # the span of the mapped shards, its view and the address of its first byte: replaced whole
        self.current = (empty, memoryview(empty.u8), 0)  # type: ignore[arg-type]  # numpy arrays are buffers
        self._lock = threading.Lock()
        self._tried: set[int] = set()  # shards whose whole-shard check ran (`_whole`)
        self._unchecked = len(self.split)  # records not yet in the table: when none, `at` looks no further

    @classmethod
    def of(cls, reader, lengths, names: list[str]) -> TokenShards | None:
        """For a Loader's one-source reader of TFRecord shards whose schema `RecordModel` fits, of at
        most ``ALL_INDEX_MAX`` records (one table of every record's offsets: 8 bytes a record and feature)."""
        frames = getattr(reader, "frames", None)
        split = getattr(frames, "split", None)
        if getattr(reader, "mixture", True) or split is None or split.info.format != "tfrecord":
            return None
        if not hasattr(frames, "shard_buffer") or len(split) > ALL_INDEX_MAX:
            return None
        model = RecordModel.of(split.dataset.schema, list(names))
        return None if model is None else cls(frames, model, lengths, 0, len(names))

    def at(self, ids: np.ndarray) -> tuple[np.ndarray, memoryview] | None:
        """``(len(ids), k)`` offsets of each record's values per feature in the returned view of
        the mapped shards' bytes, every record's block checked; None: the general way (a block
        that failed its check)."""
        unchecked = self._unchecked  # read first: 0 here means every row below was in place
        rows = self._table[ids]
        if not len(rows):
            return None
        # every column looked at: a block being installed on another thread (numpy copies without
        # the GIL) may show a row whose first column is in place and whose next is not yet
        if unchecked and int(rows.min()) < 0:
            todo = ids[(rows == -1).any(axis=1)]
            for s, blk in {(int(s), int(b)) for s, b in zip(*self._blocks(todo))}:
                self._check(s, blk)  # under the lock: a block being installed is whole when it returns
            rows = self._table[ids]
            if int(rows.min()) < 0:
                return None
        _, view, origin = self.current
        return rows - origin, view

    def _blocks(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        shard = np.searchsorted(self.starts, ids, side="right") - 1
        return shard, (ids - self.starts[shard]) // self.BLOCK

    def _check(self, s: int, blk: int) -> None:
        lo = int(self.starts[s]) + blk * self.BLOCK
        hi = min(int(self.starts[s + 1]), lo + self.BLOCK)
        with self._lock:
            if self._table[lo, 0] != -1:
                return
            if s not in self._tried:  # first touch of the shard: the whole of it at once, if its CRC32C is known
                self._tried.add(s)
                got = self._whole(s)
                if got is not None:
                    self._install(s, got[1], int(self.starts[s]), int(self.starts[s + 1]), got[0])
                    return
            rows = np.arange(lo - int(self.starts[s]), hi - int(self.starts[s]), dtype=np.int64)
            got = self._checked(s, rows)
            if got is None:
                self._table[lo:hi, 0] = -2
                return
            self._install(s, got[1], lo, hi, got[0])

    def _install(self, s: int, u8: np.ndarray, lo: int, hi: int, rows: np.ndarray) -> None:
        if s not in self._arrays or self.current[0].base[s] < 0:
            self._arrays[s] = u8
            span = Span(self._arrays, len(self.starts) - 1)
            origin = span.u8.ctypes.data if len(span.u8) else 0
            self.current = (span, memoryview(span.u8), origin)  # type: ignore[arg-type]  # a buffer
        self._table[lo:hi] = rows + self._arrays[s].ctypes.data
        self._unchecked -= hi - lo

    def _whole(self, s: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Every record of shard ``s`` by the whole-shard check (the module docstring), or None:
        the shard goes block by block."""
        info = self.split.shards[s]
        if getattr(info, "crc32c", None) is None or info.compressed or info.num_bytes > self.WHOLE_MAX:
            return None
        try:
            buf = self.frames.shard_buffer(s)
        except CrossfeedError:
            return None
        if buf is None or len(memoryview(buf)) != info.num_bytes:
            return None
        _populate(buf, 0, info.num_bytes)
        if _crc32c.crc32c(buf) != info.crc32c:
            return None  # damaged (or not the bytes the manifest names): block by block, which names the record
        n = int(self.starts[s + 1] - self.starts[s])
        ns = np.asarray(self.lengths.shard(self.source, s), dtype=np.int64)
        if len(ns) != n:
            return None
        planned = self.model.ops(ns)
        ops = planned[0]
        # one record of each layout the shard holds (the varint widths of its length prefixes), its
        # first and its last, checked byte for byte: the writer's encoder is the model's
        key = np.zeros(n, dtype=np.int64)
        for kind, arg in ops:
            if kind == "v":
                key = key * 8 + varint_widths(arg)
        reps = np.unique(np.concatenate([np.unique(key, return_index=True)[1], [0, n - 1]]))
        if n and self._checked(s, reps.astype(np.int64)) is None:
            return None
        return self._checked(s, np.arange(n, dtype=np.int64), verify=False, planned=(ns, planned))

    def _checked(
        self, s: int, rows: np.ndarray, verify: bool = True, planned: tuple | None = None
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Records ``rows`` of shard ``s``: their table rows (see ``_table``), their framing and
        layout checked (``verify``; else their places only, the shard's bytes checked whole by
        `_whole`), and the shard's bytes; None: they go the general way. ``planned``: the rows'
        lengths and their `RecordModel.ops`, where the caller has them already."""
        try:
            buf = self.frames.shard_buffer(s)
        except CrossfeedError:
            return None
        if buf is None:
            return None
        index = self.split.index(s)[rows]
        u8 = np.frombuffer(buf, dtype=np.uint8)
        offs, lens = index[:, 0].astype(np.int64), index[:, 1].astype(np.int64)
        if not len(u8) or out_of_bounds(offs, lens, len(u8)).any():
            return None
        if verify:
            _populate(buf, int(offs.min()), int((offs + lens).max()))
            if bad_headers(gather(u8, offs, HEADER), lens).any():
                return None
            if bad_payloads(payload_views(buf, offs, lens), stored_crcs(u8, offs, lens)).any():
                return None
        if planned is None:
            ns = np.asarray(self.lengths.shard(self.source, s), dtype=np.int64)[rows]
            planned = (ns, self.model.ops(ns))
        ns, (ops, total) = planned
        if len(ns) != len(offs):
            return None
        start, size = offs + HEADER, lens - FRAMING
        last = len(u8) - 1
        if self.model.prefix is None:
            if (total != size).any():
                return None
            pos = start.copy()
        else:  # other features' entries first: each skipped by its length, its key checked
            outer, width, whole = read_varints(u8, start + 1, last)
            if (u8[np.minimum(start, last)] != 0x0A).any() or not whole.all() or (1 + width + outer != size).any():
                return None
            pos = start + 1 + width
            for key in self.model.prefix:
                want = np.frombuffer(key, dtype=np.uint8)
                entry, width, whole = read_varints(u8, pos + 1, last)
                head = gather(u8, np.minimum(pos + 1 + width, last - len(want) + 1), len(want))
                if (u8[np.minimum(pos, last)] != 0x0A).any() or not whole.all() or (entry < len(want)).any():
                    return None
                if (head != want).any():
                    return None
                pos = pos + 1 + width + entry
            if (pos + total != start + size).any():  # the packed features' entries fill the rest exactly
                return None
        at = np.zeros((len(ns), self.k), dtype=np.int64)
        for kind, arg in ops:
            if kind == "c":
                want = np.frombuffer(arg, dtype=np.uint8)
                if verify and (gather(u8, np.minimum(pos, last - len(want) + 1), len(want)) != want).any():
                    return None
                pos += len(want)
            elif kind == "v" and not verify:
                pos += varint_widths(arg)
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
        return at, u8
