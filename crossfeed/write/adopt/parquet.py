"""Adopting Parquet files written by anyone (pyarrow, pandas, HF ``datasets.to_parquet``, Spark) in
place: the row groups and their row counts come from each file's footer, the features from its
columns (`crossfeed.format.parquet`); nothing is rewritten and no index file is written.

`index_parquet` is what ``crossfeed index DIR`` runs on a directory of ``*.parquet`` files, and
of ``*.arrow`` Arrow IPC files (Hugging Face ``datasets`` folders, `crossfeed.format.hf.ArrowFile`:
each record batch a row group; their nulls are counted by reading, having no footer statistics). List
columns are read once to learn whether every row has the same length (then they are tensors of
that shape); declared columns (``--feature``) are read and checked in full; other columns are
known from the footer alone.

The manifest goes beside the files or, with ``--index-dir``, into a directory of its own
(`crossfeed.write.adopt.placement`; the files are then read where they lie: a read-only directory or
an fsspec URL, fetched whole once to be hashed and indexed). Beside the files, ``crossfeed.json``
is one more file in the directory: ``pyarrow.dataset(DIR)`` then fails on it (it is no Parquet
file); pass ``pyarrow.dataset`` the Parquet files themselves, or keep the directory Parquet-only
with ``--index-dir``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from crossfeed.errors import CorruptRecordError, SchemaError
from crossfeed.format import codecs
from crossfeed.format.hf import ArrowFile, is_arrow_name
from crossfeed.format.manifest import ShardInfo, SplitInfo
from crossfeed.format.parquet import (
    FORMAT,
    check_footer,
    column_values,
    footer_row_groups,
    infer_feature,
    is_categorical,
    is_float,
    list_dims,
    merge_dims,
    pyarrow_modules,
)
from crossfeed.format.schema import Feature, Schema
from crossfeed.write.adopt.lengths import check_features, parquet_lengths, write_file
from crossfeed.write.adopt.placement import Placement

log = logging.getLogger(__name__)


def index_parquet(
    place: Placement,
    groups: dict[str, list[str]],
    *,
    declared: dict[str, Feature],
    picked: list[str],
    unshaped: frozenset[str] = frozenset(),
    progress: Callable[[int], None] | None = None,
    lengths: tuple[str, ...] = (),
) -> tuple[Schema, dict[str, SplitInfo], dict]:
    """``(schema, splits, metadata)`` of the Parquet files ``groups`` (split → file names in
    ``place``'s data directory, which is only read); ``metadata``: what goes into the manifest's
    (the column maps of `crossfeed.format.parquet`, and ``inferred_types``: one line per column
    saying what was decided and why, also logged).

    ``declared`` features are read as declared and checked against every row (those named in
    ``unshaped`` were declared without a shape: they take the column's); ``picked`` names columns
    whose feature is inferred. With either given only those columns are indexed (a way round
    columns crossfeed cannot read); without, every column is.

    ``lengths``: list columns whose per-row lengths (from the list offsets) are written beside
    each file (``NAME.len`` in ``place.root``, `crossfeed.write.adopt.lengths`), once the schema
    says they are one-dimensional integer arrays.
    """
    pa, pq = pyarrow_modules()
    wanted = list(dict.fromkeys([*picked, *declared])) or None
    inferred: dict[str, Feature] = {}  # from the first file; every other file must agree
    types: dict = {}  # the Arrow type of each column, from the first file
    dims: dict[str, list] = {}  # list columns: the length at each level, merged over every file
    nulls: dict[str, int] = {}  # nulls counted in each column (footer statistics, else read)
    cats: dict[str, dict] = {}  # dictionary columns: their categories, in first-seen order
    first = None
    splits = {}
    sizes: dict[str, np.ndarray] = {}  # file -> (rows, len(lengths)): the lengths columns' list lengths
    for split, names in groups.items():
        shards = []
        for n in names:
            path = place.data_url(n)
            with place.open_bytes(n) as (buf, size, sha):
                arrow = is_arrow_name(n)  # an Arrow IPC file (HF datasets'): record batches are its row groups
                groups_ = () if arrow else footer_row_groups(buf, path)  # before pyarrow: it trusts a footer
                try:  # a local file by its path (pyarrow reads it), a remote one from the fetched bytes
                    if arrow:
                        pf = ArrowFile(buf if place.remote else path)
                        md = pf.metadata
                        counts = tuple(md.row_group(r).num_rows for r in range(md.num_row_groups))
                    else:
                        pf = pq.ParquetFile(pa.BufferReader(buf) if place.remote else path)
                        md = pf.metadata
                        counts = check_footer(groups_, md, path)
                    arrow_schema = pf.schema_arrow
                except (pa.ArrowException, OSError, UnicodeDecodeError, ValueError) as e:
                    kind = "Arrow IPC" if arrow else "Parquet"
                    raise CorruptRecordError(path, 0, f"not a readable {kind} file ({e})") from e
                with pf:
                    feats = _file_features(path, arrow_schema, wanted, declared, unshaped)
                    if first is None:
                        first, inferred = path, feats
                        types = {k: pf.schema_arrow.field(k).type for k in feats}
                    elif feats != inferred:
                        diff = sorted(k for k in set(feats) | set(inferred) if feats.get(k) != inferred.get(k))[:1]
                        k = diff[0]
                        raise SchemaError(
                            f"{path}: column {k!r} is {_show(feats.get(k))}, in {first} it is {_show(inferred.get(k))}; "
                            f"the files of a dataset share one schema (pick the common columns with --feature NAME)"
                        )
                    # nulls: counted from the footer's statistics (an Arrow file has none: read)
                    unknown = sorted(feats) if arrow else _count_nulls(groups_, set(feats), nulls)
                    lists = [
                        k
                        for k, f in feats.items()
                        if (k not in declared or k in unshaped) and f.codec.arrow == "tensor" and None in f.shape
                    ]
                    dicts = [k for k in feats if k not in declared and is_categorical(types[k])]
                    scan = list(dict.fromkeys([*lists, *dicts, *unknown]))
                    for r in range(md.num_row_groups):
                        where = f"{path}: row group {r}"
                        if scan:
                            table = _read(pa, pf, path, r, scan)
                            for k in scan:
                                arr = table.column(k).combine_chunks()
                                if k in lists:
                                    got = list_dims(arr)
                                    dims[k] = merge_dims(dims[k], got) if k in dims else got
                                if k in dicts:
                                    cats.setdefault(k, {}).update(dict.fromkeys(arr.dictionary.to_pylist()))
                                if k in unknown:
                                    nulls[k] = nulls.get(k, 0) + arr.null_count
                        if declared:
                            table = _read(pa, pf, path, r, list(declared))
                            for k in declared:  # nulls: NaN in a float, else a mask (`_decide`)
                                fill = None if is_float(feats[k]) else {"fill": True}
                                column_values(feats[k], table.column(k).combine_chunks(), where, fill)
                    missing = [k for k in lengths if k not in feats]
                    if missing:
                        raise SchemaError(f"{path}: --lengths {missing[0]}: no such column; it has {list(feats)}")
                    if lengths:
                        check_features(Schema(feats[k] for k in lengths), lengths, path)  # list columns only
                        sizes[n] = np.stack(
                            [parquet_lengths(pa, pf, path, k, lambda r, c: _read(pa, pf, path, r, c)) for k in lengths],
                            axis=1,
                        )
            shards.append(ShardInfo(n, sum(counts), size, sha, None, counts))
            if progress is not None:
                progress(size)
        splits[split] = SplitInfo(split, tuple(shards), format=FORMAT)
    features: list[Feature] = []
    maps: dict = {}
    lines: dict = {}
    for k, f in inferred.items():
        if k in dims:
            shape = tuple(d if d is not None and d >= 0 else None for d in dims[k])
            if None in shape[1:]:
                raise SchemaError(
                    f"{first}: column {k!r} is a list of lists whose inner lengths vary ({list(dims[k])}); crossfeed "
                    f"reads a list column as a tensor whose first dimension alone may vary; leave it out with --feature"
                )
            f = Feature(k, f.dtype, shape, f.encoding)
        made, how, lines[k] = _decide(pa, f, types[k], nulls.get(k, 0), list(cats.get(k, ())), k in declared)
        features += made
        maps.update(how)
    for line in lines.values():
        log.log(logging.WARNING if "null" in line else logging.INFO, "%s", line)
    meta: dict = {"inferred_types": lines}
    if maps:
        meta["parquet"] = {"columns": maps}
    schema = Schema(features)
    if lengths:
        check_features(schema, lengths, first or place.data)
        splits = {
            s: replace(
                info,
                shards=tuple(
                    replace(sh, lengths_sha256=write_file(place.root, sh.file, sizes[sh.file])) for sh in info.shards
                ),
            )
            for s, info in splits.items()
        }
    return schema, splits, meta


def _decide(pa, f: Feature, t, nulls: int, cats: list, declared: bool) -> tuple[list[Feature], dict, str]:
    """Column ``f.name``'s features (its own, and a mask where nulls need one), their maps (see
    `crossfeed.format.parquet`) and the line that says what was decided and why."""
    k = f.name
    kind = f"{f.encoding.value} {f.dtype}{list(f.shape)}" if f.codec.arrow == "tensor" else f.dtype
    line = f"{k}: {'declared ' if declared else ''}{kind} (Parquet {t})"
    how: dict = {}
    if declared:
        pass
    elif is_categorical(t):
        how = {"as": "codes", "class_names": cats}
        line = (
            f"{k}: int64 codes of {len(cats)} categories (Parquet {t}), the categories in the manifest "
            f"(class_names); --feature {k}=bytes:string (or the values' dtype) keeps the values"
        )
        if nulls:
            line += f"; {nulls} nulls are code -1 (as pandas' codes)"
        return [f], {k: how}, line
    elif pa.types.is_timestamp(t):
        how = {"as": "epoch", "unit": t.unit, "timezone": t.tz or None}
        zone = f"UTC, time zone {t.tz} in the manifest" if t.tz else "no time zone"
        line = f"{k}: int64 {_UNITS.get(t.unit, t.unit)} since 1970-01-01 (Parquet {t}; {zone}); unit in the manifest"
    elif f.dtype not in ("int64", "float32") and f.shape == () and f.codec.arrow == "tensor":
        line += ", dtype kept as stored"
    if not nulls:
        return [f], ({k: how} if how else {}), line
    if pa.types.is_floating(t) or is_float(f):
        return [f], ({k: how} if how else {}), f"{line}; {nulls} nulls become NaN"
    mask = Feature(f"{k}/valid", "bool", (), codecs.TENSOR)
    fill = '""' if f.codec.text else "False" if f.dtype == "bool" else "0"
    line += f"; {nulls} nulls read as {fill}, and mask feature {mask.name!r} is False there"
    line += (
        f"; --feature {k}=float64 makes them NaN instead" if pa.types.is_integer(t) else "; or fill them before writing"
    )
    return [f, mask], {k: {**how, "fill": True}, mask.name: {"column": k, "as": "valid"}}, line


_UNITS = {"s": "seconds", "ms": "milliseconds", "us": "microseconds", "ns": "nanoseconds"}


def _file_features(
    path: str, schema, wanted: list[str] | None, declared: dict[str, Feature], unshaped: frozenset[str]
) -> dict[str, Feature]:
    """The features of one file's columns (``wanted`` ones only), declared or inferred; every
    column crossfeed cannot read is named in one error."""
    names = schema.names
    if wanted is not None:
        missing = [k for k in wanted if k not in names]
        if missing:
            raise SchemaError(f"{path}: no column {missing[0]!r} (picked with --feature); the file has {names}")
    out, bad = {}, []
    for k in names if wanted is None else [k for k in names if k in wanted]:  # in the file's column order
        t = schema.field(k).type
        f = infer_feature(k, t, path)
        if k in declared:
            d = declared[k]
            if k in unshaped and f is not None and d.codec.arrow == "tensor":  # the column's shape
                d = Feature(k, d.dtype, f.shape, d.encoding)
            out[k] = d
        elif f is None:
            bad.append(f"{k!r} ({t})")
        else:
            out[k] = f
    if bad:
        raise SchemaError(
            f"{path}: column{'s' if len(bad) > 1 else ''} {', '.join(bad)} of no type crossfeed reads (numbers, lists "
            f"of numbers, binary, string, dictionaries, timestamps); pick the columns to read with --feature NAME "
            f"(inferred) or --feature NAME=ENCODING[:DTYPE[:SHAPE]] (declared): with any --feature, only those "
            f"columns are indexed"
        )
    return out


def _count_nulls(groups, names: set[str], nulls: dict[str, int]) -> list[str]:
    """Add the nulls that footer statistics count in each top-level column to ``nulls``; the
    columns some row group has no such statistics for (to be read and counted). The counts come
    from `footer_row_groups`: pyarrow's column-chunk metadata objects abort on some damaged footers."""
    unknown = set()
    for _, chunks in groups:
        for c in chunks:
            if c.path not in names:
                continue
            if c.null_count is not None:
                nulls[c.path] = nulls.get(c.path, 0) + c.null_count
            else:
                unknown.add(c.path)
    return sorted(unknown)


def _read(pa, pf, path: str, r: int, columns: list[str]):
    try:
        return pf.read_row_group(r, columns=columns)
    except (pa.ArrowException, OSError, UnicodeDecodeError, ValueError) as e:
        raise CorruptRecordError(path, 0, f"row group {r} does not decode ({e})") from e


def _show(f: Feature | None) -> str:
    if f is None:
        return "absent"
    return f"{f.encoding.value} {f.dtype}{list(f.shape)}" if f.codec is not codecs.INT64 else "int64"
