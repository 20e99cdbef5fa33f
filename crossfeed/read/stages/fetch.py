"""Stages 2 and 3 composed for one source or a mixture: global sample ids → ``(batch, kept)``,
the decoded batch (``dict[str, np.ndarray]``) and the positions of the ids that made it into it.

    ids ──► FrameReader / ParquetFrameReader ──► Frames ──► decoder ──► (batch, kept)
    a mixture of formats:  ids ──► per source: (batch, kept) ──► MixtureMerge ──► (batch, kept)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from time import perf_counter_ns as _clock
from typing import Any

import numpy as np

from crossfeed.format.schema import Feature
from crossfeed.io.cache import ShardCache
from crossfeed.read.options import ReadOptions
from crossfeed.read.sources.dataset import Split
from crossfeed.read.sources.parquet import ParquetDecoder, ParquetFrameReader
from crossfeed.read.stages.decode import make_decoder
from crossfeed.read.stages.frames import DeferredCrcError, FrameReader, Frames


class SourceReader:
    """Stages 2 and 3 for one split: global sample indices → ``(batch, kept)``, the decoded batch
    and the positions of the indices that made it into it (all, unless ``on_error`` dropped some)."""

    mixture = False  # ids are the split's own (``starts``: [0, N])

    def __init__(
        self,
        split: Split,
        features,
        *,
        read: ReadOptions,
        whole_shards: bool,
        keep_loaded: int | None,
        cache: ShardCache | None = None,
    ):
        # the decoder and the frame reader of the split's format (Parquet's take and give columns, the
        # others' records: the two pairs are not interchangeable, so neither attribute has one type)
        self.decoder: Any
        self.frames: Any
        self.starts = np.array([0, len(split)], dtype=np.int64)
        self._defer = False
        self._framed = split.info.format != "parquet"  # its frames are `Frames` (Parquet's: columns)
        if split.info.format == "parquet":  # row groups read in place (crossfeed.read.sources.parquet)
            self.decoder = ParquetDecoder(features, decode_images=read.decode_images, fit=read.image_fit)
            self.frames = ParquetFrameReader(split, features)
            return
        # batch arrays the consumer has dropped are reused: at most this many are in flight
        self.decoder = make_decoder(
            features,
            decode_images=read.decode_images,
            recycle=read.num_threads + read.prefetch + 4,
            shard_format=split.info.format,
            fit=read.image_fit,
        )
        self.frames = FrameReader(split, whole_shards=whole_shards, keep_loaded=keep_loaded, cache=cache)
        self.frames.rows = self.decoder.columnar and self.frames.small_records()
        # big records' payload CRCs are checked by the columnar decoder as it copies them
        self._defer = self.decoder.columnar and not self.frames.rows

    def where(self, i: int) -> str:
        """Where record ``i`` lies: its shard and byte offset."""
        return self.frames.where(int(i))

    def __call__(self, indices: np.ndarray, budget=None, tick=None) -> tuple[dict[str, np.ndarray], np.ndarray]:
        frames = self.frames(indices, on_error=budget, defer_crc=True) if self._defer else self.frames(indices, budget)
        if tick is not None:  # a `crossfeed.read.metrics.Tally`: read ends, decode begins
            rows = frames.rows if self._framed else None  # one matrix of rows: small records, the hot path
            tick.bytes += rows[0][1].size if rows is not None and len(rows) == 1 else payload_bytes(frames)
            now = _clock()
            tick.read += now - tick.last
            tick.n_read += 1
            tick.last = now
        try:
            batch, kept = self._decode(frames, budget)
        except DeferredCrcError:  # a corrupt record: the exact path names it (or drops it into the budget)
            frames = self.frames(indices, on_error=budget)
            batch, kept = self._decode(frames, budget)
        if tick is not None:
            now = _clock()
            tick.decode += now - tick.last
            tick.n_decode += 1
            tick.last = now
        if len(frames.indices) == len(indices):
            return batch, kept
        return batch, _positions(indices, frames.indices[kept])  # bad records were skipped (rare)

    def _decode(self, frames: Frames, budget):
        return self.decoder(frames, where=lambda j: self.frames.where(frames.indices[j]), on_error=budget)


def payload_bytes(frames) -> int:
    """The record payload bytes of a batch's frames (`Frames`: rows or buffers, a tar sample's
    members; Parquet's `ColumnFrames`: its columns) — a sum per row group or per record, for
    `crossfeed.read.metrics`."""
    rows = getattr(frames, "rows", None)
    if rows is not None:
        return rows[0][1].size if len(rows) == 1 else sum(m.size for _, m in rows)
    payloads = getattr(frames, "payloads", None)
    if payloads is not None:
        return sum(sum(map(len, p.values())) if isinstance(p, dict) else len(p) for p in payloads)
    total = 0
    for col in getattr(frames, "columns", {}).values():
        if isinstance(col, np.ndarray) and col.dtype != object:
            total += col.nbytes
        else:
            total += sum(len(v) for v in col if isinstance(v, (bytes, bytearray, memoryview, str)))
    return total


def _positions(indices: np.ndarray, kept_values: np.ndarray) -> np.ndarray:
    """Positions in ``indices`` of ``kept_values`` (a subsequence of distinct ``indices``; a batch
    may repeat an index only under padding, where the first occurrences are taken in order)."""
    out, j = [], 0
    vals = kept_values.tolist()
    for i, v in enumerate(indices.tolist()):
        if j < len(vals) and v == vals[j]:
            out.append(i)
            j += 1
    return np.asarray(out, dtype=np.int64)


class MixtureReader:
    """Stages 2 and 3 for a mixture: the batch's sample ids (global across sources, see
    `crossfeed.read.stages.sampler.MixtureOrder`) → ``(batch, kept)`` under the mixture's feature
    names. Two ways, chosen once by the Loader:

    * sources that store the same features in one shard format: their frames are merged back
      into batch order (rows of one length from several sources become one matrix) and decoded
      once by one decoder — or, local TFRecords, read in one pass over every shard (``union``);
    * any other mix (tar + TFRecord + Parquet, renamed features, shapes or dtypes that differ):
      each source's part is read and decoded by its own reader, and `MixtureMerge` puts the
      decoded parts back into batch order under the mixture's names.

    ``names``: ``{a source's name: the mixture's}`` applied to the batch of the first way (the
    sources rename alike there)."""

    mixture = True  # ids are global across the sources (``starts``)

    def __init__(
        self,
        readers: list[SourceReader],
        starts: np.ndarray,
        *,
        union: SourceReader | None = None,
        merge: MixtureMerge | None = None,
        names: dict[str, str] | None = None,
    ):
        """``union``: one reader over every source's shards (a `UnionSplit`; local sources),
        which reads a mixture batch in one pass — then ``readers`` may be empty."""
        self.readers, self.starts, self.union, self.merge = readers, starts, union, merge
        self.names = {k: v for k, v in (names or {}).items() if k != v} or None
        self.decoder: Any = merge or (union or readers[0]).decoder  # MixtureMerge, or one of SourceReader's
        if merge is not None:
            self.rows = False
        else:
            self.rows = union.frames.rows if union is not None else all(r.frames.rows for r in readers)

    def where(self, i: int) -> str:
        s = int(np.searchsorted(self.starts, i, side="right") - 1)
        if self.union is not None:
            return f"source {s}: {self.union.frames.where(int(i))}"
        return f"source {s}: {self.readers[s].frames.where(int(i - self.starts[s]))}"

    def __call__(self, ids: np.ndarray, budget=None, tick=None) -> tuple[dict[str, np.ndarray], np.ndarray]:
        if self.merge is not None:
            return self._decoded_parts(self.merge, ids, budget, tick)
        if self.union is not None:  # ids are the union's record ids: one read, one decode
            batch, kept = self.union(ids, budget, tick)
        else:
            batch, kept = self._merged_frames(ids, budget, tick)
        if self.names:
            batch = {self.names.get(k, k): v for k, v in batch.items()}
        return batch, kept

    def _decoded_parts(
        self, merge: MixtureMerge, ids: np.ndarray, budget, tick
    ) -> tuple[dict[str, np.ndarray], np.ndarray]:
        src = np.searchsorted(self.starts, ids, side="right") - 1
        parts = []  # (source, batch positions of its kept samples, its decoded batch)
        for s in np.unique(src).tolist():
            m = np.flatnonzero(src == s)
            batch, kept = self.readers[s](ids[m] - self.starts[s], budget, tick)
            parts.append((s, m[kept], batch))
        kept = np.sort(np.concatenate([p for _, p, _ in parts])) if parts else np.zeros(0, np.int64)
        out = merge(parts, kept, len(ids))
        if tick is not None:  # the merge: decode time (each source's decode counted it already)
            now = _clock()
            tick.decode += now - tick.last
            tick.last = now
        return out, kept

    def _merged_frames(self, ids: np.ndarray, budget, tick) -> tuple[dict[str, np.ndarray], np.ndarray]:
        src = np.searchsorted(self.starts, ids, side="right") - 1
        parts = []
        for s in np.unique(src).tolist():
            m = np.flatnonzero(src == s)
            local = ids[m] - self.starts[s]
            fr = self.readers[s].frames(local, on_error=budget)
            parts.append((m if len(fr.indices) == len(m) else m[_positions(local, fr.indices)], fr))
        kept = np.concatenate([p for p, _ in parts]) if parts else np.zeros(0, np.int64)
        order = np.argsort(kept, kind="stable")
        slot = np.empty(len(ids), dtype=np.int64)  # batch position → position among the kept records
        slot[kept[order]] = np.arange(len(kept))
        if all(fr.rows is not None for _, fr in parts):
            by_len: dict[int, list] = {}
            for p, fr in parts:
                for pos, mat in fr.rows:
                    by_len.setdefault(mat.shape[1], []).append((slot[p if pos is None else p[pos]], mat))
            rows: list[tuple[np.ndarray | None, np.ndarray]] = [
                (np.concatenate([q for q, _ in g]), np.concatenate([mt for _, mt in g])) for g in by_len.values()
            ]
            merged = Frames(ids[kept[order]], rows=rows)
        else:
            payloads: list = [None] * len(kept)
            for p, fr in parts:
                for j, v in zip(slot[p].tolist(), fr.as_payloads()):
                    payloads[j] = v
            merged = Frames(ids[kept[order]], payloads=payloads)
        if tick is not None:
            tick.bytes += payload_bytes(merged)
            tick.tick("read")
        batch, ok = self.decoder(merged, where=lambda j: self.where(int(merged.indices[j])), on_error=budget)
        if tick is not None:
            tick.tick("decode")
        return batch, kept[order][ok]


class MixtureMerge:
    """The decoded batches of a mixture's sources → one batch in batch order, under the mixture's
    feature names (``features``, each covering every source's definition: `mix_feature`).

    ``sources[i]``: source ``i``'s name of each of ``features``, in order. A feature whose parts
    are arrays of one item shape becomes one array (cast to the feature's dtype: an int32 label
    beside int64 ones); one whose shapes differ between sources (photos of different sizes)
    becomes a 1-D object array of per-sample values, as one source's would."""

    columnar = False

    def __init__(self, features: Sequence[Feature], sources: list[list[str]], *, decode_images: bool):
        self.features, self.sources, self.decode_images = tuple(features), sources, decode_images
        self.alloc: Callable[..., np.ndarray] | None = (
            None  # where dense batch arrays go (None: np.empty); a worker process's shared memory
        )

    def __call__(self, parts: list, kept: np.ndarray, n: int) -> dict[str, np.ndarray]:
        """``parts``: ``(source, sorted batch positions, its batch)``; ``kept``: every part's
        positions, sorted (the merged batch's rows, in order); ``n``: the batch's size."""
        row = np.empty(n, dtype=np.int64)  # batch position → row of the merged batch
        row[kept] = np.arange(len(kept))
        out = {}
        for j, f in enumerate(self.features):
            vals = [(row[pos], batch[self.sources[s][j]]) for s, pos, batch in parts]
            out[f.name] = self._column(f, vals, len(kept))
        return out

    def _column(self, f: Feature, vals: list, n: int) -> np.ndarray:
        arrays = [v for _, v in vals if len(v)]
        if arrays and all(
            isinstance(v, np.ndarray) and v.dtype != object and v.shape[1:] == arrays[0].shape[1:] for v in arrays
        ):
            dtype = arrays[0].dtype if f.codec.image else np.dtype(f.dtype)
            out = (self.alloc or np.empty)((n, *arrays[0].shape[1:]), dtype)
            for rows, v in vals:
                out[rows] = v  # a safe cast where a source stores a narrower dtype (`mix_feature`)
            return out
        if not arrays and f.fixed and f.codec.dense:
            return np.empty((0, *f.fixed_shape), np.dtype(f.dtype))
        cast = np.dtype(f.dtype) if f.codec.dense else None
        out = np.empty(n, dtype=object)
        for rows, v in vals:
            for r, item in zip(rows.tolist(), v):
                out[r] = item.astype(cast, copy=False) if cast is not None and isinstance(item, np.ndarray) else item
        return out
