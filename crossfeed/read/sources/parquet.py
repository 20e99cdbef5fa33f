"""Stages 2 and 3 of the read pipeline for Parquet files read in place.

    global sample indices ──► ParquetFrameReader ──► ColumnFrames ──► ParquetDecoder ──► batch
    (global row numbers)      (row groups decoded      (the batch's     (images decoded;   dict[str, np.ndarray]
                               by pyarrow, selected     rows, one array  the rest as is)
                               columns only, kept in    per feature)
                               a small LRU; rows
                               gathered with numpy)

A sample index is a global row number: the rows of the split's files in manifest order. The plan
is the TFRecord one (`crossfeed.read.stages.sampler`); its block shuffle windows over row groups (the
split's `block_counts`), so a window of row groups is decoded once and served from the LRU, and a
global shuffle of a split whose decoded row groups fit the LRU decodes each one once — once all
of them are decoded they become whole-split columns, and a batch is one numpy take per column.
A global shuffle of a split larger than the LRU decodes a row group for every few rows it takes
from it: use the block shuffle there.

Each file is checked when opened: its byte size and its footer's row groups must be what the
manifest says (a file rewritten after ``crossfeed index`` is refused; ``crossfeed verify`` also
compares its sha256). Page CRCs are checked wherever the writer stored them. pyarrow is imported
on first use. Files adopted with ``--index-dir`` are read where they lie (the manifest's
``data_root``): a local directory, or an fsspec URL whose files pyarrow reads through fsspec's
file objects (range requests: the footer, then each row group's column chunks).

Arrow IPC files (``*.arrow``: Hugging Face ``datasets``' ``save_to_disk`` and cache files) are read
the same way through `crossfeed.format.hf.ArrowFile`: each record batch is a row group, a local
file is memory-mapped (its batches are views of the file's pages), a remote one fetched whole.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from crossfeed.errors import CorruptRecordError, CrossfeedError, DatasetNotFoundError, SchemaError
from crossfeed.format.hf import open_columnar
from crossfeed.format.parquet import column_maps, feature_columns, pyarrow_modules, source_columns
from crossfeed.format.schema import Feature, ImageFit, decode_image


class Split(Protocol):
    """What a Parquet reader reads of a `crossfeed.read.sources.dataset.Split` (a protocol: the
    dataset module imports this one, so this one does not import it)."""

    @property
    def name(self) -> str: ...
    @property
    def shards(self) -> Sequence: ...
    @property
    def dataset(self) -> Any: ...

    def file(self, shard: int) -> Any: ...
    def __len__(self) -> int: ...


log = logging.getLogger(__name__)

ROW_GROUP_CACHE_BYTES = 512 << 20  # decoded row groups a reader keeps (by their Arrow size) ...
ROW_GROUP_CACHE_MIN = 2  # ... and at least this many, however large
READ_CHUNK_BYTES = 1 << 20  # a row group is decoded this many (uncompressed) bytes at a time


def _selected(pf, columns: Sequence[str], where: str):
    """The Arrow schema of the ``columns`` of a file."""
    pa, _ = pyarrow_modules()
    try:
        return pa.schema([pf.schema_arrow.field(c) for c in columns])
    except KeyError as e:
        raise SchemaError(
            f"{where}: no column {e}; the file has {pf.schema_arrow.names}: it changed after `crossfeed index`; "
            f"re-index with --force"
        ) from None


def footer_mismatch(pf, info) -> str | None:
    """Why an open file's footer is not the one indexed (its row groups' rows differ from the
    manifest's ``info.row_groups``), or None."""
    md = pf.metadata
    rows = tuple(md.row_group(r).num_rows for r in range(md.num_row_groups))
    if rows == tuple(info.row_groups or ()):
        return None
    return (
        f"its footer has row groups of {list(rows)[:8]} rows, the manifest says {list(info.row_groups or ())[:8]}: "
        f"it changed after `crossfeed index`; re-index with `crossfeed index --force`"
    )


class ParquetFiles:
    """The Parquet files of a split, each opened once (thread-safe) and checked against the
    manifest; row groups are numbered across the split (``g``), in manifest order."""

    def __init__(self, split: Split):
        self.split = split
        self.storage = split.dataset.storage  # where the files lie: local, or an fsspec URL (range reads)
        self.paths = [split.file(s).path for s in range(len(split.shards))]
        groups = [np.asarray(sh.row_groups or (), dtype=np.int64) for sh in split.shards]
        self.counts = np.concatenate(groups) if groups else np.zeros(0, np.int64)  # rows of each row group
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)  # first global row of each
        self.shard = np.repeat(np.arange(len(groups)), [len(g) for g in groups])  # file of each row group
        self.local = np.concatenate([np.arange(len(g)) for g in groups]) if groups else np.zeros(0, np.int64)
        self._files: list = [None] * len(self.paths)
        self._sources: list = [None] * len(self.paths)  # the fsspec file objects of remote files
        self._locks = [threading.Lock() for _ in self.paths]
        self._last: tuple | None = None  # ((g, feature names), columns) of `row`'s last row group
        self.maps = column_maps(split.dataset.manifest.metadata)  # features read as codes, masks ...

    def group_of(self, i: int) -> tuple[int, int]:
        """``(g, row within it)`` of global row ``i``."""
        g = int(np.searchsorted(self.starts, i, side="right") - 1)
        return g, int(i - self.starts[g])

    def where(self, i: int) -> str:
        g, k = self.group_of(i)
        return f"{self.paths[self.shard[g]]}: row group {int(self.local[g])}, row {k} (sample {int(i)})"

    def read(self, g: int, features: Sequence[Feature]) -> tuple[dict[str, np.ndarray], int]:
        """Row group ``g``'s columns as the batch form of ``features`` (`column_values`), and
        their decoded size in bytes (Arrow's)."""
        pa, _ = pyarrow_modules()
        s, r = int(self.shard[g]), int(self.local[g])
        pf = self._open(s)
        where = f"{self.paths[s]}: row group {r}"
        meta = pf.metadata.row_group(r)
        # in chunks of about READ_CHUNK_BYTES: nested columns (lists) decode faster than in one piece
        chunk = int(max(64, min(1 << 20, READ_CHUNK_BYTES * max(1, meta.num_rows) // max(1, meta.total_byte_size))))
        columns = source_columns(features, self.maps)
        schema = _selected(pf, columns, where)
        with self._locks[s]:  # a ParquetFile is not documented thread-safe
            try:
                parts = pf.iter_batches(batch_size=chunk, row_groups=[r], columns=columns, use_threads=True)
                table = pa.Table.from_batches(list(parts), schema=schema)
            except (pa.ArrowException, OSError) as e:  # a page CRC mismatch, damaged compression ...
                raise CorruptRecordError(
                    self.paths[s], self.offset(pf, r), f"row group {r} does not decode: {e}"
                ) from e
        if table.num_rows != self.counts[g]:
            raise CorruptRecordError(
                self.paths[s], self.offset(pf, r), f"row group {r} holds {table.num_rows} rows, not {self.counts[g]}"
            )
        try:
            cols = feature_columns(table, features, self.maps, where)
            return cols, int(table.nbytes)
        except (pa.ArrowException, KeyError) as e:
            raise SchemaError(f"{where}: {e}; re-index the files with `crossfeed index --force`") from e

    @staticmethod
    def offset(pf, r: int) -> int:
        """The byte offset of row group ``r``'s first page (where errors point)."""
        col = pf.metadata.row_group(r).column(0)
        return int(col.dictionary_page_offset or col.data_page_offset or 0)

    def _open(self, s: int):
        pf = self._files[s]
        if pf is not None:
            return pf
        pa, pq = pyarrow_modules()
        with self._locks[s]:
            if self._files[s] is None:
                path, info = self.paths[s], self.split.shards[s]
                try:
                    size = self.storage.size(info.file)
                except DatasetNotFoundError as e:
                    raise CorruptRecordError(path, 0, "Parquet file is missing; restore it or re-index") from e
                if size != info.num_bytes:
                    raise CorruptRecordError(
                        path,
                        0,
                        f"file is {size} bytes, the manifest says {info.num_bytes}: it changed after "
                        f"`crossfeed index`; re-index with `crossfeed index --force`",
                    )
                # a local file by its path (pyarrow reads it itself); a remote one through fsspec
                source = self.storage.open(info.file) if self.storage.remote else path
                try:
                    pf = open_columnar(source, path)  # an Arrow IPC file (HF datasets') by its name
                    changed = footer_mismatch(pf, info)
                except (pa.ArrowException, OSError) as e:
                    _close(source)
                    raise CorruptRecordError(path, 0, f"not a readable Parquet file ({e})") from e
                if changed:
                    pf.close()
                    _close(source)
                    raise CorruptRecordError(path, 0, changed)
                self._files[s], self._sources[s] = pf, source
        return self._files[s]

    def row(self, shard: int, k: int, features: Sequence[Feature], *, decode_images: bool = True) -> dict:
        """Sample ``k`` of file ``shard`` (what ``split[i]`` returns: values as one record's)."""
        g0 = int(np.searchsorted(self.shard, shard))
        g, j = self.group_of(int(self.starts[g0]) + k)
        key = (g, tuple(f.name for f in features))
        last = self._last  # the row group read last: iterating a split reads each once
        if last is None or last[0] != key:
            last = self._last = (key, self.read(g, features)[0])
        cols = last[1]
        out = {}
        for f in features:
            v = cols[f.name][j]
            if f.codec.image:
                v = decode_image(v, f) if decode_images else v
            elif not f.codec.text and not isinstance(v, np.ndarray):
                v = np.asarray(v)
            out[f.name] = v
        return out

    def close(self) -> None:
        self._last = None
        for s, pf in enumerate(self._files):
            if pf is not None:
                pf.close()
                _close(self._sources[s])
                self._files[s] = self._sources[s] = None


def _close(source) -> None:
    """Close what `ParquetFiles` opened itself (a remote file object; a local path is pyarrow's)."""
    if not isinstance(source, str):
        source.close()


class RowGroupCache:
    """Decoded row groups, least recently used out first once over ``max_bytes`` (but at least
    ``min_groups`` kept); each loaded once even when threads ask for it together."""

    def __init__(self, max_bytes: int = ROW_GROUP_CACHE_BYTES, min_groups: int = ROW_GROUP_CACHE_MIN):
        self.max_bytes, self.min_groups = max_bytes, min_groups
        self._items: OrderedDict[int, tuple[dict, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._loading: dict[int, threading.Lock] = {}
        self.loads = 0  # how many row groups were decoded (a test and the benchmark read it) ...
        self.evictions = 0  # ... and dropped to make room

    def get(self, g: int, load: Callable[[int], tuple[dict, int]]) -> dict:
        with self._lock:
            got = self._items.get(g)
            if got is not None:
                self._items.move_to_end(g)
                return got[0]
            gate = self._loading.setdefault(g, threading.Lock())
        with gate:
            with self._lock:
                got = self._items.get(g)
                if got is not None:
                    return got[0]
            cols, size = load(g)
            with self._lock:
                self.loads += 1
                self._items[g] = (cols, size)
                self._bytes += size
                while len(self._items) > self.min_groups and self._bytes > self.max_bytes:
                    _, (_, old) = self._items.popitem(last=False)
                    self._bytes -= old
                    self.evictions += 1
                self._loading.pop(g, None)
        return cols

    def __len__(self) -> int:
        return len(self._items)

    def replace(self, items: dict[int, dict]) -> None:
        """Hold ``items`` (``{g: columns}`` of row groups held now) instead of their columns."""
        with self._lock:
            for g, cols in items.items():
                if g in self._items:
                    self._items[g] = (cols, self._items[g][1])

    def snapshot(self) -> dict[int, dict]:
        """``{g: columns}`` of the row groups held now."""
        with self._lock:
            return {g: cols for g, (cols, _) in self._items.items()}

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0


@dataclasses.dataclass
class ColumnFrames:
    """The rows of one batch, column by column: ``indices`` (global rows; under ``on_error`` the
    rows of a row group that did not decode are gone) and ``columns`` (feature → batch array)."""

    indices: np.ndarray
    columns: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.indices)


class ParquetFrameReader:
    """Stage 2 for Parquet: global rows → `ColumnFrames`. Thread-safe."""

    rows = False  # the frame reader's small-record form does not apply: batches are built in threads
    cache = None  # no shard cache: local files are read in place, remote ones by range (fsspec)

    def __init__(self, split: Split, features: Sequence[Feature], *, cache: RowGroupCache | None = None):
        self.split = split
        self.features = tuple(features)
        self.files = ParquetFiles(split)
        self.groups = cache or RowGroupCache()
        self._whole: dict[str, np.ndarray] | None = None  # the split's columns, once every row group is decoded
        self._lock = threading.Lock()
        self._served = 0  # rows gathered from decoded row groups (to notice a cache that thrashes)
        self._warned = False

    def _split_columns(self) -> dict[str, np.ndarray] | None:
        """The whole split's columns, once the LRU holds every row group (a small split): then a
        batch is one take per column, whatever the shuffle. The LRU then holds views of them."""
        if self._whole is None and len(self.groups) == len(self.files.counts):
            with self._lock:
                parts = self.groups.snapshot()
                if self._whole is None and len(parts) == len(self.files.counts):
                    cols = [parts[g] for g in range(len(parts))]
                    whole = {f.name: np.concatenate([c[f.name] for c in cols]) for f in self.features}
                    st = self.files.starts
                    self.groups.replace({g: {k: v[st[g] : st[g + 1]] for k, v in whole.items()} for g in parts})
                    self._whole = whole
        return self._whole

    @property
    def split_columns(self) -> dict[str, np.ndarray] | None:
        """The whole split's decoded columns, once built (see `_split_columns`), else None."""
        return self._whole

    def clear(self) -> None:
        """Drop every decoded row group (the next batches decode afresh)."""
        with self._lock:
            self._whole = None
            self.groups.clear()

    def where(self, i: int) -> str:
        return self.files.where(int(i))

    def __call__(self, indices, on_error: Callable[[CrossfeedError], None] | None = None) -> ColumnFrames:
        indices = np.asarray(indices, dtype=np.int64)
        self._served += len(indices)
        whole = self._whole if self._whole is not None else self._split_columns()
        if whole is not None:
            return ColumnFrames(indices, {k: v[indices] for k, v in whole.items()})
        n = len(indices)
        g = np.searchsorted(self.files.starts, indices, side="right") - 1
        local = indices - self.files.starts[g]
        if n == 0 or g[0] == g[-1] and (g == g[0]).all():  # one row group (block shuffle, file order): one take
            cols = self._group(int(g[0]), on_error) if n else {}
            if cols is None:
                return ColumnFrames(indices[:0], {f.name: self._empty(f, 0) for f in self.features})
            return ColumnFrames(
                indices, {f.name: cols[f.name][local] if n else self._empty(f, 0) for f in self.features}
            )
        out = {f.name: self._empty(f, n) for f in self.features}
        order = np.argsort(g, kind="stable")
        sorted_g = g[order]
        cuts = (np.flatnonzero(sorted_g[1:] != sorted_g[:-1]) + 1).tolist()  # where each row group's rows start
        dropped = []
        for lo, hi in zip([0, *cuts], [*cuts, n]):
            m = order[lo:hi]
            cols = self._group(int(sorted_g[lo]), on_error)
            if cols is None:
                dropped.append(m)
                continue
            lm = local[m]
            for k, v in cols.items():
                out[k][m] = v[lm]
        if not self._warned and self.groups.evictions >= 16:
            self._check_thrash()
        if dropped:
            keep = np.ones(n, dtype=bool)
            keep[np.concatenate(dropped)] = False
            return ColumnFrames(indices[keep], {k: v[keep] for k, v in out.items()})
        return ColumnFrames(indices, out)

    def _check_thrash(self) -> None:
        """Warn once when decoded row groups serve a small part of their rows before they are
        evicted: a global shuffle of a split larger than the row-group cache."""
        per_group = len(self.split) / max(1, len(self.files.counts))
        if self._served < 0.25 * self.groups.loads * per_group:
            self._warned = True
            log.warning(
                "%s split %r: each decoded Parquet row group served %.1f of its %.0f rows on average before the "
                "row-group cache (%d MiB) dropped it, so most of the decoding is wasted: a global shuffle of a split "
                "larger than the cache decodes a row group for every few rows. Use shuffle='block' (each row group "
                "decoded once per epoch) or write smaller row groups.",
                self.split.dataset.path,
                self.split.name,
                self._served / self.groups.loads,
                per_group,
                self.groups.max_bytes >> 20,
            )

    def _group(self, g: int, on_error) -> dict | None:
        try:
            return self.groups.get(g, lambda g: self.files.read(g, self.features))
        except (CorruptRecordError, SchemaError) as e:
            if on_error is None:
                raise
            on_error(e)  # its rows are dropped from this batch (and reported again by the next that needs them)
            return None

    @staticmethod
    def _empty(f: Feature, n: int) -> np.ndarray:
        if f.fixed and f.codec.dense:
            return np.empty((n, *f.fixed_shape), dtype=f.codec.dtype(f))
        return np.empty(n, dtype=object)

    def close(self) -> None:
        self.clear()
        self.files.close()


class ParquetDecoder:
    """Stage 3 for Parquet: `ColumnFrames` → ``(batch, kept)``. Columns are already in batch form;
    images (binary columns declared ``image``, or HF ``datasets.Image`` structs) are decoded here,
    one array per batch when every image of it has one shape."""

    columnar = False

    def __init__(self, features: Sequence[Feature], *, decode_images: bool = True, fit: ImageFit | None = None):
        self.features = tuple(features)
        self.decode_images = decode_images
        self.fit = fit  # images brought to one size and channel count as they are decoded (None: as stored)
        self._ragged = [f for f in self.features if f.codec.arrow == "tensor" and not f.fixed]

    def __call__(
        self,
        frames: ColumnFrames,
        *,
        where: Callable[[int], str] = str,
        on_error: Callable[[CrossfeedError], None] | None = None,
    ) -> tuple[dict[str, np.ndarray], np.ndarray]:
        batch = dict(frames.columns)
        n = len(frames)
        for f in self._ragged:  # rows of one shape in this batch: one array, as from TFRecords
            batch[f.name] = _stack(list(batch[f.name]))
        images = [f for f in self.features if f.codec.image] if self.decode_images else []
        if not images:
            return batch, np.arange(n)
        bad: set[int] = set()
        decoded = {}
        for f in images:
            out: list = [None] * n
            for j, data in enumerate(batch[f.name].tolist()):
                if j in bad:
                    continue
                try:
                    out[j] = decode_image(data, f, self.fit)
                except SchemaError as e:
                    err = SchemaError(f"{where(j)}: {e}")
                    if on_error is None:
                        raise err from e
                    on_error(err)
                    bad.add(j)
            decoded[f.name] = out
        kept = np.asarray([j for j in range(n) if j not in bad], dtype=np.int64)
        for k in batch:
            batch[k] = _stack([decoded[k][j] for j in kept.tolist()]) if k in decoded else batch[k][kept]
        return batch, kept


def _stack(images: list) -> np.ndarray:
    if images and all(im.shape == images[0].shape and im.dtype == images[0].dtype for im in images):
        return np.stack(images)
    out = np.empty(len(images), dtype=object)
    for i, im in enumerate(images):
        out[i] = im
    return out


VERIFY_NOTE = (
    "Parquet files: every page of the indexed columns was read and decoded and each file's sha256 compared with "
    "the manifest; page CRCs are checked only where the writer stored them (pyarrow writes them with "
    "write_page_checksum=True, most writers do not), and columns left out of the index are covered by the sha256 only"
)


def check_file(path: str, info, features: Sequence[Feature], maps: dict | None = None) -> list[tuple[int | None, str]]:
    """``(byte offset or None, reason)`` for every problem of one Parquet file of the manifest
    (``info``, a `crossfeed.format.manifest.ShardInfo`): the footer's row groups, then every row
    group's pages (CRCs where stored) decoded and checked against ``features`` (read through
    ``maps``, `crossfeed.format.parquet.column_maps`). Keeps going after a bad row group."""
    pa, pq = pyarrow_modules()
    try:
        pf = open_columnar(path, path)
    except (pa.ArrowException, OSError) as e:
        return [(0, f"not a readable Parquet file ({e})")]
    problems: list[tuple[int | None, str]] = []
    with pf:
        changed = footer_mismatch(pf, info)
        if changed:
            return [(None, changed)]
        for r in range(pf.metadata.num_row_groups):
            offset = ParquetFiles.offset(pf, r)
            try:
                table = pf.read_row_group(r, columns=source_columns(features, maps or {}), use_threads=False)
                feature_columns(table, features, maps or {}, f"row group {r}")
            except (pa.ArrowException, OSError, KeyError) as e:
                problems.append((offset, f"row group {r} does not decode: {e}"))
            except SchemaError as e:
                problems.append((offset, str(e)))
    return problems
