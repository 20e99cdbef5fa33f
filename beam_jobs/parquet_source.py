"""Parquet files (one file, or every ``.parquet`` under a directory); a work unit is one row
group, read with pyarrow. Integer and boolean columns are int64, floating columns float,
string columns string; ``types`` converts a column (e.g. a string column of numbers to int64, or
anything to string) and ``columns`` picks a subset. A null int64 value, or a value a conversion
cannot parse, is a bad row reported as ``file:row N`` under ``on_error``. Keys are ``<file>:<row>``.
"""

from __future__ import annotations

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
    parse_types,
    table_metadata,
    table_schema,
    vocabulary,
)
from crossfeed.errors import ConfigError
from crossfeed.format.schema import Schema


@dataclass(frozen=True)
class ParquetSource:
    root: str
    units_: tuple[tuple[str, int, int], ...]  # (file, row group, first row of the group)
    columns: tuple[tuple[str, ColumnType], ...]
    label: str | None = None
    on_error: ErrorPolicy = ErrorPolicy()
    classes: tuple[str, ...] | None = None  # a string label's vocabulary: stored as class indices
    num_rows: int = 0

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
        import pyarrow.parquet as pq

        root, files = list_files(src, (".parquet", ".pq"), "Parquet")
        declared = parse_types(types)
        units, first_schema, cols, rows = [], None, [], 0
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
                cols = [(n, declared.get(n) or _arrow_type(n, schema.field(n).type)) for n in names]
            else:
                for n, _ in cols:
                    if n not in schema.names or not schema.field(n).type.equals(first_schema.field(n).type):
                        raise ConfigError(f"{rel}: column {n!r} is missing or has another type than in {files[0]}")
            start = 0
            for g in range(meta.num_row_groups):
                units.append((rel, g, start))
                start += meta.metadata.row_group(g).num_rows
            rows += start
        table_schema(cols, label)  # validates the label
        classes = None
        if label is not None and label_classes and dict(cols)[label] is ColumnType.STRING:
            values: set[str] = set()
            for rel in files:  # the label column only: columnar, cheap
                column = pq.read_table(os.path.join(root, rel), columns=[label]).column(label)
                values.update("" if v is None else str(v) for v in column.to_pylist())
            classes = vocabulary(values, label)
        return cls(root, tuple(units), tuple(cols), label, on_error, classes, rows)

    @property
    def schema(self) -> Schema:
        return table_schema(list(self.columns), self.label, self.classes)

    @property
    def metadata(self) -> dict:
        return table_metadata("parquet", self.label, self.classes)

    def report(self) -> list[str]:
        """Column types (from the Parquet schema) and the label's classes."""
        lines = [f"{n}: {t.value} (Parquet type)" for n, t in self.columns]
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
        table = pq.ParquetFile(path).read_row_group(group, columns=[n for n, _ in self.columns])
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
        columns, keys = drop_rows(columns, keys, bad)
        if keys or skips.count:
            yield SampleBatch(f"parquet-{rel}-{group:06d}", keys, columns, skipped=skips.count)


def _arrow_type(name: str, t) -> ColumnType:
    import pyarrow as pa

    if pa.types.is_integer(t) or pa.types.is_boolean(t):
        return ColumnType.INT64
    if pa.types.is_floating(t):
        return ColumnType.FLOAT
    if (
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or (pa.types.is_dictionary(t) and (pa.types.is_string(t.value_type) or pa.types.is_large_string(t.value_type)))
    ):
        return ColumnType.STRING
    raise ConfigError(
        f"column {name!r} has Parquet type {t}, which is not int, float or string; "
        f"pass types={{{name!r}: 'string'}} (--types {name}:string) to store its text"
    )


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
    if typ is ColumnType.FLOAT:
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
