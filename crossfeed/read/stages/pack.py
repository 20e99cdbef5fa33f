"""Sequence packing and length-aware batching: the plan of a token dataset, on integers.

A token dataset's records are documents: a variable-length integer feature (``tokens``) per
record, whose lengths lie beside each shard in lengths files (`crossfeed.format.lengths`). Two
ways to batch them, both pure functions of (seed, epoch, position, world size, worker) and of the
lengths — never of record contents — so resumption and elastic resumption stay exact:

``Pack(length=L)`` — the epoch's documents, in the plan's order (`crossfeed.read.stages.sampler`:
the same order, mixtures included, an unpacked Loader delivers), are packed into one global
sequence of rows of ``L`` tokens (`packed_rows`):

* ``split="documents"`` (the default): best-fit into at most ``bins`` open rows — a document
  goes into the open row with the least room that still holds it; when none does and ``bins``
  rows are open, the oldest open row is closed (emitted) and a new one opened; a row that fills
  up is emitted at once, the open ones at the end of the epoch. A document is cut only when it is
  longer than ``L`` (into ``L``-token rows of its own, and a last piece packed like a document).
  Padding is the room closed rows leave: about 1–2% at ``L=2048`` on log-normal lengths of mean
  600 with the default 32 bins (docs/sequences.md).
* ``split="rows"``: concatenate and chunk (Megatron's GPT datasets): no padding but the epoch's
  last row, documents cut wherever a row ends.

Rows are dealt like samples: after ``position`` rows of the epoch were consumed, rank ``r`` of
``W`` takes global rows ``position + r, + r + W, …``, ``B`` per batch; the epoch's last global
batch is completed with empty rows (all padding, segment 0), so every rank has the same number of
``(B, L)`` batches and every token of the epoch is delivered exactly once (``drop_last=True``
drops that last incomplete global batch instead). A state is ``(epoch, rows consumed)`` and the
packer's cursor there (see Cost); rows consumed count every rank together, so resuming at another world size or worker count deals the
rest of the same row sequence: every remaining token exactly once.

``batch_by_tokens=T`` — no packing: documents in plan order form global batches of whole
groups of ``W`` consecutive documents, as many groups as keep ``groups × W × longest ≤ T × W``
(at least one group), and rank ``r`` takes the ``r``-th document of each group (`token_batches`):
every rank's batch is ``(groups, longest)`` — at most ``T`` tokens, padding counted — and all
ranks take the same number of steps because the batches are global. The epoch's last group may
have fewer than ``W`` documents: the ranks without one get an empty row. A state is ``(epoch,
documents consumed)``, and a batch boundary is a fresh start of the greedy rule, so resuming
there continues identically, and at another world size covers the rest exactly once.

Cost: memory is O(batch + bins), never O(documents): lengths are gathered ``SCAN`` documents at a
time from memory-mapped lengths files. Packing is sequential: rows are found by walking the
epoch's lengths in plan order — integers only, no record is read — a chunk of documents at a time
(`walk`: ``split="rows"`` in numpy; best-fit one ``bisect`` step per document, its pieces laid
out per chunk in numpy, `_BestFitChunks`), and a batch's rows are
picked out of each chunk with one mask. Every chunk ends at a `PackCursor` — the rows emitted,
the documents consumed, and the packer's open rows (at most ``bins``; ``split="rows"``: where
the open row starts) — from which a walk continues exactly as the uninterrupted one would. A
process remembers the cursors it met (`_Marks`: bounded, the recent ones dense), and a
`crossfeed.Loader` state carries the one at (or a chunk before) its position, checked strictly
when loaded (`PackCursor.from_json`). So a walk to row ``p`` — a resume, an elastic resume at
another world size, a dispatcher's batch leased again, "which documents are in row ``p``"
(`PackSampler.rows`), a replayed step (`PackSampler.rank_batch`, `crossfeed.read.replay`) — starts at the nearest cursor before ``p``: O(bins + batch + ``SCAN``)
documents, not a walk from the epoch's start. Without one (a version-2 state, ``start=``)
it walks from the epoch's start. A token-weighted mixture's order (`TokenMixtureOrder`) is
planned in numpy too, a chunk at a time, and its cursors carry each source's draws. The epoch's number of rows (`PackSampler.epoch_total`, what
``len(loader)`` needs) is exact without a walk for ``split="rows"`` of one dataset (the lengths
files' sum, cut in rows); otherwise one walk from the furthest cursor known to the epoch's end,
kept. A batch is built by `PackBuilder` with a few numpy calls, its pieces
sliced from the shards where `crossfeed.read.stages.tokens` checked them. A split
without lengths files has its lengths learned by decoding each shard once, kept in memory (4
bytes per record): write lengths files to avoid both.

Skipped documents (``skip=Skip(samples=…)``): `DocLengths` gives a skipped document length 0
wherever the plan reads lengths (a chunk's, a mixture's draws, a cursor's check), so every walk —
from the start, from a cursor, on any rank or worker — treats it as absent: it fills no row, is
never read, and the documents after it are packed on (O(chunk · log skipped) a chunk).
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import logging
import math
import mmap
import operator
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from crossfeed.errors import ConfigError, DatasetNotFoundError, IndexFileError, redact
from crossfeed.format.lengths import DTYPE, check_bound, checked_lengths, lengths_path, record_bound
from crossfeed.format.schema import Feature
from crossfeed.read.options import LoaderOptions, Pack, PackLong, PackSplit, WeightsBy
from crossfeed.read.stages.batch import call_batch_transform, timed_apart
from crossfeed.read.stages.recipes import epoch_of, step_of
from crossfeed.read.stages.tokens import TokenShards

log = logging.getLogger(__name__)

SCAN = 1 << 13  # documents whose lengths are gathered at once
FIRST_SCAN = 1 << 7  # … at first (then twice as many each time, up to SCAN)
SEGMENT_IDS, POSITIONS = "segment_ids", "positions"
HEADER, PIECE = 2, 5  # a batch: (rows, width), then pieces of (row, document, start, count, document length)


# ---- lengths ------------------------------------------------------------------------------------


SPARSE = 32  # entries of one lengths file looked up at once, at most, read by pread rather than the mapping
EMPTY_CHECKS = 1024  # empty documents read per shard to confirm their lengths entries (`DocLengths`)


class DocLengths:
    """``lengths(ids)``: the length (values of ``feature``) of documents by global id — a mixture's
    sources numbered one after the other, as `MixtureOrder` numbers them.

    From each shard's lengths file (memory-mapped, checked against the manifest's
    ``lengths_sha256`` the first time the shard is touched); a split whose manifest does not list
    ``feature`` has its shards decoded once each instead (logged; 4 bytes per record kept)."""

    def __init__(self, splits, names: list[str], skipped: np.ndarray | None = None):
        """``splits``: one `Split` per source; ``names``: the feature's name in each; ``skipped``:
        the sorted global ids of skipped documents (``skip=`` sample ids), whose length the plan
        takes as 0 — never read, no tokens, the documents after them packed on (`__call__`)."""
        self.splits, self.names = list(splits), list(names)
        self.starts = np.concatenate([[0], np.cumsum([len(sp) for sp in self.splits])]).astype(np.int64)
        self.skipped = np.zeros(0, np.int64) if skipped is None else np.asarray(skipped, dtype=np.int64)
        self._skipped_lengths: np.ndarray | None = None  # their stored lengths, for `total`
        self._cols: list[int | None] = []
        for sp, name in zip(self.splits, self.names):
            listed = tuple(getattr(sp.dataset.manifest, "lengths", ()) or ())
            self._cols.append(listed.index(name) if name in listed else None)
            if name not in listed:
                log.warning(
                    "%s split %r has no lengths files for %r: each shard is decoded once to learn its documents' "
                    "lengths (the whole shard is read; 4 bytes per record kept in memory). Write lengths files "
                    "(crossfeed convert text does) to plan from integers alone.",
                    redact(sp.dataset.path),
                    sp.name,
                    name,
                )
        self._shards: dict[tuple[int, int], np.ndarray] = {}
        self._files: dict[tuple[int, int], tuple[str, int, int]] = {}  # local lengths files: (path, width, column)
        self._maps: list = []
        self._lock = threading.Lock()

    def __call__(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        out = self.stored(ids)
        if len(self.skipped):  # a skipped document is absent: length 0 (O(ids · log skipped))
            out[self.is_skipped(ids)] = 0
        return out

    def stored(self, ids: np.ndarray) -> np.ndarray:
        """The lengths files' lengths of documents ``ids`` (skipped ones too)."""
        out = np.empty(len(ids), dtype=np.int64)
        src = np.searchsorted(self.starts, ids, side="right") - 1
        for s in np.unique(src).tolist():
            at = np.flatnonzero(src == s)
            local = ids[at] - self.starts[s]
            sp = self.splits[s]
            shard = np.searchsorted(sp.starts, local, side="right") - 1
            for k in np.unique(shard).tolist():
                m = shard == k
                lens = self.shard(s, k)
                j = local[m] - sp.starts[k]
                file = self._files.get((s, k)) if len(j) <= SPARSE else None
                out[at[m]] = lens[j] if file is None else self._read(file, j)
        return out

    def is_skipped(self, ids: np.ndarray) -> np.ndarray:
        """Which of global ids ``ids`` are skipped (a bool mask)."""
        sk = self.skipped
        if not len(sk):
            return np.zeros(len(ids), dtype=bool)
        at = np.minimum(np.searchsorted(sk, ids), len(sk) - 1)
        return sk[at] == ids

    @staticmethod
    def _read(file: tuple[str, int, int], entries: np.ndarray) -> np.ndarray:
        """A few entries of a checked local lengths file, read by ``pread``: a lookup through the
        mapping would map the whole folio around each entry into this process (hundreds of KB a
        file on kernels with large page-cache folios), a few scattered lookups into every file
        of a shuffled epoch's first chunks."""
        path, width, col = file
        fd = os.open(path, os.O_RDONLY)
        try:
            got = [os.pread(fd, DTYPE.itemsize, (int(j) * width + col) * DTYPE.itemsize) for j in entries.tolist()]
        finally:
            os.close(fd)
        data = b"".join(got)
        if len(data) != DTYPE.itemsize * len(entries):
            raise IndexFileError(f"{path}: the lengths file was cut short after it was checked; it is being rewritten?")
        return np.frombuffer(data, dtype=DTYPE).astype(np.int64)

    def total(self, limit: int | None = None) -> int:
        """Every document's length summed (``limit``: of those at most ``limit``), shard by shard
        in numpy: every lengths file read once (4 bytes a document), no plan walked."""
        got = 0
        for s, sp in enumerate(self.splits):
            for k in range(len(sp.shards)):
                lens = self.shard(s, k)
                got += int(lens.sum(dtype=np.int64) if limit is None else lens[lens <= limit].sum(dtype=np.int64))
        if len(self.skipped):  # skipped documents hold no tokens of the plan
            sk = self._skipped_lengths
            if sk is None:  # their stored lengths, looked up once
                sk = self._skipped_lengths = np.concatenate(
                    [self.stored(self.skipped[i : i + SCAN]) for i in range(0, len(self.skipped), SCAN)]
                )
            got -= int(sk.sum(dtype=np.int64) if limit is None else sk[sk <= limit].sum(dtype=np.int64))
        return got

    def where(self, doc: int) -> str:
        """Where the plan's length of document ``doc`` came from."""
        s = int(np.searchsorted(self.starts, doc, side="right") - 1)
        sp = self.splits[s]
        k, _ = sp.locate(int(doc - self.starts[s]))
        if self._cols[s] is None:
            return f"its length learned by decoding {sp.file(k).path}"
        return f"the lengths file {sp.dataset.index_storage.url(lengths_path(sp.shards[k].file))}"

    def shard(self, s: int, k: int) -> np.ndarray:
        """The lengths of source ``s``'s shard ``k``, loaded (and checked) once."""
        got = self._shards.get((s, k))
        if got is None:
            with self._lock:
                got = self._shards.get((s, k))
                if got is None:
                    got = self._shards[(s, k)] = self._load(s, k)
        return got

    def _load(self, s: int, k: int) -> np.ndarray:
        sp, col = self.splits[s], self._cols[s]
        info = sp.shards[k]
        if col is None:
            name = self.names[s]
            return np.fromiter(
                (np.size(sp.decode(k, j, features=[name], decode_images=False)[name]) for j in range(info.num_records)),
                dtype=DTYPE,
                count=info.num_records,
            )
        ds = sp.dataset
        storage, rel = ds.index_storage, lengths_path(info.file)
        digest = None
        where, width = storage.url(rel), len(ds.manifest.lengths)
        fix = "write the dataset's lengths files again (convert it again), or read it without pack=/batch_by_tokens="
        try:
            if storage.remote:
                data = storage.read(rel, limit=info.num_records * width * DTYPE.itemsize + 1)
            else:
                with open(where, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    if size and getattr(
                        info, "lengths_sha256", None
                    ):  # hashed as read: only the pages used stay mapped
                        digest = _sha256(f)
                    data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
                if size:
                    self._maps.append(data)
        except (FileNotFoundError, DatasetNotFoundError) as e:
            raise IndexFileError(f"{where}: lengths file is missing; {fix}") from e
        except OSError as e:
            raise IndexFileError(f"{where}: cannot read the lengths file ({e.strerror or e}); {fix}") from e
        lengths = checked_lengths(data, where, info, width, digest)[:, col]
        name = self.names[s]
        feature = next((f for f in ds.schema if f.name == name), None)
        if feature is not None:  # bounded by what a record can hold, before a plan sizes rows by it
            check_bound(lengths, record_bound(info, feature, sp.info.format), where, name)
        self._check_empty(s, k, lengths, where, fix)
        if isinstance(data, mmap.mmap):  # checked: its pages leave this process (a walk maps back the few it reads)
            try:
                data.madvise(mmap.MADV_DONTNEED)
            except (OSError, ValueError, AttributeError):
                pass
            self._files[(s, k)] = (where, width, col)
        return lengths

    def _check_empty(self, s: int, k: int, lengths: np.ndarray, where: str, fix: str) -> None:
        """A document its lengths file says is empty is never read by the plan (it fills no row),
        so a lie there would drop its tokens unseen: read those records now and refuse a lie.
        Empty documents are rare; at most `EMPTY_CHECKS` per shard (a sample, remote)."""
        sp, name = self.splits[s], self.names[s]
        zeros = np.flatnonzero(lengths == 0)
        if len(self.skipped) and len(zeros):  # a skipped document is never read, empty or not
            zeros = zeros[~self.is_skipped(zeros + int(self.starts[s] + sp.starts[k]))]
        most = EMPTY_CHECKS if not sp.dataset.storage.remote else EMPTY_CHECKS // 64
        if len(zeros) > most:
            zeros = zeros[np.linspace(0, len(zeros) - 1, most).astype(np.int64)]
        for j in zeros.tolist():
            have = int(np.size(sp.decode(k, j, features=[name], decode_images=False)[name]))
            if have:
                raise IndexFileError(
                    f"{where}: entry {j} says record {j} of {sp.shards[k].file} holds no {name!r} values; it "
                    f"holds {have} (packing would have dropped them); {fix}"
                )


# ---- where the packer stands: cursors ------------------------------------------------------------


CURSOR_PIECES_MAX = 1 << 16  # pieces a carried cursor may hold, all rows together (a state crosses a trust boundary)


class PackCursor:
    """Where the packer stands in epoch ``epoch``: everything it needs to continue, so a walk can
    start here instead of at the epoch's start (`walk`).

    ``rows`` rows were emitted before it and ``documents`` documents of the plan's order consumed.
    ``split="documents"``: ``open`` holds the best-fit packer's open rows (at most ``bins``), in
    the order they were opened, each a tuple of pieces ``(document id, start, count, length)``.
    ``split="rows"``: ``open`` is empty and row ``rows`` starts at token ``offset`` of the
    document at position ``documents`` (the one the walk continues with). A token-weighted
    mixture's cursor holds each source's ``(draws, tokens)`` there too (``mixture``: where its
    order stands, `TokenMixtureOrder.walk`). Walking on from a cursor
    gives exactly the rows an uninterrupted walk gives from there. Immutable; ``to_json`` is what a
    state carries, `from_json` its strict reader."""

    __slots__ = ("epoch", "rows", "documents", "offset", "open", "mixture", "_json")

    def __init__(self, epoch: int, rows: int, documents: int, offset: int = 0, open: tuple = (), mixture: tuple = ()):
        self.epoch, self.rows, self.documents, self.offset, self.open = epoch, rows, documents, offset, open
        self.mixture = mixture
        self._json: dict | None = None

    @classmethod
    def start(cls, epoch: int) -> PackCursor:
        return cls(epoch, 0, 0)

    @property
    def key(self) -> tuple[int, int]:
        return (self.rows, self.documents)

    def __repr__(self) -> str:
        return f"PackCursor(epoch={self.epoch}, rows={self.rows}, documents={self.documents}, open={len(self.open)})"

    def to_json(self) -> dict:
        """``{"epoch", "rows", "documents", "offset", "open": [[[doc, start, count, length], …], …]}``."""
        if self._json is None:
            self._json = {
                "epoch": self.epoch,
                "rows": self.rows,
                "documents": self.documents,
                "offset": self.offset,
                "open": [[list(p) for p in row] for row in self.open],
            }
            if self.mixture:
                self._json["mixture"] = [list(m) for m in self.mixture]
        return self._json

    @classmethod
    def from_json(
        cls, d, *, pack: Pack, documents: int, ids: int, lengths, sources: int = 0, phased: bool = False
    ) -> PackCursor:
        """A cursor read from a state, bounded and checked before anything is planned from it:
        ``documents`` (the epoch's documents) bounds its position, ``ids`` (the documents' global
        ids) its pieces' documents, ``pack.bins`` its open rows and ``pack.length`` their tokens,
        and every piece's length must be its document's (``lengths``), its tokens within it; a
        token mixture's (``sources`` > 0) ``mixture`` holds a ``[draws, tokens]`` pair per source,
        the draws summing to ``documents`` (the tokens at least the draws, each document counting
        one or more; ``phased``: a scheduled one's count from the phase's start, at least 0).
        Raises `ConfigError` naming the field."""

        def bad(field: str, why: str) -> ConfigError:
            where = f"pack.{field}" if field else "pack"
            return ConfigError(f"loader state {where}: {why}; the state is damaged or was not saved by crossfeed")

        def integer(v, field: str, lo: int, hi: int) -> int:
            if not isinstance(v, int) or isinstance(v, bool):
                raise bad(field, f"expected an integer, got {type(v).__name__}")
            if not lo <= v <= hi:
                raise bad(field, f"{v} is outside {lo} … {hi}")
            return v

        if not isinstance(d, dict):
            raise bad("", f"expected an object, got {type(d).__name__}")
        unknown = set(d) - {"epoch", "rows", "documents", "offset", "open", "mixture"}
        if unknown:
            raise bad(sorted(unknown)[0], "is not a field of a packed state")
        L = pack.length
        epoch = integer(d.get("epoch"), "epoch", 0, 2**62)
        docs = integer(d.get("documents"), "documents", 0, documents)
        rows = integer(d.get("rows"), "rows", 0, 2**62)
        offset = integer(d.get("offset", 0), "offset", 0, 2**62)
        rows_in = d.get("open", [])
        if not isinstance(rows_in, list):
            raise bad("open", f"expected a list of rows, got {type(rows_in).__name__}")
        if pack.split is PackSplit.ROWS and rows_in:
            raise bad("open", 'split="rows" carries no open rows (its row starts at documents, offset)')
        if pack.split is PackSplit.DOCUMENTS and offset:
            raise bad("offset", 'split="documents" starts at a whole document (offset 0)')
        if len(rows_in) > pack.bins:
            raise bad("open", f"{len(rows_in)} open rows, more than the packing's bins={pack.bins}")
        flat: list[list] = []
        for i, row in enumerate(rows_in):
            if not isinstance(row, list) or not row:
                raise bad(f"open[{i}]", "expected a non-empty list of pieces")
            flat += [[i, j, p] for j, p in enumerate(row)]
        if len(flat) > CURSOR_PIECES_MAX:
            raise bad("open", f"{len(flat)} pieces, more than {CURSOR_PIECES_MAX:,}")
        out: list[list[tuple]] = [[] for _ in rows_in]
        for i, j, p in flat:
            field = f"open[{i}][{j}]"
            if not isinstance(p, list) or len(p) != 4:
                raise bad(field, "expected [document, start, count, length]")
            doc = integer(p[0], field + "[0] (document)", 0, ids - 1)
            n = integer(p[3], field + "[3] (length)", 1, 2**62)
            count = integer(p[2], field + "[2] (count)", 1, min(n, L))
            start = integer(p[1], field + "[1] (start)", 0, n - count)
            out[i].append((doc, start, count, n))
        for i, row in enumerate(out):
            used = sum(p[2] for p in row)
            if used >= L:
                raise bad(f"open[{i}]", f"holds {used} tokens; an open row holds fewer than the pack length {L}")
        if flat:  # each piece's length is its document's: a piece is sliced by it
            docs_of = np.array([p[0] for row in out for p in row], dtype=np.int64)
            have = np.asarray(lengths(docs_of), dtype=np.int64)
            said = np.array([p[3] for row in out for p in row], dtype=np.int64)
            wrong = np.flatnonzero(have != said)
            if len(wrong):
                k = int(wrong[0])
                i, j, _ = flat[k]
                raise bad(
                    f"open[{i}][{j}][3] (length)",
                    f"document {int(docs_of[k])} has {int(have[k])} tokens, the state says {int(said[k])}",
                )
        mix_in = d.get("mixture", [])
        if not isinstance(mix_in, list):
            raise bad("mixture", f"expected a list of [draws, tokens] per source, got {type(mix_in).__name__}")
        if not sources and mix_in:
            raise bad("mixture", "only a token-weighted mixture's state carries its sources' draws")
        mixture: list[tuple[int, int]] = []
        if sources and (mix_in or docs):
            if len(mix_in) != sources:
                raise bad("mixture", f"{len(mix_in)} sources, the mixture has {sources}")
            for i, m in enumerate(mix_in):
                if not isinstance(m, list) or len(m) != 2:
                    raise bad(f"mixture[{i}]", "expected [draws, tokens]")
                drawn = integer(m[0], f"mixture[{i}][0] (draws)", 0, docs)
                mixture.append((drawn, integer(m[1], f"mixture[{i}][1] (tokens)", 0 if phased else drawn, 2**62)))
            if sum(m[0] for m in mixture) != docs:
                raise bad("mixture", f"its sources' draws sum to {sum(m[0] for m in mixture)}, not documents={docs}")
        return cls(epoch, rows, docs, offset, tuple(tuple(row) for row in out), tuple(mixture))


class _Marks:
    """What one process knows of an epoch's walk: the cursors it met (`PackCursor`, sorted by
    position; the newest ``DENSE`` all kept, older ones thinned to every other when there are
    more than ``KEEP``: bounded memory at any epoch length), the rows known to exist
    (``seen``), and the epoch's rows once a walk reached its end (``total``)."""

    KEEP, DENSE = 256, 64

    def __init__(self, epoch: int):
        start = PackCursor.start(epoch)
        self.cursors, self.keys = [start], [start.key]
        self.seen: int = 0
        self.total: int | None = None
        self._lock = threading.Lock()

    def add(self, cursor: PackCursor) -> None:
        with self._lock:
            i = bisect.bisect_left(self.keys, cursor.key)
            if i < len(self.keys) and self.keys[i] == cursor.key:
                return
            self.keys.insert(i, cursor.key)
            self.cursors.insert(i, cursor)
            self.seen = max(self.seen, cursor.rows)
            if len(self.cursors) > self.KEEP:  # every other older one goes (the epoch's start stays)
                old = len(self.cursors) - self.DENSE
                keep = [j for j in range(len(self.cursors)) if j >= old or j % 2 == 0]
                self.cursors = [self.cursors[j] for j in keep]
                self.keys = [self.keys[j] for j in keep]

    def best(self, row: int) -> PackCursor:
        """The furthest cursor before row ``row`` is emitted (its ``rows`` at most ``row``)."""
        with self._lock:
            i = bisect.bisect_right(self.keys, (row, sys.maxsize)) - 1
            return self.cursors[max(i, 0)]

    def end(self, rows: int) -> None:
        with self._lock:
            self.total = rows
            self.seen = max(self.seen, rows)


# ---- packing: every row of an epoch -------------------------------------------------------------


def _chunks(order, lengths, start: int = 0, mixture=()) -> Iterator[tuple[int, np.ndarray, np.ndarray, Any]]:
    """``(position, document ids, lengths, draws)`` of the epoch's documents from position
    ``start``, in plan order, a chunk at a time: a few at first (the first rows touch few lengths
    files), then ``SCAN`` at a time; ``position``: the chunk's first document's. A token
    mixture's order (sequential) gives each chunk's `MixDraws` (else None) and walks on from
    ``mixture`` (each source's ``(draws, tokens)`` at ``start``; empty: from the epoch's start)."""
    if order.sequential:
        if mixture:
            yield from order.walk(lengths, (start, [d for d, _ in mixture], [t for _, t in mixture]))
            return
        for lo, ids, lens, draws in order.walk(lengths):
            if lo + len(ids) > start:
                skip = max(0, start - lo)
                if skip:
                    draws = draws.after(skip)
                yield lo + skip, ids[skip:], lens[skip:], draws
        return
    lo, size = start, FIRST_SCAN
    while lo < order.n:
        ids = order(np.arange(lo, min(order.n, lo + size), dtype=np.int64))
        yield lo, ids, np.asarray(lengths(ids), dtype=np.int64), None
        lo, size = lo + size, min(SCAN, 2 * size)


def document_chunks(order, lengths, start: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(document ids, lengths)`` int64 arrays of the epoch's documents from position ``start``,
    in plan order, a few at first (the first rows touch few lengths files), then ``SCAN`` at a time."""
    for _, ids, lens, _ in _chunks(order, lengths, start):
        yield ids, lens


def documents(order, lengths, start: int = 0) -> Iterator[tuple[int, int]]:
    """``(document id, length)`` of the epoch's documents from position ``start``, in plan order."""
    for ids, lens in document_chunks(order, lengths, start):
        yield from zip(ids.tolist(), lens.tolist())


class TokenMixtureOrder:
    """The order of one epoch of a mixture whose weights are shares of tokens
    (``Pack(weights_by="tokens")``), over the documents' `MixtureOrder` (its sources, passes and
    global ids).

    Position ``p`` draws from the source whose ``(tokens drawn so far + 1) / weight`` is smallest
    (the first source on ties; a document counts its tokens, at least 1), so after every
    document each source's tokens are within a document of its share: for sources ``s``, ``t``,
    ``T_s / w_s − T_t / w_t ≤ M / w_s + 1 / w_t`` (``M``: the longest document). It is a pure
    function of the plan and the lengths, exact in integers (``(T + 1) · lcm / w``), and
    sequential: the epoch is walked in order (`walk`, vectorised), from its start or from where
    a cursor says each source stands. A source's ``c``-th document of
    epoch ``e`` is its draw ``e · n + c`` (``n``: the epoch's documents) — its passes' orders as
    in `MixtureOrder` — so epochs never share draws, and within an epoch a source repeats a
    document only after drawing all of them.

    A scheduled mixture (`crossfeed.read.schedule.Schedule`; `ScheduledMixtureOrder`) has phases
    over the documents consumed since training began (``g = e · n + p``, as a sample-weighted
    one): the epoch is cut where a phase begins into segments, and each segment is a token
    mixture of its own under its phase's integer weights — the tokens count from the segment's
    start (the phase's start, or the epoch's for a phase begun in an earlier epoch, as an
    unscheduled plan restarts every epoch), a source weighted 0 there is not drawn — so every
    prefix of every phase's part of an epoch holds each source within a document of its token
    share. A cursor's tokens are then the segment's (at a segment's first position the walk
    counts from 0 whatever it holds)."""

    sequential = True  # walked in order, from the epoch's start or a cursor's draws (`_chunks`)

    def __init__(self, mix):
        self.mix, self.n, self.epoch = mix, mix.n, mix.epoch
        phases = getattr(mix, "phases", None)  # a scheduled mixture's (`ScheduledMixtureOrder`)
        self.phased = phases is not None
        segments: list[tuple[int, tuple[int, ...]]] = [(0, tuple(int(w) for w in mix.weights))]
        if phases is not None:  # the phases this epoch meets, each from its start or the epoch's
            base, j = int(mix.base), int(phases.phase_of(np.array([mix.base]))[0])
            segments = [(0, tuple(int(w) for w in phases.weights[j]))]
            for a, w in zip(phases.starts[j + 1 :].tolist(), phases.weights[j + 1 :]):
                if a >= base + self.n:
                    break
                segments.append((a - base, tuple(int(x) for x in w)))
        self.bounds = [a for a, _ in segments] + [self.n]  # each segment's first position, and the epoch's end
        self.segment_steps = [_steps(w) for _, w in segments]
        self.steps = self.segment_steps[0]

    @property
    def sources(self) -> int:
        return len(self.steps)

    def segment(self, position: int) -> int:
        """The segment (a phase's part in this epoch) that position ``position`` lies in."""
        return bisect.bisect_right(self.bounds, position, hi=len(self.bounds) - 1) - 1

    def walk(self, lengths, start: tuple[int, list[int], list[int]] | None = None):
        """``(position, ids, lengths, draws)`` of the epoch's documents in order, from ``start``
        (``(position, each source's draws, each source's tokens)`` there; None: the epoch's
        start), a chunk at a time; ``draws``: `MixDraws` of the chunk (each source's draws and
        tokens anywhere in it, what a `PackCursor` carries).

        Vectorised: source ``s``'s ``c``-th next document is drawn when its key ``(T_s + 1) ·
        lcm / w_s`` (``T_s``: its tokens before it) is the smallest, ties to the first source —
        each source's keys increase with its own draws alone, so the epoch's order is the merge of
        the sources' key sequences, sorted by (key, source): a chunk of ``count`` documents is the
        first ``count`` of the merge of each source's next ``count`` candidates (one `lexsort`)."""
        mix, k = self.mix, len(self.steps)
        lo, drawn, tokens = (0, [0] * k, [0] * k) if start is None else (start[0], list(start[1]), list(start[2]))
        base = self.epoch * self.n
        buf_ids = [np.zeros(0, dtype=np.int64) for _ in range(k)]  # each source's next draws, fetched ahead
        buf_lens = [np.zeros(0, dtype=np.int64) for _ in range(k)]
        size = FIRST_SCAN
        while lo < self.n:
            seg = self.segment(lo)
            if self.phased and lo == self.bounds[seg]:  # a phase's part begins: its tokens count from here
                tokens = [0] * k
            steps = self.segment_steps[seg]
            live = [s for s in range(k) if steps[s]]  # a source weighted 0 in the phase is not drawn
            count = min(size, self.bounds[seg + 1] - lo)  # a chunk never crosses a phase's start
            keys = []
            for s in live:
                have = len(buf_ids[s])
                if have < count:
                    got = mix.source_samples(s, base + drawn[s] + have, count - have)
                    buf_ids[s] = np.concatenate([buf_ids[s], got])
                    buf_lens[s] = np.concatenate([buf_lens[s], np.asarray(lengths(got), dtype=np.int64)])
                w = np.maximum(buf_lens[s][:count], 1)
                before = tokens[s] + np.cumsum(w) - w
                if steps[s] * (int(before[-1]) + 1) >= 1 << 62:  # past int64: the exact step in Python ints
                    yield from self._walk_python(lengths, lo, drawn, tokens)
                    return
                keys.append(steps[s] * (before + 1))
            source = np.repeat(np.asarray(live, dtype=np.int64), count)
            picked = np.lexsort((source, np.concatenate(keys)))[:count]
            src = source[picked]
            take = np.bincount(src, minlength=k)
            ids, lens = np.empty(count, dtype=np.int64), np.empty(count, dtype=np.int64)
            for s in range(k):
                t = int(take[s])
                if t:
                    m = src == s
                    ids[m], lens[m] = buf_ids[s][:t], buf_lens[s][:t]
            yield lo, ids, lens, MixDraws(drawn, tokens, src, lens)
            for s in range(k):
                t = int(take[s])
                drawn[s] += t
                tokens[s] += int(np.maximum(buf_lens[s][:t], 1).sum())
                buf_ids[s], buf_lens[s] = buf_ids[s][t:], buf_lens[s][t:]
            lo, size = lo + count, min(SCAN, 2 * size)

    def _walk_python(self, lengths, lo: int, drawn: list[int], tokens: list[int]):
        """`walk` one document at a time in Python integers (weights whose keys pass int64)."""
        mix, k = self.mix, len(self.steps)
        drawn, tokens = list(drawn), list(tokens)
        base, size = self.epoch * self.n, FIRST_SCAN
        while lo < self.n:
            seg = self.segment(lo)
            if self.phased and lo == self.bounds[seg]:
                tokens = [0] * k
            steps = self.segment_steps[seg]
            keys = [st * (t + 1) if st else math.inf for st, t in zip(steps, tokens)]
            count = min(size, self.bounds[seg + 1] - lo)
            ids, lens, src = [0] * count, [0] * count, [0] * count
            start_drawn, start_tokens = list(drawn), list(tokens)
            for j in range(count):
                s = keys.index(min(keys))
                got = mix.source_samples(s, base + drawn[s], 1)
                ids[j], n, src[j] = int(got[0]), int(lengths(got)[0]), s
                lens[j] = n
                drawn[s] += 1
                tokens[s] += max(n, 1)
                keys[s] += max(n, 1) * steps[s]
            lens_a = np.asarray(lens, dtype=np.int64)
            yield (
                lo,
                np.asarray(ids, dtype=np.int64),
                lens_a,
                MixDraws(start_drawn, start_tokens, np.asarray(src), lens_a),
            )
            lo, size = lo + count, min(SCAN, 2 * size)


def _steps(weights) -> list[int]:
    """Each source's key step ``lcm / w`` for integer weights ``w`` (0: a source not drawn)."""
    lcm = math.lcm(*(w for w in weights if w))
    return [lcm // w if w else 0 for w in weights]


class MixDraws:
    """Where a token mixture's sources stand within one chunk of its walk: ``at(j)`` is each
    source's ``(draws, tokens)`` before the chunk's ``j``-th document (a `PackCursor`'s ``mixture``)."""

    __slots__ = ("drawn", "tokens", "src", "lens")

    def __init__(self, drawn, tokens, src: np.ndarray, lens: np.ndarray):
        self.drawn, self.tokens, self.src, self.lens = list(drawn), list(tokens), src, lens

    def after(self, j: int) -> MixDraws:
        """The draws of the chunk's documents from its ``j``-th on."""
        drawn, tokens = zip(*self.at(j)) if self.drawn else ((), ())
        return MixDraws(drawn, tokens, self.src[j:], self.lens[j:])

    def at(self, j: int) -> tuple[tuple[int, int], ...]:
        k = len(self.drawn)
        d = np.bincount(self.src[:j], minlength=k)
        t = np.bincount(self.src[:j], weights=np.maximum(self.lens[:j], 1), minlength=k)
        return tuple((a + int(x), b + int(y)) for a, b, x, y in zip(self.drawn, self.tokens, d.tolist(), t.tolist()))


class _BestFitChunks:
    """Best-fit packing into at most ``bins`` open rows (see the module docstring), a chunk of
    documents at a time: exactly `_BestFit`'s rows (the rule one document at a time, kept as
    the reference the tests check this against), with the per-document step cut to what the
    rule needs — a ``bisect`` over the open rows' rooms, each kept as one integer ``room << SH
    | row`` (ties: the oldest row, the smallest number), and the row the document went to.
    Pieces are never built per document: a chunk's rows are laid out from the documents'
    arrays and the rows each went to, in numpy (`_emit`)."""

    SH = 40  # row numbers (opened since the cursor) below 2^40
    MASK = (1 << SH) - 1

    def __init__(self, length: int, bins: int):
        self.length, self.bins = length, bins
        self.spaces: list[int] = []  # room << SH | row of the open rows, sorted
        self.keys: dict[int, int] = {}  # row → its key in spaces; insertion order = opening order
        self.seq = 0
        self.carry = np.zeros((0, PIECE), dtype=np.int64)  # the open rows' pieces: (row, doc, start, count, length)

    @classmethod
    def at(cls, length: int, bins: int, rows=()) -> _BestFitChunks:
        """A packer whose open rows are ``rows`` (a `PackCursor`'s, in the order they were opened)."""
        self = cls(length, bins)
        pieces: list[tuple] = []
        for row in rows:
            s, self.seq = self.seq, self.seq + 1
            key = (length - sum(p[2] for p in row)) << self.SH | s
            self.keys[s] = key
            bisect.insort(self.spaces, key)
            pieces += [(s, *p) for p in row]
        self.carry = np.array(pieces, dtype=np.int64).reshape(-1, PIECE)
        return self

    def state(self) -> tuple:
        """The open rows, in the order they were opened (what a `PackCursor` carries)."""
        if not self.keys:
            return ()
        c = self.carry[np.argsort(self.carry[:, 0], kind="stable")]  # each row's pieces together, in order
        rows, first = np.unique(c[:, 0], return_index=True)
        pieces = list(map(tuple, c[:, 1:].tolist()))
        bounds = np.append(first, len(c)).tolist()
        at = dict(zip(rows.tolist(), zip(bounds, bounds[1:])))
        return tuple(tuple(pieces[a:b]) for a, b in map(at.__getitem__, self.keys))

    def add(self, ids: np.ndarray, lens: np.ndarray, drop: bool, first: int) -> tuple[int, np.ndarray]:
        """Pack a chunk of documents: ``(rows emitted, their pieces)``, rows numbered from ``first``.

        The step per document is a search, a removal and an insertion in ``spaces`` (its end held
        by a key past every room, so a search always lands) and the key of the row it went to;
        what the step needs of each document (its last piece's tokens, shifted into a key) is
        computed for the chunk in numpy first, and long or empty documents take a branch of
        their own."""
        L, bins, SH, MASK = self.length, self.bins, self.SH, self.MASK
        spaces, keys, seq = self.spaces, self.keys, self.seq
        left, insort, remove = bisect.bisect_left, bisect.insort, spaces.remove
        end = (L + 1) << SH  # past every room
        spaces.append(end)
        went: list[int] = []  # per document: the key of the row its (last) piece went to; -1: none
        put = went.append
        emitted: list[int] = []
        emit = emitted.append
        whole: list[tuple[int, int, int]] = []  # (row, document's index, start): full rows of a long document
        last = np.where(lens > L, (lens - 1) // L * L, 0)  # a long document's last piece starts there
        # each document's last piece as a key; a long or empty document's -1 - its index
        needs = np.where((lens > L) | (lens <= 0), -1 - np.arange(len(lens)), (lens - last) << SH).tolist()
        for need in needs:
            if need < 0:
                j = -1 - need
                n = int(lens[j])
                if not n or drop:
                    put(-1)
                    continue
                for start in range(0, n - L, L):
                    whole.append((seq, j, start))
                    emit(seq)
                    seq += 1
                need = (n - int(last[j])) << SH
            i = left(spaces, need)
            key = spaces[i]
            if key != end:  # the best-fitting open row
                del spaces[i]
                key -= need
                if key > MASK:
                    insort(spaces, key)
                    keys[key & MASK] = key
                else:  # full: emitted now
                    del keys[key]
                    emit(key)
                put(key)
                continue
            if len(keys) >= bins:  # the oldest open row is closed
                old = next(iter(keys))
                remove(keys.pop(old))
                emit(old)
            key = (L << SH) - need
            if key:
                key |= seq
                insort(spaces, key)
                keys[seq] = key
            else:
                emit(seq)
            put(seq)
            seq += 1
        spaces.pop()
        self.seq = seq
        rows = np.asarray(went, dtype=np.int64)
        placed = rows >= 0
        rows &= MASK
        parts = [self.carry]
        if whole:
            w = np.asarray(whole, dtype=np.int64)
            parts.append(np.stack([w[:, 0], ids[w[:, 1]], w[:, 2], np.full(len(w), L), lens[w[:, 1]]], axis=1))
        if placed.any():
            d = np.flatnonzero(placed)
            parts.append(np.stack([rows[d], ids[d], last[d], lens[d] - last[d], lens[d]], axis=1))
        return self._emit(np.concatenate(parts) if len(parts) > 1 else self.carry, emitted, first)

    def flush(self, first: int) -> tuple[int, np.ndarray]:
        """The open rows, emitted in the order they were opened (the epoch's end)."""
        rows = list(self.keys)
        self.keys, self.spaces = {}, []
        return self._emit(self.carry, rows, first)

    def _emit(self, pieces: np.ndarray, emitted: list[int], first: int) -> tuple[int, np.ndarray]:
        """Rows ``emitted`` (in that order) of ``pieces`` (the packer's, each row's in the order
        they were added) as a block numbered from ``first``; the rest stay open."""
        if not emitted:
            self.carry = pieces
            return 0, pieces[:0]
        e = np.asarray(emitted, dtype=np.int64)
        numbers = pieces[:, 0]
        bounds = [int(e.min()), int(e.max())] + ([int(numbers.min()), int(numbers.max())] if len(numbers) else [])
        lo, span = min(bounds), max(bounds) - min(bounds) + 1
        if span <= 4 * len(pieces) + 1024:  # each row's rank by a table over the rows' numbers
            table = np.full(span, -1, dtype=np.int64)
            table[e - lo] = np.arange(len(e))
            rank = table[numbers - lo]
            out = rank >= 0
            rank = rank[out]
        else:  # an open row far older than the rest (memory stays O(pieces)): by a search
            order = np.argsort(e, kind="stable")
            ranked = e[order]
            at = np.minimum(np.searchsorted(ranked, numbers), len(e) - 1)
            out = ranked[at] == numbers
            rank = order[at[out]]
        # each row's pieces in the order they were added (a stable sort; a radix sort on 16 bits)
        keep = np.argsort(rank.astype(np.uint16) if len(e) <= 1 << 16 else rank, kind="stable")
        block = pieces[out][keep]
        block[:, 0] = first + rank[keep]
        self.carry = pieces[~out]
        return len(e), block


class _BestFit:
    """Best-fit packing into at most ``bins`` open rows (see the module docstring), one document
    at a time: the rule as written, the reference `_BestFitChunks` is checked against."""

    def __init__(self, length: int, bins: int):
        self.length, self.bins = length, bins
        self.spaces: list[tuple[int, int]] = []  # (room, row number) of the open rows, sorted
        self.open: dict[int, list] = {}  # row number → pieces; insertion order = opening order
        self.room: dict[int, int] = {}
        self.seq = 0

    @classmethod
    def at(cls, length: int, bins: int, rows=()) -> _BestFit:
        """A packer whose open rows are ``rows`` (a `PackCursor`'s, in the order they were opened)."""
        self = cls(length, bins)
        for row in rows:
            s, self.seq = self.seq, self.seq + 1
            self.open[s] = list(row)
            room = length - sum(p[2] for p in row)
            self.room[s] = room
            bisect.insort(self.spaces, (room, s))
        return self

    def state(self) -> tuple:
        """The open rows, in the order they were opened (what a `PackCursor` carries)."""
        return tuple(map(tuple, self.open.values()))

    def add(self, doc: int, n: int, out: list) -> None:
        L, start = self.length, 0
        while n - start > L:  # a long document: rows of its own, the last piece packed below
            out.append([(doc, start, L, n)])
            start += L
        rest = n - start
        if rest <= 0:
            return
        piece = (doc, start, rest, n)
        i = bisect.bisect_left(self.spaces, (rest, -1))
        if i < len(self.spaces):
            room, s = self.spaces.pop(i)
            self.open[s].append(piece)
            self._left(s, room - rest, out)
            return
        if len(self.open) >= self.bins:
            s = next(iter(self.open))
            self.spaces.remove((self.room.pop(s), s))
            out.append(self.open.pop(s))
        s, self.seq = self.seq, self.seq + 1
        self.open[s] = [piece]
        self._left(s, L - rest, out)

    def _left(self, s: int, room: int, out: list) -> None:
        if room:
            self.room[s] = room
            bisect.insort(self.spaces, (room, s))
        else:  # full: emitted now
            self.room.pop(s, None)
            out.append(self.open.pop(s))

    def flush(self) -> list:
        return list(self.open.values())


def _sha256(f) -> str:
    """The hex sha256 of the rest of open file ``f``."""
    if sys.version_info >= (3, 11):
        return hashlib.file_digest(f, "sha256").hexdigest()
    h = hashlib.sha256()  # Python 3.10 has no file_digest
    for chunk in iter(lambda: f.read(8 << 20), b""):
        h.update(chunk)
    return h.hexdigest()


class _Chunks:
    """Concatenate and chunk: documents end to end, cut at every ``length`` tokens."""

    def __init__(self, length: int):
        self.length, self.fill = length, 0
        self.row: list[tuple[int, int, int, int]] = []  # (document, start, tokens, its length) pieces

    def add(self, doc: int, n: int, out: list) -> None:
        start = 0
        while start < n:
            take = min(n - start, self.length - self.fill)
            self.row.append((doc, start, take, n))
            start, self.fill = start + take, self.fill + take
            if self.fill == self.length:
                out.append(self.row)
                self.row, self.fill = [], 0

    def flush(self) -> list:
        return [self.row] if self.row else []


def walk(order, lengths, pack: Pack, cursor: PackCursor | None = None) -> Iterator[tuple[int, np.ndarray, PackCursor]]:
    """The rows of one epoch in order from ``cursor`` (None: the epoch's start), in blocks
    ``(rows, pieces, after)``: the block's ``rows`` rows (numbered on from the cursor's
    ``rows``) as an ``(n, 5)`` int64 array of pieces ``(row, document, start, count, length)``,
    row by row — the document's tokens ``start .. start + count`` (``length``: the whole
    document's) — and the cursor after the block (a walk from it continues with the next block).

    ``split="rows"`` is planned in numpy a chunk of documents at a time: with the documents'
    token offsets in the epoch's concatenation (a cumulative sum), document ``d`` spans rows
    ``begin_d // L … (end_d - 1) // L`` and its piece in row ``r`` is ``[max(begin_d, r·L),
    min(end_d, (r + 1)·L))`` — one expansion for the chunk, no step per document. Best-fit steps
    per document through its open rows' rooms (`_BestFitChunks`: a bisect and the row each
    document went to), the chunk's pieces laid out in numpy."""
    L = pack.length
    drop = pack.long is PackLong.DROP
    epoch = getattr(order, "epoch", 0) if cursor is None else cursor.epoch
    cursor = cursor or PackCursor.start(epoch)
    end_mix = cursor.mixture  # a token mixture's draws where the walk stands (its last chunk's end)

    def mix_at(draws, j: int) -> tuple:
        return draws.at(j) if draws is not None else ()

    if pack.split is PackSplit.DOCUMENTS:
        packer, done = _BestFitChunks.at(L, pack.bins, cursor.open), cursor.rows
        for lo, ids, lens, draws in _chunks(order, lengths, cursor.documents, cursor.mixture):
            rows, block = packer.add(ids, lens, drop, done)
            done += rows
            end_mix = mix_at(draws, len(ids))
            yield rows, block, PackCursor(epoch, done, lo + len(ids), 0, packer.state(), end_mix)
        rows, block = packer.flush(done)
        if rows:
            yield rows, block, PackCursor(epoch, done + rows, order.n, mixture=end_mix)
        return
    done = cursor.rows  # rows emitted
    tokens = done * L - cursor.offset  # tokens before the next chunk, in the epoch's concatenation
    at, offset, at_mix = cursor.documents, cursor.offset, cursor.mixture  # where the open row starts
    carry = np.zeros((0, PIECE), dtype=np.int64)  # the pieces of the open row
    first = True
    for lo, ids, lens, draws in _chunks(order, lengths, cursor.documents, cursor.mixture):
        chunk = len(ids)
        pos = np.arange(lo, lo + chunk, dtype=np.int64)
        keep = (lens > 0) & (lens <= L) if drop else lens > 0
        if first and offset and (len(lens) == 0 or not keep[0] or offset >= lens[0]):
            raise ConfigError(
                f"loader state pack.offset: {offset} is not inside document {at} of epoch {epoch} "
                f"({int(lens[0]) if len(lens) else 0} tokens); the state is damaged or was saved for other data"
            )
        first = False
        end_mix = mix_at(draws, chunk)
        if not keep.all():
            ids, lens, pos = ids[keep], lens[keep], pos[keep]
        if not len(ids):
            if len(carry):
                yield 0, carry[:0], PackCursor(epoch, done, at, offset, mixture=at_mix)
            else:
                yield 0, carry[:0], PackCursor(epoch, done, lo + chunk, mixture=end_mix)
            continue
        ends = tokens + np.cumsum(lens)
        begins = ends - lens
        row0 = begins // L
        count = (ends - 1) // L - row0 + 1
        d = np.repeat(np.arange(len(ids)), count)
        row = row0[d] + np.arange(len(d)) - np.repeat(np.cumsum(count) - count, count)
        a = np.maximum(begins[d], row * L)
        b = np.minimum(ends[d], (row + 1) * L)
        new = np.stack([row, ids[d], a - begins[d], b - a, lens[d]], axis=1)
        if row0[0] < done:  # a walk from a cursor mid-document: the rows before it are not this walk's
            new = new[new[:, 0] >= done]
        pieces = np.concatenate([carry, new])
        tokens = int(ends[-1])
        full = tokens // L  # rows before this one are complete
        cut = int(np.searchsorted(pieces[:, 0], full))
        if full > done:
            k = int(np.searchsorted(ends, full * L, side="right"))  # the document the open row starts in
            if k < len(ids):
                at, offset = int(pos[k]), full * L - int(begins[k])
                at_mix = mix_at(draws, at - lo)
            else:
                at, offset, at_mix = lo + chunk, 0, end_mix
            rows, block, done = full - done, pieces[:cut], full
        else:
            rows, block = 0, pieces[:0]
        carry = pieces[cut:]
        if len(carry):
            yield rows, block, PackCursor(epoch, done, at, offset, mixture=at_mix)
        else:
            yield rows, block, PackCursor(epoch, done, lo + chunk, mixture=end_mix)
    if len(carry):
        yield 1, carry, PackCursor(epoch, done + 1, order.n, mixture=end_mix)


def row_blocks(order, lengths, pack: Pack, cursor: PackCursor | None = None) -> Iterator[tuple[int, np.ndarray]]:
    """Every row of one epoch in order (from ``cursor``), in blocks ``(rows, pieces)`` (`walk`)."""
    for rows, pieces, _ in walk(order, lengths, pack, cursor):
        yield rows, pieces


def _block(rows: list[list], first: int) -> np.ndarray:
    """Rows of piece tuples (numbered from ``first``) as a block's ``(n, 5)`` piece array."""
    pieces = np.array(list(itertools.chain.from_iterable(rows)), dtype=np.int64).reshape(-1, PIECE - 1)
    numbers = np.repeat(np.arange(first, first + len(rows), dtype=np.int64), list(map(len, rows)))
    return np.column_stack([numbers, pieces])


def packed_rows(order, lengths, pack: Pack) -> Iterator[list[tuple[int, int, int, int]]]:
    """Every row of one epoch in order: a list of pieces ``(document, start, count, length)``
    (the document's tokens ``start .. start + count``; ``length``: the whole document's) — the
    rows of `row_blocks`, one at a time."""
    for rows, pieces in row_blocks(order, lengths, pack):
        first = int(pieces[0, 0]) if len(pieces) else 0
        out: list[list] = [[] for _ in range(rows)]
        for r, *piece in pieces.tolist():
            out[r - first].append(tuple(piece))
        yield from out


def _encoded(pieces: np.ndarray, rows: int, width: int) -> np.ndarray:
    """A batch for the builder from ``(n, 5)`` pieces whose first column is the row in the batch."""
    out = np.empty(HEADER + pieces.size, dtype=np.int64)
    out[0], out[1] = rows, width
    out[HEADER:].reshape(pieces.shape)[...] = pieces
    return out


def token_batches(order, lengths, start: int, budget: int, world: int) -> Iterator[list[tuple[int, int]]]:
    """The global batches of ``batch_by_tokens`` from epoch position ``start`` (see the module
    docstring): each a list of ``(document, length)`` whose ``i``-th belongs to rank ``i % world``."""
    docs = documents(order, lengths, start)
    batch: list = []
    longest = 0
    while True:
        group = [d for _, d in zip(range(world), docs)]
        if not group:
            break
        top = max(n for _, n in group)
        if batch and (len(batch) + world) * max(longest, top) > budget * world:
            yield batch
            batch, longest = [], 0
        batch.extend(group)
        longest = max(longest, top)
    if batch:
        yield batch


def _encode(rows: list[list], width: int) -> np.ndarray:
    """A batch for the builder (int64, what process workers receive): ``(rows, width)`` and its pieces."""
    pieces = [(i, *p) for i, row in enumerate(rows) for p in row]
    out = np.empty(HEADER + PIECE * len(pieces), dtype=np.int64)
    out[0], out[1] = len(rows), width
    if pieces:
        out[HEADER:] = np.asarray(pieces, dtype=np.int64).ravel()
    return out


# ---- the plan -----------------------------------------------------------------------------------


class PackSampler:
    """Stage 1 for token datasets, over the documents' `Sampler` (whose order it packs or
    batches): the interface of `Sampler` (``plan``, ``rank_batch_count``, ``position_after``,
    ``epoch_total``, ``total``) with positions counted in rows (``pack``) or documents
    (``batch_by_tokens``)."""

    def __init__(self, docs, lengths: DocLengths, options: LoaderOptions):
        self.docs, self.lengths = docs, lengths
        self.options, self.shard = options.plan, options.shard
        self.pack, self.budget = options.plan.pack, options.plan.batch_by_tokens
        self.total = docs.total  # documents per epoch (a state's num_samples: which data it was saved for)
        self._marks: dict[int, _Marks] = {}  # epoch → what is known of its walk (the last few epochs)
        self._counts: dict[tuple[int, int], int] = {}  # batch_by_tokens: (epoch, position) → global batches left
        self._lock = threading.Lock()

    @property
    def packing(self) -> Pack:
        """``pack`` of a packing sampler (one under a token budget has none)."""
        if self.pack is None:
            raise ConfigError("this token Loader batches documents by batch_by_tokens; it packs no rows")
        return self.pack

    @property
    def token_budget(self) -> int:
        """``batch_by_tokens`` of a sampler under a token budget (a packing one has none)."""
        if self.budget is None:
            raise ConfigError("this token Loader packs rows (pack=); it has no batch_by_tokens budget")
        return self.budget

    @property
    def per_batch(self) -> int:
        """Global rows per step (``pack``): every rank's batch."""
        return self.options.batch_size * self.shard.world_size

    def order(self, epoch: int):
        order = self.docs.plan(epoch, 0).order
        if self.pack is not None and self.pack.weights_by is WeightsBy.TOKENS and getattr(self.docs, "weights", None):
            return TokenMixtureOrder(order)
        return order

    def walk(self, epoch: int, row: int = 0) -> tuple[int, Iterator[tuple[int, np.ndarray]]]:
        """``(first, blocks)``: the epoch's rows in blocks (`row_blocks`) from the nearest cursor
        known at or before row ``row`` (the epoch's start when none is), ``first`` the first
        block's first row; the cursors met are remembered (`_Marks`), and the epoch's total when
        the walk reaches its end."""
        marks = self.marks(epoch)
        start = marks.best(row)
        return start.rows, self._recorded(marks, walk(self.order(epoch), self.lengths, self.packing, start), start)

    def blocks(self, epoch: int) -> Iterator[tuple[int, np.ndarray]]:
        """The epoch's rows in blocks from its start (`row_blocks`)."""
        return row_blocks(self.order(epoch), self.lengths, self.packing)

    @staticmethod
    def _recorded(marks: _Marks, blocks, last: PackCursor) -> Iterator[tuple[int, np.ndarray]]:
        for rows, pieces, after in blocks:
            marks.add(after)
            last = after
            yield rows, pieces
        marks.end(last.rows)

    def marks(self, epoch: int) -> _Marks:
        """What this process knows of epoch ``epoch``'s walk (the last few epochs are kept)."""
        with self._lock:
            got = self._marks.get(epoch)
            if got is None:
                got = self._marks[epoch] = _Marks(epoch)
                while len(self._marks) > 4:
                    del self._marks[next(iter(self._marks))]
        return got

    def epoch_total(self, epoch: int) -> int:
        """Positions in epoch ``epoch``: its rows (``pack``), or documents. Rows: exact from the
        lengths' sums where they decide it (`exact_rows`), else one walk on from the furthest
        cursor known (the whole epoch, the first time), kept."""
        if self.pack is None:
            return self.total
        marks = self.marks(epoch)
        if marks.total is None:
            exact = self.exact_rows(epoch)
            if exact is not None:
                marks.end(exact)
            else:
                first, blocks = self.walk(epoch, marks.seen)
                for _ in blocks:
                    pass
        assert marks.total is not None
        return marks.total

    def exact_rows(self, epoch: int) -> int | None:
        """The rows of a ``split="rows"`` epoch of one dataset without walking it: every document
        once, so its tokens are the lengths files' sum whatever the order (``long="drop"``: of
        the lengths up to ``length``), cut in rows of ``length``; None where the order decides
        it (a mixture's draws, best-fit's padding)."""
        if self.pack is None or self.pack.split is not PackSplit.ROWS or getattr(self.docs, "weights", None):
            return None
        bounds = self.rows_bounds(epoch)
        return None if bounds is None else bounds[0]

    def rows_bounds(self, epoch: int) -> tuple[int, int] | None:
        """``(least, most)`` rows epoch ``epoch`` can have, without walking it (one dataset; None
        for a mixture, whose tokens depend on its draws): with ``T`` the epoch's tokens (the lengths
        files' sum; ``long="drop"``: of the lengths up to ``L``), ``split="rows"`` has exactly
        ``⌈T / L⌉``; best-fit at least that and at most ``⌊2T / L⌋ + bins`` — a row is closed
        with room left only when a piece fits none of the ``bins`` open rows, so its padding is
        less than that piece, and each piece closes at most one row; the rows open at the end
        are the ``bins``. ``len()`` stays exact (`epoch_total`); this is for a plan that only
        needs a bound."""
        if self.pack is None or getattr(self.docs, "weights", None):
            return None
        L = self.pack.length
        tokens = self.lengths.total(L if self.pack.long is PackLong.DROP else None)
        least = -(-tokens // L)
        return (least, least) if self.pack.split is PackSplit.ROWS else (least, 2 * tokens // L + self.pack.bins)

    def rows_upto(self, epoch: int, position: int) -> int:
        """``min(rows of the epoch, position)``, walking no further than ``position`` rows, on
        from the nearest cursor known before it (opening, a first batch, a state mid-epoch and
        a resumed state never walk the whole epoch, nor from its start when a cursor is known)."""
        marks = self.marks(epoch)
        if marks.total is not None:
            return min(marks.total, position)
        if position <= marks.seen:
            return max(position, 0)
        first, blocks = self.walk(epoch, position)
        k = first
        for rows, _ in blocks:
            k += rows
            if k >= position:
                return position
        return k

    def within(self, epoch: int, position: int) -> bool:
        """Whether ``position`` lies in epoch ``epoch`` (0 … its rows or documents)."""
        return 0 <= position and (
            self.pack is None and position <= self.total or self.rows_upto(epoch, position) == position
        )

    def cursor_at(self, epoch: int, position: int) -> PackCursor:
        """A cursor at or before row ``position`` of epoch ``epoch`` — within a chunk of documents
        of it (a walk from it reaches ``position`` in O(``SCAN``) documents), walking there from
        the nearest one known when this process has not been there."""
        self.rows_upto(epoch, position)
        return self.marks(epoch).best(position)

    def resume(self, state, epoch: int, position: int) -> bool:
        """Take a state's cursor (`PackCursor.to_json`), checked (`PackCursor.from_json`), as one
        this process knows: a walk to ``position`` starts there. A cursor of another epoch, or past
        ``position``, does not lead there and is left unused (False)."""
        order = self.order(epoch)
        cursor = PackCursor.from_json(
            state,
            pack=self.packing,
            documents=self.total,
            ids=int(self.lengths.starts[-1]),
            lengths=self.lengths,
            sources=order.sources if order.sequential else 0,
            phased=getattr(order, "phased", False),
        )
        if cursor.epoch != epoch or cursor.rows > position:
            log.debug(
                "a packed state's cursor (%r) does not lead to row %d of epoch %d: unused", cursor, position, epoch
            )
            return False
        self.marks(epoch).add(cursor)
        return True

    def documents_before(self, epoch: int, position: int, state=None) -> int:
        """The documents of epoch ``epoch``'s order the walk consumes to emit its rows before row
        ``position`` (the epoch's documents when it has fewer rows): exactly, one document at a
        time (`_BestFit`, or the running token count of ``split="rows"``) from the last cursor
        before that row — a state's (``state``: `PackCursor.to_json`, checked; it is not kept)
        or one this process knows. Where a mixture schedule stands at that row: its rows depend on
        those documents alone (`crossfeed.read.identity.StreamIdentity.resume_differences`)."""
        if position <= 0:
            return 0
        order, pack = self.order(epoch), self.packing
        start = self.marks(epoch).best(position - 1)
        if state is not None:
            given = PackCursor.from_json(
                state,
                pack=pack,
                documents=self.total,
                ids=int(self.lengths.starts[-1]),
                lengths=self.lengths,
                sources=order.sources if order.sequential else 0,
                phased=getattr(order, "phased", False),
            )
            if given.epoch == epoch and start.key < given.key and given.rows < position:
                start = given
        for _, _, after in walk(order, self.lengths, pack, start):  # to the chunk that emits row position - 1
            if after.rows >= position:
                break
            start = after
        L, rows = pack.length, start.rows
        drop = pack.long is PackLong.DROP
        packer = _BestFit.at(L, pack.bins, start.open) if pack.split is PackSplit.DOCUMENTS else None
        need = (position - rows) * L + start.offset  # split="rows": tokens from the cursor's document's start
        out: list = []
        for lo, ids, lens, _ in _chunks(order, self.lengths, start.documents, start.mixture):
            for j, n in enumerate(lens.tolist()):
                if not n or drop and n > L:
                    continue
                if packer is None:
                    need -= n
                    if need <= 0:
                        return lo + j + 1
                    continue
                packer.add(int(ids[j]), n, out)
                if rows + len(out) >= position:
                    return lo + j + 1
        return order.n

    def rows(self, epoch: int, lo: int, hi: int) -> np.ndarray:
        """The pieces ``(row, document, start, count, length)`` of rows ``lo … hi - 1`` of epoch
        ``epoch`` ("which documents are in row R"): a walk from the nearest cursor known before
        ``lo`` (O(bins + rows) past a cursor in the same chunk of documents)."""
        first, blocks = self.walk(epoch, lo)
        parts, k = [], first
        for rows, pieces in blocks:
            k += rows
            parts.append(pieces[(pieces[:, 0] >= lo) & (pieces[:, 0] < hi)])
            if k >= hi:
                break
        return np.concatenate(parts) if parts else np.zeros((0, PIECE), dtype=np.int64)

    def rank_batch(self, epoch: int, position: int, b: int, rank: int) -> tuple[np.ndarray, int] | None:
        """Rank ``rank``'s batch ``b`` from ``position`` of epoch ``epoch``, encoded as `PackPlan`
        yields it, and the row the walk to it began at (the nearest cursor known before it); None
        where the batch lies past the epoch's end — found by walking no further than its rows (the
        epoch's batches are not counted). Its global rows are ``position + b·B·W …`` (`rows`), the
        rank's ``position + b·B·W + i·W + rank`` its row ``i``."""
        W, per = self.shard.world_size, self.per_batch
        lo = position + b * per
        start = self.marks(epoch).best(lo).rows
        need = lo + (per if self.options.drop_last else 1)  # the last batch is completed with empty rows
        if self.rows_upto(epoch, need) < need:
            return None
        pieces = self.rows(epoch, lo, lo + per)
        i, r = np.divmod(pieces[:, 0] - lo, W)
        mine = r == rank
        encoded = _encoded(np.column_stack([i[mine], pieces[mine, 1:]]), self.options.batch_size, self.packing.length)
        return encoded, start

    def _token_count(self, epoch: int, position: int) -> int:
        key = (epoch, position)
        with self._lock:
            got = self._counts.get(key)
        if got is None:
            got = sum(
                1
                for _ in token_batches(
                    self.order(epoch), self.lengths, position, self.token_budget, self.shard.world_size
                )
            )
            with self._lock:
                self._counts[key] = got
                while len(self._counts) > 8:
                    del self._counts[next(iter(self._counts))]
        return got

    def plan(self, epoch: int, position: int = 0) -> PackPlan:
        if not self.within(epoch, position):
            raise ConfigError(
                f"position {position} is outside epoch {epoch} of {self.epoch_total(epoch)} "
                f"{'rows' if self.pack else 'documents'}; was the state saved for another dataset or packing?"
            )
        return PackPlan(self, int(epoch), int(position))

    def rank_batch_count(self, position: int = 0, epoch: int = 0) -> int:
        """Batches each rank delivers from ``position`` to the end of epoch ``epoch``."""
        if self.pack is None:
            return self._token_count(epoch, position)
        left = max(0, self.epoch_total(epoch) - position)  # (a state's row number is taken as given)
        return left // self.per_batch if self.options.drop_last else -(-left // self.per_batch)

    def source_positions(self, epoch: int, position: int) -> list[dict] | None:
        """None: a token plan's positions count rows or documents, not each source's draws."""
        return None

    def position_after(self, position: int, rank_batches_done: int, epoch: int = 0) -> int:
        """The position after every rank delivered ``rank_batches_done`` batches from ``position``."""
        if rank_batches_done <= 0:
            return position
        if self.pack is not None:
            return self.rows_upto(epoch, position + rank_batches_done * self.per_batch)
        done = position
        batches = token_batches(self.order(epoch), self.lengths, position, self.token_budget, self.shard.world_size)
        for _, batch in zip(range(rank_batches_done), batches):
            done += len(batch)
        return done


class PackPlan:
    """One rank's (and worker's) batches for the rest of an epoch, as encoded pieces (`_encode`)
    for `PackBuilder`; walked from the lengths as it is iterated."""

    random_access = False  # rows are walked in order: no batch by number (see `PackWalker`)

    def __init__(self, sampler: PackSampler, epoch: int, position: int):
        self.sampler, self.epoch, self.position = sampler, epoch, position
        sh = sampler.shard
        self.rank, self.world_size, self.worker, self.num_workers = sh.rank, sh.world_size, sh.worker, sh.num_workers

    def __len__(self) -> int:
        n = self.sampler.rank_batch_count(self.position, epoch=self.epoch)
        return len(range(self.worker, n, self.num_workers))

    def __iter__(self) -> Iterator[np.ndarray]:
        return self._packed() if self.sampler.pack is not None else self._by_tokens()

    def _mine(self, g: int) -> bool:
        return g % self.num_workers == self.worker

    def _packed(self) -> Iterator[np.ndarray]:
        """The rank's rows of each batch of this worker, picked from the epoch's row blocks with
        one mask per block: global row ``k ≥ position`` is row ``i`` of global batch ``g`` for
        rank ``r`` where ``k - position = g·B·W + i·W + r``."""
        s = self.sampler
        B, W, p, L = s.options.batch_size, self.world_size, self.position, s.packing.length
        per, nw = B * W, self.num_workers
        pending = np.zeros((0, PIECE + 1), dtype=np.int64)  # (batch, row in it, doc, start, count, length)
        seen, blocks = s.walk(self.epoch, p)  # from the nearest cursor before p
        g_next = 0
        for rows, pieces in blocks:
            seen += rows
            k = pieces[:, 0] - p
            g, within = np.divmod(k, per)
            i, r = np.divmod(within, W)
            mine = (k >= 0) & (r == self.rank) & (g % nw == self.worker)
            if mine.any():
                pending = np.concatenate([pending, np.column_stack([g[mine], i[mine], pieces[mine, 1:]])])
            ready = max(0, (seen - p) // per)  # batches whose every row is known
            if g_next < ready:
                cuts = np.searchsorted(pending[:, 0], np.arange(g_next, ready), side="right")
                yield from self._cut(pending, g_next, cuts.tolist(), B, L)
                pending, g_next = pending[int(cuts[-1]) :], ready
        left = max(0, seen - p)
        count = left // per if s.options.drop_last else -(-left // per)
        if g_next < count:
            cuts = np.searchsorted(pending[:, 0], np.arange(g_next, count), side="right")
            yield from self._cut(pending, g_next, cuts.tolist(), B, L)

    def _cut(self, pending: np.ndarray, first: int, cuts: list[int], B: int, L: int) -> Iterator[np.ndarray]:
        """This worker's batches of batches ``first, first + 1, …``, whose pieces (``pending``, by
        batch) end at ``cuts``."""
        lo = 0
        for g, cut in enumerate(cuts, first):
            if self._mine(g):
                yield _encoded(pending[lo:cut, 1:], B, L)
            lo = cut

    def _by_tokens(self) -> Iterator[np.ndarray]:
        s = self.sampler
        W, r = self.world_size, self.rank
        batches = token_batches(s.order(self.epoch), s.lengths, self.position, s.token_budget, W)
        for g, batch in enumerate(batches):
            if not self._mine(g):
                continue
            rows = [[(doc, 0, n, n)] if n else [] for doc, n in batch[r::W]]
            rows += [[] for _ in range(math.ceil(len(batch) / W) - len(rows))]  # the epoch's last group: empty rows
            yield _encode(rows, max(n for _, n in batch))


class PackWalker:
    """Global batch ``b`` of epoch ``e`` of a packed plan for one rank (``batch_size`` rows of the
    epoch's row sequence, the epoch's last batch completed with empty rows), as encoded pieces
    for `PackBuilder`, in whatever order a dispatcher leases them: one forward walk over the
    epoch's rows (O(batch + bins) memory); a batch behind the walk (leased again after its server
    died), or ahead of a cursor further on than the walk, restarts the walk from the nearest
    cursor before it (`PackSampler.walk`), not from the epoch's start."""

    def __init__(self, sampler: Any):
        if getattr(sampler, "pack", None) is None or sampler.shard.world_size != 1:
            raise ConfigError("a PackWalker walks the packed rows of a plan for one rank")
        self.sampler = sampler
        self.epoch: int | None = None
        self._blocks: Iterator[tuple[int, np.ndarray]] = iter(())
        self._pending = np.zeros((0, PIECE), dtype=np.int64)  # pieces of rows walked, not yet served
        self._seen = 0  # rows the walk has passed
        self._next = 0  # the batch the walk stands before
        self.restarts = 0  # walks restarted for a batch behind the walk

    def batch(self, epoch: int, b: int) -> np.ndarray:
        s = self.sampler
        B = s.options.batch_size
        lo, hi = b * B, (b + 1) * B
        behind = epoch == self.epoch and b < self._next
        if epoch != self.epoch or behind or s.marks(epoch).best(lo).rows > self._seen:
            if behind:
                self.restarts += 1
                log.debug(
                    "packed batch %d of epoch %d is behind the walk (at %d): walking on from a cursor",
                    b,
                    epoch,
                    self._next,
                )
            self._seen, self._blocks = s.walk(epoch, lo)  # from the nearest cursor before the batch
            self.epoch, self._next = epoch, b
            self._pending = np.zeros((0, PIECE), dtype=np.int64)
        # pieces are in row order: the batch's start is a search and a view, not a mask and a copy
        # of what is left of the walk's block (blocks grow to thousands of rows: a copy of them per
        # batch cost more than the batch's build)
        pending = self._pending[int(np.searchsorted(self._pending[:, 0], lo)) :]
        parts = [pending]
        while self._seen < hi:
            got = next(self._blocks, None)
            if got is None:
                break
            rows, pieces = got
            self._seen += rows
            parts.append(pieces[int(np.searchsorted(pieces[:, 0], lo)) :])
        pending = np.concatenate(parts) if len(parts) > 1 else pending
        cut = int(np.searchsorted(pending[:, 0], hi))
        here, self._pending = pending[:cut], pending[cut:]
        self._next = b + 1
        rows = min(self._seen, hi) - lo
        if rows <= 0 or (rows < B and s.options.drop_last):
            self.epoch = None  # the walk is spent
            raise ConfigError(
                f"packed batch {b} of epoch {epoch} lies past the end of the epoch's rows here: serve the same "
                "dataset the dispatcher plans"
            )
        here = here.copy()
        here[:, 0] -= lo
        return _encoded(here, B, s.packing.length)


# ---- building a batch ---------------------------------------------------------------------------


class _Prefixes(dict):
    """``prefixes[n]``: the first ``n`` items of a row (``n · itemsize`` bytes of ``row``), a view
    made on first use and kept (the first ``KEEP`` lengths asked for), so that a batch's padding
    and position slices are dict lookups in one ``map``, not a slice each."""

    KEEP = 1 << 13  # views kept (~1.5 MB): every length of a row of up to 8,191

    def __init__(self, row: bytes, itemsize: int):
        super().__init__()
        self.row, self.itemsize = memoryview(row), itemsize

    def __missing__(self, n: int) -> memoryview:
        got = self.row[: n * self.itemsize]
        if len(self) < self.KEEP:
            self[n] = got
        return got


class PackBuilder:
    """Stage 4 for token datasets: an encoded batch of the plan → ``{feature: (rows, width),
    segment_ids, positions}`` dense arrays.

    Records of crossfeed's own token layout, checked once per process (`TokenShards`), are cut
    straight out of the mapped shards: the batch is built in one pass over its pieces and its
    rows' padding (`_sliced`: a ``bytearray.join`` of slices per feature, no step per row or
    token). Any other record is read once (CRC-checked by the Loader's frame reader) and
    decoded, its values laid end to end and placed row by row (`_built`); each document's
    length must be the one the plan used (a lengths file that lies is named)."""

    def __init__(self, inner, features: list[Feature], lengths: DocLengths, pad_id: int = 0, segments: bool = True):
        self.inner, self.lengths, self.pad_id, self.segments = inner, lengths, pad_id, segments
        self.reader, self.budget = inner.reader, inner.budget
        self.features = [(f.name, np.dtype(f.dtype)) for f in features]
        self._token_bytes = sum(d.itemsize for _, d in self.features)  # a token's bytes, every feature's
        self.return_index = False
        self.transform = self.batch_transform = None
        self.post = inner.batch_transform
        self.epoch = 0  # the epoch of untagged batches (`Pipeline.set_epoch`)
        self._shards: TokenShards | None | bool = False  # the fast path's checked shards (False: not looked at)
        self._pads: dict[tuple[str, int], _Prefixes] = {}  # `_pad`, `_positions`
        self._up = np.zeros(0, dtype=np.int64)  # `_count`

    @property
    def alloc(self):
        return self.inner.alloc

    @alloc.setter
    def alloc(self, value) -> None:  # a worker process's shared memory
        self.inner.alloc = value

    @property
    def meter(self):
        """The inner builder's stage meter (it reads and decodes the documents: its stages are timed)."""
        return self.inner.meter

    @meter.setter
    def meter(self, value) -> None:
        self.inner.meter = value

    def _where(self, doc: int) -> str:
        """Names a document's record: its shard and offset (a mixture's: its source too)."""
        return self.reader.where(doc)

    def _fast(self, docs: np.ndarray, tick) -> tuple[np.ndarray, memoryview] | None:
        """The value offsets of documents ``docs`` in the bytes of their checked shards
        (`TokenShards`), and those bytes; None: the general way."""
        if self._shards is False:
            self._shards = TokenShards.of(self.reader, self.lengths, [n for n, _ in self.features])
        if not isinstance(self._shards, TokenShards):  # None: not this layout
            return None
        return self._shards.at(docs)

    def _decoded(self, ids: np.ndarray, planned: np.ndarray, tick) -> tuple[list[list], np.ndarray]:
        """``(per feature each kept document's values, kept)`` by the Loader's reader and
        decoder, each decoded length checked against the plan's."""
        batch, kept = self.reader(ids, self.budget, tick)
        out = []
        for name, dtype in self.features:
            col = batch[name]
            values = [np.ravel(v) for v in col]
            sizes = np.fromiter((v.size for v in values), dtype=np.int64, count=len(values))
            bad = np.flatnonzero(sizes != planned[kept])
            if len(bad):
                doc, j = int(ids[kept[bad[0]]]), int(bad[0])
                raise IndexFileError(
                    f"{self._where(doc)}: feature {name!r} has {int(sizes[j])} values, but the plan used length "
                    f"{int(planned[kept[j]])} from {self.lengths.where(doc)}; the lengths do not belong to these "
                    f"records: write the lengths files again"
                )
            out.append([v.astype(dtype, copy=False) for v in values])
        return out, kept

    def __call__(
        self, encoded: np.ndarray, timings: dict[str, float] | None = None, tally=None
    ) -> dict[str, np.ndarray]:
        if timings is not None and tally is None:  # timed apart (`crossfeed bench`), as `BatchBuilder` is
            return timed_apart(self, encoded, timings)
        meter = self.inner.meter
        tick = tally if tally is not None or meter is None else meter.tally()
        rows, width = int(encoded[0]), int(encoded[1])
        pieces = np.asarray(encoded[HEADER:], dtype=np.int64).reshape(-1, PIECE)
        if tick is not None:
            tick.start = tick.last = time.perf_counter_ns()
        fast = self._fast(pieces[:, 1], tick)  # (each piece's document's value offsets, their bytes)
        total = int(pieces[:, 3].sum()) if fast is not None else 0  # the batch's tokens
        if fast is not None and tick is not None:  # the read: the checked shards' offsets looked up
            tick.bytes += total * self._token_bytes
            tick.tick("read")
        if fast is not None:
            out = self._sliced(pieces, rows, width, fast, tick, total)
            alloc = self.inner.alloc
            if alloc is not None:  # the batch arrays made by `alloc` (a worker's shared memory): copied in
                dtypes = dict(self.features)
                for name, a in out.items():
                    made = alloc(a.shape, dtypes.get(name, a.dtype))
                    made[...] = a
                    out[name] = made
        else:
            out = self._built(pieces, rows, width, tick)
        if self.post is not None:  # its generator (a transform taking rng) keyed by the batch's tagged step
            out = call_batch_transform(
                self.post, out, self.inner.recipe, epoch_of(encoded, self.epoch), step_of(encoded)
            )
            if tick is not None:
                tick.tick("transform")
        return out

    def _sliced(self, pieces: np.ndarray, rows: int, width: int, fast, tick, total: int) -> dict[str, np.ndarray]:
        """The batch of ``pieces`` (row by row, each row's from column 0) cut from the checked
        shards' bytes: per feature one ``bytearray.join`` of the pieces' slices, each row's padding
        (a run of ``pad_id``) after its pieces, so the joined bytes are the batch (a batch of full
        rows: the pieces alone); positions joined the same way from runs of 0, 1, 2, … (padding:
        0); segment ids one ``np.repeat`` of each piece's number in its row (padding: 0)."""
        offsets, view = fast
        n = len(pieces)
        up = self._count(n + rows)  # 0, 1, 2, …
        row, start, count = pieces[:, 0], pieces[:, 2], pieces[:, 3]
        full = total == rows * width  # every row full (no row holds more): no padding
        if not full:
            gap = (width - np.bincount(row, count, rows)).astype(np.int64)  # each row's padding
            # the pieces and padding entries laid row by row: piece i at i + its row, row r's
            # padding after its pieces (at r + the pieces of rows 0 .. r)
            moved = up[:n] + row
            pads = np.bincount(row, minlength=rows).cumsum() + up[:rows]
            m = n + rows
            counts = np.empty(m, dtype=np.int64)
            counts[moved], counts[pads] = count, gap
            # the slices are made pieces first, then the rows' padding, and put in that order by
            # one C call (`itemgetter`; one more entry, so that it always gives a tuple)
            place = np.empty(m, dtype=np.int64)
            place[moved], place[pads] = up[:n], up[n:m]
            laid = operator.itemgetter(*place.tolist(), m)
            gaps = gap.tolist()
        out = {}
        for i, (name, dtype) in enumerate(self.features):
            size = dtype.itemsize
            lo = offsets[:, i] + start * size
            cut: Any = map(view.__getitem__, map(slice, lo.tolist(), (lo + count * size).tolist()))
            if not full:
                cut = laid([*cut, *map(self._pad(dtype, width).__getitem__, gaps), b""])
            out[name] = np.frombuffer(bytearray().join(cut), dtype.newbyteorder("<")).reshape(rows, width)
        if tick is not None:  # the decode: the slices joined
            tick.tick("decode")
        if self.segments:
            number = up[1 : n + 1] - row.searchsorted(row)  # each piece's number in its row, from 1
            if full:
                seg = number.astype(np.int32).repeat(count)
            else:
                seg_of = np.zeros(m, dtype=np.int32)  # padding: segment 0
                seg_of[moved] = number
                seg = seg_of.repeat(counts)
            # positions: each piece's 0, 1, 2, … and its row's padding's zeros, joined as the tokens are
            ramps, zeros = self._positions(width)
            cut = map(ramps.__getitem__, count.tolist())
            if not full:
                cut = laid([*cut, *map(zeros.__getitem__, gaps), b""])
            pos = np.frombuffer(bytearray().join(cut), np.int32)
            out[SEGMENT_IDS], out[POSITIONS] = seg.reshape(rows, width), pos.reshape(rows, width)
        if tick is not None:
            tick.tick("batch")
        return out

    def _count(self, n: int) -> np.ndarray:
        """``0, 1, 2, …`` (int64, read only) of at least ``n + 1`` numbers, made once (grown as needed)."""
        if len(self._up) <= n:
            self._up = np.arange(max(2 * n, 1024), dtype=np.int64)
            self._up.flags.writeable = False
        return self._up

    def _built(self, pieces: np.ndarray, rows: int, width: int, tick) -> dict[str, np.ndarray]:
        """The batch of ``pieces`` by the general way (records read and decoded)."""
        ids, first = np.unique(pieces[:, 1], return_index=True)
        values, kept = self._decoded(ids, pieces[first, 4], tick)
        slot = np.full(len(ids), -1, dtype=np.int64)  # a document's place among the kept ones
        slot[kept] = np.arange(len(kept))
        at = slot[np.searchsorted(ids, pieces[:, 1])]
        if not (at >= 0).all():  # pieces of documents dropped under on_error="skip": padding
            pieces, at = pieces[at >= 0], at[at >= 0]
        row, start, count = pieces[:, 0], pieces[:, 2], pieces[:, 3]
        # each row's tokens, its pieces end to end, then all rows end to end: one flat array per
        # feature (pieces come row by row, each row's from column 0)
        total = int(count.sum())
        full = total == rows * width  # every row full (no row holds more): the flat arrays are the batch
        alloc = self.inner.alloc
        direct = full and alloc is None  # ... taken as they are, no copy
        alloc = alloc or np.empty
        if not full:
            fill = np.bincount(row, weights=count, minlength=rows).astype(np.int64)
            cuts = np.concatenate([[0], np.cumsum(fill)]).tolist()

        def place(flat: np.ndarray, dtype, pad) -> np.ndarray:
            if direct:
                return flat.reshape(rows, width)
            a = alloc((rows, width), dtype)
            if full:
                a.reshape(-1)[:] = flat
                return a
            a[...] = pad
            for r, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
                if hi > lo:
                    a[r, : hi - lo] = flat[lo:hi]
            return a

        out = {}
        at_l, start_l, stop_l = at.tolist(), start.tolist(), (start + count).tolist()
        for (name, dtype), docs in zip(self.features, values):
            parts = [docs[k][a:b] for k, a, b in zip(at_l, start_l, stop_l)]
            out[name] = place(
                np.concatenate(parts or [np.zeros(0, dtype)]).astype(dtype, copy=False), dtype, self.pad_id
            )
        if self.segments:
            out[SEGMENT_IDS], out[POSITIONS] = self._segments(row, count, total, place)
        if tick is not None:
            tick.tick("batch")
        return out

    def _pad(self, dtype: np.dtype, width: int) -> _Prefixes:
        """Runs of ``pad_id`` in ``dtype`` (little-endian bytes) of up to ``width``, made once."""
        key = (dtype.str, width)
        got = self._pads.get(key)
        if got is None:
            got = self._pads[key] = _Prefixes(
                np.full(width, self.pad_id, dtype.newbyteorder("<")).tobytes(), dtype.itemsize
            )
        return got

    def _positions(self, width: int) -> tuple[_Prefixes, _Prefixes]:
        """Runs ``0, 1, 2, …`` and ``0, 0, …`` of up to ``width`` int32 (a piece's positions, and
        padding's), made once."""
        key = ("positions", width)
        got = self._pads.get(key)
        if got is None:
            got = self._pads[key] = _Prefixes(np.arange(width, dtype=np.int32).tobytes(), 4)
            self._pads[("zeros", width)] = _Prefixes(bytes(4 * width), 4)
        return got, self._pads[("zeros", width)]

    @staticmethod
    def _segments(row: np.ndarray, count: np.ndarray, total: int, place) -> tuple[np.ndarray, np.ndarray]:
        """``(segment_ids, positions)`` of pieces ``(row, count)`` laid row by row, each put in
        the batch by ``place``."""
        new_row = np.empty(len(row), dtype=bool)
        new_row[:1] = True
        np.not_equal(row[1:], row[:-1], out=new_row[1:])
        idx = np.arange(len(row))
        row_first = np.maximum.accumulate(np.where(new_row, idx, 0))
        seg_of = (idx - row_first + 1).astype(np.int32)
        before = (np.cumsum(count) - count).astype(np.int32)
        seg = np.repeat(seg_of, count)
        ramp = np.arange(total, dtype=np.int32)
        ramp -= np.repeat(before, count)
        return place(seg, np.int32, 0), place(ramp, np.int32, 0)


# ---- the Loader's wiring ------------------------------------------------------------------------


def read_names(options: LoaderOptions, datasets) -> tuple[str, ...] | None:
    """The features a token Loader reads: ``pack``'s, or for ``batch_by_tokens`` those asked
    for (default: the first dataset's lengths features); None: not a token Loader."""
    plan = options.plan
    if plan.pack is not None:
        if options.features is not None and tuple(options.features) != plan.pack.features:
            raise ConfigError(
                f"features={list(options.features)} with pack=: packed batches hold the pack's features "
                f"{list(plan.pack.features)} (and segment_ids, positions); leave features= out"
            )
        return plan.pack.features
    if plan.batch_by_tokens is not None:
        if options.features is not None:
            return tuple(options.features)
        listed = tuple(getattr(datasets[0].manifest, "lengths", ()) or ())
        if not listed:
            raise ConfigError(
                f"batch_by_tokens= needs to know which feature holds the tokens: {datasets[0].path} lists no "
                f"lengths features; pass features=['tokens'] (its first feature is counted)"
            )
        return listed
    return None


def check_token_batch(plan, features) -> None:
    """Before the first batch, where the dataset is known: ``pack.pad_id`` must fit every packed
    feature's dtype (70000 or -1 in uint16 tokens would wrap or overflow), and one packed batch
    (``batch_size`` rows of ``length``, every feature plus int32 segment ids and positions) must
    fit in this machine's memory. Raises `ConfigError` naming the option and the bound."""
    if plan.pack is None:
        return
    pad = plan.pack.pad_id
    for f in features:
        dtype = np.dtype(f.dtype)
        if dtype.kind in "iu":
            lo, hi = int(np.iinfo(dtype).min), int(np.iinfo(dtype).max)
            if not lo <= pad <= hi:
                raise ConfigError(
                    f"pack pad_id={pad} does not fit feature {f.name!r} ({dtype.name}: {lo} to {hi:,}); "
                    f"pick a pad_id in that range"
                )
    per_token = sum(np.dtype(f.dtype).itemsize for f in features) + 8 * plan.pack.segments  # + segment_ids, positions
    need = plan.batch_size * plan.pack.length * per_token
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not known here: the option bounds stand alone
        return
    if memory > 0 and need > memory:
        raise ConfigError(
            f"batch_size={plan.batch_size:,} packed rows of length={plan.pack.length:,} take {need:,} bytes a "
            f"batch, more than this machine's {memory:,} bytes of memory; lower batch_size or the pack length"
        )


def token_stages(sampler, builder, splits, stored: list[list[Feature]], features, options: LoaderOptions):
    """``(PackSampler, PackBuilder)`` over a pipeline's document `Sampler` and `BatchBuilder`:
    the stages of a token pipeline (``pack=`` or ``batch_by_tokens=``), satisfying the same
    contracts (`crossfeed.read.pipeline.SamplerLike`, `Builder`)."""
    plan = options.plan
    what = "pack=" if plan.pack is not None else "batch_by_tokens="
    if builder.transform is not None:
        raise ConfigError(
            f"{what} plans from the stored lengths, which a per-sample transform could change; "
            f"use batch_transform= (it gets the packed batch)"
        )
    if options.return_index:
        raise ConfigError(f"return_index=True is not available with {what}: a row holds pieces of several records")
    for f in features:
        if not f.codec.dense or len(f.shape) != 1:
            raise ConfigError(
                f"{what} feature {f.name!r} ({f.encoding.value}, shape {list(f.shape)}) is not a list of numbers; "
                f"{what} reads one-dimensional token features (of any length)"
            )
    check_token_batch(plan, features)
    skip = plan.skip
    skipped = None
    if skip is not None and len(skip.samples):  # skipped documents: length 0 in the plan (`DocLengths`)
        starts = np.concatenate([[0], np.cumsum([len(sp) for sp in splits])]).astype(np.int64)
        skipped = skip.ids(starts, [str(sp.dataset.path) for sp in splits])
    lengths = DocLengths(splits, [st[0].name for st in stored], skipped)
    pad = plan.pack.pad_id if plan.pack is not None else 0
    segments = plan.pack is None or plan.pack.segments
    return PackSampler(sampler, lengths, options), PackBuilder(builder, features, lengths, pad, segments)
