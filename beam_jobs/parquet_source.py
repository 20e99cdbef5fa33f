"""Parquet files (one file, or every ``.parquet`` under a directory); a work unit is one row
group, read with pyarrow.

Columns map to features exactly as ``crossfeed index`` maps them (one mapping:
`crossfeed.write.adopt.parquet.index_parquet` decides, `crossfeed.format.parquet.column_values`
reads): every dtype kept (float64 stays float64, int32 int32), a timestamp as int64 since the
epoch (unit and time zone in the manifest), a Categorical as int64 codes (the categories in the
manifest), a nullable integer column as its values and a mask feature ``<name>/valid``, lists of
numbers as tensors. ``types`` asks otherwise for a column (``int64``, ``float``/``float64``,
``float32`` — a narrowing, said in the summary and the manifest's ``narrowed`` — or ``string``):
a value such a conversion cannot parse is a bad row reported as ``file:row N`` under
``on_error``. ``columns`` picks a subset. Keys are ``<file>:<row>``.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass

import numpy as np

from crossfeed.beam_jobs.policy import ErrorPolicy, Skips
from crossfeed.beam_jobs.records import SampleBatch
from crossfeed.beam_jobs.sources import list_files
from crossfeed.beam_jobs.tabular import (
    ColumnType,
    convert_strings,
    drop_rows,
    encode_labels,
    feature_name,
    narrowed_lines,
    parse_types,
    table_metadata,
    table_schema,
    vocabulary,
)
from crossfeed.errors import ConfigError
from crossfeed.format.parquet import column_values
from crossfeed.format.schema import Feature, Schema
from crossfeed.io.files import map_file
from crossfeed.write.adopt.placement import Placement


@dataclass(frozen=True)
class ParquetSource:
    root: str
    units_: tuple[tuple[str, int, int], ...]  # (file, row group, first row of the group)
    columns: tuple[tuple[str, ColumnType], ...]  # the columns --types (or a string label) converts
    label: str | None = None
    on_error: ErrorPolicy = ErrorPolicy()
    classes: tuple[str, ...] | None = None  # a string label's vocabulary: stored as class indices
    num_rows: int = 0
    mapped: tuple[Feature, ...] = ()  # features of the other columns, as `crossfeed index` maps them
    maps_json: str = "{}"  # how each mapped feature is read from its column (`crossfeed.format.parquet`)
    order: tuple[str, ...] = ()  # the columns, in the file's order
    decided: tuple[tuple[str, str], ...] = ()  # (column, what the mapping decided and why)
    narrowed: tuple[tuple[str, str], ...] = ()  # (column, what was narrowed)

    @classmethod
    def scan(
        cls,
        src,
        *,
        columns=None,
        types=None,
        label: str | None = None,
        on_error: ErrorPolicy = ErrorPolicy(),
        label_classes: bool = True,
    ) -> ParquetSource:
        """``src``: a file, a folder, a glob pattern or a list of these. A string ``label`` column
        becomes class indices (vocabulary in the metadata) unless ``label_classes=False``."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        root, files = list_files(src, (".parquet", ".pq"), "Parquet")
        declared = parse_types(types)
        units, first_schema, names, rows = [], None, [], 0
        for rel in files:
            meta = pq.ParquetFile(os.path.join(root, rel))
            schema = meta.schema_arrow
            if first_schema is None:
                first_schema = schema
                names = (
                    [n.strip() for n in columns.split(",")]
                    if isinstance(columns, str)
                    else list(columns or schema.names)
                )
                for n in names:
                    if n not in schema.names:
                        raise ConfigError(f"{rel}: no column {n!r}; it has {schema.names}")
                unknown = set(declared) - set(names)
                if unknown:
                    raise ConfigError(f"types given for unknown columns {sorted(unknown)}; the columns are {names}")
            else:
                for n in names:
                    if n not in schema.names or not schema.field(n).type.equals(first_schema.field(n).type):
                        raise ConfigError(f"{rel}: column {n!r} is missing or has another type than in {files[0]}")
            start = 0
            for g in range(meta.num_row_groups):
                units.append((rel, g, start))
                start += meta.metadata.row_group(g).num_rows
            rows += start
        assert first_schema is not None
        if label is not None:
            if label not in names:
                raise ConfigError(f"label column {label!r} is not among the columns {names}")
            if "label" in names and label != "label":
                raise ConfigError(
                    f"--label {label!r} would be stored as 'label', but a column is already named 'label'"
                )
        typed = {n: declared[n] for n in names if n in declared}
        if label is not None and label_classes and label not in typed:
            t = first_schema.field(label).type
            if pa.types.is_string(t) or pa.types.is_large_string(t):  # class indices, the names in the manifest
                typed[label] = ColumnType.STRING
        mapped, maps, decided = _index_mapping(root, files, [n for n in names if n not in typed], label)
        classes = None
        if label is not None and typed.get(label) is ColumnType.STRING and label_classes:
            values: set[str] = set()
            for rel in files:  # the label column only: columnar, cheap
                column = pq.read_table(os.path.join(root, rel), columns=[label]).column(label)
                values.update("" if v is None else str(v) for v in column.to_pylist())
            classes = vocabulary(values, label)
        elif label is not None and maps.get("label", {}).get("as") == "codes":  # a Categorical label
            classes = tuple(str(c) for c in maps["label"].get("class_names") or ())
        cols = [(n, typed[n]) for n in names if n in typed]
        stored = {n: _dtype_name(first_schema.field(n).type) for n in typed}
        narrowed = narrowed_lines(cols, stored)
        return cls(
            root,
            tuple(units),
            tuple(cols),
            label,
            on_error,
            classes,
            rows,
            tuple(mapped),
            json.dumps(maps, sort_keys=True),
            tuple(names),
            tuple(decided.items()),
            tuple(narrowed.items()),
        )

    @property
    def maps(self) -> dict:
        return json.loads(self.maps_json)

    @property
    def schema(self) -> Schema:
        label = self.label if self.label in dict(self.columns) else None  # else a mapped column, named already
        typed = {f.name: f for f in table_schema(list(self.columns), label, self.classes)} if self.columns else {}
        by_column: dict[str, list[Feature]] = {}
        maps = self.maps
        for f in self.mapped:
            source = (maps.get(f.name) or {}).get("column", f.name)
            by_column.setdefault(source, []).append(f)
        feats: list[Feature] = []
        for n in self.order:
            name = feature_name(n, self.label)
            feats += [typed[name]] if name in typed else by_column.get(n, [])
        return Schema(feats)

    @property
    def metadata(self) -> dict:
        meta = table_metadata("parquet", self.label, self.classes, narrowed=dict(self.narrowed))
        if self.decided:
            meta["inferred_types"] = dict(self.decided)
        if self.maps:
            meta["parquet"] = {"columns": self.maps}  # as `crossfeed index` records them: units, zones, categories
        return meta

    def report(self) -> list[str]:
        """What each column became (the mapping `crossfeed index` uses, or --types), what was
        narrowed, and the label's classes."""
        lines = [f"{n}: {t.value} (--types)" for n, t in self.columns if n != self.label or self.classes is None]
        lines += [why for _, why in self.decided]
        lines += [why for _, why in self.narrowed]
        if self.classes is not None:
            lines.append(
                f"label {self.label!r}: {len(self.classes)} classes stored as indices; names in the manifest "
                f"(class_names); --no-label-classes keeps the strings"
            )
        return lines

    @property
    def num_samples(self) -> int:
        """Rows in all row groups (known from the Parquet metadata at scan time)."""
        return self.num_rows

    def describe(self) -> str:
        return f"Parquet {self.root} ({len(self.units_)} row groups)"

    def units(self) -> list[tuple[str, int, int]]:
        return list(self.units_)

    def read(self, unit):
        import pyarrow.parquet as pq

        rel, group, start = unit
        path = os.path.join(self.root, rel)
        maps = self.maps
        wanted = [n for n, _ in self.columns]
        wanted += [(maps.get(f.name) or {}).get("column", f.name) for f in self.mapped]
        table = pq.ParquetFile(path).read_row_group(group, columns=list(dict.fromkeys(wanted)))
        n = table.num_rows
        keys = [f"{rel}:{start + i}" for i in range(n)]
        skips = Skips(self.on_error)
        columns, bad = {}, set()
        for name, typ in self.columns:
            col: np.ndarray | list
            if self.classes is not None and name == self.label:
                col, errors = encode_labels(
                    ["" if v is None else str(v) for v in table.column(name).to_pylist()], self.classes, name
                )
            else:
                col, errors = _convert(table.column(name), typ, name)
            for i, why in sorted(errors.items()):
                if i not in bad:
                    skips.bad(f"{path}: row {start + i}: {why}")
                    bad.add(i)
            columns[feature_name(name, self.label)] = col
        where = f"{path}: row group {group}"
        for f in self.mapped:  # exactly the values `crossfeed index` reads from this row group
            how = maps.get(f.name) or {}
            arr = table.column(how.get("column", f.name)).combine_chunks()
            columns[f.name] = column_values(f, arr, where, how or None)
        columns, keys = drop_rows(columns, keys, bad)
        if keys or skips.count:
            yield SampleBatch(f"parquet-{rel}-{group:06d}", keys, columns, skipped=skips.count)


@dataclass(frozen=True)
class _Scan(Placement):
    """The files where they lie, for the mapping alone: not hashed (the conversion pins what it
    writes), only their footers and the columns the mapping needs are read."""

    @contextlib.contextmanager
    def open_bytes(self, name: str):
        with map_file(self.data_url(name)) as buf:
            yield buf, len(buf), ""


def _dtype_name(t) -> str:
    """A column's numpy dtype name (``float64`` for Arrow's double), or its Arrow type."""
    import pyarrow as pa

    return np.dtype(t.to_pandas_dtype()).name if pa.types.is_floating(t) or pa.types.is_integer(t) else str(t)


def _index_mapping(root: str, files: list[str], names: list[str], label: str | None):
    """The features, column maps and decisions of ``crossfeed index`` for columns ``names`` of
    the Parquet ``files`` (every file's footer checked; the columns read once where the mapping
    needs their values: list lengths, categories, nulls). The ``label`` column's features are
    named ``label`` (its maps name the column)."""
    if not names:
        return [], {}, {}
    from crossfeed.write.adopt.parquet import index_parquet

    place = _Scan(root, root)
    schema, _, meta = index_parquet(place, {"train": list(files)}, declared={}, picked=list(names))
    maps = dict((meta.get("parquet") or {}).get("columns") or {})
    decided = dict(meta.get("inferred_types") or {})
    feats = []
    for f in schema:
        if label is not None and f.name == label:
            maps["label"] = {**maps.pop(label, {}), "column": label}
            f = Feature("label", f.dtype, f.shape, f.encoding)
        feats.append(f)
    return feats, maps, decided


def _convert(column, typ: ColumnType, name: str) -> tuple[np.ndarray | list, dict[int, str]]:
    """An arrow column → a typed column and ``{row: why}`` for values that cannot be stored."""
    import pyarrow as pa

    t = column.type
    numeric = pa.types.is_integer(t) or pa.types.is_boolean(t) or pa.types.is_floating(t)
    if typ is ColumnType.STRING:
        return ["" if v is None else str(v) for v in column.to_pylist()], {}
    if not numeric:
        return convert_strings(["" if v is None else str(v) for v in column.to_pylist()], typ, name)
    nulls = column.is_null().to_numpy(zero_copy_only=False) if column.null_count else None
    if typ in (ColumnType.FLOAT, ColumnType.FLOAT32):  # float32: narrowed by the encoder, and said so
        arr = column.cast(pa.float64()).to_numpy(zero_copy_only=False)
        return np.where(nulls, np.nan, arr) if nulls is not None else arr, {}
    if pa.types.is_floating(t):
        vals = column.to_numpy(zero_copy_only=False)
        bad = {int(i): f"column {name!r}: {vals[i]!r} is not an int64" for i in np.flatnonzero(vals != np.floor(vals))}
        out = np.nan_to_num(vals).astype(np.int64)
    else:
        out, bad = column.cast(pa.int64()).fill_null(0).to_numpy(zero_copy_only=False), {}
    if nulls is not None:
        for i in np.flatnonzero(nulls).tolist():
            bad.setdefault(i, f"column {name!r}: null in an int64 column (declare it float to keep the row as NaN)")
    return out, bad
