"""Adopting Parquet files written by anyone (pyarrow, pandas, HF ``datasets.to_parquet``, Spark) in
place: the row groups and their row counts come from each file's footer, the features from its
columns (`crossfeed.format.parquet`); nothing is rewritten and no index file is written.

`index_parquet` is what ``crossfeed index DIR`` runs on a directory of ``*.parquet`` files. List
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

from collections.abc import Callable

from crossfeed.errors import CorruptRecordError, SchemaError
from crossfeed.format.manifest import ShardInfo, SplitInfo
from crossfeed.format.parquet import (
    FORMAT,
    check_footer,
    column_values,
    footer_row_groups,
    infer_feature,
    list_dims,
    merge_dims,
    pyarrow_modules,
)
from crossfeed.format.schema import Encoding, Feature, Schema
from crossfeed.write.adopt.placement import Placement


def index_parquet(
    place: Placement,
    groups: dict[str, list[str]],
    *,
    declared: dict[str, Feature],
    picked: list[str],
    progress: Callable[[int], None] | None = None,
) -> tuple[Schema, dict[str, SplitInfo]]:
    """``(schema, splits)`` of the Parquet files ``groups`` (split → file names in ``place``'s
    data directory, which is only read).

    ``declared`` features are read as declared and checked against every row; ``picked`` names
    columns whose feature is inferred. With either given only those columns are indexed (a way
    round columns crossfeed cannot read); without, every column is.
    """
    pa, pq = pyarrow_modules()
    wanted = list(dict.fromkeys([*picked, *declared])) or None
    inferred: dict[str, Feature] = {}  # from the first file; every other file must agree
    dims: dict[str, list] = {}  # list columns: the length at each level, merged over every file
    first = None
    splits = {}
    for split, names in groups.items():
        shards = []
        for n in names:
            path = place.data_url(n)
            with place.open_bytes(n) as (buf, size, sha):
                groups_ = footer_row_groups(buf, path)  # before pyarrow: it trusts what a footer says
                try:  # a local file by its path (pyarrow reads it), a remote one from the fetched bytes
                    pf = pq.ParquetFile(pa.BufferReader(buf) if place.remote else path)
                    md = pf.metadata
                    counts = check_footer(groups_, md, path)
                    arrow_schema = pf.schema_arrow
                except (pa.ArrowException, OSError, UnicodeDecodeError, ValueError) as e:
                    raise CorruptRecordError(path, 0, f"not a readable Parquet file ({e})") from e
                with pf:
                    feats = _file_features(path, arrow_schema, wanted, declared)
                    if first is None:
                        first, inferred = path, feats
                    elif feats != inferred:
                        diff = sorted(k for k in set(feats) | set(inferred) if feats.get(k) != inferred.get(k))[:1]
                        k = diff[0]
                        raise SchemaError(
                            f"{path}: column {k!r} is {_show(feats.get(k))}, in {first} it is {_show(inferred.get(k))}; "
                            f"the files of a dataset share one schema (pick the common columns with --feature NAME)"
                        )
                    _check_null_stats(path, groups_, set(feats))
                    lists = [
                        k
                        for k, f in feats.items()
                        if k not in declared and f.encoding is Encoding.TENSOR and None in f.shape
                    ]
                    for r in range(md.num_row_groups):
                        where = f"{path}: row group {r}"
                        if lists:
                            table = _read(pa, pf, path, r, lists)
                            for k in lists:
                                got = list_dims(table.column(k).combine_chunks())
                                dims[k] = merge_dims(dims[k], got) if k in dims else got
                        if declared:
                            table = _read(pa, pf, path, r, list(declared))
                            for k, f in declared.items():
                                column_values(f, table.column(k).combine_chunks(), where)
            shards.append(ShardInfo(n, sum(counts), size, sha, None, counts))
            if progress is not None:
                progress(size)
        splits[split] = SplitInfo(split, tuple(shards), format=FORMAT)
    features = []
    for k, f in inferred.items():
        if k in dims:
            shape = tuple(d if d is not None and d >= 0 else None for d in dims[k])
            if None in shape[1:]:
                raise SchemaError(
                    f"{first}: column {k!r} is a list of lists whose inner lengths vary ({list(dims[k])}); crossfeed "
                    f"reads a list column as a tensor whose first dimension alone may vary; leave it out with --feature"
                )
            f = Feature(k, f.dtype, shape, f.encoding)
        features.append(f)
    return Schema(features), splits


def _file_features(path: str, schema, wanted: list[str] | None, declared: dict[str, Feature]) -> dict[str, Feature]:
    """The features of one file's columns (``wanted`` ones only), declared or inferred."""
    names = schema.names
    if wanted is not None:
        missing = [k for k in wanted if k not in names]
        if missing:
            raise SchemaError(f"{path}: no column {missing[0]!r} (picked with --feature); the file has {names}")
    out = {}
    for k in names if wanted is None else [k for k in names if k in wanted]:  # in the file's column order
        if k in declared:
            out[k] = declared[k]
            continue
        t = schema.field(k).type
        f = infer_feature(k, t, path)
        if f is None:
            raise SchemaError(
                f"{path}: column {k!r} of type {t} is not a type crossfeed reads (numbers, lists of numbers, binary, "
                f"string); pick the columns to read with --feature NAME (inferred) or --feature NAME=ENCODING[:DTYPE"
                f"[:SHAPE]] (declared): with any --feature, only those columns are indexed"
            )
        out[k] = f
    return out


def _check_null_stats(path: str, groups, names: set[str]) -> None:
    """A top-level column whose footer statistics count nulls cannot be a feature (said at index
    time, without reading it; nested columns are checked when read). The counts come from
    `footer_row_groups`: pyarrow's column-chunk metadata objects abort on some damaged footers."""
    for r, (_, chunks) in enumerate(groups):
        for c in chunks:
            if c.path in names and c.null_count:
                raise SchemaError(
                    f"{path}: row group {r}: column {c.path!r} holds {c.null_count} null(s); crossfeed "
                    f"features have a value in every row: fill them (e.g. pandas fillna) or leave the column out "
                    f"(--feature NAME picks the columns to index)"
                )


def _read(pa, pf, path: str, r: int, columns: list[str]):
    try:
        return pf.read_row_group(r, columns=columns)
    except (pa.ArrowException, OSError, UnicodeDecodeError, ValueError) as e:
        raise CorruptRecordError(path, 0, f"row group {r} does not decode ({e})") from e


def _show(f: Feature | None) -> str:
    if f is None:
        return "absent"
    return f"{f.encoding.value} {f.dtype}{list(f.shape)}" if f.encoding is not Encoding.INT64 else "int64"
